//! The decision path: a filter's [`DecideRequest`] in, a [`DecideResponse`] out; and the
//! completion path that settles what an allowed request held.
//!
//! A decision is authentication (the key hash, from the local cache or one Redis HGETALL) and then
//! every limit of the key's plan in ONE `decide.lua` call. With the key record cached (the usual
//! case) a decision costs one Redis round trip; without limits, none.
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

pub mod cache;
pub mod hints;
pub mod limits;
pub mod responses;
pub mod routing;

pub use routing::Routing;

use crate::apikey::{self, KeyRecord};
use cache::{CacheConfig, Lookup, TtlCache};
use responses::{Lookup as ResponseLookup, Outcome};
use tollgate_wire::responses::{Replay, ReplayKind, StoreTicket};
use crate::clock::Clock;

use crate::keys::{ConcurrencyKey, Id, KeyHash, ReservationKey, Subject, TokenBudgetKey};
use limits::{LimitFailureMode, Plans, RequestCtx};
use crate::metrics as m;
use crate::store::{CompleteCall, Store, StoreError};
use rand::distr::{Alphanumeric, SampleString};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate_wire::{codes, Completion, DecideRequest, DecideResponse, Header};

#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("cannot decide now: {0}")]
    Unavailable(String),
}

pub struct Decider {
    store: Store,
    ttl: Duration,
    cache: TtlCache<KeyHash, Option<KeyRecord>>,
    /// Keys audited recently by this process: spares Redis the SET NX on every repeat.
    audited: TtlCache<Id, ()>,
    /// Shadow denials logged recently, per limit (a log line at most once a minute each).
    shadow_logged: TtlCache<String, ()>,
    plans: std::sync::RwLock<Arc<Plans>>,
    clock: Arc<dyn Clock>,
    /// Usage metering: denials of known tenants become usage events.
    usage: Option<Arc<crate::usage::Usage>>,
    routing: std::sync::RwLock<Arc<Routing>>,
}

/// Wall-clock unix seconds.
pub fn unix_now() -> u64 {
    crate::clock::SystemClock.now_ms() / 1000
}

impl Decider {
    pub fn new(store: Store, cache: &CacheConfig, plans: Plans, clock: Arc<dyn Clock>) -> Decider {
        let minute = Duration::from_secs(60);
        Decider {
            store,
            ttl: cache.ttl,
            cache: TtlCache::new(cache.ttl, cache.stale_grace, cache.max_entries),
            audited: TtlCache::new(minute, minute, cache.max_entries),
            shadow_logged: TtlCache::new(minute, minute, 10_000),
            plans: std::sync::RwLock::new(Arc::new(plans)),
            clock,
            usage: None,
            routing: std::sync::RwLock::new(Arc::new(Routing::default())),
        }
    }

    /// Meters this decider's denials into `usage` (when metering is on).
    pub fn with_usage(mut self, usage: Option<Arc<crate::usage::Usage>>) -> Decider {
        self.usage = usage;
        self
    }

    pub async fn decide(&self, req: &DecideRequest) -> Result<DecideResponse, DecideError> {
        let hash = KeyHash::parse(&req.key_hash)
            .ok_or_else(|| DecideError::BadRequest("keyHash must be 64 lowercase hex characters".into()))?;
        let (record, fresh_for) = self.record(&hash).await?;
        let now_ms = self.clock.now_ms();
        let mut response = apikey::verdict(record.as_ref(), now_ms / 1000);
        // The route the filter matched: an id this replica does not know (yet, or any more)
        // has no effect — the tables converge within a refresh.
        let routing = self.routing();
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
        let plan_override = route.and_then(|x| x.plan.as_deref());
        if req.lease.is_some_and(|l| l.renewal) {
            return Ok(self.renew(record.as_ref(), fresh_for.is_some(), response, req, plan_override, product, now_ms).await);
        }
        if let (Some(r), DecideResponse::Allow { .. }) = (&record, &response) {
            let plans = self.plans();
            let plan = plan_override.unwrap_or(r.plan.as_str());
            let limits = plans.limits(plan);
            let route_cache = route.and_then(|x| x.cache.as_ref()).map(|(id, _)| id);
            let lookup = ResponseLookup::of(req, &r.tenant, &r.key_id, route_cache);
            if !limits.is_empty() || lookup.is_some() {
                response = self.limit(r, limits, req, product, now_ms, lookup, fresh_for.is_some()).await;
            } else if let (DecideResponse::Allow { cache_for_ms, .. }, Some(fresh_for)) = (&mut response, fresh_for) {
                // No limits: the answer is the same for every request of this key, so the filter
                // may reuse it while ours is fresh — never past the key's expiry: a revocation
                // still applies within one cache TTL end to end.
                let until_expiry = r.expires_at.map_or(u64::MAX, |e| (e * 1000).saturating_sub(now_ms));
                let ms = (fresh_for.as_millis() as u64).min(until_expiry);
                *cache_for_ms = (ms > 0).then_some(ms);
            }
        }
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
    #[allow(clippy::too_many_arguments)]
    async fn renew(
        &self,
        record: Option<&KeyRecord>,
        fresh: bool,
        verdict: DecideResponse,
        req: &DecideRequest,
        plan_override: Option<&str>,
        product: Option<&Id>,
        now_ms: u64,
    ) -> DecideResponse {
        let (Some(r), DecideResponse::Allow { .. }) = (record, &verdict) else {
            metrics::counter!(m::LEASES, "call" => "renewal", "result" => "denied").increment(1);
            return verdict;
        };
        let plans = self.plans();
        let limits = plans.limits(plan_override.unwrap_or(r.plan.as_str()));
        let key_left_ms = r.expires_at.map_or(u64::MAX, |e| (e * 1000).saturating_sub(now_ms));
        if !limits::leasable(limits) || !fresh || limits::lease_ttl_ms(limits, now_ms, key_left_ms) == 0 {
            metrics::counter!(m::LEASES, "call" => "renewal", "result" => "none").increment(1);
            return verdict;
        }
        self.limit(r, limits, req, product, now_ms, None, fresh).await
    }

    /// Runs every limit of the plan, and the response lookup, in one script call and turns the
    /// reply into the answer.
    #[allow(clippy::too_many_arguments)]
    async fn limit(
        &self,
        r: &KeyRecord,
        limits: &[limits::Limit],
        req: &DecideRequest,
        product: Option<&Id>,
        now_ms: u64,
        lookup: Option<ResponseLookup>,
        fresh: bool,
    ) -> DecideResponse {
        let request_id = req
            .request_id
            .as_deref()
            .and_then(Id::parse)
            .unwrap_or_else(|| Id::parse(&Alphanumeric.sample_string(&mut rand::rng(), 24)).expect("alphanumeric id"));
        let ctx = RequestCtx {
            tenant: &r.tenant,
            key_id: &r.key_id,
            product,
            client_ip: req.client_ip.as_deref().and_then(|s| s.parse().ok()),
            headers: &req.headers,
            request_id: &request_id,
            now_ms,
            token_estimate: req.token_estimate.filter(|n| *n > 0),
        };
        let mut inv = limits::invocation(limits, &ctx);
        // Leases: only for plans whose limits are all leased, only while the key record is fresh
        // (so a revocation is seen within the cache TTL + the lease lifetime).
        let renewal = req.lease.is_some_and(|l| l.renewal);
        let key_left_ms = r.expires_at.map_or(u64::MAX, |e| (e * 1000).saturating_sub(now_ms));
        let lease_ttl = match req.lease {
            Some(_) if fresh && limits::leasable(limits) => limits::lease_ttl_ms(limits, now_ms, key_left_ms),
            _ => 0,
        };
        let leasing = req.lease.is_some() && (lease_ttl > 0 || renewal);
        if let (Some(ask), true) = (req.lease, leasing) {
            inv = limits::with_lease(inv, if lease_ttl > 0 { ask.want } else { 0 }, renewal);
        }
        if let Some(l) = &lookup {
            if !leasing {
                // the lookup's arguments follow the lease's, so those are present: no lease
                inv = limits::with_lease(inv, 0, false);
            }
            l.append_to(&mut inv);
        }
        let mut outcome = None;
        let verdict = match self.store.run_decide(&inv).await {
            Ok(reply) => responses::split_reply(reply).and_then(|(numbers, o)| {
                outcome = o;
                limits::read_reply(&numbers, inv.meta.len())
            }),
            Err(e) => Err(e.to_string()),
        };
        let allow = |response_headers: Vec<Header>, ticket, lease, replay, store| DecideResponse::Allow {
            tenant: r.tenant.to_string(),
            key_id: r.key_id.to_string(),
            plan: r.plan.to_string(),
            request_headers: vec![],
            response_headers,
            cache_for_ms: None,
            ticket,
            replay,
            store,
            lease,
        };
        let verdict = match verdict {
            Ok(v) => v,
            Err(why) => {
                if let Some(l) = &lookup {
                    self.lookup_unavailable(l, &why);
                }
                let closed = inv.meta.iter().any(|m| !m.shadow && m.failure_mode == LimitFailureMode::Closed);
                let mode = if closed { "closed" } else { "open" };
                metrics::counter!(m::LIMITS_FAILED, "mode" => mode).increment(1);
                tracing::debug!(error = %why, mode, "limits could not be checked");
                return if closed {
                    DecideResponse::Deny {
                        status: 503,
                        error: codes::LIMITS_UNAVAILABLE.into(),
                        message: "rate limits cannot be checked right now".into(),
                        limit: None,
                        response_headers: vec![Header::new("retry-after", "1")],
                    }
                } else {
                    // fail-open: a cache miss, an idempotency key executed without being recorded
                    allow(vec![], None, None, None, None)
                };
            }
        };
        for (meta, state) in inv.meta.iter().zip(&verdict.states) {
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
        match verdict.denied {
            Some(i) => {
                let (meta, state) = (&inv.meta[i], &verdict.states[i]);
                let mut headers = vec![Header::new("retry-after", state.reset_ms.div_ceil(1000).max(1).to_string())];
                headers.extend(limits::ratelimit_headers(meta, state));
                DecideResponse::Deny {
                    status: 429,
                    error: limits::deny_code(meta.algorithm).into(),
                    message: format!("limit '{}' exceeded", meta.name),
                    limit: Some(meta.name.clone()),
                    response_headers: headers,
                }
            }
            None => {
                let nearest = limits::nearest(&inv.meta, &verdict.states);
                let headers = nearest
                    .map(|i| limits::ratelimit_headers(&inv.meta[i], &verdict.states[i]).to_vec())
                    .unwrap_or_default();
                let lease = (verdict.granted > 0).then(|| tollgate_wire::Lease {
                    units: verdict.granted,
                    ttl_ms: lease_ttl,
                    // the policy only: the remaining count is known here, not where the lease is spent
                    response_headers: headers.iter().filter(|h| h.name == "ratelimit-policy").cloned().collect(),
                });
                if req.lease.is_some() {
                    let call = if renewal { "renewal" } else { "request" };
                    let result = if lease.is_some() { "granted" } else { "none" };
                    metrics::counter!(m::LEASES, "call" => call, "result" => result).increment(1);
                    if let Some(l) = &lease {
                        metrics::counter!(m::LEASE_UNITS).increment(l.units);
                    }
                }
                let (replay, store) = match (lookup, outcome) {
                    (None, _) => (None, None),
                    (Some(l), o) => match self.apply_outcome(&l, o) {
                        Ok(x) => x,
                        Err(deny) => return deny,
                    },
                };
                allow(headers, limits::ticket(&inv.meta, &r.tenant, &request_id), lease, replay, store.map(Box::new))
            }
        }
    }

    /// What a lookup's outcome means for the answer: a replay, a store ticket, or a 409/422.
    #[allow(clippy::result_large_err)]
    fn apply_outcome(&self, l: &ResponseLookup, o: Option<Outcome>) -> Result<(Option<Box<Replay>>, Option<StoreTicket>), DecideResponse> {
        let count = |name: &'static str, label: &'static str, v: &'static str| metrics::counter!(name, label => v).increment(1);
        let deny = |status: u16, error: &str, message: &str| DecideResponse::Deny {
            status,
            error: error.into(),
            message: message.into(),
            limit: None,
            response_headers: vec![],
        };
        match o {
            Some(Outcome::Hit(json)) => match responses::read_stored(&json) {
                Some(response) => {
                    count(responses::CACHE_LOOKUPS, "result", "hit");
                    Ok((Some(Box::new(Replay { kind: ReplayKind::Cache, response })), None))
                }
                // unreadable: overwrite it with the fresh response
                None => Ok((None, Some(l.ticket()))),
            },
            Some(Outcome::Miss) => {
                count(responses::CACHE_LOOKUPS, "result", "miss");
                Ok((None, Some(l.ticket())))
            }
            Some(Outcome::Claimed) => {
                count(responses::IDEMPOTENCY, "outcome", "claimed");
                Ok((None, Some(l.ticket())))
            }
            Some(Outcome::Replay(json)) => match responses::read_stored(&json) {
                Some(response) => {
                    count(responses::IDEMPOTENCY, "outcome", "replayed");
                    Ok((Some(Box::new(Replay { kind: ReplayKind::Idempotency, response })), None))
                }
                None => {
                    self.lookup_unavailable(l, "an unreadable idempotency memo");
                    Ok((None, None))
                }
            },
            Some(Outcome::InFlight) => {
                count(responses::IDEMPOTENCY, "outcome", "in_flight");
                Err(deny(409, codes::IDEMPOTENCY_IN_FLIGHT, "a request with this Idempotency-Key is still being processed"))
            }
            Some(Outcome::Conflict) => {
                count(responses::IDEMPOTENCY, "outcome", "conflict");
                Err(deny(
                    422,
                    codes::IDEMPOTENCY_KEY_REUSED,
                    "this Idempotency-Key was used for a different request (method, path or body)",
                ))
            }
            None => {
                self.lookup_unavailable(l, "decide.lua returned no lookup outcome");
                Ok((None, None))
            }
        }
    }

    /// Redis could not answer a lookup: a cache miss, or (seed 002) an idempotency key executed
    /// without being recorded — logged at most once a minute.
    fn lookup_unavailable(&self, l: &ResponseLookup, why: &str) {
        if !l.is_idempotency() {
            metrics::counter!(responses::CACHE_LOOKUPS, "result" => "unavailable").increment(1);
            return;
        }
        metrics::counter!(responses::IDEMPOTENCY, "outcome" => "unavailable").increment(1);
        let now = Instant::now();
        let key = "\0idempotency".to_string();
        if !matches!(self.shadow_logged.get(&key, now), Lookup::Fresh(..)) {
            self.shadow_logged.insert(key, (), now);
            tracing::warn!(error = %why, "idempotency keys are executed without being recorded: Redis cannot answer (logged at most once a minute)");
        }
    }

    /// The record of `hash` and, when it is fresh, how long it stays so.
    async fn record(&self, hash: &KeyHash) -> Result<(Option<KeyRecord>, Option<Duration>), DecideError> {
        let now = Instant::now();
        let cached = self.cache.get(hash, now);
        if let Lookup::Fresh(r, left) = cached {
            metrics::counter!(m::CACHE, "result" => "fresh").increment(1);
            return Ok((r, Some(left)));
        }
        match self.store.lookup(hash).await {
            Ok(r) => {
                metrics::counter!(m::CACHE, "result" => "miss").increment(1);
                self.cache.insert(hash.clone(), r.clone(), now);
                Ok((r, Some(self.ttl)))
            }
            Err(e) if e.is_transient() => match cached {
                Lookup::Stale(r) => {
                    metrics::counter!(m::CACHE, "result" => "stale").increment(1);
                    Ok((r, None))
                }
                _ => {
                    metrics::counter!(m::DECISIONS, "outcome" => "unavailable", "reason" => "redis").increment(1);
                    Err(DecideError::Unavailable(e.to_string()))
                }
            },
            Err(e) => {
                // A malformed record is a store problem, not the caller's: treat as unknown.
                tracing::debug!(error = %e, "unreadable key record; treating it as unknown");
                Ok((None, None))
            }
        }
    }

    /// Settles one completed request: its token reservations (actual vs reserved) and its
    /// concurrency slots. Idempotent (a retried report changes nothing twice).
    pub async fn complete(&self, c: &Completion) -> Result<(), CompleteError> {
        let t = &c.ticket;
        let bad = |what: &str| CompleteError::BadTicket(what.to_string());
        let tenant = Id::parse(&t.tenant).ok_or_else(|| bad("tenant"))?;
        let request_id = Id::parse(&t.request_id).ok_or_else(|| bad("requestId"))?;
        let mut slots = Vec::new();
        for s in &t.slots {
            let limit = Id::parse(&s.limit).ok_or_else(|| bad("slots.limit"))?;
            let subject = Subject::parse(&s.subject).ok_or_else(|| bad("slots.subject"))?;
            slots.push(ConcurrencyKey::new(&tenant, &limit, &subject));
        }
        let mut calls = Vec::new();
        for b in &t.budgets {
            let limit = Id::parse(&b.limit).ok_or_else(|| bad("budgets.limit"))?;
            let subject = Subject::parse(&b.subject).ok_or_else(|| bad("budgets.subject"))?;
            if !(190_001..=999_912).contains(&b.period) {
                return Err(bad("budgets.period"));
            }
            calls.push(CompleteCall {
                budget: Some((
                    TokenBudgetKey::new(&tenant, &limit, &subject, b.period),
                    ReservationKey::new(&tenant, &request_id),
                )),
                slot: slots.pop(),
                // No usage reported: the reservation stands as the charge.
                actual: c.tokens.unwrap_or(b.reserved),
                estimate: b.reserved,
                request_id: request_id.to_string(),
            });
        }
        for slot in slots {
            calls.push(CompleteCall { budget: None, slot: Some(slot), actual: 0, estimate: 0, request_id: request_id.to_string() });
        }
        for call in calls {
            let (delta, found) = self.store.run_complete(call).await?;
            let outcome = match found {
                1 => "reconciled",
                2 => "duplicate",
                _ => "expired",
            };
            metrics::counter!(m::COMPLETIONS, "outcome" => outcome).increment(1);
            if delta > 0 {
                metrics::counter!(m::BUDGET_DELTA, "direction" => "overrun").increment(delta as u64);
            } else if delta < 0 {
                metrics::counter!(m::BUDGET_DELTA, "direction" => "refund").increment(delta.unsigned_abs());
            }
        }
        Ok(())
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
            let write = store.claim_auth_failure_audit(&key_id).await.unwrap_or(true);
            if write {
                metrics::counter!(m::AUDITS).increment(1);
                tracing::info!(target: "audit", event = "api_key.auth_failure", key_id = %key_id, tenant = %tenant, reason);
            }
        });
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CompleteError {
    #[error("invalid ticket field {0}")]
    BadTicket(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Live reconfiguration (crate::control::propagation): swap the plans, evict cached key answers.
impl Decider {
    /// The plans in force now.
    pub fn plans(&self) -> Arc<Plans> {
        self.plans.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The routing in force now.
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the routing; decisions and table reads after this call use the new one.
    pub fn set_routing(&self, routing: Routing) {
        *self.routing.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(routing);
    }

    /// Replaces the plans; decisions after this call use the new ones.
    pub fn set_plans(&self, plans: Plans) {
        *self.plans.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(plans);
    }

    /// Forgets the cached answers for `tenant`'s keys, and every cached "no such key" (a key just
    /// issued must not stay unknown for a TTL). `None` forgets everything.
    pub fn evict(&self, tenant: Option<&Id>) {
        self.cache.retain(|_, r| match (tenant, r) {
            (None, _) | (_, None) => false,
            (Some(t), Some(r)) => &r.tenant != t,
        });
    }
}
