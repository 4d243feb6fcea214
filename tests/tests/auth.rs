//! Functional tests of the walking skeleton: a real Envoy (V8) loading the Tollgate .wasm, the
//! real sidecar binary, a real redis-server and an echo upstream, each test with its own.

use serde_json::json;
use std::time::{Duration, Instant};
use tollgate_tests::{get, poll_until, Gateway};

/// The default plugin configuration (a 2 s sidecar timeout, generous for a noisy machine and
/// well under Envoy's own defaults; failing closed).
fn gateway() -> Gateway {
    Gateway::builder().build()
}

#[test]
fn valid_key_reaches_upstream_with_identity_and_without_the_raw_key() {
    let s = gateway();
    let key = s.sidecar().create_key("acme", "gold", &[]);
    let bearer = format!("Bearer {}", key.raw);

    // The same key through each source; a spoofed tenant header never arrives.
    let cases: Vec<(String, Vec<(&str, &str)>)> = vec![
        ("/v1/items?x=1".to_string(), vec![("authorization", bearer.as_str()), ("x-tollgate-tenant", "evil")]),
        ("/v1/items?x=1".to_string(), vec![("x-api-key", key.raw.as_str()), ("x-tollgate-key-id", "key_evil")]),
        (format!("/v1/items?api_key={}&x=1", key.raw), vec![("x-tollgate-plan", "platinum")]),
    ];
    for (path, headers) in cases {
        let r = get(&s.envoy().url(&path), &headers);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let seen = r.echoed();
        assert_eq!(seen.header("x-tollgate-tenant"), Some("acme"));
        assert_eq!(seen.header("x-tollgate-key-id"), Some(key.id.as_str()));
        assert_eq!(seen.header("x-tollgate-plan"), Some("gold"));
        assert_eq!(seen.path, "/v1/items?x=1");
        assert_eq!(seen.header("authorization"), None);
        assert_eq!(seen.header("x-api-key"), None);
        let everything = serde_json::to_string(&seen).unwrap();
        assert!(!everything.contains(&key.raw), "raw key reached the upstream: {everything}");
        assert!(!everything.contains("evil") && !everything.contains("platinum"), "spoofed header: {everything}");
    }
    assert_eq!(s.envoy().counter_reaching("wasmcustom.tollgate.requests.allowed", 3), 3);
    // Requests 2 and 3 came within the cache time of the first: answered without a callout.
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.auth_cache.hits"), 2);

    // The sidecar's metrics count the decisions.
    let metrics = get(&s.sidecar().url("/metrics"), &[]).body;
    assert!(metrics.contains(r#"tollgate_sidecar_decisions_total{outcome="allow",reason="ok"}"#), "{metrics}");

    // Neither logs nor Redis hold the raw key.
    assert!(!s.envoy().log_text().contains(&key.raw));
    assert!(!s.sidecar().log_text().contains(&key.raw));
    s.redis().assert_no_raw_keys(&[&key.raw]);
}

#[test]
fn repeated_requests_of_a_key_skip_the_callout_but_revocation_still_applies() {
    let s = gateway();
    let key = s.sidecar().create_key("acme", "gold", &[]);
    let h = [("x-api-key", key.raw.as_str())];
    for _ in 0..20 {
        assert_eq!(get(&s.envoy().url("/"), &h).status, 200);
    }
    assert_eq!(s.envoy().counter_reaching("wasmcustom.tollgate.requests.allowed", 20), 20);
    let hits = s.envoy().counter("wasmcustom.tollgate.auth_cache.hits");
    let calls = 20 - hits;
    assert!(hits > 0, "no request was answered from the filter's cache");
    let metrics = get(&s.sidecar().url("/metrics"), &[]).body;
    let decided: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"tollgate_sidecar_decisions_total{outcome="allow",reason="ok"} "#))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert_eq!(decided, calls, "the sidecar decided exactly the requests that were not cache hits");
}

#[test]
fn missing_and_unknown_keys_get_401_json() {
    let s = gateway();
    let r = get(&s.envoy().url("/v1/items"), &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.json()["error"], "missing_key");
    assert!(r.json()["message"].as_str().is_some_and(|m| !m.is_empty()));

    let r = get(&s.envoy().url("/v1/items"), &[("x-api-key", "tg_not_a_real_key")]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"], "unknown_key");

    let r = get(&s.envoy().url("/v1/items"), &[("authorization", "Bearer tg_also_not_real")]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"], "unknown_key");

    assert_eq!(s.envoy().counter("wasmcustom.tollgate.requests.denied.missing_key"), 1);
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.requests.denied.unknown_key"), 2);
    assert!(!s.envoy().log_text().contains("tg_not_a_real_key"));
}

#[test]
fn a_revoked_key_is_refused_within_one_second() {
    let s = gateway();
    let key = s.sidecar().create_key("acme", "free", &[]);
    let other = s.sidecar().create_key("acme", "free", &[]);
    let h = [("x-api-key", key.raw.as_str())];
    assert_eq!(get(&s.envoy().url("/"), &h).status, 200); // now cached by the sidecar

    s.sidecar().revoke_key(&key.id);
    let revoked_at = Instant::now();
    poll_until("revocation to apply", Duration::from_secs(5), || get(&s.envoy().url("/"), &h).status == 401);
    let took = revoked_at.elapsed();
    assert!(took < Duration::from_secs(1), "revocation took {took:?}");
    let r = get(&s.envoy().url("/"), &h);
    assert_eq!(r.json()["error"], "revoked_key");
    // Other keys are unaffected.
    assert_eq!(get(&s.envoy().url("/"), &[("x-api-key", other.raw.as_str())]).status, 200);

    // One audit line per key per hour: the throttle key exists with its TTL.
    let mut c = s.redis().connection().unwrap();
    let throttle = format!("apikey:authfail:{}", key.id);
    poll_until("the audit throttle key", Duration::from_secs(5), || {
        redis::cmd("EXISTS").arg(&throttle).query::<i64>(&mut c).unwrap() == 1
    });
    let ttl: i64 = redis::cmd("TTL").arg(&throttle).query(&mut c).unwrap();
    assert!(ttl > 3500 && ttl <= 3600, "authfail TTL {ttl}");
    s.redis().assert_no_raw_keys(&[&key.raw, &other.raw]);
    s.redis().assert_ttl_invariant();
}

#[test]
fn an_expired_key_is_refused() {
    let s = gateway();
    let key = s.sidecar().create_key("acme", "free", &["--expires-in", "1s"]);
    let h = [("x-api-key", key.raw.as_str())];
    poll_until("key expiry", Duration::from_secs(10), || get(&s.envoy().url("/"), &h).status == 401);
    assert_eq!(get(&s.envoy().url("/"), &h).json()["error"], "expired_key");
    assert!(s.envoy().counter("wasmcustom.tollgate.requests.denied.expired_key") >= 1);
}

#[test]
fn sidecar_killed_fails_closed_or_open_as_configured() {
    let mut s = gateway();
    let warm = s.sidecar().create_key("acme", "free", &[]);
    assert_eq!(get(&s.envoy().url("/"), &[("x-api-key", warm.raw.as_str())]).status, 200);
    // A key the filter has not cached yet, so that its requests need the sidecar.
    let key = s.sidecar().create_key("acme", "free", &[]);
    let h = [("x-api-key", key.raw.as_str())];

    // A second Envoy on the same sidecar, failing open.
    let open = s.start_envoy(|o| o.plugin_config(json!({"sidecar": {"timeout": "2s"}, "failureMode": "open"})));

    s.sidecar_mut().kill();
    let started = Instant::now();
    let r = get(&s.envoy().url("/"), &h);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "sidecar_unavailable");
    assert!(started.elapsed() < Duration::from_secs(2), "fail-closed took {:?}", started.elapsed());
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.requests.failed_closed"), 1);

    // the same key in the query too (two different keys would be 400 invalid_request, issue 13.7)
    let r = get(&open.url(&format!("/p?api_key={}", key.raw)), &h);
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = r.echoed();
    assert_eq!(seen.header("x-tollgate-degraded"), Some("sidecar_unavailable"));
    assert_eq!(seen.header("x-tollgate-tenant"), None);
    assert_eq!(seen.header("x-api-key"), None, "the raw key is stripped even when failing open");
    assert_eq!(seen.path, "/p");
    assert_eq!(open.counter("wasmcustom.tollgate.requests.failed_open"), 1);
}

#[test]
fn a_hung_sidecar_hits_the_timeout_and_the_failure_mode() {
    let g = Gateway::builder().black_hole_sidecar().plugin(json!({"sidecar": {"timeout": "300ms"}, "failureMode": "closed"})).build();
    let envoy = g.envoy();
    let started = Instant::now();
    let r = get(&envoy.url("/"), &[("x-api-key", "tg_whatever")]);
    let took = started.elapsed();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "sidecar_unavailable");
    // Envoy's timers may fire a millisecond or two early (seen: 298.6 ms, 299.4 ms under load)
    assert!(took >= Duration::from_millis(290), "answered before the timeout: {took:?}");
    assert!(took < Duration::from_secs(5), "no hang: {took:?}");
    assert_eq!(envoy.counter("wasmcustom.tollgate.sidecar.errors"), 1);
}

#[test]
fn redis_stopped_still_answers_per_policy_without_hanging() {
    // A short Redis deadline and a long stale grace, as in production defaults.
    let mut g = Gateway::builder().sidecar_env("TOLLGATE_SIDECAR_REDIS__TIMEOUT", "100ms").build();
    let known = g.sidecar().create_key("acme", "free", &[]);
    let h = [("x-api-key", known.raw.as_str())];
    assert_eq!(get(&g.envoy().url("/"), &h).status, 200);

    g.redis_mut().kill();
    let (envoy, sidecar) = (g.envoy(), g.sidecar());
    // A key the sidecar has seen is still served from its cache (stale grace)...
    let r = get(&envoy.url("/"), &h);
    assert_eq!(r.status, 200, "{}", r.body);
    // ...and one it has not is "cannot decide": the filter fails closed, quickly.
    for _ in 0..3 {
        let started = Instant::now();
        let r = get(&envoy.url("/"), &[("x-api-key", "tg_never_seen")]);
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["error"], "sidecar_unavailable");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    }
    let health = get(&sidecar.url("/healthz"), &[]).body;
    assert!(health.contains(r#""redis":"down""#), "{health}");
    assert!(sidecar.log_text().contains("redis went down"));
}

#[test]
fn bad_plugin_configuration_is_refused_by_envoy() {
    let result = Gateway::builder().sidecar_at(1).plugin(json!({"failureMode": "sometimes"})).try_build();
    let log = match result {
        Ok(g) => panic!("envoy accepted a bad plugin config:\n{}", g.envoy().log_text()),
        Err(log) => log,
    };
    assert!(log.contains("invalid tollgate plugin configuration"), "{log}");
    assert!(log.contains("sometimes"), "{log}");
}

#[test]
fn sidecar_shuts_down_gracefully_on_sigterm() {
    let mut g = Gateway::builder().without_envoy().build();
    let sidecar = g.sidecar_mut();
    let status = sidecar.terminate(Duration::from_secs(10)).expect("sidecar exits on SIGTERM");
    assert!(status.success(), "exit status {status}");
    assert!(sidecar.log_text().contains("tollgate sidecar stopped"));
}

#[test]
fn check_config_validates_without_starting() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "listen = \"127.0.0.1:0\"\n[redis]\ntimeout = \"20ms\"\n").unwrap();
    let out = std::process::Command::new(tollgate_tests::sidecar_bin()).arg("--config").arg(&good).arg("--check-config").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("configuration OK"));

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[redis]\ntimout = \"20ms\"\n").unwrap();
    let out = std::process::Command::new(tollgate_tests::sidecar_bin()).arg("--config").arg(&bad).arg("--check-config").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("timout"), "{}", String::from_utf8_lossy(&out.stderr));

    // an environment override is checked too
    let out = std::process::Command::new(tollgate_tests::sidecar_bin())
        .arg("--config")
        .arg(&good)
        .arg("--check-config")
        .env("TOLLGATE_SIDECAR_REDIS__URL", "http://not-redis")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("redis.url"));
}
