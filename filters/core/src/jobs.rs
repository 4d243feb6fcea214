//! Background jobs: the work a worker's root context does off the request path, on its tick
//! (flushing completions, usage and responses; renewing leases; polling the routing table and
//! breaker hints).
//!
//! A [`Job`] runs on every tick, owns the tokens of the calls it dispatched, and gets the
//! responses to those calls (`on_http_call_response` fires in the context that dispatched the
//! call, and every response is matched by its token). [`Every`] runs a job at its own cadence
//! on a faster tick; `Option<J>` is a job that is configured off.

use crate::host::{Host, LogLevel};
use std::time::Duration;

/// Whether a job's exchanges with the sidecar fail, so that it logs the moment they start failing
/// and the moment they work again, not every tick in between.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outage {
    failing: bool,
}

impl Outage {
    /// The last exchange worked (`ok`) or not: logs `back` (info) or `lost()` (a warning) when
    /// that is a change.
    pub fn note(&mut self, host: &mut impl Host, ok: bool, back: &str, lost: impl FnOnce() -> String) {
        if ok && self.failing {
            host.log(LogLevel::Info, back);
        } else if !ok && !self.failing {
            host.log(LogLevel::Warn, &lost());
        }
        self.failing = !ok;
    }
}

/// A background job of a root context.
pub trait Job {
    /// One tick of the root context.
    fn on_tick(&mut self, host: &mut impl Host);
    /// Whether the call `token` is one of this job's.
    fn owns(&self, token: u32) -> bool;
    /// Whether this job reads the body of its call responses (reading it is a host call).
    fn reads_body(&self) -> bool {
        true
    }
    /// The response to one of this job's calls (`status`: `None` when the call ended without a
    /// response).
    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]);
}

/// When a periodic job is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cadence {
    interval_ms: u64,
    last_ms: u64,
}

impl Cadence {
    /// Timer ticks jitter: a tick this early still counts as on time.
    pub const SLACK_MS: u64 = 5;

    /// Due at once, then every `interval`.
    pub fn every(interval: Duration) -> Cadence {
        Cadence { interval_ms: interval.as_millis() as u64, last_ms: 0 }
    }

    /// Whether a run is due at `now_ms`.
    pub fn is_due(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_ms) + Self::SLACK_MS >= self.interval_ms
    }

    /// A run happened at `now_ms`.
    pub fn mark(&mut self, now_ms: u64) {
        self.last_ms = now_ms;
    }

    /// Whether a run is due at `now_ms`; if so, it counts as run.
    pub fn due(&mut self, now_ms: u64) -> bool {
        let due = self.is_due(now_ms);
        if due {
            self.mark(now_ms);
        }
        due
    }
}

/// A job run at its own cadence (the tick is the fastest of all jobs' cadences).
pub struct Every<J> {
    cadence: Cadence,
    pub job: J,
}

impl<J> Every<J> {
    pub fn new(interval: Duration, job: J) -> Every<J> {
        Every { cadence: Cadence::every(interval), job }
    }

    /// Its first run one `interval` after `now_ms`, not at once (a queue's flusher: nothing
    /// waits at its start).
    pub fn first_after(mut self, now_ms: u64) -> Every<J> {
        self.cadence.mark(now_ms);
        self
    }
}

impl<J: Job> Job for Every<J> {
    fn on_tick(&mut self, host: &mut impl Host) {
        if self.cadence.due(host.now_ms()) {
            self.job.on_tick(host);
        }
    }
    fn owns(&self, token: u32) -> bool {
        self.job.owns(token)
    }
    fn reads_body(&self) -> bool {
        self.job.reads_body()
    }
    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        self.job.on_call_response(host, token, status, body);
    }
}

/// A job configured off does nothing and owns no call.
impl<J: Job> Job for Option<J> {
    fn on_tick(&mut self, host: &mut impl Host) {
        if let Some(j) = self {
            j.on_tick(host);
        }
    }
    fn owns(&self, token: u32) -> bool {
        self.as_ref().is_some_and(|j| j.owns(token))
    }
    fn reads_body(&self) -> bool {
        self.as_ref().is_some_and(|j| j.reads_body())
    }
    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        if let Some(j) = self {
            j.on_call_response(host, token, status, body);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_cadence_is_due_at_once_then_every_interval_with_a_little_slack() {
        let mut c = Cadence::every(Duration::from_millis(100));
        assert!(c.due(1_000));
        assert!(!c.due(1_050));
        assert!(!c.due(1_094));
        assert!(c.due(1_095), "5 ms early is on time");
        assert!(!c.is_due(1_100));
        c.mark(1_200);
        assert!(!c.is_due(1_290) && c.is_due(1_300));
        assert!(Cadence::every(Duration::ZERO).due(0), "no interval: every tick");
    }
}
