//! Idempotency outcomes Redis could not take (decision 138): kept and tried again.
//!
//! An outcome (the stored response of a request with an `Idempotency-Key`, or the release of its
//! claim) that reaches the sidecar while Redis cannot take it — down for a moment, failing fast
//! after a stall, a command timed out — was lost: the claim's in-flight marker stayed, and every
//! retry of the request got 409 `idempotency_in_flight` until the marker expired
//! (`[responses] idempotency_in_flight`, 5 minutes by default), though the request had finished.
//! Now the sidecar keeps the outcome and runs `idem_complete.lua` again in the background (0.25 s,
//! doubling, at most 5 s apart) until Redis answers, for as long as the marker can live: the
//! configured in-flight TTL from the outcome's first try (the worker kept the claim until its
//! request ended, decision 186; before decision 188 the retries stopped after 5 minutes whatever
//! the setting, and an outcome Redis took back after that was lost). Trying again is safe:
//! the script settles a claim only while it is still this request's, so an outcome a timed-out
//! call did store is refused the second time, changing nothing.
//!
//! Bounded: at most [`MAX_PENDING`] outcomes and [`MAX_PENDING_BYTES`] of their responses wait at
//! once; beyond either, an outcome is dropped as before (counted).

use crate::scripts::idem_complete::{self, IdemComplete, Settled};
use crate::store::Store;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Metric: outcomes tried again, labelled `outcome` (stored | over_bound: stored without its
/// body, decision 185 | released | refused | gave_up | dropped).
pub const RETRIED: &str = "tollgate_sidecar_idempotency_outcome_retries_total";
/// Outcomes that may wait at once.
pub const MAX_PENDING: usize = 1_000;
/// Bytes of their responses' JSON that may wait at once.
pub const MAX_PENDING_BYTES: usize = 64 << 20;
const FIRST_WAIT: Duration = Duration::from_millis(250);
const MAX_WAIT: Duration = Duration::from_secs(5);

static PENDING: AtomicUsize = AtomicUsize::new(0);
static PENDING_BYTES: AtomicUsize = AtomicUsize::new(0);

fn count(outcome: &'static str) {
    metrics::counter!(RETRIED, "outcome" => outcome).increment(1);
}

/// Keeps `call`, first run at `now_ms`, and runs it again until Redis answers (in the background),
/// for at most `in_flight_ms`: as long as the claim's marker can outlive its request.
pub fn retry(store: &Store, call: IdemComplete, now_ms: u64, in_flight_ms: u64) {
    let bytes = call.outcome_bytes();
    let n = PENDING.fetch_add(1, Ordering::Relaxed);
    let b = PENDING_BYTES.fetch_add(bytes, Ordering::Relaxed);
    if n >= MAX_PENDING || b + bytes > MAX_PENDING_BYTES {
        PENDING.fetch_sub(1, Ordering::Relaxed);
        PENDING_BYTES.fetch_sub(bytes, Ordering::Relaxed);
        count("dropped");
        tracing::warn!("an idempotency outcome Redis could not take was dropped: too many wait already");
        return;
    }
    let store = store.clone();
    tokio::spawn(async move {
        count(settle(&store, &call, now_ms, Duration::from_millis(in_flight_ms)).await);
        PENDING.fetch_sub(1, Ordering::Relaxed);
        PENDING_BYTES.fetch_sub(bytes, Ordering::Relaxed);
    });
}

async fn settle(store: &Store, call: &IdemComplete, first_ms: u64, give_up_after: Duration) -> &'static str {
    let started = Instant::now();
    let mut wait = FIRST_WAIT;
    while started.elapsed() < give_up_after {
        tokio::time::sleep(wait.min(give_up_after.saturating_sub(started.elapsed()))).await;
        wait = (wait * 2).min(MAX_WAIT);
        let now_ms = first_ms + started.elapsed().as_millis() as u64;
        match idem_complete::run(store, call, now_ms).await {
            Ok(Settled::Done) if call.response.is_some() => return "stored",
            Ok(Settled::Done) => return "released",
            // kept without its body: the tenant's bound of stored bytes (decision 185)
            Ok(Settled::WithoutBody) => return "over_bound",
            // the claim is no longer this request's (stored by a call that timed out, expired)
            Ok(Settled::NotOurs) => return "refused",
            Err(e) if e.is_transient() || e.is_read_only() => {}
            Err(e) => {
                tracing::warn!(error = %e, "an idempotency outcome cannot be recorded");
                return "refused";
            }
        }
    }
    "gave_up"
}
