//! Decision ids: the gateway names every decision it asks the sidecar for.
//!
//! A decision's id keys everything the decision takes in shared state — the sliding-log member,
//! the concurrency slot, the token reservation, the completion ticket — so it must be unique and
//! chosen by the gateway, never by the client (a client repeating one `x-request-id` would
//! otherwise be one log entry and one slot however many requests it sent). Ids are
//! `sha256(secret seed ‖ counter)`, cut to 128 bits (32 lowercase hex): unique per worker by the
//! counter, across workers and Envoys by the seed, and unguessable without the seed (drawn from
//! the host's randomness by the adapter, once per VM).

use sha2::{Digest, Sha256};

/// 32 secret random bytes for a worker's decision ids (both hosts): four keyed hashes whose keys
/// `RandomState` draws from the host's randomness (the OS's natively, WASI `random_get` in Wasm).
pub fn random_seed() -> [u8; 32] {
    use std::hash::BuildHasher;
    let mut seed = [0u8; 32];
    for (i, chunk) in seed.chunks_mut(8).enumerate() {
        let v = std::collections::hash_map::RandomState::new().hash_one(i as u64);
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    seed
}

/// Appends `bytes` to `out` as lowercase hex, two characters a byte (API key hashes, decision
/// and usage event ids).
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
}

/// A worker's source of decision ids.
#[derive(Debug)]
pub struct DecisionIds {
    seed: [u8; 32],
    next: u64,
}

impl DecisionIds {
    /// `seed` must be secret and random per VM (the adapter draws it from the host).
    pub fn new(seed: [u8; 32]) -> DecisionIds {
        DecisionIds { seed, next: 0 }
    }

    /// The next id: 32 lowercase hex characters.
    pub fn next_id(&mut self) -> String {
        self.next = self.next.wrapping_add(1);
        let digest = Sha256::new().chain_update(self.seed).chain_update(self.next.to_le_bytes()).finalize();
        let mut out = String::with_capacity(32);
        push_hex(&mut out, &digest[..16]);
        out
    }
}

impl Default for DecisionIds {
    /// A fixed seed: for tests only (ids stay unique per instance, but are guessable).
    fn default() -> DecisionIds {
        DecisionIds::new([7; 32])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn hex_is_lowercase_two_characters_a_byte() {
        let mut out = String::from("x");
        push_hex(&mut out, &[0x00, 0x0f, 0xa0, 0xff]);
        assert_eq!(out, "x000fa0ff");
        let mut n = String::new();
        push_hex(&mut n, &0x0123_4567_89ab_cdefu64.to_be_bytes());
        assert_eq!(n, format!("{:016x}", 0x0123_4567_89ab_cdefu64));
    }

    #[test]
    fn ids_are_unique_hex_and_depend_on_the_seed() {
        let mut a = DecisionIds::new([1; 32]);
        let ids: std::collections::HashSet<String> = (0..10_000).map(|_| a.next_id()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())));
        let (mut b, mut c) = (DecisionIds::new([1; 32]), DecisionIds::new([2; 32]));
        let first = b.next_id();
        assert!(ids.contains(&first), "same seed, same sequence");
        assert_ne!(first, c.next_id(), "another seed, other ids");
    }
}
