//! Circuit-breaker hints shared between replicas (seed 000, ADR-004: fast-open only).
//!
//! `POST /v1/breaker/hints` (a `HintReport` from the filter's elected poller, sent on a local
//! OPEN transition) stores `cb:hint:{provider}:{model}` = `{"replica","openedAtMs"}` with
//! `SET … EX ttl` (30 s by default). `GET /v1/breaker/hints` lists the live hints of *other*
//! replicas (this sidecar's own are left out): the names from the index `cb:hints` (a sorted set
//! by expiry, written with each hint), then the values. Polling a list rather than pub/sub:
//! nothing is lost while a listener reconnects, and expiry is Redis's TTL. Never a SCAN: SCAN
//! walks the whole keyspace whatever its MATCH (with 50k keys in Redis, one listing was ~5 000
//! SCAN calls, and the pollers of a few Envoys kept Redis ~40% busy).
//!
//! Redis trouble never becomes an error for the filter: a report is answered 202 (accepted, not
//! shared) and a list is answered empty; the store logs "redis went down / is back" on the
//! transition only.

use crate::keys::{BreakerHintKey, BREAKER_HINT_INDEX, BREAKER_HINT_INDEX_SLACK_MS, BREAKER_HINT_TTL_SECS};
use crate::store::{Store, StoreError};
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tollgate_wire::breaker::{Hint, HintList, HintReport};

/// The `[breaker]` section of the sidecar configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// TTL of a hint (whole seconds, at least 1). Seed 000 fixes 30 s; tests shorten it.
    #[serde(with = "humantime_serde")]
    pub hint_ttl: Duration,
    /// This replica's name in the hints it writes; empty: a random one per process.
    pub replica: String,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig { hint_ttl: Duration::from_secs(BREAKER_HINT_TTL_SECS), replica: String::new() }
    }
}

/// The stored value of a hint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct HintValue {
    replica: String,
    opened_at_ms: u64,
}

/// Hint settings of this sidecar.
pub struct Hints {
    replica: String,
    ttl_secs: u64,
}

/// Deadline of one hint command: off the request path, but a poller is waiting.
const DEADLINE: Duration = Duration::from_millis(250);

impl Hints {
    pub fn new(config: &BreakerConfig) -> Hints {
        let replica = if config.replica.is_empty() {
            format!("sidecar-{:016x}", rand::random::<u64>())
        } else {
            config.replica.clone()
        };
        Hints { replica, ttl_secs: config.hint_ttl.as_secs().max(1) }
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }
}

/// Milliseconds since the epoch by this sidecar's clock (index scores only).
fn epoch_ms() -> u64 {
    use crate::clock::Clock;
    crate::clock::SystemClock.now_ms()
}

/// How a report ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Stored: the other replicas see it at their next poll.
    Shared,
    /// Redis could not take it now (logged at debug level; the store logs the transition).
    NotShared,
}

/// A report naming no valid provider or model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("invalid provider or model")]
pub struct InvalidHint;

impl Hints {
    /// Stores the hint of a local OPEN transition for the other replicas.
    pub async fn record(&self, store: &Store, report: &HintReport) -> Result<Recorded, InvalidHint> {
        let key = BreakerHintKey::new(&report.provider, &report.model).ok_or(InvalidHint)?;
        let value = HintValue { replica: self.replica.clone(), opened_at_ms: report.opened_at_ms };
        let value = serde_json::to_string(&value).unwrap_or_default();
        match put(store, key, value, self.ttl_secs).await {
            Ok(()) => {
                tracing::info!(provider = %report.provider, model = %report.model, "breaker hint recorded");
                Ok(Recorded::Shared)
            }
            Err(e) => {
                tracing::debug!(error = %e, "breaker hint not shared");
                Ok(Recorded::NotShared)
            }
        }
    }

    /// The live hints of the other replicas; none while Redis is unreachable.
    pub async fn list(&self, store: &Store) -> HintList {
        let hints = match live(store).await {
            Ok(found) => others(&self.replica, found),
            Err(e) => {
                tracing::debug!(error = %e, "breaker hints not listed");
                Vec::new()
            }
        };
        HintList { hints }
    }
}

/// `SET cb:hint:{provider}:{model} <value> EX ttl`, then the index: `ZADD cb:hints <expiry>
/// <name>`, `ZREMRANGEBYSCORE cb:hints -inf <long expired>` and `PEXPIRE cb:hints <ttl + slack>`
/// (one pipeline, one slot): the index outlives its newest member by the slack, then goes.
async fn put(store: &Store, key: BreakerHintKey, value: String, ttl_secs: u64) -> Result<(), StoreError> {
    store
        .run_with_deadline("set_breaker_hint", DEADLINE, |mut c| async move {
            c.set_ex::<_, _, ()>(&key, value, ttl_secs).await?;
            let now = epoch_ms();
            redis::pipe()
                .zadd(BREAKER_HINT_INDEX, key.as_str(), now + ttl_secs * 1000)
                .ignore()
                .zrembyscore(BREAKER_HINT_INDEX, "-inf", now.saturating_sub(BREAKER_HINT_INDEX_SLACK_MS))
                .ignore()
                .pexpire(BREAKER_HINT_INDEX, (ttl_secs * 1000 + BREAKER_HINT_INDEX_SLACK_MS) as i64)
                .ignore()
                .query_async::<()>(&mut c)
                .await
        })
        .await
}

/// Every live hint key with its value: the index's recent members (`ZRANGEBYSCORE`), then one
/// pipelined round of GETs (an expired hint reads as nil).
async fn live(store: &Store) -> Result<Vec<(String, Option<String>)>, StoreError> {
    store
        .run_with_deadline("list_breaker_hints", DEADLINE, |mut c| async move {
            let since = epoch_ms().saturating_sub(BREAKER_HINT_INDEX_SLACK_MS);
            let names: Vec<String> = c.zrangebyscore(BREAKER_HINT_INDEX, since, "+inf").await?;
            if names.is_empty() {
                return Ok(Vec::new());
            }
            let mut pipe = redis::pipe();
            for n in &names {
                pipe.get(n);
            }
            let values: Vec<Option<String>> = pipe.query_async(&mut c).await?;
            Ok(names.into_iter().zip(values).collect())
        })
        .await
}

/// The hints of other replicas among `(key name, value)` pairs.
fn others(replica: &str, found: Vec<(String, Option<String>)>) -> Vec<Hint> {
    found
        .into_iter()
        .filter_map(|(name, value)| {
            let (provider, model) = BreakerHintKey::parse(&name)?;
            let v: HintValue = serde_json::from_str(&value?).ok()?;
            (v.replica != replica).then_some(Hint { provider, model, replica: v.replica, opened_at_ms: v.opened_at_ms })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_and_malformed_hints_are_left_out() {
        let v = |r: &str| Some(format!(r#"{{"replica":"{r}","openedAtMs":5}}"#));
        let found = vec![
            ("cb:hint:p:m".to_string(), v("other")),
            ("cb:hint:p:n".to_string(), v("me")),
            ("cb:hint:p:o".to_string(), Some("garbage".into())),
            ("cb:hint:p:q".to_string(), None),
            ("cb:hint:bad".to_string(), v("other")),
        ];
        assert_eq!(
            others("me", found),
            vec![Hint { provider: "p".into(), model: "m".into(), replica: "other".into(), opened_at_ms: 5 }]
        );
    }

    #[test]
    fn replica_names_are_random_unless_configured() {
        let a = Hints::new(&BreakerConfig::default());
        let b = Hints::new(&BreakerConfig::default());
        assert_ne!(a.replica(), b.replica());
        assert_eq!(a.ttl_secs, 30);
        let c = Hints::new(&BreakerConfig { hint_ttl: Duration::from_millis(10), replica: "r1".into() });
        assert_eq!((c.replica(), c.ttl_secs), ("r1", 1));
    }
}
