//! When each key was last used, noted by decisions in memory and taken in batches by the
//! last-use flusher (crate::control::last_used; decision 336): never a Redis or PostgreSQL write
//! per request. Coarse by design: to the minute.

use crate::keys::{Id, KeyHash};
use std::collections::HashMap;
use std::sync::Mutex;

/// The most keys noted between two flushes; a key beyond it waits for the next (it is noted
/// again by its next decision).
pub const MAX_NOTED: usize = 100_000;

/// Keys used since the last flush: hash → (key id, unix seconds to the minute).
#[derive(Default)]
pub struct LastUsed {
    noted: Mutex<HashMap<KeyHash, (Id, u64)>>,
}

/// `now_ms` down to its minute, in unix seconds.
pub fn minute_of(now_ms: u64) -> u64 {
    now_ms / 60_000 * 60
}

impl LastUsed {
    /// Notes a use of the key at `now_ms` (a map update; nothing leaves the process).
    pub fn note(&self, hash: &KeyHash, key_id: &Id, now_ms: u64) {
        let at = minute_of(now_ms);
        let mut noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        let room = noted.len() < MAX_NOTED;
        match noted.get_mut(hash) {
            Some(entry) => entry.1 = entry.1.max(at),
            None if room => drop(noted.insert(hash.clone(), (key_id.clone(), at))),
            None => {}
        }
    }

    /// Every use noted since the last call, emptied.
    pub fn take(&self) -> Vec<(KeyHash, Id, u64)> {
        let taken = std::mem::take(&mut *self.noted.lock().unwrap_or_else(|p| p.into_inner()));
        taken.into_iter().map(|(h, (id, at))| (h, id, at)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_are_kept_per_key_to_the_minute_until_taken() {
        let u = LastUsed::default();
        let (h, id) = (KeyHash::parse(&"ab".repeat(32)).unwrap(), Id::parse("key_a").unwrap());
        u.note(&h, &id, 120_500);
        u.note(&h, &id, 179_999);
        u.note(&h, &id, 60_000); // an older decision finishing late moves nothing back
        assert_eq!(u.take(), vec![(h.clone(), id.clone(), 120)]);
        assert!(u.take().is_empty(), "taken once");
        u.note(&h, &id, 181_000);
        assert_eq!(u.take(), vec![(h, id, 180)]);
    }
}
