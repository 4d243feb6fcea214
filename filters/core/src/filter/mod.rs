//! The per-request state machine of the auth filter, driven through the [`Host`] trait.
//!
//! `on_request_headers` runs the request path's stages ([`stages`]: key, metering, routing,
//! lookup, auth cache, lease) until one decides, then applies the [`Decision`] in one place
//! ([`AuthFilter::apply`]): allow (identity headers, steering), deny (a JSON reply), or the one
//! decision call to the sidecar — at once, or once the request body is in (`on_request_body`).
//! `on_sidecar_response` turns the answer into a decision the same way, or applies the
//! configured failure mode when the sidecar did not answer properly. The response side (headers
//! to add, the body kept for usage or storing, what is reported when the request ends) is
//! [`response::ResponseSide`]. Time never enters: the call's timeout is Envoy's.
//!
//! The breaker guard runs after an allow; [`crate::http::HttpFilter`] wires the two.

mod body;
mod call;
mod llm_call;
mod outcome;
pub mod decision;
pub mod hold;
pub mod kept;
pub mod response;
pub mod stages;
mod wiring;

use crate::auth_cache::{self, CachedAllow, LocalAllows};
use crate::batch::DecisionBatcher;
use crate::changes::Generation;
use crate::breaker::guard::CLUSTER_HEADER;
use crate::completions::CompletionQueue;
use crate::config::FilterConfig;
use crate::headers::{RequestHeaders, INTERNAL_HEADER_PREFIX};
use crate::host::{Action, Host};
use crate::ids::DecisionIds;
use crate::lease::renewer::RenewalQueue;
use crate::refunds::RefundQueue;
use crate::responses::claims::ClaimBook;
use crate::responses::queue::{PendingStore, ResponseQueue};
use crate::responses::LookupPlan;
use crate::routing::{Routed, WorkerRoutes};
use crate::shared_keys::{self, SharedKey};
use crate::stats::{DenyReason, Metric};
use crate::usage::{Identity, Meter, RequestInfo, TokenUse};
use decision::{Decision, Denial, Grant, Source};
use hold::EndHold;
use response::ResponseSide;
use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;
use tollgate_wire::refunds::Abandoned;
use tollgate_wire::responses::{StoreItem, StoreTicket};
use tollgate_wire::routes::RouteSpec;
use tollgate_wire::{codes, Completion, DecideRequest, DecideResponse};

/// Largest body the filter reads: a request body for a decision, a response body for token
/// usage (larger ones report no usage).
pub const MAX_USAGE_BODY: usize = 1 << 20;

/// Header for the upstream: the tenant of the key.
pub const TENANT_HEADER: &str = "x-tollgate-tenant";
/// Header for the upstream: the key's id (never its hash or raw value).
pub const KEY_ID_HEADER: &str = "x-tollgate-key-id";
/// Header for the upstream: the plan of the key.
pub const PLAN_HEADER: &str = "x-tollgate-plan";
/// Header for the upstream when a request passed without a decision (fail-open).
pub const DEGRADED_HEADER: &str = "x-tollgate-degraded";
/// Removed from a request whose response body the filter reads.
const ACCEPT_ENCODING: &str = "accept-encoding";

#[derive(Debug)]
enum State {
    Start,
    /// The decision needs the request body; the call is ready but for it.
    AwaitingBody { request: Box<DecideRequest>, lookup: Option<LookupPlan> },
    /// The decision call is in flight; `decision_id` names it (a refund needs it if it is abandoned).
    Waiting { token: u32, key_hash: String, decision_id: Option<String> },
    /// The decision waits in its worker's batch, or rides the batch out (crate::batch).
    Queued { key_hash: String, decision_id: Option<String> },
    Done,
}

/// The parts of its worker a request uses; each optional one is present when its feature is on.
#[derive(Clone)]
struct WorkerParts {
    completions: Rc<RefCell<CompletionQueue>>,
    meter: Option<Rc<RefCell<Meter>>>,
    routes: Option<Rc<RefCell<WorkerRoutes>>>,
    responses: Option<Rc<RefCell<ResponseQueue>>>,
    /// The idempotency claims the worker keeps while their requests run (with `responses`).
    claims: Option<Rc<RefCell<ClaimBook>>>,
    leases: Option<Rc<RefCell<RenewalQueue>>>,
    local_allows: Option<Rc<RefCell<LocalAllows>>>,
    /// Without it the sidecar names the decision.
    decision_ids: Option<Rc<RefCell<DecisionIds>>>,
    /// The worker's generation of cached answers and leases (crate::changes); without it, 0.
    gen: Generation,
    /// Abandoned decisions to refund (crate::refunds); only with `decision_ids`.
    refunds: Option<Rc<RefCell<RefundQueue>>>,
    /// The worker's decision batches, and this request's context id (crate::batch).
    batcher: Option<(Rc<RefCell<DecisionBatcher>>, u32)>,
}

/// One request's filter.
pub struct AuthFilter {
    config: Rc<FilterConfig>,
    worker: WorkerParts,
    state: State,
    /// The route this request matched.
    route: Option<Routed>,
    /// The key's auth-cache key on its route (`shared_keys::auth_cache`), built once the key's
    /// hash is known: the auth cache and its marks use it up to four times a request.
    auth_key: Option<SharedKey>,
    /// What a usage event needs from the request (metering on).
    request: Option<RequestInfo>,
    /// An LLM call's request side (metering on, an LLM route: issue 42).
    llm: Option<llm_call::LlmCall>,
    /// When the decision call that asks for a lease was sent.
    lease_sent_ms: Option<u64>,
    /// The lease stage found the key's record (`stages::Leased::Miss`).
    lease_recorded: bool,
    /// The request's well-formed W3C `traceparent`, forwarded on the decision call.
    traceparent: Option<String>,
    /// The worker's generation when the decision call was sent.
    sent_gen: u64,
    /// The decision whose answer was lost, until the failure mode says whether the request is
    /// refused (then it is refunded) or let through (then what it took stays taken).
    abandoned: Option<Abandoned>,
    response: ResponseSide,
    /// The call storing an idempotency outcome while the response's end is held (its token, and
    /// the item, queued for the batch if the call fails).
    outcome_call: Option<(u32, StoreItem)>,
    /// The outcome call is answered: the adapter resumes the response.
    resume_response: bool,
    /// How much of a response to an idempotency claim goes out before its outcome is stored.
    hold: EndHold,
    /// Body bytes Envoy buffers for this filter (a held chunk), presented again with the next.
    held_bytes: usize,
    /// The client sent `Accept-Encoding` (removed when the filter reads the response's body).
    accepts_encoding: bool,
    /// The request body's size as Envoy last presented it (the buffered size while paused).
    request_body_size: usize,
}

impl AuthFilter {
    pub fn new(config: Rc<FilterConfig>, completions: Rc<RefCell<CompletionQueue>>) -> AuthFilter {
        AuthFilter {
            config,
            worker: WorkerParts {
                completions,
                meter: None,
                routes: None,
                responses: None,
                claims: None,
                leases: None,
                local_allows: None,
                decision_ids: None,
                gen: Generation::default(),
                refunds: None,
                batcher: None,
            },
            state: State::Start,
            route: None,
            auth_key: None,
            request: None,
            llm: None,
            lease_sent_ms: None,
            lease_recorded: false,
            traceparent: None,
            sent_gen: 0,
            abandoned: None,
            response: ResponseSide::default(),
            outcome_call: None,
            resume_response: false,
            accepts_encoding: false,
            request_body_size: 0,
            hold: EndHold::AtEnd,
            held_bytes: 0,
        }
    }

    /// The gateway answered the allowed request itself (an open breaker): no upstream used any
    /// tokens, so a reservation it holds is settled at 0, never charged in full.
    pub fn refused_before_upstream(&mut self) {
        self.response.no_upstream = true;
    }

    /// The request's answer will not be stored in the response cache (it went to a breaker's
    /// fallback, decision 192): a pending cache fill is dropped and the response says `bypass`;
    /// an idempotency outcome is still stored (the operation ran, wherever it ran).
    pub fn forgo_cache_fill(&mut self) {
        if self.response.pending_store.as_ref().is_some_and(|p| !p.is_idempotency()) {
            self.response.pending_store = None;
            self.response.cache_status = Some("bypass");
        }
    }

    /// The route this request matched, if any.
    pub fn route(&self) -> Option<&RouteSpec> {
        self.route.as_ref().and_then(Routed::spec)
    }

    fn route_id(&self) -> Option<&str> {
        self.route().map(|r| r.id.as_str())
    }

    /// The request's auth-cache key: the one built for it, or (a request whose key stage never
    /// ran) built now for `key_hash`.
    fn auth_key(&self, key_hash: &str) -> Cow<'_, SharedKey> {
        match &self.auth_key {
            Some(key) => Cow::Borrowed(key),
            None => Cow::Owned(shared_keys::auth_cache(key_hash, self.route_id())),
        }
    }

    /// `end_of_stream`: the request has no body.
    pub fn on_request_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        if !matches!(self.state, State::Start) {
            return Action::Continue;
        }
        self.state = State::Done;
        let decision = self.admit(host, end_of_stream);
        self.apply(host, decision)
    }

    /// The request path's stages, in order; the first that decides ends it.
    fn admit(&mut self, host: &mut impl Host, end_of_stream: bool) -> Decision {
        let headers = RequestHeaders::new(host.request_headers());
        self.accepts_encoding = !headers.all_raw(ACCEPT_ENCODING).is_empty();
        let keyed = match stages::key(host, &self.config.key_sources, &headers) {
            Ok(k) => k,
            Err(d) => return Decision::Deny(d),
        };
        if self.worker.meter.is_some() {
            self.request = Some(RequestInfo::new(&headers, &keyed.path, host.now_ms()));
        }
        if let Some(routes) = &self.worker.routes {
            match stages::route(host, routes, self.config.failure_mode, &headers, &keyed.path) {
                Ok(r) => self.route = r,
                Err(d) => return Decision::Deny(d),
            }
        }
        // the model asked for is read on every LLM route, metered or not (a model policy, decision 308)
        if self.config.usage.llm_all || self.route().is_some_and(|r| r.llm) {
            let json = !end_of_stream && headers.get("content-type").is_some_and(|c| c.contains("json"));
            let within = !stages::content_length_over(&headers, MAX_USAGE_BODY);
            self.llm = Some(llm_call::LlmCall::start(&keyed.path, json && within));
            self.response.llm = self.request.is_some();
        }
        let Some(raw_key) = keyed.key else {
            return Decision::Deny(Denial::local(401, codes::MISSING_KEY, "an API key is required"));
        };
        let key_hash = raw_key.hash();
        self.auth_key = Some(shared_keys::auth_cache(&key_hash, self.route_id()));
        let lookup = match self.worker.responses {
            Some(_) => match stages::lookup(&self.config, self.route(), &headers) {
                Ok(l) => {
                    self.response.cache_status = l.cache_status;
                    l.plan
                }
                Err(d) => return Decision::Deny(d),
            },
            None => None,
        };
        // A lookup rides on the decision call: neither the auth cache nor a lease can answer it.
        if lookup.is_none() {
            let local = self.worker.local_allows.as_deref();
            if let Some(hit) = stages::auth_cache(host, &self.config, local, &self.auth_key(&key_hash), self.worker.gen.get()) {
                return hit;
            }
        }
        self.traceparent = crate::sidecar::traceparent(headers.get(tollgate_wire::TRACEPARENT_HEADER)).map(str::to_string);
        let mut request = stages::decide_request(&self.config, &headers, key_hash, keyed.path, self.route());
        let unleased = self.worker.local_allows.as_ref().is_some_and(|l| {
            let l = l.borrow();
            l.any_unleased() && l.unleased(&self.auth_key(&request.key_hash), host.now_ms())
        });
        if let (None, Some(renewals), false) = (&lookup, &self.worker.leases, unleased) {
            match stages::lease(host, &self.config.leases, renewals, &mut request, self.worker.gen.get()) {
                stages::Leased::Hit(hit) => {
                    if let Some(local) = &self.worker.local_allows {
                        local.borrow_mut().mark_uncached(&self.auth_key(&request.key_hash), host.now_ms());
                    }
                    return hit;
                }
                stages::Leased::Miss { recorded } => self.lease_recorded = recorded,
            }
        }
        request.client_ip = host.client_ip();
        if let Some(llm) = &self.llm {
            let announced = headers.get("content-length").and_then(|n| n.trim().parse().ok());
            request.llm = Some(llm.ask(announced.unwrap_or(0), self.request.as_ref().map(RequestInfo::start_ms)));
        }
        let json_body = !end_of_stream && headers.get("content-type").is_some_and(|c| c.contains("json"));
        // a body announced larger than the filter reads is decided without it at once, as one
        // found larger on the way (decision 139): not buffered up to Envoy's limit and its 413
        let unread = stages::content_length_over(&headers, MAX_USAGE_BODY);
        // an LLM call's body is read before its decision too: the model it asks for (issue 42)
        let reads_json = self.config.token_estimate_field.is_some() || self.llm.is_some();
        if !unread && ((reads_json && json_body) || (lookup.is_some() && !end_of_stream)) {
            return Decision::AwaitBody(request, lookup);
        }
        if let Some(plan) = &lookup {
            let body: Option<&[u8]> = if unread && !end_of_stream { None } else { Some(&[]) };
            match stages::complete_lookup(&mut request, plan, body) {
                Ok(status) => self.response.cache_status = status.or(self.response.cache_status),
                Err(d) => return Decision::Deny(d),
            }
        }
        Decision::Call(request)
    }

    /// The decision the sidecar's answer makes.
    fn decide(&mut self, host: &mut impl Host, key_hash: &str, answer: Result<DecideResponse, String>) -> Decision {
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
                no_lease: _,
                model,
            }) => {
                let who = Identity { tenant, key_id, plan };
                if let Some(t) = ticket {
                    self.response.hold(t, self.config.token_usage_from_response);
                }
                if let Some(replay) = replay {
                    return Decision::Replay { who, response_headers, replay };
                }
                // an alias: the upstream is asked for the model its plan names (decision 309)
                if let Some(Err(denial)) = model.map(|m| self.rewrite_model(host, &m)) {
                    return Decision::Deny(denial);
                }
                if self.worker.responses.is_some() {
                    let claims = self.worker.claims.clone();
                    self.response.pending_store = store.map(|t| {
                        let max = match *t {
                            StoreTicket::Cache { .. } => self.config.response_cache.max_body_bytes,
                            StoreTicket::Idempotency { .. } => self.config.idempotency.max_body_bytes,
                        };
                        let p = PendingStore::new(*t, max);
                        // an idempotency claim is kept by the worker while the request runs (decision 186)
                        match &claims {
                            Some(book) if p.is_idempotency() => {
                                let p = p.kept_in(book, host.now_ms());
                                if p.claim.is_none() {
                                    host.count(Metric::IdempotencyClaimNotKept);
                                }
                                p
                            }
                            _ => p,
                        }
                    });
                }
                if self.response.cache_status == Some("miss") {
                    host.count(Metric::CacheMiss);
                }
                let ttl = cache_for_ms.unwrap_or(0).min(self.config.auth_cache_max_ttl.as_millis() as u64);
                // Only an answer that is the same for every request of this key may be reused,
                // and only if no change of keys or plans came while the call was out.
                let current = self.sent_gen >= self.worker.gen.get();
                let reusable = response_headers.is_empty() && self.response.ticket.is_none() && self.response.pending_store.is_none();
                if ttl > 0 && reusable && current {
                    let entry = CachedAllow {
                        until_ms: host.now_ms().saturating_add(ttl),
                        tenant: who.tenant.clone(),
                        key_id: who.key_id.clone(),
                        plan: who.plan.clone(),
                        request_headers: request_headers.clone(),
                        gen: self.sent_gen,
                    };
                    let key = self.auth_key(key_hash).into_owned();
                    auth_cache::write(host, self.worker.local_allows.as_deref(), key, entry);
                } else if !response_headers.is_empty() {
                    // a plan with limits: its answers carry RateLimit fields and are never
                    // cached, so the next request of this key need not read the shared entry
                    if let Some(local) = &self.worker.local_allows {
                        local.borrow_mut().mark_uncached(&self.auth_key(key_hash), host.now_ms());
                    }
                }
                Decision::Allow(Grant { who, request_headers, response_headers, source: Source::Sidecar })
            }
            Ok(DecideResponse::Deny { status, error, message, limit, response_headers }) => Decision::Deny(Denial {
                status: if (400..=599).contains(&status) { status } else { 403 },
                code: error.into(),
                message: message.into(),
                limit,
                headers: response_headers,
            }),
            Err(why) => Decision::Fail(why),
        }
    }

    /// Applies a decision: the one place that answers, forwards or calls for the request.
    fn apply(&mut self, host: &mut impl Host, decision: Decision) -> Action {
        match decision {
            Decision::Allow(grant) => self.allow(host, grant),
            Decision::Deny(denial) => {
                host.count(Metric::Denied(DenyReason::of(&denial.code)));
                // a local reply: nothing was looked up in the response cache for it
                self.response.cache_status = None;
                let extra: Vec<(&str, &str)> = denial.headers.iter().map(|h| (h.name.as_str(), h.value.as_str())).collect();
                crate::reply::json_error(host, denial.status, &denial.code, &denial.message, denial.limit.as_deref(), &extra);
                Action::Pause
            }
            Decision::Call(request) => self.call_sidecar(host, request),
            Decision::AwaitBody(request, lookup) => {
                self.state = State::AwaitingBody { request: Box::new(request), lookup };
                Action::Pause
            }
            Decision::Replay { who, response_headers, replay } => {
                let who = self.request.is_some().then_some(who);
                self.response.replay(host, who, response_headers, *replay, self.config.token_usage_from_response);
                Action::Pause
            }
            Decision::Fail(why) => self.sidecar_failed(host, &why),
        }
    }

    fn allow(&mut self, host: &mut impl Host, grant: Grant) -> Action {
        match grant.source {
            Source::AuthCache => host.count(Metric::AuthCacheHit),
            Source::Lease => host.count(Metric::LeaseHit),
            Source::Sidecar => {}
        }
        let Grant { who, request_headers, response_headers, source: _ } = grant;
        // the key stage removed every header of Tollgate's namespace the client sent, and nothing
        // set these before: they are added, not set (decision 227)
        host.add_request_header(TENANT_HEADER, &who.tenant);
        host.add_request_header(KEY_ID_HEADER, &who.key_id);
        host.add_request_header(PLAN_HEADER, &who.plan);
        let mut cluster_set = false;
        for h in request_headers.iter().filter(|h| h.name.starts_with(INTERNAL_HEADER_PREFIX)) {
            host.set_request_header(&h.name, &h.value);
            cluster_set |= h.name == CLUSTER_HEADER;
        }
        // what it keeps of its response counts against its tenant's share (decision 195)
        self.response.kept.for_tenant(&who.tenant);
        if self.request.is_some() {
            self.response.identity = Some(who);
        }
        // A body the filter reads (token usage, a response to store) must come as the upstream
        // wrote it: a compressed one hides its usage, and a stored one would be replayed
        // compressed to clients that never asked (decision 129).
        let reads_body = self.response.pending_store.is_some()
            || (self.config.token_usage_from_response && (self.request.is_some() || self.response.want_tokens));
        if reads_body && self.accepts_encoding {
            host.remove_request_header(ACCEPT_ENCODING);
        }
        self.steer(host, cluster_set);
        self.response.headers = response_headers;
        host.count(Metric::Allowed);
        Action::Continue
    }

    /// Sends a routed request to its route's cluster: Envoy's `cluster_header` route follows the
    /// header (setting it clears the route cache, [`Host::set_request_header`]).
    /// `set`: the header was set on this request already (the sidecar named it), so it is
    /// replaced; else it is absent (the key stage cleared the namespace) and added.
    fn steer(&self, host: &mut impl Host, set: bool) {
        if let Some(r) = self.route() {
            match set {
                true => host.set_request_header(CLUSTER_HEADER, &r.cluster),
                false => host.add_request_header(CLUSTER_HEADER, &r.cluster),
            }
        }
    }

    /// Adds the headers the decision asked for to the downstream response. `end_of_stream`: the
    /// response has no body.
    pub fn on_response_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        let key_headers = self.route.as_ref().and_then(Routed::spec).map(|r| r.cache_key_headers.as_slice()).unwrap_or(&[]);
        self.response.on_headers(host, self.config.token_usage_from_response, key_headers, end_of_stream);
        if end_of_stream {
            return self.store_outcome(host);
        }
        if self.response.pending_store.as_ref().is_some_and(|p| p.is_idempotency()) {
            self.hold = EndHold::from_length(host.response_header("content-length").as_deref());
            if self.hold.holds_headers() {
                return Action::Pause;
            }
        }
        Action::Continue
    }

    /// Keeps the response body (bounded) when token usage must be read from it or the response
    /// may be stored. Streaming responses flow through untouched; only the end of a response to
    /// an idempotency claim (with its last byte, [`hold`]) waits for its outcome to be stored
    /// ([`Self::store_outcome`]).
    ///
    /// `buffered`: the size of the body Envoy presents, which after a held chunk still holds the
    /// bytes seen before (`held_bytes` of them).
    pub fn on_response_body(&mut self, host: &mut impl Host, buffered: usize, end_of_stream: bool) -> Action {
        let seen = std::mem::take(&mut self.held_bytes).min(buffered);
        let chunk_size = buffered - seen;
        self.response.on_body(host, seen, chunk_size, end_of_stream);
        if end_of_stream {
            return self.store_outcome(host);
        }
        if self.hold.hold_chunk(chunk_size) {
            self.held_bytes = buffered;
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// The request is over (response sent, or the client went away): report what it held, store
    /// what may be stored, and meter it.
    pub fn on_log(&mut self, host: &mut impl Host) {
        // The stream ended while its outcome call was out (the client went away): the call
        // dies with the stream, the batch sends the outcome (settling twice is a no-op).
        if let Some((_, item)) = self.outcome_call.take() {
            self.queue_store(item);
        }
        // The client went away while the decision call was in flight: the request was never
        // admitted, and the call's answer is lost with its context.
        self.abandon_call(host);
        let (tokens, store, facts) = self.response.finish(host);
        if let (Some(item), Some(queue)) = (store, &self.worker.responses) {
            queue.borrow_mut().push(item);
        }
        let status = self.response.status;
        let llm = self.llm.take().and_then(|l| l.usage(facts));
        if let Some(ticket) = self.response.ticket.take() {
            // a money budget is settled at the cost of the usage read (decision 302)
            let spend = tokens.is_some() && ticket.budgets.iter().any(|b| b.priced_at_ms.is_some());
            self.worker.completions.borrow_mut().push(Completion { ticket, status, tokens, llm: llm.clone().filter(|_| spend) });
        }
        if let (Some(meter), Some(request), Some(who)) = (&self.worker.meter, self.request.take(), self.response.identity.take()) {
            let tokens = TokenUse { count: tokens, unread: self.response.tokens_unread, llm };
            meter.borrow_mut().record_request(host, request, who, status, tokens, self.route());
        }
    }
}
