//! The stats catalogue: every counter the filter exports with a name fixed at build time (Envoy
//! shows them under `wasmcustom.`). Per-target breaker counters are named at configuration time
//! instead (`crate::breaker::config::BreakerConfig::metric_names`).
//!
//! Invariant: names never change — dashboards and the functional tests read them.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use tollgate_wire::codes;

/// The hosts' counter ids, by [`Metric`] or by a configured name: looked up for every event
/// counted, so hashed with [`IdHasher`] rather than the standard SipHash (decision 227).
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// A multiply-rotate hash (the scheme of rustc's FxHasher) for keys the configuration chose,
/// never a client: nothing to resist flooding with, so a lookup costs a few instructions instead
/// of SipHash's rounds.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl IdHasher {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(Self::K);
    }
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // the product's high bits are its best mixed; the table indexes by the low ones
        self.0.rotate_left(26)
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }
    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    fn write_isize(&mut self, n: isize) {
        self.add(n as u64);
    }
}

/// Counters the filter exports as Envoy stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Metric {
    Allowed,
    /// Denied with one of [`codes::ALL_DENY`] (by index), or another code.
    Denied(DenyReason),
    /// The sidecar did not answer in time, or answered with an error.
    SidecarError,
    FailedOpen,
    FailedClosed,
    /// Allowed from the VM-wide auth cache, without a call to the sidecar.
    AuthCacheHit,
    /// Answered from the response cache (issue 7).
    CacheHit,
    /// Looked up in the response cache and sent upstream.
    CacheMiss,
    /// Answered with the stored response of an earlier request with the same Idempotency-Key.
    IdempotentReplay,
    /// An Idempotency-Key's request ended without a 2xx and without knowing whether its
    /// operation ran (a gateway timeout, a reset after it went out, the client gone first): its
    /// claim is kept in flight until it expires, not released (decision 166).
    IdempotencyOutcomeUnknown,
    /// An idempotency claim its worker could not keep while the request runs: the worker's book
    /// of claims, or the tenant's share of it, was full (decision 186): it lives its TTL.
    IdempotencyClaimNotKept,
    /// Allowed from this Envoy's lease of a leased limit, without a call (crate::lease).
    LeaseHit,
    /// Lease renewals sent by a root context (off the request path).
    LeaseRenewal,
    /// An upstream reported a token count outside `0..=2^53` (negative, huge): it was clamped
    /// (crate::usage::read_tokens).
    TokensClamped,
    /// Decisions whose answer the filter gave up on while the request was refused or gone,
    /// queued for the sidecar to refund (crate::refunds).
    RefundQueued,
    /// Decision batches a root context sent (crate::batch, decision 127).
    DecisionBatches,
    /// Requests whose decision rode a batch instead of a call of its own.
    DecisionsBatched,
    /// Requests whose decision went on the worker's decision stream (crate::stream, decision 223).
    DecisionsStreamed,
    /// Decision streams a root context opened.
    DecisionStreamsOpened,
    /// A batch flusher's counters (crate::flush): batches sent, items dropped, failed sends.
    Flush(Stream, FlushEvent),
}

impl Metric {
    /// The counters of every warm request, which the Wasm adapter tallies in the worker's memory
    /// and gives Envoy on the root context's tick instead of one host call per request (decision
    /// 125): an operator sees them at most one tick late. `Allowed` comes last, the order of the
    /// flush: once it is in, so are the others of the same requests.
    pub const BATCHED: [Metric; 4] = [Metric::AuthCacheHit, Metric::LeaseHit, Metric::DecisionsStreamed, Metric::Allowed];

    /// This counter's place in [`Metric::BATCHED`], if it is batched.
    pub fn batch_slot(self) -> Option<usize> {
        Metric::BATCHED.iter().position(|m| *m == self)
    }
}

/// A deny reason known to this version, or `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenyReason {
    Known(usize),
    Other,
}

impl DenyReason {
    pub fn of(code: &str) -> DenyReason {
        codes::ALL_DENY.iter().position(|c| *c == code).map_or(DenyReason::Other, DenyReason::Known)
    }
    pub fn name(self) -> &'static str {
        match self {
            DenyReason::Known(i) => codes::ALL_DENY.get(i).copied().unwrap_or("other"),
            DenyReason::Other => "other",
        }
    }
}

tollgate_wire::named_enum! {
    /// What a worker sends to the sidecar in batches, off the request path.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Stream {
        /// Completion reports (`POST /v1/completions`).
        Completions => "completions",
        /// Usage events (`POST /v1/usage`).
        Usage => "usage",
        /// Responses to store (`POST /v1/responses`).
        Responses => "responses",
        /// Abandoned decisions to refund (`POST /v1/refunds`).
        Refunds => "refunds",
    }
}

tollgate_wire::named_enum! {
    /// A batch flusher's counters.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum FlushEvent {
        /// Batches the sidecar took (200).
        BatchesSent => "batches_sent",
        /// Items lost: the queue was full, or the sidecar refused their batch for good.
        Dropped => "dropped",
        /// Batches that could not be sent or were not taken.
        Errors => "flush_errors",
    }
}

impl Metric {
    /// The counters of the request path (every configuration defines them).
    pub fn requests() -> Vec<Metric> {
        let mut v = vec![
            Metric::Allowed,
            Metric::SidecarError,
            Metric::FailedOpen,
            Metric::FailedClosed,
            Metric::AuthCacheHit,
            Metric::CacheHit,
            Metric::CacheMiss,
            Metric::IdempotentReplay,
            Metric::IdempotencyOutcomeUnknown,
            Metric::IdempotencyClaimNotKept,
            Metric::LeaseHit,
            Metric::LeaseRenewal,
            Metric::TokensClamped,
            Metric::RefundQueued,
            Metric::DecisionBatches,
            Metric::DecisionsBatched,
            Metric::DecisionsStreamed,
            Metric::DecisionStreamsOpened,
        ];
        v.extend((0..codes::ALL_DENY.len()).map(|i| Metric::Denied(DenyReason::Known(i))));
        v.push(Metric::Denied(DenyReason::Other));
        v
    }

    /// A flusher's three counters.
    pub fn flush(stream: Stream) -> [Metric; 3] {
        FlushEvent::ALL.map(|e| Metric::Flush(stream, e))
    }

    /// Every metric there is.
    pub fn all() -> Vec<Metric> {
        let mut v = Metric::requests();
        for s in Stream::ALL {
            v.extend(Metric::flush(s));
        }
        v
    }

    /// The stat name (Envoy shows it under `wasmcustom.`).
    pub fn name(self) -> String {
        match self {
            Metric::Allowed => "tollgate.requests.allowed".into(),
            Metric::Denied(r) => format!("tollgate.requests.denied.{}", r.name()),
            Metric::SidecarError => "tollgate.sidecar.errors".into(),
            Metric::FailedOpen => "tollgate.requests.failed_open".into(),
            Metric::FailedClosed => "tollgate.requests.failed_closed".into(),
            Metric::AuthCacheHit => "tollgate.auth_cache.hits".into(),
            Metric::CacheHit => "tollgate.cache.hits".into(),
            Metric::CacheMiss => "tollgate.cache.misses".into(),
            Metric::IdempotentReplay => "tollgate.idempotency.replays".into(),
            Metric::IdempotencyOutcomeUnknown => "tollgate.idempotency.outcome_unknown".into(),
            Metric::IdempotencyClaimNotKept => "tollgate.idempotency.claims_not_kept".into(),
            Metric::LeaseHit => "tollgate.leases.hits".into(),
            Metric::LeaseRenewal => "tollgate.leases.renewals".into(),
            Metric::TokensClamped => "tollgate.tokens.clamped".into(),
            Metric::RefundQueued => "tollgate.refunds.queued".into(),
            Metric::DecisionBatches => "tollgate.decisions.batches".into(),
            Metric::DecisionsBatched => "tollgate.decisions.batched".into(),
            Metric::DecisionsStreamed => "tollgate.decisions.streamed".into(),
            Metric::DecisionStreamsOpened => "tollgate.decisions.streams_opened".into(),
            Metric::Flush(s, e) => format!("tollgate.{}.{}", s.name(), e.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn an_id_map_finds_every_metric_and_name_as_a_standard_map_does() {
        use std::hash::BuildHasher;
        let metrics = Metric::all();
        let ids: IdMap<Metric, usize> = metrics.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        assert_eq!(ids.len(), metrics.len());
        assert!(metrics.iter().enumerate().all(|(i, m)| ids.get(m) == Some(&i)));
        let names: IdMap<String, usize> = metrics.iter().enumerate().map(|(i, m)| (m.name(), i)).collect();
        assert!(metrics.iter().enumerate().all(|(i, m)| names.get(&m.name()) == Some(&i)));
        assert!(!names.contains_key("tollgate.nothing"));
        // distinct keys, distinct hashes (bytes of every length, and the same bytes shorter)
        let build = BuildHasherDefault::<IdHasher>::default();
        let hashes: std::collections::HashSet<u64> = metrics.iter().map(|m| build.hash_one(m)).collect();
        assert_eq!(hashes.len(), metrics.len());
        let texts: Vec<&[u8]> = vec![b"", b"a", b"a\0", b"abcdefgh", b"abcdefgh\0", b"abcdefghi"];
        let hashes: std::collections::HashSet<u64> = texts.iter().map(|t| build.hash_one(t)).collect();
        assert_eq!(hashes.len(), texts.len());
    }

    #[test]
    fn flusher_counters_keep_their_names() {
        let names: Vec<String> = Stream::ALL.iter().flat_map(|s| Metric::flush(*s)).map(Metric::name).collect();
        assert_eq!(
            names,
            [
                "tollgate.completions.batches_sent",
                "tollgate.completions.dropped",
                "tollgate.completions.flush_errors",
                "tollgate.usage.batches_sent",
                "tollgate.usage.dropped",
                "tollgate.usage.flush_errors",
                "tollgate.responses.batches_sent",
                "tollgate.responses.dropped",
                "tollgate.responses.flush_errors",
                "tollgate.refunds.batches_sent",
                "tollgate.refunds.dropped",
                "tollgate.refunds.flush_errors",
            ]
        );
    }
}
