//! The circuit-breaker state machine of one upstream target, apart from the host.
//!
//! `Closed` → `Open` on `consecutive_failures` in a row, or when the failure ratio over a rolling
//! window reaches `failure_ratio` with at least `min_requests` results in it. `Open` rejects until
//! `until_ms`; the first request after that turns it `HalfOpen` and is a trial. At most
//! `half_open_trials` trials are in flight at once; a successful trial closes the breaker, a failed
//! one re-opens it for another `open_ms`.
//!
//! Invariants:
//! - Time is passed in (`now_ms`), never read here.
//! - One [`State`] per target lives in Envoy shared data (every worker's VM sees it), encoded in
//!   [`State::encode`]'s fixed 194-byte layout, and every change is a compare-and-swap with bounded
//!   retries ([`update`]). A request on a closed breaker only reads: it writes nothing.
//! - A hint from another replica ([`State::apply_hint`]) can only turn `Closed` into `Open`. It
//!   never closes a breaker, never shortens or extends an open period, and each distinct hint is
//!   applied at most once (its fingerprint is remembered), so a breaker that closed on its own
//!   trials is not re-opened by the same, still-live hint (ADR-004 of seed 000).
//!
//! The section of the plugin configuration is [`config`], the per-request side [`guard`], the
//! hint exchange with other replicas [`hints`].

pub mod config;
pub mod guard;
pub mod hints;
pub mod local;

use crate::host::{Host, SharedSetError};
use crate::shared_keys::SharedKey;

/// Rolling-window resolution: the window is kept as this many buckets.
pub const BUCKETS: usize = 10;
/// CAS attempts before giving up on one update.
pub const MAX_CAS_ATTEMPTS: u32 = 8;
const VERSION: u8 = 1;
/// Encoded size of a [`State`].
pub const ENCODED_LEN: usize = 1 + 1 + 8 + 4 + 4 + 8 + 8 + BUCKETS * 16;

/// The thresholds of a breaker (validated by the configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Open after this many failures in a row (0: off).
    pub consecutive_failures: u32,
    /// Open when failures / results in the window reach this, in per mille (0: off).
    pub failure_ratio_permille: u32,
    pub window_ms: u64,
    /// The ratio applies only with at least this many results in the window.
    pub min_requests: u32,
    /// How long an open breaker rejects before letting trials through.
    pub open_ms: u64,
    /// Trials in flight at once while half-open (across all workers of one Envoy).
    pub half_open_trials: u32,
    /// A trial that has not reported after this long no longer holds its slot (a lost request
    /// must not wedge the breaker half-open).
    pub trial_timeout_ms: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            consecutive_failures: 5,
            failure_ratio_permille: 500,
            window_ms: 10_000,
            min_requests: 20,
            open_ms: 30_000,
            half_open_trials: 1,
            trial_timeout_ms: 10_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Closed,
    Open { until_ms: u64 },
    HalfOpen { since_ms: u64, in_flight: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Bucket {
    epoch: u64,
    ok: u32,
    fail: u32,
}

/// The shared state of one target's breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub phase: Phase,
    /// Failures in a row while closed.
    pub consecutive: u32,
    /// Fingerprint of the last hint seen (applied or not); 0: none.
    pub hint_seen: u64,
    /// `opened_at_ms` of a local OPEN transition not yet reported to the sidecar; 0: none.
    pub publish: u64,
    buckets: [Bucket; BUCKETS],
}

impl Default for State {
    fn default() -> Self {
        State { phase: Phase::Closed, consecutive: 0, hint_seen: 0, publish: 0, buckets: [Bucket::default(); BUCKETS] }
    }
}

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: go ahead.
    Pass,
    /// Half-open: go ahead as one of the bounded trials.
    Trial,
    /// Open (or all trial slots taken): do not send; retry after about this long.
    Reject { retry_after_ms: u64 },
}

/// The result of one admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
}

tollgate_wire::named_enum! {
    /// A state change worth a stat and a log line; its name is the stat name's last segment.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Transition {
        /// Closed → open on local failures.
        Opened => "opened",
        /// Closed → open on another replica's hint.
        OpenedByHint => "opened_by_hint",
        HalfOpened => "half_opened",
        /// Half-open → closed on a successful trial.
        Closed => "closed",
        /// Half-open → open on a failed trial.
        Reopened => "reopened",
    }
}

/// What happened to a hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintEffect {
    /// Seen before: nothing to do.
    Known,
    /// New, but the breaker is not closed: remembered, otherwise ignored.
    Ignored,
    /// New, and it opened the closed breaker.
    Opened,
}

impl State {
    /// A state in `phase` with no counts (for tests and tools).
    pub fn with_phase(phase: Phase) -> State {
        State { phase, ..State::default() }
    }

    fn open(&mut self, p: &Policy, now_ms: u64) {
        self.phase = Phase::Open { until_ms: now_ms.saturating_add(p.open_ms) };
        self.reset_counts();
    }

    fn reset_counts(&mut self) {
        self.consecutive = 0;
        self.buckets = [Bucket::default(); BUCKETS];
    }

    /// Decides whether a request may go to the target. Returns the admission, whether the state
    /// changed (and must be written back), and a transition if one happened.
    pub fn admit(&mut self, p: &Policy, now_ms: u64) -> (Admission, bool, Option<Transition>) {
        match self.phase {
            Phase::Closed => (Admission::Pass, false, None),
            Phase::Open { until_ms } if now_ms < until_ms => {
                (Admission::Reject { retry_after_ms: until_ms - now_ms }, false, None)
            }
            Phase::Open { .. } => {
                self.phase = Phase::HalfOpen { since_ms: now_ms, in_flight: 1 };
                (Admission::Trial, true, Some(Transition::HalfOpened))
            }
            Phase::HalfOpen { since_ms, in_flight } => {
                if now_ms.saturating_sub(since_ms) >= p.trial_timeout_ms {
                    // The trials in flight are overdue: their slots are free again.
                    self.phase = Phase::HalfOpen { since_ms: now_ms, in_flight: 1 };
                    (Admission::Trial, true, None)
                } else if in_flight < p.half_open_trials {
                    // With no trial in flight (each released), a new one starts the period
                    // again: its timeout counts from it, and no earlier trial's late release or
                    // result counts in it.
                    let since_ms = if in_flight == 0 { now_ms } else { since_ms };
                    self.phase = Phase::HalfOpen { since_ms, in_flight: in_flight + 1 };
                    (Admission::Trial, true, None)
                } else {
                    // A trial decides soon; until then, ask the client to come back shortly.
                    (Admission::Reject { retry_after_ms: 1_000 }, false, None)
                }
            }
        }
    }

    /// The half-open period a trial admitted now belongs to (the period's start), `None` in
    /// another phase. A trial's result and its release count only in its own period.
    pub fn trial_period(&self) -> Option<u64> {
        match self.phase {
            Phase::HalfOpen { since_ms, .. } => Some(since_ms),
            _ => None,
        }
    }

    /// Records the result of a request admitted with [`Admission::Pass`] (`trial` `None`) or
    /// [`Admission::Trial`] in the half-open period `trial` ([`State::trial_period`]). Returns
    /// whether the state changed and a transition if one happened.
    pub fn record(&mut self, p: &Policy, now_ms: u64, trial: Option<u64>, outcome: Outcome) -> (bool, Option<Transition>) {
        match self.phase {
            Phase::Closed => {
                self.count(p, now_ms, outcome);
                if self.should_trip(p, now_ms) {
                    self.open(p, now_ms);
                    self.publish = now_ms.max(1);
                    return (true, Some(Transition::Opened));
                }
                (true, None)
            }
            Phase::HalfOpen { since_ms, .. } if trial == Some(since_ms) => match outcome {
                Outcome::Success => {
                    self.phase = Phase::Closed;
                    self.reset_counts();
                    (true, Some(Transition::Closed))
                }
                Outcome::Failure => {
                    self.open(p, now_ms);
                    self.publish = now_ms.max(1);
                    (true, Some(Transition::Reopened))
                }
            },
            // Results of requests admitted before the breaker opened, or late trials of an
            // earlier half-open period: not evidence about the current period.
            Phase::HalfOpen { .. } | Phase::Open { .. } => (false, None),
        }
    }

    /// Frees the slot of a trial of half-open period `period` that ended without a result (e.g.
    /// the client went away). A trial of an earlier period holds no slot of this one.
    pub fn release_trial(&mut self, period: u64) -> bool {
        match self.phase {
            Phase::HalfOpen { since_ms, in_flight } if in_flight > 0 && since_ms == period => {
                self.phase = Phase::HalfOpen { since_ms, in_flight: in_flight - 1 };
                true
            }
            _ => false,
        }
    }

    /// Applies another replica's hint, identified by `fingerprint` (non-zero). Fast-open only:
    /// a closed breaker opens for `open_ms`; in any other phase the hint is only remembered.
    pub fn apply_hint(&mut self, p: &Policy, now_ms: u64, fingerprint: u64) -> (HintEffect, bool) {
        if fingerprint == self.hint_seen {
            return (HintEffect::Known, false);
        }
        self.hint_seen = fingerprint;
        if self.phase == Phase::Closed {
            // Not reported back: a hint-driven open is not local evidence (no hint ping-pong).
            self.open(p, now_ms);
            return (HintEffect::Opened, true);
        }
        (HintEffect::Ignored, true)
    }

    fn bucket_ms(p: &Policy) -> u64 {
        (p.window_ms / BUCKETS as u64).max(1)
    }

    /// The window's bucket of `now_ms`, emptied first when it held an older epoch.
    fn bucket(&mut self, p: &Policy, now_ms: u64) -> Option<&mut Bucket> {
        let epoch = now_ms / Self::bucket_ms(p);
        let slot = (epoch % BUCKETS as u64) as usize;
        let b = self.buckets.get_mut(slot)?;
        if b.epoch != epoch {
            *b = Bucket { epoch, ok: 0, fail: 0 };
        }
        Some(b)
    }

    /// Adds `n` successes one worker tallied since its last tick ([`local::WorkerBreakers`]) to a
    /// closed breaker's window; they leave the failure streak alone (a streak that started after
    /// them is not ended by them). In another phase they are not evidence about it: dropped.
    /// Returns whether the state changed.
    pub fn add_successes(&mut self, p: &Policy, now_ms: u64, n: u32) -> bool {
        if self.phase != Phase::Closed || n == 0 {
            return false;
        }
        if let Some(b) = self.bucket(p, now_ms) {
            b.ok = b.ok.saturating_add(n);
        }
        true
    }

    fn count(&mut self, p: &Policy, now_ms: u64, outcome: Outcome) {
        if let Some(b) = self.bucket(p, now_ms) {
            match outcome {
                Outcome::Success => b.ok = b.ok.saturating_add(1),
                Outcome::Failure => b.fail = b.fail.saturating_add(1),
            }
        }
        match outcome {
            Outcome::Success => self.consecutive = 0,
            Outcome::Failure => self.consecutive = self.consecutive.saturating_add(1),
        }
    }

    /// Results (successes, failures) in the window ending at `now_ms`.
    pub fn window(&self, p: &Policy, now_ms: u64) -> (u64, u64) {
        let epoch = now_ms / Self::bucket_ms(p);
        self.buckets
            .iter()
            .filter(|b| b.epoch <= epoch && epoch - b.epoch < BUCKETS as u64)
            .fold((0, 0), |(ok, fail), b| (ok + u64::from(b.ok), fail + u64::from(b.fail)))
    }

    fn should_trip(&self, p: &Policy, now_ms: u64) -> bool {
        if p.consecutive_failures > 0 && self.consecutive >= p.consecutive_failures {
            return true;
        }
        if p.failure_ratio_permille == 0 {
            return false;
        }
        let (ok, fail) = self.window(p, now_ms);
        let total = ok + fail;
        total > 0 && total >= u64::from(p.min_requests) && fail * 1000 >= u64::from(p.failure_ratio_permille) * total
    }

    /// The fixed little-endian layout: version, phase tag, phase u64, phase u32, consecutive,
    /// hint_seen, publish, then each bucket's epoch u64, ok u32, fail u32.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_LEN);
        let (tag, a, b) = match self.phase {
            Phase::Closed => (0u8, 0u64, 0u32),
            Phase::Open { until_ms } => (1, until_ms, 0),
            Phase::HalfOpen { since_ms, in_flight } => (2, since_ms, in_flight),
        };
        out.push(VERSION);
        out.push(tag);
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&b.to_le_bytes());
        out.extend_from_slice(&self.consecutive.to_le_bytes());
        out.extend_from_slice(&self.hint_seen.to_le_bytes());
        out.extend_from_slice(&self.publish.to_le_bytes());
        for bk in &self.buckets {
            out.extend_from_slice(&bk.epoch.to_le_bytes());
            out.extend_from_slice(&bk.ok.to_le_bytes());
            out.extend_from_slice(&bk.fail.to_le_bytes());
        }
        out
    }

    /// `None` for anything that is not exactly an encoded state of this version.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        if bytes.len() != ENCODED_LEN || bytes.first() != Some(&VERSION) {
            return None;
        }
        let mut r = Reader { bytes, at: 1 };
        let tag = r.u8()?;
        let (a, b) = (r.u64()?, r.u32()?);
        let phase = match tag {
            0 => Phase::Closed,
            1 => Phase::Open { until_ms: a },
            2 => Phase::HalfOpen { since_ms: a, in_flight: b },
            _ => return None,
        };
        let consecutive = r.u32()?;
        let hint_seen = r.u64()?;
        let publish = r.u64()?;
        let mut buckets = [Bucket::default(); BUCKETS];
        for bk in buckets.iter_mut() {
            *bk = Bucket { epoch: r.u64()?, ok: r.u32()?, fail: r.u32()? };
        }
        Some(State { phase, consecutive, hint_seen, publish, buckets })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let s = self.bytes.get(self.at..self.at + N)?;
        self.at += N;
        s.try_into().ok()
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
}

/// Why an update did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError {
    /// Other workers won the race [`MAX_CAS_ATTEMPTS`] times in a row.
    Contended,
    /// The host refused the write.
    Host(String),
}

/// Writes the initial (closed) state when the key is absent. Done in `on_configure`, before any
/// traffic, so later updates always have a CAS token (a first write can only be unconditional).
pub fn init(host: &mut impl Host, key: &SharedKey) {
    if host.shared_get_cas(key.as_str()).0.is_none() {
        let _ = host.shared_set_cas(key.as_str(), &State::default().encode(), None);
    }
}

/// Reads the state (a missing or undecodable value reads as closed).
pub fn read(host: &impl Host, key: &SharedKey) -> State {
    host.shared_get_cas(key.as_str()).0.and_then(|b| State::decode(&b)).unwrap_or_default()
}

/// Read-modify-write of a target's state by CAS: `f` returns its result and whether it changed
/// the state; an unchanged state is not written. On a CAS mismatch the update is recomputed on
/// the fresh state, at most [`MAX_CAS_ATTEMPTS`] times.
pub fn update<R>(host: &mut impl Host, key: &SharedKey, mut f: impl FnMut(&mut State) -> (R, bool)) -> Result<R, UpdateError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (bytes, cas) = host.shared_get_cas(key.as_str());
        let mut state = bytes.and_then(|b| State::decode(&b)).unwrap_or_default();
        let (result, changed) = f(&mut state);
        if !changed {
            return Ok(result);
        }
        match host.shared_set_cas(key.as_str(), &state.encode(), cas) {
            Ok(()) => return Ok(result),
            Err(SharedSetError::CasMismatch) => continue,
            Err(SharedSetError::Other(e)) => return Err(UpdateError::Host(e)),
        }
    }
    Err(UpdateError::Contended)
}

/// A non-zero fingerprint of a hint (FNV-1a over the replica and its open time).
pub fn hint_fingerprint(replica: &str, opened_at_ms: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in replica.bytes().chain([0xff]).chain(opened_at_ms.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}
