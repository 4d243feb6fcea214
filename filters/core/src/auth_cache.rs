//! The auth cache: allow answers the sidecar said may be reused (`cacheForMs`, capped by
//! `authCacheMaxTtl`), kept in VM-wide shared data under [`crate::shared_keys::auth_cache`] so
//! every worker of the Envoy reuses them, and copied into each worker's [`LocalAllows`] so a
//! repeat request on a worker costs no host call and no decode.
//!
//! A key this worker just admitted from a lease, or whose last answer here carried RateLimit
//! fields, skips the shared read for a moment: its plan has limits, so its answers are never
//! cached and the read would always miss.
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
    /// Keys whose plan has limits (admitted from a lease, or answered with RateLimit fields), until
    /// when this worker skips their shared entry: such answers are never reusable, so the shared
    /// read would be a host call that always misses, on every request.
    uncached: HashMap<SharedKey, u64>,
    /// Keys whose plan is never leased (the sidecar's `noLease`), until when this worker neither
    /// spends nor observes a lease for them (the lease record's read and CAS write, per request).
    unleased: HashMap<SharedKey, u64>,
}

impl LocalAllows {
    /// Entries kept at most (beyond it the expired are dropped, and if that is not enough, all).
    pub const MAX_ENTRIES: usize = 4096;

    fn get(&self, key: &SharedKey, now_ms: u64, gen: u64) -> Option<&CachedAllow> {
        self.entries.get(key).filter(|e| live(e, now_ms, gen))
    }

    /// How long a mark lets the worker skip the key's shared entry.
    pub const UNCACHED_MARK_MS: u64 = 1_000;

    /// Forgets every entry (the generation moved: they all predate a change).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.uncached.clear();
        self.unleased.clear();
    }

    /// The key (its auth-cache key) has limits: admitted from a lease, or answered with
    /// RateLimit fields.
    pub fn mark_uncached(&mut self, key: &SharedKey, now_ms: u64) {
        bounded_insert(&mut self.uncached, key, now_ms.saturating_add(Self::UNCACHED_MARK_MS), now_ms);
    }

    /// The key's plan is never leased (the sidecar said `noLease`).
    pub fn mark_unleased(&mut self, key: &SharedKey, now_ms: u64) {
        bounded_insert(&mut self.unleased, key, now_ms.saturating_add(Self::UNCACHED_MARK_MS), now_ms);
    }

    /// Whether any key is marked (a leased-only worker skips building the key to look one up).
    pub fn any_unleased(&self) -> bool {
        !self.unleased.is_empty()
    }

    /// Whether the worker skips the lease of `key` (its auth-cache key) now.
    pub fn unleased(&self, key: &SharedKey, now_ms: u64) -> bool {
        self.unleased.get(key).is_some_and(|until| *until > now_ms)
    }

    fn uncached(&self, key: &SharedKey, now_ms: u64) -> bool {
        self.uncached.get(key).is_some_and(|until| *until > now_ms)
    }

    fn put(&mut self, key: SharedKey, entry: CachedAllow, now_ms: u64) {
        self.uncached.remove(&key);
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

/// Inserts a mark valid until `until` (a mark there already is moved, with no copy of the key); a
/// full map drops its expired marks first, then all.
fn bounded_insert(marks: &mut HashMap<SharedKey, u64>, key: &SharedKey, until: u64, now_ms: u64) {
    if let Some(mark) = marks.get_mut(key) {
        *mark = until;
        return;
    }
    if marks.len() >= LocalAllows::MAX_ENTRIES {
        marks.retain(|_, u| *u > now_ms);
        if marks.len() >= LocalAllows::MAX_ENTRIES {
            marks.clear();
        }
    }
    marks.insert(key.clone(), until);
}

/// Whether `e` may answer at `now_ms` for a worker at generation `gen`.
fn live(e: &CachedAllow, now_ms: u64, gen: u64) -> bool {
    e.until_ms > now_ms && e.gen >= gen
}

/// The live entry at `key` for a worker at generation `gen`: the worker's copy first, then
/// shared data (copied into the worker's).
pub fn read(host: &impl Host, local: Option<&RefCell<LocalAllows>>, key: &SharedKey, now_ms: u64, gen: u64) -> Option<CachedAllow> {
    if let Some(hit) = local.and_then(|l| l.borrow().get(key, now_ms, gen).cloned()) {
        return Some(hit);
    }
    if local.is_some_and(|l| l.borrow().uncached(key, now_ms)) {
        return None;
    }
    let bytes = host.shared_get(key.as_str())?;
    let entry: CachedAllow = serde_json::from_slice(&bytes).ok()?;
    if !live(&entry, now_ms, gen) {
        return None;
    }
    if let Some(local) = local {
        local.borrow_mut().put(key.clone(), entry.clone(), now_ms);
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
    fn a_key_with_limits_skips_the_shared_read_for_a_while_and_a_new_entry_ends_the_skip() {
        let key = crate::shared_keys::auth_cache("ab", None);
        let mut host = MockHost::new();
        // another worker's entry in shared data
        host.shared_set(key.as_str(), &serde_json::to_vec(&entry(10_000)).unwrap());
        let local = RefCell::new(LocalAllows::default());
        local.borrow_mut().mark_uncached(&key, 1_000);
        assert_eq!(read(&host, Some(&local), &key, 1_500, 0), None, "skipped: a key with limits has no entry");
        assert!(read(&host, Some(&local), &key, 1_000 + LocalAllows::UNCACHED_MARK_MS, 0).is_some(), "read again later");
        // an entry this worker writes ends the skip at once
        let local = RefCell::new(LocalAllows::default());
        local.borrow_mut().mark_uncached(&key, 1_000);
        write(&mut host, Some(&local), key.clone(), entry(10_000));
        assert!(read(&host, Some(&local), &key, 1_100, 0).is_some());
        // a change of keys or plans forgets the marks with the entries
        let local = RefCell::new(LocalAllows::default());
        local.borrow_mut().mark_uncached(&key, 1_000);
        local.borrow_mut().clear();
        assert!(read(&host, Some(&local), &key, 1_100, 0).is_some());
    }

    #[test]
    fn a_never_leased_key_is_marked_for_a_while_and_a_change_forgets_it() {
        let key = crate::shared_keys::auth_cache("ab", Some("r"));
        let mut local = LocalAllows::default();
        assert!(!local.any_unleased());
        local.mark_unleased(&key, 1_000);
        assert!(local.any_unleased() && local.unleased(&key, 1_999));
        assert!(!local.unleased(&key, 2_000), "renewed by each answer that says so, else over");
        local.mark_unleased(&key, 1_500);
        assert!(local.unleased(&key, 2_499) && !local.unleased(&key, 2_500), "a mark again moves its end");
        assert!(!local.unleased(&crate::shared_keys::auth_cache("ab", None), 1_500), "per key and route");
        local.clear();
        assert!(!local.unleased(&key, 1_500), "a change of keys or plans forgets it");
    }
}
