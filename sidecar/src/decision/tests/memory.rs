//! A [`DecisionStore`] in memory, for unit tests of the decision logic: key records by hash,
//! units taken per limit key, response-cache entries, idempotency owners and memos, and a switch
//! that makes every call fail as Redis does when it is unreachable.
//!
//! Its limits are plain counters (no windows, no refill: tests drive counts, not time); shadow
//! limits, lease grants, renewals and lookups follow `decide.lua`'s contract. The Lua itself is
//! tested against a real Redis (sidecar/tests).

use crate::apikey::KeyRecord;
use crate::decision::DecisionStore;
use crate::keys::{Id, KeyHash};
use crate::scripts::complete::{CompleteCall, Settled};
use crate::scripts::refund::Refunded;
use crate::scripts::ScriptError;
use crate::scripts::decide::{Check, DecideCall, DecideReply, LimitState, Lookup, Outcome};
use crate::store::StoreError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Default)]
pub struct Mem {
    pub records: HashMap<String, KeyRecord>,
    /// Hashes whose record cannot be read (a malformed hash in Redis).
    pub malformed: Vec<String>,
    /// Every call fails as a transient error.
    pub down: bool,
    /// Units taken, by the first key of each limit.
    pub taken: HashMap<String, u64>,
    /// Response-cache entries and idempotency owners and memos, by key.
    pub strings: HashMap<String, String>,
    /// Every `decide.lua` call asked, in order.
    pub calls: Vec<DecideCall>,
    pub record_reads: usize,
    pub audits: Vec<Id>,
    pub completions: Vec<CompleteCall>,
    /// Every refund asked: (tenant, decision id).
    pub refunds: Vec<(Id, Id)>,
    /// The decisions' connection was replaced (`replaced_since` answers this).
    pub replaced: bool,
}

#[derive(Clone, Default)]
pub struct MemoryStore(Arc<Mutex<Mem>>);

impl MemoryStore {
    pub fn mem(&self) -> MutexGuard<'_, Mem> {
        self.0.lock().unwrap()
    }

    pub fn put(&self, hash: &KeyHash, record: KeyRecord) {
        self.mem().records.insert(hash.as_str().to_string(), record);
    }

    pub fn set_down(&self, down: bool) {
        self.mem().down = down;
    }

    pub fn taken(&self, key: &str) -> u64 {
        self.mem().taken.get(key).copied().unwrap_or(0)
    }

    pub fn last_call(&self) -> Option<DecideCall> {
        self.mem().calls.last().cloned()
    }
}

fn unreachable() -> StoreError {
    StoreError::Unreachable("the memory store is down".into())
}

/// The key a limit is counted on, and its window (the reset it reports).
fn counted_on(check: &Check) -> (String, u64) {
    match check {
        Check::Fixed { key, window_ms } => (key.as_str().to_string(), *window_ms),
        Check::Sliding { current, window_ms, .. } => (current.as_str().to_string(), *window_ms),
        Check::Bucket { key, refill_ms } => (key.as_str().to_string(), *refill_ms),
        Check::Log { key, window_ms } => (key.as_str().to_string(), *window_ms),
        Check::Budget { counter, period_left_ms, .. } => (counter.as_str().to_string(), *period_left_ms),
        Check::Concurrency { key, slot_timeout_ms } => (key.as_str().to_string(), *slot_timeout_ms),
    }
}

impl Mem {
    /// The lookup's outcome when the limits pass; `Conflict` and `InFlight` take nothing.
    fn look_up(&mut self, lookup: &Lookup) -> Outcome {
        match lookup {
            Lookup::Cache { key } => match self.strings.get(key.as_str()) {
                Some(v) => Outcome::Hit(v.clone()),
                None => Outcome::Miss,
            },
            Lookup::Idempotency { owner, memo, digest, token, .. } => {
                if self.strings.get(owner.as_str()).is_some_and(|o| o != digest.as_str()) {
                    return Outcome::Conflict;
                }
                match self.strings.get(memo.as_str()) {
                    Some(m) if m.starts_with("inflight:") => Outcome::InFlight,
                    Some(m) => Outcome::Replay(m.clone()),
                    None => {
                        self.strings.insert(owner.as_str().to_string(), digest.as_str().to_string());
                        self.strings.insert(memo.as_str().to_string(), format!("inflight:{token}"));
                        Outcome::Claimed
                    }
                }
            }
        }
    }

    fn decide(&mut self, call: &DecideCall) -> DecideReply {
        self.calls.push(call.clone());
        let renewal = call.lease.is_some_and(|l| l.renewal);
        let cost = |c: &crate::scripts::decide::LimitCheck| if renewal { 0 } else { c.cost };
        let counted: Vec<(String, u64, u64)> = call
            .limits
            .iter()
            .map(|c| {
                let (key, window) = counted_on(&c.kind);
                let used = self.taken.get(&key).copied().unwrap_or(0);
                (key, window, used)
            })
            .collect();
        let ok: Vec<bool> = call.limits.iter().zip(&counted).map(|(c, (_, _, used))| used + cost(c) <= c.limit).collect();
        let denied = call.limits.iter().zip(&ok).position(|(c, ok)| !ok && !c.shadow);
        let outcome = match (&call.lookup, denied) {
            (Some(l), None) => Some(self.look_up(l)),
            _ => None,
        };
        let stops = matches!(outcome, Some(Outcome::Conflict | Outcome::InFlight));
        let leasable = call.limits.iter().all(|c| matches!(c.kind, Check::Fixed { .. } | Check::Bucket { .. }) && !c.shadow);
        let granted = match (call.lease, denied, stops) {
            (Some(l), None, false) if l.want > 0 && leasable => call
                .limits
                .iter()
                .zip(&counted)
                .map(|(c, (_, _, used))| c.limit.saturating_sub(used + cost(c)) / c.cost.max(1) / l.share.max(1))
                .fold(l.want, u64::min),
            _ => 0,
        };
        let takes = denied.is_none() && !stops && !(renewal && granted == 0);
        let mut states = Vec::new();
        for ((c, (key, window, used)), ok) in call.limits.iter().zip(&counted).zip(&ok) {
            let take = if takes { cost(c) + granted * c.cost } else { 0 };
            *self.taken.entry(key.clone()).or_insert(0) += take;
            states.push(LimitState { remaining: c.limit.saturating_sub(used + take), reset_ms: *window, would_deny: !ok });
        }
        DecideReply { denied, states, granted, outcome }
    }
}

impl DecisionStore for MemoryStore {
    fn decision_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }

    async fn key_record(&self, hash: &KeyHash, _left: std::time::Duration, _off_path: bool) -> Result<Option<KeyRecord>, StoreError> {
        let mut m = self.mem();
        m.record_reads += 1;
        if m.down {
            return Err(unreachable());
        }
        if m.malformed.iter().any(|h| h == hash.as_str()) {
            return Err(StoreError::Malformed("record field status invalid".into()));
        }
        Ok(m.records.get(hash.as_str()).cloned())
    }

    async fn decide(&self, call: &DecideCall, _left: std::time::Duration) -> Result<DecideReply, ScriptError> {
        let mut m = self.mem();
        if m.down {
            return Err(ScriptError::Store(unreachable()));
        }
        Ok(m.decide(call))
    }

    async fn complete(&self, call: &CompleteCall) -> Result<(i64, Settled), StoreError> {
        let mut m = self.mem();
        if m.down {
            return Err(unreachable());
        }
        m.completions.push(call.clone());
        Ok((call.actual as i64 - call.estimate as i64, Settled::Reconciled))
    }

    async fn refund(&self, tenant: &Id, decision_id: &Id, _now_ms: u64) -> Result<Refunded, ScriptError> {
        let mut m = self.mem();
        if m.down {
            return Err(ScriptError::Store(unreachable()));
        }
        m.refunds.push((tenant.clone(), decision_id.clone()));
        Ok(Refunded::Nothing)
    }

    async fn claim_audit(&self, key_id: &Id) -> Result<bool, StoreError> {
        let mut m = self.mem();
        let first = !m.audits.contains(key_id);
        m.audits.push(key_id.clone());
        Ok(first)
    }

    async fn barrier(&self) -> bool {
        true
    }

    async fn replaced_since(&self, _t: std::time::Instant) -> bool {
        self.mem().replaced
    }
}
