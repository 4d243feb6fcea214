#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! A leased key under a steady burst, simulated in time over the lease module with a mock host:
//! every ask and renewal is granted exactly what it asks (the sidecar's 500 ms lease lifetime),
//! answered 1 ms (or 10 ms) after it was sent; renewals leave on the worker's 20 ms tick. A key seen once
//! long before the burst must reach the same hit rate as a key first seen with it, and so must a
//! worker that spends from its share of the lease (decision 124).

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use tollgate_filter_core::lease::{self, LeaseConfig, LeaseIdentity, Spend};
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::shared_keys;
use tollgate_wire::Lease;

/// The sidecar's longest lease (LEASE_MAX_TTL_MS in sidecar/src/decision/limits.rs).
const TTL_MS: u64 = 500;
/// The worker's tick while leases are on (renewals wait for it).
const TICK_MS: u64 = 20;

#[derive(Debug, Default)]
struct Outcome {
    hits: u64,
    misses: u64,
    /// Hits and misses from the first second of the burst on.
    late_hits: u64,
    late_misses: u64,
    renewals: u64,
    asks: u64,
}

impl Outcome {
    fn late_hit_rate(&self) -> f64 {
        self.late_hits as f64 / (self.late_hits + self.late_misses) as f64
    }
}

/// A call out: when its answer comes, what it asked (0: no lease), when it was sent, a renewal.
struct Call {
    at: u64,
    want: u64,
    sent: u64,
    renewal: bool,
}

/// One allowed request at `first_ms` starts the record; from `burst_ms`, `per_ms` requests each
/// millisecond for `burst_len_ms`; every call is answered `answer_ms` after it was sent. `shares`:
/// the worker spends from its share of the lease (decision 124), else every spend goes to the
/// record.
fn simulate(first_ms: u64, burst_ms: u64, per_ms: u64, burst_len_ms: u64, answer_ms: u64, shares: bool) -> Outcome {
    let mut held = lease::Shares::with_capacity(if shares { lease::share::MAX_SHARES } else { 0 });
    let c = LeaseConfig::default();
    let key = shared_keys::lease("hash", None);
    let identity = LeaseIdentity { tenant: "acme".into(), key_id: "k".into(), plan: "pro".into(), ..Default::default() };
    let mut h = MockHost::new();
    let mut out = Outcome::default();
    let mut calls: Vec<Call> = Vec::new();
    let mut queued: Option<u64> = None;
    let allow = |h: &mut MockHost, now: u64| {
        // a call that asked for no lease: the sidecar's allow starts the observation
        let answer = Ok(tollgate_wire::DecideResponse::allow("acme", "k", "pro"));
        lease::on_answer(h, &mut lease::Shares::default(), &key, &answer, None, false, now, false, lease::Gens::default());
    };
    h.now_ms = first_ms;
    assert_eq!(lease::spend(&mut h, &key, &c, first_ms, 0), Spend::Miss { want: 0, recorded: false });
    allow(&mut h, first_ms + answer_ms);
    for now in burst_ms..burst_ms + burst_len_ms {
        h.now_ms = now;
        // answers due now
        let (due, rest): (Vec<Call>, Vec<Call>) = calls.drain(..).partition(|x| x.at <= now);
        calls = rest;
        for x in due {
            if x.want > 0 {
                let grant = Lease { units: x.want, ttl_ms: TTL_MS, response_headers: Vec::new() };
                lease::store_grant(&mut h, &key, identity.clone(), &grant, x.sent, now, x.renewal, 0);
            } else {
                allow(&mut h, now);
            }
        }
        if now % TICK_MS == 0 {
            if let Some(want) = queued.take() {
                out.renewals += 1;
                calls.push(Call { at: now + answer_ms, want, sent: now, renewal: true });
            }
        }
        for _ in 0..per_ms {
            let late = now >= burst_ms + 1_000;
            match lease::spend_from(&mut h, &mut held, &key, &c, now, 0) {
                Spend::Hit { renew, .. } => {
                    out.hits += 1;
                    out.late_hits += late as u64;
                    if let Some(want) = renew {
                        queued.get_or_insert(want);
                    }
                }
                Spend::Miss { want, .. } => {
                    out.misses += 1;
                    out.late_misses += late as u64;
                    out.asks += (want > 0) as u64;
                    calls.push(Call { at: now + answer_ms, want, sent: now, renewal: false });
                }
            }
        }
    }
    out
}

#[test]
fn a_key_idle_before_a_burst_recovers_its_leases_like_a_fresh_one() {
    for answer_ms in [1, 10] {
        let fresh = simulate(40_000, 40_000, 3, 5_000, answer_ms, false);
        let idle = simulate(0, 40_000, 3, 5_000, answer_ms, false);
        println!("answers in {answer_ms} ms, fresh: {fresh:?} late hit rate {:.4}", fresh.late_hit_rate());
        println!("answers in {answer_ms} ms, idle:  {idle:?} late hit rate {:.4}", idle.late_hit_rate());
        assert!(fresh.late_hit_rate() >= 0.95, "fresh: {fresh:?}");
        assert!(idle.late_hit_rate() >= 0.95, "idle 40 s then busy: {idle:?}");
        assert!(idle.hits as f64 >= 0.95 * (idle.hits + idle.misses) as f64, "idle: {idle:?}");
    }
}

#[test]
fn a_worker_spending_from_its_share_keeps_the_hit_rate_and_renews_as_often() {
    for answer_ms in [1, 10] {
        // the harder case: a key seen once, 40 s before its burst
        let record = simulate(0, 40_000, 3, 5_000, answer_ms, false);
        let shared = simulate(0, 40_000, 3, 5_000, answer_ms, true);
        println!("answers in {answer_ms} ms, record only: {record:?}");
        println!("answers in {answer_ms} ms, with shares: {shared:?} late hit rate {:.4}", shared.late_hit_rate());
        assert!(shared.late_hit_rate() >= 0.95, "with shares: {shared:?}");
        // renewals are considered only when a spend reaches the record (every ~20 ms of the
        // rate): they still come, and not in a storm
        assert!(shared.renewals > 0 && shared.renewals <= 2 * record.renewals.max(1), "{shared:?} against {record:?}");
    }
}
