//! Usage intake with per-second aggregation on (`usage.aggregate_above_rps` > 0): which tenants
//! are above the rate at this sidecar (their events are *marked* for aggregation in their spool
//! lines, `tollgate_shared::aggregate::encode_line`), and which event ids were accepted lately (a
//! batch the filter sends again is dropped, since events inside an aggregate cannot be
//! deduplicated downstream). Pure: time is passed in. The shipping half (a segment into
//! aggregates) is `tollgate_shared::aggregate::plan_segment`.

use std::collections::HashMap;

/// An event of a batch whose earlier copy is still being written: the batch is refused (503, the
/// filter sends it again), since dropping it as a duplicate would answer before its events are
/// durable, and lose them if that write fails.
#[derive(Debug, PartialEq, Eq)]
pub struct InFlight;
use tollgate_wire::usage::UsageEvent;

#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    second: u64,
    count: u64,
    previous: u64,
}

/// Each tenant's events per second arriving at this sidecar, and which to aggregate.
#[derive(Debug)]
pub struct RateTracker {
    above_rps: u64,
    tenants: HashMap<String, Rate>,
    pruned_at: u64,
}

/// Tenants tracked before idle ones are forgotten (at most once a second).
const PRUNE_ABOVE: usize = 4096;

impl RateTracker {
    /// `above_rps` = 0: nothing is ever marked.
    pub fn new(above_rps: u64) -> RateTracker {
        RateTracker { above_rps, tenants: HashMap::new(), pruned_at: 0 }
    }

    /// Counts `events` as arriving at `now_ms` and says, event by event, which to aggregate: an
    /// event of a tenant that has had more than `above_rps` events in this second (counting the
    /// ones before it), or had in the previous second. A tenant thus turns aggregated within the
    /// second it crosses the rate, and stays so for the whole next second.
    pub fn mark(&mut self, events: &[UsageEvent], now_ms: u64) -> Vec<bool> {
        if self.above_rps == 0 {
            return vec![false; events.len()];
        }
        let second = now_ms / 1000;
        if self.tenants.len() > PRUNE_ABOVE && self.pruned_at != second {
            self.pruned_at = second;
            self.tenants.retain(|_, r| r.second + 1 >= second);
        }
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            let r = match self.tenants.get_mut(&e.tenant) {
                Some(r) => r,
                None => self.tenants.entry(e.tenant.clone()).or_default(),
            };
            if r.second != second {
                r.previous = if r.second + 1 == second { r.count } else { 0 };
                r.second = second;
                r.count = 0;
            }
            r.count += 1;
            out.push(r.count > self.above_rps || r.previous > self.above_rps);
        }
        out
    }
}

/// The ids of the events accepted lately (the last [`RecentIds::new`]'s `capacity`), as 128-bit
/// keyed hashes. With aggregation on, intake drops an event whose id is here: a batch the filter
/// sends again after the sidecar already spooled it (its call timed out, or the sidecar crashed
/// between the fsync and its answer). Single events would be deduplicated by id at the consumer;
/// events inside aggregates cannot be, so they must not be spooled twice. Each id is durable
/// (spooled) or in flight (its write not answered yet: [`RecentIds::insert_pending`]).
pub struct RecentIds {
    keys: (std::hash::RandomState, std::hash::RandomState),
    /// id → (durable, the number of the insertion it came with)
    set: HashMap<u128, (bool, u64)>,
    /// The insertions in order, oldest first. One whose id was forgotten (or remembered again
    /// since) is stale: leaving the window, it removes nothing.
    order: std::collections::VecDeque<(u128, u64)>,
    /// The next insertion's number.
    next: u64,
    capacity: usize,
}

impl RecentIds {
    pub fn new(capacity: usize) -> RecentIds {
        RecentIds {
            keys: (std::hash::RandomState::new(), std::hash::RandomState::new()),
            set: HashMap::with_capacity(capacity.min(1 << 16)),
            order: std::collections::VecDeque::with_capacity(capacity.min(1 << 16)),
            next: 0,
            capacity: capacity.max(1),
        }
    }

    fn key(&self, id: &str) -> u128 {
        use std::hash::BuildHasher;
        (u128::from(self.keys.0.hash_one(id)) << 64) | u128::from(self.keys.1.hash_one(id))
    }

    /// Remembers `id` as durable (read back from the spool); `false` when it was already there.
    pub fn insert(&mut self, id: &str) -> bool {
        self.remember(id, true)
    }

    /// Remembers `id` as in flight: its write is not answered yet ([`Self::confirm`] or
    /// [`Self::forget`] once it is). `false` when it was already there.
    pub fn insert_pending(&mut self, id: &str) -> bool {
        self.remember(id, false)
    }

    /// `id`'s write is answered: it is durable.
    pub fn confirm(&mut self, id: &str) {
        let k = self.key(id);
        if let Some((durable, _)) = self.set.get_mut(&k) {
            *durable = true;
        }
    }

    /// `id` is remembered and its write is not answered yet.
    pub fn in_flight(&self, id: &str) -> bool {
        self.set.get(&self.key(id)).is_some_and(|(durable, _)| !durable)
    }

    fn remember(&mut self, id: &str, durable: bool) -> bool {
        let k = self.key(id);
        if self.set.contains_key(&k) {
            return false;
        }
        // The window is the last `capacity` ids remembered: room is made before this one comes.
        // Stale insertions leave with the live ones before them (and take no room: at most as
        // many again are kept, so the order holds at most twice the window). An id whose write
        // is not answered yet is never dropped (its batch sent again must get 503, not be
        // spooled twice): while the oldest id is such a one, the window grows instead, and
        // shrinks back once its write is answered (in flight: the writes of a few batches).
        while self.set.len() >= self.capacity || self.order.len() >= 2 * self.capacity {
            let Some((old, m)) = self.order.pop_front() else { break };
            match self.set.get(&old) {
                Some((false, at)) if *at == m => {
                    self.order.push_front((old, m));
                    break;
                }
                Some((true, at)) if *at == m => {
                    self.set.remove(&old);
                }
                _ => {}
            }
        }
        let n = self.next;
        self.next += 1;
        self.set.insert(k, (durable, n));
        self.order.push_back((k, n));
        true
    }

    /// Forgets `id` (its batch was not spooled after all: when it comes again it is new). Its
    /// insertion stays in the order, stale: it can never remove the id remembered again later.
    pub fn forget(&mut self, id: &str) {
        let k = self.key(id);
        self.set.remove(&k);
    }

    /// Ids remembered now.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

/// Intake with aggregation on: the rates, and the ids accepted lately.
pub struct Intake {
    pub rates: RateTracker,
    pub recent: RecentIds,
}

impl Intake {
    /// Which of `events` are new (an id accepted lately, or twice in `events`, is not), the new
    /// ones remembered as in flight; then the new ones' marks, in their order
    /// ([`RateTracker::mark`]). [`InFlight`], remembering nothing, when one of them is an id of
    /// an earlier batch whose write is not answered yet.
    pub fn admit(&mut self, events: &[UsageEvent], now_ms: u64) -> Result<(Vec<bool>, Vec<bool>), InFlight> {
        if events.iter().any(|e| self.recent.in_flight(&e.id)) {
            return Err(InFlight);
        }
        let fresh: Vec<bool> = events.iter().map(|e| self.recent.insert_pending(&e.id)).collect();
        let marks = if fresh.iter().all(|f| *f) {
            self.rates.mark(events, now_ms)
        } else {
            let kept: Vec<UsageEvent> = events.iter().zip(&fresh).filter(|(_, f)| **f).map(|(e, _)| e.clone()).collect();
            self.rates.mark(&kept, now_ms)
        };
        Ok((fresh, marks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_764_460_800_000; // 2025-11-30T00:00:00Z

    /// An event of `tenant` with id `id` (intake reads nothing else).
    fn ev(id: &str, tenant: &str) -> UsageEvent {
        let json = serde_json::json!({
            "id": id, "tenant": tenant, "keyId": "k", "plan": "gold", "method": "GET",
            "authority": "api.test", "path": "/v1", "status": 200, "startMs": SEC,
        });
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_tenant_above_the_rate_is_marked_from_the_event_that_crosses_it_and_the_whole_next_second() {
        let mut t = RateTracker::new(3);
        let hot: Vec<UsageEvent> = (0..5).map(|i| ev(&format!("h{i:07}"), "hot")).collect();
        let cold = [ev("c0000001", "cold")];
        assert_eq!(t.mark(&hot, SEC + 10), [false, false, false, true, true]);
        assert_eq!(t.mark(&cold, SEC + 20), [false]);
        // the next second: marked from its first event (the previous second was above)
        assert_eq!(t.mark(&hot[..1], SEC + 1000), [true]);
        assert_eq!(t.mark(&cold, SEC + 1000), [false]);
        // two seconds later with 1 event in between: below again
        assert_eq!(t.mark(&hot[..2], SEC + 2000), [false, false]);
        assert_eq!(t.mark(&hot[..1], SEC + 4000), [false], "a gap forgets the old rate");
        // off: nothing is marked
        assert_eq!(RateTracker::new(0).mark(&hot, SEC), [false; 5]);
    }

    #[test]
    fn intake_drops_ids_accepted_lately_and_marks_the_rest() {
        let mut intake = Intake { rates: RateTracker::new(1), recent: RecentIds::new(3) };
        let batch: Vec<UsageEvent> = (0..3).map(|i| ev(&format!("e{i:07}"), "hot")).collect();
        assert_eq!(intake.admit(&batch, SEC), Ok((vec![true; 3], vec![false, true, true])));
        // sent again while the first copy is still being written: refused, nothing remembered
        let mut again = batch.clone();
        again.push(ev("e0000003", "hot"));
        assert_eq!(intake.admit(&again, SEC), Err(InFlight));
        assert!(!intake.recent.in_flight("e0000003"));
        for e in &batch {
            intake.recent.confirm(&e.id);
        }
        // the filter sends the batch again once it is durable, with one new event
        assert_eq!(intake.admit(&again, SEC), Ok((vec![false, false, false, true], vec![true])));
        // the window is bounded: the oldest ids are forgotten
        assert_eq!(intake.recent.len(), 3);
        assert!(intake.recent.insert("e0000000"));
        assert!(!intake.recent.insert("e0000003"));
        // a batch the spool refused is forgotten, so that it is taken when it comes again
        intake.recent.forget("e0000003");
        assert!(intake.recent.insert("e0000003"));
    }

    #[test]
    fn an_id_forgotten_and_remembered_again_keeps_its_whole_window() {
        // a batch the spool refused, sent again and written: its ids stay for the window's
        // `capacity` ids, and an old insertion of theirs leaving it removes nothing
        let mut r = RecentIds::new(3);
        assert!(r.insert_pending("a"));
        r.forget("a");
        assert!(r.insert_pending("a"));
        r.confirm("a");
        assert!(r.insert("b"));
        assert!(r.insert("c"));
        assert_eq!(r.len(), 3);
        assert!(!r.insert("a"), "one of the last 3 ids");
        // still in flight after an old insertion left: still refused as in flight
        let mut r = RecentIds::new(2);
        assert!(r.insert_pending("x"));
        r.forget("x");
        assert!(r.insert_pending("x"));
        assert!(r.insert("y"));
        assert!(r.in_flight("x"), "its write is not answered yet");
        // the window moves on past the ids whose writes are answered; x stays while in flight
        assert!(r.insert("z"));
        assert!(r.in_flight("x"), "never dropped while its write is out");
        r.confirm("x");
        assert!(r.insert("w"));
        assert!(!r.in_flight("x") && r.insert("x"), "x left the window of 2 once durable");
    }

    #[test]
    fn an_id_whose_write_is_out_outlasts_the_window() {
        // a disk slower than the window: the batch sent again while its first write is out must
        // get 503 (in flight), never be spooled a second time because its ids were dropped
        let mut r = RecentIds::new(3);
        assert!(r.insert_pending("a"));
        for id in ["b", "c", "d", "e", "f"] {
            assert!(r.insert(id));
        }
        assert!(r.in_flight("a"));
        assert_eq!(r.len(), 6, "the window grows while its oldest id's write is out");
        r.confirm("a");
        assert!(r.insert("g"));
        assert_eq!(r.len(), 3, "and shrinks back once it is answered");
        assert!(!r.insert("f") && r.insert("b"), "f in the window, b out of it");
    }

    #[test]
    fn idle_tenants_are_forgotten() {
        let mut t = RateTracker::new(1);
        for i in 0..PRUNE_ABOVE + 10 {
            t.mark(&[ev("x0000001", &format!("t{i}"))], SEC);
        }
        t.mark(&[ev("x0000001", "now")], SEC + 5000);
        assert_eq!(t.tenants.len(), 1);
    }
}
