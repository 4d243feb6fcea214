//! Hostile clients (issue 13): what an attacker sends must not bypass a limit, crash a worker or
//! grow memory without bound. Each test runs a real Envoy with the filter, the sidecar and Redis.

use std::sync::atomic::Ordering;
use tollgate_tests::{get, start_counting_echo, Envoy, EnvoyOptions, Redis, Sidecar};

const PLUGIN: &str = r#"{"sidecar":{"timeout":"2s"},"failureMode":"closed"}"#;

/// A client repeating one `x-request-id` is still counted once per request, by every algorithm:
/// the decision's id is the gateway's, never the client's.
#[test]
fn a_fixed_client_request_id_never_bypasses_a_limit() {
    let redis = Redis::start();
    // Windows far longer than the test, so no window ends or bucket refills during it.
    let mut toml = String::new();
    for algorithm in ["fixed_window", "sliding_window", "token_bucket", "sliding_log"] {
        toml.push_str(&format!(
            "[[plans.{algorithm}.limits]]\nname = \"ten\"\nalgorithm = \"{algorithm}\"\nlimit = 10\nwindow = \"24h\"\n"
        ));
    }
    let sidecar = Sidecar::start_with_config(&redis.url(), &toml, &[]);
    let (upstream, seen) = start_counting_echo();
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN));
    for plan in ["fixed_window", "sliding_window", "token_bucket", "sliding_log"] {
        let key = sidecar.create_key("acme", plan, &[]);
        let before = seen.load(Ordering::SeqCst);
        let statuses: Vec<u16> =
            (0..15).map(|_| get(&envoy.url("/"), &[("x-api-key", key.raw.as_str()), ("x-request-id", "fixed-1")]).status).collect();
        let ok = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(ok, 10, "{plan}: a fixed x-request-id must not change the count: {statuses:?}");
        assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{plan}: {statuses:?}");
        assert_eq!(seen.load(Ordering::SeqCst) - before, 10, "{plan}: exactly 10 reached the upstream");
    }
}

/// A concurrency cap of 2 holds against ten parallel slow requests that all carry one id.
#[test]
fn a_fixed_client_request_id_never_bypasses_a_concurrency_cap() {
    let redis = Redis::start();
    let sidecar = Sidecar::start_with_config(
        &redis.url(),
        "[[plans.two.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 2\n",
        &[],
    );
    let (upstream, seen) = start_counting_echo();
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN).concurrency(2));
    let key = sidecar.create_key("acme", "two", &[]);
    let url = envoy.url("/slow");
    // The upstream holds each admitted request for 4 s: all ten are decided while the first two
    // are still in flight.
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..10)
            .map(|_| {
                let (url, key) = (&url, &key);
                s.spawn(move || {
                    get(url, &[("x-api-key", key.raw.as_str()), ("x-request-id", "fixed-1"), ("x-echo-delay-ms", "4000")]).status
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(ok, 2, "exactly two in flight at once: {statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 8, "{statuses:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
}

/// Each request's token reservation is its own: three parallel requests with one `x-request-id`
/// are reconciled three times, and the budget ends at what they used.
#[test]
fn a_fixed_client_request_id_never_merges_token_reservations() {
    let redis = Redis::start();
    let sidecar = Sidecar::start_with_config(
        &redis.url(),
        "[[plans.llm.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 100000\nestimate = 400\n",
        &[],
    );
    let (upstream, _) = start_counting_echo();
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN));
    let key = sidecar.create_key("acme", "llm", &[]);
    // In parallel, each held 1.5 s upstream: all three reserve before any is reconciled.
    let url = envoy.url("/v1/chat");
    std::thread::scope(|s| {
        for _ in 0..3 {
            let (url, key) = (&url, &key);
            s.spawn(move || {
                let h = [("x-api-key", key.raw.as_str()), ("x-request-id", "fixed-1"), ("x-echo-usage", "100"), ("x-echo-delay-ms", "1500")];
                assert_eq!(get(url, &h).status, 200);
            });
        }
    });
    let used = || -> Option<i64> {
        let mut c = redis.connection()?;
        let keys: Vec<String> = redis::cmd("KEYS").arg("q:tokens:*").query(&mut c).ok()?;
        redis::cmd("GET").arg(keys.first()?).query(&mut c).ok()
    };
    tollgate_tests::poll_until("three reservations reconciled to 3 x 100", std::time::Duration::from_secs(10), || used() == Some(300));
}
