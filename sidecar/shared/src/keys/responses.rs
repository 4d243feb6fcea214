//! Response-cache and idempotency keys (issue 7; seed 000 `cache:exact:{ns}:{hash}`, seed 002
//! `idem:api:…`).
//!
//! All carry the tenant's hash tag, like the limit keys, so `decide.lua` reads them in the same
//! call as the limits (one round trip, one Cluster slot).

use super::{tag, Id};
use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};

/// A request's response-cache hash: 64 lowercase hex (sha256, computed by the filter).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheHash(String);

impl CacheHash {
    pub fn parse(s: &str) -> Option<CacheHash> {
        (s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then(|| CacheHash(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An operation digest for idempotency: the first 32 lowercase hex characters of
/// sha256(METHOD + " " + path + JSON(body)) (seed 002), computed by the filter.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestDigest(String);

impl RequestDigest {
    pub fn parse(s: &str) -> Option<RequestDigest> {
        (s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then(|| RequestDigest(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A client's idempotency key as a key segment: as sent when it is 1–64 of `[A-Za-z0-9_.~-]`
/// (UUIDs and the like), else `#` + the first 32 hex of its sha256 (`#` is not in that set, so
/// the two forms never collide). Any key of 1–255 printable ASCII characters is accepted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdemKey(String);

impl IdemKey {
    pub fn parse(raw: &str) -> Option<IdemKey> {
        if raw.is_empty() || raw.len() > 255 || !raw.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return None;
        }
        let plain = raw.len() <= 64 && raw.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.~-".contains(&b));
        if plain {
            return Some(IdemKey(raw.to_string()));
        }
        use sha2::{Digest, Sha256};
        let d = Sha256::digest(raw.as_bytes());
        Some(IdemKey(format!("#{}", d.iter().take(16).map(|b| format!("{b:02x}")).collect::<String>())))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

redis_key!(
    /// `cache:exact:{tenant}:{plan}:{route}:{hash}` — string: JSON of a stored response
    /// (`tollgate_wire::responses::StoredResponse`), TTL = the route's `cache_ttl` (`SET … PX`).
    /// Seed 000's `cache:exact:{ns}:{hash}` with ns = `{tenant}:{plan}:{route}`: one tenant never
    /// reads another's responses, a route's responses stay its own, and a plan's too (the
    /// upstream sees `x-tollgate-plan` and may answer by it: decision 169). Read by `decide.lua` (GET, with
    /// the limits), written off the request path by `POST /v1/responses`.
    ResponseCacheKey
);

impl ResponseCacheKey {
    pub fn new(tenant: &Id, plan: &Id, route: &Id, hash: &CacheHash) -> Self {
        Self(format!("cache:exact:{}:{plan}:{route}:{}", tag(tenant), hash.as_str()))
    }
}

redis_key!(
    /// `idem:api:{tenant}:{keyId}:{digest}:{idemKey}` — string (seed 002): `inflight:<token>` while
    /// the first request runs (TTL [`IDEMPOTENCY_IN_FLIGHT_TTL_MS`]), then the JSON of its 2xx
    /// response (TTL [`IDEMPOTENCY_TTL_MS`], 24 h). Scoped by credential and operation digest, so
    /// no cross-key or cross-tenant replay is possible.
    IdempotencyMemoKey
);

redis_key!(
    /// `idem:key:{tenant}:{keyId}:{idemKey}` — string: the digest of the operation that claimed
    /// this idempotency key, TTL [`IDEMPOTENCY_TTL_MS`]. Read in the same script as the memo, so
    /// "same key, different body" (422) is found in the same single lookup: the memo key alone
    /// (digest in its name) cannot say that another digest holds the key without a SCAN.
    IdempotencyOwnerKey
);

redis_key!(
    /// `responses:live:{tenant}` — zset (decision 185): one member per stored response of the
    /// tenant (cache entries and idempotency outcomes), `<bytes>:<its key>`, scored by the time
    /// (ms) its TTL ends. With [`ResponsesBytesKey`], the tenant's ledger of stored bytes, kept by
    /// `store_response.lua` and `idem_complete.lua` (`sidecar/lua/ledger.lua`).
    ResponsesLiveKey
);

redis_key!(
    /// `responses:bytes:{tenant}` — string: the sum of [`ResponsesLiveKey`]'s bytes; a store that
    /// would take it past the tenant's bound (`[responses] tenant_max_mb`) is refused (a cache
    /// entry) or kept without its body (an idempotency outcome). Decision 185.
    ResponsesBytesKey
);

impl ResponsesLiveKey {
    pub fn new(tenant: &Id) -> Self {
        Self(format!("responses:live:{}", tag(tenant)))
    }
}

impl ResponsesBytesKey {
    pub fn new(tenant: &Id) -> Self {
        Self(format!("responses:bytes:{}", tag(tenant)))
    }
}

/// TTL of a completed idempotency memo and of its owner key: 24 h (seed 002).
pub const IDEMPOTENCY_TTL_MS: u64 = 24 * 3600 * 1000;
/// TTL of the in-flight marker: a request whose outcome never arrives (Envoy crashed, the report
/// was lost) stops blocking retries with 409 after this long. 5 minutes, like a reservation.
pub const IDEMPOTENCY_IN_FLIGHT_TTL_MS: u64 = 5 * 60 * 1000;

impl IdempotencyMemoKey {
    pub fn new(tenant: &Id, key_id: &Id, digest: &RequestDigest, idem: &IdemKey) -> Self {
        Self(format!("idem:api:{}:{key_id}:{}:{}", tag(tenant), digest.as_str(), idem.as_str()))
    }
}

impl IdempotencyOwnerKey {
    pub fn new(tenant: &Id, key_id: &Id, idem: &IdemKey) -> Self {
        Self(format!("idem:key:{}:{key_id}:{}", tag(tenant), idem.as_str()))
    }
}

#[cfg(test)]
mod response_key_tests {
    use super::*;

    #[test]
    fn golden_formats_share_the_tenant_tag() {
        let t = Id::parse("acme").unwrap();
        let k = Id::parse("key_1").unwrap();
        let h = CacheHash::parse(&"ab".repeat(32)).unwrap();
        let d = RequestDigest::parse(&"0f".repeat(16)).unwrap();
        let i = IdemKey::parse("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap();
        assert_eq!(
            ResponseCacheKey::new(&t, &Id::parse("gold").unwrap(), &Id::parse("chat").unwrap(), &h).as_str(),
            format!("cache:exact:{{acme}}:gold:chat:{}", "ab".repeat(32))
        );
        assert_eq!(
            IdempotencyMemoKey::new(&t, &k, &d, &i).as_str(),
            format!("idem:api:{{acme}}:key_1:{}:8e03978e-40d5-43e8-bc93-6894a57f9324", "0f".repeat(16))
        );
        assert_eq!(IdempotencyOwnerKey::new(&t, &k, &i).as_str(), "idem:key:{acme}:key_1:8e03978e-40d5-43e8-bc93-6894a57f9324");
        assert_eq!(IDEMPOTENCY_TTL_MS, 86_400_000);
        assert_eq!(ResponsesLiveKey::new(&t).as_str(), "responses:live:{acme}");
        assert_eq!(ResponsesBytesKey::new(&t).as_str(), "responses:bytes:{acme}");
    }

    #[test]
    fn odd_idempotency_keys_are_hashed_and_bad_ones_refused() {
        let odd = IdemKey::parse("order 42: {retry}").unwrap();
        assert!(odd.as_str().starts_with('#') && odd.as_str().len() == 33, "{}", odd.as_str());
        assert_ne!(odd, IdemKey::parse("order 42: {retry!}").unwrap());
        assert_eq!(IdemKey::parse(&"a".repeat(64)).unwrap().as_str(), "a".repeat(64));
        assert!(IdemKey::parse(&"a".repeat(65)).unwrap().as_str().starts_with('#'));
        assert!(IdemKey::parse("").is_none());
        assert!(IdemKey::parse(&"a".repeat(256)).is_none());
        assert!(IdemKey::parse("tab\there").is_none());
        assert!(CacheHash::parse(&"AB".repeat(32)).is_none());
        assert!(RequestDigest::parse(&"ab".repeat(32)).is_none());
    }
}
