//! Functional tests of the circuit breakers: a real Envoy (V8) with the Tollgate .wasm, the real
//! sidecar binary, a real redis-server, and upstreams that fail on command and count what they
//! see. Every test starts its own processes on its own ports; open times are short and waited
//! for by polling, never by sleeping.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use tollgate_tests::{free_port, get, poll_until, start_flaky, Envoy, EnvoyOptions, IssuedKey, Redis, Resp, Sidecar};

/// Generous for a noisy 2-core machine.
const DEADLINE: Duration = Duration::from_secs(20);

/// A plugin configuration with one guarded target `primary` (cluster `upstream`, hint key
/// `cb:hint:acme:m1`) falling back to `secondary` (cluster `upstream_b`) when `fallback`.
fn plugin(open_for: &str, trials: u32, fallback: bool, extra: &str) -> String {
    let fb = if fallback { r#","fallback":["secondary"]"# } else { "" };
    format!(
        r#"{{"sidecar":{{"timeout":"2s"}},"failureMode":"closed",
        "breakers":{{"consecutiveFailures":3,"failureRatio":0,"openFor":"{open_for}","halfOpenTrials":{trials},
          "trialTimeout":"20s","hints":{{"pollInterval":"100ms"}}{extra},
          "targets":[{{"name":"primary","cluster":"upstream","provider":"acme","model":"m1"{fb}}},
                     {{"name":"secondary","cluster":"upstream_b"}}]}}}}"#
    )
}

struct Replica {
    envoy: Envoy,
    sidecar: Sidecar,
}

impl Replica {
    fn start(redis: &Redis, upstream: u16, fallback: u16, plugin: &str, concurrency: u32, sidecar_env: &[(&str, &str)]) -> Replica {
        let sidecar = Sidecar::start(&redis.url(), sidecar_env);
        let envoy = Envoy::start(EnvoyOptions {
            template: "envoy/breaker.yaml.tmpl",
            vars: vec![("FALLBACK_PORT", fallback.to_string())],
            ..EnvoyOptions::new(upstream, sidecar.port).plugin_config(plugin).concurrency(concurrency)
        });
        Replica { envoy, sidecar }
    }

    fn get(&self, key: &IssuedKey) -> Resp {
        get(&self.envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str())])
    }

    fn stat(&self, event: &str) -> u64 {
        self.envoy.counter(&format!("wasmcustom.tollgate.breaker.primary.{event}"))
    }
}

fn is_breaker_503(r: &Resp) -> bool {
    r.status == 503 && r.header("x-tollgate-breaker") == Some("open")
}

/// Sends failing requests until the breaker opens (exactly `n` expected).
fn trip(r: &Replica, key: &IssuedKey, n: usize, status: u16) {
    for i in 0..n {
        let resp = r.get(key);
        assert_eq!(resp.status, status, "request {i} before the breaker opened: {}", resp.body);
        assert_eq!(resp.header("x-tollgate-target"), Some("primary"));
    }
    assert_eq!(r.stat("opened"), 1, "the breaker did not open after {n} failures");
}

/// Polls requests until one is not rejected by the breaker; returns it and when it came.
fn first_admitted(r: &Replica, key: &IssuedKey) -> (Resp, Instant) {
    let mut found = None;
    poll_until("a request admitted by the breaker", DEADLINE, || {
        let resp = r.get(key);
        if is_breaker_503(&resp) {
            return false;
        }
        found = Some((resp, Instant::now()));
        true
    });
    found.expect("polled")
}

fn hint_exists(redis: &Redis) -> bool {
    let mut c = redis.connection().expect("redis");
    redis::cmd("EXISTS").arg("cb:hint:acme:m1").query::<i64>(&mut c).expect("EXISTS") == 1
}

#[test]
fn opens_after_the_threshold_then_replies_503_fast_without_upstream_traffic() {
    let redis = Redis::start();
    let up = start_flaky("a");
    let r = Replica::start(&redis, up.port, free_port(), &plugin("30s", 1, false, ""), 1, &[]);
    let key = r.sidecar.create_key("acme", "gold", &[]);

    // Healthy: served, and the response names the target.
    let ok = r.get(&key);
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.header("x-tollgate-target"), Some("primary"));

    up.fail_with(500);
    trip(&r, &key, 3, 500);
    let seen = up.seen();
    assert_eq!(seen, 4);

    for _ in 0..10 {
        let resp = r.get(&key);
        assert!(is_breaker_503(&resp), "expected the breaker's 503: {} {}", resp.status, resp.body);
        assert_eq!(resp.json()["error"], "upstream_unavailable");
        assert_eq!(resp.header("content-type"), Some("application/json"));
        let retry_after: u64 = resp.header("retry-after").expect("Retry-After").parse().expect("seconds");
        assert!((1..=30).contains(&retry_after), "Retry-After {retry_after}");
    }
    assert_eq!(up.seen(), seen, "the upstream saw traffic while the breaker was open");
    assert_eq!(r.stat("rejected"), 10);
    // Transitions are logged, requests are not.
    let log = r.envoy.log_text();
    assert_eq!(log.matches("tollgate: breaker primary opened").count(), 1, "{log}");
    assert!(!log.contains("breaker primary rejected"));
}

#[test]
fn a_failed_trial_reopens_and_a_successful_trial_closes() {
    let redis = Redis::start();
    let up = start_flaky("a");
    let r = Replica::start(&redis, up.port, free_port(), &plugin("1s", 1, false, ""), 1, &[]);
    let key = r.sidecar.create_key("acme", "gold", &[]);
    up.fail_with(503);
    trip(&r, &key, 3, 503);

    // Still failing: the first request after the open time is a trial; it fails and re-opens.
    let (trial, _) = first_admitted(&r, &key);
    assert_eq!(trial.status, 503, "{}", trial.body);
    assert_eq!(trial.header("x-served-by"), Some("a"));
    assert_eq!((r.stat("half_opened"), r.stat("reopened"), r.stat("closed")), (1, 1, 0));
    assert!(is_breaker_503(&r.get(&key)), "re-opened: rejected again");

    // Healed: the next trial succeeds and closes the breaker for every request after it.
    up.heal();
    let (trial, _) = first_admitted(&r, &key);
    assert_eq!(trial.status, 200, "{}", trial.body);
    assert_eq!((r.stat("half_opened"), r.stat("closed")), (2, 1));
    let before = up.seen();
    for _ in 0..5 {
        assert_eq!(r.get(&key).status, 200);
    }
    assert_eq!(up.seen(), before + 5);
    let log = r.envoy.log_text();
    for t in ["opened", "half_opened", "reopened", "closed"] {
        assert!(log.contains(&format!("tollgate: breaker primary {t}")), "no {t} line");
    }
}

#[test]
fn half_open_trials_are_bounded_across_two_workers() {
    let redis = Redis::start();
    let up = start_flaky("a");
    let r = Replica::start(&redis, up.port, free_port(), &plugin("1s", 1, false, ""), 2, &[]);
    let key = r.sidecar.create_key("acme", "gold", &[]);
    up.fail_with(500);
    trip(&r, &key, 3, 500);
    let opened = Instant::now();
    up.heal();
    up.delay(Duration::from_secs(3));
    let seen = up.seen();
    // The open time (1 s) is over: a clock condition, not readiness.
    poll_until("the open time to pass", DEADLINE, || opened.elapsed() > Duration::from_millis(1_300));

    // 24 concurrent requests on their own connections (spread over both workers by the kernel):
    // only the one trial may reach the upstream while it is in flight.
    let n = 24;
    let barrier = Arc::new(Barrier::new(n));
    let url = r.envoy.url("/v1/chat");
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (barrier, url, raw) = (barrier.clone(), url.clone(), key.raw.clone());
            std::thread::spawn(move || {
                barrier.wait();
                get(&url, &[("x-api-key", raw.as_str())])
            })
        })
        .collect();
    let responses: Vec<Resp> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
    let passed: Vec<&Resp> = responses.iter().filter(|r| !is_breaker_503(r)).collect();
    assert_eq!(up.seen() - seen, 1, "the upstream saw more than the one allowed trial");
    assert_eq!(passed.len(), 1, "statuses: {:?}", responses.iter().map(|r| r.status).collect::<Vec<_>>());
    assert_eq!(passed[0].status, 200);
    assert_eq!(r.stat("half_opened"), 1);
    assert_eq!(r.stat("rejected"), (n - 1) as u64);
    // The trial succeeded: closed for both workers.
    assert_eq!(r.stat("closed"), 1);
    up.delay(Duration::ZERO);
    for _ in 0..4 {
        assert_eq!(r.get(&key).status, 200);
    }
}

#[test]
fn while_open_the_fallback_target_serves_and_the_response_names_it() {
    let redis = Redis::start();
    let a = start_flaky("a");
    let b = start_flaky("b");
    let r = Replica::start(&redis, a.port, b.port, &plugin("30s", 1, true, ""), 1, &[]);
    let key = r.sidecar.create_key("acme", "gold", &[]);

    // A client cannot pick the cluster: the filter strips x-tollgate-* before routing.
    let spoofed = get(&r.envoy.url("/"), &[("x-api-key", key.raw.as_str()), ("x-tollgate-cluster", "upstream_b")]);
    assert_eq!(spoofed.header("x-served-by"), Some("a"), "{:?}", spoofed);
    assert_eq!(spoofed.header("x-tollgate-target"), Some("primary"));

    a.fail_with(502);
    trip(&r, &key, 3, 502);
    let (seen_a, seen_b) = (a.seen(), b.seen());
    for _ in 0..5 {
        let resp = r.get(&key);
        assert_eq!(resp.status, 200, "{}", resp.body);
        assert_eq!(resp.header("x-tollgate-target"), Some("secondary"));
        assert_eq!(resp.header("x-served-by"), Some("b"));
    }
    assert_eq!(a.seen(), seen_a, "the open primary saw traffic");
    assert_eq!(b.seen(), seen_b + 5);
    assert_eq!(r.stat("fallback"), 5);

    // The fallback failing too: nothing left, the breaker's 503.
    b.fail_with(500);
    for _ in 0..3 {
        assert_eq!(r.get(&key).header("x-tollgate-target"), Some("secondary"));
    }
    assert_eq!(r.envoy.counter("wasmcustom.tollgate.breaker.secondary.opened"), 1);
    assert!(is_breaker_503(&r.get(&key)));
}

#[test]
fn connection_failures_count_even_outside_the_failure_statuses() {
    let redis = Redis::start();
    let dead = free_port(); // nothing listens here: Envoy's own 503 (connection failure)
    let r = Replica::start(&redis, dead, free_port(), &plugin("30s", 1, false, r#","failureStatuses":["500"]"#), 1, &[]);
    let key = r.sidecar.create_key("acme", "gold", &[]);
    for _ in 0..3 {
        let resp = r.get(&key);
        assert_eq!(resp.status, 503);
        assert_ne!(resp.header("x-tollgate-breaker"), Some("open"), "Envoy's reply, not the breaker's");
    }
    assert_eq!(r.stat("opened"), 1);
    assert!(is_breaker_503(&r.get(&key)));
}

#[test]
fn replica_b_opens_from_a_hint_before_it_sees_any_failure() {
    let redis = Redis::start();
    let up = start_flaky("shared");
    let a = Replica::start(&redis, up.port, free_port(), &plugin("30s", 1, false, ""), 1, &[]);
    let b = Replica::start(&redis, up.port, free_port(), &plugin("30s", 1, false, ""), 1, &[]);
    let key = a.sidecar.create_key("acme", "gold", &[]);
    up.fail_with(500);
    trip(&a, &key, 3, 500);
    assert_eq!(up.seen(), 3);

    // Propagation: A's poller reports, Redis holds the hint, B's poller applies it.
    let started = Instant::now();
    poll_until("B to open from A's hint", Duration::from_secs(10), || b.stat("opened_by_hint") == 1);
    eprintln!("hint propagation A→B observed after {:?}", started.elapsed());
    assert!(hint_exists(&redis));
    let mut c = redis.connection().expect("redis");
    let ttl: i64 = redis::cmd("TTL").arg("cb:hint:acme:m1").query(&mut c).expect("TTL");
    assert!((1..=30).contains(&ttl), "hint TTL {ttl}");

    let resp = b.get(&key);
    assert!(is_breaker_503(&resp), "{} {}", resp.status, resp.body);
    assert_eq!(up.seen(), 3, "B sent traffic to the failing upstream");
    assert_eq!(b.stat("opened"), 0, "B saw no failure of its own");
    // A does not re-open from its own hint, and B's hint-driven open is not reported back.
    assert_eq!(a.stat("opened_by_hint"), 0);
    assert!(b.envoy.log_text().contains("tollgate: breaker primary opened_by_hint"));
}

#[test]
fn a_live_hint_neither_shortens_b_open_time_nor_keeps_b_from_closing_on_its_own_trial() {
    let redis = Redis::start();
    let up = start_flaky("shared");
    // A re-opens every second while the upstream fails, writing a new hint each time.
    let a = Replica::start(&redis, up.port, free_port(), &plugin("1s", 1, false, ""), 1, &[]);
    let b = Replica::start(&redis, up.port, free_port(), &plugin("4s", 1, false, ""), 1, &[]);
    let key = a.sidecar.create_key("acme", "gold", &[]);
    up.fail_with(500);
    let t0 = Instant::now(); // B cannot open before A: B's open time ends after t0 + 4 s
    trip(&a, &key, 3, 500);
    poll_until("B to open from A's hint", Duration::from_secs(10), || b.stat("opened_by_hint") == 1);

    // A's trial fails and re-opens A: a new hint, which B (open) must ignore.
    let (trial, _) = first_admitted(&a, &key);
    assert_eq!(trial.status, 500);
    assert_eq!(a.stat("reopened"), 1);
    poll_until("B to see A's new hint", Duration::from_secs(10), || b.stat("hint_ignored") >= 1);

    up.heal();
    let (resp, at) = first_admitted(&b, &key);
    assert!(at.duration_since(t0) >= Duration::from_secs(4), "B closed early: {:?} after t0", at.duration_since(t0));
    assert_eq!(resp.status, 200, "B's trial: {}", resp.body);
    assert_eq!(resp.header("x-tollgate-target"), Some("primary"));
    assert_eq!((b.stat("half_opened"), b.stat("closed"), b.stat("opened_by_hint"), b.stat("opened")), (1, 1, 1, 0));

    // The hint is still live (30 s TTL), and B stays closed: a seen hint is not applied again.
    assert!(hint_exists(&redis), "the hint should still be live");
    // Requests over several of B's poll periods (100 ms) all pass.
    let mut sent = 0;
    while at.elapsed() < Duration::from_millis(800) || sent < 5 {
        let resp = b.get(&key);
        assert_eq!(resp.status, 200, "B re-opened while closed: {}", resp.body);
        sent += 1;
    }
    assert_eq!(b.stat("opened_by_hint"), 1);
    assert!(hint_exists(&redis));
}

#[test]
fn an_expired_hint_does_not_close_b_which_closes_only_on_its_own_trial() {
    let redis = Redis::start();
    let up = start_flaky("shared");
    let short_ttl: &[(&str, &str)] = &[("TOLLGATE_SIDECAR_BREAKER__HINT_TTL", "1s")];
    let a = Replica::start(&redis, up.port, free_port(), &plugin("30s", 1, false, ""), 1, short_ttl);
    let b = Replica::start(&redis, up.port, free_port(), &plugin("4s", 1, false, ""), 1, short_ttl);
    let key = a.sidecar.create_key("acme", "gold", &[]);
    up.fail_with(500);
    let t0 = Instant::now();
    trip(&a, &key, 3, 500);
    poll_until("B to open from A's hint", Duration::from_secs(10), || b.stat("opened_by_hint") == 1);
    poll_until("the hint to expire", Duration::from_secs(10), || !hint_exists(&redis));

    // Expired hint, healthy upstream: B is still open until its own open time is over.
    up.heal();
    let seen = up.seen();
    let resp = b.get(&key);
    if t0.elapsed() < Duration::from_millis(3_800) {
        assert!(is_breaker_503(&resp), "B closed when the hint expired: {} {}", resp.status, resp.body);
        assert_eq!(up.seen(), seen);
    }
    let (resp, at) = first_admitted(&b, &key);
    assert!(at.duration_since(t0) >= Duration::from_secs(4), "B closed early: {:?}", at.duration_since(t0));
    assert_eq!(resp.status, 200);
    assert_eq!((b.stat("half_opened"), b.stat("closed"), b.stat("opened")), (1, 1, 0));
    assert_eq!(a.stat("closed"), 0, "A is still open (30 s)");
}
