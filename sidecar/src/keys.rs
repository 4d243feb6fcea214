//! Every Redis key the sidecar reads or writes, built here and nowhere else.
//!
//! Keys are newtypes with a private field; constructors take typed ids, so a raw API key can
//! never become part of a key name (only [`KeyHash`], its sha256, can). docs/redis-keys.md lists
//! each family with its type, TTL and writer; the golden tests below pin every format.
//!
//! Families (all TTL-less store-of-record keys are marked so):
//! - `apikey:{sha256}` — hash, the API-key record (store of record, no TTL; seed 003/004).
//! - `apikey-id:{keyId}` — string, the record's key hash, to find it by id (store of record).
//! - `apikey-index:{tenant}` — set of key ids of one tenant (store of record; seed 004).
//! - `apikey:authfail:{keyId}` — string `1`, audit throttle, `SET … EX 3600 NX` (seed 002).

use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};
use std::fmt;

/// A validated lowercase-hex sha256 of an API key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyHash(String);

impl KeyHash {
    /// Accepts exactly 64 lowercase hex characters.
    pub fn parse(s: &str) -> Option<KeyHash> {
        (s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then(|| KeyHash(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An identifier of ours (tenant, plan, key id): 1–64 of `[A-Za-z0-9_.-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(String);

impl Id {
    pub fn parse(s: &str) -> Option<Id> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        ok.then(|| Id(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! redis_key {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl ToRedisArgs for $name {
            fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
                out.write_arg(self.0.as_bytes())
            }
        }

        impl ToSingleRedisArg for $name {}
    };
}

redis_key!(
    /// `apikey:{sha256}` — hash: the API-key record. Store of record: no TTL.
    ApiKeyRecordKey
);
redis_key!(
    /// `apikey-id:{keyId}` — string: the key hash of a key id. Store of record: no TTL.
    ApiKeyIdKey
);
redis_key!(
    /// `apikey-index:{tenant}` — set: the key ids of a tenant. Store of record: no TTL.
    ApiKeyIndexKey
);
redis_key!(
    /// `apikey:authfail:{keyId}` — string `1`, TTL [`AUTH_FAIL_TTL_SECS`]: audit throttle.
    AuthFailKey
);

/// TTL of [`AuthFailKey`]: one audit line per key per hour (seed 002).
pub const AUTH_FAIL_TTL_SECS: u64 = 3600;

/// Pattern matching every [`ApiKeyIdKey`] (for listing all keys with SCAN).
pub const API_KEY_ID_PATTERN: &str = "apikey-id:*";

impl ApiKeyRecordKey {
    pub fn new(hash: &KeyHash) -> Self {
        Self(format!("apikey:{}", hash.as_str()))
    }
}

impl ApiKeyIdKey {
    pub fn new(key_id: &Id) -> Self {
        Self(format!("apikey-id:{key_id}"))
    }
    /// The key id back from a key name found by SCAN.
    pub fn key_id_of(name: &str) -> Option<Id> {
        name.strip_prefix("apikey-id:").and_then(Id::parse)
    }
}

impl ApiKeyIndexKey {
    pub fn new(tenant: &Id) -> Self {
        Self(format!("apikey-index:{tenant}"))
    }
}

impl AuthFailKey {
    pub fn new(key_id: &Id) -> Self {
        Self(format!("apikey:authfail:{key_id}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_formats() {
        let h = KeyHash::parse(&"ab".repeat(32)).unwrap();
        let id = Id::parse("key_0123").unwrap();
        let t = Id::parse("acme").unwrap();
        assert_eq!(ApiKeyRecordKey::new(&h).as_str(), format!("apikey:{}", "ab".repeat(32)));
        assert_eq!(ApiKeyIdKey::new(&id).as_str(), "apikey-id:key_0123");
        assert_eq!(ApiKeyIndexKey::new(&t).as_str(), "apikey-index:acme");
        assert_eq!(AuthFailKey::new(&id).as_str(), "apikey:authfail:key_0123");
        assert_eq!(ApiKeyIdKey::key_id_of("apikey-id:key_0123"), Some(id));
    }

    #[test]
    fn ids_and_hashes_are_validated() {
        assert!(KeyHash::parse(&"AB".repeat(32)).is_none());
        assert!(KeyHash::parse("abc").is_none());
        assert!(Id::parse("").is_none());
        assert!(Id::parse("a:b").is_none());
        assert!(Id::parse("a b").is_none());
        assert!(Id::parse(&"a".repeat(65)).is_none());
        assert!(Id::parse("tenant-1.prod_x").is_some());
    }
}

// ---- circuit-breaker hints (seed 000, ADR-004: fast-open only) ----

/// `cb:hint:{provider}:{model}` — string, JSON `{"replica","openedAtMs"}`, TTL
/// [`BREAKER_HINT_TTL_SECS`] (`SET … EX`): an advisory hint that a replica's breaker for this
/// provider/model opened. Other replicas may only use it to open their own breaker sooner; it
/// is never evidence for closing one. Provider and model are validated (no `:`), so the key parses
/// back unambiguously. Written by the sidecar on the filter's report; listed by SCAN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerHintKey(String);

/// TTL of [`BreakerHintKey`] (seed 000): 30 seconds.
pub const BREAKER_HINT_TTL_SECS: u64 = 30;

/// Pattern matching every [`BreakerHintKey`] (for listing with SCAN).
pub const BREAKER_HINT_PATTERN: &str = "cb:hint:*";

impl BreakerHintKey {
    /// `None` unless provider and model pass `tollgate_wire::breaker::valid_hint_part`.
    pub fn new(provider: &str, model: &str) -> Option<Self> {
        use tollgate_wire::breaker::valid_hint_part;
        (valid_hint_part(provider) && valid_hint_part(model)).then(|| Self(format!("cb:hint:{provider}:{model}")))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// Provider and model back from a key name found by SCAN.
    pub fn parse(name: &str) -> Option<(String, String)> {
        let (provider, model) = name.strip_prefix("cb:hint:")?.split_once(':')?;
        Self::new(provider, model).map(|_| (provider.to_string(), model.to_string()))
    }
}

impl ToRedisArgs for BreakerHintKey {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        out.write_arg(self.0.as_bytes())
    }
}

impl ToSingleRedisArg for BreakerHintKey {}

#[cfg(test)]
mod breaker_hint_key_tests {
    use super::*;

    #[test]
    fn golden_format() {
        let k = BreakerHintKey::new("openai", "gpt-4o").unwrap();
        assert_eq!(k.as_str(), "cb:hint:openai:gpt-4o");
        assert_eq!(BreakerHintKey::parse("cb:hint:openai:gpt-4o"), Some(("openai".into(), "gpt-4o".into())));
        assert_eq!(BreakerHintKey::new("meta", "llama/3.1-8b").unwrap().as_str(), "cb:hint:meta:llama/3.1-8b");
        assert!(BreakerHintKey::new("a:b", "m").is_none());
        assert!(BreakerHintKey::new("p", "").is_none());
        assert!(BreakerHintKey::parse("cb:hint:p:m:x").is_none());
        assert!(BreakerHintKey::parse("apikey:x").is_none());
        assert_eq!(BREAKER_HINT_TTL_SECS, 30);
    }
}
