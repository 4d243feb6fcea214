//! A worker's share of its Envoy's leases (issue 16): a spend that finds units in the shared
//! record takes a few of them for this worker at once, in the same CAS write, and the worker's
//! next requests of that key spend them from its own memory — no shared-data read or write per
//! request.
//!
//! A share is sized to what the whole Envoy spends of the key in [`SHARE_SPAN_MS`] (the record's
//! observed rate), at most half of what is left in the batch it is taken from (another worker
//! still finds units), and at least the one unit of the request taking it. Its units left the
//! record in the CAS write that took them, so no other worker can spend them: a unit is still
//! spent at most once. A share expires with the batch it came from, and carries the generation
//! of its grant (crate::changes): a worker at a later generation spends none of it. What a share
//! holds unspent when it expires, is dropped or is evicted is under-use, never over-use; it is at
//! most a [`SHARE_SPAN_MS`] of the key's traffic per worker.
//!
//! The record still observes the Envoy's rate: the requests a share admitted are added to the
//! record's observation with the next spend that reaches it. A denied renewal or a 401 drops this
//! worker's share at once; another worker's share of that key runs out or expires (within a
//! share span at the key's rate, at most the grant's lifetime), and a revocation reaches every
//! worker through the generation.

use super::record::LeaseIdentity;
use std::collections::HashMap;

/// A share lasts about this long at the Envoy's rate of its key.
pub const SHARE_SPAN_MS: u64 = 20;
/// Keys a worker holds a share of; beyond it a spend takes no share (one unit, as without shares).
pub const MAX_SHARES: usize = 1024;
/// How often a full table looks for expired shares to drop.
const PRUNE_EVERY_MS: u64 = 50;

/// Units of one key's lease held by this worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    pub units: u64,
    /// The expiry of the batch the units came from.
    pub until_ms: u64,
    /// The generation of the grant (crate::changes).
    pub gen: u64,
    pub identity: LeaseIdentity,
}

/// One worker's shares, by lease key, and the requests each admitted that the record has not
/// yet observed.
#[derive(Debug)]
pub struct Shares {
    held: HashMap<String, (Share, u64)>,
    capacity: usize,
    pruned_ms: u64,
}

impl Default for Shares {
    fn default() -> Self {
        Shares::with_capacity(MAX_SHARES)
    }
}

impl Shares {
    /// A table of at most `capacity` keys (0: never a share, every spend goes to the record).
    pub fn with_capacity(capacity: usize) -> Shares {
        Shares { held: HashMap::new(), capacity, pruned_ms: 0 }
    }

    /// Spends one unit of this worker's share of `key`, if it holds a live one.
    pub fn spend(&mut self, key: &str, now_ms: u64, gen: u64) -> Option<LeaseIdentity> {
        let (share, admitted) = self.held.get_mut(key)?;
        if share.units == 0 || share.until_ms <= now_ms || share.gen < gen {
            return None;
        }
        share.units -= 1;
        *admitted += 1;
        Some(share.identity.clone())
    }

    /// The requests this worker admitted from its share of `key` since the record last heard of
    /// them (the record adds them to its observation); resets the tally.
    pub fn take_admitted(&mut self, key: &str) -> u64 {
        self.held.get_mut(key).map_or(0, |(_, admitted)| std::mem::take(admitted))
    }

    /// How many units a spend of `key` should take for this worker, its own included: `rate_per_s`
    /// is the Envoy's rate of the key, `available` what the batch holds. One when the table has no
    /// room for the share (a full table drops its expired shares first, every
    /// [`PRUNE_EVERY_MS`] at most).
    pub fn size(&mut self, key: &str, rate_per_s: f64, available: u64, now_ms: u64) -> u64 {
        if available <= 1 || !self.room(key, now_ms) {
            return available.min(1);
        }
        let wanted = (rate_per_s * SHARE_SPAN_MS as f64 / 1000.0).ceil();
        let wanted = if wanted.is_finite() && wanted >= 1.0 { wanted as u64 } else { 1 };
        wanted.clamp(1, available / 2)
    }

    fn room(&mut self, key: &str, now_ms: u64) -> bool {
        if self.held.len() < self.capacity || self.held.contains_key(key) {
            return true;
        }
        if self.capacity == 0 || now_ms < self.pruned_ms + PRUNE_EVERY_MS {
            return false;
        }
        self.pruned_ms = now_ms;
        // an expired or empty share goes, with the requests it admitted that the record has not
        // heard of (a key gone quiet must not hold its slot for the VM's life; the record's rate
        // merely misses them)
        self.held.retain(|_, (s, _)| s.units > 0 && s.until_ms > now_ms);
        self.held.len() < self.capacity
    }

    /// Holds `share` of `key` (replacing what was held; [`Shares::size`] made room for it).
    pub fn hold(&mut self, key: &str, share: Share) {
        let admitted = self.take_admitted(key);
        self.held.insert(key.to_string(), (share, admitted));
    }

    /// Drops this worker's share of `key` (its key was refused, or its lease dropped).
    pub fn drop_key(&mut self, key: &str) {
        self.held.remove(key);
    }

    /// Units this worker holds of `key` at `now_ms`.
    pub fn units(&self, key: &str, now_ms: u64) -> u64 {
        self.held.get(key).map_or(0, |(s, _)| if s.until_ms > now_ms { s.units } else { 0 })
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn share(units: u64, until_ms: u64, gen: u64) -> Share {
        Share { units, until_ms, gen, identity: LeaseIdentity { tenant: "acme".into(), ..Default::default() } }
    }

    #[test]
    fn a_share_is_a_span_of_the_rate_at_most_half_the_batch_and_none_without_room() {
        let mut s = Shares::default();
        assert_eq!(s.size("k", 1000.0, 1000, 0), 20, "20 ms at 1000/s");
        assert_eq!(s.size("k", 1000.0, 30, 0), 15, "half of what is left");
        assert_eq!(s.size("k", 10.0, 1000, 0), 1, "a slow key: the request's own unit");
        assert_eq!(s.size("k", 1e12, 9, 0), 4);
        assert_eq!((s.size("k", 1000.0, 1, 0), s.size("k", 1000.0, 0, 0)), (1, 0));
        assert_eq!(s.size("k", f64::NAN, 100, 0), 1);
        assert_eq!(Shares::with_capacity(0).size("k", 1000.0, 1000, 0), 1, "no table: one unit per spend");
    }

    #[test]
    fn a_share_is_spent_until_empty_expired_or_of_an_older_generation() {
        let mut s = Shares::default();
        assert_eq!(s.spend("k", 0, 0), None);
        s.hold("k", share(2, 100, 3));
        assert!(s.spend("k", 10, 3).is_some());
        assert_eq!(s.spend("k", 10, 4), None, "a later generation spends none of it");
        assert!(s.spend("k", 99, 3).is_some());
        assert_eq!(s.spend("k", 99, 3), None, "empty");
        assert_eq!(s.take_admitted("k"), 2);
        assert_eq!(s.take_admitted("k"), 0);
        s.hold("k", share(5, 100, 3));
        assert_eq!(s.spend("k", 100, 3), None, "expired with its batch");
        s.drop_key("k");
        assert!(s.is_empty());
    }

    #[test]
    fn a_new_share_keeps_the_admitted_tally_and_a_full_table_takes_none_until_one_expires() {
        let mut s = Shares::with_capacity(2);
        s.hold("a", share(1, 100, 0));
        s.spend("a", 1, 0);
        s.hold("a", share(3, 200, 0));
        assert_eq!(s.take_admitted("a"), 1, "not lost by the next claim");
        s.hold("b", share(1, 50, 0));
        assert_eq!(s.size("a", 1000.0, 100, 2), 20, "a held key has room");
        assert_eq!(s.size("c", 1000.0, 100, 2), 1, "full: no share for a third key");
        assert_eq!(s.size("c", 1000.0, 100, 60), 20, "b expired and was dropped");
        assert_eq!((s.len(), s.units("a", 60), s.units("b", 60)), (1, 3, 0));
        // a key that spent its share and went quiet keeps its tally, but not its slot
        s.hold("c", share(1, 500, 0));
        s.spend("c", 61, 0);
        assert_eq!(s.size("d", 1000.0, 100, 62), 1, "full, and nothing expired yet");
        assert_eq!(s.size("d", 1000.0, 100, 250), 20, "a's and c's shares are gone: room");
        assert!(s.is_empty());
    }
}
