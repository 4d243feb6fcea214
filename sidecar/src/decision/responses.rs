//! The response cache and Idempotency-Key replay on the sidecar's side (issue 7).
//!
//! Lookups ride on the decision: [`Lookup`] adds its keys and arguments to the one `decide.lua`
//! call of the request (after the limits'), so a decision with limits, a cache lookup or an
//! idempotency claim still costs one Redis round trip (with the key record cached). The script
//! answers an [`Outcome`]; [`crate::decision`] turns it into a replay, a store ticket or a 409/422.
//!
//! Storing is off the request path: the filter sends finished responses in batches to
//! `POST /v1/responses` ([`store_batch`]). A cache entry is one `SET … PX <route TTL>`; an
//! idempotency outcome runs `idem_complete.lua` (store the 2xx response for 24 h, or release the
//! claim). Everything the filter echoes back is validated again, and the TTL is the sidecar's own
//! route configuration, never the filter's word.
//!
//! Failure policy (seeds 002 and 004): Redis unavailable → a cache lookup is a miss and nothing
//! is stored; an idempotency key executes without being recorded (fail-open), logged at most once
//! a minute. Stores are best effort and not retried: a lost cache entry is a later miss, a lost
//! idempotency outcome leaves the in-flight marker to expire ([`IDEMPOTENCY_IN_FLIGHT_TTL_MS`]).

use crate::keys::{
    CacheHash, Id, IdemKey, IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest, ResponseCacheKey,
    IDEMPOTENCY_IN_FLIGHT_TTL_MS, IDEMPOTENCY_TTL_MS,
};
use crate::decision::limits::Invocation;
use crate::store::Store;
use rand::distr::{Alphanumeric, SampleString};
use tollgate_wire::responses::{StoreAck, StoreBatch, StoreItem, StoreTicket, StoredResponse, MAX_STORED_BODY};
use tollgate_wire::DecideRequest;

/// Metric: response-cache lookups, labelled `result` (hit | miss | unavailable).
pub const CACHE_LOOKUPS: &str = "tollgate_sidecar_response_cache_total";
/// Metric: idempotency decisions, labelled `outcome` (claimed | replayed | in_flight | conflict |
/// unavailable).
pub const IDEMPOTENCY: &str = "tollgate_sidecar_idempotency_total";
/// Metric: stored-response items, labelled `kind` (cache | idempotency) and `outcome` (stored |
/// released | refused | failed).
pub const STORES: &str = "tollgate_sidecar_responses_stored_total";

/// The one response lookup of a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Cache { key: ResponseCacheKey, ticket: StoreTicket },
    Idempotency { owner: IdempotencyOwnerKey, memo: IdempotencyMemoKey, digest: RequestDigest, token: String, ticket: StoreTicket },
}

impl Lookup {
    /// The lookup `req` asks for, for the key's `tenant` and `key_id`: an idempotency claim when
    /// it carries a valid key and digest, else a cache lookup when it carries a valid hash and
    /// its route caches (`route_cache`: the route's id, when its TTL is set). Invalid inputs ask
    /// for nothing (the request is then simply forwarded).
    pub fn of(req: &DecideRequest, tenant: &Id, key_id: &Id, route_cache: Option<&Id>) -> Option<Lookup> {
        if let Some(i) = &req.idempotency {
            let (Some(idem), Some(digest)) = (IdemKey::parse(&i.key), RequestDigest::parse(&i.digest)) else {
                return None;
            };
            let token = Alphanumeric.sample_string(&mut rand::rng(), 20);
            return Some(Lookup::Idempotency {
                owner: IdempotencyOwnerKey::new(tenant, key_id, &idem),
                memo: IdempotencyMemoKey::new(tenant, key_id, &digest, &idem),
                ticket: StoreTicket::Idempotency {
                    tenant: tenant.to_string(),
                    key_id: key_id.to_string(),
                    digest: digest.as_str().to_string(),
                    key: i.key.clone(),
                    token: token.clone(),
                },
                digest,
                token,
            });
        }
        let route = route_cache?;
        let hash = CacheHash::parse(req.cache_key.as_deref()?)?;
        Some(Lookup::Cache {
            key: ResponseCacheKey::new(tenant, route, &hash),
            ticket: StoreTicket::Cache { tenant: tenant.to_string(), route: route.to_string(), hash: hash.as_str().to_string() },
        })
    }

    /// Adds this lookup to the decision's script call (contract: sidecar/lua/decide.lua).
    pub fn append_to(&self, inv: &mut Invocation) {
        match self {
            Lookup::Cache { key, .. } => {
                inv.keys.push(key.as_str().to_string());
                inv.args.push("cache".into());
            }
            Lookup::Idempotency { owner, memo, digest, token, .. } => {
                inv.keys.push(owner.as_str().to_string());
                inv.keys.push(memo.as_str().to_string());
                inv.args.extend([
                    "idem".to_string(),
                    digest.as_str().to_string(),
                    token.clone(),
                    IDEMPOTENCY_IN_FLIGHT_TTL_MS.to_string(),
                    IDEMPOTENCY_TTL_MS.to_string(),
                ]);
            }
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

/// What the script found.
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
}

/// Splits `decide.lua`'s reply into the limit numbers and the lookup outcome (when present).
pub fn split_reply(values: Vec<redis::Value>) -> Result<(Vec<i64>, Option<Outcome>), String> {
    let text = |v: &redis::Value| -> Option<String> {
        match v {
            redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    };
    let mut numbers = Vec::with_capacity(values.len());
    let mut strings = Vec::new();
    for v in &values {
        match v {
            redis::Value::Int(i) if strings.is_empty() => numbers.push(*i),
            other => strings.push(text(other).ok_or_else(|| format!("decide.lua returned an unexpected value {other:?}"))?),
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
            other => return Err(format!("decide.lua returned an unknown lookup outcome {other:?}")),
        }),
        _ => return Err(format!("decide.lua returned {} trailing values", strings.len())),
    };
    Ok((numbers, outcome))
}

/// A stored response read back from Redis, or `None` when it is not one (then it is not used).
pub fn read_stored(json: &str) -> Option<StoredResponse> {
    let r: StoredResponse = serde_json::from_str(json).ok()?;
    ((100..=599).contains(&r.status)).then_some(r)
}

/// Whether a response may be kept: a successful status (2xx but 206) within the size bound.
fn storable(r: &StoredResponse) -> bool {
    (200..=299).contains(&r.status) && r.status != 206 && r.body_len() <= MAX_STORED_BODY && r.headers.len() <= 64
}

/// Where a cache ticket's response goes and for how long, after validating every field.
/// `route_ttl_ms` gives the TTL of a route id in the configuration in force (none: not caching).
pub fn cache_target(ticket: &StoreTicket, route_ttl_ms: impl Fn(&str) -> Option<u64>) -> Option<(ResponseCacheKey, u64)> {
    let StoreTicket::Cache { tenant, route, hash } = ticket else { return None };
    let (tenant, route_id, hash) = (Id::parse(tenant)?, Id::parse(route)?, CacheHash::parse(hash)?);
    let ttl = route_ttl_ms(route)?;
    Some((ResponseCacheKey::new(&tenant, &route_id, &hash), ttl))
}

/// The keys, digest and token of an idempotency ticket, after validating every field.
pub fn idempotency_target(ticket: &StoreTicket) -> Option<(IdempotencyOwnerKey, IdempotencyMemoKey, RequestDigest, String)> {
    let StoreTicket::Idempotency { tenant, key_id, digest, key, token } = ticket else { return None };
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
}

async fn store_one(store: &Store, item: &StoreItem, route_ttl_ms: &(impl Fn(&str) -> Option<u64> + Sync)) -> (&'static str, Done) {
    let response = item.response.as_ref().filter(|r| storable(r));
    match &item.ticket {
        t @ StoreTicket::Cache { .. } => {
            let kind = "cache";
            let (Some((key, ttl)), Some(r)) = (cache_target(t, route_ttl_ms), response) else { return (kind, Done::Refused) };
            let Ok(json) = serde_json::to_string(r) else { return (kind, Done::Refused) };
            match store.set_response(&key, json, ttl).await {
                Ok(()) => (kind, Done::Stored),
                Err(e) => {
                    tracing::debug!(error = %e, "a response could not be cached");
                    (kind, Done::Failed)
                }
            }
        }
        t @ StoreTicket::Idempotency { .. } => {
            let kind = "idempotency";
            let Some((owner, memo, digest, token)) = idempotency_target(t) else { return (kind, Done::Refused) };
            let json = match (&item.response, response) {
                (None, _) => None,
                (Some(_), Some(r)) => match serde_json::to_string(r) {
                    Ok(j) => Some(j),
                    Err(_) => return (kind, Done::Refused),
                },
                // not a storable outcome: the claim is released
                (Some(_), None) => None,
            };
            let storing = json.is_some();
            match store.run_idem_complete(&owner, &memo, &token, &digest, json).await {
                Ok(true) if storing => (kind, Done::Stored),
                Ok(true) => (kind, Done::Released),
                Ok(false) => (kind, Done::Refused),
                Err(e) => {
                    tracing::debug!(error = %e, "an idempotency outcome could not be recorded");
                    (kind, Done::Failed)
                }
            }
        }
    }
}

/// Stores (or releases) a batch of finished responses; each item independently, concurrently (the
/// multiplexed connection pipelines them).
pub async fn store_batch(store: &Store, batch: &StoreBatch, route_ttl_ms: impl Fn(&str) -> Option<u64> + Sync) -> StoreAck {
    let mut ack = StoreAck::default();
    for chunk in batch.responses.chunks(64) {
        let results = futures::future::join_all(chunk.iter().map(|i| store_one(store, i, &route_ttl_ms))).await;
        for (kind, done) in results {
            let (outcome, n) = match done {
                Done::Stored => ("stored", &mut ack.stored),
                Done::Released => ("released", &mut ack.released),
                Done::Refused => ("refused", &mut ack.refused),
                Done::Failed => ("failed", &mut ack.failed),
            };
            *n += 1;
            metrics::counter!(STORES, "kind" => kind, "outcome" => outcome).increment(1);
        }
    }
    ack
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
            client_ip: None,
            headers: vec![],
            token_estimate: None,
            route: Some("chat".into()),
            cache_key: Some("cd".repeat(32)),
            idempotency: None,
            lease: None,
        }
    }

    #[test]
    fn a_cache_lookup_needs_a_caching_route_and_a_valid_hash() {
        let (t, k, r) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap(), Id::parse("chat").unwrap());
        let l = Lookup::of(&req(), &t, &k, Some(&r)).unwrap();
        let mut inv = Invocation { keys: vec!["rl:x".into()], args: vec!["1".into(), "r".into(), "0".into()], meta: vec![] };
        l.append_to(&mut inv);
        assert_eq!(inv.keys[1], format!("cache:exact:{{acme}}:chat:{}", "cd".repeat(32)));
        assert_eq!(inv.args[3], "cache");
        assert_eq!(l.ticket(), StoreTicket::Cache { tenant: "acme".into(), route: "chat".into(), hash: "cd".repeat(32) });
        assert_eq!(Lookup::of(&req(), &t, &k, None), None, "the route does not cache");
        assert_eq!(Lookup::of(&DecideRequest { cache_key: Some("xyz".into()), ..req() }, &t, &k, Some(&r)), None);
    }

    #[test]
    fn an_idempotency_key_takes_precedence_and_is_validated() {
        let (t, k) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap());
        let with = |key: &str, digest: &str| DecideRequest {
            idempotency: Some(IdempotencyRequest { key: key.into(), digest: digest.into() }),
            ..req()
        };
        let l = Lookup::of(&with("k-1", &"0a".repeat(16)), &t, &k, Some(&Id::parse("chat").unwrap())).unwrap();
        assert!(l.is_idempotency());
        let mut inv = Invocation { keys: vec![], args: vec!["1".into(), "r".into(), "0".into()], meta: vec![] };
        l.append_to(&mut inv);
        assert_eq!(inv.keys, vec!["idem:key:{acme}:key_1:k-1".to_string(), format!("idem:api:{{acme}}:key_1:{}:k-1", "0a".repeat(16))]);
        assert_eq!(&inv.args[3..4], &["idem".to_string()]);
        assert_eq!(inv.args[6], "300000");
        assert_eq!(inv.args[7], "86400000");
        let StoreTicket::Idempotency { token, .. } = l.ticket() else { panic!() };
        assert_eq!(inv.args[5], token);
        assert!(idempotency_target(&l.ticket()).is_some());
        assert_eq!(Lookup::of(&with("", &"0a".repeat(16)), &t, &k, None), None);
        assert_eq!(Lookup::of(&with("k", "short"), &t, &k, None), None);
    }

    #[test]
    fn replies_split_into_numbers_and_an_outcome() {
        use redis::Value::{BulkString, Int};
        assert_eq!(split_reply(vec![Int(1), Int(0)]).unwrap(), (vec![1, 0], None));
        let (n, o) = split_reply(vec![Int(1), Int(0), Int(4), Int(10), Int(0), BulkString(b"hit".to_vec()), BulkString(b"{}".to_vec())]).unwrap();
        assert_eq!((n, o), (vec![1, 0, 4, 10, 0], Some(Outcome::Hit("{}".into()))));
        assert_eq!(split_reply(vec![Int(1), Int(0), BulkString(b"miss".to_vec()), BulkString(vec![])]).unwrap().1, Some(Outcome::Miss));
        assert_eq!(split_reply(vec![Int(1), Int(0), BulkString(b"conflict".to_vec()), BulkString(vec![])]).unwrap().1, Some(Outcome::Conflict));
        assert!(split_reply(vec![Int(1), Int(0), BulkString(b"what".to_vec()), BulkString(vec![])]).is_err());
        assert!(split_reply(vec![Int(1), BulkString(b"hit".to_vec()), Int(0)]).is_err());
    }

    #[test]
    fn cache_tickets_are_validated_and_take_the_routes_ttl() {
        let ok = StoreTicket::Cache { tenant: "acme".into(), route: "chat".into(), hash: "ab".repeat(32) };
        let ttl = |r: &str| (r == "chat").then_some(60_000);
        let (key, t) = cache_target(&ok, ttl).unwrap();
        assert_eq!((key.as_str().starts_with("cache:exact:{acme}:chat:"), t), (true, 60_000));
        assert!(cache_target(&StoreTicket::Cache { tenant: "acme".into(), route: "other".into(), hash: "ab".repeat(32) }, ttl).is_none());
        assert!(cache_target(&StoreTicket::Cache { tenant: "a{b}".into(), route: "chat".into(), hash: "ab".repeat(32) }, ttl).is_none());
        assert!(cache_target(&StoreTicket::Cache { tenant: "acme".into(), route: "chat".into(), hash: "ab".into() }, ttl).is_none());
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
