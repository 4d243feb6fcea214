//! The key lifecycle as plain functions over [`Control`]: issue, revoke, rotate. The admin API
//! (`super::super::admin_keys`) and the console call these; each writes the store of record
//! (PostgreSQL, or Redis for the file source), then Redis, then announces the change to every
//! replica (their cached answers for the tenant end at once, decision 212).
//!
//! Invariant: a raw key exists only in the value returned to the caller (shown once); what is
//! stored is its sha256. A key whose writes did not all complete is never returned.

use crate::apikey::{self, IssuedKey, KeyRecord, KeyStatus};
use crate::control::source::SourceError;
use crate::control::{Control, Source};
use crate::decision::unix_now;
use crate::keys::Id;
use crate::scripts::copy_key;
use crate::store::StoreError;
use std::sync::Arc;
use std::time::Duration;

/// A lifetime that makes no key.
#[derive(Debug, thiserror::Error)]
pub enum BadLifetime {
    #[error("not a duration (e.g. \"30d\"): {0}")]
    Unreadable(#[from] humantime::DurationError),
    #[error("must be above zero")]
    Zero,
    #[error("must be at most 100 years")]
    TooLong,
}

/// The longest key lifetime: a bound that keeps `now + lifetime` (and its milliseconds) far from
/// overflowing, and the PostgreSQL column positive.
const MAX_LIFETIME_SECS: u64 = 100 * 366 * 86_400;

/// When a key issued at `now` (unix seconds) with lifetime `expires_in` expires: `None` without
/// one; at least a second later with one.
pub fn expiry(expires_in: Option<&str>, now: u64) -> Result<Option<u64>, BadLifetime> {
    let Some(text) = expires_in else { return Ok(None) };
    let d = humantime::parse_duration(text)?;
    if d.is_zero() {
        return Err(BadLifetime::Zero);
    }
    if d.as_secs() > MAX_LIFETIME_SECS {
        return Err(BadLifetime::TooLong);
    }
    Ok(Some(now.saturating_add(d.as_secs().max(1))))
}

/// Why a key operation did nothing (or, for [`KeyError::Unavailable`], may not be in force yet).
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Bad input, naming the field.
    #[error("{message}")]
    Invalid { field: &'static str, message: String },
    #[error("{0}")]
    NotFound(String),
    /// The key's state forbids it (`code`: `key_revoked`, `key_expired`).
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// A store did not answer; the message says what is in force.
    #[error("{0}")]
    Unavailable(String),
}

fn invalid(field: &'static str, message: impl Into<String>) -> KeyError {
    KeyError::Invalid { field, message: message.into() }
}

/// What a new key is made of (the admin API's `POST /v1/keys` body).
#[derive(Debug, Clone, Default)]
pub struct NewKey {
    pub tenant: String,
    pub plan: String,
    /// A lifetime, e.g. "30d"; `None`: never expires.
    pub expires_in: Option<String>,
}

/// A key just made: its raw value (shown once, never stored) and its record.
#[derive(Debug)]
pub struct Issued {
    pub raw: String,
    pub record: KeyRecord,
    /// The configuration version the change was announced as; `None`: not announced yet
    /// (announced again in the background until Redis takes it).
    pub version: Option<u64>,
}

/// A key whose change is in force.
#[derive(Debug)]
pub struct Changed {
    pub record: KeyRecord,
    pub version: Option<u64>,
}

/// A rotation: the successor (raw value shown once) and the previous key with its new expiry.
#[derive(Debug)]
pub struct Rotated {
    pub successor: Issued,
    pub previous: KeyRecord,
}

/// The overlap of a rotation when none is given.
pub const DEFAULT_OVERLAP: Duration = Duration::from_secs(24 * 3600);
/// The longest overlap: a rotation is a replacement, not a second lifetime.
pub const MAX_OVERLAP: Duration = Duration::from_secs(30 * 24 * 3600);

/// Reads an overlap ("24h", "2s"; at most [`MAX_OVERLAP`]; "0s" ends the old key at once).
pub fn overlap(text: Option<&str>) -> Result<Duration, KeyError> {
    let Some(text) = text else { return Ok(DEFAULT_OVERLAP) };
    let d = humantime::parse_duration(text).map_err(|e| invalid("overlap", format!("not a duration (e.g. \"24h\"): {e}")))?;
    if d > MAX_OVERLAP {
        return Err(invalid("overlap", "at most 30 days"));
    }
    Ok(d)
}

/// When a rotation at `now` ends the previous key `r`: `now + overlap`, or its own expiry when
/// that comes first (a rotation never lengthens a key's life).
pub fn previous_expiry(r: &KeyRecord, now: u64, overlap: Duration) -> u64 {
    let end = now.saturating_add(overlap.as_secs());
    r.expires_at.map_or(end, |e| e.min(end))
}

/// When the successor of `r` made at `now` expires: after the lifetime `r` was given (its
/// expiry minus its creation), counted from `now`; never when `r` never expires.
pub fn successor_expiry(r: &KeyRecord, now: u64) -> Option<u64> {
    r.expires_at.map(|e| now.saturating_add(e.saturating_sub(r.created_at).max(1)))
}

/// Issues a key for an existing tenant on an existing plan.
pub async fn create(control: &Arc<Control>, new: &NewKey) -> Result<Issued, KeyError> {
    let tenant = Id::parse(&new.tenant).ok_or_else(|| invalid("tenant", "use 1-64 of letters, digits, '_', '-', '.'"))?;
    let plan = Id::parse(&new.plan).ok_or_else(|| invalid("plan", "use 1-64 of letters, digits, '_', '-', '.'"))?;
    let snapshot = control.live.get();
    if !snapshot.plans.contains_key(plan.as_str()) {
        return Err(invalid("plan", format!("no plan '{plan}'")));
    }
    if matches!(control.source, Source::Postgres(_)) && !snapshot.tenants.contains_key(tenant.as_str()) {
        return Err(invalid("tenant", format!("no tenant '{tenant}'")));
    }
    let now = unix_now();
    let expires_at = expiry(new.expires_in.as_deref(), now)
        .map_err(|_| invalid("expires_in", "a duration above zero and at most 100 years, e.g. \"30d\""))?;
    let issued = apikey::issue(tenant, plan, now, expires_at);
    store_new(control, &issued).await?;
    let version = control.publish(Some(&issued.record.tenant)).await;
    Ok(Issued { raw: issued.raw, record: issued.record, version })
}

/// Writes a new key to the store of record, then Redis; undone in PostgreSQL when Redis does not
/// take it (the raw key is never shown: no active record of it may stay, which the next start
/// would copy into Redis).
async fn store_new(control: &Control, issued: &IssuedKey) -> Result<(), KeyError> {
    let pg = match &control.source {
        Source::Postgres(pg) => Some(pg),
        Source::File(_) => None,
    };
    if let Some(pg) = pg {
        match pg.create_key(&issued.hash, &issued.record).await {
            Ok(()) => {}
            // deleted since this replica's copy said it was there (decision 174)
            Err(SourceError::Missing(field, m)) => return Err(invalid(field, m)),
            Err(e) => return Err(KeyError::Unavailable(e.to_string())),
        }
    }
    if let Err(e) = control.store.create_key(&issued.hash, &issued.record).await {
        if let Some(pg) = pg {
            if let Err(undo) = pg.delete_key(&issued.record.key_id).await {
                tracing::warn!(key_id = %issued.record.key_id, error = %undo, "a key whose creation failed stays in PostgreSQL; revoke it");
            }
        }
        return Err(KeyError::Unavailable(format!("the key could not be written to Redis: {e}")));
    }
    Ok(())
}

/// Revokes a key at once, everywhere (decision 130: a revocation not taken by both stores is
/// completed in the background).
pub async fn revoke(control: &Arc<Control>, key_id: &Id) -> Result<Changed, KeyError> {
    let now = unix_now();
    let record = match &control.source {
        Source::Postgres(pg) => match pg.revoke_key(key_id, now).await {
            Ok(Some((hash, record))) => {
                if let Err(e) = control.store.create_key(&hash, &record).await {
                    control.complete_revocation(key_id.clone(), now);
                    return Err(KeyError::Unavailable(format!(
                        "not in force yet: revoked in PostgreSQL, but Redis did not take it ({e}); this sidecar keeps trying until it does (retrying is safe)"
                    )));
                }
                record
            }
            // A key PostgreSQL lacks (created in Redis alone by an older `keys create`) still
            // authenticates: Redis is where it lives, as `tollgate-sidecar keys revoke` does.
            Ok(None) => revoke_in_redis(control, key_id, now).await?,
            Err(e) => {
                control.complete_revocation(key_id.clone(), now);
                return Err(KeyError::Unavailable(format!(
                    "not in force yet: {e}; this sidecar keeps trying until PostgreSQL and Redis take the revocation (retrying is safe)"
                )));
            }
        },
        Source::File(_) => revoke_in_redis(control, key_id, now).await?,
    };
    let version = control.publish(Some(&record.tenant)).await;
    Ok(Changed { record, version })
}

async fn revoke_in_redis(control: &Control, key_id: &Id, now: u64) -> Result<KeyRecord, KeyError> {
    match control.store.revoke_key(key_id, now).await {
        Ok(record) => Ok(record),
        Err(StoreError::NotFound(m)) => Err(KeyError::NotFound(m)),
        Err(e) => Err(KeyError::Unavailable(e.to_string())),
    }
}

/// The record of a key by its id, from the store of record.
pub async fn get(control: &Control, key_id: &Id) -> Result<KeyRecord, KeyError> {
    let found = match &control.source {
        Source::Postgres(pg) => pg.key(key_id).await.map_err(|e| KeyError::Unavailable(e.to_string()))?.map(|(_, r)| r),
        Source::File(_) => None,
    };
    let found = match found {
        Some(r) => Some(r),
        // the file source's keys, or one PostgreSQL lacks (an older `keys create`)
        None => control.store.key_by_id(key_id).await.map_err(|e| KeyError::Unavailable(e.to_string()))?.map(|(_, r)| r),
    };
    found.ok_or_else(|| KeyError::NotFound(format!("no key with id {key_id}")))
}

/// Rotates a key: a successor on the same tenant and plan (and the same lifetime, counted from
/// now; `expires_in` instead when given), returned raw once; the previous key expires after
/// `overlap` (or sooner, if it already did). Both authenticate until then; either can be revoked
/// at once; each keeps its own id, so usage stays attributed per key. A revoked or expired key
/// is not rotated (409). When the previous key's new expiry cannot be written, the successor is
/// revoked again and nothing is returned (503: retrying is safe).
pub async fn rotate(control: &Arc<Control>, key_id: &Id, overlap: Duration, expires_in: Option<&str>) -> Result<Rotated, KeyError> {
    let previous = get(control, key_id).await?;
    let now = unix_now();
    if previous.status == KeyStatus::Revoked {
        return Err(KeyError::Conflict { code: "key_revoked", message: format!("key {key_id} is revoked: issue a new key instead") });
    }
    if previous.expires_at.is_some_and(|e| e <= now) {
        return Err(KeyError::Conflict { code: "key_expired", message: format!("key {key_id} has expired: issue a new key instead") });
    }
    let expires_at = match expires_in {
        Some(text) => expiry(Some(text), now)
            .map_err(|_| invalid("expires_in", "a duration above zero and at most 100 years, e.g. \"30d\""))?,
        None => successor_expiry(&previous, now),
    };
    let issued = apikey::issue(previous.tenant.clone(), previous.plan.clone(), now, expires_at);
    store_new(control, &issued).await?;
    let ends = previous_expiry(&previous, now, overlap);
    let previous = match shorten(control, key_id, ends).await {
        Ok(r) => r,
        Err(e) => {
            // the successor was never shown: it must not authenticate
            if let Err(undo) = revoke(control, &issued.record.key_id).await {
                tracing::warn!(key_id = %issued.record.key_id, error = %undo, "the successor of a failed rotation is not revoked yet");
            }
            return Err(e);
        }
    };
    let version = control.publish(Some(&previous.tenant)).await;
    Ok(Rotated { successor: Issued { raw: issued.raw, record: issued.record, version }, previous })
}

/// Sets a key's expiry to `at` unless it expires sooner: the store of record, then Redis (the
/// record copied with `copy_key.lua`, which never undoes a revocation made meanwhile).
async fn shorten(control: &Control, key_id: &Id, at: u64) -> Result<KeyRecord, KeyError> {
    let unavailable = |e: &dyn std::fmt::Display| KeyError::Unavailable(format!("the previous key's expiry could not be written: {e}"));
    if let Source::Postgres(pg) = &control.source {
        match pg.shorten_key(key_id, at).await {
            Ok(Some((hash, record))) => {
                copy_key::run(&control.store, &hash, &record).await.map_err(|e| unavailable(&e))?;
                return Ok(record);
            }
            Ok(None) => {} // lives in Redis alone
            Err(e) => return Err(unavailable(&e)),
        }
    }
    match control.store.shorten_key(key_id, at).await {
        Ok(r) => Ok(r),
        Err(StoreError::NotFound(m)) => Err(KeyError::NotFound(m)),
        Err(e) => Err(unavailable(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(created_at: u64, expires_at: Option<u64>) -> KeyRecord {
        let id = |s: &str| Id::parse(s).unwrap();
        KeyRecord { key_id: id("key_a"), tenant: id("acme"), plan: id("free"), status: KeyStatus::Active, created_at, expires_at, revoked_at: None }
    }

    #[test]
    fn an_overlap_is_a_bounded_duration_24h_by_default() {
        assert_eq!(overlap(None).unwrap(), DEFAULT_OVERLAP);
        assert_eq!(overlap(Some("2s")).unwrap(), Duration::from_secs(2));
        assert_eq!(overlap(Some("0s")).unwrap(), Duration::ZERO);
        assert_eq!(overlap(Some("30d")).unwrap(), MAX_OVERLAP);
        for bad in ["31d", "soon", "-1s", ""] {
            assert!(matches!(overlap(Some(bad)), Err(KeyError::Invalid { field: "overlap", .. })), "{bad}");
        }
    }

    #[test]
    fn a_rotation_never_lengthens_the_previous_keys_life() {
        let day = Duration::from_secs(86_400);
        assert_eq!(previous_expiry(&record(0, None), 1_000, day), 1_000 + 86_400);
        assert_eq!(previous_expiry(&record(0, Some(5_000)), 1_000, day), 5_000, "it expired sooner anyway");
        assert_eq!(previous_expiry(&record(0, Some(500_000)), 1_000, day), 1_000 + 86_400);
        assert_eq!(previous_expiry(&record(0, None), 1_000, Duration::ZERO), 1_000, "no overlap: over at once");
    }

    #[test]
    fn a_successor_gets_the_lifetime_its_predecessor_was_given() {
        assert_eq!(successor_expiry(&record(100, None), 1_000), None);
        assert_eq!(successor_expiry(&record(100, Some(200)), 1_000), Some(1_100));
        assert_eq!(successor_expiry(&record(100, Some(100)), 1_000), Some(1_001), "at least a second");
    }
}
