//! Circuit-breaker hints and the sidecars' liveness set (seed 000, ADR-004; issue 15.3).

use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};


redis_key!(
    /// `cb:hint:{provider}:{model}` — string, JSON `{"replica","openedAtMs"}`, TTL
    /// [`BREAKER_HINT_TTL_SECS`] (`SET … EX`): an advisory hint that a replica's breaker for this
    /// provider/model opened. Other replicas may only use it to open their own breaker sooner; it
    /// is never evidence for closing one. Provider and model are validated (no `:`), so the key parses
    /// back unambiguously. Written by the sidecar on the filter's report; listed through [`BREAKER_HINT_INDEX`].
    BreakerHintKey
);

/// TTL of [`BreakerHintKey`] (seed 000): 30 seconds.
pub const BREAKER_HINT_TTL_SECS: u64 = 30;

/// `cb:hints` — sorted set, the index of the [`BreakerHintKey`]s: member = the hint key's name,
/// score = when it expires (ms since the epoch, the writing sidecar's clock). Written with each
/// hint; members expired for over [`BREAKER_HINT_INDEX_SLACK_MS`] are removed on each write, and
/// each write sets the index's TTL to the hint's plus that slack (the TTL rule: it goes a minute
/// after its newest member's hint). It holds at most one member per provider/model. Listing reads the index and then the hint keys (their TTL stays the authority), so a
/// listing costs O(hints), never a SCAN of the whole keyspace.
pub const BREAKER_HINT_INDEX: &str = "cb:hints";

/// `sidecars:live` — sorted set of the sidecars that share this Redis (issue 15.3): member = a
/// random id per sidecar process, score = its last heartbeat (ms, Redis' own `TIME`, so the
/// sidecars' clocks never disagree). Each sidecar without a configured `limits.local_replicas`
/// beats every [`SIDECAR_BEAT_MS`]: `ZADD`, `ZREMRANGEBYSCORE` of members older than
/// [`SIDECAR_LIVE_MS`], `PEXPIRE` [`SIDECARS_LIVE_TTL_MS`], `ZCOUNT` of the live ones — the replica
/// count its `local` limits divide by while Redis cannot answer. A stopping sidecar removes itself.
pub const SIDECARS_LIVE: &str = "sidecars:live";
/// How often a sidecar beats in [`SIDECARS_LIVE`].
pub const SIDECAR_BEAT_MS: u64 = 1_000;
/// A member beaten within this long is live (three beats).
pub const SIDECAR_LIVE_MS: u64 = 3_000;
/// TTL of [`SIDECARS_LIVE`], renewed by each beat: it goes once no sidecar beats.
pub const SIDECARS_LIVE_TTL_MS: u64 = 10_000;

/// How long past its expiry an index member is still listed (clock skew between sidecars; a
/// hint key that expired reads as nil and is skipped).
pub const BREAKER_HINT_INDEX_SLACK_MS: u64 = 60_000;

impl BreakerHintKey {
    /// `None` unless provider and model pass `tollgate_wire::breaker::valid_hint_part`.
    pub fn new(provider: &str, model: &str) -> Option<Self> {
        use tollgate_wire::breaker::valid_hint_part;
        (valid_hint_part(provider) && valid_hint_part(model)).then(|| Self(format!("cb:hint:{provider}:{model}")))
    }
    /// Provider and model back from a key name listed in [`BREAKER_HINT_INDEX`].
    pub fn parse(name: &str) -> Option<(String, String)> {
        let (provider, model) = name.strip_prefix("cb:hint:")?.split_once(':')?;
        Self::new(provider, model).map(|_| (provider.to_string(), model.to_string()))
    }
}

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

