//! The worker's usage meter: event ids and the queue of usage events (issue 6).
//!
//! Every request the filter lets through with an identity becomes one [`UsageEvent`] when it
//! ends (`on_log`); the worker's root context sends the queue as `POST /v1/usage` batches every
//! `usage.flushInterval`. Ids are made here, never taken from the request (a client choosing ids
//! could make its requests look like duplicates of each other and go unbilled): a random 64-bit
//! seed per VM and a counter, 32 hex characters.
//!
//! Loss bound: events wait in this worker's memory until the sidecar has spooled them. A crash
//! of Envoy loses at most what the queue holds (normally one flush interval of requests); a
//! sidecar outage longer than `maxQueued` events drops the oldest, counted as
//! `tollgate.usage.dropped` — never silently.

use crate::completions::UsageQueue;
use tollgate_wire::usage::UsageEvent;

/// Events per `POST /v1/usage`.
pub const MAX_BATCH: usize = 1000;

#[derive(Debug)]
pub struct Meter {
    pub queue: UsageQueue,
    seed: u64,
    next: u64,
}

impl Meter {
    /// `seed` must be random per VM (the adapter draws it from the host's randomness).
    pub fn new(max_queued: usize, seed: u64) -> Meter {
        Meter { queue: UsageQueue::new(max_queued), seed, next: 0 }
    }

    /// A new event id, unique per VM and (with a random seed) across VMs.
    pub fn next_id(&mut self) -> String {
        self.next = self.next.wrapping_add(1);
        format!("{:016x}{:016x}", self.seed, self.next)
    }

    pub fn record(&mut self, event: UsageEvent) {
        self.queue.push(event);
    }
}

/// An Envoy integer attribute (8 bytes, little-endian), e.g. `response.total_size`.
pub fn int_property(bytes: Option<Vec<u8>>) -> Option<u64> {
    let b: [u8; 8] = bytes?.as_slice().try_into().ok()?;
    u64::try_from(i64::from_le_bytes(b)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn ids_are_unique_and_carry_the_seed() {
        let mut m = Meter::new(10, 0xdead_beef);
        let (a, b) = (m.next_id(), m.next_id());
        assert_ne!(a, b);
        assert_eq!(a, "00000000deadbeef0000000000000001");
        assert_eq!(b.len(), 32);
        assert_ne!(Meter::new(10, 1).next_id(), Meter::new(10, 2).next_id());
    }

    #[test]
    fn integer_attributes() {
        assert_eq!(int_property(Some(42i64.to_le_bytes().to_vec())), Some(42));
        assert_eq!(int_property(Some(vec![1, 2])), None);
        assert_eq!(int_property(Some((-1i64).to_le_bytes().to_vec())), None);
        assert_eq!(int_property(None), None);
    }
}
