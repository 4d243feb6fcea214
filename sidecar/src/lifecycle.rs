//! The sidecar's stop beside an Envoy that drains (issue 40): in a pod both containers get
//! SIGTERM at once, but Envoy still has requests to finish and, once they are done, the queues
//! its filter flushes to the sidecar (usage events, completions, refunds, responses to store).
//! A sidecar that stopped at the signal would answer none of them.
//!
//! So after the signal the sidecar keeps serving until its filter has made no call for
//! `server.shutdown_quiet` — while its Envoy runs, the filter calls at least every change poll
//! (50 ms) — and at most `server.shutdown_wait`; only then does it stop accepting, drain and
//! flush the usage spool ([`crate::Sidecar::serve`]). `shutdown_wait = 0` (the default) stops
//! at once, as before.
//!
//! Only calls that carry the filter secret count ([`crate::server`]'s `require_secret`): a probe
//! of `/healthz` or a scrape of `/metrics` does not keep a sidecar up whose Envoy is gone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// When the filter last called (milliseconds since this was made).
#[derive(Debug)]
pub struct FilterCalls {
    start: Instant,
    last_ms: AtomicU64,
}

impl Default for FilterCalls {
    fn default() -> Self {
        FilterCalls { start: Instant::now(), last_ms: AtomicU64::new(0) }
    }
}

impl FilterCalls {
    /// A call from the filter arrived.
    pub fn touch(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long no call arrived (since this was made, when none ever did).
    pub fn quiet_for(&self) -> Duration {
        self.start.elapsed().saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// Why [`until_filter_gone`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// `shutdown_wait` is zero: stop at once.
    NoWait,
    /// No filter call for `quiet`: its Envoy stopped.
    Quiet,
    /// `wait` elapsed while the filter still called.
    WaitElapsed,
}

/// Returns once the filter made no call for `quiet`, or `wait` after it was called, whichever
/// comes first (at once when `wait` is zero).
pub async fn until_filter_gone(calls: &FilterCalls, quiet: Duration, wait: Duration) -> Gone {
    if wait.is_zero() {
        return Gone::NoWait;
    }
    let deadline = Instant::now() + wait;
    loop {
        let q = calls.quiet_for();
        if q >= quiet {
            return Gone::Quiet;
        }
        let now = Instant::now();
        if now >= deadline {
            return Gone::WaitElapsed;
        }
        // the earliest the filter can have been quiet long enough, or the deadline
        tokio::time::sleep_until((now + (quiet - q)).min(deadline)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    const QUIET: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn no_wait_returns_at_once() {
        let calls = FilterCalls::default();
        calls.touch();
        assert_eq!(until_filter_gone(&calls, QUIET, Duration::ZERO).await, Gone::NoWait);
    }

    #[tokio::test]
    async fn a_filter_that_never_called_is_gone_after_quiet() {
        let calls = FilterCalls::default();
        let t0 = Instant::now();
        assert_eq!(until_filter_gone(&calls, QUIET, Duration::from_secs(60)).await, Gone::Quiet);
        assert!(t0.elapsed() >= QUIET);
    }

    /// The filter calls every 20 ms for a while (its Envoy drains), then stops (gone): the wait
    /// returns only after its last call, and then because it was quiet.
    #[tokio::test]
    async fn serving_goes_on_while_the_filter_calls_then_stops_once_it_is_quiet() {
        let calls = Arc::new(FilterCalls::default());
        let done = Arc::new(AtomicBool::new(false));
        let (caller, finished) = (calls.clone(), done.clone());
        let filter = tokio::spawn(async move {
            let until = Instant::now() + Duration::from_millis(800);
            while Instant::now() < until {
                caller.touch();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            finished.store(true, Ordering::SeqCst);
        });
        let gone = until_filter_gone(&calls, QUIET, Duration::from_secs(60)).await;
        assert_eq!(gone, Gone::Quiet);
        assert!(done.load(Ordering::SeqCst), "returned while the filter still called");
        assert!(calls.quiet_for() >= QUIET);
        filter.await.unwrap();
    }

    #[tokio::test]
    async fn the_wait_bounds_a_filter_that_keeps_calling() {
        let calls = Arc::new(FilterCalls::default());
        let caller = calls.clone();
        let filter = tokio::spawn(async move {
            loop {
                caller.touch();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let t0 = Instant::now();
        assert_eq!(until_filter_gone(&calls, QUIET, Duration::from_millis(500)).await, Gone::WaitElapsed);
        assert!(t0.elapsed() >= Duration::from_millis(500));
        filter.abort();
    }
}
