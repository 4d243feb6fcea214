//! The decision path's port to its store: the five things a decision or a completion asks of
//! Redis. [`crate::store::Store`] implements it over the real connection and scripts; the unit
//! tests of the decision logic implement it in memory. Generic, so the hot path is statically
//! dispatched (no boxing, no vtable).

use crate::apikey::KeyRecord;
use crate::keys::{Id, KeyHash};
use crate::scripts::complete::{self, CompleteCall, Settled};
use crate::scripts::decide::{self, DecideCall, DecideReply};
use crate::scripts::refund::{self, Refunded};
use crate::scripts::ScriptError;
use crate::store::{Store, StoreError};
use std::future::Future;
use std::time::{Duration, Instant};

/// The decision path's port to its store. `left` is what remains of the decision's Redis budget
/// ([`DecisionStore::decision_timeout`]): one deadline for the whole decision, not one per call.
pub trait DecisionStore: Clone + Send + Sync + 'static {
    /// All the store time one decision may take.
    fn decision_timeout(&self) -> Duration;

    /// The record of a key hash (`None`: no such key): `apikey:{sha256}`. `off_path`: for
    /// background work (a refund), within all of `left` on the off-path connection; else a
    /// decision's, within `redis.timeout` too.
    fn key_record(&self, hash: &KeyHash, left: Duration, off_path: bool) -> impl Future<Output = Result<Option<KeyRecord>, StoreError>> + Send;

    /// Every limit of a request, its lease and its lookup: one `decide.lua` call.
    fn decide(&self, call: &DecideCall, left: Duration) -> impl Future<Output = Result<DecideReply, ScriptError>> + Send;

    /// Settles a reservation and/or a slot: one `complete.lua` call.
    fn complete(&self, call: &CompleteCall) -> impl Future<Output = Result<(i64, Settled), StoreError>> + Send;

    /// Gives back what an abandoned decision took: its record, then one `refund.lua` call.
    fn refund(&self, tenant: &Id, decision_id: &Id, now_ms: u64) -> impl Future<Output = Result<Refunded, ScriptError>> + Send;

    /// Whether this caller writes the key's audit line (the first failure of the hour).
    fn claim_audit(&self, key_id: &Id) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Whether a command sent now on the decisions' connection is answered: every limits script
    /// sent on it before has run (a late refund trusts "no record" only after it: super::late).
    fn barrier(&self) -> impl Future<Output = bool> + Send;

    /// Whether the decisions' connection in use now was made after `t`: a script sent before on
    /// the one it replaced may still reach Redis from that connection's socket, and a barrier on
    /// this one says nothing of it (decision 181).
    fn replaced_since(&self, t: Instant) -> impl Future<Output = bool> + Send;
}

impl DecisionStore for Store {
    fn decision_timeout(&self) -> Duration {
        Store::decision_timeout(self)
    }

    async fn key_record(&self, hash: &KeyHash, left: Duration, off_path: bool) -> Result<Option<KeyRecord>, StoreError> {
        self.lookup_within(hash, if off_path { left } else { self.request_deadline(left) }).await
    }

    async fn decide(&self, call: &DecideCall, left: Duration) -> Result<DecideReply, ScriptError> {
        decide::run(self, call, self.request_deadline(left)).await
    }

    async fn complete(&self, call: &CompleteCall) -> Result<(i64, Settled), StoreError> {
        complete::run(self, call).await
    }

    async fn refund(&self, tenant: &Id, decision_id: &Id, now_ms: u64) -> Result<Refunded, ScriptError> {
        refund::run(self, tenant, decision_id, now_ms).await
    }

    async fn claim_audit(&self, key_id: &Id) -> Result<bool, StoreError> {
        self.claim_auth_failure_audit(key_id).await
    }

    async fn barrier(&self) -> bool {
        self.request_path_barrier().await
    }

    async fn replaced_since(&self, t: Instant) -> bool {
        self.request_path_replaced_at().await.is_some_and(|at| at > t)
    }
}
