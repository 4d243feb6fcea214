//! The decision path: a filter's [`DecideRequest`] in, a [`DecideResponse`] out.
//!
//! Today a decision is authentication: the key hash is looked up (local cache first, then one
//! Redis HGETALL) and judged by [`apikey::verdict`]. Limits, quotas and routing will join this
//! same function so that a request still costs one call and one Redis round trip.
//!
//! When Redis fails, a cached answer within the stale grace is used; otherwise the decision is
//! [`DecideError::Unavailable`] and the filter applies its configured failure mode.

use crate::apikey::{self, KeyRecord};
use crate::cache::{Lookup, TtlCache};
use crate::config::CacheConfig;
use crate::keys::{Id, KeyHash};
use crate::metrics as m;
use crate::store::Store;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tollgate_wire::{codes, DecideRequest, DecideResponse};

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
}

/// Wall-clock unix seconds.
pub fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

/// Wall-clock unix milliseconds.
pub fn unix_now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Decider {
    pub fn new(store: Store, cache: &CacheConfig) -> Decider {
        let audit_window = Duration::from_secs(60);
        Decider {
            store,
            ttl: cache.ttl,
            cache: TtlCache::new(cache.ttl, cache.stale_grace, cache.max_entries),
            audited: TtlCache::new(audit_window, audit_window, cache.max_entries),
        }
    }

    pub async fn decide(&self, req: &DecideRequest) -> Result<DecideResponse, DecideError> {
        let hash = KeyHash::parse(&req.key_hash)
            .ok_or_else(|| DecideError::BadRequest("keyHash must be 64 lowercase hex characters".into()))?;
        let (record, fresh_for) = self.record(&hash).await?;
        let now_ms = unix_now_ms();
        let mut response = apikey::verdict(record.as_ref(), now_ms / 1000);
        if let (DecideResponse::Allow { cache_for_ms, .. }, Some(fresh_for)) = (&mut response, fresh_for) {
            // The filter may reuse the answer while ours is fresh, never past the key's expiry:
            // a revocation still applies within one cache TTL end to end.
            let until_expiry = record
                .as_ref()
                .and_then(|r| r.expires_at)
                .map_or(u64::MAX, |e| (e * 1000).saturating_sub(now_ms));
            let ms = (fresh_for.as_millis() as u64).min(until_expiry);
            *cache_for_ms = (ms > 0).then_some(ms);
        }
        match &response {
            DecideResponse::Allow { .. } => {
                metrics::counter!(m::DECISIONS, "outcome" => "allow", "reason" => "ok").increment(1);
            }
            DecideResponse::Deny { error, .. } => {
                let reason = codes::ALL_DENY.iter().find(|c| **c == error.as_str()).copied().unwrap_or("other");
                metrics::counter!(m::DECISIONS, "outcome" => "deny", "reason" => reason).increment(1);
                if reason == codes::REVOKED_KEY || reason == codes::EXPIRED_KEY {
                    if let Some(r) = &record {
                        self.audit(r, reason);
                    }
                }
            }
        }
        Ok(response)
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

    /// One audit line per key per hour (`apikey:authfail:{keyId}`), fail-open: if Redis cannot
    /// say, the line is written anyway. Runs off the request path.
    fn audit(&self, record: &KeyRecord, reason: &'static str) {
        let now = Instant::now();
        if matches!(self.audited.get(&record.key_id, now), Lookup::Fresh((), _)) {
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
