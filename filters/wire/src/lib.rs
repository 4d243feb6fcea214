//! The filter ↔ sidecar wire protocol (version 1).
//!
//! One request pays at most one callout: the filter sends a single [`DecideRequest`] to
//! `POST /v1/decide` and applies the [`DecideResponse`] it gets back. Authentication is all the
//! decision holds today; limits, quotas and routing add fields to the same call (never a second
//! call), so both sides follow the *tolerant reader* rule: unknown fields are ignored, new fields
//! are optional with defaults. A breaking change gets a new path (`/v2/decide`).
//!
//! Invariant: the raw API key never appears here. The filter sends `key_hash`, the lowercase hex
//! sha256 of the key, and nothing from which the key could be recovered.

use serde::{Deserialize, Serialize};

/// An enum of fieldless variants, each with one fixed name (a stat's or counter's last
/// segment, a path segment): `ALL` in declaration order and `name()`, from one list, so a
/// variant cannot be added without its name or left out of `ALL`.
///
/// ```
/// tollgate_wire::named_enum! {
///     #[derive(Debug, Clone, Copy, PartialEq, Eq)]
///     pub enum Side { Left => "left", Right => "right" }
/// }
/// assert_eq!(Side::ALL.map(Side::name), ["left", "right"]);
/// ```
#[macro_export]
macro_rules! named_enum {
    ($(#[$meta:meta])* $vis:vis enum $enum:ident { $($(#[$vmeta:meta])* $variant:ident => $name:literal),+ $(,)? }) => {
        $(#[$meta])*
        $vis enum $enum {
            $($(#[$vmeta])* $variant),+
        }

        impl $enum {
            /// Every variant, in declaration order.
            pub const ALL: [$enum; [$($name),+].len()] = [$($enum::$variant),+];

            /// The variant's fixed name.
            pub const fn name(self) -> &'static str {
                match self {
                    $($enum::$variant => $name),+
                }
            }
        }
    };
}

/// Path of the decision endpoint on the sidecar.
pub const DECIDE_PATH: &str = "/v1/decide";
/// Path of the batched completion reports (see [`CompletionBatch`]).
pub const COMPLETIONS_PATH: &str = "/v1/completions";
/// The sidecar's body limit on every filter-facing endpoint but `POST /v1/responses`
/// ([`responses::RESPONSES_BODY_LIMIT`]): a bigger call is refused with 413. The filter bounds
/// the serialized size of its batches below it.
pub const BODY_LIMIT: usize = 2 << 20;
/// The namespace of headers only Tollgate sets: a client's are removed before anything reads the
/// request, and no configured rule (a route's header match, a cache key header, a forwarded
/// header, a key source) may name one.
pub const INTERNAL_HEADER_PREFIX: &str = "x-tollgate-";

/// Whether `name` is in Tollgate's namespace ([`INTERNAL_HEADER_PREFIX`]), in any case. No
/// allocation: every header of every request passes here in the filter.
pub fn is_internal_header(name: &str) -> bool {
    is_internal_header_bytes(name.as_bytes())
}

/// [`is_internal_header`] for a name as the host handed it over (bytes).
pub fn is_internal_header_bytes(name: &[u8]) -> bool {
    name.get(..INTERNAL_HEADER_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(INTERNAL_HEADER_PREFIX.as_bytes()))
}
/// The header that carries the deployment's filter secret on every call to the sidecar but
/// `/healthz` and `/metrics` (the plugin's `sidecar.secret`, the sidecar's `[server] secret`).
pub const SECRET_HEADER: &str = "x-tollgate-secret";
/// The request's W3C trace context, forwarded on the decision call (well-formed values only).
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// What the filter asks about one request. `Default` is every field empty: fixtures set what
/// they test on top of [`DecideRequest::new`] with struct update syntax.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DecideRequest {
    /// Lowercase hex sha256 of the API key (64 characters).
    pub key_hash: String,
    pub method: String,
    pub authority: String,
    /// The request path as it goes upstream: the API-key query parameter already removed.
    pub path: String,
    /// The client's `x-request-id`, when present: for tracing (logs) only. It never keys shared
    /// state — a client choosing it could make every request the same log entry or slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The gateway's own id of this decision (32 lowercase hex, random per decision, made by the
    /// filter): the sliding-log member, the concurrency slot, the reservation and the ticket all
    /// key on it. Absent (an older filter, a lease renewal): the sidecar makes one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// The downstream peer address as Envoy saw it (not a client-supplied header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<String>,
    /// Values of the request headers the filter is configured to forward (limit subjects).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<Header>,
    /// Tokens the request says it may use (e.g. `max_tokens` of a JSON body), for budgets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_estimate: Option<u64>,
    /// The id of the route the filter matched in its routing table ([`routes`]), if any. The
    /// sidecar applies that route's product (subscription check) and plan override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// Response cache (issue 7; [`responses`]): the lowercase hex sha256 of the request (method,
    /// path, normalized query, canonical body, the route's key headers), sent when the matched
    /// route caches responses. The sidecar looks it up in the tenant's and route's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
    /// Idempotency-Key replay (issue 7; [`responses`]): the client's key and the operation digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency: Option<responses::IdempotencyRequest>,
    /// Leased limits: the filter would take a lease of units with this decision (see [`LeaseAsk`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseAsk>,
    /// An LLM route's request: what money budgets reserve from (issue 42; [`llm::LlmAsk`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<llm::LlmAsk>,
}

impl DecideRequest {
    /// A request with the four fields every decision has, and none of the optional ones.
    pub fn new(key_hash: impl Into<String>, method: impl Into<String>, authority: impl Into<String>, path: impl Into<String>) -> Self {
        DecideRequest {
            key_hash: key_hash.into(),
            method: method.into(),
            authority: authority.into(),
            path: path.into(),
            ..DecideRequest::default()
        }
    }
}

/// A filter's request for a lease: units of the key's leased limits it may spend locally,
/// without a call, until the lease expires. The sidecar grants at most `want` (maybe none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseAsk {
    /// Units (requests) the filter would like, sized by the rate it observes.
    pub want: u64,
    /// A renewal sent off the request path: no request is admitted by this call, so the
    /// limits are charged only for the units granted, and it is never a usage event.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub renewal: bool,
}

/// A lease granted with an allow: `units` requests of this key may be admitted by the filter
/// without a call, taken atomically from every limit of the key's plan already.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    pub units: u64,
    /// How long the units may be spent, from when the sidecar granted them (never past the
    /// window they were taken from, the key's expiry or the sidecar's maximum lease lifetime).
    pub ttl_ms: u64,
    /// Headers for responses admitted from the lease (`RateLimit-Policy`; the exact remaining
    /// count is only known at the sidecar).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub response_headers: Vec<Header>,
}

/// A header to add, as a name/value pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub name: String,
    pub value: String,
}

impl Header {
    pub fn new(name: impl Into<String>, value: impl Into<String>) -> Self {
        Header { name: name.into(), value: value.into() }
    }
}

/// The sidecar's verdict on one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "camelCase", try_from = "decode::DecideFlat")]
// Read in one pass (decode.rs), not through serde's buffering of tagged enums.
// Allow (the common answer) is the large variant: boxing its fields would add an allocation to
// the usual case to save bytes on the rare one; one value lives per request, briefly.
#[allow(clippy::large_enum_variant)]
pub enum DecideResponse {
    /// Let the request through, tagged with the caller's identity.
    #[serde(rename_all = "camelCase")]
    Allow {
        tenant: String,
        key_id: String,
        plan: String,
        /// Extra headers for the upstream request (beyond tenant and key id).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        request_headers: Vec<Header>,
        /// Headers for the downstream response (e.g. rate-limit headers, later).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        response_headers: Vec<Header>,
        /// The filter may reuse this answer for the same key hash, without a call, for up to this
        /// many milliseconds. Absent when the answer is per-request (limits, stale data).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_for_ms: Option<u64>,
        /// What the request holds until it completes (a token reservation, a concurrency slot).
        /// When present, the filter reports the request's completion with it, batched.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ticket: Option<Ticket>,
        /// A stored response to answer with locally (a cache hit, an idempotent replay): the
        /// upstream is not called. The request still counts (limits were taken, usage is metered).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replay: Option<Box<responses::Replay>>,
        /// Where the response may be stored once complete (a cache miss, a claimed idempotency
        /// key), echoed back in `POST /v1/responses`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        store: Option<Box<responses::StoreTicket>>,
        /// Leased limits: units the filter may spend locally for later requests of this key.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<Lease>,
        /// The key's plan has limits that are never leased (an exact one among them): the filter
        /// need not observe this key's rate nor ask for a lease (and saves that bookkeeping).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        no_lease: bool,
        /// The model the upstream is to be asked for, in place of the one the request names (an
        /// alias of its plan, resolved: issue 42 item 4). The filter rewrites the request's
        /// `model` (its JSON body's, or a Gemini path's) or, when it cannot do so safely, refuses
        /// the request; never forwards it with the alias.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
    },
    /// Answer locally with `status` and `{"error": code, "message": message}`.
    #[serde(rename_all = "camelCase")]
    Deny {
        status: u16,
        /// A stable machine-readable code, one of [`codes`] or one added later.
        error: String,
        message: String,
        /// The limit that denied, for 429s.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        response_headers: Vec<Header>,
    },
}

impl DecideResponse {
    /// An allow of `tenant`'s key `key_id` on `plan` with nothing else: no headers, not
    /// cacheable, no ticket, replay, store ticket or lease.
    pub fn allow(tenant: impl Into<String>, key_id: impl Into<String>, plan: impl Into<String>) -> Self {
        DecideResponse::Allow {
            tenant: tenant.into(),
            key_id: key_id.into(),
            plan: plan.into(),
            request_headers: Vec::new(),
            response_headers: Vec::new(),
            cache_for_ms: None,
            ticket: None,
            replay: None,
            store: None,
            lease: None,
            no_lease: false,
            model: None,
        }
    }
}

/// What an allowed request holds until its completion is reported. Opaque to the filter: it is
/// echoed back as is; the sidecar checks its MAC, its expiry and every field again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ticket {
    pub tenant: String,
    pub request_id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<BudgetHold>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<SlotHold>,
    /// Until when (ms since the Unix epoch) the sidecar takes the ticket back; 0: unsealed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expires_at_ms: u64,
    /// The sidecar's MAC over every other field (lowercase hex HMAC-SHA256), made at decision
    /// time: a ticket without it, or with any field changed, is refused.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Ticket {
    /// An unsealed ticket of `tenant`'s decision `request_id` (the sidecar seals it).
    pub fn new(tenant: impl Into<String>, request_id: impl Into<String>, budgets: Vec<BudgetHold>, slots: Vec<SlotHold>) -> Ticket {
        Ticket { tenant: tenant.into(), request_id: request_id.into(), budgets, slots, expires_at_ms: 0, mac: String::new() }
    }
}

/// A token reservation taken from a monthly budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetHold {
    pub limit: String,
    pub subject: String,
    /// `yyyyMM` of the counter that was charged.
    pub period: u32,
    /// Tokens reserved (the estimate); a money budget's: micro-units.
    pub reserved: u64,
    /// A money budget (`spend_budget`): the moment its reservation was priced at, and its
    /// settlement will be (absent: a token budget). Its `period` is `yyyyMM` or `yyyyMMdd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priced_at_ms: Option<u64>,
}

/// A concurrency slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotHold {
    pub limit: String,
    pub subject: String,
}

/// One finished request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Completion {
    pub ticket: Ticket,
    /// The response status the client got.
    pub status: u16,
    /// Tokens actually used (`usage.total_tokens` of an LLM response), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// An LLM call's model and tokens apart, when its usage was read (`tokens` known) and its
    /// ticket holds a money budget: what the sidecar prices to reconcile the reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<llm::LlmUsage>,
}

/// The body of `POST /v1/completions`: completions batched by the filter (no call per request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionBatch {
    pub completions: Vec<Completion>,
}

/// Stable error codes carried in JSON error bodies and in deny-reason metrics.
pub mod codes {
    /// No API key in any configured source (decided by the filter, no callout).
    pub const MISSING_KEY: &str = "missing_key";
    /// The key's hash is not known.
    pub const UNKNOWN_KEY: &str = "unknown_key";
    /// The key was revoked.
    pub const REVOKED_KEY: &str = "revoked_key";
    /// The key is past its expiry time.
    pub const EXPIRED_KEY: &str = "expired_key";
    /// The sidecar did not answer in time or answered with an error (fail-closed).
    pub const SIDECAR_UNAVAILABLE: &str = "sidecar_unavailable";
    /// A rate limit (fixed/sliding window, token bucket, sliding log) is exhausted: 429.
    pub const RATE_LIMITED: &str = "rate_limited";
    /// A token budget is exhausted: 429.
    pub const QUOTA_EXCEEDED: &str = "quota_exceeded";
    /// A money budget (`spend_budget`) cannot cover the request's reservation: 429.
    pub const BUDGET_EXHAUSTED: &str = "budget_exhausted";
    /// A money budget cannot price the model asked for and is set to refuse it: 403.
    pub const MODEL_NOT_PRICED: &str = "model_not_priced";
    /// Too many requests in flight: 429.
    pub const CONCURRENCY_LIMITED: &str = "concurrency_limited";
    /// Redis could not answer and a fail-closed limit applies: 503.
    pub const LIMITS_UNAVAILABLE: &str = "limits_unavailable";
    /// Routing is on and no route matches the request: 404 (decided by the filter, no callout).
    pub const NO_ROUTE: &str = "no_route";
    /// The route's API product is not one the key's tenant subscribes to: 403.
    pub const NOT_SUBSCRIBED: &str = "not_subscribed";
    /// Routing is on but the filter has no routing table yet (fail-closed): 503.
    pub const ROUTES_UNAVAILABLE: &str = "routes_unavailable";
    /// The `Idempotency-Key` header is not a valid key (IETF draft: 400; decided by the filter).
    pub const INVALID_IDEMPOTENCY_KEY: &str = "invalid_idempotency_key";
    /// An `Idempotency-Key` request's body is too large to fingerprint: 413 (decided by the filter).
    pub const IDEMPOTENCY_BODY_TOO_LARGE: &str = "idempotency_body_too_large";
    /// A request with the same idempotency key is still in flight (IETF draft: 409).
    pub const IDEMPOTENCY_IN_FLIGHT: &str = "idempotency_in_flight";
    /// The idempotency key was used with a different request (IETF draft: 422).
    pub const IDEMPOTENCY_KEY_REUSED: &str = "idempotency_key_reused";
    /// The tenant's stored responses are at its bound (`[responses] tenant_max_mb`): a new
    /// idempotency key is not claimed, the request not run (429 with Retry-After; decision 185).
    pub const IDEMPOTENCY_STORAGE_FULL: &str = "idempotency_storage_full";
    /// The request cannot be read safely (a path or API key that is not UTF-8, two different API
    /// keys): 400, decided by the filter.
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// The request is outside what its API key may reach (a route, an API product, a method or a
    /// client network the key's scopes leave out): 403, decided by the sidecar before any
    /// upstream call (issue 43).
    pub const KEY_SCOPE: &str = "key_scope";
    /// The model an LLM request asks for (after its plan's alias) is outside its plan's or its
    /// key's allow-list: 403, decided by the sidecar before any limit or upstream call (issue 42
    /// item 4).
    pub const MODEL_NOT_ALLOWED: &str = "model_not_allowed";
    /// An allow-list of models applies and the request names no model the gateway can read (no
    /// JSON body with a top-level `model`, a body over 1 MiB): 400, decided by the sidecar.
    pub const MODEL_REQUIRED: &str = "model_required";
    /// Every deny code this version knows, for per-reason metrics.
    pub const ALL_DENY: &[&str] = &[
        MISSING_KEY,
        UNKNOWN_KEY,
        REVOKED_KEY,
        EXPIRED_KEY,
        RATE_LIMITED,
        QUOTA_EXCEEDED,
        BUDGET_EXHAUSTED,
        MODEL_NOT_PRICED,
        CONCURRENCY_LIMITED,
        LIMITS_UNAVAILABLE,
        NO_ROUTE,
        NOT_SUBSCRIBED,
        ROUTES_UNAVAILABLE,
        INVALID_IDEMPOTENCY_KEY,
        IDEMPOTENCY_BODY_TOO_LARGE,
        IDEMPOTENCY_IN_FLIGHT,
        IDEMPOTENCY_KEY_REUSED,
        IDEMPOTENCY_STORAGE_FULL,
        INVALID_REQUEST,
        KEY_SCOPE,
        MODEL_NOT_ALLOWED,
        MODEL_REQUIRED,
    ];
}

/// The JSON body of every error reply, from the filter or the sidecar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    pub message: String,
    /// The limit that denied (429s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_round_trips_with_camel_case_tag() {
        let r = DecideResponse::allow("acme", "key_1", "free");
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(s, r#"{"verdict":"allow","tenant":"acme","keyId":"key_1","plan":"free"}"#);
        assert_eq!(serde_json::from_str::<DecideResponse>(&s).unwrap(), r);
    }

    #[test]
    fn readers_tolerate_unknown_fields() {
        let s = r#"{"verdict":"deny","status":401,"error":"unknown_key","message":"m","future":1}"#;
        match serde_json::from_str::<DecideResponse>(s).unwrap() {
            DecideResponse::Deny { status, error, .. } => {
                assert_eq!(status, 401);
                assert_eq!(error, codes::UNKNOWN_KEY);
            }
            other => panic!("unexpected {other:?}"),
        }
        let q = r#"{"keyHash":"ab","method":"GET","authority":"a","path":"/","later":true}"#;
        let req: DecideRequest = serde_json::from_str(q).unwrap();
        assert_eq!(req.request_id, None);
        assert_eq!(req.lease, None);
        assert_eq!(req, DecideRequest::new("ab", "GET", "a", "/"), "every optional field absent");
        assert_eq!(serde_json::to_string(&req).unwrap(), r#"{"keyHash":"ab","method":"GET","authority":"a","path":"/"}"#);
    }

    #[test]
    fn leases_round_trip_and_are_optional() {
        let q = r#"{"keyHash":"ab","method":"GET","authority":"a","path":"/","lease":{"want":8,"renewal":true}}"#;
        let req: DecideRequest = serde_json::from_str(q).unwrap();
        assert_eq!(req.lease, Some(LeaseAsk { want: 8, renewal: true }));
        let ask = serde_json::to_string(&LeaseAsk { want: 3, renewal: false }).unwrap();
        assert_eq!(ask, r#"{"want":3}"#);
        let a = r#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p","lease":{"units":5,"ttlMs":400}}"#;
        match serde_json::from_str::<DecideResponse>(a).unwrap() {
            DecideResponse::Allow { lease: Some(l), .. } => assert_eq!((l.units, l.ttl_ms), (5, 400)),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Breaker hints (fast-open only) between the filter and the sidecar.
pub mod breaker;

/// Usage events (billing-grade metering, issue 6).
pub mod usage;

/// What a usage event says of an LLM call: models and tokens apart (issue 42).
pub mod llm;

/// The routing table and its matching rule (issue 4).
pub mod routes;

/// The response cache and Idempotency-Key replay (issue 7).
pub mod responses;

/// The change count the filter polls to drop cached answers and leases (issue 15).
pub mod changes;
/// Abandoned decisions, refunded by the sidecar (issue 15.2).
pub mod refunds;
/// Decisions of several requests in one call (decision 127).
pub mod batch;
/// Decisions on one long-lived gRPC stream per worker (decision 223).
pub mod stream;
/// Compact messages on that stream (decision 224).
pub mod compact;
mod decode;
