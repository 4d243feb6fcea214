//! The refund path (issue 15.2): a decision whose answer the filter gave up on (timeout, failed
//! call, the client gone) is reported in a refund batch, and everything it took is given back
//! through `refund.lua` — see that script for what, and why it is idempotent.
//!
//! The filter names the decision and its key hash; the key's record gives the tenant (the hash
//! tag of the decision's record `dec:{tenant}:<decisionId>`), from the key cache when it is there.

use super::{well_formed_decision_id, DecisionStore, Decider};
use crate::keys::{Id, KeyHash};
use crate::metrics as m;
use crate::scripts::refund::Refunded;
use crate::scripts::ScriptError;
use crate::store::StoreError;
use std::time::{Duration, Instant};
use tollgate_wire::refunds::Abandoned;

/// Off the request path: a key lookup for a refund may wait this long.
const KEY_DEADLINE: Duration = Duration::from_secs(1);

/// Why a refund was not done.
#[derive(Debug, thiserror::Error)]
pub enum RefundFailed {
    /// The report is malformed (retrying cannot help).
    #[error("invalid abandoned decision: {0}")]
    Invalid(&'static str),
    /// Redis could not answer now: the filter sends the batch again.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<S: DecisionStore> Decider<S> {
    /// Gives back what the abandoned decision took. `Ok` when it is settled for good (refunded,
    /// or nothing to refund); `Err(Store)` when it should be sent again.
    pub async fn refund(&self, a: &Abandoned) -> Result<Refunded, RefundFailed> {
        let count = |outcome: &'static str| metrics::counter!(m::REFUNDS, "outcome" => outcome).increment(1);
        let (Some(hash), Some(id)) = (KeyHash::parse(&a.key_hash), Some(&a.decision_id).filter(|d| well_formed_decision_id(d)).and_then(|d| Id::parse(d))) else {
            count("invalid");
            return Err(RefundFailed::Invalid("keyHash or decisionId"));
        };
        // on the off-path connection, within its own deadline: a refund is no decision
        let record = match self.record(&hash, Instant::now() + KEY_DEADLINE, true).await {
            Ok((Some(r), _)) => r,
            Ok((None, _)) => {
                count("unknown_key");
                return Ok(Refunded::Nothing);
            }
            Err(e) => return Err(RefundFailed::Store(StoreError::Unreachable(e.to_string()))),
        };
        match self.store.refund(&record.tenant, &id, self.clock.now_ms()).await {
            Ok(Refunded::Nothing) => {
                // The decision's script may not have run yet: a Redis slower than the filter's
                // patience runs it later and takes for a request nobody served. Asked again
                // behind a barrier, as the sidecar's own late refunds are (decision 163).
                self.rechecks.refund(&self.store, &self.clock, &record.tenant, &id);
                count(Refunded::Nothing.as_str());
                Ok(Refunded::Nothing)
            }
            Ok(done) => {
                count(done.as_str());
                Ok(done)
            }
            Err(ScriptError::Store(e)) => Err(RefundFailed::Store(e)),
            Err(ScriptError::Reply(e)) => {
                count("invalid");
                tracing::warn!(error = %e, "a decision record cannot be refunded");
                Ok(Refunded::Nothing)
            }
        }
    }
}
