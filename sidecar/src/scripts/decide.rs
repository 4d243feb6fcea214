//! `sidecar/lua/decide.lua`: every limit of one request, check-all-then-take-all, an optional
//! lease and an optional response lookup — one atomic script call, one round trip.
//!
//! [`DecideCall`] is the call in the script's terms (which keys each kind of limit touches, what
//! its window means); [`DecideCall::encode`] lays it out as the contract at the top of
//! `decide.lua` says, and [`parse`] reads the reply back into a [`DecideReply`]. Callers never
//! see an offset.

use super::call::{BadReply, Invocation, ScriptError};
use crate::keys::{
    BudgetCounter, ConcurrencyKey, DecisionRecordKey, FixedWindowKey, Id, IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest, ReservationKey,
    ResponseCacheKey, ResponsesBytesKey, ResponsesLiveKey, SlidingLogKey, SlidingWindowKey, TokenBucketKey,
};
use crate::store::Store;
use std::sync::LazyLock;

/// `ledger.lua` first: an idempotency claim reads its tenant's ledger (decision 185).
pub(super) static SCRIPT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(concat!(include_str!("../../lua/ledger.lua"), include_str!("../../lua/decide.lua"))));

/// ARGV per limit (kind, limit, window, cost, shadow, aux).
const ARGS_PER_LIMIT: usize = 6;

/// The lease share the script assumes when no lease is asked (`decide.lua`'s default).
const DEFAULT_SHARE: u64 = 2;

/// One limit to check, and take from when every limit passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitCheck {
    /// Max per window / bucket capacity / monthly budget / max in flight.
    pub limit: u64,
    /// Units this request takes (a budget: the tokens reserved; a concurrency limit: 1).
    pub cost: u64,
    /// Count a would-deny, never block.
    pub shadow: bool,
    pub kind: Check,
}

/// What kind of limit, with the keys it touches (all carry the tenant's hash tag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// `INCRBY` a counter of the current window (TTL 2 × window).
    Fixed { key: FixedWindowKey, window_ms: u64 },
    /// The current bucket plus the previous one, weighted.
    Sliding { current: SlidingWindowKey, previous: SlidingWindowKey, window_ms: u64 },
    /// Refill, check and take; `refill_ms`: from empty to full.
    Bucket { key: TokenBucketKey, refill_ms: u64 },
    /// A zset of request timestamps.
    Log { key: SlidingLogKey, window_ms: u64 },
    /// A period's counter — a month's tokens, or a month's or day's micro-units of money (TTL
    /// `counter_ttl_ms`, the period ends in `period_left_ms`) — and the request's reservation
    /// (TTL `reservation_ttl_ms`).
    Budget { counter: BudgetCounter, reservation: ReservationKey, reservation_ttl_ms: u64, counter_ttl_ms: u64, period_left_ms: u64 },
    /// A zset of in-flight request ids; a slot lives `slot_timeout_ms` without a completion.
    Concurrency { key: ConcurrencyKey, slot_timeout_ms: u64 },
}

/// A lease asked in the same call (leased limits only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Units asked beyond the request's own (0: none).
    pub want: u64,
    /// The call admits no request itself (its own cost is 0): a renewal off the request path.
    pub renewal: bool,
    /// A lease takes at most 1/share of what each limit has left after the request.
    pub share: u64,
}

/// The one response lookup a decision may carry (issue 7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// `GET` the cached response, only when the limits allow.
    Cache { key: ResponseCacheKey },
    /// Claim the idempotency key for this request's operation, or find its replay, its owner, or
    /// that it is in flight.
    Idempotency {
        owner: IdempotencyOwnerKey,
        memo: IdempotencyMemoKey,
        digest: RequestDigest,
        /// The claim token (the in-flight marker is `inflight:<token>`).
        token: String,
        in_flight_ttl_ms: u64,
        owner_ttl_ms: u64,
        /// The tenant's ledger of stored bytes, and its bound: a new claim is refused while the
        /// ledger holds that much (decision 185).
        live: ResponsesLiveKey,
        bytes: ResponsesBytesKey,
        bound: u64,
    },
}

/// Where an allowed decision records what it took, for its refund (issue 15.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// `dec:{tenant}:<decisionId>`.
    pub key: DecisionRecordKey,
    pub ttl_ms: u64,
}

/// One `decide.lua` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecideCall {
    /// The sidecar's clock (tests drive it).
    pub now_ms: u64,
    /// A log/concurrency member and the reservation's owner.
    pub request_id: Id,
    pub limits: Vec<LimitCheck>,
    pub lease: Option<Lease>,
    pub lookup: Option<Lookup>,
    /// Record what an allowed decision takes (only for decisions the filter named: it can report
    /// them abandoned).
    pub record: Option<Record>,
}

impl DecideCall {
    /// KEYS and ARGV, in the order of `decide.lua`'s contract.
    pub fn encode(&self) -> (Vec<String>, Vec<String>) {
        let mut keys = Vec::with_capacity(self.limits.len() + 2);
        let mut args = Vec::with_capacity(3 + ARGS_PER_LIMIT * self.limits.len() + 8);
        args.extend([self.now_ms.to_string(), self.request_id.to_string(), self.limits.len().to_string()]);
        for l in &self.limits {
            let (kind, window, aux) = match &l.kind {
                Check::Fixed { key, window_ms } => {
                    keys.push(key.as_str().to_string());
                    ("fixed", *window_ms, String::new())
                }
                Check::Sliding { current, previous, window_ms } => {
                    keys.extend([current.as_str().to_string(), previous.as_str().to_string()]);
                    ("sliding", *window_ms, String::new())
                }
                Check::Bucket { key, refill_ms } => {
                    keys.push(key.as_str().to_string());
                    ("bucket", *refill_ms, String::new())
                }
                Check::Log { key, window_ms } => {
                    keys.push(key.as_str().to_string());
                    ("log", *window_ms, String::new())
                }
                Check::Budget { counter, reservation, reservation_ttl_ms, counter_ttl_ms, period_left_ms } => {
                    keys.extend([counter.as_str().to_string(), reservation.as_str().to_string()]);
                    ("budget", *reservation_ttl_ms, format!("{counter_ttl_ms}:{period_left_ms}"))
                }
                Check::Concurrency { key, slot_timeout_ms } => {
                    keys.push(key.as_str().to_string());
                    ("conc", *slot_timeout_ms, String::new())
                }
            };
            args.extend([
                kind.to_string(),
                l.limit.to_string(),
                window.to_string(),
                l.cost.to_string(),
                if l.shadow { "1" } else { "0" }.to_string(),
                aux,
            ]);
        }
        // The lease's three arguments come next; a lookup's follow them, then the record's, so
        // with a lookup or a record they are present even when no lease is asked.
        let lease = match (self.lease, self.lookup.is_some() || self.record.is_some()) {
            (Some(l), _) => Some(l),
            (None, true) => Some(Lease { want: 0, renewal: false, share: DEFAULT_SHARE }),
            (None, false) => None,
        };
        if let Some(l) = lease {
            args.extend([l.want.to_string(), if l.renewal { "1" } else { "0" }.to_string(), l.share.to_string()]);
        }
        match &self.lookup {
            None if self.record.is_some() => args.push("none".into()),
            None => {}
            Some(Lookup::Cache { key }) => {
                keys.push(key.as_str().to_string());
                args.push("cache".into());
            }
            Some(Lookup::Idempotency { owner, memo, digest, token, in_flight_ttl_ms, owner_ttl_ms, live, bytes, bound }) => {
                keys.extend([owner.as_str(), memo.as_str(), live.as_str(), bytes.as_str()].map(String::from));
                args.extend([
                    "idem".to_string(),
                    digest.as_str().to_string(),
                    token.clone(),
                    in_flight_ttl_ms.to_string(),
                    owner_ttl_ms.to_string(),
                    bound.to_string(),
                ]);
            }
        }
        if let Some(r) = &self.record {
            keys.push(r.key.as_str().to_string());
            args.push(r.ttl_ms.to_string());
        }
        (keys, args)
    }
}

/// One limit's state after the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// Units left after this request and its lease (or now, when denied).
    pub remaining: u64,
    /// Until the limit frees up (for a denial: the Retry-After).
    pub reset_ms: u64,
    pub would_deny: bool,
}

/// What the response lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Cache hit: the stored response JSON.
    Hit(String),
    Miss,
    /// Idempotent replay: the stored response JSON.
    Replay(String),
    /// The key is now this request's (owner set, in-flight marker set).
    Claimed,
    /// Another request with this key and operation is in flight (409; nothing taken).
    InFlight,
    /// The key is held by a different operation (422; nothing taken).
    Conflict,
    /// The tenant's stored responses are at its bound (decision 185): not claimed, nothing taken;
    /// room again in this many ms at the soonest.
    Full(u64),
}

/// The script's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecideReply {
    /// Index (into the call's limits) of the limit that denied.
    pub denied: Option<usize>,
    /// Per limit, in the call's order.
    pub states: Vec<LimitState>,
    /// Lease units taken (beyond the request's own cost) from every limit.
    pub granted: u64,
    /// With a lookup and the limits passing.
    pub outcome: Option<Outcome>,
}

/// Runs the call: one round trip, within `deadline`.
pub async fn run(store: &Store, call: &DecideCall, deadline: std::time::Duration) -> Result<DecideReply, ScriptError> {
    let (keys, args) = call.encode();
    let values: Vec<redis::Value> = Invocation { script: &SCRIPT, op: "decide_lua", keys, args }.run(store, Some(deadline)).await?;
    Ok(parse(&values, call.limits.len())?)
}

/// Reads the reply to a call with `n` limits: `{allowed, denied_index, (remaining, reset_ms,
/// would_deny) × n, granted}`, then, with a lookup's outcome, `outcome, value`.
pub fn parse(values: &[redis::Value], n: usize) -> Result<DecideReply, BadReply> {
    let bad = |m: String| BadReply::new("decide.lua", m);
    let text = |v: &redis::Value| -> Option<String> {
        match v {
            redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    };
    let mut numbers = Vec::with_capacity(values.len());
    let mut strings = Vec::new();
    for v in values {
        match v {
            redis::Value::Int(i) if strings.is_empty() => numbers.push(*i),
            other => strings.push(text(other).ok_or_else(|| bad(format!("returned an unexpected value {other:?}")))?),
        }
    }
    let outcome = match strings.as_slice() {
        [] => None,
        [o, v] => Some(match o.as_str() {
            "hit" => Outcome::Hit(v.clone()),
            "miss" => Outcome::Miss,
            "replay" => Outcome::Replay(v.clone()),
            "claimed" => Outcome::Claimed,
            "in_flight" => Outcome::InFlight,
            "conflict" => Outcome::Conflict,
            "full" => Outcome::Full(v.parse().map_err(|_| bad(format!("returned full with {v:?}")))?),
            other => return Err(bad(format!("returned an unknown lookup outcome {other:?}"))),
        }),
        _ => return Err(bad(format!("returned {} trailing values", strings.len()))),
    };
    if numbers.len() != 3 + 3 * n {
        return Err(bad(format!("returned {} values for {n} limits", numbers.len())));
    }
    let granted = numbers[2 + 3 * n];
    if granted < 0 || (granted > 0 && numbers[0] != 1) {
        return Err(bad(format!("granted {granted} with allowed={}", numbers[0])));
    }
    let denied = match (numbers[0], numbers[1]) {
        (1, 0) => None,
        (0, i) if i >= 1 && (i as usize) <= n => Some(i as usize - 1),
        (a, d) => return Err(bad(format!("returned allowed={a} denied={d}"))),
    };
    let states = numbers[2..2 + 3 * n]
        .chunks(3)
        .map(|c| LimitState { remaining: c[0].max(0) as u64, reset_ms: c[1].max(0) as u64, would_deny: c[2] == 1 })
        .collect();
    Ok(DecideReply { denied, states, granted: granted as u64, outcome })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{CacheHash, IdemKey, Subject, TokenBudgetKey};
    use redis::Value::{BulkString, Int};

    fn id(s: &str) -> Id {
        Id::parse(s).unwrap()
    }

    fn call(limits: Vec<LimitCheck>) -> DecideCall {
        DecideCall { now_ms: 1_000, request_id: id("req-1"), limits, lease: None, lookup: None, record: None }
    }

    fn fixed(limit: u64) -> LimitCheck {
        let key = FixedWindowKey::new(&id("acme"), &id("pm"), &Subject::tenant(), 7);
        LimitCheck { limit, cost: 1, shadow: false, kind: Check::Fixed { key, window_ms: 60_000 } }
    }

    #[test]
    fn every_kind_lays_out_its_keys_and_six_arguments() {
        let (t, l, s) = (id("acme"), id("l"), Subject::tenant());
        let budget = Check::Budget {
            counter: TokenBudgetKey::new(&t, &l, &s, 202511).into(),
            reservation: ReservationKey::new(&t, &l, &s, &id("req-1")),
            reservation_ttl_ms: 300_000,
            counter_ttl_ms: 9,
            period_left_ms: 8,
        };
        let limits = vec![
            LimitCheck { limit: 10, cost: 1, shadow: true, kind: Check::Sliding { current: SlidingWindowKey::new(&t, &l, &s, 2), previous: SlidingWindowKey::new(&t, &l, &s, 1), window_ms: 500 } },
            LimitCheck { limit: 5000, cost: 50, shadow: false, kind: budget },
            LimitCheck { limit: 2, cost: 1, shadow: false, kind: Check::Concurrency { key: ConcurrencyKey::new(&t, &l, &s), slot_timeout_ms: 300_000 } },
        ];
        let (keys, args) = call(limits).encode();
        assert_eq!(keys, ["rate:{acme}:l:t:2", "rate:{acme}:l:t:1", "q:tokens:{acme}:l:t:202511", "q:reserved:{acme}:l:t:req-1", "q:conc:{acme}:l:t"]);
        assert_eq!(&args[..3], ["1000", "req-1", "3"]);
        assert_eq!(args.len(), 3 + 3 * ARGS_PER_LIMIT, "no lease, no lookup: nothing after the limits");
        assert_eq!(&args[3..9], ["sliding", "10", "500", "1", "1", ""]);
        assert_eq!(&args[9..15], ["budget", "5000", "300000", "50", "0", "9:8"]);
        assert_eq!(&args[15..21], ["conc", "2", "300000", "1", "0", ""]);
    }

    #[test]
    fn a_lookup_follows_the_lease_arguments_present_or_not() {
        let (t, k) = (id("acme"), id("key_1"));
        let cache = Lookup::Cache { key: ResponseCacheKey::new(&t, &id("gold"), &id("chat"), &CacheHash::parse(&"cd".repeat(32)).unwrap()) };
        let (keys, args) = DecideCall { lookup: Some(cache), ..call(vec![fixed(5)]) }.encode();
        assert_eq!(keys[1], format!("cache:exact:{{acme}}:gold:chat:{}", "cd".repeat(32)));
        assert_eq!(&args[9..], ["0", "0", "2", "cache"], "a = 7 + 6n: the lease's place is filled");

        let lease = Lease { want: 40, renewal: true, share: 3 };
        let (_, args) = DecideCall { lease: Some(lease), ..call(vec![fixed(5)]) }.encode();
        assert_eq!(&args[9..], ["40", "1", "3"]);

        let idem = IdemKey::parse("k-1").unwrap();
        let digest = RequestDigest::parse(&"0a".repeat(16)).unwrap();
        let lookup = Lookup::Idempotency {
            owner: IdempotencyOwnerKey::new(&t, &k, &idem),
            memo: IdempotencyMemoKey::new(&t, &k, &digest, &idem),
            digest,
            token: "tok".into(),
            in_flight_ttl_ms: 300_000,
            owner_ttl_ms: 86_400_000,
            live: ResponsesLiveKey::new(&t),
            bytes: ResponsesBytesKey::new(&t),
            bound: 1 << 20,
        };
        let (keys, args) = DecideCall { lookup: Some(lookup), ..call(vec![]) }.encode();
        assert_eq!(
            keys,
            [
                "idem:key:{acme}:key_1:k-1".to_string(),
                format!("idem:api:{{acme}}:key_1:{}:k-1", "0a".repeat(16)),
                "responses:live:{acme}".to_string(),
                "responses:bytes:{acme}".to_string()
            ]
        );
        assert_eq!(args, ["1000", "req-1", "0", "0", "0", "2", "idem", &"0a".repeat(16), "tok", "300000", "86400000", "1048576"]);
    }

    fn ints(v: &[i64]) -> Vec<redis::Value> {
        v.iter().map(|i| Int(*i)).collect()
    }

    #[test]
    fn a_record_comes_last_after_placeholders_for_the_lease_and_the_lookup() {
        let key = DecisionRecordKey::new(&id("acme"), &id(&"ab".repeat(16)));
        let record = Some(Record { key: key.clone(), ttl_ms: 60_000 });
        let (keys, args) = DecideCall { record: record.clone(), ..call(vec![fixed(5)]) }.encode();
        assert_eq!(keys.last().map(String::as_str), Some(key.as_str()));
        assert_eq!(&args[9..], ["0", "0", "2", "none", "60000"], "a = 7 + 6n; r = a + 1");
        let idem = IdemKey::parse("k-1").unwrap();
        let digest = RequestDigest::parse(&"0a".repeat(16)).unwrap();
        let lookup = Lookup::Idempotency {
            owner: IdempotencyOwnerKey::new(&id("acme"), &id("key_1"), &idem),
            memo: IdempotencyMemoKey::new(&id("acme"), &id("key_1"), &digest, &idem),
            digest,
            token: "tok".into(),
            in_flight_ttl_ms: 300_000,
            owner_ttl_ms: 86_400_000,
            live: ResponsesLiveKey::new(&id("acme")),
            bytes: ResponsesBytesKey::new(&id("acme")),
            bound: 7,
        };
        let (keys, args) = DecideCall { record, lookup: Some(lookup), ..call(vec![]) }.encode();
        assert_eq!(keys.len(), 5);
        assert_eq!(&args[6..], ["idem", &"0a".repeat(16), "tok", "300000", "86400000", "7", "60000"], "r = a + 6");
    }

    #[test]
    fn replies_are_read_and_checked() {
        let r = parse(&ints(&[0, 2, 5, 1000, 0, 0, 30_500, 1, 0]), 2).unwrap();
        assert_eq!(r.denied, Some(1));
        assert_eq!(r.states[1], LimitState { remaining: 0, reset_ms: 30_500, would_deny: true });
        assert_eq!(r.outcome, None);
        assert!(parse(&ints(&[1, 0, 1]), 1).is_err());
        assert!(parse(&ints(&[0, 3, 0, 0, 0, 0]), 1).is_err());
        assert_eq!(parse(&ints(&[1, 0, 4, 100, 0, 7]), 1).unwrap().granted, 7);
        assert!(parse(&ints(&[0, 1, 0, 100, 1, 7]), 1).is_err(), "a denial grants nothing");
        assert!(parse(&ints(&[1, 0, 4, 100, 0, -1]), 1).is_err());
        assert_eq!(parse(&ints(&[1, 0, 0]), 0).unwrap(), DecideReply { denied: None, states: vec![], granted: 0, outcome: None });
    }

    #[test]
    fn a_lookup_outcome_follows_the_numbers() {
        let with = |o: &[u8], v: &[u8]| {
            let mut r = ints(&[1, 0, 4, 10, 0, 0]);
            r.extend([BulkString(o.to_vec()), BulkString(v.to_vec())]);
            parse(&r, 1)
        };
        let r = with(b"hit", b"{}").unwrap();
        assert_eq!((r.states[0].remaining, r.outcome), (4, Some(Outcome::Hit("{}".into()))));
        assert_eq!(with(b"miss", b"").unwrap().outcome, Some(Outcome::Miss));
        assert_eq!(with(b"conflict", b"").unwrap().outcome, Some(Outcome::Conflict));
        assert_eq!(with(b"in_flight", b"").unwrap().outcome, Some(Outcome::InFlight));
        assert_eq!(with(b"full", b"1500").unwrap().outcome, Some(Outcome::Full(1500)));
        assert!(with(b"full", b"soon").is_err());
        assert_eq!(with(b"replay", b"{\"status\":200}").unwrap().outcome, Some(Outcome::Replay("{\"status\":200}".into())));
        assert!(with(b"what", b"").is_err());
        assert!(parse(&[Int(1), BulkString(b"hit".to_vec()), Int(0)], 0).is_err(), "numbers after the outcome");
    }
}
