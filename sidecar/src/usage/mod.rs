//! Usage metering in the sidecar (issue 6): `POST /v1/usage` from the filter, denial events from
//! the decision path, the durable spool, the Kafka shipper and the Redis meter.
//!
//! ```text
//! filter ──POST /v1/usage──► validate ──► spool (fsync) ──200──► filter forgets the batch
//!                                           │      └──► meter: HINCRBY usage:{tenant}:{day} (best effort)
//!  decide (deny) ──event──────────────────► ┘
//!                                  spool ──shipper──► Kafka usage_events (key = tenant) ──► billing
//! ```
//!
//! With `aggregate_above_rps`, `accept` marks the events of tenants above that rate in their
//! spool lines, and the shipper sends those as per-second aggregates (`intake`, `tollgate_shared::aggregate`).
//!
//! Invariants: an event is acknowledged only once durable on disk; the request path never waits
//! on the spool or Kafka (denials are spooled from a spawned task); every loss is counted
//! (`tollgate_sidecar_usage_events_total{outcome="lost"}`). The Redis meter is a fast, approximate
//! view (it may count a re-sent batch twice, and its keys may be evicted); billing reads the
//! PostgreSQL rollup, which counts each event id once.

pub mod intake;
pub mod kafka;
pub mod meter;
pub mod pricing;
pub mod spool;

use intake::{Intake, RateTracker, RecentIds};
use crate::usage::kafka::{KafkaConfig, Shipper};
use crate::invalid::{invalid, Invalid};
use crate::keys::Id;
use crate::usage::spool::{Spool, SpoolError};
use crate::store::Store;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
pub use tollgate_shared::events::invalid_reason;
use tollgate_wire::usage::{event_path, UsageEvent, MAX_PATH};

/// `[usage]` of the sidecar configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UsageConfig {
    /// Take usage events (`POST /v1/usage`) and meter denials. Off: the endpoint answers 404.
    pub enabled: bool,
    /// The spool directory: events wait here, durable, until Kafka has them. Keep it on a
    /// persistent volume: it is what makes a crash or a Kafka outage lose nothing.
    pub spool_dir: PathBuf,
    /// Bound on the spool; past it batches are refused (503) and wait in the filters.
    pub max_spool_mb: u64,
    /// How long a spool segment takes events before it is shipped (latency to Kafka).
    #[serde(with = "humantime_serde")]
    pub segment_age: Duration,
    /// Count events per tenant and day in Redis (`usage:{tenant}:{yyyyMMdd}`, 35 days).
    pub meter: bool,
    /// Per-second aggregation (seed 003): a tenant with more than this many events per second at
    /// this sidecar gets its events combined per second into `tollgate.usage.aggregate.v1`
    /// messages (tollgate_shared::aggregate). 0 = off: one message per request.
    pub aggregate_above_rps: u64,
    /// On shutdown, how long the shipper may keep sending what is spooled.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    pub kafka: KafkaConfig,
    /// Prices of LLM calls: each call's event is priced as it is taken (`pricing`).
    pub pricing: pricing::PricingConfig,
}

impl Default for UsageConfig {
    fn default() -> Self {
        UsageConfig {
            enabled: false,
            spool_dir: PathBuf::from("/var/lib/tollgate/usage-spool"),
            max_spool_mb: 1024,
            segment_age: Duration::from_millis(200),
            meter: true,
            aggregate_above_rps: 0,
            shutdown_grace: Duration::from_secs(5),
            kafka: KafkaConfig::default(),
            pricing: pricing::PricingConfig::default(),
        }
    }
}

impl UsageConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if !self.enabled {
            return Ok(());
        }
        if self.spool_dir.as_os_str().is_empty() {
            return Err(invalid("usage.spool_dir", "required when usage is enabled"));
        }
        if self.max_spool_mb == 0 {
            return Err(invalid("usage.max_spool_mb", "at least 1"));
        }
        if self.segment_age < Duration::from_millis(10) || self.segment_age > Duration::from_secs(60) {
            return Err(invalid("usage.segment_age", "between 10ms and 60s"));
        }
        pricing::Pricing::compile(&self.pricing)?;
        self.kafka.validate()
    }
}

/// An LLM call's facts as another gateway may have sent them, made storable (decision 292): a
/// model name that is not one is left out, counts clamped to `0..=2^53`, cached input within
/// the input. The request stays metered.
fn normalize_llm(l: &mut tollgate_wire::llm::LlmUsage) {
    use tollgate_wire::llm::model_name;
    use tollgate_wire::usage::clamp_tokens;
    for m in [&mut l.requested_model, &mut l.model] {
        if m.as_deref().is_some_and(|s| model_name(s).is_none()) {
            *m = None;
        }
    }
    for n in [&mut l.input_tokens, &mut l.output_tokens, &mut l.cached_tokens] {
        *n = n.map(|v| clamp_tokens(v).0);
    }
    l.cached_tokens = match (l.cached_tokens, l.input_tokens) {
        (Some(c), Some(i)) => Some(c.min(i)),
        _ => None,
    };
}

/// Bounds what a client chose in `e` instead of refusing it (an older filter may send a long
/// Host): `authority` cut to 255 bytes, `method` `OTHER` unless 1-16 letters, `path` cut to
/// 256 bytes, control characters removed; `tokens` clamped to `0..=2^53`. Returns whether the
/// token count was clamped. An allowed request is always metered.
pub fn normalize(e: &mut UsageEvent) -> bool {
    use tollgate_wire::usage::{bounded_text, clamp_tokens, event_authority, event_method};
    if e.authority.len() > tollgate_wire::usage::MAX_AUTHORITY || e.authority.bytes().any(|b| b.is_ascii_control()) {
        e.authority = event_authority(&e.authority);
    }
    e.method = event_method(&e.method);
    if let Some(llm) = &mut e.llm {
        normalize_llm(llm);
        if llm.is_empty() {
            e.llm = None;
        }
    }
    if e.path.len() > MAX_PATH || e.path.bytes().any(|b| b.is_ascii_control()) || e.path.contains(['?', '#']) {
        e.path = bounded_text(&event_path(&e.path), MAX_PATH);
    }
    match e.tokens.map(clamp_tokens) {
        Some((n, clamped)) => {
            e.tokens = Some(n);
            clamped
        }
        None => false,
    }
}


/// Event ids remembered at intake when aggregation is on (≈ 10 MB of ids, and up to 16 MB of
/// their order; at 10 000 events/s, the last
/// ~26 s — far longer than the filter takes to send a batch again).
pub const RECENT_IDS: usize = 262_144;

/// Fills `recent` with the ids of the newest spooled events (up to its capacity), oldest first.
fn seed_recent(dir: &std::path::Path, recent: &mut RecentIds) {
    #[derive(Deserialize)]
    struct IdOnly<'a> {
        #[serde(borrow)]
        id: std::borrow::Cow<'a, str>,
    }
    let mut segments: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut n = 0;
    for seg in crate::usage::spool::sealed_segments(dir).iter().rev() {
        if n >= RECENT_IDS {
            break;
        }
        if let Ok((lines, _)) = crate::usage::spool::read_segment(seg) {
            n += lines.len();
            segments.push(lines);
        }
    }
    for lines in segments.iter().rev() {
        for l in lines {
            if let Ok(e) = serde_json::from_slice::<IdOnly<'_>>(l) {
                recent.insert(&e.id);
            }
        }
    }
}

/// JSON lines of `events`, as the spool stores them; `marks[i]` marks event `i` for aggregation
/// (tollgate_shared::aggregate; missing marks are `false`). An LLM call's event is never
/// aggregated (decision 293): an aggregate's per-key sums have no place for its model.
pub fn encode_lines(events: &[UsageEvent], marks: &[bool]) -> Vec<u8> {
    let mut out = Vec::with_capacity(events.len() * 256);
    for (i, e) in events.iter().enumerate() {
        let mark = marks.get(i).copied().unwrap_or(false) && e.llm.is_none();
        tollgate_shared::aggregate::encode_line(&mut out, e, mark);
    }
    out
}

/// The running usage pipeline of one sidecar.
pub struct Usage {
    spool: Spool,
    store: Store,
    meter: bool,
    /// Per-tenant event rates and the ids accepted lately, when aggregation is on
    /// (`aggregate_above_rps` > 0).
    intake: Option<std::sync::Mutex<Intake>>,
    stop: CancellationToken,
    shipper: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// When a refused write was last logged (ms since the epoch).
    refusal_logged: std::sync::atomic::AtomicU64,
    /// The prices in force (the file's and the stored ones, swapped by the configuration plane).
    pricing: Arc<pricing::PriceTable>,
}

/// At most one log line per this many ms for refused spool writes (they come once per batch).
const REFUSAL_LOG_EVERY_MS: u64 = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error(transparent)]
    Spool(#[from] SpoolError),
    #[error("usage: spool {dir}: {source}")]
    SpoolDir { dir: PathBuf, source: std::io::Error },
    #[error("usage: {0}")]
    Kafka(#[from] kafka::SetupError),
    #[error("usage: {0}")]
    Pricing(#[from] crate::invalid::Invalid),
}

impl Usage {
    /// Opens the spool and starts the shipper (needs a tokio runtime). Kafka need not be up.
    /// Events are priced by `pricing` (the table money budgets read too).
    pub fn start(config: &UsageConfig, store: Store, pricing: Arc<pricing::PriceTable>) -> Result<Usage, UsageError> {
        let sealed = Arc::new(tokio::sync::Notify::new());
        let spool = Spool::start(&config.spool_dir, config.max_spool_mb << 20, config.segment_age, sealed.clone())
            .map_err(|source| UsageError::SpoolDir { dir: config.spool_dir.clone(), source })?;
        let producer = kafka::producer(&config.kafka)?;
        // Before the shipper starts: a batch the filter sends again after a crash is in the
        // segment that was open then (sealed by `Spool::start`).
        let intake = (config.aggregate_above_rps > 0).then(|| {
            let mut recent = RecentIds::new(RECENT_IDS);
            seed_recent(&config.spool_dir, &mut recent);
            std::sync::Mutex::new(Intake { rates: RateTracker::new(config.aggregate_above_rps), recent })
        });
        let shipper = Shipper {
            config: config.kafka.clone(),
            producer,
            dir: config.spool_dir.clone(),
            total: spool.total(),
            sealed,
            undeletable: Default::default(),
        };
        let stop = CancellationToken::new();
        let handle = tokio::spawn(shipper.run(stop.clone(), config.shutdown_grace));
        Ok(Usage {
            spool,
            store,
            meter: config.meter,
            intake,
            stop,
            shipper: tokio::sync::Mutex::new(Some(handle)),
            refusal_logged: Default::default(),
            pricing,
        })
    }

    /// Prices the LLM calls among `events` (pricing): each call's cost at the price in effect at
    /// its arrival, by the table in force now, replacing whatever cost the sender wrote.
    pub fn price(&self, events: &mut [UsageEvent]) {
        let mut table = None;
        for e in events {
            if let Some(llm) = &mut e.llm {
                table.get_or_insert_with(|| self.pricing.get()).price(llm, e.start_ms);
            }
        }
    }

    /// Makes `events` (already validated) durable, then meters them. `Ok` means the sender may
    /// forget them.
    pub async fn accept(self: &Arc<Self>, events: Vec<UsageEvent>) -> Result<(), SpoolError> {
        if events.is_empty() {
            return Ok(());
        }
        // Marked here, at arrival, and written into the spool line: the decision to aggregate is
        // as durable as the event (a re-shipped segment is aggregated the same way). Ids taken
        // lately are dropped: they are durable already, and an aggregate cannot be deduplicated
        // event by event downstream. A batch whose earlier copy is still being written is
        // refused: dropped as a duplicate, it would be answered before its events are durable.
        let (events, marks) = match &self.intake {
            Some(intake) => {
                let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
                let admitted = match intake.lock() {
                    Ok(mut i) => i.admit(&events, now),
                    Err(_) => Ok(Default::default()),
                };
                let Ok((fresh, marks)) = admitted else {
                    metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "in_flight").increment(events.len() as u64);
                    return Err(SpoolError::InFlight);
                };
                let dropped = fresh.iter().filter(|f| !**f).count();
                if dropped == 0 {
                    (events, marks)
                } else {
                    metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "duplicate").increment(dropped as u64);
                    (events.into_iter().zip(&fresh).filter(|(_, f)| **f).map(|(e, _)| e).collect(), marks)
                }
            }
            None => (events, Vec::new()),
        };
        if events.is_empty() {
            return Ok(());
        }
        // A task of its own: a sender that gives up (its call timed out) drops this future, and
        // what follows the write's answer — the ids confirmed or forgotten, the meter — must
        // still happen, or a copy sent again would be dropped as spooled when it was not.
        let me = self.clone();
        tokio::spawn(async move { me.spool_and_meter(events, marks).await }).await.unwrap_or(Err(SpoolError::Stopped))
    }

    async fn spool_and_meter(&self, events: Vec<UsageEvent>, marks: Vec<bool>) -> Result<(), SpoolError> {
        let written = self.spool.append(encode_lines(&events, &marks)).await;
        if let Some(Ok(mut i)) = self.intake.as_ref().map(|i| i.lock()) {
            for ev in &events {
                match &written {
                    Ok(()) => i.recent.confirm(&ev.id),
                    // not spooled: the filter sends them again, and then they must be taken
                    Err(_) => i.recent.forget(&ev.id),
                }
            }
        }
        if let Err(e) = written {
            metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "refused").increment(events.len() as u64);
            self.warn_refused(&e);
            return Err(e);
        }
        metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "spooled").increment(events.len() as u64);
        crate::telemetry::observe_usage(&events);
        metrics::gauge!(crate::metrics::USAGE_SPOOL_BYTES)
            .set(self.spool.total().load(std::sync::atomic::Ordering::Relaxed) as f64);
        if self.meter {
            let incs = meter::increments(&events);
            let store = self.store.clone();
            tokio::spawn(async move {
                if let Err(e) = meter::add(&store, incs).await {
                    metrics::counter!(crate::metrics::USAGE_METER_ERRORS).increment(1);
                    tracing::debug!(error = %e, "usage meter not updated");
                }
            });
        }
        Ok(())
    }

    /// A refused write (disk full, the spool over its cap, an i/o error) is logged with the
    /// spool's directory, at most once per [`REFUSAL_LOG_EVERY_MS`]: the filter holds the batch
    /// and sends it again, so an operator must see why it keeps coming back.
    fn warn_refused(&self, e: &SpoolError) {
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let last = self.refusal_logged.load(std::sync::atomic::Ordering::Relaxed);
        if now.saturating_sub(last) >= REFUSAL_LOG_EVERY_MS
            && self.refusal_logged.compare_exchange(last, now, std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed).is_ok()
        {
            tracing::warn!(error = %e, spool_dir = %self.spool.dir().display(), "usage: the spool refused a batch; the filters hold it and send it again");
        }
    }

    /// Records a denial the sidecar decided, off the request path. A failure to spool it is
    /// counted as lost (the filter does not hold denials).
    pub fn record_denial(self: &Arc<Self>, event: UsageEvent) {
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.accept(vec![event]).await {
                metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "lost").increment(1);
                tracing::warn!(error = %e, "usage: a denial event could not be spooled");
            }
        });
    }

    /// Seals the spool, lets the shipper make a last pass (bounded by its grace), and waits for it.
    pub async fn shutdown(&self) {
        self.spool.stop().await;
        self.stop.cancel();
        if let Some(h) = self.shipper.lock().await.take() {
            let _ = h.await;
        }
    }
}

/// A usage event for a denial of the decision path.
pub fn denial_event(
    tenant: &str,
    key_id: &str,
    plan: &str,
    req: &tollgate_wire::DecideRequest,
    status: u16,
    code: &str,
    now_ms: u64,
) -> UsageEvent {
    use rand::distr::{Alphanumeric, SampleString};
    UsageEvent {
        id: format!("d{}", Alphanumeric.sample_string(&mut rand::rng(), 31)),
        tenant: tenant.into(),
        key_id: key_id.into(),
        plan: plan.into(),
        method: tollgate_wire::usage::event_method(&req.method),
        authority: tollgate_wire::usage::event_authority(&req.authority),
        path: event_path(&req.path).chars().filter(|c| !c.is_control()).collect(),
        status,
        start_ms: now_ms,
        duration_ms: 0,
        tokens: None,
        tokens_unread: false,
        request_bytes: None,
        response_bytes: None,
        denied: Some(code.into()),
        // the filter's route id, if it is one: the request's bytes are no one's to trust
        route: req.route.clone().filter(|r| Id::parse(r).is_some()),
        product: None,
        llm: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_wire::usage::UsageClass;

    fn ev(id: &str, tenant: &str, status: u16, start_ms: u64, tokens: Option<u64>) -> UsageEvent {
        UsageEvent {
            id: id.into(),
            tenant: tenant.into(),
            key_id: "key_1".into(),
            status,
            start_ms,
            duration_ms: 1,
            tokens,
            ..UsageEvent { plan: "gold".into(), method: "GET".into(), authority: "api.test".into(), path: "/v1".into(), ..UsageEvent::default() }
        }
    }

    const DAY: u64 = 1_764_460_800_000; // 2025-11-30T00:00:00Z

    #[test]
    fn increments_per_tenant_and_day() {
        let mut denied = ev("id000004", "acme", 429, DAY + 5, None);
        denied.denied = Some("rate_limited".into());
        let events = [
            ev("id000001", "acme", 200, DAY, Some(10)),
            ev("id000002", "acme", 404, DAY + 1, Some(5)),
            ev("id000003", "acme", 200, DAY - 1, None),
            denied,
            ev("id000005", "beta", 502, DAY, None),
        ];
        let incs = meter::increments(&events);
        let acme = &incs[&("acme".to_string(), "20251130".to_string())];
        assert_eq!(acme.by_class[&UsageClass::Ok], 1);
        assert_eq!(acme.by_class[&UsageClass::ClientError], 1);
        assert_eq!(acme.by_class[&UsageClass::Denied], 1);
        assert_eq!(acme.tokens, 15);
        assert_eq!(incs[&("acme".to_string(), "20251129".to_string())].by_class[&UsageClass::Ok], 1);
        assert_eq!(incs[&("beta".to_string(), "20251130".to_string())].by_class[&UsageClass::ServerError], 1);
        assert_eq!(incs.len(), 3);
    }

    #[test]
    fn client_chosen_fields_are_bounded_not_refused_and_tokens_clamped() {
        let mut e = ev("0123456789abcdef", "acme", 200, DAY, Some(u64::MAX));
        e.authority = "h".repeat(2_500);
        e.method = "M-SEARCH".into();
        e.path = format!("/{}", "p".repeat(600));
        assert!(normalize(&mut e), "the token count was clamped");
        assert_eq!(invalid_reason(&e), None, "{e:?}");
        assert_eq!((e.authority.len(), e.method.as_str(), e.path.len(), e.tokens), (255, "OTHER", 256, Some(1 << 53)));
        let mut fine = ev("0123456789abcdef", "acme", 200, DAY, Some(7));
        let before = fine.clone();
        assert!(!normalize(&mut fine));
        assert_eq!(fine, before, "a valid event is unchanged");
        let incs = meter::increments(&[e.clone(), e]);
        assert_eq!(incs[&("acme".to_string(), "20251130".to_string())].tokens, 1 << 54, "never negative");
    }

    #[test]
    fn events_are_validated_field_by_field() {
        let good = ev("0123456789abcdef", "acme", 200, DAY, None);
        assert_eq!(invalid_reason(&good), None);
        type Change = Box<dyn Fn(&mut UsageEvent)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|e| e.id = "short".into()), "id"),
            (Box::new(|e| e.id = "a b c d e f g h".into()), "id"),
            (Box::new(|e| e.tenant = "a:b".into()), "tenant"),
            (Box::new(|e| e.key_id = String::new()), "keyId"),
            (Box::new(|e| e.plan = "x".repeat(65)), "plan"),
            (Box::new(|e| e.method = "GET /".into()), "method"),
            (Box::new(|e| e.path = "/a?key=x".into()), "path"),
            (Box::new(|e| e.authority = "a\nb".into()), "authority"),
            (Box::new(|e| e.start_ms = 0), "startMs/status"),
            (Box::new(|e| e.start_ms = u64::MAX), "startMs/status"),
            (Box::new(|e| e.path = "/a\0b".into()), "path"),
            (Box::new(|e| e.request_bytes = Some((1 << 53) + 1)), "counts"),
            (Box::new(|e| e.duration_ms = u64::MAX), "counts"),
            (Box::new(|e| e.denied = Some("x".repeat(1 << 20))), "denied"),
            (Box::new(|e| e.denied = Some("Rate limited".into())), "denied"),
            (Box::new(|e| e.route = Some("r".repeat(65))), "route"),
        ];
        for (change, reason) in cases {
            let mut e = good.clone();
            change(&mut e);
            assert_eq!(invalid_reason(&e), Some(reason), "{e:?}");
        }
    }

    #[test]
    fn the_recent_ids_are_refilled_from_the_spool_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let old: Vec<UsageEvent> = (0..3).map(|i| ev(&format!("old{i:05}"), "acme", 200, DAY, None)).collect();
        let new: Vec<UsageEvent> = (0..3).map(|i| ev(&format!("new{i:05}"), "acme", 200, DAY, None)).collect();
        std::fs::write(dir.path().join("00000000000000000001.seg"), encode_lines(&old, &[true; 3])).unwrap();
        std::fs::write(dir.path().join("00000000000000000002.seg"), encode_lines(&new, &[])).unwrap();
        let mut recent = RecentIds::new(4);
        seed_recent(dir.path(), &mut recent);
        assert_eq!(recent.len(), 4, "bounded");
        // the newest are kept: a batch re-sent after a crash is in the last segments
        assert!(!recent.insert("new00002") && !recent.insert("new00000") && !recent.insert("old00002"));
        assert!(recent.insert("old00000"), "the oldest did not fit");
    }

    #[test]
    fn lines_are_one_json_event_each() {
        let events = [ev("id000001", "acme", 200, DAY, None), ev("id000002", "acme", 200, DAY, None)];
        let text = String::from_utf8(encode_lines(&events, &[])).unwrap();
        let back: Vec<UsageEvent> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(back, events);
    }

    #[test]
    fn denial_events_have_their_own_ids_and_no_query() {
        let req = tollgate_wire::DecideRequest {
            key_hash: "h".into(),
            method: "POST".into(),
            authority: "api".into(),
            path: "/v1/chat?x=1".into(),
            request_id: Some("client".into()),
            decision_id: None,
            client_ip: None,
            headers: vec![],
            token_estimate: None,
            route: None,
            cache_key: None,
            idempotency: None,
            lease: None,
            llm: None,
        };
        let a = denial_event("acme", "key_1", "gold", &req, 429, "rate_limited", DAY);
        let b = denial_event("acme", "key_1", "gold", &req, 429, "rate_limited", DAY);
        assert_ne!(a.id, b.id);
        assert_eq!(a.path, "/v1/chat");
        assert_eq!(a.class(), UsageClass::Denied);
        assert_eq!(invalid_reason(&a), None);
        // a route the filter named that is no id (a forged or broken call): left out, never spooled
        let huge = tollgate_wire::DecideRequest { route: Some("r".repeat(1 << 20)), ..req.clone() };
        let c = denial_event("acme", "key_1", "gold", &huge, 429, "rate_limited", DAY);
        assert_eq!((c.route, invalid_reason(&a)), (None, None));
        let named = tollgate_wire::DecideRequest { route: Some("chat".into()), ..req };
        assert_eq!(denial_event("acme", "key_1", "gold", &named, 429, "rate_limited", DAY).route.as_deref(), Some("chat"));
    }
}
