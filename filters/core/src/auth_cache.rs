//! The auth cache: allow answers the sidecar said may be reused (`cacheForMs`, capped by
//! `authCacheMaxTtl`), kept in VM-wide shared data under [`crate::shared_keys::auth_cache`] so
//! every worker of the Envoy reuses them, and copied into each worker's [`LocalAllows`] so a
//! repeat request on a worker costs no host call and no decode.
//!
//! A key this worker just admitted from a lease skips the shared read (its plan's answers carry
//! headers, so they are never cached: the read would always miss).
//!
//! Invariant: an entry is never used past its `until_ms` (in shared data or a worker's copy), nor
//! once the worker's generation passed the one its call was sent under (crate::changes), so a
//! revocation takes effect within one change poll and tick, and at worst within the TTL the
//! sidecar chose.

use crate::host::Host;
use crate::shared_keys::SharedKey;
use std::cell::RefCell;
use std::collections::HashMap;
use tollgate_wire::Header;

/// An allow answer kept in shared data, reusable until `until_ms`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedAllow {
    pub until_ms: u64,
    pub tenant: String,
    pub key_id: String,
    pub plan: String,
    #[serde(default)]
    pub request_headers: Vec<Header>,
    /// The generation the decision call was sent under (crate::changes).
    #[serde(default)]
    pub gen: u64,
}

/// A worker's own copy of the auth cache entries it has read or written (the same entries, the
/// same expiry as in shared data): a repeat request of a key on this worker is answered without
/// a host call or a decode. An entry is never kept past its `until_ms`, so revocation takes
/// effect as it does through shared data.
#[derive(Debug, Default)]
pub struct LocalAllows {
    entries: HashMap<SharedKey, CachedAllow>,
    /// Keys this worker admitted from a lease, until when it skips their shared entry: a leased
    /// plan's answers carry headers (its RateLimit fields), so they are never reusable and the
    /// shared read would be a host call that always misses, on every lease hit.
    leased: HashMap<SharedKey, u64>,
}

impl LocalAllows {
    /// Entries kept at most (beyond it the expired are dropped, and if that is not enough, all).
    pub const MAX_ENTRIES: usize = 4096;

    fn get(&self, key: &SharedKey, now_ms: u64, gen: u64) -> Option<&CachedAllow> {
        self.entries.get(key).filter(|e| live(e, now_ms, gen))
    }

    /// How long a lease hit lets the worker skip the key's shared entry.
    pub const LEASED_MARK_MS: u64 = 1_000;

    /// Forgets every entry (the generation moved: they all predate a change).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.leased.clear();
    }

    /// The key (its auth-cache key) was just admitted from a lease.
    pub fn mark_leased(&mut self, key: SharedKey, now_ms: u64) {
        if self.leased.len() >= Self::MAX_ENTRIES && !self.leased.contains_key(&key) {
            self.leased.retain(|_, until| *until > now_ms);
            if self.leased.len() >= Self::MAX_ENTRIES {
                self.leased.clear();
            }
        }
        self.leased.insert(key, now_ms.saturating_add(Self::LEASED_MARK_MS));
    }

    fn leased(&self, key: &SharedKey, now_ms: u64) -> bool {
        self.leased.get(key).is_some_and(|until| *until > now_ms)
    }

    fn put(&mut self, key: SharedKey, entry: CachedAllow, now_ms: u64) {
        self.leased.remove(&key);
        if self.entries.len() >= Self::MAX_ENTRIES && !self.entries.contains_key(&key) {
            self.entries.retain(|_, e| e.until_ms > now_ms);
            if self.entries.len() >= Self::MAX_ENTRIES {
                self.entries.clear();
            }
        }
        self.entries.insert(key, entry);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Whether `e` may answer at `now_ms` for a worker at generation `gen`.
fn live(e: &CachedAllow, now_ms: u64, gen: u64) -> bool {
    e.until_ms > now_ms && e.gen >= gen
}

/// The live entry at `key` for a worker at generation `gen`: the worker's copy first, then
/// shared data (copied into the worker's).
pub fn read(host: &impl Host, local: Option<&RefCell<LocalAllows>>, key: SharedKey, now_ms: u64, gen: u64) -> Option<CachedAllow> {
    if let Some(hit) = local.and_then(|l| l.borrow().get(&key, now_ms, gen).cloned()) {
        return Some(hit);
    }
    if local.is_some_and(|l| l.borrow().leased(&key, now_ms)) {
        return None;
    }
    let bytes = host.shared_get(key.as_str())?;
    let entry: CachedAllow = serde_json::from_slice(&bytes).ok()?;
    if !live(&entry, now_ms, gen) {
        return None;
    }
    if let Some(local) = local {
        local.borrow_mut().put(key, entry.clone(), now_ms);
    }
    Some(entry)
}

/// Stores `entry` at `key` in shared data and in the worker's copy.
pub fn write(host: &mut impl Host, local: Option<&RefCell<LocalAllows>>, key: SharedKey, entry: CachedAllow) {
    let Ok(bytes) = serde_json::to_vec(&entry) else { return };
    host.shared_set(key.as_str(), &bytes);
    if let Some(local) = local {
        local.borrow_mut().put(key, entry, host.now_ms());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::MockHost;

    fn entry(until_ms: u64) -> CachedAllow {
        CachedAllow { until_ms, tenant: "t".into(), key_id: "k".into(), plan: "p".into(), request_headers: vec![], gen: 0 }
    }

    #[test]
    fn a_lease_hit_skips_the_shared_read_for_a_while_and_a_new_entry_ends_the_skip() {
        let key = crate::shared_keys::auth_cache("ab", None);
        let mut host = MockHost::new();
        // another worker's entry in shared data
        host.shared_set(key.as_str(), &serde_json::to_vec(&entry(10_000)).unwrap());
        let local = RefCell::new(LocalAllows::default());
        local.borrow_mut().mark_leased(key.clone(), 1_000);
        assert_eq!(read(&host, Some(&local), key.clone(), 1_500, 0), None, "skipped: a leased key has no entry");
        assert!(read(&host, Some(&local), key.clone(), 1_000 + LocalAllows::LEASED_MARK_MS, 0).is_some(), "read again later");
        // an entry this worker writes ends the skip at once
        let local = RefCell::new(LocalAllows::default());
        local.borrow_mut().mark_leased(key.clone(), 1_000);
        write(&mut host, Some(&local), key.clone(), entry(10_000));
        assert!(read(&host, Some(&local), key.clone(), 1_100, 0).is_some());
        // a change of keys or plans forgets the marks with the entries
        let local = RefCell::new(LocalAllows::default());
        local.borrow_mut().mark_leased(key.clone(), 1_000);
        local.borrow_mut().clear();
        assert!(read(&host, Some(&local), key, 1_100, 0).is_some());
    }
}
