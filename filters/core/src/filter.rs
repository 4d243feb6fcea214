//! The per-request state machine of the auth filter, driven through the [`Host`] trait.
//!
//! `on_request_headers` strips the internal header namespace, finds and hashes the key, strips it
//! from the request, and either replies at once (no key: no callout) or makes the one decision
//! call to the sidecar. `on_sidecar_response` applies the answer, or the configured failure mode
//! when the sidecar did not answer properly. Time never enters: the call's timeout is Envoy's.

use crate::config::{FailureMode, FilterConfig, INTERNAL_HEADER_PREFIX};
use crate::key;
use std::rc::Rc;
use std::time::Duration;
use crate::completions::CompletionQueue;
use crate::routing::{Lookup, Routed, WorkerRoutes};
use crate::usage::{int_property, Meter};
use std::cell::RefCell;
use tollgate_wire::routes::{RequestView, RouteFailureMode, RouteSpec};
use tollgate_wire::usage::{event_path, UsageEvent};
use tollgate_wire::{codes, Completion, DecideRequest, DecideResponse, ErrorBody, Header, Ticket, DECIDE_PATH};
use crate::responses::{self as resp, PendingStore, ResponseQueue};
use tollgate_wire::responses::{IdempotencyRequest, Replay, ReplayKind, StoreItem, StoreTicket, StoredResponse};

/// Largest response body kept to read token usage from (larger ones report no usage).
pub const MAX_USAGE_BODY: usize = 1 << 20;

/// Header for the upstream: the tenant of the key.
pub const TENANT_HEADER: &str = "x-tollgate-tenant";
/// Header for the upstream: the key's id (never its hash or raw value).
pub const KEY_ID_HEADER: &str = "x-tollgate-key-id";
/// Header for the upstream: the plan of the key.
pub const PLAN_HEADER: &str = "x-tollgate-plan";
/// Header for the upstream when a request passed without a decision (fail-open).
pub const DEGRADED_HEADER: &str = "x-tollgate-degraded";

/// What the adapter should return to Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// Counters the filter exports as Envoy stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Metric {
    Allowed,
    /// Denied with one of [`codes::ALL_DENY`] (by index), or another code.
    Denied(DenyReason),
    /// The sidecar did not answer in time, or answered with an error.
    SidecarError,
    FailedOpen,
    FailedClosed,
    /// Allowed from the VM-wide auth cache, without a call to the sidecar.
    AuthCacheHit,
    /// Answered from the response cache (issue 7).
    CacheHit,
    /// Looked up in the response cache and sent upstream.
    CacheMiss,
    /// Answered with the stored response of an earlier request with the same Idempotency-Key.
    IdempotentReplay,
    /// Allowed from this Envoy's lease of a leased limit, without a call (crate::lease).
    LeaseHit,
    /// Lease renewals sent by a root context (off the request path).
    LeaseRenewal,
}

/// A deny reason known to this version, or `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenyReason {
    Known(usize),
    Other,
}

impl DenyReason {
    pub fn of(code: &str) -> DenyReason {
        codes::ALL_DENY.iter().position(|c| *c == code).map_or(DenyReason::Other, DenyReason::Known)
    }
    pub fn name(self) -> &'static str {
        match self {
            DenyReason::Known(i) => codes::ALL_DENY.get(i).copied().unwrap_or("other"),
            DenyReason::Other => "other",
        }
    }
}

impl Metric {
    /// Every metric, for the adapter to define them once per VM.
    pub fn all() -> Vec<Metric> {
        let mut v = vec![
            Metric::Allowed,
            Metric::SidecarError,
            Metric::FailedOpen,
            Metric::FailedClosed,
            Metric::AuthCacheHit,
            Metric::CacheHit,
            Metric::CacheMiss,
            Metric::IdempotentReplay,
            Metric::LeaseHit,
            Metric::LeaseRenewal,
        ];
        v.extend((0..codes::ALL_DENY.len()).map(|i| Metric::Denied(DenyReason::Known(i))));
        v.push(Metric::Denied(DenyReason::Other));
        v
    }
    /// The stat name (Envoy shows it under `wasmcustom.`).
    pub fn name(self) -> String {
        match self {
            Metric::Allowed => "tollgate.requests.allowed".into(),
            Metric::Denied(r) => format!("tollgate.requests.denied.{}", r.name()),
            Metric::SidecarError => "tollgate.sidecar.errors".into(),
            Metric::FailedOpen => "tollgate.requests.failed_open".into(),
            Metric::FailedClosed => "tollgate.requests.failed_closed".into(),
            Metric::AuthCacheHit => "tollgate.auth_cache.hits".into(),
            Metric::CacheHit => "tollgate.cache.hits".into(),
            Metric::CacheMiss => "tollgate.cache.misses".into(),
            Metric::IdempotentReplay => "tollgate.idempotency.replays".into(),
            Metric::LeaseHit => "tollgate.leases.hits".into(),
            Metric::LeaseRenewal => "tollgate.leases.renewals".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
}

/// A call the filter wants dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSpec {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

/// Everything the filter needs from Envoy. Header names are lowercase.
pub trait Host {
    /// Every request header as the client sent it: names lowercase, values raw bytes (a client
    /// may send any byte; see [`RequestHeaders`]).
    fn request_headers(&self) -> Vec<(String, Vec<u8>)>;
    fn set_request_header(&mut self, name: &str, value: &str);
    fn remove_request_header(&mut self, name: &str);
    fn add_response_header(&mut self, name: &str, value: &str);
    /// The downstream peer's IP address as Envoy saw it.
    fn client_ip(&self) -> Option<String>;
    /// Dispatches an HTTP call; returns its token, or an error description.
    fn dispatch(&mut self, call: CallSpec) -> Result<u32, String>;
    fn send_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]);
    fn count(&mut self, metric: Metric);
    fn log(&mut self, level: LogLevel, message: &str);
    /// Wall-clock milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// VM-wide shared data (all workers of one Envoy see it).
    fn shared_get(&self, key: &str) -> Option<Vec<u8>>;
    fn shared_set(&mut self, key: &str, value: &[u8]);
    /// A response header (lowercase name), e.g. `:status`; `None` when absent or not UTF-8.
    fn response_header(&self, name: &str) -> Option<String>;
    /// Every response header (lowercase names, raw values), for storing a response (issue 7).
    fn response_headers(&self) -> Vec<(String, Vec<u8>)>;
    /// `size` bytes of the response body chunk being processed, from `start`.
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>>;
    /// `size` bytes of the (buffered) request body, from `start`.
    fn request_body(&self, start: usize, size: usize) -> Option<Vec<u8>>;

    // ---- circuit breakers (crate::breaker, crate::breaker_guard, crate::breaker_hints) ----
    /// Shared data with its CAS token (`(None, None)` when absent).
    fn shared_get_cas(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes only if the value still has token `cas` (`None`: unconditional).
    fn shared_set_cas(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), crate::breaker::SharedSetError>;
    /// An Envoy attribute, e.g. `["xds", "cluster_name"]` or `["response", "code_details"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Makes Envoy pick the route again (after the filter changed a header routes match on).
    fn clear_route_cache(&mut self);
    /// Increments a counter known by name only at configuration time (per-target stats).
    fn count_named(&mut self, name: &str);
}

/// An allow answer kept in shared data under [`auth_cache_key`], reusable until `until_ms`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedAllow {
    pub until_ms: u64,
    pub tenant: String,
    pub key_id: String,
    pub plan: String,
    #[serde(default)]
    pub request_headers: Vec<Header>,
}

/// The shared-data key of a key hash's cached answer on a route (the hash, never the raw key).
/// Per route: a route's product and plan override change the answer.
pub fn auth_cache_key(key_hash: &str, route: Option<&str>) -> String {
    match route {
        Some(r) => format!("tollgate.auth.v1.{key_hash}.{r}"),
        None => format!("tollgate.auth.v1.{key_hash}"),
    }
}

/// A worker's own copy of the auth cache entries it has read or written (the same entries, the
/// same expiry as in shared data): a repeat request of a key on this worker is answered without
/// a host call or a decode. An entry is never kept past its `until_ms`, so revocation takes
/// effect as it does through shared data.
#[derive(Debug, Default)]
pub struct LocalAllows {
    entries: std::collections::HashMap<String, CachedAllow>,
}

impl LocalAllows {
    /// Entries kept at most (beyond it the expired are dropped, and if that is not enough, all).
    pub const MAX_ENTRIES: usize = 4096;

    fn get(&self, key: &str, now_ms: u64) -> Option<&CachedAllow> {
        self.entries.get(key).filter(|e| e.until_ms > now_ms)
    }

    fn put(&mut self, key: String, entry: CachedAllow, now_ms: u64) {
        if self.entries.len() >= Self::MAX_ENTRIES && !self.entries.contains_key(&key) {
            self.entries.retain(|_, e| e.until_ms > now_ms);
            if self.entries.len() >= Self::MAX_ENTRIES {
                self.entries.clear();
            }
        }
        self.entries.insert(key, entry);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The response lookup a request asks for in its decision (issue 7), completed with the body.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LookupPlan {
    kind: LookupKind,
    content_type: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LookupKind {
    /// The route caches: its key headers and their values.
    Cache { headers: Vec<(String, Option<String>)> },
    /// The client's idempotency key (unquoted).
    Idempotency { key: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Start,
    /// The decision needs the request body (token estimate, cache key, idempotency digest); the
    /// call is ready but for it.
    AwaitingBody { request: Box<DecideRequest>, lookup: Option<LookupPlan> },
    Waiting { token: u32, key_hash: String },
    Done,
}

/// One request's filter.
pub struct AuthFilter {
    config: Rc<FilterConfig>,
    state: State,
    response_headers: Vec<Header>,
    /// Held until the request completes, then reported through `completions`.
    ticket: Option<Ticket>,
    status: u16,
    /// The response body so far, kept only when the ticket holds a token reservation.
    body: Option<Vec<u8>>,
    completions: Rc<RefCell<CompletionQueue>>,
    /// The worker's usage meter, when metering is on.
    meter: Option<Rc<RefCell<Meter>>>,
    /// What a usage event needs from the request (recorded only when metering is on).
    request: Option<RequestInfo>,
    /// Tenant, key id and plan of a request let through with an identity (metering only).
    identity: Option<(String, String, String)>,
    /// The worker's copy of the routing table (routing on).
    routes: Option<Rc<RefCell<WorkerRoutes>>>,
    /// The route this request matched.
    route: Option<Routed>,
    /// The worker's queue of responses to store (issue 7), when caching or idempotency is on.
    responses: Option<Rc<RefCell<ResponseQueue>>>,
    /// `x-tollgate-cache` for the response (`miss`, `bypass`), on routes that cache.
    cache_status: Option<&'static str>,
    /// The response may be stored (a cache miss, an idempotency claim) once complete.
    pending_store: Option<PendingStore>,
    /// The request was answered with a stored response (nothing went upstream).
    replayed: bool,
    /// Token usage is read from the kept body.
    want_tokens: bool,
    /// Bytes of response body kept at most.
    body_limit: usize,
    /// The worker's lease renewals (crate::lease), when leases are on.
    leases: Option<Rc<RefCell<crate::lease::RenewalQueue>>>,
    /// When the decision call that asks for a lease was sent.
    lease_sent_ms: Option<u64>,
    /// The worker's copy of auth cache entries.
    local_allows: Option<Rc<RefCell<LocalAllows>>>,
    /// The worker's decision ids (crate::ids); without it the sidecar names the decision.
    decision_ids: Option<Rc<RefCell<crate::ids::DecisionIds>>>,
}

#[derive(Debug, Clone)]
struct RequestInfo {
    method: String,
    authority: String,
    path: String,
    start_ms: u64,
}

impl AuthFilter {
    pub fn new(config: Rc<FilterConfig>, completions: Rc<RefCell<CompletionQueue>>) -> AuthFilter {
        AuthFilter {
            config,
            state: State::Start,
            response_headers: Vec::new(),
            ticket: None,
            status: 0,
            body: None,
            completions,
            meter: None,
            request: None,
            identity: None,
            routes: None,
            route: None,
            responses: None,
            cache_status: None,
            pending_store: None,
            replayed: false,
            want_tokens: false,
            body_limit: MAX_USAGE_BODY,
            leases: None,
            lease_sent_ms: None,
            local_allows: None,
            decision_ids: None,
        }
    }

    /// Names every decision call with an id from `ids` (crate::ids).
    pub fn with_decision_ids(mut self, ids: Rc<RefCell<crate::ids::DecisionIds>>) -> AuthFilter {
        self.decision_ids = Some(ids);
        self
    }

    /// Keeps this worker's copy of auth cache entries in `allows` (see [`LocalAllows`]).
    pub fn with_local_allows(mut self, allows: Rc<RefCell<LocalAllows>>) -> AuthFilter {
        self.local_allows = Some(allows);
        self
    }

    /// Stores responses through `queue` (when the response cache or idempotency is on).
    pub fn with_responses(mut self, queue: Rc<RefCell<ResponseQueue>>) -> AuthFilter {
        if self.config.response_cache.enabled || self.config.idempotency.enabled {
            self.responses = Some(queue);
        }
        self
    }

    /// Routes requests by `routes` (when the configuration turns routing on).
    pub fn with_routes(mut self, routes: Rc<RefCell<WorkerRoutes>>) -> AuthFilter {
        if self.config.routing.enabled {
            self.routes = Some(routes);
        }
        self
    }

    /// Spends and renews leases of leased limits through `renewals` (when the configuration
    /// enables leases; crate::lease).
    pub fn with_leases(mut self, renewals: Rc<RefCell<crate::lease::RenewalQueue>>) -> AuthFilter {
        if self.config.leases.enabled {
            self.leases = Some(renewals);
        }
        self
    }

    /// The route this request matched, if any.
    pub fn route(&self) -> Option<&RouteSpec> {
        self.route.as_ref().and_then(Routed::spec)
    }

    /// Meters this request into `meter` (when the configuration enables usage metering).
    pub fn with_meter(mut self, meter: Rc<RefCell<Meter>>) -> AuthFilter {
        if self.config.usage.enabled {
            self.meter = Some(meter);
        }
        self
    }

    /// `end_of_stream`: the request has no body.
    pub fn on_request_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        if self.state != State::Start {
            return Action::Continue;
        }
        self.state = State::Done;
        let headers = RequestHeaders::new(host.request_headers());
        // First of all: a client must never be able to speak in our header namespace.
        for name in headers.names().filter(|n| n.starts_with(INTERNAL_HEADER_PREFIX)) {
            host.remove_request_header(name);
        }
        let plan = key::plan(&self.config.key_sources, |n| headers.all_raw(n), headers.get(":path").unwrap_or(""));
        for name in &plan.remove_headers {
            host.remove_request_header(name);
        }
        if headers.has_non_utf8(":path") {
            // RFC 3986 has no raw bytes above 0x7F in a URI: a key in its query could not be
            // found or stripped reliably, so the request is refused.
            return self.deny(host, 400, codes::INVALID_REQUEST, "the request path is not valid UTF-8 (percent-encode it)", &[]);
        }
        match plan.problem {
            Some(key::KeyProblem::NotUtf8) => {
                return self.deny(host, 400, codes::INVALID_REQUEST, "the API key is not valid UTF-8", &[]);
            }
            Some(key::KeyProblem::Conflicting) => {
                let why = "more than one API key was sent: use one method (RFC 6750)";
                return self.deny(host, 400, codes::INVALID_REQUEST, why, &[]);
            }
            None => {}
        }
        let path = headers.get(":path").unwrap_or("/").to_string();
        let upstream_path = match plan.new_path {
            Some(p) => {
                host.set_request_header(":path", &p);
                p
            }
            None => path,
        };
        if self.meter.is_some() {
            self.request = Some(RequestInfo {
                method: headers.get(":method").unwrap_or("GET").to_string(),
                authority: headers.get(":authority").unwrap_or("").to_string(),
                path: event_path(&upstream_path),
                start_ms: host.now_ms(),
            });
        }
        if let Some(routes) = self.routes.clone() {
            let req = RequestView {
                authority: headers.get(":authority").unwrap_or(""),
                method: headers.get(":method").unwrap_or("GET"),
                path: &upstream_path,
                header: |n: &str| headers.get(n),
            };
            let found = routes.borrow_mut().lookup(host, &req);
            match found {
                Lookup::Unrouted => {}
                Lookup::Route(r) => self.route = Some(r),
                Lookup::NoMatch => return self.deny(host, 404, codes::NO_ROUTE, "no route matches this request", &[]),
                Lookup::NotLoaded => match self.config.failure_mode {
                    FailureMode::Closed => {
                        let why = "the gateway has no routing table yet";
                        return self.deny(host, 503, codes::ROUTES_UNAVAILABLE, why, &[("retry-after", "1")]);
                    }
                    FailureMode::Open => host.set_request_header(DEGRADED_HEADER, "routes_unavailable"),
                },
            }
        }
        let Some(raw_key) = plan.key else {
            return self.deny(host, 401, codes::MISSING_KEY, "an API key is required", &[]);
        };
        let key_hash = raw_key.hash();
        let lookup = match self.plan_lookup(host, &headers) {
            Ok(l) => l,
            Err(action) => return action,
        };
        // A lookup rides on the decision call: the auth cache cannot answer it.
        if lookup.is_none() {
            if let Some(hit) = self.cached_allow(host, &key_hash) {
                host.count(Metric::AuthCacheHit);
                return self.allow(host, hit.tenant, hit.key_id, hit.plan, hit.request_headers, Vec::new());
            }
        }
        let mut request = DecideRequest {
            key_hash,
            method: headers.get(":method").unwrap_or("GET").to_string(),
            authority: headers.get(":authority").unwrap_or("").to_string(),
            path: upstream_path,
            request_id: headers.get("x-request-id").map(str::to_string),
            decision_id: None,
            // an Envoy attribute (a costly host call): read only for a call (below)
            client_ip: None,
            headers: self
                .config
                .forward_headers
                .iter()
                .filter_map(|n| headers.get(n).map(|v| Header::new(n.as_str(), v)))
                .collect(),
            token_estimate: None,
            route: self.route().map(|r| r.id.clone()),
            cache_key: None,
            idempotency: None,
            lease: None,
        };
        // ---- leased limits (crate::lease): admit from this Envoy's lease, no callout ----
        // (not with a response lookup: that rides on the decision call, as for the auth cache)
        if lookup.is_none() {
            if let Some(action) = self.spend_lease(host, &mut request) {
                return action;
            }
        }
        request.client_ip = host.client_ip();
        let json_body = !end_of_stream && headers.get("content-type").is_some_and(|c| c.contains("json"));
        if (self.config.token_estimate_field.is_some() && json_body) || (lookup.is_some() && !end_of_stream) {
            // Decided when the body is in (Envoy buffers it meanwhile).
            self.state = State::AwaitingBody { request: Box::new(request), lookup };
            return Action::Pause;
        }
        if let Some(plan) = &lookup {
            if let Err(action) = self.complete_lookup(host, &mut request, plan, Some(&[])) {
                return action;
            }
        }
        self.call_sidecar(host, request)
    }

    /// The response lookup of this request, if any: an idempotency claim (POST, PATCH, PUT,
    /// DELETE with an `Idempotency-Key`; a malformed key is 400), else a cache lookup on a route
    /// with a cache TTL (unless the request's `Cache-Control` or method rules it out: then the
    /// response says `x-tollgate-cache: bypass`).
    fn plan_lookup(&mut self, host: &mut impl Host, headers: &RequestHeaders) -> Result<Option<LookupPlan>, Action> {
        if self.responses.is_none() {
            return Ok(None);
        }
        let method = headers.get(":method").unwrap_or("GET");
        let content_type = headers.get("content-type").map(str::to_string);
        let idem_key = headers.get(tollgate_wire::responses::IDEMPOTENCY_KEY_HEADER);
        if idem_key.is_none() && headers.has_non_utf8(tollgate_wire::responses::IDEMPOTENCY_KEY_HEADER) {
            let message = "the Idempotency-Key header is not valid UTF-8: use a quoted string of 1-255 characters";
            return Err(self.deny(host, 400, codes::INVALID_IDEMPOTENCY_KEY, message, &[]));
        }
        if let (true, Some(raw)) = (self.config.idempotency.enabled && resp::IDEMPOTENT_METHODS.contains(&method), idem_key) {
            return match resp::parse_idempotency_key(raw) {
                Ok(key) => Ok(Some(LookupPlan { kind: LookupKind::Idempotency { key }, content_type })),
                Err(why) => {
                    let message = format!("the Idempotency-Key header is not a valid key ({why}): use a quoted string of 1-255 characters");
                    Err(self.deny(host, 400, codes::INVALID_IDEMPOTENCY_KEY, &message, &[]))
                }
            };
        }
        let Some(route) = self.route().filter(|r| r.cache_ttl_ms.is_some_and(|t| t > 0) && self.config.response_cache.enabled) else {
            return Ok(None);
        };
        let bypass = !resp::CACHEABLE_METHODS.contains(&method)
            || idem_key.is_some()
            || headers.get("cache-control").is_some_and(resp::forbids_caching);
        if bypass {
            self.cache_status = Some("bypass");
            return Ok(None);
        }
        let key_headers =
            route.cache_key_headers.iter().map(|n| (n.clone(), headers.get(n).map(str::to_string))).collect();
        self.cache_status = Some("miss");
        Ok(Some(LookupPlan { kind: LookupKind::Cache { headers: key_headers }, content_type }))
    }

    /// Puts the cache key or the idempotency digest into the decision request. `body`: the whole
    /// request body, `None` when it is too large to read (the cache is bypassed; an idempotency
    /// key cannot be honoured: 413).
    fn complete_lookup(&mut self, host: &mut impl Host, request: &mut DecideRequest, plan: &LookupPlan, body: Option<&[u8]>) -> Result<(), Action> {
        let canonical = body.map(|b| resp::canonical_body(plan.content_type.as_deref(), b));
        match (&plan.kind, canonical) {
            (LookupKind::Cache { headers }, Some(c)) => {
                request.cache_key = Some(resp::cache_key(&request.method, &request.path, headers, &c));
            }
            (LookupKind::Cache { .. }, None) => self.cache_status = Some("bypass"),
            (LookupKind::Idempotency { key }, Some(c)) => {
                let digest = resp::request_digest(&request.method, &request.path, &c);
                request.idempotency = Some(IdempotencyRequest { key: key.clone(), digest });
            }
            (LookupKind::Idempotency { .. }, None) => {
                let message = format!("a request with an Idempotency-Key may have a body of at most {MAX_USAGE_BODY} bytes");
                return Err(self.deny(host, 413, codes::IDEMPOTENCY_BODY_TOO_LARGE, &message, &[]));
            }
        }
        Ok(())
    }

    /// The request body, for the token estimate. Returns `Pause` until the whole body is in.
    pub fn on_request_body(&mut self, host: &mut impl Host, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.state, State::AwaitingBody { .. }) {
            return if matches!(self.state, State::Waiting { .. }) { Action::Pause } else { Action::Continue };
        }
        if !end_of_stream && body_size <= MAX_USAGE_BODY {
            return Action::Pause;
        }
        let State::AwaitingBody { request, lookup } = std::mem::replace(&mut self.state, State::Done) else {
            return Action::Continue;
        };
        let mut request = *request;
        // `None`: too large, or unreadable — never guessed (an empty stand-in would make different
        // requests share a cache key or an idempotency digest).
        let body = match body_size {
            0 => Some(Vec::new()),
            n if n <= MAX_USAGE_BODY => host.request_body(0, n),
            _ => None,
        };
        if let (Some(field), Some(b)) = (&self.config.token_estimate_field, &body) {
            request.token_estimate = serde_json::from_slice::<serde_json::Value>(b)
                .ok()
                .and_then(|v| v.get(field.as_str()).and_then(serde_json::Value::as_u64));
        }
        if let Some(plan) = &lookup {
            if let Err(action) = self.complete_lookup(host, &mut request, plan, body.as_deref()) {
                return action;
            }
        }
        self.call_sidecar(host, request)
    }

    fn call_sidecar(&mut self, host: &mut impl Host, mut request: DecideRequest) -> Action {
        // The gateway names the decision: what it takes in Redis keys on this id, never on
        // anything the client sent.
        request.decision_id = self.decision_ids.as_ref().map(|ids| ids.borrow_mut().next_id());
        let body = match serde_json::to_vec(&request) {
            Ok(b) => b,
            Err(e) => return self.sidecar_failed(host, &format!("cannot encode decision request: {e}")),
        };
        let call = CallSpec {
            cluster: self.config.sidecar_cluster.clone(),
            headers: vec![
                (":method".into(), "POST".into()),
                (":path".into(), DECIDE_PATH.into()),
                (":authority".into(), self.config.sidecar_authority.clone()),
                ("content-type".into(), "application/json".into()),
            ],
            body,
            timeout: self.config.sidecar_timeout,
        };
        if request.lease.is_some() {
            self.lease_sent_ms = Some(host.now_ms()); // leased limits: the grant's clock starts here
        }
        match host.dispatch(call) {
            Ok(token) => {
                self.state = State::Waiting { token, key_hash: request.key_hash };
                Action::Pause
            }
            Err(e) => self.sidecar_failed(host, &format!("cannot call the sidecar: {e}")),
        }
    }

    /// The sidecar's answer: `status` is the call response's `:status` (Envoy synthesizes 503
    /// when the sidecar is unreachable and 504 on timeout). Returns `Continue` when the adapter
    /// must resume the request.
    pub fn on_sidecar_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) -> Action {
        let key_hash = match &self.state {
            State::Waiting { token: t, key_hash } if *t == token => key_hash.clone(),
            _ => {
                host.log(LogLevel::Debug, "ignoring a call response with an unexpected token");
                return Action::Pause;
            }
        };
        self.state = State::Done;
        let answer = interpret(status, body);
        if self.leases.is_some() {
            // ---- leased limits (crate::lease): keep a grant, release the ask, forget on a 401 ----
            let now = host.now_ms();
            let scope = match self.route() {
                Some(r) => format!("{key_hash}.{}", r.id),
                None => key_hash.clone(),
            };
            crate::lease::on_answer(host, &scope, &answer, self.lease_sent_ms.take(), now, false);
        }
        match answer {
            Ok(DecideResponse::Allow {
                tenant,
                key_id,
                plan,
                request_headers,
                response_headers,
                cache_for_ms,
                ticket,
                replay,
                store,
                lease: _,
            }) => {
                if let Some(t) = ticket {
                    if !t.budgets.is_empty() && self.config.token_usage_from_response {
                        self.body = Some(Vec::new());
                        self.want_tokens = true;
                    }
                    self.ticket = Some(t);
                }
                if let Some(r) = replay {
                    return self.replay(host, tenant, key_id, plan, response_headers, *r);
                }
                if self.responses.is_some() {
                    self.pending_store = store.map(|t| {
                        let t = *t;
                        let max = match t {
                            StoreTicket::Cache { .. } => self.config.response_cache.max_body_bytes,
                            StoreTicket::Idempotency { .. } => self.config.idempotency.max_body_bytes,
                        };
                        PendingStore::new(t, max)
                    });
                }
                if self.cache_status == Some("miss") {
                    host.count(Metric::CacheMiss);
                }
                let ttl = cache_for_ms.unwrap_or(0).min(self.config.auth_cache_max_ttl.as_millis() as u64);
                // Only an answer that is the same for every request of this key may be reused.
                if ttl > 0 && response_headers.is_empty() && self.ticket.is_none() && self.pending_store.is_none() {
                    let entry = CachedAllow {
                        until_ms: host.now_ms().saturating_add(ttl),
                        tenant: tenant.clone(),
                        key_id: key_id.clone(),
                        plan: plan.clone(),
                        request_headers: request_headers.clone(),
                    };
                    if let Ok(bytes) = serde_json::to_vec(&entry) {
                        let key = auth_cache_key(&key_hash, self.route().map(|r| r.id.as_str()));
                        host.shared_set(&key, &bytes);
                        if let Some(local) = &self.local_allows {
                            local.borrow_mut().put(key, entry, host.now_ms());
                        }
                    }
                }
                self.allow(host, tenant, key_id, plan, request_headers, response_headers)
            }
            Ok(DecideResponse::Deny { status, error, message, limit, response_headers }) => {
                let status = if (400..=599).contains(&status) { status } else { 403 };
                let extra: Vec<(&str, &str)> =
                    response_headers.iter().map(|h| (h.name.as_str(), h.value.as_str())).collect();
                host.count(Metric::Denied(DenyReason::of(&error)));
                // a local reply: nothing was looked up in the response cache for it
                self.cache_status = None;
                reply_json(host, status, &error, &message, limit.as_deref(), &extra);
                Action::Pause
            }
            Err(why) => self.sidecar_failed(host, &why),
        }
    }

    /// Answers with a stored response (a cache hit, an idempotent replay): a local reply, nothing
    /// goes upstream. The request counts like any other: its limits were taken in the decision,
    /// its ticket is reported and it is metered with the stored status.
    fn replay(
        &mut self,
        host: &mut impl Host,
        tenant: String,
        key_id: String,
        plan: String,
        response_headers: Vec<Header>,
        replay: Replay,
    ) -> Action {
        let r = replay.response;
        let body = r.body_bytes().unwrap_or_default();
        if self.request.is_some() {
            self.identity = Some((tenant, key_id, plan));
        }
        if self.config.token_usage_from_response && (self.want_tokens || self.identity.is_some()) {
            self.want_tokens = true;
            self.body = Some(body.clone());
        }
        self.status = r.status;
        self.replayed = true;
        let age = (host.now_ms().saturating_sub(r.stored_at_ms) / 1000).to_string();
        let mut headers: Vec<(&str, &str)> = r.headers.iter().map(|h| (h.name.as_str(), h.value.as_str())).collect();
        headers.extend(response_headers.iter().map(|h| (h.name.as_str(), h.value.as_str())));
        match replay.kind {
            ReplayKind::Cache => {
                headers.push((tollgate_wire::responses::CACHE_STATUS_HEADER, "hit"));
                headers.push(("age", age.as_str()));
                host.count(Metric::CacheHit);
            }
            ReplayKind::Idempotency => {
                headers.push((tollgate_wire::responses::REPLAYED_HEADER, "true"));
                host.count(Metric::IdempotentReplay);
            }
        }
        host.count(Metric::Allowed);
        host.send_reply(r.status, &headers, &body);
        Action::Pause
    }

    /// Leased limits (crate::lease): admits the request from this Envoy's lease of its key
    /// (`Some(Continue)`), or sets the lease ask on the decision `request` and returns `None`.
    fn spend_lease(&mut self, host: &mut impl Host, request: &mut DecideRequest) -> Option<Action> {
        let renewals = self.leases.clone()?;
        let now = host.now_ms();
        match crate::lease::spend(host, &crate::lease::scope(request), &self.config.leases, now) {
            crate::lease::Spend::Hit { identity, renew } => {
                if let Some(want) = renew {
                    let mut renewal = request.clone();
                    renewal.client_ip = host.client_ip();
                    renewals.borrow_mut().push(renewal, want);
                }
                host.count(Metric::LeaseHit);
                let crate::lease::LeaseIdentity { tenant, key_id, plan, request_headers, response_headers } = identity;
                Some(self.allow(host, tenant, key_id, plan, request_headers, response_headers))
            }
            crate::lease::Spend::Miss { want } => {
                request.lease = (want > 0).then_some(tollgate_wire::LeaseAsk { want, renewal: false });
                None
            }
        }
    }

    fn cached_allow(&self, host: &impl Host, key_hash: &str) -> Option<CachedAllow> {
        if self.config.auth_cache_max_ttl.is_zero() {
            return None;
        }
        let key = auth_cache_key(key_hash, self.route().map(|r| r.id.as_str()));
        let now = host.now_ms();
        if let Some(hit) = self.local_allows.as_ref().and_then(|l| l.borrow().get(&key, now).cloned()) {
            return Some(hit);
        }
        let bytes = host.shared_get(&key)?;
        let entry: CachedAllow = serde_json::from_slice(&bytes).ok()?;
        if entry.until_ms <= now {
            return None;
        }
        if let Some(local) = &self.local_allows {
            local.borrow_mut().put(key, entry.clone(), now);
        }
        Some(entry)
    }

    fn allow(
        &mut self,
        host: &mut impl Host,
        tenant: String,
        key_id: String,
        plan: String,
        request_headers: Vec<Header>,
        response_headers: Vec<Header>,
    ) -> Action {
        host.set_request_header(TENANT_HEADER, &tenant);
        host.set_request_header(KEY_ID_HEADER, &key_id);
        host.set_request_header(PLAN_HEADER, &plan);
        for h in request_headers.iter().filter(|h| h.name.starts_with(INTERNAL_HEADER_PREFIX)) {
            host.set_request_header(&h.name, &h.value);
        }
        if self.request.is_some() {
            self.identity = Some((tenant, key_id, plan));
        }
        self.steer(host);
        self.response_headers = response_headers;
        host.count(Metric::Allowed);
        Action::Continue
    }

    /// Sends a routed request to its route's cluster: Envoy's `cluster_header` route follows the
    /// header once the route cache is cleared.
    fn steer(&self, host: &mut impl Host) {
        if let Some(r) = self.route() {
            host.set_request_header(crate::breaker_guard::CLUSTER_HEADER, &r.cluster);
            host.clear_route_cache();
        }
    }

    /// Adds the headers the decision asked for to the downstream response. `end_of_stream`: the
    /// response has no body.
    pub fn on_response_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        if self.replayed {
            // our own local reply: its headers are complete already
            return Action::Continue;
        }
        if let Some(p) = &mut self.pending_store {
            let status = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
            // An upstream may send any byte in a header value (Latin-1, say). Such a response is
            // not cached (a replay could not carry it as sent); an idempotent outcome is still
            // stored — the operation ran — without those headers.
            let raw = host.response_headers();
            let all_utf8 = raw.iter().all(|(_, v)| std::str::from_utf8(v).is_ok());
            let headers: Vec<(String, String)> =
                raw.into_iter().filter_map(|(n, v)| String::from_utf8(v).ok().map(|v| (n, v))).collect();
            let key_headers = self.route.as_ref().and_then(Routed::spec).map(|r| r.cache_key_headers.as_slice()).unwrap_or(&[]);
            p.status = status;
            p.storable = if p.is_idempotency() {
                (200..=299).contains(&status)
            } else {
                all_utf8 && resp::cacheable_response(status, &headers, key_headers)
            };
            p.complete = end_of_stream;
            if p.storable {
                p.headers = resp::storable_headers(&headers);
                self.body.get_or_insert_with(Vec::new);
            }
        }
        for h in std::mem::take(&mut self.response_headers) {
            host.add_response_header(&h.name, &h.value);
        }
        if let Some(v) = self.cache_status {
            host.add_response_header(tollgate_wire::responses::CACHE_STATUS_HEADER, v);
        }
        if self.ticket.is_some() || self.identity.is_some() {
            self.status = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        }
        // Metering reads token usage from LLM-style responses too (JSON or an SSE stream).
        if self.identity.is_some() && !self.want_tokens && self.config.token_usage_from_response {
            let content_type = host.response_header("content-type").unwrap_or_default();
            if content_type.contains("json") || content_type.contains("event-stream") {
                self.body.get_or_insert_with(Vec::new);
                self.want_tokens = true;
            }
        }
        self.body_limit = match (&self.pending_store, self.want_tokens) {
            (Some(p), false) if p.storable => p.max_body,
            _ => MAX_USAGE_BODY,
        };
        Action::Continue
    }

    /// Keeps the response body (bounded) when token usage must be read from it or the response
    /// may be stored. Never pauses: streaming responses flow through untouched.
    pub fn on_response_body(&mut self, host: &mut impl Host, chunk_size: usize, end_of_stream: bool) -> Action {
        if self.replayed {
            return Action::Continue;
        }
        if let Some(body) = &mut self.body {
            if body.len() + chunk_size > self.body_limit {
                self.body = None;
            } else if let Some(chunk) = host.response_body(0, chunk_size) {
                body.extend_from_slice(&chunk);
            }
        }
        if let (Some(p), true) = (&mut self.pending_store, end_of_stream) {
            p.complete = true;
        }
        Action::Continue
    }

    /// What to store of a finished request's response, if anything: a complete cacheable
    /// response; an idempotency claim's 2xx outcome (without its body when it was too large or
    /// did not complete: the operation ran, so it is not run again) or, for any other outcome, the
    /// claim's release.
    fn store_item(&self, p: PendingStore, body: Option<Vec<u8>>, now_ms: u64) -> Option<StoreItem> {
        let body = body.filter(|b| b.len() <= p.max_body && p.complete);
        let idem = p.is_idempotency();
        let response = match (p.storable, body) {
            (true, Some(b)) => Some(StoredResponse::new(p.status, p.headers, b, now_ms)),
            (true, None) if idem => {
                let mut r = StoredResponse::new(p.status, p.headers, Vec::new(), now_ms);
                r.truncated = true;
                Some(r)
            }
            _ if idem => None,
            _ => return None,
        };
        Some(StoreItem { ticket: p.ticket, response })
    }

    /// The request is over (response sent, or the client went away): report what it held, and
    /// meter it.
    pub fn on_log(&mut self, host: &impl Host) {
        let body = self.body.take();
        let tokens = if self.want_tokens { body.as_deref().and_then(usage_tokens) } else { None };
        if let (Some(p), Some(queue)) = (self.pending_store.take(), &self.responses) {
            if let Some(item) = self.store_item(p, body, host.now_ms()) {
                queue.borrow_mut().push(item);
            }
        }
        if let Some(ticket) = self.ticket.take() {
            self.completions.borrow_mut().push(Completion { ticket, status: self.status, tokens });
        }
        if let (Some(meter), Some(request), Some((tenant, key_id, plan))) =
            (&self.meter, self.request.take(), self.identity.take())
        {
            let mut meter = meter.borrow_mut();
            let event = UsageEvent {
                id: meter.next_id(),
                tenant,
                key_id,
                plan,
                method: request.method,
                authority: request.authority,
                path: request.path,
                status: self.status,
                start_ms: request.start_ms,
                duration_ms: host.now_ms().saturating_sub(request.start_ms),
                tokens,
                request_bytes: int_property(host.property(&["request", "total_size"])),
                response_bytes: int_property(host.property(&["response", "total_size"])),
                denied: None,
                route: self.route().map(|r| r.id.clone()),
                product: self.route().and_then(|r| r.product.clone()),
            };
            meter.record(event);
        }
    }

    fn deny(&mut self, host: &mut impl Host, status: u16, code: &str, message: &str, extra: &[(&str, &str)]) -> Action {
        host.count(Metric::Denied(DenyReason::of(code)));
        self.cache_status = None;
        reply_json(host, status, code, message, None, extra);
        Action::Pause
    }

    fn sidecar_failed(&mut self, host: &mut impl Host, why: &str) -> Action {
        host.count(Metric::SidecarError);
        let mode = match self.route().and_then(|r| r.failure_mode) {
            Some(RouteFailureMode::Open) => FailureMode::Open,
            Some(RouteFailureMode::Closed) => FailureMode::Closed,
            None => self.config.failure_mode,
        };
        match mode {
            FailureMode::Closed => {
                host.log(LogLevel::Warn, &format!("tollgate: sidecar failed ({why}); failing closed"));
                host.count(Metric::FailedClosed);
                self.cache_status = None;
                reply_json(host, 503, codes::SIDECAR_UNAVAILABLE, "the gateway cannot decide this request now", None, &[]);
                Action::Pause
            }
            FailureMode::Open => {
                host.log(LogLevel::Warn, &format!("tollgate: sidecar failed ({why}); failing open"));
                host.count(Metric::FailedOpen);
                host.set_request_header(DEGRADED_HEADER, "sidecar_unavailable");
                self.steer(host);
                Action::Continue
            }
        }
    }
}

/// Reads a decision call's result: anything but a 200 with a decodable body is an error.
pub fn interpret(status: Option<u16>, body: &[u8]) -> Result<DecideResponse, String> {
    match status {
        Some(200) => serde_json::from_slice(body).map_err(|e| format!("undecodable decision: {e}")),
        Some(s) => Err(format!("sidecar answered {s}")),
        None => Err("sidecar response has no :status".into()),
    }
}

/// The field [`usage_tokens`] looks for, quotes included.
const FIELD: &[u8] = b"\"total_tokens\"";

/// `usage.total_tokens` of a JSON response, or the last `"total_tokens": N` in the body (which
/// also finds the usage frame of an SSE stream). A body without `"total_tokens"` is not parsed.
pub fn usage_tokens(body: &[u8]) -> Option<u64> {
    let at = rfind_field(body)?;
    /// Only the field read: the rest of the document is skipped, not built.
    #[derive(serde::Deserialize)]
    struct Response {
        usage: Option<Usage>,
    }
    #[derive(serde::Deserialize)]
    struct Usage {
        total_tokens: Option<u64>,
    }
    if let Ok(Response { usage: Some(Usage { total_tokens: Some(n) }) }) = serde_json::from_slice::<Response>(body) {
        return Some(n);
    }
    let rest = std::str::from_utf8(body.get(at + FIELD.len()..)?).ok()?;
    let digits: String = rest.trim_start().strip_prefix(':')?.trim_start().chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
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

fn reply_json(host: &mut impl Host, status: u16, code: &str, message: &str, limit: Option<&str>, extra: &[(&str, &str)]) {
    let error = ErrorBody { error: code.into(), message: message.into(), limit: limit.map(str::to_string) };
    let body = serde_json::to_vec(&error)
        .unwrap_or_else(|_| br#"{"error":"internal","message":""}"#.to_vec());
    let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    headers.extend_from_slice(extra);
    host.send_reply(status, &headers, &body);
}

/// The request's headers as the host gave them: names lowercase, values raw bytes. A value that
/// is not UTF-8 reads as absent through [`RequestHeaders::get`] — the filter never guesses at
/// bytes — and the places where absence is not safe (the key, the path, an Idempotency-Key)
/// ask [`RequestHeaders::has_non_utf8`] or read the bytes and refuse the request.
#[derive(Debug, Clone, Default)]
pub struct RequestHeaders(Vec<(String, Vec<u8>)>);

impl RequestHeaders {
    pub fn new(pairs: Vec<(String, Vec<u8>)>) -> RequestHeaders {
        RequestHeaders(pairs)
    }

    /// The first value of `name` when it is UTF-8; `None` when absent or not UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n == name).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// Every value of `name`, as sent.
    pub fn all_raw(&self, name: &str) -> Vec<&[u8]> {
        self.0.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()).collect()
    }

    /// Whether some value of `name` is not UTF-8.
    pub fn has_non_utf8(&self, name: &str) -> bool {
        self.0.iter().any(|(n, v)| n == name && std::str::from_utf8(v).is_err())
    }

    /// Every header name (repeated names repeat).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(n, _)| n.as_str())
    }
}
