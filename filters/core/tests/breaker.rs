#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The circuit breakers through a mock host: the state machine, CAS updates under contention,
//! the per-request guard (admission, fallback, outcome classification) and the hint poller
//! (lease election, reports, fast-open only). Runs natively and under wasm-bindgen-test.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::rc::Rc;
use tollgate_filter_core::breaker::{self, Admission, HintEffect, Outcome, Phase, Policy, State, Transition, UpdateError};
use tollgate_filter_core::breaker::guard::{BreakerGuard, CLUSTER_HEADER, TARGET_HEADER};
use tollgate_filter_core::breaker::hints::HintPoller;
use tollgate_filter_core::jobs::Job;
use tollgate_filter_core::shared_keys::{self, HINTS_POLLER};
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::{Action, Host};
use tollgate_filter_core::mock::MockHost;
use tollgate_wire::breaker::{Hint, HintList, HintReport};

fn policy() -> Policy {
    Policy {
        consecutive_failures: 3,
        failure_ratio_permille: 0,
        window_ms: 10_000,
        min_requests: 1,
        open_ms: 1_000,
        half_open_trials: 1,
        trial_timeout_ms: 5_000,
    }
}

#[test]
fn opens_after_consecutive_failures_and_rejects_until_the_open_time_is_over() {
    let p = policy();
    let mut s = State::default();
    assert_eq!(s.admit(&p, 0), (Admission::Pass, false, None), "closed admission writes nothing");
    assert_eq!(s.record(&p, 10, None, Outcome::Failure), (true, None));
    assert_eq!(s.record(&p, 20, None, Outcome::Success), (true, None), "a success resets the run");
    assert_eq!(s.record(&p, 30, None, Outcome::Failure), (true, None));
    assert_eq!(s.record(&p, 40, None, Outcome::Failure), (true, None));
    assert_eq!(s.record(&p, 50, None, Outcome::Failure), (true, Some(Transition::Opened)));
    assert_eq!(s.phase, Phase::Open { until_ms: 1_050 });
    assert_eq!(s.publish, 50, "a local open is to be reported");
    assert_eq!(s.admit(&p, 600).0, Admission::Reject { retry_after_ms: 450 });
    assert_eq!(s.admit(&p, 1_049).0, Admission::Reject { retry_after_ms: 1 });
    // Late results of requests admitted before the open are no evidence.
    assert_eq!(s.record(&p, 700, None, Outcome::Success), (false, None));
    assert_eq!(s.phase, Phase::Open { until_ms: 1_050 });
}

#[test]
fn half_open_bounds_trials_success_closes_failure_reopens() {
    let p = Policy { half_open_trials: 2, ..policy() };
    let mut s = State::default();
    for t in 0..3 {
        s.record(&p, t, None, Outcome::Failure);
    }
    assert_eq!(s.admit(&p, 1_002), (Admission::Trial, true, Some(Transition::HalfOpened)));
    assert_eq!(s.admit(&p, 1_003), (Admission::Trial, true, None));
    assert_eq!(s.admit(&p, 1_004).0, Admission::Reject { retry_after_ms: 1_000 }, "third trial over the bound");
    // A non-trial result does not decide.
    assert_eq!(s.record(&p, 1_005, None, Outcome::Success), (false, None));
    // A failed trial re-opens for another full period.
    assert_eq!(s.record(&p, 1_010, Some(1_002), Outcome::Failure), (true, Some(Transition::Reopened)));
    assert_eq!(s.phase, Phase::Open { until_ms: 2_010 });
    assert_eq!(s.publish, 1_010);
    // Then a successful trial closes.
    assert_eq!(s.admit(&p, 2_010).0, Admission::Trial);
    assert_eq!(s.record(&p, 2_020, Some(2_010), Outcome::Success), (true, Some(Transition::Closed)));
    assert_eq!(s.phase, Phase::Closed);
    assert_eq!(s.consecutive, 0);
}

#[test]
fn lost_trials_free_their_slot_by_release_or_timeout() {
    let p = policy();
    let mut s = State::with_phase(Phase::Open { until_ms: 0 });
    assert_eq!(s.admit(&p, 10).0, Admission::Trial);
    assert!(matches!(s.admit(&p, 11).0, Admission::Reject { .. }));
    assert!(s.release_trial(10));
    assert_eq!(s.admit(&p, 12).0, Admission::Trial);
    // Never released: after trial_timeout the slot is given again.
    assert!(matches!(s.admit(&p, 4_000).0, Admission::Reject { .. }));
    assert_eq!(s.admit(&p, 5_012), (Admission::Trial, true, None));
}

/// A trial's release and result count only in its own half-open period. Before, the trial
/// timeout ran from the period's start, not the trial's, and a stale trial's release freed a
/// slot a newer trial held: a client dropping its own requests kept several trials in flight on
/// a failing upstream (`halfOpenTrials` 1), and a late result decided a later period.
#[test]
fn trials_of_an_earlier_half_open_period_neither_free_slots_nor_decide() {
    let p = Policy { trial_timeout_ms: 10_000, ..policy() };
    let mut s = State::with_phase(Phase::Open { until_ms: 0 });
    assert_eq!(s.admit(&p, 0).0, Admission::Trial);
    let a = s.trial_period().unwrap();
    assert!(s.release_trial(a), "A's client left at 9 s");
    assert_eq!(s.admit(&p, 9_500).0, Admission::Trial);
    let b = s.trial_period().unwrap();
    assert_eq!(b, 9_500, "with none in flight, B starts the period again");
    assert!(matches!(s.admit(&p, 10_000).0, Admission::Reject { .. }), "B is 0.5 s old: its slot is not overdue");
    assert!(!s.release_trial(a), "A's slot was given back already");
    // B overdue: C takes the slot in a new period; B's late release frees nothing of it
    assert_eq!(s.admit(&p, 19_500).0, Admission::Trial);
    let c = s.trial_period().unwrap();
    assert!(!s.release_trial(b));
    assert!(matches!(s.admit(&p, 19_600).0, Admission::Reject { .. }), "D waits: C is in flight");
    // B's late failure does not re-open C's period; C's success closes it
    assert_eq!(s.record(&p, 19_700, Some(b), Outcome::Failure), (false, None));
    assert_eq!(s.record(&p, 19_800, Some(c), Outcome::Success), (true, Some(Transition::Closed)));
}

#[test]
fn failure_ratio_over_the_window_needs_the_minimum_count() {
    let p = Policy { consecutive_failures: 0, failure_ratio_permille: 500, min_requests: 10, window_ms: 1_000, ..policy() };
    let mut s = State::default();
    // 4 failures, 5 successes, interleaved: ratio 0.44, then the 10th result a failure: 0.5.
    for i in 0..9u64 {
        let o = if i % 2 == 0 { Outcome::Success } else { Outcome::Failure };
        assert_eq!(s.record(&p, 100 + i, None, o).1, None);
    }
    assert_eq!(s.window(&p, 108), (5, 4));
    assert_eq!(s.record(&p, 109, None, Outcome::Failure).1, Some(Transition::Opened));

    // Old results leave the window: 9 failures long ago do not count now.
    let mut s = State::default();
    for i in 0..9 {
        s.record(&p, i, None, Outcome::Failure);
    }
    assert_eq!(s.window(&p, 5_000), (0, 0));
    assert_eq!(s.record(&p, 5_000, None, Outcome::Failure).1, None);
}

#[test]
fn state_encoding_round_trips_and_rejects_garbage() {
    let p = policy();
    let mut s = State::default();
    s.record(&p, 12_345, None, Outcome::Failure);
    s.hint_seen = 77;
    for phase in [Phase::Closed, Phase::Open { until_ms: u64::MAX }, Phase::HalfOpen { since_ms: 9, in_flight: 3 }] {
        s.phase = phase;
        let bytes = s.encode();
        assert_eq!(bytes.len(), breaker::ENCODED_LEN);
        assert_eq!(State::decode(&bytes), Some(s.clone()));
    }
    assert_eq!(State::decode(b""), None);
    assert_eq!(State::decode(&[9; breaker::ENCODED_LEN]), None);
    let mut bad_tag = s.encode();
    bad_tag[1] = 7;
    assert_eq!(State::decode(&bad_tag), None);
}

#[test]
fn hints_only_ever_open_a_closed_breaker_once() {
    let p = policy();
    let fp = breaker::hint_fingerprint("replica-a", 1_000);
    assert_ne!(fp, breaker::hint_fingerprint("replica-b", 1_000));
    assert_ne!(fp, breaker::hint_fingerprint("replica-a", 1_001));

    // Closed: opens for this replica's own open time.
    let mut s = State::default();
    assert_eq!(s.apply_hint(&p, 500, fp), (HintEffect::Opened, true));
    assert_eq!(s.phase, Phase::Open { until_ms: 1_500 });
    assert_eq!(s.publish, 0, "a hint-driven open is not reported back");
    assert_eq!(s.apply_hint(&p, 600, fp), (HintEffect::Known, false));

    // Open: a new hint neither shortens nor extends; half-open: it does not close or re-open.
    let mut s = State::with_phase(Phase::Open { until_ms: 9_000 });
    assert_eq!(s.apply_hint(&p, 100, fp), (HintEffect::Ignored, true));
    assert_eq!(s.phase, Phase::Open { until_ms: 9_000 });
    let mut s = State::with_phase(Phase::HalfOpen { since_ms: 5, in_flight: 1 });
    assert_eq!(s.apply_hint(&p, 100, fp).0, HintEffect::Ignored);
    assert_eq!(s.phase, Phase::HalfOpen { since_ms: 5, in_flight: 1 });
    // The breaker closes on its own trial; the same hint, still live, does not re-open it.
    assert_eq!(s.record(&p, 200, Some(5), Outcome::Success).1, Some(Transition::Closed));
    assert_eq!(s.apply_hint(&p, 300, fp), (HintEffect::Known, false));
    assert_eq!(s.phase, Phase::Closed);
    // A newer hint (a new open elsewhere) does.
    assert_eq!(s.apply_hint(&p, 400, breaker::hint_fingerprint("replica-a", 350)).0, HintEffect::Opened);
}

#[test]
fn updates_retry_on_cas_mismatch_and_give_up_when_always_contended() {
    let key = shared_keys::breaker("t");
    let mut host = MockHost::new();
    breaker::init(&mut host, &key);
    let p = policy();
    // Another worker records two failures between our read and our write.
    let mut other = State::default();
    other.record(&p, 1, None, Outcome::Failure);
    other.record(&p, 2, None, Outcome::Failure);
    host.interfere.push((key.as_str().to_string(), other.encode()));
    let mut attempts = 0;
    let t = breaker::update(&mut host, &key, |s| {
        attempts += 1;
        let (changed, t) = s.record(&p, 3, None, Outcome::Failure);
        (t, changed)
    })
    .unwrap();
    assert_eq!(attempts, 2, "recomputed on the fresh state");
    assert_eq!(t, Some(Transition::Opened), "the other worker's failures counted");

    // Always contended: bounded.
    let mut host = MockHost::new();
    breaker::init(&mut host, &key);
    for _ in 0..breaker::MAX_CAS_ATTEMPTS {
        host.interfere.push((key.as_str().to_string(), State::default().encode()));
    }
    let r = breaker::update(&mut host, &key, |s| ((), s.record(&p, 3, None, Outcome::Failure).0));
    assert_eq!(r, Err(UpdateError::Contended));

    // init never overwrites.
    let mut host = MockHost::new();
    host.shared_set(key.as_str(), &other.encode());
    breaker::init(&mut host, &key);
    assert_eq!(breaker::read(&host, &key).consecutive, 2);
}

// ---- the guard ----

const CONFIG: &str = r#"{"breakers":{"consecutiveFailures":2,"openFor":"1s","halfOpenTrials":1,
  "hints":{"pollInterval":"100ms"},
  "targets":[{"name":"llm-a","cluster":"cluster_a","provider":"prov","model":"m1","fallback":["llm-b"]},
             {"name":"llm-b","cluster":"cluster_b"},
             {"name":"solo","cluster":"cluster_s"}]}}"#;

fn config() -> Rc<FilterConfig> {
    Rc::new(FilterConfig::parse(CONFIG.as_bytes()).unwrap())
}

/// One request through the guard on `host`'s shared data, answered with `status`/`details`.
fn request(shared: &MockHost, cluster: &str, status: u16, details: &str) -> (MockHost, Action) {
    let mut h = MockHost::next_request(shared).with_property("xds.cluster_name", cluster);
    let mut g = BreakerGuard::new(config().breakers.clone());
    let a = g.on_request(&mut h);
    if a == Action::Continue {
        h.upstream_response.push((":status".into(), status.to_string().into_bytes()));
        h.properties.insert("response.code_details".into(), details.as_bytes().to_vec());
        g.on_response(&mut h);
    }
    g.on_done(&mut h);
    (h, a)
}

#[test]
fn guard_opens_on_failures_then_replies_503_with_retry_after_without_sending() {
    let mut h = MockHost::new();
    h.now_ms = 10_000;
    let (h1, a) = request(&h, "cluster_s", 500, "via_upstream");
    assert_eq!(a, Action::Continue);
    assert_eq!(h1.response_headers, vec![(TARGET_HEADER.to_string(), "solo".to_string())]);
    let (h2, _) = request(&h1, "cluster_s", 502, "via_upstream");
    assert_eq!(h2.named("tollgate.breaker.solo.opened"), 1);
    assert!(h2.logs.iter().any(|(_, l)| l.contains("breaker solo opened")));

    let mut h3 = MockHost::next_request(&h2).with_property("xds.cluster_name", "cluster_s");
    h3.now_ms = 10_400;
    let mut g = BreakerGuard::new(config().breakers.clone());
    assert_eq!(g.on_request(&mut h3), Action::Pause);
    let reply = h3.reply.clone().unwrap();
    assert_eq!(reply.status, 503);
    assert!(reply.headers.contains(&("retry-after".into(), "1".into())));
    assert!(String::from_utf8_lossy(&reply.body).contains("upstream_unavailable"));
    assert_eq!(h3.named("tollgate.breaker.solo.rejected"), 1);
    assert!(h3.logs.is_empty(), "no log line per rejected request");
}

#[test]
fn envoy_local_replies_count_as_failures_and_4xx_do_not() {
    let b = &config().breakers;
    use tollgate_filter_core::breaker::guard::classify;
    assert_eq!(classify(b, Some(503), Some("upstream_reset_before_response_started{connection_failure}")), Outcome::Failure);
    assert_eq!(classify(b, Some(504), Some("upstream_response_timeout")), Outcome::Failure);
    assert_eq!(classify(b, Some(500), Some("via_upstream")), Outcome::Failure);
    assert_eq!(classify(b, Some(404), Some("via_upstream")), Outcome::Success);
    assert_eq!(classify(b, Some(429), Some("via_upstream")), Outcome::Success);
    assert_eq!(classify(b, None, None), Outcome::Failure);
    let only_502 = FilterConfig::parse(br#"{"breakers":{"failureStatuses":["502"],"failOn429":true}}"#).unwrap();
    assert_eq!(classify(&only_502.breakers, Some(500), Some("via_upstream")), Outcome::Success);
    assert_eq!(classify(&only_502.breakers, Some(429), Some("via_upstream")), Outcome::Failure);
    // A local reply is a failure whatever the configured set says.
    assert_eq!(classify(&only_502.breakers, Some(503), Some("upstream_reset_before_response_started{remote_reset}")), Outcome::Failure);
}

/// Decision 203: a route naming a breaker target the filter lacks is guarded by its cluster's.
#[test]
fn a_route_naming_an_unknown_breaker_is_guarded_by_its_clusters_target() {
    let route: tollgate_wire::routes::RouteSpec = serde_json::from_value(serde_json::json!({"id": "r", "cluster": "cluster_s", "breaker": "nope"})).unwrap();
    let (mut h, mut g) = (MockHost::new(), BreakerGuard::new(config().breakers.clone()));
    assert_eq!(g.on_request_routed(&mut h, Some(&route)), Action::Continue);
    h.upstream_response.push((":status".into(), b"500".to_vec()));
    h.properties.insert("response.code_details".into(), b"via_upstream".to_vec());
    g.on_response(&mut h);
    assert_eq!(h.response_headers, vec![(TARGET_HEADER.to_string(), "solo".to_string())], "guarded by cluster_s's target");
}

#[test]
fn unguarded_clusters_and_missing_properties_pass_untouched() {
    for h in [MockHost::new().with_property("xds.cluster_name", "other"), MockHost::new()] {
        let mut h = h;
        let mut g = BreakerGuard::new(config().breakers.clone());
        assert_eq!(g.on_request(&mut h), Action::Continue);
        g.on_response(&mut h);
        assert!(h.shared.is_empty() && h.response_headers.is_empty());
    }
}

#[test]
fn while_open_the_fallback_target_serves_and_says_so() {
    let mut h = MockHost::new();
    h.now_ms = 1_000;
    let (h, _) = request(&h, "cluster_a", 500, "via_upstream");
    let (h, _) = request(&h, "cluster_a", 500, "via_upstream");
    assert_eq!(h.named("tollgate.breaker.llm-a.opened"), 1);

    let mut f = MockHost::next_request(&h).with_property("xds.cluster_name", "cluster_a");
    let mut g = BreakerGuard::new(config().breakers.clone());
    assert_eq!(g.on_request(&mut f), Action::Continue);
    assert_eq!(f.header(CLUSTER_HEADER), Some("cluster_b"));
    assert_eq!(f.named("tollgate.breaker.llm-a.fallback"), 1);
    f.upstream_response.push((":status".into(), "200".into()));
    g.on_response(&mut f);
    assert_eq!(f.response_headers, vec![(TARGET_HEADER.to_string(), "llm-b".to_string())]);
    // The result is llm-b's, not llm-a's.
    assert_eq!(breaker::read(&f, &shared_keys::breaker("llm-a")).phase, Phase::Open { until_ms: 2_000 });
}

#[test]
fn the_trial_bound_holds_across_workers_sharing_the_state() {
    let h = MockHost::new();
    let (h, _) = request(&h, "cluster_s", 500, "via_upstream");
    let (mut h, _) = request(&h, "cluster_s", 500, "via_upstream");
    h.now_ms = 5_000; // open time over
    // Worker 1 takes the trial; worker 2 (same shared data) is refused while it is in flight.
    let mut w1 = MockHost::next_request(&h).with_property("xds.cluster_name", "cluster_s");
    let mut g1 = BreakerGuard::new(config().breakers.clone());
    assert_eq!(g1.on_request(&mut w1), Action::Continue);
    assert_eq!(w1.named("tollgate.breaker.solo.half_opened"), 1);
    let mut w2 = MockHost::next_request(&w1).with_property("xds.cluster_name", "cluster_s");
    let mut g2 = BreakerGuard::new(config().breakers.clone());
    assert_eq!(g2.on_request(&mut w2), Action::Pause);
    assert_eq!(w2.reply.as_ref().unwrap().status, 503);
    // The trial succeeds: closed for everyone.
    w1.upstream_response.push((":status".into(), "204".into()));
    g1.on_response(&mut w1);
    assert_eq!(w1.named("tollgate.breaker.solo.closed"), 1);
    let (_, a) = request(&w1, "cluster_s", 200, "via_upstream");
    assert_eq!(a, Action::Continue);
}

#[test]
fn a_trial_without_response_headers_gives_its_slot_back() {
    let mut h = MockHost::new();
    h.shared_set(shared_keys::breaker("solo").as_str(), &State::with_phase(Phase::Open { until_ms: 0 }).encode());
    h.now_ms = 10;
    let mut w = MockHost::next_request(&h).with_property("xds.cluster_name", "cluster_s");
    let mut g = BreakerGuard::new(config().breakers.clone());
    assert_eq!(g.on_request(&mut w), Action::Continue);
    assert_eq!(breaker::read(&w, &shared_keys::breaker("solo")).phase, Phase::HalfOpen { since_ms: 10, in_flight: 1 });
    g.on_done(&mut w);
    assert_eq!(breaker::read(&w, &shared_keys::breaker("solo")).phase, Phase::HalfOpen { since_ms: 10, in_flight: 0 });
}

// ---- the hint poller ----

#[test]
fn one_root_context_holds_the_lease_until_it_expires() {
    let mut h = MockHost::new();
    h.now_ms = 1_000;
    let a = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 1);
    let b = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 2);
    assert!(a.hold_lease(&mut h, 1_000));
    assert!(!b.hold_lease(&mut h, 1_050));
    assert!(a.hold_lease(&mut h, 1_100), "the holder renews");
    assert!(!b.hold_lease(&mut h, 1_900));
    assert!(b.hold_lease(&mut h, 2_101), "expired (4 x 100ms, at least 1s): taken over");
    assert!(!a.hold_lease(&mut h, 2_200));
    assert_eq!(h.shared.get(HINTS_POLLER.as_str()).map(Vec::len), Some(16));
}

#[test]
fn the_lease_holder_reports_local_opens_and_asks_for_hints() {
    let mut h = MockHost::new();
    h.now_ms = 1_000;
    let (mut h, _) = request(&h, "cluster_a", 500, "via_upstream");
    let (h2, _) = request(&h, "cluster_a", 500, "via_upstream");
    h = h2;
    h.calls.clear();
    let mut p = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 7);
    p.on_tick(&mut h);
    assert_eq!(h.calls.len(), 2, "one report, one list");
    let post = &h.calls[0];
    assert!(post.headers.contains(&(":method".into(), "POST".into())));
    assert!(post.headers.contains(&(":path".into(), "/v1/breaker/hints".into())));
    let report: HintReport = serde_json::from_slice(&post.body).unwrap();
    assert_eq!(report, HintReport { provider: "prov".into(), model: "m1".into(), opened_at_ms: 1_000 });
    assert!(h.calls[1].headers.contains(&(":method".into(), "GET".into())));
    // Reported once only; the list call is not repeated while one is outstanding.
    p.on_tick(&mut h);
    assert_eq!(h.calls.len(), 2);
    // A non-holder does nothing.
    let mut other = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 8);
    other.on_tick(&mut h);
    assert_eq!(h.calls.len(), 2);
}

#[test]
fn listed_hints_open_only_closed_matching_breakers() {
    let mut h = MockHost::new();
    h.now_ms = 50_000;
    let mut p = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 7);
    p.on_tick(&mut h);
    let list_token = h.calls.len() as u32;
    let list = HintList {
        hints: vec![
            Hint { provider: "prov".into(), model: "m1".into(), replica: "r2".into(), opened_at_ms: 49_000 },
            Hint { provider: "prov".into(), model: "other".into(), replica: "r2".into(), opened_at_ms: 49_000 },
        ],
    };
    p.on_call_response(&mut h, 999, Some(200), &serde_json::to_vec(&list).unwrap());
    assert_eq!(h.named("tollgate.breaker.llm-a.opened_by_hint"), 0, "unexpected token ignored");
    p.on_call_response(&mut h, list_token, Some(200), &serde_json::to_vec(&list).unwrap());
    assert_eq!(h.named("tollgate.breaker.llm-a.opened_by_hint"), 1);
    assert_eq!(breaker::read(&h, &shared_keys::breaker("llm-a")).phase, Phase::Open { until_ms: 51_000 });
    assert_eq!(breaker::read(&h, &shared_keys::breaker("llm-b")).phase, Phase::Closed);
    // The same hint again changes nothing (open time not extended).
    h.now_ms = 50_500;
    p.apply(&mut h, &list);
    assert_eq!(breaker::read(&h, &shared_keys::breaker("llm-a")).phase, Phase::Open { until_ms: 51_000 });
    assert_eq!(h.named("tollgate.breaker.llm-a.opened_by_hint"), 1);
}

#[test]
fn sidecar_trouble_is_logged_once_per_transition() {
    let mut h = MockHost::new();
    let mut p = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 7);
    for _ in 0..3 {
        p.on_tick(&mut h);
        let t = h.calls.len() as u32;
        p.on_call_response(&mut h, t, Some(503), b"");
    }
    assert_eq!(h.logs.iter().filter(|(_, l)| l.contains("not shared")).count(), 1);
    p.on_tick(&mut h);
    let t = h.calls.len() as u32;
    p.on_call_response(&mut h, t, Some(200), br#"{"hints":[]}"#);
    assert_eq!(h.logs.iter().filter(|(_, l)| l.contains("answers again")).count(), 1);
}

#[test]
fn clean_successes_are_tallied_per_worker_and_written_on_the_tick_or_with_a_failure() {
    use std::cell::RefCell;
    use tollgate_filter_core::breaker::local::WorkerBreakers;
    let config = Rc::new(
        FilterConfig::parse(
            br#"{"breakers":{"consecutiveFailures":2,"failureRatio":0.5,"minRequests":4,"window":"10s","openFor":"1s",
                 "targets":[{"name":"solo","cluster":"cluster_s"}]}}"#,
        )
        .unwrap(),
    );
    let key = shared_keys::breaker("solo");
    let tally: Rc<RefCell<WorkerBreakers>> = Rc::default();
    let mut shared = MockHost::new();
    shared.now_ms = 10_000;
    breaker::init(&mut shared, &key);
    let other_worker: Rc<RefCell<WorkerBreakers>> = Rc::default();
    let run_on = |shared: &mut MockHost, tally: &Rc<RefCell<WorkerBreakers>>, status: u16| {
        let mut h = MockHost::next_request(shared).with_property("xds.cluster_name", "cluster_s");
        let mut g = BreakerGuard::new(config.breakers.clone()).with_worker(tally.clone());
        assert_eq!(g.on_request(&mut h), Action::Continue);
        h.upstream_response.push((":status".into(), status.to_string().into_bytes()));
        h.properties.insert("response.code_details".into(), b"via_upstream".to_vec());
        g.on_response(&mut h);
        assert!(h.response_headers.contains(&(TARGET_HEADER.to_string(), "solo".to_string())));
        g.on_done(&mut h);
        shared.shared = h.shared.clone();
        let writes = h.cas.get(key.as_str()).copied().unwrap_or(0) - shared.cas.get(key.as_str()).copied().unwrap_or(0);
        shared.cas = h.cas.clone();
        writes
    };
    let run = |shared: &mut MockHost, status: u16| run_on(shared, &tally, status);
    let window = |shared: &MockHost| breaker::read(shared, &key).window(&config.breakers.policy, 10_000);

    // three healthy requests: no shared write, tallied by the worker
    for _ in 0..3 {
        assert_eq!(run(&mut shared, 200), 0, "a clean success writes nothing");
    }
    assert_eq!((tally.borrow().pending(), window(&shared)), (3, (0, 0)));
    // the tick writes them (one write)
    tally.borrow_mut().on_tick(&mut shared, &config.breakers);
    assert_eq!((tally.borrow().pending(), window(&shared)), (0, (3, 0)));

    // two more successes, then a failure: written with the failure, so the ratio sees them
    // (1 of 6 failed, under 50%: still closed)
    run(&mut shared, 200);
    run(&mut shared, 200);
    assert_eq!(run(&mut shared, 503), 1, "a failure is written at once");
    assert_eq!((tally.borrow().pending(), window(&shared)), (0, (5, 1)));
    assert_eq!(breaker::read(&shared, &key).consecutive, 1);
    // during a failure streak a success is written at once: it ends the streak
    assert_eq!(run(&mut shared, 200), 1);
    assert_eq!(breaker::read(&shared, &key).consecutive, 0);
    assert_eq!(window(&shared), (6, 1));
    // this worker tallies a success; another worker's two failures in a row open the breaker
    assert_eq!(run(&mut shared, 200), 0);
    run_on(&mut shared, &other_worker, 503);
    run_on(&mut shared, &other_worker, 503);
    assert!(matches!(breaker::read(&shared, &key).phase, Phase::Open { .. }));
    // successes tallied before it opened are not evidence about the open period: dropped
    let before = breaker::read(&shared, &key);
    tally.borrow_mut().on_tick(&mut shared, &config.breakers);
    assert_eq!(tally.borrow().pending(), 0);
    assert_eq!(breaker::read(&shared, &key), before);
}

#[test]
fn tallied_successes_land_in_the_bucket_of_the_tick() {
    let p = Policy { failure_ratio_permille: 500, min_requests: 4, ..policy() };
    let mut s = State::default();
    assert!(s.add_successes(&p, 5_000, 7));
    assert!(!s.add_successes(&p, 5_000, 0), "nothing to add");
    assert_eq!(s.window(&p, 5_000), (7, 0));
    assert_eq!(s.window(&p, 5_000 + p.window_ms), (0, 0), "out of the window later");
    s.record(&p, 5_100, None, Outcome::Failure);
    assert!(s.add_successes(&p, 5_200, 1));
    assert_eq!(s.consecutive, 1, "tallied successes leave the streak alone");
    s.phase = Phase::Open { until_ms: 9_000 };
    assert!(!s.add_successes(&p, 5_300, 3), "not while open");
}

#[test]
fn a_worker_admits_on_a_clean_breaker_without_reading_and_sees_another_workers_open_at_its_tick() {
    use std::cell::RefCell;
    use tollgate_filter_core::breaker::local::WorkerBreakers;
    let config = config();
    let key = shared_keys::breaker("solo");
    let mut shared = MockHost::new();
    shared.now_ms = 10_000;
    breaker::init(&mut shared, &key);
    let (ours, theirs): (Rc<RefCell<WorkerBreakers>>, Rc<RefCell<WorkerBreakers>>) = (Rc::default(), Rc::default());
    let run = |shared: &mut MockHost, worker: &Rc<RefCell<WorkerBreakers>>, status: u16| -> Action {
        let mut h = MockHost::next_request(shared).with_property("xds.cluster_name", "cluster_s");
        let mut g = BreakerGuard::new(config.breakers.clone()).with_worker(worker.clone());
        let a = g.on_request(&mut h);
        if a == Action::Continue {
            h.upstream_response.push((":status".into(), status.to_string().into_bytes()));
            h.properties.insert("response.code_details".into(), b"via_upstream".to_vec());
            g.on_response(&mut h);
        }
        g.on_done(&mut h);
        shared.shared = h.shared.clone();
        shared.cas = h.cas.clone();
        a
    };
    // our worker reads once (unknown), then knows the target clean
    assert_eq!(run(&mut shared, &ours, 200), Action::Continue);
    // another worker's failures open it (2 in a row)
    run(&mut shared, &theirs, 503);
    run(&mut shared, &theirs, 503);
    assert!(matches!(breaker::read(&shared, &key).phase, Phase::Open { .. }));
    assert_eq!(run(&mut shared, &theirs, 200), Action::Pause, "the worker that opened it rejects at once");
    // ours admits without reading until its tick (at most one tick late) ...
    assert_eq!(run(&mut shared, &ours, 200), Action::Continue);
    // ... then its tick looks again, and it rejects too; its tallied successes are dropped
    ours.borrow_mut().on_tick(&mut shared, &config.breakers);
    assert_eq!(ours.borrow().pending(), 0);
    assert_eq!(run(&mut shared, &ours, 200), Action::Pause);
    // a clean target left unused for a tick is forgotten: the next admission reads
    shared.now_ms += 2_000; // open time over: the next admission is a trial, which closes it
    assert_eq!(run(&mut shared, &ours, 200), Action::Continue);
    assert_eq!(breaker::read(&shared, &key).phase, Phase::Closed);
    ours.borrow_mut().on_tick(&mut shared, &config.breakers); // used since: looked at, clean
    ours.borrow_mut().on_tick(&mut shared, &config.breakers); // unused since: forgotten
    run(&mut shared, &theirs, 503);
    run(&mut shared, &theirs, 503);
    assert_eq!(run(&mut shared, &ours, 200), Action::Pause, "forgotten, so read: open");
}

#[test]
fn a_hint_that_opens_a_target_ends_this_workers_clean_view_at_once() {
    use std::cell::RefCell;
    use tollgate_filter_core::breaker::local::WorkerBreakers;
    let worker: Rc<RefCell<WorkerBreakers>> = Rc::default();
    let mut shared = MockHost::new();
    shared.now_ms = 10_000;
    let admit = |shared: &MockHost| -> MockHost {
        let mut h = MockHost::next_request(shared).with_property("xds.cluster_name", "cluster_a");
        let mut g = BreakerGuard::new(config().breakers.clone()).with_worker(worker.clone());
        assert_eq!(g.on_request(&mut h), Action::Continue);
        h
    };
    // read once: llm-a is clean, known so by this worker
    assert_eq!(admit(&shared).header(CLUSTER_HEADER), None, "its own target");
    let p = HintPoller::new(config().breakers.clone(), config().sidecar.clone(), 7).with_worker(worker.clone());
    let list = HintList { hints: vec![Hint { provider: "prov".into(), model: "m1".into(), replica: "other".into(), opened_at_ms: 9_000 }] };
    p.apply(&mut shared, &list);
    assert!(matches!(breaker::read(&shared, &shared_keys::breaker("llm-a")).phase, Phase::Open { .. }));
    // the very next request reads it (open) and goes to the fallback, no tick needed
    assert_eq!(admit(&shared).header(CLUSTER_HEADER), Some("cluster_b"));
}
