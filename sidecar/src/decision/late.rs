//! Late scripts (decision 137): a limits script the sidecar gave up on may still run.
//!
//! A `decide.lua` call that misses its deadline was sent: a hung or busy Redis runs it when it
//! answers again, and it takes what the decision asked for (window units, a concurrency slot, a
//! budget reservation, an idempotency claim) for a request the sidecar already answered from the
//! limits' failure mode, without Redis' limits: refused (closed), decided by the `local` share,
//! or let through uncounted (open), as every request that fails fast meanwhile. What the late
//! script took is an accident of timing, and harmful: a refused request counted, a concurrency
//! slot no completion will free (the answer carried no ticket: a cap of 1 locks the tenant out
//! until the slot expires), an idempotency claim whose outcome is never stored (409 for 5
//! minutes). So the sidecar refunds the decision itself, in every failure mode, from the record
//! the script writes in the same call (decision 96), as the filter does for an answer it gave up
//! on.
//!
//! When: Redis may run the script any time after the deadline, so the refund is tried with backoff
//! (0.5 s, doubling, at most 10 s apart) until it gives something back, or Redis has answered
//! twice that there is no record, or five minutes passed. "No record" is trusted only after a
//! PING on the decisions' own connection was answered ([`DecisionStore::barrier`]): the script,
//! sent on that connection before it, has run by then — unless that connection was replaced
//! since the script may have been sent (Cluster, Sentinel: a timed-out connection is replaced in
//! the background, and the old socket may still deliver it), when "no record" is not trusted
//! and the refund is tried until [`GIVE_UP_AFTER`] (decision 181) — the refund itself goes on the off-path
//! connection (decision 141), where a busy request path could be overtaken. A refund is
//! idempotent (the record is deleted), so trying again never gives back twice.
//!
//! Bounded: at most [`MAX_PENDING`] refunds wait at once (a hung Redis is failed fast after its
//! first timeout, so few decisions time out; a saturated one times many out, and each waiting
//! refund costs it a few commands a second at most; beyond the bound they are counted
//! `dropped`).

use super::store::DecisionStore;
use crate::clock::Clock;
use crate::keys::Id;
use crate::metrics as m;
use crate::scripts::refund::Refunded;
use crate::scripts::ScriptError;
use crate::store::StoreError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Late refunds that may wait at once.
pub const MAX_PENDING: usize = 2_000;
/// The first try, after the decision gave up; the wait doubles up to [`MAX_WAIT`].
const FIRST_WAIT: Duration = Duration::from_millis(500);
const MAX_WAIT: Duration = Duration::from_secs(10);
/// How long Redis may stay away before the refund is given up.
const GIVE_UP_AFTER: Duration = Duration::from_secs(300);
/// Answers of "no record" that settle it: the script did not run.
const NOTHING_ANSWERS: u32 = 2;
/// How long before its refund is asked a script may have been sent (the sidecar's own: its
/// decision deadline; the filter's recheck: its call's timeout, seconds at most): a connection
/// replaced since then may still hold it (decision 181).
const SENT_WITHIN: Duration = Duration::from_secs(30);

/// Whether a limits call that failed with `e` may still run in Redis: it was sent and not answered
/// in time, or its connection dropped after it may have been sent (a reset, a killed client, a
/// failover: Redis may have run it; decision 163). A call refused before it was sent (failing
/// fast, no connection made, no budget left) never runs. A refund of a script that did not run
/// finds nothing: erring this way costs a few commands.
pub fn may_still_run(e: &ScriptError) -> bool {
    match e {
        ScriptError::Store(StoreError::Timeout(d)) => !d.is_zero(),
        ScriptError::Store(StoreError::Redis(r)) => {
            !r.is_connection_refusal() && (r.is_timeout() || r.is_connection_dropped() || r.is_io_error())
        }
        _ => false,
    }
}

/// The refunds waiting for late scripts, in one pool of [`MAX_PENDING`]: the sidecar's own
/// (`source="timeout"`: a script it gave up on) or the filter's refunds that found nothing
/// (`source="recheck"`, decision 163) — two pools, so rechecks a client can cause in numbers
/// (denied decisions reset at once also find nothing) never push out the sidecar's own.
#[derive(Debug)]
pub struct LateRefunds {
    pending: AtomicUsize,
    source: &'static str,
}

impl Default for LateRefunds {
    fn default() -> Self {
        LateRefunds { pending: AtomicUsize::new(0), source: "timeout" }
    }
}

impl LateRefunds {
    /// The pool of the filter's refunds that found nothing.
    pub fn rechecks() -> LateRefunds {
        LateRefunds { source: "recheck", ..LateRefunds::default() }
    }

    /// Refunds decision `id` of `tenant` once its late script has run (in the background).
    pub fn refund<S: DecisionStore>(self: &Arc<Self>, store: &S, clock: &Arc<dyn Clock>, tenant: &Id, id: &Id) {
        let source = self.source;
        if self.pending.fetch_add(1, Ordering::Relaxed) >= MAX_PENDING {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            count(source, "dropped");
            return;
        }
        metrics::gauge!(m::LATE_REFUNDS_PENDING, "source" => source).increment(1.0);
        let (me, store, clock, tenant, id) = (self.clone(), store.clone(), clock.clone(), tenant.clone(), id.clone());
        tokio::spawn(async move {
            let outcome = settle(&store, clock.as_ref(), &tenant, &id).await;
            count(source, outcome);
            me.pending.fetch_sub(1, Ordering::Relaxed);
            metrics::gauge!(m::LATE_REFUNDS_PENDING, "source" => source).decrement(1.0);
        });
    }
}

fn count(source: &'static str, outcome: &'static str) {
    metrics::counter!(m::LATE_REFUNDS, "source" => source, "outcome" => outcome).increment(1);
}

/// Tries the refund until it is settled; the outcome's metric label.
async fn settle<S: DecisionStore>(store: &S, clock: &dyn Clock, tenant: &Id, id: &Id) -> &'static str {
    let started = Instant::now();
    let sent_from = started.checked_sub(SENT_WITHIN).unwrap_or(started);
    let (mut wait, mut nothing) = (FIRST_WAIT, 0);
    while started.elapsed() < GIVE_UP_AFTER {
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(MAX_WAIT);
        // every script sent before on the decisions' connection has run, or it is not time yet
        if !store.barrier().await {
            continue;
        }
        match store.refund(tenant, id, clock.now_ms()).await {
            Ok(Refunded::Nothing) => {
                // the barrier ran on a connection made since the script may have been sent: the
                // one it went on may still deliver it, so "nothing" settles nothing; tried on
                // until it gives something back or GIVE_UP_AFTER (decision 181)
                if store.replaced_since(sent_from).await {
                    continue;
                }
                nothing += 1;
                if nothing >= NOTHING_ANSWERS {
                    return "nothing";
                }
            }
            Ok(done) => {
                tracing::info!(tenant = %tenant, decision = %id, outcome = done.as_str(), "a limits script that ran after its deadline was refunded");
                return done.as_str();
            }
            Err(ScriptError::Store(_)) => {}
            Err(ScriptError::Reply(e)) => {
                tracing::warn!(error = %e, "a late decision's record cannot be refunded");
                return "invalid";
            }
        }
    }
    "gave_up"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_call_that_may_have_been_sent_and_got_no_answer_may_still_run() {
        assert!(may_still_run(&ScriptError::Store(StoreError::Timeout(Duration::from_millis(20)))));
        // no budget left: the call was never sent
        assert!(!may_still_run(&ScriptError::Store(StoreError::Timeout(Duration::ZERO))));
        assert!(!may_still_run(&ScriptError::Store(StoreError::Unreachable("failing fast".into()))));
        let refused = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!may_still_run(&ScriptError::Store(StoreError::Redis(refused))));
        let timed_out = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(may_still_run(&ScriptError::Store(StoreError::Redis(timed_out))));
        // a connection that dropped under the call: Redis may have run it (decision 163)
        for kind in [std::io::ErrorKind::ConnectionReset, std::io::ErrorKind::BrokenPipe, std::io::ErrorKind::UnexpectedEof] {
            let dropped = redis::RedisError::from(std::io::Error::from(kind));
            assert!(may_still_run(&ScriptError::Store(StoreError::Redis(dropped))), "{kind:?}");
        }
    }
}
