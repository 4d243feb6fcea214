//! Revocations and plan changes reaching the filter's own state (issue 15): the auth cache and
//! leases are reused without asking the sidecar, so a change to a key or a plan must drop them.
//!
//! ```text
//!  sidecar GET /v1/changes {epoch, version} ──(one root context per Envoy, elected, every
//!      changes.pollInterval: ChangesJob)──► shared data `tollgate.changes.v1` (gen, epoch, version)
//!          └──► each worker's [`Generation`] (read on every tick) ──► requests
//! ```
//!
//! The sidecar counts a change once it has applied it and forgotten its own cached key answers
//! (a revocation or plan change announced on `config_changed:*`). When the poller sees the
//! count (or the sidecar's epoch) move, it bumps the Envoy's *generation*. Every auth cache entry
//! and every lease grant carries the generation its decision call was sent under; a worker uses
//! only those at least as new as the generation it last read, and drops its own copies of auth
//! answers when it moves. So from the tick after the poll on, every request of every key is
//! decided by the sidecar again (which knows the change), and a revoked key gets its 401. The
//! request path is unchanged: the generation is a number in the worker's memory.
//!
//! Every change drops every key's answers and leases, not just the changed key's: one decision
//! call per active key, and the units of the leases held then (under-use, never over-use).
//! Changes are operator actions; the generation keeps the filter free of per-key bookkeeping.
//!
//! The poller sleeps while nothing a change could revoke can be held (issue 41, decision 271):
//! every answer or lease cached comes from a decision or renewal call, and each worker marks in
//! shared data (`tollgate.changes.v1.calls`, at most once per [`MARK_EVERY_MS`]) that it sends
//! one, before sending it. The poller polls while the newest mark is younger than what anything
//! cached from it can live ([`ChangesJob::new`]'s `cached_for`: the call's timeout, then the
//! answer's or the lease's life; plus the marks' period), and always until this Envoy's first
//! poll set the baseline. A call made while
//! it slept marks before its answer can be cached, so the next due tick polls: the bound of one
//! poll and one tick holds. A change made while it slept moves the count it then reads: every
//! answer cached under the old generation is dropped (one more call per active key, never a
//! stale allow).

use crate::auth_cache::LocalAllows;
use crate::election;
use crate::host::{Host, LogLevel, SharedSetError};
use crate::jobs::{Cadence, Job, Outage};
use crate::settings::{duration_within, given, ConfigError};
use crate::shared_keys::{CHANGES, CHANGES_CALLS, CHANGES_POLLER};
use crate::sidecar::Sidecar;
use serde::Deserialize;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;
use tollgate_wire::changes::{Changes, CHANGES_PATH};

/// `changes` of the plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangesConfig {
    /// Off: revocations reach the filter when its cached answers and leases expire (≤ 1 s).
    pub enabled: bool,
    /// How often one root context per Envoy asks the sidecar for its change count.
    pub poll_interval: Duration,
}

impl Default for ChangesConfig {
    fn default() -> Self {
        ChangesConfig { enabled: true, poll_interval: Duration::from_millis(50) }
    }
}

/// `changes` as written in the plugin configuration.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawChanges {
    #[serde(default, deserialize_with = "given")]
    enabled: Option<bool>,
    #[serde(default, deserialize_with = "given")]
    poll_interval: Option<String>,
}

impl ChangesConfig {
    pub fn compile(raw: RawChanges) -> Result<ChangesConfig, ConfigError> {
        let (min, max) = (Duration::from_millis(10), Duration::from_secs(10));
        let defaults = ChangesConfig::default();
        let poll_interval = match raw.poll_interval {
            Some(s) => duration_within("changes.pollInterval", &s, min, max, "10ms and 10s")?,
            None => defaults.poll_interval,
        };
        Ok(ChangesConfig { enabled: raw.enabled.unwrap_or(defaults.enabled), poll_interval })
    }
}

/// The longest the poller assumes a lease from one call is spent: the sidecar grants at most
/// 500 ms (`LEASE_MAX_TTL_MS`); a margin for a sidecar built otherwise.
pub const LEASE_TRUST: Duration = Duration::from_secs(10);

/// How often a worker marks at most that it sends calls (`tollgate.changes.v1.calls`).
pub const MARK_EVERY_MS: u64 = 1_000;

/// The generation of cached answers and leases a worker trusts (see the module docs). Shared by
/// the worker's root context (which moves it) and its requests (which stamp and check); also
/// when the worker last marked that it sends calls.
#[derive(Debug, Clone, Default)]
pub struct Generation(Rc<Cell<u64>>, Rc<Cell<u64>>);

impl Generation {
    pub fn get(&self) -> u64 {
        self.0.get()
    }

    /// A decision or lease renewal call is about to be sent: what its answer caches must stay
    /// revocable, so the poller must be awake. Marks shared data (one host call) at most once per
    /// [`MARK_EVERY_MS`] per worker; the poller allows for that period.
    pub fn note_call(&self, host: &mut impl Host) {
        let now = host.now_ms();
        let last = self.1.get();
        if last != 0 && now.saturating_sub(last) < MARK_EVERY_MS {
            return;
        }
        self.1.set(now.max(1));
        // Unconditional: racing workers write marks a few ms apart; the poller allows a period.
        host.shared_set(CHANGES_CALLS.as_str(), &now.to_le_bytes());
    }
}

/// The shared record: generation, sidecar epoch, sidecar version (u64 little-endian each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    gen: u64,
    seen: Changes,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        [self.gen, self.seen.epoch, self.seen.version].iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn decode(b: &[u8]) -> Option<Record> {
        let u = |i: usize| b.get(i * 8..i * 8 + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
        if b.len() != 24 {
            return None;
        }
        Some(Record { gen: u(0)?, seen: Changes { epoch: u(1)?, version: u(2)? } })
    }
}

/// One worker's part: reads the Envoy's generation on every tick (moving its [`Generation`] and
/// dropping its copies of auth answers when it moved) and, in the elected root context, polls
/// the sidecar and bumps the generation.
pub struct ChangesJob {
    config: ChangesConfig,
    sidecar: Sidecar,
    owner: u64,
    gen: Generation,
    local: Rc<RefCell<LocalAllows>>,
    call: Option<(u32, u64)>,
    cadence: Cadence,
    outage: Outage,
    /// How long after the newest call mark something cached from it may still be trusted.
    awake_ms: u64,
}

impl ChangesJob {
    /// `cached_for`: the longest anything may be trusted after its call was sent (the call's
    /// timeout, then an auth answer's or a lease's life): the poller stays awake that long after
    /// the last call mark, plus the marks' period.
    pub fn new(
        config: ChangesConfig,
        sidecar: Sidecar,
        owner: u64,
        gen: Generation,
        local: Rc<RefCell<LocalAllows>>,
        cached_for: Duration,
    ) -> ChangesJob {
        let cadence = Cadence::every(config.poll_interval);
        let awake = cached_for.as_millis() as u64 + MARK_EVERY_MS;
        ChangesJob { config, sidecar, owner: owner.max(1), gen, local, call: None, cadence, outage: Outage::default(), awake_ms: awake }
    }

    /// Whether a poll is needed: before this Envoy's first poll (no baseline yet), or while an
    /// answer or a lease from a call may be cached somewhere in this Envoy.
    fn needed(&self, host: &impl Host, now: u64, has_record: bool) -> bool {
        if !has_record {
            return true;
        }
        let mark = host.shared_get(CHANGES_CALLS.as_str()).and_then(|b| b.as_slice().try_into().ok()).map(u64::from_le_bytes);
        mark.is_some_and(|m| now.saturating_sub(m) <= self.awake_ms)
    }

    fn lease_ms(&self) -> u64 {
        (self.config.poll_interval.as_millis() as u64).saturating_mul(10).max(1_000)
    }

    /// Moves this worker's generation to the Envoy's (never back). Also when the worker is made:
    /// one made after a change (a new plugin configuration, a reloaded VM) must not trust, until
    /// its first tick, answers and leases the change made stale.
    /// Returns whether the Envoy's record exists (a first poll was answered).
    pub fn refresh(&self, host: &impl Host) -> bool {
        let Some(rec) = host.shared_get(CHANGES.as_str()).as_deref().and_then(Record::decode) else { return false };
        if rec.gen > self.gen.get() {
            self.gen.0.set(rec.gen);
            self.local.borrow_mut().clear();
        }
        true
    }

    /// Records what the sidecar said: a new generation when its count or epoch moved.
    fn record(&self, host: &mut impl Host, seen: Changes) {
        for _ in 0..8 {
            let (bytes, cas) = host.shared_get_cas(CHANGES.as_str());
            let next = match bytes.as_deref().and_then(Record::decode) {
                Some(rec) if rec.seen == seen => return,
                Some(rec) => Record { gen: rec.gen + 1, seen },
                // The first poll of this Envoy: nothing was dropped for a change before it.
                None => Record { gen: self.gen.get(), seen },
            };
            match host.shared_set_cas(CHANGES.as_str(), &next.encode(), cas) {
                Ok(()) => return,
                Err(SharedSetError::CasMismatch) => continue,
                Err(SharedSetError::Other(e)) => {
                    host.log(LogLevel::Warn, &format!("tollgate: cannot record a change of keys or plans: {e}"));
                    return;
                }
            }
        }
    }

    fn state(&mut self, host: &mut impl Host, ok: bool, why: &str) {
        self.outage.note(host, ok, "tollgate: the sidecar's change count is readable again", || format!("tollgate: cannot read the sidecar's change count ({why}); revocations apply when cached answers and leases expire"));
    }
}

impl Job for ChangesJob {
    fn on_tick(&mut self, host: &mut impl Host) {
        let has_record = self.refresh(host);
        let now = host.now_ms();
        if !self.cadence.is_due(now) || !self.needed(host, now, has_record) {
            return;
        }
        // A call that never came back (it has Envoy's timeout, but be safe): forget it.
        if self.call.is_some_and(|(_, at)| now.saturating_sub(at) < 10_000) {
            return;
        }
        if !election::hold(host, &CHANGES_POLLER, self.owner, now, self.lease_ms()) {
            return;
        }
        self.cadence.mark(now);
        // Short: a poll that hangs holds up the next ones.
        let timeout = self.sidecar.timeout.max(Duration::from_millis(250));
        match host.dispatch(self.sidecar.call("GET", CHANGES_PATH, &[], Vec::new(), timeout)) {
            Ok(token) => self.call = Some((token, now)),
            Err(e) => self.state(host, false, &format!("cannot call the sidecar: {e}")),
        }
    }

    fn owns(&self, token: u32) -> bool {
        self.call.is_some_and(|(t, _)| t == token)
    }

    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        if !self.owns(token) {
            return;
        }
        self.call = None;
        match (status, serde_json::from_slice::<Changes>(body)) {
            (Some(200), Ok(seen)) => {
                self.state(host, true, "");
                self.record(host, seen);
                // this worker need not wait for its next tick
                self.refresh(host);
            }
            (Some(200), Err(e)) => self.state(host, false, &format!("an unreadable answer: {e}")),
            (s, _) => self.state(host, false, &format!("status {s:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_record_round_trips_and_refuses_other_lengths() {
        let r = Record { gen: 3, seen: Changes { epoch: 9, version: 12 } };
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode(&r.encode()[..23]), None);
        assert_eq!(Record::decode(b""), None);
    }

    #[test]
    fn the_poll_interval_is_bounded() {
        assert_eq!(ChangesConfig::compile(RawChanges::default()).unwrap(), ChangesConfig::default());
        let raw = |s: &str| RawChanges { enabled: Some(true), poll_interval: Some(s.into()) };
        assert!(ChangesConfig::compile(raw("5ms")).is_err());
        assert!(ChangesConfig::compile(raw("11s")).is_err());
        assert_eq!(ChangesConfig::compile(raw("20ms")).unwrap().poll_interval, Duration::from_millis(20));
    }
}
