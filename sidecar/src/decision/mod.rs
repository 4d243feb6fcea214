//! The decision path: a filter's [`DecideRequest`] in, a [`DecideResponse`] out; and the
//! completion path that settles what an allowed request held.
//!
//! A decision is authentication (the key hash, from the local cache or one Redis HGETALL) and then
//! every limit of the key's plan in ONE `decide.lua` call. With the key record cached (the usual
//! case) a decision costs one Redis round trip; without limits, none.
//!
//! One deadline for the whole decision: the key lookup and the limits script share
//! `redis.decision_timeout` (each command gets what is left, at most `redis.timeout`), so a slow
//! or hung Redis yields the stale grace and the limits' failure modes before the filter's own
//! timeout, never a callout timeout.
//!
//! Failures: when Redis cannot answer the key lookup, a cached answer within the stale grace is
//! used, else [`DecideError::Unavailable`] (the filter's failure mode applies). When it cannot
//! answer the limits, each limit's failure mode applies: any fail-closed limit → 503
//! `limits_unavailable`; all fail-open → allowed without limit headers.
//!
//! Leases (`limits::leasable` plans): a decision whose request carries a [`tollgate_wire::LeaseAsk`]
//! may take a lease in the same script call; a *renewal* (sent by the filter off the request path)
//! authenticates the key again and takes only a lease, admitting no request: it is counted in
//! `tollgate_sidecar_leases_total`, never as a decision or a usage event.
//!
//! The [`Decider`] is generic over its store ([`DecisionStore`]: Redis in the sidecar, memory in
//! the unit tests). Around it: [`limits`] (plans as configured, the lease policy), [`checks`] (a
//! request's limits as `decide.lua` checks; headers, ticket), [`responses`] (cache and
//! idempotency lookups, storing finished responses), [`routing`], [`cache`] (the key-record
//! cache), [`complete`] (the completion path) and [`hints`] (circuit-breaker hints between
//! replicas, off the request path).

mod answers;
mod in_force;
pub mod cache;
pub mod checks;
pub mod complete;
pub mod hints;
pub mod last_used;
pub mod late;
pub mod refund;
pub mod limits;
pub mod local;
mod lookup;
mod model_policy;
pub mod outcomes;
pub mod replicas;
pub mod responses;
pub mod routing;
pub mod spend;
pub mod store;
pub mod tickets;
#[cfg(test)]
mod tests;

pub use routing::{InForce, Routing};
pub use store::DecisionStore;
pub use crate::clock::unix_now;

use crate::apikey::{self, KeyRecord};
use crate::clock::Clock;
use crate::keys::{DecisionRecordKey, Id, KeyHash, DECISION_RECORD_TTL_MS};
use crate::metrics as m;
use crate::scripts::decide::{DecideCall, DecideReply, Lease, LimitState, Record};
use crate::store::Store;
use answers::{allow, too_many};
use cache::{CacheConfig, Lookup, TtlCache};
use checks::{Checks, Meta, RequestCtx};
use limits::{Limit, LimitFailureMode, Plans};
use responses::Lookup as ResponseLookup;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate_wire::responses::StoreTicket;
use tollgate_wire::{codes, DecideRequest, DecideResponse, Header};

#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("cannot decide now: {0}")]
    Unavailable(String),
}

/// The decision and completion paths over a store (Redis in the sidecar, [`DecisionStore`]).
pub struct Decider<S = Store> {
    store: S,
    ttl: Duration,
    /// Boxed: an unknown key's entry (most of a flood of random keys) takes a pointer, not a
    /// whole record's room.
    cache: TtlCache<KeyHash, Option<Arc<KeyRecord>>>,
    /// Keys audited recently by this process: spares Redis the SET NX on every repeat.
    audited: TtlCache<Id, ()>,
    /// Shadow denials logged recently, per limit (a log line at most once a minute each).
    shadow_logged: TtlCache<String, ()>,
    /// The plans and the routing, one value swapped whole (decision 208).
    config: std::sync::RwLock<Arc<InForce>>,
    clock: Arc<dyn Clock>,
    /// Usage metering: denials of known tenants become usage events.
    usage: Option<Arc<crate::usage::Usage>>,
    /// Random per process: with `changes`, what `GET /v1/changes` answers (the filter drops its
    /// cached answers and leases when either moves).
    epoch: u64,
    /// Evictions so far (each after the change it follows was applied here).
    changes: std::sync::atomic::AtomicU64,
    /// What tickets are sealed with (tickets::TicketKey).
    tickets: tickets::TicketKey,
    /// The counters of `failure_mode = "local"` limits while Redis cannot answer.
    local: Arc<local::LocalLimits>,
    /// Refunds of limits scripts that may run after their deadline (decision 137).
    late: Arc<late::LateRefunds>,
    /// The filter's refunds that found nothing, asked again (decision 163): a pool of their own.
    rechecks: Arc<late::LateRefunds>,
    /// How long an idempotency claim stays in flight without word from its request (`[responses]
    /// idempotency_in_flight`; decision 186).
    in_flight_ms: u64,
    /// A tenant's bound of stored responses (`[responses] tenant_max_mb`; decision 185).
    tenant_max_bytes: u64,
    /// The prices money budgets reserve and settle at (the table usage events are priced by,
    /// swapped by the configuration plane; none: they refuse).
    pricing: Option<Arc<crate::usage::pricing::PriceTable>>,
    /// When each key was last used, until the flusher takes it (decision 336).
    used: last_used::LastUsed,
}

/// Whether `s` is a decision id as the filter makes them: 32 lowercase hex.
pub fn well_formed_decision_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether the filter named this decision (a well-formed `decisionId`).
fn filter_named(req: &DecideRequest) -> bool {
    req.decision_id.as_deref().is_some_and(well_formed_decision_id)
}

/// The id of a decision: the filter's `decisionId` when it is one (32 lowercase hex), else a
/// random one of the same form made here.
pub fn decision_id(req: &DecideRequest) -> Id {
    req.decision_id
        .as_deref()
        .filter(|s| well_formed_decision_id(s))
        .and_then(Id::parse)
        .unwrap_or_else(|| Id::parse(&format!("{:032x}", rand::random::<u128>())).expect("hex id"))
}

/// One decision's context: the request, what its route says, the time, the key record's freshness.
struct Cx<'a> {
    req: &'a DecideRequest,
    product: Option<&'a Id>,
    now_ms: u64,
    /// Whether the key record is fresh (not served from the stale grace): leases need it.
    fresh: bool,
    /// When the decision's Redis budget runs out.
    deadline: Instant,
    /// The routing of the configuration the decision reads (with its plans: decision 208).
    routing: &'a Routing,
    /// Whether the filter may reuse the answer (cache it, spend a lease): not for a key whose
    /// scopes decide per request, nor under a model policy (decisions 334, 306).
    reusable: bool,
}

/// What a decision's script call asked, to read its reply against.
struct Asked {
    meta: Vec<Meta>,
    request_id: Id,
    /// How long a granted lease may be spent.
    lease_ttl_ms: u64,
    lookup: Option<ResponseLookup>,
}

/// Milliseconds until the key expires (`u64::MAX`: never).
fn key_left_ms(r: &KeyRecord, now_ms: u64) -> u64 {
    r.expires_at.map_or(u64::MAX, |e| (e * 1000).saturating_sub(now_ms))
}

impl<S: DecisionStore> Decider<S> {
    pub fn new(store: S, cache: &CacheConfig, plans: Plans, clock: Arc<dyn Clock>) -> Decider<S> {
        let minute = Duration::from_secs(60);
        Decider {
            store,
            ttl: cache.ttl,
            cache: TtlCache::new(cache.ttl, cache.stale_grace, cache.max_entries),
            audited: TtlCache::new(minute, minute, cache.max_entries),
            shadow_logged: TtlCache::new(minute, minute, 10_000),
            config: std::sync::RwLock::new(Arc::new(InForce { plans: Arc::new(plans), routing: Arc::new(Routing::default()) })),
            clock,
            usage: None,
            epoch: rand::random::<u64>() >> 11,
            changes: std::sync::atomic::AtomicU64::new(0),
            tickets: tickets::TicketKey::random(),
            local: Arc::default(),
            late: Arc::default(),
            rechecks: Arc::new(late::LateRefunds::rechecks()),
            in_flight_ms: crate::keys::IDEMPOTENCY_IN_FLIGHT_TTL_MS,
            tenant_max_bytes: responses::ResponsesConfig::default().tenant_max_bytes(),
            pricing: None,
            used: last_used::LastUsed::default(),
        }
    }

    /// Money budgets reserve and settle at these prices (those usage events are priced at).
    pub fn with_pricing(mut self, pricing: Arc<crate::usage::pricing::PriceTable>) -> Decider<S> {
        self.pricing = Some(pricing);
        self
    }

    /// Stored responses as `[responses]` says: idempotency claims stay in flight
    /// `idempotency_in_flight` without word from their request (decision 186), and are refused
    /// while their tenant holds `tenant_max_mb` of stored responses (decision 185).
    pub fn with_responses(mut self, c: &responses::ResponsesConfig) -> Decider<S> {
        self.in_flight_ms = (c.idempotency_in_flight.as_millis() as u64).max(1);
        self.tenant_max_bytes = c.tenant_max_bytes();
        self
    }

    /// How long an idempotency claim stays in flight without word from its request.
    pub fn in_flight_ms(&self) -> u64 {
        self.in_flight_ms
    }

    /// The keys used since the last call, to the minute (the last-use flusher's batch).
    pub fn take_used(&self) -> Vec<(KeyHash, Id, u64)> {
        self.used.take()
    }

    /// The counters of `local` limits (the replica heartbeat sets their discovered count).
    pub fn local(&self) -> &Arc<local::LocalLimits> {
        &self.local
    }

    /// Enforces `local` limits with these counters (their replica count, their bound).
    pub fn with_local(mut self, local: Arc<local::LocalLimits>) -> Decider<S> {
        self.local = local;
        self
    }

    /// Meters this decider's denials into `usage` (when metering is on).
    pub fn with_usage(mut self, usage: Option<Arc<crate::usage::Usage>>) -> Decider<S> {
        self.usage = usage;
        self
    }

    /// Seals tickets with the deployment's key (the default is one of this process only).
    pub fn with_ticket_key(mut self, key: tickets::TicketKey) -> Decider<S> {
        self.tickets = key;
        self
    }

    pub async fn decide(&self, req: &DecideRequest) -> Result<DecideResponse, DecideError> {
        let hash = KeyHash::parse(&req.key_hash)
            .ok_or_else(|| DecideError::BadRequest("keyHash must be 64 lowercase hex characters".into()))?;
        let deadline = Instant::now() + self.store.decision_timeout();
        let (record, fresh_for) = self.record(&hash, deadline, false).await?;
        let now_ms = self.clock.now_ms();
        let mut response = apikey::verdict(record.as_ref(), now_ms / 1000);
        if let (Some(r), DecideResponse::Allow { .. }) = (&record, &response) {
            self.used.note(&hash, &r.key_id, now_ms);
        }
        // The route the filter matched: an id this replica does not know (yet, or any more)
        // has no effect — the tables converge within a refresh.
        // one read of plans and routing together: a route and the plan it names come from the
        // same configuration (decision 208)
        let config = self.in_force();
        let routing = &config.routing;
        let route = req.route.as_deref().and_then(|id| routing.route(id));
        let product = route.and_then(|r| r.product.as_ref());
        if let (Some(r), Some(p), DecideResponse::Allow { .. }) = (&record, product, &response) {
            if !routing.subscribes(&r.tenant, p) {
                response = DecideResponse::Deny {
                    status: 403,
                    error: codes::NOT_SUBSCRIBED.into(),
                    message: format!("this API key's tenant is not subscribed to the API product '{p}'"),
                    limit: None,
                    response_headers: vec![],
                };
            }
        }
        if let (Some(r), DecideResponse::Allow { .. }) = (&record, &response) {
            // before any limit or lease: a request outside the key's scopes takes nothing
            let asked = crate::scopes::Asked { route: req.route.as_deref(), product: product.map(Id::as_str), method: &req.method, client_ip: req.client_ip.as_deref() };
            if let Some(why) = r.scopes.refusal(&asked) {
                response = DecideResponse::Deny { status: 403, error: codes::KEY_SCOPE.into(), message: why, limit: None, response_headers: vec![] };
            }
        }
        let plan_override = route.and_then(|x| x.plan.as_deref());
        let policy = record.as_ref().and_then(|r| config.plans.models(plan_override.unwrap_or(r.plan.as_str())));
        // the model policy (issue 42 item 4): after the scopes, before any limit, lease or lookup
        let mut model_limits: &[Limit] = &[];
        let mut resolved: Option<DecideRequest> = None;
        if let (Some(r), DecideResponse::Allow { .. }) = (&record, &response) {
            match model_policy::judge(req, route, policy, r) {
                model_policy::Judged::Refused(deny) => response = deny,
                model_policy::Judged::Allowed { limits, aliased } => (model_limits, resolved) = (limits, aliased),
            }
        }
        let req = resolved.as_ref().unwrap_or(req);
        // a plan with a model policy, or a key with models, never gets a reusable answer: the
        // filter reuses one before it reads the body, where the model is (decision 306)
        let reusable = record.as_ref().is_some_and(|r| r.scopes.reusable()) && policy.is_none();
        let cx = Cx { req, product, now_ms, fresh: fresh_for.is_some(), deadline, routing, reusable };
        if req.lease.is_some_and(|l| l.renewal) {
            return Ok(self.renew(record.as_ref(), response, plan_override, &cx, &config).await);
        }
        if let (Some(r), DecideResponse::Allow { .. }) = (&record, &response) {
            let plan = plan_override.unwrap_or(r.plan.as_str());
            let limits = model_policy::with_plans(config.plans.limits(plan), model_limits);
            let route_cache = route.and_then(|x| x.cache.as_ref()).map(|(id, _)| id);
            let lookup = ResponseLookup::of(req, &r.tenant, &r.key_id, plan, route_cache);
            if !limits.is_empty() || lookup.is_some() {
                response = self.limit(&cx, r, &limits, lookup).await;
            } else if let (DecideResponse::Allow { cache_for_ms, .. }, Some(fresh_for), true) = (&mut response, fresh_for, cx.reusable) {
                // No limits: the answer is the same for every request of this key, so the filter
                // may reuse it while ours is fresh — never past the key's expiry: a revocation
                // still applies within one cache TTL end to end. Not for a key whose method or
                // client network decides: the filter's reuse does not look at them (decision 334).
                let ms = (fresh_for.as_millis() as u64).min(key_left_ms(r, now_ms));
                *cache_for_ms = (ms > 0).then_some(ms);
            }
        }
        model_policy::name_model(resolved.as_ref(), &mut response);
        match &response {
            DecideResponse::Allow { .. } => {
                metrics::counter!(m::DECISIONS, "outcome" => "allow", "reason" => "ok").increment(1);
            }
            DecideResponse::Deny { error, status, .. } => {
                let reason = codes::ALL_DENY.iter().find(|c| **c == error.as_str()).copied().unwrap_or("other");
                metrics::counter!(m::DECISIONS, "outcome" => "deny", "reason" => reason).increment(1);
                if let (Some(usage), Some(r)) = (&self.usage, &record) {
                    let mut event = crate::usage::denial_event(
                        r.tenant.as_str(),
                        r.key_id.as_str(),
                        r.plan.as_str(),
                        req,
                        *status,
                        error,
                        now_ms,
                    );
                    event.product = product.map(|p| p.to_string());
                    usage.record_denial(event);
                }
                if reason == codes::REVOKED_KEY || reason == codes::EXPIRED_KEY {
                    if let Some(r) = &record {
                        self.audit(r, reason);
                    }
                }
            }
        }
        Ok(response)
    }

    /// A lease renewal: the key is judged as for a decision (a revoked key's renewal is denied,
    /// which makes the filter drop its lease), then, for a leasable plan with a fresh key record,
    /// one script call takes the lease and nothing else.
    async fn renew(&self, record: Option<&KeyRecord>, verdict: DecideResponse, plan_override: Option<&str>, cx: &Cx<'_>, config: &InForce) -> DecideResponse {
        let (Some(r), DecideResponse::Allow { .. }) = (record, &verdict) else {
            metrics::counter!(m::LEASES, "call" => "renewal", "result" => "denied").increment(1);
            return verdict;
        };
        let limits = config.plans.limits(plan_override.unwrap_or(r.plan.as_str()));
        if !limits::leasable(limits) || !cx.fresh || !cx.reusable || limits::lease_ttl_ms(limits, cx.now_ms, key_left_ms(r, cx.now_ms)) == 0 {
            metrics::counter!(m::LEASES, "call" => "renewal", "result" => "none").increment(1);
            return verdict;
        }
        self.limit(cx, r, limits, None).await
    }

    /// Runs every limit of the plan, and the response lookup, in one script call and turns the
    /// reply into the answer.
    async fn limit(&self, cx: &Cx<'_>, r: &KeyRecord, limits: &[Limit], lookup: Option<ResponseLookup>) -> DecideResponse {
        let req = cx.req;
        // The decision's id keys what it takes (log member, slot, reservation, ticket): the
        // filter's own id for it, or one made here — never the client's `x-request-id`, which
        // would let a client make all its requests one log entry or one slot.
        let request_id = decision_id(req);
        // the table in force, read once per decision and only for a money budget's
        let pricing = self.pricing.as_ref().filter(|_| limits.iter().any(|l| l.algorithm == limits::Algorithm::SpendBudget)).map(|t| t.get());
        let ctx = RequestCtx {
            tenant: &r.tenant,
            key_id: &r.key_id,
            product: cx.product,
            client_ip: req.client_ip.as_deref().and_then(|s| s.parse().ok()),
            headers: &req.headers,
            request_id: &request_id,
            now_ms: cx.now_ms,
            token_estimate: req.token_estimate.filter(|n| *n > 0).map(|n| m::clamp_tokens(n, "estimate")),
            llm: req.llm.as_ref(),
            pricing: pricing.as_deref(),
        };
        if let Some((limit, why)) = checks::unpriced(limits, &ctx) {
            return answers::not_priced(limit, why);
        }
        let Checks { checks, meta } = checks::checks(limits, &ctx);
        let (lease, lease_ttl_ms) = Self::lease(cx, r, limits);
        // A decision the filter named can be reported abandoned (its answer lost): record what it
        // takes, in the same call, so the refund can give it back (issue 15.2). A renewal admits
        // no request, and an id made here is known to no filter.
        let record = (filter_named(req) && !req.lease.is_some_and(|l| l.renewal))
            .then(|| Record { key: DecisionRecordKey::new(&r.tenant, &request_id), ttl_ms: DECISION_RECORD_TTL_MS });
        let call = DecideCall {
            now_ms: cx.now_ms,
            request_id,
            limits: checks,
            lease,
            lookup: lookup.as_ref().map(|l| l.script_lookup(self.in_flight_ms, self.tenant_max_bytes)),
            record,
        };
        let reply = crate::trace::redis_call(self.store.decide(&call, cx.deadline.saturating_duration_since(Instant::now()))).await;
        let asked = Asked { meta, request_id: call.request_id, lease_ttl_ms, lookup };
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                let answer = self.limits_unavailable(cx, r, &asked, &e.to_string());
                // the script may still run and take for a request answered without Redis' limits
                if call.record.is_some() && late::may_still_run(&e) {
                    self.late.refund(&self.store, &self.clock, &r.tenant, &asked.request_id);
                }
                return answer;
            }
        };
        self.note_shadow_denials(r, &asked.meta, &reply.states);
        crate::telemetry::observe_limits(r.tenant.as_str(), &asked.meta, &reply.states, reply.denied);
        crate::alerts::observe(r.tenant.as_str(), checks::budget_uses(&asked.meta, &reply.states), cx.now_ms);
        match reply.denied {
            Some(i) => too_many(&asked.meta[i], &reply.states[i]),
            None => {
                let mut answer = self.allowed(cx, r, asked, reply);
                // the filter need not observe or ask for what is never granted
                if let (DecideResponse::Allow { no_lease, .. }, false) = (&mut answer, limits::leasable(limits) && cx.reusable) {
                    *no_lease = true;
                }
                answer
            }
        }
    }

    /// The lease a decision asks for with its limits, and how long it may be spent (0: none).
    /// Only for plans whose limits are all leased, only while the key record is fresh (so a
    /// revocation is seen within the cache TTL + the lease lifetime). A renewal says so even when
    /// nothing can be granted: it admits no request.
    fn lease(cx: &Cx<'_>, r: &KeyRecord, limits: &[Limit]) -> (Option<Lease>, u64) {
        let Some(ask) = cx.req.lease else { return (None, 0) };
        let ttl = match cx.fresh && limits::leasable(limits) && cx.reusable {
            true => limits::lease_ttl_ms(limits, cx.now_ms, key_left_ms(r, cx.now_ms)),
            false => 0,
        };
        let lease = (ttl > 0 || ask.renewal).then(|| checks::lease(if ttl > 0 { ask.want } else { 0 }, ask.renewal));
        (lease, ttl)
    }

    /// Redis could not answer the limits: each limit's failure mode applies — any fail-closed,
    /// non-shadow limit → 503; else any `local` one → this sidecar's share of the `local` limits
    /// decides (super::local; a renewal gets no lease and counts nothing); else allowed without
    /// limit headers. The lookup is a miss.
    fn limits_unavailable(&self, cx: &Cx<'_>, r: &KeyRecord, asked: &Asked, why: &str) -> DecideResponse {
        if let Some(l) = &asked.lookup {
            self.lookup_unavailable(l, why);
        }
        let applies = |mode| asked.meta.iter().any(|m| !m.shadow && m.failure_mode == mode);
        let mode = match (applies(LimitFailureMode::Closed), applies(LimitFailureMode::Local)) {
            (true, _) => "closed",
            (false, true) => "local",
            (false, false) => "open",
        };
        metrics::counter!(m::LIMITS_FAILED, "mode" => mode).increment(1);
        tracing::debug!(error = %why, mode, "limits could not be checked");
        match mode {
            "closed" => DecideResponse::Deny {
                status: 503,
                error: codes::LIMITS_UNAVAILABLE.into(),
                message: "rate limits cannot be checked right now".into(),
                limit: None,
                response_headers: vec![Header::new("retry-after", "1")],
            },
            "local" if !cx.req.lease.is_some_and(|l| l.renewal) => local::answer(&self.local, r, &asked.meta, cx.now_ms),
            // fail-open: a cache miss, an idempotency key executed without being recorded
            _ => allow(r, vec![], None, None, None, None),
        }
    }

    /// Counts the shadow limits that would have denied; logs each at most once a minute.
    fn note_shadow_denials(&self, r: &KeyRecord, meta: &[Meta], states: &[LimitState]) {
        for (meta, state) in meta.iter().zip(states) {
            if meta.shadow && state.would_deny {
                metrics::counter!(m::SHADOW_DENIALS, "limit" => meta.name.clone()).increment(1);
                let key = format!("{}/{}", r.tenant, meta.name);
                let now = Instant::now();
                if !matches!(self.shadow_logged.get(&key, now), Lookup::Fresh(..)) {
                    self.shadow_logged.insert(key, (), now);
                    tracing::info!(tenant = %r.tenant, plan = %r.plan, limit = %meta.name, "shadow limit would deny (logged at most once a minute)");
                }
            }
        }
    }

    /// Every limit passed: the nearest limit's headers, the lease, the ticket, and what the
    /// lookup found (a replay, a store ticket, or a 409/422).
    fn allowed(&self, cx: &Cx<'_>, r: &KeyRecord, asked: Asked, reply: DecideReply) -> DecideResponse {
        let nearest = checks::nearest(&asked.meta, &reply.states);
        let headers = nearest
            .map(|i| checks::ratelimit_headers(&asked.meta[i], &reply.states[i]).to_vec())
            .unwrap_or_default();
        let lease = (reply.granted > 0).then(|| tollgate_wire::Lease {
            units: reply.granted,
            ttl_ms: asked.lease_ttl_ms,
            // the policy only: the remaining count is known here, not where the lease is spent
            response_headers: headers.iter().filter(|h| h.name == "ratelimit-policy").cloned().collect(),
        });
        if let Some(ask) = cx.req.lease {
            let call = if ask.renewal { "renewal" } else { "request" };
            let result = if lease.is_some() { "granted" } else { "none" };
            metrics::counter!(m::LEASES, "call" => call, "result" => result).increment(1);
            if let Some(l) = &lease {
                metrics::counter!(m::LEASE_UNITS).increment(l.units);
            }
        }
        let (replay, store) = match (&asked.lookup, reply.outcome) {
            (None, _) => (None, None),
            (Some(l), o) => match self.apply_outcome(l, o) {
                Ok(x) => x,
                Err(deny) => return deny,
            },
        };
        let ticket = checks::ticket(&asked.meta, &r.tenant, &asked.request_id).map(|mut t| {
            self.tickets.seal(&mut t, cx.now_ms, checks::slot_hold_ms(&asked.meta));
            t
        });
        let store = store.map(|mut t| {
            // a cache ticket lives no longer than the entry it may write (written only where none
            // is, so a replay within its life finds the entry and changes nothing)
            let life = match &t {
                StoreTicket::Cache { route, .. } => cx.routing.cache_ttl_ms(route).unwrap_or(0).min(tickets::STORE_TICKET_TTL_MS),
                StoreTicket::Idempotency { .. } => self.in_flight_ms,
            };
            self.tickets.seal_store(&mut t, asked.request_id.as_str(), cx.now_ms + life);
            Box::new(t)
        });
        allow(r, headers, ticket, lease, replay, store)
    }

    /// The record of `hash` and, when it is fresh, how long it stays so. `off_path`: looked up
    /// for background work (a refund), not for a decision (DecisionStore::key_record).
    async fn record(&self, hash: &KeyHash, deadline: Instant, off_path: bool) -> Result<(Option<KeyRecord>, Option<Duration>), DecideError> {
        let now = Instant::now();
        let cached = self.cache.get(hash, now);
        if let Lookup::Fresh(r, left) = cached {
            metrics::counter!(m::CACHE, "result" => "fresh").increment(1);
            return Ok((r.map(|r| KeyRecord::clone(&r)), Some(left)));
        }
        let changes = self.changes.load(Ordering::Acquire);
        match crate::trace::redis_call(self.store.key_record(hash, deadline.saturating_duration_since(now), off_path)).await {
            Ok(r) => {
                metrics::counter!(m::CACHE, "result" => "miss").increment(1);
                if self.changes.load(Ordering::Acquire) != changes {
                    // An eviction came while Redis answered: the record may predate the change.
                    // Use it for this decision only, and let nobody reuse the answer.
                    return Ok((r, Some(Duration::ZERO)));
                }
                self.cache.insert(hash.clone(), r.clone().map(Arc::new), now);
                Ok((r, Some(self.ttl)))
            }
            Err(e) if e.is_about_the_record() => {
                // A malformed record is a store problem, not the caller's: treat as unknown.
                tracing::debug!(error = %e, "unreadable key record; treating it as unknown");
                Ok((None, None))
            }
            // Redis could not say (a timeout, a lost connection, or an error reply about itself:
            // `LOADING` after a restart, `BUSY`, `MASTERDOWN`, `NOPERM`): never "unknown key"
            // for a key that may be valid, but the stale grace, else the failure mode.
            Err(e) => match cached {
                Lookup::Stale(r) => {
                    metrics::counter!(m::CACHE, "result" => "stale").increment(1);
                    Ok((r.map(|r| KeyRecord::clone(&r)), None))
                }
                _ => {
                    if !off_path {
                        metrics::counter!(m::DECISIONS, "outcome" => "unavailable", "reason" => "redis").increment(1);
                    }
                    Err(DecideError::Unavailable(e.to_string()))
                }
            },
        }
    }

    /// One audit line per key per hour (`apikey:authfail:{keyId}`), fail-open: if Redis cannot
    /// say, the line is written anyway. Runs off the request path.
    fn audit(&self, record: &KeyRecord, reason: &'static str) {
        let now = Instant::now();
        if matches!(self.audited.get(&record.key_id, now), Lookup::Fresh(..)) {
            return;
        }
        self.audited.insert(record.key_id.clone(), (), now);
        let store = self.store.clone();
        let (key_id, tenant) = (record.key_id.clone(), record.tenant.clone());
        tokio::spawn(async move {
            let write = store.claim_audit(&key_id).await.unwrap_or(true);
            if write {
                metrics::counter!(m::AUDITS).increment(1);
                tracing::info!(target: "audit", event = "api_key.auth_failure", key_id = %key_id, tenant = %tenant, reason);
            }
        });
    }
}
