//! A small bounded cache of key lookups with a freshness TTL and a stale grace.
//!
//! Entries younger than `ttl` are answered without Redis; while Redis is unreachable, entries
//! younger than `stale_grace` still are. The size bound holds under a flood of random keys: when
//! full, expired entries are swept, and if that frees nothing the oldest-inserted eighth goes.
//! Time is passed in, so the rules are tested without sleeping.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `[cache]` of the sidecar configuration: the key-record cache of the decision path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// How long a key lookup (found or not) is answered locally without asking Redis. This bounds
    /// how long a revocation takes to apply.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// While Redis is unreachable, a cached answer up to this old is still used.
    #[serde(with = "humantime_serde")]
    pub stale_grace: Duration,
    /// Bound on cached entries (a flood of random keys cannot grow memory past it).
    pub max_entries: usize,
    /// How often the keys' last-use times (to the minute) are written to Redis and PostgreSQL,
    /// in one batch (decision 336).
    #[serde(with = "humantime_serde")]
    pub last_used_interval: Duration,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig { ttl: Duration::from_millis(500), stale_grace: Duration::from_secs(60), max_entries: 100_000, last_used_interval: Duration::from_secs(60) }
    }
}

pub struct TtlCache<K, V> {
    inner: Mutex<HashMap<K, (V, Instant)>>,
    ttl: Duration,
    stale_grace: Duration,
    max_entries: usize,
}

/// What a lookup found.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup<V> {
    /// Within the TTL; the duration is how much of it is left.
    Fresh(V, Duration),
    /// Older than the TTL but within the stale grace: usable only when the source is down.
    Stale(V),
    Miss,
}

impl<K: Hash + Eq + Clone, V: Clone> TtlCache<K, V> {
    pub fn new(ttl: Duration, stale_grace: Duration, max_entries: usize) -> Self {
        TtlCache { inner: Mutex::new(HashMap::new()), ttl, stale_grace: stale_grace.max(ttl), max_entries: max_entries.max(1) }
    }

    pub fn get(&self, key: &K, now: Instant) -> Lookup<V> {
        let map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(key) {
            Some((v, at)) => {
                let age = now.saturating_duration_since(*at);
                if age < self.ttl {
                    Lookup::Fresh(v.clone(), self.ttl - age)
                } else if age < self.stale_grace {
                    Lookup::Stale(v.clone())
                } else {
                    Lookup::Miss
                }
            }
            None => Lookup::Miss,
        }
    }

    pub fn insert(&self, key: K, value: V, now: Instant) {
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.max_entries && !map.contains_key(&key) {
            let grace = self.stale_grace;
            map.retain(|_, (_, at)| now.saturating_duration_since(*at) < grace);
            if map.len() >= self.max_entries {
                let mut by_age: Vec<(K, Instant)> = map.iter().map(|(k, (_, at))| (k.clone(), *at)).collect();
                by_age.sort_by_key(|(_, at)| *at);
                let drop = (self.max_entries / 8).max(1);
                for (k, _) in by_age.into_iter().take(drop) {
                    map.remove(&k);
                }
            }
        }
        map.insert(key, (value, now));
    }

    pub fn remove(&self, key: &K) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }

    /// Keeps only the entries for which `keep` is true.
    pub fn retain(&self, mut keep: impl FnMut(&K, &V) -> bool) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).retain(|k, (v, _)| keep(k, v));
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_then_stale_then_gone() {
        let c = TtlCache::new(Duration::from_millis(500), Duration::from_secs(60), 10);
        let t0 = Instant::now();
        c.insert("k", 1, t0);
        assert_eq!(c.get(&"k", t0 + Duration::from_millis(499)), Lookup::Fresh(1, Duration::from_millis(1)));
        assert_eq!(c.get(&"k", t0 + Duration::from_millis(500)), Lookup::Stale(1));
        assert_eq!(c.get(&"k", t0 + Duration::from_secs(60)), Lookup::Miss);
        assert_eq!(c.get(&"other", t0), Lookup::Miss);
    }

    #[test]
    fn size_is_bounded_under_a_flood() {
        let c = TtlCache::new(Duration::from_secs(1), Duration::from_secs(60), 100);
        let t0 = Instant::now();
        for i in 0..10_000 {
            c.insert(i, i, t0 + Duration::from_micros(i as u64));
            assert!(c.len() <= 100);
        }
        // the newest entry is kept
        assert!(matches!(c.get(&9_999, t0 + Duration::from_millis(20)), Lookup::Fresh(9_999, _)));
    }

    #[test]
    fn expired_entries_are_swept_first() {
        let c = TtlCache::new(Duration::from_secs(1), Duration::from_secs(2), 2);
        let t0 = Instant::now();
        c.insert("old", 1, t0);
        c.insert("new", 2, t0 + Duration::from_secs(3));
        c.insert("newer", 3, t0 + Duration::from_secs(3));
        assert_eq!(c.get(&"old", t0 + Duration::from_secs(3)), Lookup::Miss);
        assert_eq!(c.get(&"new", t0 + Duration::from_secs(3)), Lookup::Fresh(2, Duration::from_secs(1)));
        assert_eq!(c.get(&"newer", t0 + Duration::from_secs(3)), Lookup::Fresh(3, Duration::from_secs(1)));
    }
}
