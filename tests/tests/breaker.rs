//! Functional tests of the circuit breakers: a real Envoy (V8) with the Tollgate .wasm, the real
//! sidecar binary, a real redis-server, and upstreams that fail on command and count what they
//! see. Every test starts its own processes on its own ports; open times are short and waited
//! for by polling, never by sleeping.

use serde_json::{json, Value};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use tollgate_tests::{get, poll_until, Envoy, Gateway, GatewayBuilder, IssuedKey, Redis, Resp, Upstream};

/// Generous for a noisy 2-core machine.
const DEADLINE: Duration = Duration::from_secs(20);

/// A plugin configuration with one guarded target `primary` (cluster `upstream`, hint key
/// `cb:hint:acme:m1`) falling back to `secondary` (cluster `upstream_b`) when `fallback`.
fn plugin(open_for: &str, fallback: bool) -> Value {
    let mut primary = json!({"name": "primary", "cluster": "upstream", "provider": "acme", "model": "m1"});
    if fallback {
        primary["fallback"] = json!(["secondary"]);
    }
    json!({
        "sidecar": {"timeout": "2s"},
        "failureMode": "closed",
        "breakers": {
            "consecutiveFailures": 3, "failureRatio": 0, "openFor": open_for, "halfOpenTrials": 1,
            "trialTimeout": "20s", "hints": {"pollInterval": "100ms"},
            "targets": [primary, {"name": "secondary", "cluster": "upstream_b"}],
        },
    })
}

/// Replicas in front of the flaky upstream `name` (cluster `upstream`); the second upstream
/// (`upstream_b`) is a dead port unless the test says otherwise.
fn breaker_gateway(name: &str) -> GatewayBuilder {
    Gateway::builder().upstream(Upstream::flaky(name)).fallback(Upstream::Dead)
}

/// A request with `key` on the guarded route.
fn ask(envoy: &Envoy, key: &IssuedKey) -> Resp {
    get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str())])
}

/// The breaker counter `event` of target `primary`.
fn stat(envoy: &Envoy, event: &str) -> u64 {
    envoy.counter(&format!("wasmcustom.tollgate.breaker.primary.{event}"))
}

fn is_breaker_503(r: &Resp) -> bool {
    r.status == 503 && r.header("x-tollgate-breaker") == Some("open")
}

/// Sends failing requests until the breaker opens (exactly `n` expected).
fn trip(r: &Envoy, key: &IssuedKey, n: usize, status: u16) {
    for i in 0..n {
        let resp = ask(r, key);
        assert_eq!(resp.status, status, "request {i} before the breaker opened: {}", resp.body);
        assert_eq!(resp.header("x-tollgate-target"), Some("primary"));
    }
    assert_eq!(stat(r, "opened"), 1, "the breaker did not open after {n} failures");
}

/// Polls requests until one is not rejected by the breaker; returns it and when it came.
fn first_admitted(r: &Envoy, key: &IssuedKey) -> (Resp, Instant) {
    let mut found = None;
    poll_until("a request admitted by the breaker", DEADLINE, || {
        let resp = ask(r, key);
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
    let g = breaker_gateway("a").plugin(plugin("30s", false)).build();
    let (r, up) = (g.envoy(), g.upstream().flaky());
    let key = g.sidecar().create_key("acme", "gold", &[]);

    // Healthy: served, and the response names the target.
    let ok = ask(r, &key);
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.header("x-tollgate-target"), Some("primary"));

    up.fail_with(500);
    trip(r, &key, 3, 500);
    let seen = up.seen();
    assert_eq!(seen, 4);

    for _ in 0..10 {
        let resp = ask(r, &key);
        assert!(is_breaker_503(&resp), "expected the breaker's 503: {} {}", resp.status, resp.body);
        assert_eq!(resp.json()["error"], "upstream_unavailable");
        assert_eq!(resp.header("content-type"), Some("application/json"));
        let retry_after: u64 = resp.header("retry-after").expect("Retry-After").parse().expect("seconds");
        assert!((1..=30).contains(&retry_after), "Retry-After {retry_after}");
    }
    assert_eq!(up.seen(), seen, "the upstream saw traffic while the breaker was open");
    assert_eq!(stat(r, "rejected"), 10);
    // Transitions are logged, requests are not.
    let log = r.log_text();
    assert_eq!(log.matches("tollgate: breaker primary opened").count(), 1, "{log}");
    assert!(!log.contains("breaker primary rejected"));
}

#[test]
fn a_failed_trial_reopens_and_a_successful_trial_closes() {
    let g = breaker_gateway("a").plugin(plugin("1s", false)).build();
    let (r, up) = (g.envoy(), g.upstream().flaky());
    let key = g.sidecar().create_key("acme", "gold", &[]);
    up.fail_with(503);
    trip(r, &key, 3, 503);

    // Still failing: the first request after the open time is a trial; it fails and re-opens.
    let (trial, _) = first_admitted(r, &key);
    assert_eq!(trial.status, 503, "{}", trial.body);
    assert_eq!(trial.header("x-served-by"), Some("a"));
    assert_eq!((stat(r, "half_opened"), stat(r, "reopened"), stat(r, "closed")), (1, 1, 0));
    assert!(is_breaker_503(&ask(r, &key)), "re-opened: rejected again");

    // Healed: the next trial succeeds and closes the breaker for every request after it.
    up.heal();
    let (trial, _) = first_admitted(r, &key);
    assert_eq!(trial.status, 200, "{}", trial.body);
    assert_eq!((stat(r, "half_opened"), stat(r, "closed")), (2, 1));
    let before = up.seen();
    for _ in 0..5 {
        assert_eq!(ask(r, &key).status, 200);
    }
    assert_eq!(up.seen(), before + 5);
    let log = r.log_text();
    for t in ["opened", "half_opened", "reopened", "closed"] {
        assert!(log.contains(&format!("tollgate: breaker primary {t}")), "no {t} line");
    }
}

#[test]
fn half_open_trials_are_bounded_across_two_workers() {
    let g = breaker_gateway("a").plugin(plugin("1s", false)).concurrency(2).build();
    let (r, up) = (g.envoy(), g.upstream().flaky());
    let key = g.sidecar().create_key("acme", "gold", &[]);
    up.fail_with(500);
    trip(r, &key, 3, 500);
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
    let url = r.url("/v1/chat");
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
    assert_eq!(stat(r, "half_opened"), 1);
    assert_eq!(stat(r, "rejected"), (n - 1) as u64);
    // The trial succeeded: closed for both workers.
    assert_eq!(stat(r, "closed"), 1);
    up.delay(Duration::ZERO);
    for _ in 0..4 {
        assert_eq!(ask(r, &key).status, 200);
    }
}

#[test]
fn while_open_the_fallback_target_serves_and_the_response_names_it() {
    let g = breaker_gateway("a").fallback(Upstream::flaky("b")).plugin(plugin("30s", true)).build();
    let (r, a, b) = (g.envoy(), g.upstream().flaky(), g.fallback().flaky());
    let key = g.sidecar().create_key("acme", "gold", &[]);

    // A client cannot pick the cluster: the filter strips x-tollgate-* before routing.
    let spoofed = get(&r.url("/"), &[("x-api-key", key.raw.as_str()), ("x-tollgate-cluster", "upstream_b")]);
    assert_eq!(spoofed.header("x-served-by"), Some("a"), "{:?}", spoofed);
    assert_eq!(spoofed.header("x-tollgate-target"), Some("primary"));
    // repeated, in other cases: every value goes, and the filter's own header is the only one
    let repeated = [("x-api-key", key.raw.as_str()), ("X-Tollgate-Cluster", "upstream_b"), ("x-TOLLGATE-cluster", "upstream_b")];
    let spoofed = get(&r.url("/"), &repeated);
    assert_eq!(spoofed.header("x-served-by"), Some("a"), "{:?}", spoofed);
    assert_eq!(spoofed.header("x-tollgate-target"), Some("primary"));

    a.fail_with(502);
    trip(r, &key, 3, 502);
    let (seen_a, seen_b) = (a.seen(), b.seen());
    for _ in 0..5 {
        let resp = ask(r, &key);
        assert_eq!(resp.status, 200, "{}", resp.body);
        assert_eq!(resp.header("x-tollgate-target"), Some("secondary"));
        assert_eq!(resp.header("x-served-by"), Some("b"));
    }
    assert_eq!(a.seen(), seen_a, "the open primary saw traffic");
    assert_eq!(b.seen(), seen_b + 5);
    assert_eq!(stat(r, "fallback"), 5);

    // The fallback failing too: nothing left, the breaker's 503.
    b.fail_with(500);
    for _ in 0..3 {
        assert_eq!(ask(r, &key).header("x-tollgate-target"), Some("secondary"));
    }
    assert_eq!(r.counter("wasmcustom.tollgate.breaker.secondary.opened"), 1);
    assert!(is_breaker_503(&ask(r, &key)));
}

#[test]
fn connection_failures_count_even_outside_the_failure_statuses() {
    let mut config = plugin("30s", false);
    config["breakers"]["failureStatuses"] = json!(["500"]);
    // nothing listens upstream: Envoy's own 503 (connection failure)
    let g = Gateway::builder().upstream(Upstream::Dead).fallback(Upstream::Dead).plugin(config).build();
    let r = g.envoy();
    let key = g.sidecar().create_key("acme", "gold", &[]);
    for _ in 0..3 {
        let resp = ask(r, &key);
        assert_eq!(resp.status, 503);
        assert_ne!(resp.header("x-tollgate-breaker"), Some("open"), "Envoy's reply, not the breaker's");
    }
    assert_eq!(stat(r, "opened"), 1);
    assert!(is_breaker_503(&ask(r, &key)));
}

#[test]
fn replica_b_opens_from_a_hint_before_it_sees_any_failure() {
    let g = breaker_gateway("shared").plugin(plugin("30s", false)).replicas(2).build();
    let (a, b, up, redis) = (g.replica(0).envoy(), g.replica(1).envoy(), g.upstream().flaky(), g.redis());
    let key = g.sidecar().create_key("acme", "gold", &[]);
    up.fail_with(500);
    trip(a, &key, 3, 500);
    assert_eq!(up.seen(), 3);

    // Propagation: A's poller reports, Redis holds the hint, B's poller applies it.
    let started = Instant::now();
    poll_until("B to open from A's hint", Duration::from_secs(10), || stat(b, "opened_by_hint") == 1);
    eprintln!("hint propagation A→B observed after {:?}", started.elapsed());
    assert!(hint_exists(redis));
    let mut c = redis.connection().expect("redis");
    let ttl: i64 = redis::cmd("TTL").arg("cb:hint:acme:m1").query(&mut c).expect("TTL");
    assert!((1..=30).contains(&ttl), "hint TTL {ttl}");
    // The index expires too (the TTL rule: every key outside the store of record has one), and
    // so does every other key the traffic left.
    let ttl: i64 = redis::cmd("TTL").arg("cb:hints").query(&mut c).expect("TTL");
    assert!((1..=90).contains(&ttl), "cb:hints TTL {ttl}");
    assert!(redis.assert_ttl_invariant() >= 2);

    let resp = ask(b, &key);
    assert!(is_breaker_503(&resp), "{} {}", resp.status, resp.body);
    assert_eq!(up.seen(), 3, "B sent traffic to the failing upstream");
    assert_eq!(stat(b, "opened"), 0, "B saw no failure of its own");
    // A does not re-open from its own hint, and B's hint-driven open is not reported back.
    assert_eq!(stat(a, "opened_by_hint"), 0);
    assert!(b.log_text().contains("tollgate: breaker primary opened_by_hint"));
}

#[test]
fn a_live_hint_neither_shortens_b_open_time_nor_keeps_b_from_closing_on_its_own_trial() {
    // A re-opens every second while the upstream fails, writing a new hint each time.
    let g = breaker_gateway("shared").plugins([plugin("1s", false), plugin("4s", false)]).build();
    let (a, b, up, redis) = (g.replica(0).envoy(), g.replica(1).envoy(), g.upstream().flaky(), g.redis());
    let key = g.sidecar().create_key("acme", "gold", &[]);
    up.fail_with(500);
    let t0 = Instant::now(); // B cannot open before A: B's open time ends after t0 + 4 s
    trip(a, &key, 3, 500);
    poll_until("B to open from A's hint", Duration::from_secs(10), || stat(b, "opened_by_hint") == 1);

    // A's trial fails and re-opens A: a new hint, which B (open) must ignore.
    let (trial, _) = first_admitted(a, &key);
    assert_eq!(trial.status, 500);
    assert_eq!(stat(a, "reopened"), 1);
    poll_until("B to see A's new hint", Duration::from_secs(10), || stat(b, "hint_ignored") >= 1);

    up.heal();
    let (resp, at) = first_admitted(b, &key);
    assert!(at.duration_since(t0) >= Duration::from_secs(4), "B closed early: {:?} after t0", at.duration_since(t0));
    assert_eq!(resp.status, 200, "B's trial: {}", resp.body);
    assert_eq!(resp.header("x-tollgate-target"), Some("primary"));
    assert_eq!((stat(b, "half_opened"), stat(b, "closed"), stat(b, "opened_by_hint"), stat(b, "opened")), (1, 1, 1, 0));

    // The hint is still live (30 s TTL), and B stays closed: a seen hint is not applied again.
    assert!(hint_exists(redis), "the hint should still be live");
    // Requests over several of B's poll periods (100 ms) all pass.
    let mut sent = 0;
    while at.elapsed() < Duration::from_millis(800) || sent < 5 {
        let resp = ask(b, &key);
        assert_eq!(resp.status, 200, "B re-opened while closed: {}", resp.body);
        sent += 1;
    }
    assert_eq!(stat(b, "opened_by_hint"), 1);
    assert!(hint_exists(redis));
}

#[test]
fn an_expired_hint_does_not_close_b_which_closes_only_on_its_own_trial() {
    let g = breaker_gateway("shared")
        .sidecar_env("TOLLGATE_SIDECAR_BREAKER__HINT_TTL", "1s")
        .plugins([plugin("30s", false), plugin("4s", false)])
        .build();
    let (a, b, up, redis) = (g.replica(0).envoy(), g.replica(1).envoy(), g.upstream().flaky(), g.redis());
    let key = g.sidecar().create_key("acme", "gold", &[]);
    up.fail_with(500);
    let t0 = Instant::now();
    trip(a, &key, 3, 500);
    poll_until("B to open from A's hint", Duration::from_secs(10), || stat(b, "opened_by_hint") == 1);
    poll_until("the hint to expire", Duration::from_secs(10), || !hint_exists(redis));

    // Expired hint, healthy upstream: B is still open until its own open time is over.
    up.heal();
    let seen = up.seen();
    let resp = ask(b, &key);
    if t0.elapsed() < Duration::from_millis(3_800) {
        assert!(is_breaker_503(&resp), "B closed when the hint expired: {} {}", resp.status, resp.body);
        assert_eq!(up.seen(), seen);
    }
    let (resp, at) = first_admitted(b, &key);
    assert!(at.duration_since(t0) >= Duration::from_secs(4), "B closed early: {:?}", at.duration_since(t0));
    assert_eq!(resp.status, 200);
    assert_eq!((stat(b, "half_opened"), stat(b, "closed"), stat(b, "opened")), (1, 1, 0));
    assert_eq!(stat(a, "closed"), 0, "A is still open (30 s)");
}

/// Decision 192: the answer a breaker's fallback served is not stored in the response cache
/// under the route (whose target is another): after the primary heals, the same request gets
/// the primary's answer, not the fallback's as a hit. Before, the fallback's answer was cached
/// for the route's whole TTL and served to every key of the plan, unlabelled.
#[test]
fn a_fallbacks_answer_is_not_cached_under_the_route() {
    let toml = "[[routes]]\nid = \"chat\"\ncluster = \"upstream\"\ncache_ttl = \"60s\"\n[routes.match]\npath_prefix = \"/v1/chat\"\n";
    let mut config = plugin("1s", true);
    config["routing"] = json!({"enabled": true, "refreshInterval": "50ms"});
    config["responseCache"] = json!({"maxBodyBytes": 4096});
    let g = breaker_gateway("a").fallback(Upstream::flaky("b")).sidecar_toml(toml).plugin(config).build();
    let (r, a) = (g.envoy(), g.upstream().flaky());
    let key = g.sidecar().create_key("acme", "gold", &[]);
    let fetch = |path: &str| get(&r.url(path), &[("x-api-key", key.raw.as_str())]);
    poll_until("the routing table in the filter", DEADLINE, || fetch("/v1/chat/warm").header("x-tollgate-cache").is_some());
    a.fail_with(502);
    trip(r, &key, 3, 502);
    let served = fetch("/v1/chat/once");
    assert_eq!((served.status, served.header("x-served-by")), (200, Some("b")), "{}", served.body);
    assert_eq!(served.header("x-tollgate-cache"), Some("bypass"), "a fallback's answer is not stored");
    a.heal();
    poll_until("the primary closed again", DEADLINE, || {
        let resp = ask(r, &key);
        resp.status == 200 && resp.header("x-tollgate-target") == Some("primary")
    });
    let again = fetch("/v1/chat/once");
    assert_eq!((again.header("x-served-by"), again.header("x-tollgate-cache")), (Some("a"), Some("miss")), "{}", again.body);
}
