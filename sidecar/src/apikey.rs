//! API-key records and the pure rules about them: how a record is stored in its Redis hash, how
//! a lookup becomes a verdict at a given time, and how new keys are made.
//!
//! Invariant: the raw key exists only in [`IssuedKey`], returned once by [`issue`] to be printed;
//! what is stored is its sha256 ([`KeyHash`]).

use crate::keys::{Id, KeyHash};
use crate::scopes::KeyScopes;
use rand::distr::{Alphanumeric, SampleString};
use std::collections::HashMap;
use tollgate_wire::{codes, DecideResponse};

/// Prefix of every raw key Tollgate issues (makes leaked keys easy to find by secret scanners).
pub const RAW_KEY_PREFIX: &str = "tg_";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    Active,
    Revoked,
}

impl KeyStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyStatus::Active => "active",
            KeyStatus::Revoked => "revoked",
        }
    }
}

/// One API key as stored in `apikey:{sha256}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub key_id: Id,
    pub tenant: Id,
    pub plan: Id,
    pub status: KeyStatus,
    /// Unix seconds.
    pub created_at: u64,
    /// Unix seconds; `None` = never expires.
    pub expires_at: Option<u64>,
    pub revoked_at: Option<u64>,
    /// A name people give the key (what it is for); never used to decide.
    pub label: Option<String>,
    /// What the key may reach, and from where (crate::scopes; decision 333).
    pub scopes: KeyScopes,
    /// Unix seconds, to the minute: when a decision last authenticated the key (written off the
    /// request path, batched: decision 336).
    pub last_used_at: Option<u64>,
}

impl KeyRecord {
    /// The hash fields, as written with HSET.
    pub fn to_fields(&self) -> Vec<(&'static str, String)> {
        let mut f = vec![
            ("key_id", self.key_id.to_string()),
            ("tenant", self.tenant.to_string()),
            ("plan", self.plan.to_string()),
            ("status", self.status.as_str().to_string()),
            ("created_at", self.created_at.to_string()),
        ];
        if let Some(e) = self.expires_at {
            f.push(("expires_at", e.to_string()));
        }
        if let Some(r) = self.revoked_at {
            f.push(("revoked_at", r.to_string()));
        }
        if let Some(l) = &self.label {
            f.push(("label", l.clone()));
        }
        f.extend(self.scopes.to_fields());
        if let Some(u) = self.last_used_at {
            f.push(("last_used_at", u.to_string()));
        }
        f
    }

    /// Reads HGETALL's answer. An empty map is "no such key" (`Ok(None)`); a malformed record is
    /// an error naming the field (and is treated as unknown by the decision path).
    pub fn from_fields(map: &HashMap<String, String>) -> Result<Option<KeyRecord>, BadRecord> {
        if map.is_empty() {
            return Ok(None);
        }
        let get = |f: &'static str| map.get(f).ok_or(BadRecord::Missing(f));
        let id = |f: &'static str| get(f).and_then(|v| Id::parse(v).ok_or(BadRecord::Invalid(f)));
        let num = |f: &'static str| -> Result<Option<u64>, BadRecord> {
            match map.get(f).map(String::as_str) {
                None | Some("") => Ok(None),
                Some(v) => v.parse().map(Some).map_err(|_| BadRecord::Invalid(f)),
            }
        };
        let status = match get("status")?.as_str() {
            "active" => KeyStatus::Active,
            "revoked" => KeyStatus::Revoked,
            _ => return Err(BadRecord::Invalid("status")),
        };
        Ok(Some(KeyRecord {
            key_id: id("key_id")?,
            tenant: id("tenant")?,
            plan: id("plan")?,
            status,
            created_at: num("created_at")?.unwrap_or(0),
            expires_at: num("expires_at")?,
            revoked_at: num("revoked_at")?,
            label: map.get("label").filter(|l| !l.is_empty()).cloned(),
            scopes: KeyScopes::from_fields(|n| map.get(n).cloned()).ok_or(BadRecord::Invalid("scope"))?,
            last_used_at: num("last_used_at")?,
        }))
    }
}

/// A stored record that cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadRecord {
    #[error("record field {0} missing")]
    Missing(&'static str),
    #[error("record field {0} invalid")]
    Invalid(&'static str),
}

/// The verdict on a looked-up key at time `now` (unix seconds).
pub fn verdict(record: Option<&KeyRecord>, now: u64) -> DecideResponse {
    let deny = |code: &str, message: &str| DecideResponse::Deny {
        status: 401,
        error: code.to_string(),
        message: message.to_string(),
        limit: None,
        response_headers: vec![],
    };
    match record {
        None => deny(codes::UNKNOWN_KEY, "the API key is not valid"),
        Some(r) if r.status == KeyStatus::Revoked => deny(codes::REVOKED_KEY, "the API key was revoked"),
        Some(r) if r.expires_at.is_some_and(|e| e <= now) => deny(codes::EXPIRED_KEY, "the API key has expired"),
        Some(r) => DecideResponse::allow(r.tenant.to_string(), r.key_id.to_string(), r.plan.to_string()),
    }
}

/// A freshly issued key: the raw value is shown once and never stored.
pub struct IssuedKey {
    pub raw: String,
    pub hash: KeyHash,
    pub record: KeyRecord,
}

/// Makes a new key for `tenant` on `plan` (random, 40 alphanumerics after the prefix: ~238 bits).
pub fn issue(tenant: Id, plan: Id, now: u64, expires_at: Option<u64>) -> IssuedKey {
    let mut rng = rand::rng();
    let raw = format!("{RAW_KEY_PREFIX}{}", Alphanumeric.sample_string(&mut rng, 40));
    let key_id = format!("key_{}", Alphanumeric.sample_string(&mut rng, 16).to_ascii_lowercase());
    let hash = hash_raw_key(&raw);
    let record = KeyRecord {
        key_id: Id::parse(&key_id).expect("key_ + alphanumerics is a valid id"),
        tenant,
        plan,
        status: KeyStatus::Active,
        created_at: now,
        expires_at,
        revoked_at: None,
        label: None,
        scopes: KeyScopes::default(),
        last_used_at: None,
    };
    IssuedKey { raw, hash, record }
}

/// sha256 hex of a raw key, exactly as the filter computes it.
pub fn hash_raw_key(raw: &str) -> KeyHash {
    use sha2::{Digest, Sha256};
    let hex: String = Sha256::digest(raw.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    KeyHash::parse(&hex).unwrap_or_else(|| unreachable!("sha256 hex is 64 lowercase hex chars"))
}

/// A page of a key listing (decision 184): at most `limit` keys whose ids sort after `after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPage {
    pub after: Option<Id>,
    pub limit: usize,
}

impl KeyPage {
    /// The most keys one page may ask for.
    pub const MAX_LIMIT: usize = 10_000;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> KeyRecord {
        KeyRecord {
            key_id: Id::parse("key_1").unwrap(),
            tenant: Id::parse("acme").unwrap(),
            plan: Id::parse("free").unwrap(),
            status: KeyStatus::Active,
            created_at: 100,
            expires_at: Some(200),
            revoked_at: None,
            label: Some("ci".into()),
            scopes: KeyScopes::from_lists(&["chat".into()], &[], &["GET".into()], &["10.0.0.0/8".into()], &["gpt-4o*".into()]).unwrap(),
            last_used_at: Some(120),
        }
    }

    #[test]
    fn fields_round_trip() {
        let r = record();
        let map: HashMap<String, String> = r.to_fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(KeyRecord::from_fields(&map).unwrap(), Some(r));
        assert_eq!(KeyRecord::from_fields(&HashMap::new()).unwrap(), None);
        let mut bad = map.clone();
        bad.insert("status".into(), "weird".into());
        assert_eq!(KeyRecord::from_fields(&bad).unwrap_err(), BadRecord::Invalid("status"));
    }

    #[test]
    fn verdicts_at_the_boundaries() {
        let r = record();
        assert!(matches!(verdict(Some(&r), 199), DecideResponse::Allow { .. }));
        let code = |v: DecideResponse| match v {
            DecideResponse::Deny { error, status, .. } => {
                assert_eq!(status, 401);
                error
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(code(verdict(Some(&r), 200)), "expired_key");
        assert_eq!(code(verdict(None, 0)), "unknown_key");
        let revoked = KeyRecord { status: KeyStatus::Revoked, ..r };
        assert_eq!(code(verdict(Some(&revoked), 0)), "revoked_key");
    }

    #[test]
    fn issued_keys_are_random_and_hash_like_the_filter() {
        let a = issue(Id::parse("t").unwrap(), Id::parse("p").unwrap(), 1, None);
        let b = issue(Id::parse("t").unwrap(), Id::parse("p").unwrap(), 1, None);
        assert_ne!(a.raw, b.raw);
        assert_ne!(a.record.key_id, b.record.key_id);
        assert!(a.raw.starts_with("tg_") && a.raw.len() == 43);
        assert_eq!(hash_raw_key("abc").as_str(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(!a.record.to_fields().iter().any(|(_, v)| v.contains(&a.raw)));
    }
}
