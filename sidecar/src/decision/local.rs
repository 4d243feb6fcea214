//! `failure_mode = "local"` (issue 15.3): while Redis cannot answer a decision's limits, this
//! sidecar enforces each such limit itself, in memory, at its *share*: `floor(limit / replicas)`
//! — one sidecar per Envoy, so the replicas together admit at most the limit per window when the
//! replica count is right (more when it is undercounted). A share of 0 refuses every request.
//!
//! The replica count: `[limits] local_replicas` when set; else the count of live sidecars seen
//! in Redis while it answered ([`super::replicas`], the count last seen stays in force during the
//! outage); else 1.
//!
//! Counters are keyed like the Redis ones (tenant, limit, subject) and start empty when the
//! outage starts: what Redis counted before is not known here (decision 103). Per algorithm:
//! - fixed window: a count per window (same window boundaries as Redis);
//! - sliding window and sliding log: a sliding-window counter (the current window's count plus
//!   the previous one's, weighted by how much of it is still inside the window);
//! - token bucket: a bucket of `share` tokens refilled at `share / window`, full when first used.
//!
//! Token budgets and concurrency caps cannot be `local` (refused at config load: their
//! reservations and slots are settled in Redis by the completion path).
//!
//! Bounded: at most `local_max_entries` counters. When full, counters that no longer hold
//! anything (their window over, their bucket full again) go first, swept at most once a second;
//! while every counter still holds something, a new subject is counted in its tenant's and
//! limit's shared overflow counter instead — a live counter is never dropped, so a tenant
//! rotating subjects during an outage cannot reset another's (decision 165).
//! One decision checks all its local limits, then takes from all only if all pass (as
//! `decide.lua` does). Pure apart from the mutex: time is passed in.

use super::answers;
use super::checks::{self, Meta};
use super::limits::{Algorithm, LimitFailureMode};
use crate::apikey::KeyRecord;
use crate::metrics as m;
use crate::scripts::decide::LimitState;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use tollgate_wire::DecideResponse;

/// `[limits]`: how `local` limits are enforced while Redis cannot answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalConfig {
    /// How many sidecars share each limit (one per Envoy). Unset: the count discovered in Redis
    /// while it answered, else 1. Set: this, always (it wins over the discovered count).
    pub local_replicas: Option<u32>,
    /// The most local counters kept (tenant × limit × subject); beyond it, new subjects share an
    /// overflow counter per tenant and limit.
    pub local_max_entries: usize,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig { local_replicas: None, local_max_entries: 100_000 }
    }
}

impl LocalConfig {
    pub fn validate(&self) -> Result<(), crate::invalid::Invalid> {
        if self.local_replicas == Some(0) {
            return Err(crate::invalid::invalid("limits.local_replicas", "must be at least 1 (or unset: discovered)"));
        }
        if self.local_max_entries == 0 {
            return Err(crate::invalid::invalid("limits.local_max_entries", "must be at least 1"));
        }
        Ok(())
    }
}

/// One local counter.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Counter {
    /// Fixed and sliding windows: units in window `bucket` and in the one before it.
    Window { bucket: u64, count: u64, previous: u64 },
    /// Token bucket: tokens × window_ms (integer refill), as of `at_ms`.
    Bucket { scaled: u128, at_ms: u64 },
}

#[derive(Debug, Default)]
struct State {
    /// Each counter, and when it holds nothing any more (ms: the window after the next one
    /// starts, the bucket is full again): from then on it is as if it never was.
    counters: HashMap<String, (Counter, u64)>,
    /// Counters held per tenant (the part of a key before its first `/`).
    per_tenant: HashMap<String, usize>,
    /// When a full table was last swept of such counters.
    swept_ms: Option<u64>,
}

/// The share of the table one tenant may hold: a quarter, so one tenant rotating subjects
/// overflows into its own counter while the others still find room.
const TENANT_SHARE: usize = 4;

/// How often at most a full table is swept of counters that hold nothing.
const SWEEP_EVERY_MS: u64 = 1_000;

/// The subject of the counter new subjects share while the table is full (a newline: no
/// subject holds one).
const OVERFLOW: &str = "\n";

/// What a local decision found.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Per local limit: its index in the decision's limits, and its state after the decision.
    pub states: Vec<(usize, LimitState)>,
    /// The index of the limit that denied (nothing was taken).
    pub denied: Option<usize>,
}

/// The local counters of one sidecar.
#[derive(Debug)]
pub struct LocalLimits {
    configured: Option<u32>,
    /// Live sidecars last counted in Redis (0: not known).
    discovered: AtomicU32,
    max_entries: usize,
    state: Mutex<State>,
}

impl Default for LocalLimits {
    fn default() -> Self {
        LocalLimits::new(&LocalConfig::default())
    }
}

impl LocalLimits {
    pub fn new(config: &LocalConfig) -> LocalLimits {
        LocalLimits {
            configured: config.local_replicas,
            discovered: AtomicU32::new(0),
            max_entries: config.local_max_entries.max(1),
            state: Mutex::new(State::default()),
        }
    }

    /// Remembers the live sidecars counted in Redis (used while it cannot answer).
    pub fn set_discovered(&self, n: u32) {
        self.discovered.store(n, Ordering::Relaxed);
    }

    /// Whether the replica count is configured (then it is never discovered).
    pub fn configured(&self) -> bool {
        self.configured.is_some()
    }

    /// The replica count in force: configured, else discovered, else 1.
    pub fn replicas(&self) -> u32 {
        self.configured.unwrap_or_else(|| match self.discovered.load(Ordering::Relaxed) {
            0 => 1,
            n => n,
        })
    }

    /// This sidecar's share of `limit`.
    pub fn share(&self, limit: u64) -> u64 {
        limit / u64::from(self.replicas().max(1))
    }

    /// Counters held now.
    pub fn counters(&self) -> usize {
        self.lock().counters.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides one request against the limits of `meta` at indexes `which` (the `local` ones),
    /// for `tenant`: checks all, takes from all only if all pass.
    pub fn decide(&self, tenant: &str, meta: &[Meta], which: &[usize], now_ms: u64) -> Verdict {
        let mut st = self.lock();
        let mut next = Vec::with_capacity(which.len());
        let mut denied = None;
        for &i in which {
            let m = &meta[i];
            // one counter per definition, as in Redis (decision 180): two plans' limits of one
            // name never reset or refill each other's
            let def = format!("{:?}/{}/{}", m.algorithm, m.window_ms, m.limit);
            let mut key = format!("{tenant}/{}/{}/{def}", m.name, m.subject);
            if !st.counters.contains_key(&key) && !self.room(&mut st, tenant, now_ms) {
                key = format!("{tenant}/{}/{OVERFLOW}/{def}", m.name);
            }
            let share = self.share(m.limit);
            let held = st.counters.get(&key).map(|(c, _)| *c);
            let (counter, state) = check(held, m, share, now_ms);
            if state.would_deny && denied.is_none() {
                denied = Some(i);
            }
            next.push((i, key, (counter, holds_until(counter, m, share)), state));
        }
        if denied.is_none() {
            for (_, key, counter, _) in next.iter_mut() {
                if st.counters.insert(std::mem::take(key), *counter).is_none() {
                    *st.per_tenant.entry(tenant.to_string()).or_default() += 1;
                }
            }
        }
        Verdict { states: next.into_iter().map(|(i, _, _, s)| (i, s)).collect(), denied }
    }

    /// Whether a new counter of `tenant` fits: below the bound and below the tenant's share of
    /// it ([`TENANT_SHARE`]), or so after a sweep (at most once a second) of the counters that
    /// hold nothing any more. The overflow counters are not bounded by it (at most one per
    /// tenant and limit).
    fn room(&self, st: &mut State, tenant: &str, now_ms: u64) -> bool {
        let tenant_cap = (self.max_entries / TENANT_SHARE).max(1);
        let fits = |st: &State| st.counters.len() < self.max_entries && st.per_tenant.get(tenant).copied().unwrap_or(0) < tenant_cap;
        if fits(st) {
            return true;
        }
        if st.swept_ms.is_some_and(|at| now_ms < at.saturating_add(SWEEP_EVERY_MS)) {
            return false;
        }
        st.swept_ms = Some(now_ms);
        st.counters.retain(|_, (_, until)| *until > now_ms);
        let mut per_tenant: HashMap<String, usize> = HashMap::new();
        for key in st.counters.keys() {
            *per_tenant.entry(key.split('/').next().unwrap_or_default().to_string()).or_default() += 1;
        }
        st.per_tenant = per_tenant;
        fits(st)
    }
}

/// When `counter` holds nothing any more: the fixed or sliding window after the next one starts
/// (neither its count nor its previous one is read then); the bucket is full again.
fn holds_until(counter: Counter, m: &Meta, share: u64) -> u64 {
    let w = m.window_ms.max(1);
    match counter {
        Counter::Window { bucket, .. } => bucket.saturating_add(2).saturating_mul(w),
        Counter::Bucket { scaled, at_ms } => {
            let missing = (u128::from(share) * u128::from(w)).saturating_sub(scaled);
            let ms = match share {
                0 => 0,
                s => missing.div_ceil(u128::from(s)).min(u128::from(u64::MAX)) as u64,
            };
            at_ms.saturating_add(ms)
        }
    }
}

/// One limit against its counter (None: never used): the counter as it would be with the
/// request taken, and the limit's state (remaining after it, time to reset, whether it denies).
fn check(counter: Option<Counter>, m: &Meta, share: u64, now_ms: u64) -> (Counter, LimitState) {
    let w = m.window_ms.max(1);
    let cost = m.cost;
    match m.algorithm {
        Algorithm::TokenBucket => {
            let full = u128::from(share) * u128::from(w);
            let scaled = match counter {
                Some(Counter::Bucket { scaled, at_ms }) => {
                    (scaled + u128::from(now_ms.saturating_sub(at_ms)) * u128::from(share)).min(full)
                }
                _ => full,
            };
            let need = u128::from(cost) * u128::from(w);
            let deny = scaled < need;
            let after = if deny { scaled } else { scaled - need };
            let remaining = (after / u128::from(w)) as u64;
            // denied: until `cost` tokens are back; allowed: until the bucket is full again
            let missing = if deny { need - scaled } else { full - after };
            let reset_ms = match share {
                0 => w,
                s => missing.div_ceil(u128::from(s)).min(u128::from(u64::MAX)) as u64,
            };
            (Counter::Bucket { scaled: after, at_ms: now_ms }, LimitState { remaining, reset_ms, would_deny: deny })
        }
        _ => {
            let bucket = now_ms / w;
            let (count, previous) = match counter {
                Some(Counter::Window { bucket: b, count, .. }) if b + 1 == bucket => (0, count),
                Some(Counter::Window { bucket: b, count, previous }) if b == bucket => (count, previous),
                _ => (0, 0),
            };
            let into = now_ms % w;
            let used = match m.algorithm {
                // the previous window's units still inside the sliding window (rounded up)
                Algorithm::SlidingWindow | Algorithm::SlidingLog => {
                    count + (u128::from(previous) * u128::from(w - into)).div_ceil(u128::from(w)) as u64
                }
                _ => count,
            };
            let deny = used.saturating_add(cost) > share;
            let taken = if deny { used } else { used + cost };
            let c = Counter::Window { bucket, count: if deny { count } else { count + cost }, previous };
            (c, LimitState { remaining: share.saturating_sub(taken), reset_ms: w - into, would_deny: deny })
        }
    }
}

/// The answer of a decision whose limits Redis could not check and of which some are `local`:
/// those decide at this sidecar's share (the others, `open` or shadow, let it through). A denial
/// is the usual 429 with its headers; an allowed request carries the nearest local limit's.
pub fn answer(local: &LocalLimits, r: &KeyRecord, meta: &[Meta], now_ms: u64) -> DecideResponse {
    let which: Vec<usize> = (0..meta.len()).filter(|&i| !meta[i].shadow && meta[i].failure_mode == LimitFailureMode::Local).collect();
    let verdict = local.decide(r.tenant.as_str(), meta, &which, now_ms);
    let outcome = if verdict.denied.is_some() { "denied" } else { "allowed" };
    metrics::counter!(m::LOCAL_DECISIONS, "outcome" => outcome).increment(1);
    if let Some(i) = verdict.denied {
        if let Some((_, s)) = verdict.states.iter().find(|(j, _)| *j == i) {
            return answers::too_many(&meta[i], s);
        }
    }
    let (local_meta, states): (Vec<Meta>, Vec<LimitState>) = verdict.states.iter().map(|(i, s)| (meta[*i].clone(), *s)).unzip();
    let headers = checks::nearest(&local_meta, &states)
        .map(|i| checks::ratelimit_headers(&local_meta[i], &states[i]).to_vec())
        .unwrap_or_default();
    answers::allow(r, headers, None, None, None, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(algorithm: Algorithm, limit: u64, window_ms: u64) -> Meta {
        Meta {
            name: "l".into(),
            algorithm,
            limit,
            window_ms,
            cost: 1,
            shadow: false,
            failure_mode: LimitFailureMode::Local,
            subject: "k.a".into(),
            budget: None,
        }
    }

    fn local(replicas: u32) -> LocalLimits {
        LocalLimits::new(&LocalConfig { local_replicas: Some(replicas), local_max_entries: 100 })
    }

    /// Requests admitted of `n` at `now_ms`.
    fn admit(l: &LocalLimits, m: &Meta, n: usize, now_ms: u64) -> usize {
        (0..n).filter(|_| l.decide("acme", std::slice::from_ref(m), &[0], now_ms).denied.is_none()).count()
    }

    #[test]
    fn the_share_is_the_limit_divided_by_the_replicas_rounded_down() {
        assert_eq!(local(2).share(11), 5);
        assert_eq!(local(3).share(2), 0);
        let d = LocalLimits::default();
        assert_eq!(d.replicas(), 1, "nothing configured or discovered: alone");
        d.set_discovered(4);
        assert_eq!((d.replicas(), d.share(10)), (4, 2));
        let c = local(2);
        c.set_discovered(4);
        assert_eq!(c.replicas(), 2, "configured wins");
    }

    #[test]
    fn a_fixed_window_admits_its_share_per_window() {
        let l = local(2);
        let m = meta(Algorithm::FixedWindow, 11, 60_000);
        assert_eq!(admit(&l, &m, 20, 60_000), 5);
        let v = l.decide("acme", std::slice::from_ref(&m), &[0], 119_999);
        assert_eq!(v.denied, Some(0));
        assert_eq!(v.states[0].1, LimitState { remaining: 0, reset_ms: 1, would_deny: true });
        assert_eq!(admit(&l, &m, 20, 120_000), 5, "a new window");
        assert_eq!(admit(&l, &m, 20, 120_000), 0);
    }

    /// Decision 180: limits of one name with two definitions (two plans) count apart. Before,
    /// they shared one counter, and each plan's window reset the other's count at every switch.
    #[test]
    fn limits_of_one_name_in_two_plans_count_apart() {
        let l = local(1);
        let (minute, hour) = (meta(Algorithm::FixedWindow, 2, 60_000), meta(Algorithm::FixedWindow, 2, 3_600_000));
        let mut admitted = 0;
        for _ in 0..4 {
            admitted += admit(&l, &minute, 1, 10_000) + admit(&l, &hour, 1, 10_000);
        }
        assert_eq!(admitted, 4, "two of each");
    }

    #[test]
    fn a_zero_share_refuses_everything() {
        let l = local(4);
        for a in [Algorithm::FixedWindow, Algorithm::SlidingWindow, Algorithm::SlidingLog, Algorithm::TokenBucket] {
            assert_eq!(admit(&l, &meta(a, 3, 1000), 5, 5_000), 0, "{a:?}");
        }
    }

    #[test]
    fn a_sliding_window_weighs_the_previous_window() {
        let l = local(1);
        let m = meta(Algorithm::SlidingWindow, 10, 1000);
        assert_eq!(admit(&l, &m, 20, 500), 10);
        // a quarter into the next window: 3/4 of the previous 10 (rounded up: 8) still count
        assert_eq!(admit(&l, &m, 20, 1250), 2);
        // two windows on: nothing of it counts
        assert_eq!(admit(&l, &m, 20, 3000), 10);
        // no doubling at a window boundary: 10 taken at the end of a window still count at its end
        let l = local(1);
        let log = meta(Algorithm::SlidingLog, 10, 1000);
        assert_eq!(admit(&l, &log, 20, 999), 10);
        assert_eq!(admit(&l, &log, 20, 1000), 0);
        assert_eq!(admit(&l, &log, 20, 1500), 5, "half of them: the counter assumes they were spread");
    }

    #[test]
    fn a_token_bucket_starts_full_and_refills_at_its_share() {
        let l = local(2);
        let m = meta(Algorithm::TokenBucket, 10, 10_000); // share 5, refill 5 per 10 s
        assert_eq!(admit(&l, &m, 10, 0), 5);
        let v = l.decide("acme", std::slice::from_ref(&m), &[0], 0);
        assert_eq!(v.states[0].1, LimitState { remaining: 0, reset_ms: 2000, would_deny: true });
        // one token back every 2 s; a minute later it holds its share (5), never more
        for (now, admitted) in [(1999, 0), (2000, 1), (60_000, 5)] {
            assert_eq!(admit(&l, &m, 10, now), admitted, "at {now} ms");
        }
    }

    #[test]
    fn all_or_nothing_and_keyed_per_tenant_limit_and_subject() {
        let l = local(1);
        let a = meta(Algorithm::FixedWindow, 3, 60_000);
        let mut b = meta(Algorithm::FixedWindow, 1, 60_000);
        b.name = "b".into();
        let both = [a.clone(), b.clone()];
        assert_eq!(l.decide("acme", &both, &[0, 1], 0).denied, None);
        assert_eq!(l.decide("acme", &both, &[0, 1], 0).denied, Some(1));
        // the denied request took nothing from `a`: 2 left of 3
        assert_eq!(admit(&l, &a, 5, 0), 2);
        assert_eq!(admit(&l, &a, 5, 0) + admit(&l, &b, 1, 0), 0);
        assert_eq!(l.decide("other", &both, &[0, 1], 0).denied, None, "another tenant counts apart");
        let mut c = a.clone();
        c.subject = "k.b".into();
        assert_eq!(admit(&l, &c, 5, 0), 3, "another subject counts apart");
        // an `open` limit of the plan is not counted here
        assert_eq!(l.decide("acme", &both, &[0], 60_000).states.len(), 1);
    }

    #[test]
    fn a_tenant_rotating_subjects_shares_one_counter_and_drops_no_one_elses() {
        // a table of 8: a tenant may hold 2 counters of its own
        let l = LocalLimits::new(&LocalConfig { local_replicas: Some(1), local_max_entries: 8 });
        let m = meta(Algorithm::FixedWindow, 2, 60_000);
        let with = |subject: &str| Meta { subject: subject.into(), ..m.clone() };
        let admit_as = |tenant: &str, m: &Meta, n: usize| (0..n).filter(|_| l.decide(tenant, std::slice::from_ref(m), &[0], 10).denied.is_none()).count();
        // another tenant spends its limit; then acme rotates subjects
        assert_eq!(admit_as("beta", &m, 5), 2);
        let rotated: usize = (0..50).map(|i| admit_as("acme", &with(&format!("k.r{i}")), 1)).sum();
        assert_eq!(rotated, 1 + 1 + 2, "two subjects with counters of their own, the other 48 sharing one");
        assert_eq!(l.counters(), 4, "beta's, acme's two and acme's overflow counter");
        assert_eq!(admit_as("beta", &m, 5), 0, "beta's counter was never dropped");
        // beta's new subjects still get counters of their own
        assert_eq!(admit_as("beta", &with("k.new"), 5), 2);
    }

    #[test]
    fn a_full_table_first_drops_the_counters_that_hold_nothing() {
        let l = LocalLimits::new(&LocalConfig { local_replicas: Some(1), local_max_entries: 3 });
        let m = meta(Algorithm::FixedWindow, 1, 60_000);
        let bucket = meta(Algorithm::TokenBucket, 1, 60_000);
        for t in ["a", "b"] {
            assert_eq!(l.decide(t, std::slice::from_ref(&m), &[0], 0).denied, None);
        }
        assert_eq!(l.decide("c", std::slice::from_ref(&bucket), &[0], 0).denied, None);
        // half a window on: every counter still holds something (c's bucket is full again at
        // 60 s; a window's count is read through the next window, by the sliding kinds)
        assert_eq!(l.decide("d", std::slice::from_ref(&m), &[0], 30_000).denied, None);
        assert_eq!(l.counters(), 4, "d counted in its overflow counter");
        // two windows on: the windows hold nothing and the bucket is full; a new subject sweeps
        // them, and has a counter of its own
        assert_eq!(l.decide("e", std::slice::from_ref(&m), &[0], 120_000).denied, None);
        assert_eq!(l.counters(), 1);
        assert_eq!(l.decide("e", std::slice::from_ref(&m), &[0], 120_001).denied, Some(0));
        // a table full of live counters is swept at most once a second
        for t in ["f", "g"] {
            assert_eq!(l.decide(t, std::slice::from_ref(&m), &[0], 120_002).denied, None);
        }
        assert_eq!(l.decide("h", std::slice::from_ref(&m), &[0], 120_003).denied, None);
        assert_eq!(l.counters(), 4, "h overflowed: nothing to sweep");
    }
}
