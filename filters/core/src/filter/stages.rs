//! The stages of the request path, in the order the filter runs them (`AuthFilter::admit`):
//!
//! 1. **key** — strip Tollgate's header namespace and every key source, refuse credentials that
//!    cannot be read, rewrite the path without a key query parameter;
//! 2. **metering** — record what a usage event needs (`crate::usage::RequestInfo`);
//! 3. **routing** — match the worker's routing table (404, or the failure mode without a table);
//! 4. **lookup** — plan a response-cache lookup or an idempotency claim (completed with the
//!    body by [`complete_lookup`]);
//! 5. **auth cache** — a reusable allow for the key, without a call (none from before the
//!    worker's generation: crate::changes);
//! 6. **lease** — a unit of this Envoy's lease of the key, without a call (likewise);
//! 7. otherwise the decision call (now, or once the body is in).
//!
//! The breaker stage follows an allow ([`crate::http::HttpFilter`]). Each stage takes what it reads
//! as arguments and returns the value the next stage needs, or what ends the path: a [`Denial`]
//! (stages that can only refuse) or a [`Decision`].
//! Stages only touch the host where the step itself is a host call (stripping a header, reading
//! shared data); answering or forwarding the request is the caller's, through the decision.

use super::decision::{Decision, Denial, Grant, Source};
use super::MAX_USAGE_BODY;
use crate::auth_cache::{self, LocalAllows};
use crate::config::{FailureMode, FilterConfig};
use crate::headers::RequestHeaders;
use crate::host::Host;
use crate::key::{self, KeyProblem, KeySource, RawKey};
use crate::lease::config::LeaseConfig;
use crate::lease::renewer::RenewalQueue;
use crate::lease::{self, LeaseIdentity, Spend};
use crate::responses::{self as resp, LookupKind, LookupPlan};
use crate::routing::{Lookup, Routed, WorkerRoutes};
use crate::shared_keys::SharedKey;
use crate::usage::Identity;
use std::cell::RefCell;
use tollgate_wire::responses::{IdempotencyRequest, IDEMPOTENCY_KEY_HEADER};
use tollgate_wire::routes::{RequestView, RouteSpec};
use tollgate_wire::{codes, DecideRequest, Header, LeaseAsk};

/// What the key stage found.
pub struct Keyed {
    /// The key, when exactly one was sent.
    pub key: Option<RawKey>,
    /// The path as it goes upstream (a key query parameter removed).
    pub path: String,
}

/// Stage 1, the key.
pub fn key(host: &mut impl Host, sources: &[KeySource], headers: &RequestHeaders) -> Result<Keyed, Denial> {
    // First of all: a client must never be able to speak in our header namespace.
    for name in headers.internal() {
        host.remove_request_header(name);
    }
    let plan = key::plan(sources, |n| headers.all_raw(n), headers.get(":path").unwrap_or(""));
    for name in &plan.remove_headers {
        host.remove_request_header(name);
    }
    if headers.has_non_utf8(":path") {
        // RFC 3986 has no raw bytes above 0x7F in a URI: a key in its query could not be
        // found or stripped reliably, so the request is refused.
        let why = "the request path is not valid UTF-8 (percent-encode it)";
        return Err(Denial::local(400, codes::INVALID_REQUEST, why));
    }
    match plan.problem {
        Some(KeyProblem::NotUtf8) => {
            return Err(Denial::local(400, codes::INVALID_REQUEST, "the API key is not valid UTF-8"));
        }
        Some(KeyProblem::Conflicting) => {
            let why = "more than one API key was sent: use one method (RFC 6750)";
            return Err(Denial::local(400, codes::INVALID_REQUEST, why));
        }
        None => {}
    }
    let path = match plan.new_path {
        Some(p) => {
            host.set_request_header(":path", &p);
            p
        }
        None => headers.get(":path").unwrap_or("/").to_string(),
    };
    Ok(Keyed { key: plan.key, path })
}

/// Stage 3, routing: the request's route (`None`: Envoy's own route applies).
pub fn route(
    host: &mut impl Host,
    routes: &RefCell<WorkerRoutes>,
    mode: FailureMode,
    headers: &RequestHeaders,
    path: &str,
) -> Result<Option<Routed>, Denial> {
    let req = RequestView {
        authority: headers.get(":authority").unwrap_or(""),
        method: headers.get(":method").unwrap_or("GET"),
        path,
        header: |n: &str| headers.get(n),
    };
    let found = routes.borrow_mut().lookup(host, &req);
    // A header a route's rule reads, sent twice or not as UTF-8: the rule saw its first UTF-8
    // value (or none), the upstream may read another; a client could pick a route (its product,
    // its plan) the upstream does not serve. Refused, as a repeated Idempotency-Key is.
    let ambiguous = |n: &str| headers.all_raw(n).len() > 1 || headers.has_non_utf8(n);
    if let Some(name) = routes.borrow().ambiguous_rule_header(&req, ambiguous) {
        let message = format!("the {name} header decides this request's route: send it once, as UTF-8");
        return Err(Denial::local(400, codes::INVALID_REQUEST, message));
    }
    match found {
        Lookup::Unrouted => Ok(None),
        Lookup::Route(r) => Ok(Some(r)),
        Lookup::NoMatch => Err(Denial::local(404, codes::NO_ROUTE, "no route matches this request")),
        Lookup::NotLoaded => match mode {
            FailureMode::Closed => {
                let why = "the gateway has no routing table yet";
                Err(Denial::local(503, codes::ROUTES_UNAVAILABLE, why).with_header("retry-after", "1"))
            }
            FailureMode::Open => {
                host.set_request_header(super::DEGRADED_HEADER, "routes_unavailable");
                Ok(None)
            }
        },
    }
}

/// Headers in every cache key besides the route's own (decision 193): the host the request was
/// sent to, and the one a proxy before Envoy says it was — an upstream may build its answer's
/// links from either, and a route without a `host` match serves every authority.
const HOST_KEY_HEADERS: [&str; 2] = [":authority", "x-forwarded-host"];

/// What the lookup stage planned.
pub struct Lookups {
    pub plan: Option<LookupPlan>,
    /// `x-tollgate-cache` for the response, on routes that cache (`miss`, `bypass`).
    pub cache_status: Option<&'static str>,
}

/// Stage 4, the response lookup (the response cache or idempotency is on): an idempotency claim
/// (POST, PATCH, PUT, DELETE with an `Idempotency-Key`; a malformed or repeated key is 400),
/// else a cache lookup on a route with a cache TTL (unless the request's `Cache-Control` or
/// method rules it out, or a cache key header is repeated or not UTF-8: then the response says
/// `x-tollgate-cache: bypass`).
pub fn lookup(config: &FilterConfig, route: Option<&RouteSpec>, headers: &RequestHeaders) -> Result<Lookups, Denial> {
    let method = headers.get(":method").unwrap_or("GET");
    let content_type = headers.get("content-type").map(str::to_string);
    let idem_key = headers.get(IDEMPOTENCY_KEY_HEADER);
    if idem_key.is_none() && headers.has_non_utf8(IDEMPOTENCY_KEY_HEADER) {
        let message = "the Idempotency-Key header is not valid UTF-8: use a quoted string of 1-255 characters";
        return Err(Denial::local(400, codes::INVALID_IDEMPOTENCY_KEY, message));
    }
    let claims = config.idempotency.enabled && resp::IDEMPOTENT_METHODS.contains(&method);
    if claims && headers.all_raw(IDEMPOTENCY_KEY_HEADER).len() > 1 {
        // RFC 8941: repeated lines join into a list, not one key; which one would the client mean?
        let message = "more than one Idempotency-Key header: send one, a quoted string of 1-255 characters";
        return Err(Denial::local(400, codes::INVALID_IDEMPOTENCY_KEY, message));
    }
    if let (true, Some(raw)) = (claims, idem_key) {
        return match resp::parse_idempotency_key(raw) {
            Ok(key) => Ok(Lookups { plan: Some(LookupPlan { kind: LookupKind::Idempotency { key }, content_type }), cache_status: None }),
            Err(why) => {
                let message = format!("the Idempotency-Key header is not a valid key ({why}): use a quoted string of 1-255 characters");
                Err(Denial::local(400, codes::INVALID_IDEMPOTENCY_KEY, message))
            }
        };
    }
    let Some(route) = route.filter(|r| r.cache_ttl_ms.is_some_and(|t| t > 0) && config.response_cache.enabled) else {
        return Ok(Lookups { plan: None, cache_status: None });
    };
    // A key header sent twice or not UTF-8 could not be told apart from another value (or from
    // none) in the key, while the upstream sees what was sent: never stored, never served.
    let ambiguous = |n: &str| headers.all_raw(n).len() > 1 || headers.has_non_utf8(n);
    let bypass = !resp::CACHEABLE_METHODS.contains(&method)
        || idem_key.is_some()
        || headers.get("cache-control").is_some_and(resp::forbids_caching)
        || route.cache_key_headers.iter().any(|n| ambiguous(n))
        || HOST_KEY_HEADERS.iter().any(|n| ambiguous(n))
        || carries_credentials(config, route, headers);
    if bypass {
        return Ok(Lookups { plan: None, cache_status: Some("bypass") });
    }
    let mut key_headers: Vec<(String, Option<String>)> =
        route.cache_key_headers.iter().map(|n| (n.clone(), headers.get(n).map(str::to_string))).collect();
    for name in HOST_KEY_HEADERS {
        if !route.cache_key_headers.iter().any(|h| h == name) {
            key_headers.push((name.to_string(), headers.get(name).map(str::to_ascii_lowercase)));
        }
    }
    let plan = LookupPlan { kind: LookupKind::Cache { headers: key_headers }, content_type };
    Ok(Lookups { plan: Some(plan), cache_status: Some("miss") })
}

/// The request carries a credential the upstream sees besides the API key — a `Cookie`, or an
/// `Authorization` the bearer source does not strip (`Basic …`) — and the route's cache key does
/// not name that header: its answer may be that caller's alone, so a shared cache neither serves
/// nor stores it (RFC 9111 §3.5). The API key itself never reaches the upstream.
fn carries_credentials(config: &FilterConfig, route: &RouteSpec, headers: &RequestHeaders) -> bool {
    let keyed = |name: &str| route.cache_key_headers.iter().any(|h| h == name);
    let bearer_source = config.key_sources.iter().any(|s| matches!(s, crate::key::KeySource::Bearer));
    let authorizations = headers.all_raw("authorization");
    // the bearer source strips every Authorization value when one is in its scheme
    let stripped = bearer_source && authorizations.iter().any(|v| crate::key::is_bearer(v));
    let authorization_upstream = !authorizations.is_empty() && !stripped;
    (authorization_upstream && !keyed("authorization")) || (!headers.all_raw("cookie").is_empty() && !keyed("cookie"))
}

/// Completes a lookup with the whole request body: the cache key or the idempotency digest goes
/// into the decision `request`. `body` is `None` when it is too large to read: the cache is
/// bypassed (returns `Some("bypass")`, the new cache status); an idempotency key cannot be
/// honoured (413).
pub fn complete_lookup(request: &mut DecideRequest, plan: &LookupPlan, body: Option<&[u8]>) -> Result<Option<&'static str>, Denial> {
    let canonical = body.map(|b| resp::canonical_body(plan.content_type.as_deref(), b));
    match (&plan.kind, canonical) {
        (LookupKind::Cache { headers }, Some(c)) => {
            request.cache_key = Some(resp::cache_key(&request.method, &request.path, headers, &c));
        }
        (LookupKind::Cache { .. }, None) => return Ok(Some("bypass")),
        (LookupKind::Idempotency { key }, Some(c)) => {
            let digest = resp::request_digest(&request.method, &request.path, &c);
            request.idempotency = Some(IdempotencyRequest { key: key.clone(), digest });
        }
        (LookupKind::Idempotency { .. }, None) => {
            let message = format!("a request with an Idempotency-Key may have a body of at most {MAX_USAGE_BODY} bytes");
            return Err(Denial::local(413, codes::IDEMPOTENCY_BODY_TOO_LARGE, message));
        }
    }
    Ok(None)
}

/// Stage 5, the auth cache: a live reusable allow at `key` (the key's on its route,
/// [`crate::shared_keys::auth_cache`]).
pub fn auth_cache(host: &impl Host, config: &FilterConfig, local: Option<&RefCell<LocalAllows>>, key: &SharedKey, gen: u64) -> Option<Decision> {
    if config.auth_cache_max_ttl.is_zero() {
        return None;
    }
    let hit = auth_cache::read(host, local, key, host.now_ms(), gen)?;
    Some(Decision::Allow(Grant {
        who: Identity { tenant: hit.tenant, key_id: hit.key_id, plan: hit.plan },
        request_headers: hit.request_headers,
        response_headers: Vec::new(),
        source: Source::AuthCache,
    }))
}

/// The decision call's request (everything but what the later stages add: the client IP, a
/// lease ask, the token estimate, a lookup).
pub fn decide_request(config: &FilterConfig, headers: &RequestHeaders, key_hash: String, path: String, route: Option<&RouteSpec>) -> DecideRequest {
    DecideRequest {
        key_hash,
        method: headers.get(":method").unwrap_or("GET").to_string(),
        authority: headers.get(":authority").unwrap_or("").to_string(),
        path,
        request_id: headers.get("x-request-id").map(str::to_string),
        decision_id: None,
        // an Envoy attribute (a costly host call): read only for a call
        client_ip: None,
        headers: config.forward_headers.iter().filter_map(|n| headers.get(n).map(|v| Header::new(n.as_str(), v))).collect(),
        token_estimate: None,
        route: route.map(|r| r.id.clone()),
        cache_key: None,
        idempotency: None,
        lease: None,
        llm: None,
    }
}

/// What the lease stage decided: an allow from the lease, or a call (`recorded`: the key has a
/// lease record here, `lease::Spend::Miss`). Matched at once by its caller, never stored: as
/// large as the `Option<Decision>` it replaced.
#[allow(clippy::large_enum_variant)]
pub enum Leased {
    Hit(Decision),
    Miss { recorded: bool },
}

/// Stage 6, the lease: admits the request from this Envoy's lease of its key (queueing a
/// renewal when this spend claimed one), or sets the lease ask on the decision `request`. `gen`:
/// the worker's generation (crate::changes).
pub fn lease(host: &mut impl Host, config: &LeaseConfig, renewals: &RefCell<RenewalQueue>, request: &mut DecideRequest, gen: u64) -> Leased {
    let now = host.now_ms();
    let spent = lease::spend_from(host, &mut renewals.borrow_mut().shares, &lease::key_of(request), config, now, gen);
    match spent {
        Spend::Hit { identity, renew } => {
            if let Some(want) = renew {
                let mut renewal = request.clone();
                renewal.client_ip = host.client_ip();
                renewals.borrow_mut().push(renewal, want);
            }
            let LeaseIdentity { tenant, key_id, plan, request_headers, response_headers } = identity;
            Leased::Hit(Decision::Allow(Grant { who: Identity { tenant, key_id, plan }, request_headers, response_headers, source: Source::Lease }))
        }
        Spend::Miss { want, recorded } => {
            request.lease = (want > 0).then_some(LeaseAsk { want, renewal: false });
            Leased::Miss { recorded }
        }
    }
}

/// The whole request body once it is in: `None` when it is too large, or unreadable — never
/// guessed (an empty stand-in would make different requests share a cache key or an
/// idempotency digest).
pub fn request_body(host: &impl Host, body_size: usize) -> Option<Vec<u8>> {
    match body_size {
        0 => Some(Vec::new()),
        n if n <= MAX_USAGE_BODY => host.request_body(0, n),
        _ => None,
    }
}

/// The token estimate: a top-level integer `field` of a JSON body.
pub fn token_estimate(field: &str, body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|v| v.get(field).and_then(serde_json::Value::as_u64))
}

/// Whether the request announces a body larger than `max` bytes (`content-length`).
pub fn content_length_over(headers: &RequestHeaders, max: usize) -> bool {
    headers.get("content-length").and_then(|n| n.trim().parse::<u64>().ok()).is_some_and(|n| n > max as u64)
}
