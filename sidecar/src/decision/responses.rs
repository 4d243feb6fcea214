//! The response cache and Idempotency-Key replay on the sidecar's side (issue 7).
//!
//! Lookups ride on the decision: a [`Lookup`] goes in the one `decide.lua` call of the request
//! ([`Lookup::script_lookup`]), so a decision with limits, a cache lookup or an idempotency claim
//! still costs one Redis round trip (with the key record cached). The script answers an
//! [`Outcome`]; [`crate::decision`] turns it into a replay, a store ticket or a 409/422.
//!
//! Storing is off the request path: the filter sends finished responses in batches to
//! `POST /v1/responses` ([`store_batch`]). A cache entry runs `store_response.lua` (`SET … NX PX
//! <route TTL>`); an idempotency outcome runs `idem_complete.lua` (store the 2xx response for
//! 24 h, or release the claim). Everything the filter echoes back is validated again, and the TTL
//! is the sidecar's own route configuration, never the filter's word.
//!
//! Each tenant holds at most [`ResponsesConfig::tenant_max_mb`] of stored responses at once
//! (decision 185), counted by both scripts in the tenant's ledger (`responses:live:{tenant}`,
//! `responses:bytes:{tenant}`): one tenant's stores cannot fill the Redis that every tenant's
//! limits live in. Past it a cache entry is not stored (a later miss), and an idempotency outcome
//! is stored without its body (its status and headers, marked truncated, as a too-large one is:
//! the operation still never runs twice).
//!
//! Failure policy (seeds 002 and 004): Redis unavailable → a cache lookup is a miss and nothing
//! is stored; an idempotency key executes without being recorded (fail-open), logged at most once
//! a minute. Cache stores are best effort and not retried: a lost cache entry is a later miss. An
//! idempotency outcome Redis could not take is kept and tried again ([`super::outcomes`]) for as
//! long as its in-flight marker can live ([`IDEMPOTENCY_IN_FLIGHT_TTL_MS`]).

use crate::keys::{
    CacheHash, Id, IdemKey, IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest, ResponseCacheKey, ResponsesBytesKey,
    ResponsesLiveKey, IDEMPOTENCY_IN_FLIGHT_TTL_MS, IDEMPOTENCY_TTL_MS,
};
use crate::scripts::decide::Lookup as ScriptLookup;
use crate::scripts::idem_complete::{self, IdemComplete, Settled};
use crate::scripts::idem_keep;
use crate::scripts::store_response::{self, StoreResponse, Stored};
use crate::store::Store;
use super::tickets::TicketKey;
use serde::{Deserialize, Serialize};
use rand::distr::{Alphanumeric, SampleString};
use tollgate_wire::responses::{ClaimRenewal, ClaimsKept, StoreAck, StoreBatch, StoreItem, StoreTicket, StoredResponse, MAX_STORED_BODY};
use tollgate_wire::DecideRequest;

/// Metric: response-cache lookups, labelled `result` (hit | miss | unavailable).
pub const CACHE_LOOKUPS: &str = "tollgate_sidecar_response_cache_total";
/// Metric: idempotency decisions, labelled `outcome` (claimed | replayed | in_flight | conflict |
/// storage_full | unavailable).
pub const IDEMPOTENCY: &str = "tollgate_sidecar_idempotency_total";
/// Metric: stored-response items, labelled `kind` (cache | idempotency) and `outcome` (stored |
/// released | refused | failed | over_bound: the tenant's bound of stored bytes was reached — a
/// cache entry not stored, an idempotency outcome stored without its body).
pub const STORES: &str = "tollgate_sidecar_responses_stored_total";

/// Metric: idempotency claims a worker asked to keep while their request runs (decision 186),
/// labelled `outcome` (kept | gone: no longer the request's | refused: an invalid ticket |
/// failed: Redis did not answer, asked again).
pub const CLAIMS_KEPT: &str = "tollgate_sidecar_idempotency_claims_kept_total";

/// `[responses]`: responses stored in Redis (decisions 185, 186).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// MiB of stored responses (cached entries and idempotency outcomes, as stored) one tenant
    /// may hold in Redis at once; 1 to 1,048,576.
    pub tenant_max_mb: u64,
    /// How long an idempotency claim stays in flight without word from the request that holds it
    /// (its worker keeps it while the request runs, decision 186): how long retries get 409
    /// after an Envoy that ran the request died. 1 s to 24 h.
    #[serde(with = "humantime_serde")]
    pub idempotency_in_flight: std::time::Duration,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        ResponsesConfig { tenant_max_mb: 256, idempotency_in_flight: std::time::Duration::from_millis(IDEMPOTENCY_IN_FLIGHT_TTL_MS) }
    }
}

impl ResponsesConfig {
    /// Largest `tenant_max_mb`: 1 TiB.
    pub const MAX_MB: u64 = 1 << 20;

    /// The bound in bytes.
    pub fn tenant_max_bytes(&self) -> u64 {
        self.tenant_max_mb.min(Self::MAX_MB) << 20
    }
}

/// The one response lookup of a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Cache { key: ResponseCacheKey, ticket: StoreTicket },
    Idempotency {
        owner: IdempotencyOwnerKey,
        memo: IdempotencyMemoKey,
        digest: RequestDigest,
        token: String,
        ticket: StoreTicket,
        /// The tenant's ledger of stored bytes (decision 185).
        live: ResponsesLiveKey,
        bytes: ResponsesBytesKey,
    },
}

impl Lookup {
    /// The lookup `req` asks for, for the key's `tenant` and `key_id`, decided on `plan`: an
    /// idempotency claim when it carries a valid key and digest, else a cache lookup when it
    /// carries a valid hash and its route caches (`route_cache`: the route's key segment, when its
    /// TTL is set; decision 202). Invalid inputs ask for nothing (the request is then simply
    /// forwarded).
    pub fn of(req: &DecideRequest, tenant: &Id, key_id: &Id, plan: &str, route_cache: Option<&Id>) -> Option<Lookup> {
        if let Some(i) = &req.idempotency {
            let (Some(idem), Some(digest)) = (IdemKey::parse(&i.key), RequestDigest::parse(&i.digest)) else {
                return None;
            };
            let token = Alphanumeric.sample_string(&mut rand::rng(), 20);
            return Some(Lookup::Idempotency {
                live: ResponsesLiveKey::new(tenant),
                bytes: ResponsesBytesKey::new(tenant),
                owner: IdempotencyOwnerKey::new(tenant, key_id, &idem),
                memo: IdempotencyMemoKey::new(tenant, key_id, &digest, &idem),
                ticket: StoreTicket::Idempotency {
                    tenant: tenant.to_string(),
                    key_id: key_id.to_string(),
                    digest: digest.as_str().to_string(),
                    key: i.key.clone(),
                    token: token.clone(),
                    seal: Default::default(),
                },
                digest,
                token,
            });
        }
        let segment = route_cache?;
        let route = req.route.as_deref()?;
        let hash = CacheHash::parse(req.cache_key.as_deref()?)?;
        let plan = Id::parse(plan)?;
        Some(Lookup::Cache {
            key: ResponseCacheKey::new(tenant, &plan, segment, &hash),
            ticket: StoreTicket::Cache {
                tenant: tenant.to_string(),
                plan: plan.to_string(),
                route: route.to_string(),
                hash: hash.as_str().to_string(),
                seal: Default::default(),
            },
        })
    }

    /// This lookup as part of the decision's `decide.lua` call; a claim is in flight for
    /// `in_flight_ttl_ms` (kept longer while its request runs: decision 186), and refused while
    /// its tenant holds `tenant_max_bytes` of stored responses (decision 185).
    pub fn script_lookup(&self, in_flight_ttl_ms: u64, tenant_max_bytes: u64) -> ScriptLookup {
        match self {
            Lookup::Cache { key, .. } => ScriptLookup::Cache { key: key.clone() },
            Lookup::Idempotency { owner, memo, digest, token, live, bytes, .. } => ScriptLookup::Idempotency {
                owner: owner.clone(),
                memo: memo.clone(),
                digest: digest.clone(),
                token: token.clone(),
                in_flight_ttl_ms,
                owner_ttl_ms: IDEMPOTENCY_TTL_MS,
                live: live.clone(),
                bytes: bytes.clone(),
                bound: tenant_max_bytes,
            },
        }
    }

    pub fn ticket(&self) -> StoreTicket {
        match self {
            Lookup::Cache { ticket, .. } | Lookup::Idempotency { ticket, .. } => ticket.clone(),
        }
    }

    pub fn is_idempotency(&self) -> bool {
        matches!(self, Lookup::Idempotency { .. })
    }
}

/// What the script found (crate::scripts::decide).
pub use crate::scripts::decide::Outcome;

/// A stored response read back from Redis, or `None` when it is not one (then it is not used).
pub fn read_stored(json: &str) -> Option<StoredResponse> {
    let r: StoredResponse = serde_json::from_str(json).ok()?;
    ((100..=599).contains(&r.status)).then_some(r)
}

/// Whether a response may be cached: a successful status (2xx but 206) within the size bounds.
fn storable(r: &StoredResponse) -> bool {
    (200..=299).contains(&r.status) && r.status != 206 && within_bounds(r)
}

fn within_bounds(r: &StoredResponse) -> bool {
    r.body_len() <= MAX_STORED_BODY && r.headers.len() <= MAX_STORED_HEADERS
}

/// Headers a stored response keeps at most.
const MAX_STORED_HEADERS: usize = 64;

/// What of an idempotency outcome is kept: any 2xx (a 206 too: the operation ran), whole when it
/// is within the bounds, else its status and first headers without its body, marked truncated
/// — never released, so a retry replays it and never runs the operation again (decision 49).
/// The same without its body goes beside a whole one that has a body: it is stored instead when
/// the whole would take the tenant past its bound (decision 185).
/// Not a 2xx: `None`, the claim is released.
fn idempotent_outcome(r: &StoredResponse) -> Option<Result<idem_complete::Outcome, serde_json::Error>> {
    if !(200..=299).contains(&r.status) {
        return None;
    }
    let without_body = || {
        let headers = r.headers.iter().take(MAX_STORED_HEADERS).cloned().collect();
        let mut kept = StoredResponse::new(r.status, headers, Vec::new(), r.stored_at_ms);
        kept.truncated = true;
        serde_json::to_string(&kept)
    };
    Some((|| {
        if !within_bounds(r) {
            return Ok(idem_complete::Outcome { json: without_body()?, without_body: None });
        }
        let json = serde_json::to_string(r)?;
        let without_body = if r.body_len() > 0 { Some(without_body()?) } else { None };
        Ok(idem_complete::Outcome { json, without_body })
    })())
}

/// Where a cache ticket's response goes and for how long, after validating every field.
/// `route_cache` gives the key segment and TTL of a route id in the configuration in force (none:
/// not caching).
pub fn cache_target(ticket: &StoreTicket, route_cache: impl Fn(&str) -> Option<(Id, u64)>) -> Option<(ResponseCacheKey, u64)> {
    let StoreTicket::Cache { tenant, plan, route, hash, .. } = ticket else { return None };
    let (tenant, plan, hash) = (Id::parse(tenant)?, Id::parse(plan)?, CacheHash::parse(hash)?);
    let (segment, ttl) = route_cache(route)?;
    Some((ResponseCacheKey::new(&tenant, &plan, &segment, &hash), ttl))
}

/// The keys, digest and token of an idempotency ticket, after validating every field.
pub fn idempotency_target(ticket: &StoreTicket) -> Option<(IdempotencyOwnerKey, IdempotencyMemoKey, RequestDigest, String)> {
    let StoreTicket::Idempotency { tenant, key_id, digest, key, token, .. } = ticket else { return None };
    let (tenant, key_id, digest, idem) = (Id::parse(tenant)?, Id::parse(key_id)?, RequestDigest::parse(digest)?, IdemKey::parse(key)?);
    if token.is_empty() || token.len() > 64 || !token.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return None;
    }
    Some((IdempotencyOwnerKey::new(&tenant, &key_id, &idem), IdempotencyMemoKey::new(&tenant, &key_id, &digest, &idem), digest, token.clone()))
}

enum Done {
    Stored,
    Released,
    Refused,
    Failed,
    /// The tenant's bound was reached: a cache entry not stored, an outcome stored without its body.
    OverBound,
}

/// What storing a batch needs besides its items.
pub struct Storing<'a, F> {
    /// The key segment and TTL of a route id in the configuration in force (none: not caching).
    pub route_cache: F,
    pub tickets: &'a TicketKey,
    pub now_ms: u64,
    /// [`ResponsesConfig::tenant_max_bytes`].
    pub tenant_max_bytes: u64,
    /// [`ResponsesConfig::idempotency_in_flight`] in ms: how long an outcome Redis could not take
    /// is tried again.
    pub in_flight_ms: u64,
}

/// The tenant's ledger of stored bytes (decision 185).
fn ledger(tenant: &str) -> Option<(ResponsesLiveKey, ResponsesBytesKey)> {
    let tenant = Id::parse(tenant)?;
    Some((ResponsesLiveKey::new(&tenant), ResponsesBytesKey::new(&tenant)))
}

/// How long a cache entry lives (decision 211): the route's TTL, or the response's own freshness
/// left (`Cache-Control` `s-maxage` / `max-age` less `Age`, as the filter read it) when that is
/// shorter; `None` when the response was stale already.
pub fn entry_ttl_ms(route_ttl_ms: u64, own_ms: Option<u64>) -> Option<u64> {
    Some(own_ms.map_or(route_ttl_ms, |own| own.min(route_ttl_ms))).filter(|ms| *ms > 0)
}

async fn store_one<F: Fn(&str) -> Option<(Id, u64)> + Sync>(store: &Store, item: &StoreItem, with: &Storing<'_, F>) -> (&'static str, Done) {
    let kind = match item.ticket {
        StoreTicket::Cache { .. } => "cache",
        StoreTicket::Idempotency { .. } => "idempotency",
    };
    if let Err(why) = with.tickets.verify_store(&item.ticket, with.now_ms) {
        tracing::debug!(kind, reason = why.as_str(), "refused a response's ticket");
        return (kind, Done::Refused);
    }
    match &item.ticket {
        t @ StoreTicket::Cache { tenant, .. } => {
            let response = item.response.as_ref().filter(|r| storable(r));
            let (Some((key, route_ttl_ms)), Some((live, bytes)), Some(r)) = (cache_target(t, &with.route_cache), ledger(tenant), response) else {
                return (kind, Done::Refused);
            };
            let Some(ttl_ms) = entry_ttl_ms(route_ttl_ms, item.max_age_ms) else { return (kind, Done::Refused) };
            let Ok(json) = serde_json::to_string(r) else { return (kind, Done::Refused) };
            // three quarters of the bound for cache fills: the rest stays for idempotency outcomes
            let bound = with.tenant_max_bytes / 4 * 3;
            let call = StoreResponse { key, live, bytes, json, ttl_ms, now_ms: with.now_ms, bound };
            match store_response::run(store, &call).await {
                Ok(Stored::Stored) => (kind, Done::Stored),
                // never over an entry (decision 89)
                Ok(Stored::Exists) => (kind, Done::Refused),
                Ok(Stored::OverBound) => (kind, Done::OverBound),
                Err(e) => {
                    tracing::debug!(error = %e, "a response could not be cached");
                    (kind, Done::Failed)
                }
            }
        }
        t @ StoreTicket::Idempotency { tenant, .. } => {
            let (Some((owner, memo, digest, token)), Some((live, bytes))) = (idempotency_target(t), ledger(tenant)) else {
                return (kind, Done::Refused);
            };
            // not a 2xx outcome (or none): the claim is released
            let response = match item.response.as_ref().and_then(idempotent_outcome) {
                None => None,
                Some(Ok(o)) => Some(o),
                Some(Err(_)) => return (kind, Done::Refused),
            };
            let storing = response.is_some();
            let call = IdemComplete { owner, memo, live, bytes, token, digest, response, bound: with.tenant_max_bytes };
            match idem_complete::run(store, &call, with.now_ms).await {
                Ok(Settled::Done) if storing => (kind, Done::Stored),
                Ok(Settled::Done) => (kind, Done::Released),
                Ok(Settled::WithoutBody) => (kind, Done::OverBound),
                Ok(Settled::NotOurs) => (kind, Done::Refused),
                Err(e) => {
                    tracing::debug!(error = %e, "an idempotency outcome could not be recorded now: tried again until Redis takes it");
                    if e.is_transient() || e.is_read_only() {
                        super::outcomes::retry(store, call, with.now_ms, with.in_flight_ms);
                    }
                    (kind, Done::Failed)
                }
            }
        }
    }
}

/// Stores (or releases) a batch of finished responses; each item independently, concurrently (the
/// multiplexed connection pipelines them).
/// Only items whose ticket `with.tickets` sealed, unaltered and unexpired at `with.now_ms`, are
/// looked at.
pub async fn store_batch<F: Fn(&str) -> Option<(Id, u64)> + Sync>(store: &Store, batch: &StoreBatch, with: Storing<'_, F>) -> StoreAck {
    let mut ack = StoreAck::default();
    for chunk in batch.responses.chunks(64) {
        let results = futures::future::join_all(chunk.iter().map(|i| store_one(store, i, &with))).await;
        for (kind, done) in results {
            let (outcome, n) = match done {
                Done::Stored => ("stored", &mut ack.stored),
                Done::Released => ("released", &mut ack.released),
                Done::Refused => ("refused", &mut ack.refused),
                Done::Failed => ("failed", &mut ack.failed),
                // an outcome without its body is stored; a cache entry is not
                Done::OverBound if kind == "idempotency" => ("over_bound", &mut ack.stored),
                Done::OverBound => ("over_bound", &mut ack.refused),
            };
            *n += 1;
            metrics::counter!(STORES, "kind" => kind, "outcome" => outcome).increment(1);
        }
    }
    ack
}

/// One claim of [`keep_claims`]: `Ok(Some)` kept (sealed again), `Ok(None)` an invalid ticket,
/// `Err(Some("gone"))` no longer the request's, `Err(None)` Redis did not answer.
async fn keep_claim(store: &Store, t: &StoreTicket, tickets: &TicketKey, now_ms: u64, in_flight_ms: u64) -> Result<Option<StoreTicket>, Option<&'static str>> {
    if tickets.verify_store(t, now_ms).is_err() {
        return Ok(None);
    }
    let Some((owner, memo, digest, token)) = idempotency_target(t) else { return Ok(None) };
    let call = idem_keep::IdemKeep { memo, owner, token, digest, in_flight_ms };
    match idem_keep::run(store, &call).await {
        Ok(true) => {
            let mut kept = t.clone();
            let id = kept.seal().id.clone();
            tickets.seal_store(&mut kept, &id, now_ms + in_flight_ms);
            Ok(Some(kept))
        }
        Ok(false) => Err(Some("gone")),
        Err(e) => {
            tracing::debug!(error = %e, "an idempotency claim could not be kept now");
            Err(None)
        }
    }
}

/// Why a batch of claims could not be kept now (the worker asks again).
#[derive(Debug)]
pub struct ClaimsUnavailable;

/// Keeps the idempotency claims of requests still running (decision 186): each claim whose
/// ticket this deployment sealed, unaltered and unexpired at `now_ms`, and which is still its
/// request's, lives `in_flight_ms` more (its owner key at least as long), and its ticket is
/// sealed again for as long. `None` in the answer: not kept (no longer the request's, an invalid
/// ticket) — the worker stops asking. A claim Redis could not answer for (its shard down) is
/// answered with its ticket unchanged — the worker asks again — and only when Redis answered for
/// none is the batch [`ClaimsUnavailable`] (keeping is idempotent): one tenant's shard does not
/// hold back the others' claims.
pub async fn keep_claims(store: &Store, batch: &ClaimRenewal, tickets: &TicketKey, now_ms: u64, in_flight_ms: u64) -> Result<ClaimsKept, ClaimsUnavailable> {
    let results = futures::future::join_all(batch.claims.iter().map(|t| keep_claim(store, t, tickets, now_ms, in_flight_ms))).await;
    let mut kept = ClaimsKept { claims: Vec::with_capacity(results.len()), in_flight_ms };
    let mut failed = 0;
    for (r, t) in results.into_iter().zip(&batch.claims) {
        let outcome = match &r {
            Ok(Some(_)) => "kept",
            Ok(None) => "refused",
            Err(Some(gone)) => gone,
            Err(None) => "failed",
        };
        metrics::counter!(CLAIMS_KEPT, "outcome" => outcome).increment(1);
        kept.claims.push(match r {
            Ok(t) => t,
            Err(None) => {
                failed += 1;
                Some(t.clone())
            }
            Err(Some(_)) => None,
        });
    }
    if failed > 0 && failed == batch.claims.len() {
        return Err(ClaimsUnavailable);
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_wire::responses::IdempotencyRequest;

    fn req() -> DecideRequest {
        DecideRequest {
            key_hash: "ab".repeat(32),
            method: "POST".into(),
            authority: "a".into(),
            path: "/v1/chat".into(),
            request_id: None,
            decision_id: None,
            client_ip: None,
            headers: vec![],
            token_estimate: None,
            route: Some("chat".into()),
            cache_key: Some("cd".repeat(32)),
            idempotency: None,
            lease: None,
            llm: None,
        }
    }

    #[test]
    fn a_cache_lookup_needs_a_caching_route_and_a_valid_hash() {
        let (t, k, r) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap(), Id::parse("chat").unwrap());
        let l = Lookup::of(&req(), &t, &k, "p", Some(&r)).unwrap();
        let ScriptLookup::Cache { key } = l.script_lookup(IDEMPOTENCY_IN_FLIGHT_TTL_MS, 1 << 28) else { panic!("{l:?}") };
        assert_eq!(key.as_str(), format!("cache:exact:{{acme}}:p:chat:{}", "cd".repeat(32)));
        assert_eq!(l.ticket(), StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "chat".into(), hash: "cd".repeat(32), seal: Default::default() });
        assert_eq!(Lookup::of(&req(), &t, &k, "p", None), None, "the route does not cache");
        assert_eq!(Lookup::of(&DecideRequest { cache_key: Some("xyz".into()), ..req() }, &t, &k, "p", Some(&r)), None);
    }

    #[test]
    fn an_idempotency_key_takes_precedence_and_is_validated() {
        let (t, k) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap());
        let with = |key: &str, digest: &str| DecideRequest {
            idempotency: Some(IdempotencyRequest { key: key.into(), digest: digest.into() }),
            ..req()
        };
        let l = Lookup::of(&with("k-1", &"0a".repeat(16)), &t, &k, "p", Some(&Id::parse("chat").unwrap())).unwrap();
        assert!(l.is_idempotency());
        let ScriptLookup::Idempotency { owner, memo, token: sent, in_flight_ttl_ms, owner_ttl_ms, .. } = l.script_lookup(IDEMPOTENCY_IN_FLIGHT_TTL_MS, 1 << 28) else { panic!("{l:?}") };
        assert_eq!((owner.as_str(), memo.as_str()), ("idem:key:{acme}:key_1:k-1", format!("idem:api:{{acme}}:key_1:{}:k-1", "0a".repeat(16)).as_str()));
        assert_eq!((in_flight_ttl_ms, owner_ttl_ms), (300_000, 86_400_000));
        let StoreTicket::Idempotency { token, .. } = l.ticket() else { panic!() };
        assert_eq!(sent, token);
        assert!(idempotency_target(&l.ticket()).is_some());
        assert_eq!(Lookup::of(&with("", &"0a".repeat(16)), &t, &k, "p", None), None);
        assert_eq!(Lookup::of(&with("k", "short"), &t, &k, "p", None), None);
    }

    #[test]
    fn an_entry_lives_the_shorter_of_the_routes_ttl_and_its_own_freshness() {
        assert_eq!(entry_ttl_ms(60_000, None), Some(60_000));
        assert_eq!(entry_ttl_ms(60_000, Some(10_000)), Some(10_000), "max-age=10 under a 60 s route");
        assert_eq!(entry_ttl_ms(60_000, Some(600_000)), Some(60_000), "never past the route's TTL");
        assert_eq!(entry_ttl_ms(60_000, Some(0)), None, "stale already");
    }

    #[test]
    fn cache_tickets_are_validated_and_take_the_routes_ttl() {
        let ok = StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "chat".into(), hash: "ab".repeat(32), seal: Default::default() };
        let ttl = |r: &str| (r == "chat").then(|| (Id::parse("chat.0a1b2c").unwrap(), 60_000));
        let (key, t) = cache_target(&ok, ttl).unwrap();
        assert_eq!((key.as_str().starts_with("cache:exact:{acme}:p:chat.0a1b2c:"), t), (true, 60_000), "the route's segment");
        assert!(cache_target(&StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "other".into(), hash: "ab".repeat(32), seal: Default::default() }, ttl).is_none());
        assert!(cache_target(&StoreTicket::Cache { tenant: "a{b}".into(), plan: "p".into(), route: "chat".into(), hash: "ab".repeat(32), seal: Default::default() }, ttl).is_none());
        assert!(cache_target(&StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "chat".into(), hash: "ab".into(), seal: Default::default() }, ttl).is_none());
    }

    #[test]
    fn only_successful_bounded_responses_are_storable() {
        let r = |status| StoredResponse::new(status, vec![], b"x".to_vec(), 0);
        assert!(storable(&r(200)) && storable(&r(201)) && storable(&r(204)));
        assert!(!storable(&r(206)) && !storable(&r(404)) && !storable(&r(500)));
        assert!(!storable(&StoredResponse::new(200, vec![], vec![b'a'; MAX_STORED_BODY + 1], 0)));
        assert_eq!(read_stored(r#"{"status":200,"body":"hi"}"#).unwrap().body, "hi");
        assert!(read_stored("inflight:x").is_none());
        assert!(read_stored(r#"{"status":42}"#).is_none());
    }
}
