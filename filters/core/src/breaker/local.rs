//! One worker's side of its circuit breakers, so that a healthy request costs no shared-data
//! access at all (decisions 117 and 120):
//!
//! - **Successes** of requests admitted on a clean breaker (closed, no failure streak) only add to
//!   the window's success count: the worker tallies them and adds them to the shared state on its
//!   tick, or together with its next failure on that target (its ratio check sees them).
//! - **Which targets are clean**, as of the worker's last look (its tick, or a shared read or write
//!   it made since): admission on a clean target reads nothing. A target another worker opened is
//!   seen at this worker's next tick (≤ 20 ms with leases on, ≤ `changes.pollInterval` or
//!   `completionFlushInterval` otherwise); every result other than a clean success, and every
//!   admission on a target not known clean, goes to the shared state as before.
//!
//! The tick reads only the targets this worker used since its last tick (a clean target left
//! unused is forgotten, its next admission reads): work bounded by the targets in use.

use super::config::BreakerConfig;
use super::{update, Phase, State};
use crate::host::{Host, LogLevel};
use crate::shared_keys;

/// What the worker knows of one target.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum View {
    /// Nothing: the next admission reads the shared state.
    #[default]
    Unknown,
    /// Closed with no failure streak at the last look; `used`: admitted since the last tick.
    Clean { used: bool },
}

/// One worker's tallied successes and views, per target index.
#[derive(Debug, Default)]
pub struct WorkerBreakers {
    pending: Vec<u32>,
    views: Vec<View>,
}

/// Whether a state lets this worker admit without reading it.
pub fn is_clean(s: &State) -> bool {
    s.phase == Phase::Closed && s.consecutive == 0
}

impl WorkerBreakers {
    /// Admission without a shared read: the target was clean at the worker's last look.
    pub fn admit_locally(&mut self, target: usize) -> bool {
        match self.views.get_mut(target) {
            Some(View::Clean { used }) => {
                *used = true;
                true
            }
            _ => false,
        }
    }

    /// What a shared read or write of `target` just showed.
    pub fn saw(&mut self, target: usize, clean: bool) {
        if self.views.len() <= target {
            self.views.resize(target + 1, View::Unknown);
        }
        if let Some(v) = self.views.get_mut(target) {
            *v = if clean { View::Clean { used: true } } else { View::Unknown };
        }
    }

    pub fn add_success(&mut self, target: usize) {
        if self.pending.len() <= target {
            self.pending.resize(target + 1, 0);
        }
        if let Some(n) = self.pending.get_mut(target) {
            *n = n.saturating_add(1);
        }
    }

    pub fn give_back(&mut self, target: usize, n: u32) {
        if let Some(p) = self.pending.get_mut(target) {
            *p = p.saturating_add(n);
        }
    }

    pub fn take(&mut self, target: usize) -> u32 {
        self.pending.get_mut(target).map(std::mem::take).unwrap_or(0)
    }

    /// Successes not yet written, all targets.
    pub fn pending(&self) -> u64 {
        self.pending.iter().map(|&n| u64::from(n)).sum()
    }

    /// The worker's tick: each target's tallied successes go to its shared state (one CAS; a
    /// tally that cannot be written waits for the next tick), and each target used since the last
    /// tick is looked at again (one read). A clean target left unused is forgotten.
    pub fn on_tick(&mut self, host: &mut impl Host, config: &BreakerConfig) {
        let now = host.now_ms();
        for (idx, target) in config.targets.iter().enumerate() {
            let n = self.take(idx);
            let view = self.views.get(idx).copied().unwrap_or_default();
            let key = shared_keys::breaker(&target.name);
            if n > 0 {
                match update(host, &key, |s| (is_clean(s), s.add_successes(&config.policy, now, n))) {
                    Ok(clean) => self.saw(idx, clean),
                    Err(e) => {
                        host.log(LogLevel::Debug, &format!("tollgate: breaker {}: {n} successes not recorded yet: {e:?}", target.name));
                        self.give_back(idx, n);
                        self.saw(idx, false);
                    }
                }
            } else if view == (View::Clean { used: true }) {
                let clean = is_clean(&super::read(host, &key));
                self.saw(idx, clean);
            } else {
                self.saw(idx, false);
                continue;
            }
            // looked at on this tick: not yet used since
            if let Some(View::Clean { used }) = self.views.get_mut(idx) {
                *used = false;
            }
        }
    }
}
