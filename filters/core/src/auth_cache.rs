//! The auth cache: allow answers the sidecar said may be reused (`cacheForMs`, capped by
//! `authCacheMaxTtl`), kept in VM-wide shared data under [`crate::shared_keys::auth_cache`] so
//! every worker of the Envoy reuses them, and copied into each worker's [`LocalAllows`] so a
//! repeat request on a worker costs no host call and no decode.
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
}

impl LocalAllows {
    /// Entries kept at most (beyond it the expired are dropped, and if that is not enough, all).
    pub const MAX_ENTRIES: usize = 4096;

    fn get(&self, key: &SharedKey, now_ms: u64, gen: u64) -> Option<&CachedAllow> {
        self.entries.get(key).filter(|e| live(e, now_ms, gen))
    }

    /// Forgets every entry (the generation moved: they all predate a change).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    fn put(&mut self, key: SharedKey, entry: CachedAllow, now_ms: u64) {
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
