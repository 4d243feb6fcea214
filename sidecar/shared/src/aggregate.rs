//! Per-second aggregation of a high-rate tenant's usage events (seed 003: "one message per API
//! request, or, for high-volume tenants, one batch per gateway replica per second"), off by
//! default (`usage.aggregate_above_rps = 0`): the message format and how it is made.
//!
//! Two halves, both pure (time is passed in):
//! - **At accept** (the sidecar's `usage::intake`): the sidecar counts each tenant's events as
//!   they arrive; an event of a tenant above `aggregate_above_rps` at this sidecar is *marked* for
//!   aggregation, and the mark is written into its spool line (`…,"aggregate":true}`,
//!   [`encode_line`]). The decision is thereby durable: it does not depend on anything held in
//!   memory or on the configuration in force when the segment is (re-)shipped.
//! - **At ship** ([`plan_segment`], here): the shipper turns one sealed segment into Kafka
//!   messages: unmarked lines as they are (one event each), marked ones combined per (tenant, UTC
//!   second of `startMs`) into [`UsageAggregate`]s, one row per (key, plan) with the counts and
//!   sums the billing rollup needs. The billing consumer reads the same [`UsageAggregate`].
//!
//! Invariants:
//! - A segment is immutable once sealed, and [`plan_segment`] is a function of its bytes alone:
//!   shipping the same segment again (a failed round, a crash between Kafka's ack and the delete)
//!   produces byte-identical aggregates, hence the same ids, and the billing consumer counts
//!   each once.
//! - An aggregate's id is derived from its content — its tenant, second and *the ids of the
//!   events it carries* — never from the segment's number: segment numbers restart at 1 when the
//!   spool is empty at start, so a number-based id could collide with a different, later
//!   aggregate and make the consumer drop it as a duplicate (a loss).
//! - The counts are exact: every marked event of a segment is in exactly one aggregate, once
//!   (an id repeated inside the segment — a batch the filter re-sent — is counted once).
//! - Everything of a tenant is keyed by the tenant, so aggregates share the tenant's partition;
//!   an aggregate is placed where its first event was in the segment.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use tollgate_wire::usage::{Day, UsageClass, UsageEvent};

/// The `schema` header (and message type) of an aggregate (docs/usage-events.md).
pub const SCHEMA: &str = "tollgate.usage.aggregate.v1";

/// At most this many (key, plan) rows in one aggregate (a message stays well under Kafka's 1 MB);
/// a second with more keys gets several aggregates.
pub const MAX_KEYS_PER_AGGREGATE: usize = 500;

/// What marks a spool line for aggregation (the line's closing brace is replaced by this).
const MARK: &[u8] = b",\"aggregate\":true}";

/// Requests per class, named as in the Redis meter and the `usage_daily` columns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassCounts {
    #[serde(default)]
    pub ok: u64,
    #[serde(default, rename = "4xx")]
    pub client_error: u64,
    #[serde(default, rename = "5xx")]
    pub server_error: u64,
    #[serde(default)]
    pub denied: u64,
    #[serde(default)]
    pub aborted: u64,
}

impl ClassCounts {
    pub fn add(&mut self, class: UsageClass, n: u64) {
        *self.slot(class) += n;
    }
    pub fn get(&self, class: UsageClass) -> u64 {
        match class {
            UsageClass::Ok => self.ok,
            UsageClass::ClientError => self.client_error,
            UsageClass::ServerError => self.server_error,
            UsageClass::Denied => self.denied,
            UsageClass::Aborted => self.aborted,
        }
    }
    fn slot(&mut self, class: UsageClass) -> &mut u64 {
        match class {
            UsageClass::Ok => &mut self.ok,
            UsageClass::ClientError => &mut self.client_error,
            UsageClass::ServerError => &mut self.server_error,
            UsageClass::Denied => &mut self.denied,
            UsageClass::Aborted => &mut self.aborted,
        }
    }
    pub fn total(&self) -> u64 {
        UsageClass::ALL.iter().fold(0u64, |sum, c| sum.saturating_add(self.get(*c)))
    }
}

/// One key's share of an aggregate: what the `usage_daily` row of (day, tenant, key) adds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyUsage {
    pub key_id: String,
    pub plan: String,
    /// Events (requests) of this key in the aggregate; equals `requests`' total.
    pub count: u64,
    pub requests: ClassCounts,
    #[serde(default)]
    pub tokens: u64,
    /// Events whose token usage could not be read (`UsageEvent::tokens_unread`, decision 183);
    /// absent: none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tokens_unread: u64,
    #[serde(default)]
    pub request_bytes: u64,
    #[serde(default)]
    pub response_bytes: u64,
}

/// The events of one tenant in one UTC second, as one message (`tollgate.usage.aggregate.v1`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageAggregate {
    /// `agg_` + 32 hex: derived from the tenant, the second and the ids of the events carried,
    /// the billing consumer's deduplication key.
    pub id: String,
    pub tenant: String,
    /// Start of the UTC second (ms since the Unix epoch) the events arrived in (their `startMs`);
    /// its day is the billing day.
    pub second_ms: u64,
    /// Events carried; equals the sum of the rows' counts.
    pub count: u64,
    pub keys: Vec<KeyUsage>,
}

impl UsageAggregate {
    pub fn day(&self) -> Day {
        Day::of_ms(self.second_ms)
    }

    /// Why a consumer must not count this aggregate (its counts do not add up …), if anything.
    pub fn invalid_reason(&self) -> Option<&'static str> {
        if !self.id.starts_with("agg_") || !(8..=64).contains(&self.id.len()) {
            return Some("id");
        }
        if crate::keys::Id::parse(&self.tenant).is_none() {
            return Some("tenant");
        }
        let key_ok = |k: &KeyUsage| {
            crate::keys::Id::parse(&k.key_id).is_some() && crate::keys::Id::parse(&k.plan).is_some() && k.count == k.requests.total()
                && k.tokens_unread <= k.count
        };
        if self.keys.is_empty() || !self.keys.iter().all(key_ok) {
            return Some("keys");
        }
        // a row sums its events' numbers, each at most MAX_COUNT: its own bound is count times
        // that (one bound for the row refused a whole second of a tenant's requests whose two
        // events carried an upstream's clamped 2^53 tokens; decision 189)
        let big = |n: u64, events: u64| n > events.saturating_mul(crate::events::MAX_COUNT);
        if big(self.count, 1) || self.keys.iter().any(|k| big(k.tokens, k.count) || big(k.request_bytes, k.count) || big(k.response_bytes, k.count)) {
            return Some("counts");
        }
        if self.second_ms > crate::events::MAX_TIME_MS {
            return Some("secondMs");
        }
        if self.keys.iter().fold(0u64, |sum, k| sum.saturating_add(k.count)) != self.count {
            return Some("count");
        }
        if !self.second_ms.is_multiple_of(1000) {
            return Some("secondMs");
        }
        None
    }
}

/// One event as a spool line (JSON + `\n`), marked for aggregation when `aggregate`.
pub fn encode_line(out: &mut Vec<u8>, e: &UsageEvent, aggregate: bool) {
    let start = out.len();
    if serde_json::to_writer(&mut *out, e).is_err() {
        out.truncate(start);
        return;
    }
    if aggregate && out.last() == Some(&b'}') {
        out.pop();
        out.extend_from_slice(MARK);
    }
    out.push(b'\n');
}

// ---- at ship: a segment into messages -----------------------------------------------------------

/// One Kafka message of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outgoing {
    /// Line `index` of the segment, as it is (one event), keyed by `tenant`.
    Line { index: usize, tenant: String },
    Aggregate(UsageAggregate),
}

/// A segment's messages, in order, and what they carry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SegmentPlan {
    pub messages: Vec<Outgoing>,
    /// Events sent one per message.
    pub single: u64,
    /// Events carried in aggregates.
    pub aggregated: u64,
    pub aggregates: u64,
    /// Marked lines whose id was already in an aggregate of this segment (a re-sent batch).
    pub duplicates: u64,
}

/// What the shipper reads of a spool line, borrowed from it: the key, the mark, and for a
/// marked line what the rollup needs. One parse per line.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Line<'a> {
    #[serde(default, borrow)]
    tenant: Cow<'a, str>,
    #[serde(default)]
    aggregate: bool,
    #[serde(default, borrow)]
    id: Cow<'a, str>,
    #[serde(default, borrow)]
    key_id: Cow<'a, str>,
    #[serde(default, borrow)]
    plan: Cow<'a, str>,
    #[serde(default)]
    status: u16,
    #[serde(default)]
    start_ms: u64,
    #[serde(default)]
    tokens: Option<u64>,
    #[serde(default)]
    tokens_unread: bool,
    #[serde(default)]
    request_bytes: Option<u64>,
    #[serde(default)]
    response_bytes: Option<u64>,
    #[serde(default)]
    denied: Option<serde::de::IgnoredAny>,
}

/// [`UsageEvent::class`] from the two fields it reads (kept equal by a test).
fn class_of(status: u16, denied: bool) -> UsageClass {
    if denied {
        return UsageClass::Denied;
    }
    match status {
        0 => UsageClass::Aborted,
        1..=399 => UsageClass::Ok,
        400..=499 => UsageClass::ClientError,
        _ => UsageClass::ServerError,
    }
}

struct Row<'a> {
    key_id: Cow<'a, str>,
    plan: Cow<'a, str>,
    count: u64,
    requests: ClassCounts,
    tokens: u64,
    tokens_unread: u64,
    request_bytes: u64,
    response_bytes: u64,
    /// The ids of the row's events, in segment order.
    ids: Sha256,
}

struct Bucket<'a> {
    tenant: Cow<'a, str>,
    second_ms: u64,
    rows: Vec<Row<'a>>,
    by_key: HashMap<(Cow<'a, str>, Cow<'a, str>), usize>,
}

enum Slot {
    Line(usize, String),
    Bucket(usize),
}

/// The messages of a segment's `lines` (complete JSON lines, in order): unmarked lines as they
/// are, marked ones combined per (tenant, second). A pure function of the lines.
pub fn plan_segment(lines: &[Vec<u8>]) -> SegmentPlan {
    let mut plan = SegmentPlan::default();
    let mut slots = Vec::with_capacity(lines.len());
    let mut buckets: Vec<Bucket<'_>> = Vec::new();
    let mut by_second: HashMap<(Cow<'_, str>, u64), usize> = HashMap::new();
    let mut seen: HashSet<Cow<'_, str>> = HashSet::new();
    for (index, bytes) in lines.iter().enumerate() {
        let line = match serde_json::from_slice::<Line<'_>>(bytes) {
            Ok(l) if l.aggregate && !l.id.is_empty() && !l.tenant.is_empty() => l,
            Ok(l) => {
                plan.single += 1;
                slots.push(Slot::Line(index, l.tenant.into_owned()));
                continue;
            }
            Err(_) => {
                plan.single += 1;
                slots.push(Slot::Line(index, String::new()));
                continue;
            }
        };
        if !seen.insert(line.id.clone()) {
            plan.duplicates += 1;
            continue;
        }
        let second_ms = line.start_ms / 1000 * 1000;
        let b = *by_second.entry((line.tenant.clone(), second_ms)).or_insert_with(|| {
            buckets.push(Bucket { tenant: line.tenant.clone(), second_ms, rows: Vec::new(), by_key: HashMap::new() });
            slots.push(Slot::Bucket(buckets.len() - 1));
            buckets.len() - 1
        });
        let bucket = &mut buckets[b];
        let r = *bucket.by_key.entry((line.key_id.clone(), line.plan.clone())).or_insert_with(|| {
            bucket.rows.push(Row {
                key_id: line.key_id.clone(),
                plan: line.plan.clone(),
                count: 0,
                requests: ClassCounts::default(),
                tokens: 0,
                tokens_unread: 0,
                request_bytes: 0,
                response_bytes: 0,
                ids: Sha256::new(),
            });
            bucket.rows.len() - 1
        });
        let row = &mut bucket.rows[r];
        row.count += 1;
        row.requests.add(class_of(line.status, line.denied.is_some()), 1);
        // saturating, and tokens clamped: a spool line is bytes from disk, its numbers are not
        // trusted to sum within u64 (found by fuzzing, `spool_lines`; a wrapped sum would bill too little)
        row.tokens = row.tokens.saturating_add(line.tokens.unwrap_or(0).min(tollgate_wire::usage::MAX_TOKENS));
        row.tokens_unread += u64::from(line.tokens_unread);
        row.request_bytes = row.request_bytes.saturating_add(line.request_bytes.unwrap_or(0));
        row.response_bytes = row.response_bytes.saturating_add(line.response_bytes.unwrap_or(0));
        row.ids.update(line.id.as_bytes());
        row.ids.update(b"\n");
        plan.aggregated += 1;
    }
    let mut buckets: Vec<Option<Bucket<'_>>> = buckets.into_iter().map(Some).collect();
    for slot in slots {
        match slot {
            Slot::Line(index, tenant) => plan.messages.push(Outgoing::Line { index, tenant }),
            Slot::Bucket(i) => {
                let Some(mut bucket) = buckets[i].take() else { continue };
                bucket.rows.sort_by(|a, b| (&a.key_id, &a.plan).cmp(&(&b.key_id, &b.plan)));
                let rows: Vec<(KeyUsage, [u8; 32])> = bucket
                    .rows
                    .into_iter()
                    .map(|r| {
                        let usage = KeyUsage {
                            key_id: r.key_id.into_owned(),
                            plan: r.plan.into_owned(),
                            count: r.count,
                            requests: r.requests,
                            tokens: r.tokens,
                            tokens_unread: r.tokens_unread,
                            request_bytes: r.request_bytes,
                            response_bytes: r.response_bytes,
                        };
                        (usage, r.ids.finalize().into())
                    })
                    .collect();
                for chunk in rows.chunks(MAX_KEYS_PER_AGGREGATE) {
                    let digests: Vec<[u8; 32]> = chunk.iter().map(|(_, d)| *d).collect();
                    let keys: Vec<KeyUsage> = chunk.iter().map(|(k, _)| k.clone()).collect();
                    plan.aggregates += 1;
                    plan.messages.push(Outgoing::Aggregate(UsageAggregate {
                        id: aggregate_id(&bucket.tenant, bucket.second_ms, &digests),
                        tenant: bucket.tenant.to_string(),
                        second_ms: bucket.second_ms,
                        count: keys.iter().map(|k| k.count).sum(),
                        keys,
                    }));
                }
            }
        }
    }
    plan
}

/// `agg_` + the first 128 bits (hex) of sha256(tenant, second, the digests of each row's event
/// ids): the same events (in the same order, as a re-read segment has them) give the same id,
/// different ones (practically) never.
pub fn aggregate_id(tenant: &str, second_ms: u64, row_digests: &[[u8; 32]]) -> String {
    let mut h = Sha256::new();
    h.update(tenant.as_bytes());
    h.update(b"\n");
    h.update(second_ms.to_string().as_bytes());
    h.update(b"\n");
    for d in row_digests {
        h.update(d);
    }
    let digest = h.finalize();
    let mut out = String::with_capacity(36);
    out.push_str("agg_");
    for b in &digest[..16] {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_764_460_800_000; // 2025-11-30T00:00:00Z

    fn ev(id: &str, tenant: &str, key: &str, status: u16, start_ms: u64) -> UsageEvent {
        UsageEvent {
            id: id.into(),
            tenant: tenant.into(),
            key_id: key.into(),
            plan: "gold".into(),
            method: "GET".into(),
            authority: "api.test".into(),
            path: "/v1".into(),
            status,
            start_ms,
            duration_ms: 1,
            tokens: Some(3),
            request_bytes: Some(10),
            response_bytes: Some(100),
            ..UsageEvent::default()
        }
    }

    fn lines(events: &[UsageEvent], marks: &[bool]) -> Vec<Vec<u8>> {
        events
            .iter()
            .zip(marks)
            .map(|(e, m)| {
                let mut out = Vec::new();
                encode_line(&mut out, e, *m);
                assert_eq!(out.pop(), Some(b'\n'));
                out
            })
            .collect()
    }

    #[test]
    fn a_marked_line_is_still_the_event_with_one_more_field() {
        let e = ev("0123456789", "acme", "k", 200, SEC);
        let mut out = Vec::new();
        encode_line(&mut out, &e, true);
        encode_line(&mut out, &e, false);
        let text = String::from_utf8(out).unwrap();
        let ls: Vec<&str> = text.lines().collect();
        assert!(ls[0].ends_with(r#","aggregate":true}"#), "{}", ls[0]);
        assert!(!ls[1].contains("aggregate"));
        for l in ls {
            assert_eq!(serde_json::from_str::<UsageEvent>(l).unwrap(), e);
        }
    }

    #[test]
    fn marked_events_are_combined_per_tenant_and_second_with_exact_sums_per_key() {
        let mut events = vec![
            ev("e0000001", "cold", "k1", 200, SEC + 5),
            ev("e0000002", "hot", "k1", 200, SEC + 10),
            ev("e0000003", "hot", "k1", 404, SEC + 999),
            ev("e0000004", "hot", "k2", 503, SEC + 500),
            ev("e0000005", "hot", "k1", 200, SEC + 1000), // the next second
            ev("e0000006", "hot", "k1", 200, SEC + 20),   // unmarked: single
        ];
        let mut denied = ev("e0000007", "hot", "k2", 429, SEC + 30);
        denied.denied = Some("rate_limited".into());
        denied.tokens = None;
        events.push(denied);
        let marks = [false, true, true, true, true, false, true];
        let plan = plan_segment(&lines(&events, &marks));
        assert_eq!((plan.single, plan.aggregated, plan.aggregates, plan.duplicates), (2, 5, 2, 0));
        let kinds: Vec<String> = plan
            .messages
            .iter()
            .map(|m| match m {
                Outgoing::Line { index, tenant } => format!("line{index}:{tenant}"),
                Outgoing::Aggregate(a) => format!("agg:{}:{}", a.tenant, a.second_ms - SEC),
            })
            .collect();
        // in the order of each message's first event
        assert_eq!(kinds, ["line0:cold", "agg:hot:0", "agg:hot:1000", "line5:hot"]);
        let Outgoing::Aggregate(a) = &plan.messages[1] else { panic!() };
        assert_eq!(a.count, 4);
        assert_eq!(a.invalid_reason(), None);
        assert_eq!(a.day().iso(), "2025-11-30");
        let k1 = a.keys.iter().find(|k| k.key_id == "k1").unwrap();
        assert_eq!((k1.count, k1.requests.ok, k1.requests.client_error, k1.tokens, k1.request_bytes, k1.response_bytes), (2, 1, 1, 6, 20, 200));
        let k2 = a.keys.iter().find(|k| k.key_id == "k2").unwrap();
        assert_eq!((k2.requests.server_error, k2.requests.denied, k2.tokens), (1, 1, 3));
        // the JSON names the classes as the meter and the rollup do
        let json = serde_json::to_string(a).unwrap();
        assert!(json.contains(r#""requests":{"ok":0,"4xx":0,"5xx":1,"denied":1,"aborted":0}"#), "{json}");
        assert_eq!(serde_json::from_str::<UsageAggregate>(&json).unwrap(), *a);
    }

    #[test]
    fn the_same_segment_plans_to_the_same_aggregates_and_other_events_to_other_ids() {
        let events: Vec<UsageEvent> = (0..50).map(|i| ev(&format!("e{i:07}"), "hot", &format!("k{}", i % 3), 200, SEC + i)).collect();
        let l = lines(&events, &[true; 50]);
        let (a, b) = (plan_segment(&l), plan_segment(&l));
        assert_eq!(a, b, "deterministic: a re-shipped segment gives the same ids");
        let Outgoing::Aggregate(first) = &a.messages[0] else { panic!() };
        assert_eq!(first.count, 50);
        // one event fewer (another segment of the same second): another id
        let c = plan_segment(&l[1..]);
        let Outgoing::Aggregate(other) = &c.messages[0] else { panic!() };
        assert_ne!(first.id, other.id);
        // one event of another key fewer: another id too (every row's ids are in it)
        let without: Vec<Vec<u8>> = l.iter().enumerate().filter(|(i, _)| *i != 49).map(|(_, x)| x.clone()).collect();
        let Outgoing::Aggregate(other) = &plan_segment(&without).messages[0] else { panic!() };
        assert_ne!(first.id, other.id);
        assert_eq!(first.id.len(), 36);
        assert!(first.id.starts_with("agg_"));
    }

    #[test]
    fn an_id_repeated_in_a_segment_is_counted_once() {
        let e = ev("e0000001", "hot", "k", 200, SEC);
        let plan = plan_segment(&lines(&[e.clone(), e.clone(), ev("e0000002", "hot", "k", 200, SEC)], &[true; 3]));
        assert_eq!((plan.aggregated, plan.duplicates), (2, 1));
        let Outgoing::Aggregate(a) = &plan.messages[0] else { panic!() };
        assert_eq!(a.count, 2);
    }

    #[test]
    fn many_keys_split_into_several_aggregates_that_add_up() {
        let n = MAX_KEYS_PER_AGGREGATE * 2 + 7;
        let events: Vec<UsageEvent> = (0..n).map(|i| ev(&format!("e{i:07}"), "hot", &format!("k{i:05}"), 200, SEC)).collect();
        let plan = plan_segment(&lines(&events, &vec![true; n]));
        assert_eq!(plan.aggregates, 3);
        let aggs: Vec<&UsageAggregate> =
            plan.messages.iter().filter_map(|m| if let Outgoing::Aggregate(a) = m { Some(a) } else { None }).collect();
        assert_eq!(aggs.iter().map(|a| a.count).sum::<u64>(), n as u64);
        assert_eq!(aggs.iter().map(|a| a.id.clone()).collect::<HashSet<_>>().len(), 3);
        assert!(aggs.iter().all(|a| a.invalid_reason().is_none() && a.keys.len() <= MAX_KEYS_PER_AGGREGATE));
    }

    #[test]
    fn the_shipper_classes_events_as_the_rollup_does() {
        for status in [0, 1, 200, 304, 399, 400, 404, 429, 499, 500, 503, 999] {
            for denied in [false, true] {
                let mut e = ev("e0000001", "t", "k", status, SEC);
                e.denied = denied.then(|| "rate_limited".to_string());
                assert_eq!(class_of(status, denied), e.class(), "{status} {denied}");
            }
        }
    }

    #[test]
    fn unmarked_and_unreadable_lines_go_as_they_are() {
        let l = vec![b"{\"tenant\":\"x\",\"odd\":1}".to_vec(), b"{\"tenant\":\"y\",\"aggregate\":true}".to_vec()];
        let plan = plan_segment(&l);
        assert_eq!(
            plan.messages,
            [Outgoing::Line { index: 0, tenant: "x".into() }, Outgoing::Line { index: 1, tenant: "y".into() }]
        );
        assert_eq!((plan.single, plan.aggregated), (2, 0));
    }

    #[test]
    fn aggregates_that_do_not_add_up_are_invalid() {
        let events: Vec<UsageEvent> = (0..3).map(|i| ev(&format!("e{i:07}"), "hot", "k", 200, SEC)).collect();
        let Outgoing::Aggregate(good) = plan_segment(&lines(&events, &[true; 3])).messages.remove(0) else { panic!() };
        type Change = Box<dyn Fn(&mut UsageAggregate)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|a| a.count += 1), "count"),
            (Box::new(|a| a.keys[0].count += 1), "keys"),
            (Box::new(|a| a.keys.clear()), "keys"),
            (Box::new(|a| a.id = "e0000001".into()), "id"),
            (Box::new(|a| a.tenant.clear()), "tenant"),
            (Box::new(|a| a.second_ms += 1), "secondMs"),
            (Box::new(|a| a.keys[0].tokens_unread = a.keys[0].count + 1), "keys"),
            (Box::new(|a| a.keys[0].tokens = 3 * crate::events::MAX_COUNT + 1), "counts"),
        ];
        for (change, reason) in cases {
            let mut a = good.clone();
            change(&mut a);
            assert_eq!(a.invalid_reason(), Some(reason));
        }
    }

    /// Decision 183: the events whose token usage could not be read are counted per key, and an
    /// aggregate without any says nothing of them (its bytes as before).
    #[test]
    fn unread_token_usage_is_counted_per_key() {
        let mut events: Vec<UsageEvent> = (0..4).map(|i| ev(&format!("e{i:07}"), "hot", "k", 200, SEC)).collect();
        for e in &mut events[1..3] {
            e.tokens = None;
            e.tokens_unread = true;
        }
        let Outgoing::Aggregate(a) = plan_segment(&lines(&events, &[true; 4])).messages.remove(0) else { panic!() };
        assert_eq!((a.keys[0].count, a.keys[0].tokens, a.keys[0].tokens_unread), (4, 6, 2));
        assert_eq!(a.invalid_reason(), None);
        let back: UsageAggregate = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back, a);
        let Outgoing::Aggregate(none) = plan_segment(&lines(&events[..1], &[true])).messages.remove(0) else { panic!() };
        assert!(!serde_json::to_string(&none).unwrap().contains("tokensUnread"));
    }
}
