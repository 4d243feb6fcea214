//! Metering (issue 6): the worker's usage meter (event ids, the queue of usage events), the
//! request-path stage that records what an event needs, and reading the tokens a response used.
//!
//! Every request the filter lets through with an identity becomes one [`UsageEvent`] when it
//! ends (`on_log`); the worker's root context sends the queue as `POST /v1/usage` batches every
//! `usage.flushInterval` (crate::flush). Ids are made here, never taken from the request (a client choosing ids
//! could make its requests look like duplicates of each other and go unbilled): a random 64-bit
//! seed per VM and a counter, 32 hex characters.
//!
//! Loss bound: events wait in this worker's memory until the sidecar has spooled them. A crash
//! of Envoy loses at most what the queue holds (normally one flush interval of requests); a
//! sidecar outage longer than `maxQueued` events (or `maxQueuedBytes` of them) drops the oldest,
//! counted as `tollgate.usage.dropped` — never silently.
//!
//! Client-chosen fields never make an event the sidecar refuses: Host is cut to 255 bytes, the
//! path to 256 (without its query), a method that is not 1-16 letters is `OTHER`; a token count
//! outside `0..=2^53` is clamped and counted (`tollgate.tokens.clamped`). So every allowed request
//! with an identity is metered.

use crate::completions::{UsageQueue, DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_QUEUED_BYTES};
use crate::flush::{Delivery, Outbox};
use crate::headers::RequestHeaders;
use crate::host::Host;
use crate::settings::{duration_within, ConfigError};
use serde::Deserialize;
use std::time::Duration;
use tollgate_wire::llm::LlmUsage;
use tollgate_wire::routes::RouteSpec;
use tollgate_wire::usage::{clamp_tokens, event_authority, event_method, event_path, UsageEvent, MAX_TOKENS};

/// Usage metering (issue 6, plugin configuration `usage`): what the filter records and how it
/// sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageConfig {
    /// Record a usage event for every request with an identity and send them to the sidecar.
    pub enabled: bool,
    /// How often each worker sends its batched events (`POST /v1/usage`).
    pub flush_interval: Duration,
    /// Events a worker keeps while the sidecar cannot take them; past it the oldest are dropped
    /// and counted (`tollgate.usage.dropped`).
    pub max_queued: usize,
    /// Bytes (of their JSON) a worker's queued events may take, whatever their count; past it
    /// the oldest are dropped and counted the same way.
    pub max_queued_bytes: usize,
    /// Which requests are LLM calls whose events carry models and tokens apart (issue 42):
    /// only those of routes marked `llm` (`false`, the default), or every metered request
    /// (`usage.llm: "all"`, for a gateway before LLM APIs only, without routing).
    pub llm_all: bool,
}

impl Default for UsageConfig {
    fn default() -> Self {
        UsageConfig {
            enabled: false,
            flush_interval: Duration::from_secs(1),
            max_queued: default_usage_max_queued(),
            max_queued_bytes: default_usage_max_queued_bytes(),
            llm_all: false,
        }
    }
}

/// `usage.llm`: which requests are LLM calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LlmScope {
    /// Requests of routes marked `llm`.
    #[default]
    Routes,
    /// Every metered request.
    All,
}

/// `usage` as written in the plugin configuration.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawUsage {
    #[serde(default)]
    enabled: bool,
    #[serde(default = "default_usage_flush_interval")]
    flush_interval: String,
    #[serde(default = "default_usage_max_queued")]
    max_queued: usize,
    #[serde(default = "default_usage_max_queued_bytes")]
    max_queued_bytes: usize,
    #[serde(default)]
    llm: LlmScope,
}

impl Default for RawUsage {
    fn default() -> Self {
        RawUsage {
            enabled: false,
            flush_interval: default_usage_flush_interval(),
            max_queued: default_usage_max_queued(),
            max_queued_bytes: default_usage_max_queued_bytes(),
            llm: LlmScope::Routes,
        }
    }
}

fn default_usage_flush_interval() -> String {
    "1s".into()
}
fn default_usage_max_queued() -> usize {
    50_000
}
fn default_usage_max_queued_bytes() -> usize {
    DEFAULT_MAX_QUEUED_BYTES
}

impl UsageConfig {
    pub fn compile(raw: RawUsage) -> Result<UsageConfig, ConfigError> {
        let (min, max) = (Duration::from_millis(10), Duration::from_secs(60));
        let flush_interval = duration_within("usage.flushInterval", &raw.flush_interval, min, max, "10ms and 60s")?;
        if raw.max_queued == 0 || raw.max_queued > 1_000_000 {
            return Err(ConfigError("usage.maxQueued: must be between 1 and 1000000".into()));
        }
        if raw.max_queued_bytes < MAX_BATCH_BYTES || raw.max_queued_bytes > 1 << 30 {
            return Err(ConfigError("usage.maxQueuedBytes: must be between 1048576 (one batch) and 1073741824".into()));
        }
        Ok(UsageConfig {
            enabled: raw.enabled,
            flush_interval,
            max_queued: raw.max_queued,
            max_queued_bytes: raw.max_queued_bytes,
            llm_all: raw.llm == LlmScope::All,
        })
    }
}

/// Events per `POST /v1/usage`.
pub const MAX_BATCH: usize = 1000;
/// Bytes per `POST /v1/usage` (half the sidecar's 2 MiB body limit; a larger batch it refuses
/// with 413 is split anyway).
pub const MAX_BATCH_BYTES: usize = DEFAULT_MAX_BATCH_BYTES;

#[derive(Debug)]
pub struct Meter {
    pub queue: UsageQueue,
    seed: u64,
    next: u64,
}

impl Meter {
    /// `seed` must be random per VM (the adapter draws it from the host's randomness).
    pub fn new(max_queued: usize, seed: u64) -> Meter {
        Meter::bounded(max_queued, DEFAULT_MAX_QUEUED_BYTES, seed)
    }

    /// A meter whose queue holds at most `max_queued` events and `max_queued_bytes` bytes.
    pub fn bounded(max_queued: usize, max_queued_bytes: usize, seed: u64) -> Meter {
        Meter { queue: UsageQueue::bounded(max_queued, max_queued_bytes, MAX_BATCH_BYTES), seed, next: 0 }
    }

    /// A new event id, unique per VM and (with a random seed) across VMs.
    pub fn next_id(&mut self) -> String {
        self.next = self.next.wrapping_add(1);
        // `{seed:016x}{next:016x}`, without the formatting machinery (once per metered request)
        let mut id = String::with_capacity(32);
        crate::ids::push_hex(&mut id, &self.seed.to_be_bytes());
        crate::ids::push_hex(&mut id, &self.next.to_be_bytes());
        id
    }

    pub fn record(&mut self, event: UsageEvent) {
        self.queue.push(event);
    }
}

/// The meter's queue is what the usage flusher sends: events stay queued until the sidecar takes
/// them (200), and are dropped only when it refuses them for good.
impl Outbox for Meter {
    fn dropped(&self) -> u64 {
        self.queue.dropped
    }
    fn take_batch(&mut self, max: usize) -> Option<Vec<u8>> {
        self.queue.begin_flush(max)
    }
    fn settle(&mut self, delivery: Delivery) {
        self.queue.settle(delivery);
    }
    fn full_batch_waits(&self, max: usize) -> bool {
        self.queue.full_batch_waits(max)
    }
    fn waiting(&self) -> usize {
        self.queue.waiting()
    }
    fn abandon(&mut self) {
        self.queue.abandon();
    }
}

/// Who a request was let through as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub key_id: String,
    pub plan: String,
}

/// What a usage event needs from the request: the metering stage records it when the request's
/// headers arrive (metering on).
#[derive(Debug, Clone)]
pub struct RequestInfo {
    method: String,
    authority: String,
    /// The upstream path, without its query ([`event_path`]).
    path: String,
    start_ms: u64,
}

impl RequestInfo {
    /// `upstream_path`: the path as it goes upstream (the key already stripped).
    pub fn new(headers: &RequestHeaders, upstream_path: &str, now_ms: u64) -> RequestInfo {
        RequestInfo {
            method: event_method(headers.get(":method").unwrap_or("GET")),
            authority: event_authority(headers.get(":authority").unwrap_or("")),
            path: event_path(upstream_path),
            start_ms: now_ms,
        }
    }

    /// When the filter took the request (ms since the epoch).
    pub fn start_ms(&self) -> u64 {
        self.start_ms
    }
}

/// What a request's response said of its token usage.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenUse {
    /// The tokens it used, when known.
    pub count: Option<u64>,
    /// It was to be read and could not be (`UsageEvent::tokens_unread`).
    pub unread: bool,
    /// An LLM call's models and tokens apart (issue 42).
    pub llm: Option<LlmUsage>,
}

impl Meter {
    /// Records the usage event of a request that ended with `status`.
    pub fn record_request(
        &mut self,
        host: &impl Host,
        request: RequestInfo,
        who: Identity,
        status: u16,
        tokens: TokenUse,
        route: Option<&RouteSpec>,
    ) {
        let event = UsageEvent {
            id: self.next_id(),
            tenant: who.tenant,
            key_id: who.key_id,
            plan: who.plan,
            method: request.method,
            authority: request.authority,
            path: request.path,
            status,
            start_ms: request.start_ms,
            duration_ms: host.now_ms().saturating_sub(request.start_ms),
            tokens: tokens.count,
            tokens_unread: tokens.unread,
            request_bytes: int_property(host.property(&["request", "total_size"])),
            response_bytes: int_property(host.property(&["response", "total_size"])),
            denied: None,
            route: route.map(|r| r.id.clone()),
            product: route.and_then(|r| r.product.clone()),
            llm: tokens.llm,
        };
        self.record(event);
    }
}

/// The field [`usage_tokens`] looks for, quotes included.
const FIELD: &[u8] = b"\"total_tokens\"";

/// A token count an upstream reported, within `0..=MAX_TOKENS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tokens {
    pub count: u64,
    /// The upstream's number was outside `0..=MAX_TOKENS` (negative, huge, not finite) and was
    /// clamped to the nearest end (`tollgate.usage.tokens_clamped`).
    pub clamped: bool,
}

impl Tokens {
    /// A JSON number, clamped: negatives to 0, above 2^53 to 2^53; a fraction is rounded down.
    pub(crate) fn of_number(n: &serde_json::Number) -> Tokens {
        if let Some(u) = n.as_u64() {
            let (count, clamped) = clamp_tokens(u);
            return Tokens { count, clamped };
        }
        if n.as_i64().is_some() {
            return Tokens { count: 0, clamped: true }; // negative
        }
        match n.as_f64() {
            Some(f) if f >= 0.0 && f <= MAX_TOKENS as f64 => Tokens { count: f as u64, clamped: false },
            Some(f) if f > 0.0 => Tokens { count: MAX_TOKENS, clamped: true },
            _ => Tokens { count: 0, clamped: true },
        }
    }
}

/// `usage.total_tokens` of a JSON response, or of an SSE stream's last frame that holds it,
/// clamped ([`read_tokens`]).
pub fn usage_tokens(body: &[u8]) -> Option<u64> {
    read_tokens(body, true).map(|t| t.count)
}

/// As [`usage_tokens`], saying whether the number was clamped. A body without
/// `"total_tokens"` is not parsed; a value that is not a number is no count.
///
/// Only the response's own usage object counts: a JSON document's top-level `usage`, or the
/// top-level `usage` of an SSE `data:` frame. A `total_tokens` anywhere else may be content a
/// client or a model chose (an echoed request, a tool call's arguments): read, it would let a
/// client choose its own charge. Such a body reports none, and the reservation is the charge.
/// `data:` frames are read only from a response that says it is an event stream: in any other
/// text (a page, plain text echoing the client), such a line is content the client or a model
/// wrote as it is, not escaped inside a JSON string.
pub fn read_tokens(body: &[u8], event_stream: bool) -> Option<Tokens> {
    rfind_field(body)?;
    let count = |r: UsageOf| r.usage.and_then(|u| u.total_tokens).map(|n| Tokens::of_number(&n));
    if let Ok(document) = serde_json::from_slice::<UsageOf>(body) {
        return count(document);
    }
    if !event_stream {
        return None;
    }
    usage_frames(body).find_map(|data| serde_json::from_slice::<UsageOf>(data).ok().and_then(count))
}

/// What [`read_tokens`] reads of a document: only the field, the rest skipped, not built.
#[derive(serde::Deserialize)]
struct UsageOf {
    usage: Option<UsageField>,
}

#[derive(serde::Deserialize)]
struct UsageField {
    total_tokens: Option<serde_json::Number>,
}

/// An event stream's `data:` frames that name the field, last first.
fn usage_frames(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    body.rsplit(|b| *b == b'\n')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .filter(|data| data.windows(FIELD.len()).any(|w| w == FIELD))
}

/// Whether a body that names `"total_tokens"` could not be parsed where [`read_tokens`] would
/// read it (decision 191): a JSON document (or, in an event stream, any frame naming the field)
/// that does not read as a response with a usage object — not JSON (a number past f64, `1e400`;
/// nesting past 128), a repeated `usage`, a `usage` or `total_tokens` of another type. Such a
/// response's usage is unknown, not absent: its event says `tokensUnread`.
/// Asked only when [`read_tokens`] found no count.
pub fn usage_unparsable(body: &[u8], event_stream: bool) -> bool {
    if rfind_field(body).is_none() || serde_json::from_slice::<UsageOf>(body).is_ok() {
        return false;
    }
    if !event_stream {
        return true;
    }
    usage_frames(body).any(|data| serde_json::from_slice::<UsageOf>(data).is_err())
}

/// Where the last `"total_tokens"` starts. Anchored on its `_` (rare in JSON, unlike `"`), so a
/// response without the field costs one backwards byte scan.
fn rfind_field(body: &[u8]) -> Option<usize> {
    const ANCHOR: usize = 6; // FIELD[6] == b'_'
    let mut end = body.len(); // candidates for the anchor lie in [ANCHOR, end)
    loop {
        let at = body.get(ANCHOR..end)?.iter().rposition(|&b| b == b'_')? + ANCHOR;
        let start = at - ANCHOR;
        if body.get(start..).is_some_and(|rest| rest.starts_with(FIELD)) {
            return Some(start);
        }
        end = at;
    }
}

/// An Envoy integer attribute (8 bytes, little-endian), e.g. `response.total_size`.
pub fn int_property(bytes: Option<Vec<u8>>) -> Option<u64> {
    let b: [u8; 8] = bytes?.as_slice().try_into().ok()?;
    u64::try_from(i64::from_le_bytes(b)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn ids_are_unique_and_carry_the_seed() {
        let mut m = Meter::new(10, 0xdead_beef);
        let (a, b) = (m.next_id(), m.next_id());
        assert_ne!(a, b);
        assert_eq!(a, "00000000deadbeef0000000000000001");
        assert_eq!(b.len(), 32);
        assert_ne!(Meter::new(10, 1).next_id(), Meter::new(10, 2).next_id());
    }

    #[test]
    fn token_counts_outside_0_to_2_pow_53_are_clamped() {
        let t = |body: &str| read_tokens(body.as_bytes(), true);
        let exact = |count| Some(Tokens { count, clamped: false });
        let clamped = |count| Some(Tokens { count, clamped: true });
        assert_eq!(t(r#"{"usage":{"total_tokens":42}}"#), exact(42));
        assert_eq!(t(r#"{"usage":{"total_tokens":9007199254740992}}"#), exact(MAX_TOKENS));
        assert_eq!(t(r#"{"usage":{"total_tokens":9007199254740993}}"#), clamped(MAX_TOKENS));
        assert_eq!(t(r#"{"usage":{"total_tokens":18446744073709551615}}"#), clamped(MAX_TOKENS));
        assert_eq!(t(r#"{"usage":{"total_tokens":1e300}}"#), clamped(MAX_TOKENS));
        assert_eq!(t(r#"{"usage":{"total_tokens":-1}}"#), clamped(0));
        assert_eq!(t(r#"{"usage":{"total_tokens":-9223372036854775809}}"#), clamped(0));
        assert_eq!(t(r#"{"usage":{"total_tokens":12.9}}"#), exact(12));
        // the scan of an SSE stream reads the same numbers the same way
        assert_eq!(t("data: {\"usage\":{\"total_tokens\":18446744073709551616}}\n\ndata: [DONE]\n"), clamped(MAX_TOKENS));
        assert_eq!(t("data: {\"usage\":{\"total_tokens\":-1}}\n\n"), clamped(0));
        assert_eq!(t("data: {\"total_tokens\": 7}\n"), None, "not the frame's usage object");
        assert_eq!(t(r#"{"usage":{"total_tokens":"9"}}"#), None);
        assert_eq!(t("data: {\"total_tokens\": -}\n"), None);
        assert_eq!(usage_tokens(br#"{"usage":{"total_tokens":-5}}"#), Some(0));
    }

    #[test]
    fn events_bound_what_the_client_chose() {
        let long_host = "h".repeat(2_500);
        let headers = RequestHeaders::new(crate::hostmap::HeaderMap::from_pairs(&[
            (":method".to_string(), "M-SEARCH".to_string()),
            (":authority".to_string(), long_host),
            (":path".to_string(), format!("/{}", "p".repeat(1_000))),
        ]));
        let info = RequestInfo::new(&headers, &format!("/{}?q=1", "p".repeat(1_000)), 7);
        assert_eq!((info.method.as_str(), info.authority.len(), info.path.len()), ("OTHER", 255, 256));
    }

    #[test]
    fn integer_attributes() {
        assert_eq!(int_property(Some(42i64.to_le_bytes().to_vec())), Some(42));
        assert_eq!(int_property(Some(vec![1, 2])), None);
        assert_eq!(int_property(Some((-1i64).to_le_bytes().to_vec())), None);
        assert_eq!(int_property(None), None);
    }
}
