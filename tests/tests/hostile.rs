//! Hostile clients (issue 13): what an attacker sends must not bypass a limit, crash a worker or
//! grow memory without bound. Each test runs a real Envoy with the filter, the sidecar and Redis.

use serde_json::json;
use std::time::Duration;
use tollgate_tests::fixtures::{cache_sidecar_toml, limit_toml};
use tollgate_tests::{get, poll_until, post, raw, start_counting_echo, Envoy, EnvoyOptions, Gateway, GatewayBuilder};

/// A gateway whose sidecar decides by `toml`, its filter by `plugin` (over a 2 s sidecar timeout
/// and failing closed).
fn gateway(toml: &str, plugin: serde_json::Value) -> GatewayBuilder {
    let mut config = tollgate_tests::default_plugin();
    config.as_object_mut().expect("an object").extend(plugin.as_object().expect("an object").clone());
    Gateway::builder().sidecar_toml(toml).plugin(config)
}

/// A client repeating one `x-request-id` is still counted once per request, by every algorithm:
/// the decision's id is the gateway's, never the client's.
#[test]
fn a_fixed_client_request_id_never_bypasses_a_limit() {
    // Windows far longer than the test, so no window ends or bucket refills during it.
    let algorithms = ["fixed_window", "sliding_window", "token_bucket", "sliding_log"];
    let toml: String = algorithms.iter().map(|a| limit_toml(a, "ten", a, 10, "window = \"24h\"")).collect();
    let g = gateway(&toml, json!({})).build();
    let (envoy, sidecar) = (g.envoy(), g.sidecar());
    for plan in algorithms {
        let key = sidecar.create_key("acme", plan, &[]);
        let before = g.upstream().calls();
        let statuses: Vec<u16> =
            (0..15).map(|_| get(&envoy.url("/"), &[("x-api-key", key.raw.as_str()), ("x-request-id", "fixed-1")]).status).collect();
        let ok = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(ok, 10, "{plan}: a fixed x-request-id must not change the count: {statuses:?}");
        assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{plan}: {statuses:?}");
        assert_eq!(g.upstream().calls() - before, 10, "{plan}: exactly 10 reached the upstream");
    }
}

/// A concurrency cap of 2 holds against ten parallel slow requests that all carry one id.
#[test]
fn a_fixed_client_request_id_never_bypasses_a_concurrency_cap() {
    let g = gateway(&limit_toml("two", "inflight", "concurrency", 2, ""), json!({})).concurrency(2).build();
    let key = g.sidecar().create_key("acme", "two", &[]);
    let url = g.envoy().url("/slow");
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
    assert_eq!(g.upstream().calls(), 2);
}

/// Each request's token reservation is its own: three parallel requests with one `x-request-id`
/// are reconciled three times, and the budget ends at what they used.
#[test]
fn a_fixed_client_request_id_never_merges_token_reservations() {
    let g = gateway(&limit_toml("llm", "tokens", "token_budget", 100_000, "estimate = 400"), json!({})).build();
    let key = g.sidecar().create_key("acme", "llm", &[]);
    // In parallel, each held 1.5 s upstream: all three reserve before any is reconciled.
    let url = g.envoy().url("/v1/chat");
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
        let mut c = g.redis().connection()?;
        let keys: Vec<String> = redis::cmd("KEYS").arg("q:tokens:*").query(&mut c).ok()?;
        redis::cmd("GET").arg(keys.first()?).query(&mut c).ok()
    };
    tollgate_tests::poll_until("three reservations reconciled to 3 x 100", std::time::Duration::from_secs(10), || used() == Some(300));
}

/// A byte like 0xFF anywhere a client or an upstream can put it never kills a worker: one worker
/// only, so a dead VM would fail every request after it.
#[test]
fn bytes_that_are_not_utf8_never_kill_a_worker() {
    let plugin = json!({
        "routing": {"enabled": true, "refreshInterval": "50ms"}, "idempotency": {"enabled": true}, "completionFlushInterval": "20ms",
    });
    let g = gateway(&cache_sidecar_toml(100_000), plugin).build();
    let envoy = g.envoy();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let k = key.raw.as_bytes();
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&envoy.url("/warmup"), &[("x-api-key", &key.raw)]).status == 200);

    // an unrelated header: absent for the filter
    let r = raw::get(envoy.port, b"/hello", &[("user-agent", b"curl\xff")]);
    assert_eq!((r.status, r.json()["error"].as_str()), (401, Some("missing_key")), "{r:?}");
    let r = raw::get(envoy.port, b"/hello", &[("user-agent", b"curl\xff"), ("x-api-key", k)]);
    assert_eq!(r.status, 200, "{r:?}");
    // the key itself: refused with the documented JSON
    let r = raw::get(envoy.port, b"/hello", &[("x-api-key", b"tg_\xff\xfe")]);
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("invalid_request")), "{r:?}");
    let r = raw::get(envoy.port, b"/hello", &[("authorization", b"Bearer tg_\xff")]);
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("invalid_request")), "{r:?}");
    // the path (Envoy may refuse it first; either way a 400, never a dead worker)
    let r = raw::get(envoy.port, b"/caf\xe9?x=1", &[("x-api-key", k)]);
    assert_eq!(r.status, 400, "{r:?}");

    // an upstream's Latin-1 header on a caching route: served, not cached (it could not be
    // replayed as sent)
    let before = g.upstream().calls();
    for _ in 0..2 {
        let r = raw::get(envoy.port, b"/cached/latin1", &[("x-api-key", k), ("x-echo-latin1", b"1")]);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.header("x-tollgate-cache"), Some("miss"));
    }
    assert_eq!(g.upstream().calls() - before, 2, "not cached: both reached the upstream");

    // ... and on an idempotent POST: the outcome is stored (without that header) and replayed
    let h = [("x-api-key", key.raw.as_str()), ("idempotency-key", "\"order-1\""), ("x-echo-latin1", "1"), ("content-type", "application/json")];
    let before = g.upstream().calls();
    assert_eq!(post(&envoy.url("/orders"), &h, "{\"n\":1}").status, 200);
    poll_until("the idempotent replay", Duration::from_secs(10), || {
        let r = post(&envoy.url("/orders"), &h, "{\"n\":1}");
        assert!(r.status == 200 || r.status == 409, "{r:?}");
        r.header("idempotent-replayed") == Some("true")
    });
    assert_eq!(g.upstream().calls() - before, 1, "the operation ran once");

    // the worker is alive: twenty ordinary requests all pass
    for _ in 0..20 {
        assert_eq!(get(&envoy.url("/hello"), &[("x-api-key", &key.raw)]).status, 200);
    }
    let log = envoy.log_text();
    assert!(!log.contains("panicked") && !log.contains("Uncaught") && !log.contains("wasm_fail_stream"), "the VM failed:\n{log}");
}

/// Envoy replaces a VM that fails (`failure_policy: FAIL_RELOAD`): the request that killed it and
/// those during the backoff get the documented JSON 503, the failure shows in a stat, and
/// requests are served again within a second. Measured with a fixture filter that traps on
/// demand, loaded into the shipped template in place of Tollgate's.
///
/// Wasm host only: the fixture is a Wasm filter and the replacement is the Wasm host's. The
/// native host catches a panic instead (decision 256; docs/operations.md, "Filter failures").
#[test]
fn a_failed_filter_vm_is_replaced_and_answers_json_meanwhile() {
    if !tollgate_tests::wasm_host_only("a Wasm VM's replacement; the native host catches panics (decision 256)") {
        return;
    }
    let (upstream, _) = start_counting_echo();
    let crasher = std::env::var("TOLLGATE_CRASHER_WASM")
        .unwrap_or_else(|_| tollgate_tests::root().join("target/wasm32-wasip1/release/tollgate_test_crasher.wasm").display().to_string());
    let mut opts = EnvoyOptions::new(upstream.port, tollgate_tests::free_port()).concurrency(1);
    opts.vars.push(("WASM_PATH", crasher));
    let envoy = Envoy::start(opts);
    assert_eq!(get(&envoy.url("/"), &[]).status, 200);
    let r = get(&envoy.url("/"), &[("x-crash", "1")]);
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.json()["error"], "gateway_unavailable");
    let failed_at = std::time::Instant::now();
    poll_until("a fresh VM serving again", Duration::from_secs(10), || {
        let r = get(&envoy.url("/"), &[]);
        assert!(r.status == 200 || (r.status == 503 && r.json()["error"] == "gateway_unavailable"), "{r:?}");
        r.status == 200
    });
    let recovered = failed_at.elapsed();
    eprintln!("a failed VM was replaced after {recovered:?}");
    assert!(envoy.counter("wasm.tollgate.vm_reload_success") >= 1, "{}", envoy.stats("wasm."));
}

/// The client IP of a per-IP limit is the peer's address: rotating `X-Forwarded-For` gets nothing
/// more; and header names that only look like the gateway's own never reach the upstream.
#[test]
fn forwarded_for_and_underscored_names_choose_nothing() {
    let g = gateway(&limit_toml("ip", "per-ip", "sliding_log", 5, "subject = \"client_ip\"\nwindow = \"24h\""), json!({})).build();
    let (envoy, sidecar) = (g.envoy(), g.sidecar());
    let key = sidecar.create_key("acme", "ip", &[]);
    let statuses: Vec<u16> = (0..20)
        .map(|i| {
            let xff = format!("203.0.113.{i}");
            get(&envoy.url("/"), &[("x-api-key", key.raw.as_str()), ("x-forwarded-for", xff.as_str())]).status
        })
        .collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 5, "{statuses:?}");

    let other = sidecar.create_key("acme", "gold", &[]);
    let r = get(&envoy.url("/"), &[("x-api-key", other.raw.as_str()), ("x_tollgate_tenant", "evil"), ("x_api_key", "tg_x")]);
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = r.echoed();
    assert_eq!(seen.header("x-tollgate-tenant"), Some("acme"));
    assert!(seen.headers.iter().all(|(n, _)| !n.contains('_')), "an underscored name reached the upstream: {:?}", seen.headers);

    // a credential in any whitespace form is found and stripped; two different keys are refused
    for auth in [format!("Bearer\t{}", other.raw), format!("bEaReR   {} ", other.raw), format!("\tBEARER\t\t{}", other.raw)] {
        let r = raw::get(envoy.port, b"/", &[("authorization", auth.as_bytes())]);
        assert_eq!(r.status, 200, "{auth:?}: {r:?}");
        let seen: tollgate_tests::Echoed = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(seen.header("authorization"), None, "{auth:?} reached the upstream");
        assert_eq!(seen.header("x-tollgate-tenant"), Some("acme"));
    }
    let path = format!("/?api_key={}", key.raw);
    let r = get(&envoy.url(&path), &[("x-api-key", other.raw.as_str())]);
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("invalid_request")), "{}", r.body);
}

// ---- bounded state, metering whatever the client chose, clamped upstream numbers (13.3, 13.4, 13.6)

/// Envoy's `/memory` `allocated` (bytes).
fn envoy_allocated(envoy: &Envoy) -> i64 {
    let r = get(&format!("http://127.0.0.1:{}/memory", envoy.admin_port), &[]);
    r.json()["allocated"].as_str().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no allocated in /memory: {}", r.body))
}

/// `n` requests with fresh random keys, from 8 threads on keep-alive connections; every one must
/// be refused 401.
fn random_key_flood(envoy: &Envoy, n: usize, round: usize) {
    let url = envoy.url("/v1/chat");
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::thread::scope(|s| {
        for t in 0..8 {
            let url = &url;
            s.spawn(move || {
                let agent: ureq::Agent = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .timeout_global(Some(Duration::from_secs(15)))
                    .build()
                    .into();
                for i in (t..n).step_by(8) {
                    let key = format!("tg_flood_{seed:x}_{round}_{i}");
                    let status = agent.get(url).header("x-api-key", &key).call().map(|r| r.status().as_u16()).unwrap_or(0);
                    assert_eq!(status, 401, "a random key");
                }
            });
        }
    });
}

/// A flood of random keys leaves nothing behind: no lease record, no auth cache entry in Envoy's
/// shared data, little in the sidecar (its key cache is bounded) and almost nothing in Redis. The issue's 100,000 keys, in two
/// rounds of 50,000 (about a minute on a loaded 2-core machine; the sidecar's key cache, 100,000
/// entries, is full at the end);
/// before issue 13.3 each random key left a lease record (~250 bytes of shared data) behind, so
/// a round of 10,000 grew Envoy by ~1.9 MB and the second round as much again (measured).
#[test]
fn a_flood_of_random_keys_grows_neither_envoy_nor_redis() {
    const ROUND: usize = 50_000;
    let g = gateway(&limit_toml("p", "pm", "fixed_window", 100_000, "window = \"60s\""), json!({"leases": {"enabled": true}}))
        .concurrency(2)
        .build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    // warm up: a valid key (leases, the auth cache path and every worker's allocations in use)
    let key = sidecar.create_key("acme", "p", &[]);
    for _ in 0..50 {
        assert_eq!(get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str())]).status, 200);
    }
    random_key_flood(envoy, 500, 0);
    let dbsize = || redis.cmd::<i64>(&["DBSIZE"]);
    let sidecar_rss = || -> i64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", sidecar.pid().expect("sidecar pid"))).unwrap_or_default();
        let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok());
        kb.unwrap_or_else(|| panic!("no VmRSS in {status}")) * 1024
    };
    let (mem0, db0, rss0) = (envoy_allocated(envoy), dbsize(), sidecar_rss());
    random_key_flood(envoy, ROUND, 1);
    let (mem1, db1, rss1) = (envoy_allocated(envoy), dbsize(), sidecar_rss());
    random_key_flood(envoy, ROUND, 2);
    let (mem2, db2, rss2) = (envoy_allocated(envoy), dbsize(), sidecar_rss());
    eprintln!("envoy allocated: {mem0} → {mem1} → {mem2} bytes; sidecar rss: {rss0} → {rss1} → {rss2} bytes; redis dbsize: {db0} → {db1} → {db2}");
    assert!(mem1 - mem0 < 5 << 20, "Envoy grew {} bytes in the first round", mem1 - mem0);
    assert!(mem2 - mem1 < 1 << 20, "Envoy kept growing in the second round: {} bytes", mem2 - mem1);
    assert!(rss2 - rss0 < 64 << 20, "the sidecar's RSS grew {} bytes", rss2 - rss0);
    assert!(db2 - db0 < 1_000, "Redis grew by {} keys", db2 - db0);
    // the valid key still works, and still leases
    assert_eq!(get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str())]).status, 200);
}

/// Metering on (flushed every 100 ms), a sidecar that spools (Kafka need not be up for the spool
/// and the Redis meter).
fn metered(plans: &str, plugin: serde_json::Value) -> GatewayBuilder {
    let toml = format!(
        "{plans}\n[usage]\nenabled = true\nspool_dir = \"${{SPOOL_DIR}}\"\nsegment_age = \"50ms\"\n\
         [usage.kafka]\nbrokers = \"127.0.0.1:1\"\ntopic = \"usage_events\"\ndelivery_timeout = \"1s\"\n"
    );
    let mut plugin = plugin;
    plugin["usage"] = json!({"enabled": true, "flushInterval": "100ms"});
    gateway(&toml, plugin)
}

/// The Redis usage meter of `tenant` today: `field` (`ok`, `tokens` …).
fn meter_field(redis: &tollgate_tests::Redis, tenant: &str, field: &str) -> Option<i64> {
    let day = tollgate_wire::usage::Day::of_ms(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as u64);
    let mut c = redis.connection()?;
    redis::cmd("HGET").arg(format!("usage:{{{tenant}}}:{}", day.compact())).arg(field).query(&mut c).ok()
}

/// A client-chosen Host never escapes billing: one request with a 300-byte Host and a burst of
/// 2.5 KB Hosts are each metered exactly once (the Host is cut to 255 bytes in the event), and no
/// usage batch fails. The burst is the issue's 1,200 requests, from 8 threads (1.6 s on a
/// loaded 2-core machine; the byte bound and the 413 split are unit-tested in filters/core).
#[test]
fn a_long_host_is_metered_never_refused() {
    const BURST: usize = 1_200;
    let g = metered(&limit_toml("p", "pm", "fixed_window", 100_000, "window = \"60s\""), json!({})).concurrency(2).build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    let key = sidecar.create_key("acme", "p", &[]);
    let request = |host: &str| {
        let req = format!("GET /v1/items HTTP/1.1\r\nhost: {host}\r\nx-api-key: {}\r\nconnection: close\r\n\r\n", key.raw);
        raw::send(envoy.port, req.as_bytes()).status
    };
    let long = |n: usize, i: usize| format!("{i}.{}", "h".repeat(n));
    assert_eq!(request(&long(300, 0)), 200);
    let burst = std::time::Instant::now();
    std::thread::scope(|s| {
        for t in 0..8 {
            let request = &request;
            s.spawn(move || {
                for i in (t..BURST).step_by(8) {
                    assert_eq!(request(&long(2_500, i)), 200);
                }
            });
        }
    });
    eprintln!("{BURST} requests with 2.5 KB Hosts in {:?}", burst.elapsed());
    let want = (BURST + 1) as i64;
    poll_until("every request metered", Duration::from_secs(30), || meter_field(redis, "acme", "ok") == Some(want));
    assert_eq!(sidecar.metric("tollgate_sidecar_usage_events_total{outcome=\"invalid\"}"), 0);
    assert_eq!(envoy.counter("wasmcustom.tollgate.usage.flush_errors"), 0, "{}", envoy.stats("tollgate.usage"));
    assert_eq!(envoy.counter("wasmcustom.tollgate.usage.dropped"), 0);
    // exactly that count: nothing is metered twice
    assert_eq!(meter_field(redis, "acme", "ok"), Some(want));
    let events: Vec<tollgate_wire::usage::UsageEvent> = std::fs::read_dir(g.spool_dir())
        .unwrap()
        .flatten()
        .flat_map(|f| std::fs::read(f.path()).unwrap_or_default().split(|b| *b == b'\n').map(<[u8]>::to_vec).collect::<Vec<_>>())
        .filter_map(|l| serde_json::from_slice(&l).ok())
        .collect();
    assert!(events.iter().all(|e| e.authority.len() <= 255), "an authority over 255 bytes was spooled");
    assert!(events.iter().any(|e| e.authority.len() == 255 && e.authority.starts_with("0.hhh")), "the 300-byte Host, cut to 255");
}

/// An upstream reporting impossible token counts (2^64-1, -1, 1e30): every count is clamped to
/// 0..2^53 and counted in a stat, the meter and the budget never go negative, and neither the
/// usage nor the completion batches fail (no batch is resent forever).
#[test]
fn impossible_token_counts_are_clamped_and_block_no_queue() {
    let plans = limit_toml("llm", "tokens", "token_budget", 9_000_000_000_000_000_000, "estimate = 400");
    let g = metered(&plans, json!({"completionFlushInterval": "50ms"})).build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    let key = sidecar.create_key("acme", "llm", &[]);
    for raw in ["18446744073709551615", "-1", "1e30", "5"] {
        let r = get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str()), ("x-echo-usage-raw", raw)]);
        assert_eq!(r.status, 200, "{raw}: {}", r.body);
    }
    let max = 1i64 << 53;
    let want_tokens = 2 * max + 5;
    poll_until("the meter's tokens", Duration::from_secs(20), || meter_field(redis, "acme", "tokens") == Some(want_tokens));
    assert_eq!(meter_field(redis, "acme", "ok"), Some(4));
    let budget = || -> Option<i64> {
        let mut c = redis.connection()?;
        let keys: Vec<String> = redis::cmd("KEYS").arg("q:tokens:*").query(&mut c).ok()?;
        redis::cmd("GET").arg(keys.first()?).query(&mut c).ok()
    };
    poll_until("four reservations reconciled", Duration::from_secs(20), || {
        sidecar.metric("tollgate_sidecar_completions_total{outcome=\"reconciled\"}") == 4
    });
    assert_eq!(budget(), Some(want_tokens), "the budget moved by the clamped counts");
    assert_eq!(envoy.counter("wasmcustom.tollgate.tokens.clamped"), 3, "{}", envoy.stats("tollgate."));
    assert_eq!(envoy.counter("wasmcustom.tollgate.usage.flush_errors"), 0, "{}", envoy.stats("tollgate."));
    assert_eq!(envoy.counter("wasmcustom.tollgate.completions.flush_errors"), 0, "{}", envoy.stats("tollgate."));
    assert_eq!(sidecar.metric("tollgate_sidecar_usage_events_total{outcome=\"invalid\"}"), 0);
}

/// The filter's header edits touch only the headers it owns: every other one reaches the
/// upstream as the client sent it — bytes that are not UTF-8, repeated names in their order, a
/// long list of them — and each one it owns arrives exactly once, whatever the client sent under
/// that name, however often.
#[test]
fn client_headers_arrive_as_sent_and_owned_ones_exactly_once() {
    let g = Gateway::builder().build();
    let envoy = g.envoy();
    let key = g.sidecar().create_key("acme", "gold", &[]);
    let sent: Vec<(String, Vec<u8>)> = vec![
        ("user-agent".into(), b"curl\xff\xfe".to_vec()),
        ("x-dup".into(), b"1".to_vec()),
        ("x-tollgate-tenant".into(), b"evil".to_vec()),
        ("x-dup".into(), b"2".to_vec()),
        ("x-tollgate-tenant".into(), b"evil2".to_vec()),
        ("x-tollgate-key-id".into(), b"key_evil".to_vec()),
        ("x-api-key".into(), key.raw.as_bytes().to_vec()),
    ];
    let padding: Vec<(String, Vec<u8>)> = (0..60).map(|i| (format!("x-pad-{i}"), format!("v{i}\u{e9}").into_bytes())).collect();
    for extra in [0, padding.len()] {
        let headers: Vec<(&str, &[u8])> = sent.iter().chain(&padding[..extra]).map(|(n, v)| (n.as_str(), v.as_slice())).collect();
        // twice: the very first request asks the sidecar (the filter edits in the call's
        // callback), the others come from its auth cache (it edits in the request's callback)
        for attempt in 0..2 {
            let r = raw::get(envoy.port, b"/v1/items", &headers);
            assert_eq!(r.status, 200, "{extra} more headers, attempt {attempt}: {r:?}");
            let seen: tollgate_tests::Echoed = serde_json::from_slice(&r.body).expect("an echo");
            let values = |name: &str| -> Vec<&str> { seen.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect() };
            assert_eq!(values("user-agent"), ["curl\\xFF\\xFE"], "{seen:?}");
            assert_eq!(values("x-dup"), ["1", "2"], "{seen:?}");
            assert_eq!(values("x-tollgate-tenant"), ["acme"], "{seen:?}");
            assert_eq!(values("x-tollgate-key-id"), [key.id.as_str()], "{seen:?}");
            assert_eq!(values("x-tollgate-plan"), ["gold"], "{seen:?}");
            assert!(values("x-api-key").is_empty(), "{seen:?}");
            for (name, value) in &padding[..extra] {
                let want = String::from_utf8(value.clone()).expect("UTF-8");
                assert_eq!(values(name), [want.as_str()], "{seen:?}");
            }
        }
    }
    assert_eq!(envoy.counter_reaching("wasmcustom.tollgate.requests.allowed", 4), 4);
    assert!(envoy.counter("wasmcustom.tollgate.auth_cache.hits") >= 1, "the auth cache's path was taken");
}

/// The headers that speak for the gateway are the filter's alone (decision 129): an upstream that
/// sends a cache hit, a replay mark, a breaker target or RateLimit fields of its own never shows
/// them to the client; the filter's own arrive once. And a response the filter reads arrives
/// uncompressed.
#[test]
fn an_upstream_never_speaks_for_the_gateway() {
    let plugin = json!({"routing": {"enabled": true, "refreshInterval": "50ms"}});
    let g = gateway(&cache_sidecar_toml(100_000), plugin).build();
    let envoy = g.envoy();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let k = key.raw.as_bytes();
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&envoy.url("/warmup"), &[("x-api-key", &key.raw)]).status == 200);
    for (path, cache) in [(&b"/hello"[..], None), (b"/cached/spoof", Some("miss"))] {
        let r = raw::get(envoy.port, path, &[("x-api-key", k), ("x-echo-spoof", b"1")]);
        assert_eq!(r.status, 200, "{r:?}");
        let values = |name: &str| -> Vec<&str> { r.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect() };
        assert!(r.headers.iter().all(|(_, v)| !v.contains("evil")), "an upstream's header reached the client: {r:?}");
        assert!(values("idempotent-replayed").is_empty(), "{r:?}");
        assert_eq!(values("x-tollgate-cache"), cache.into_iter().collect::<Vec<_>>(), "{r:?}");
        assert_eq!(values("ratelimit").len(), 1, "the filter's one RateLimit field: {r:?}");
    }
    // a response the filter may store is asked for as the upstream writes it (decision 129)
    let r = raw::get(envoy.port, b"/cached/encoding", &[("x-api-key", k), ("accept-encoding", b"gzip, br")]);
    assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("miss")), "{r:?}");
    let seen: tollgate_tests::Echoed = serde_json::from_slice(&r.body).expect("an echo");
    assert_eq!(seen.header("accept-encoding"), None, "{seen:?}");
}

/// A header the gateway keys on, sent twice, is never resolved by a guess (decision 128): a cache
/// key header makes the request bypass the cache (the upstream sees both lines; the key could
/// hold one), a second `Idempotency-Key` is refused with 400 before anything runs.
#[test]
fn repeated_headers_the_gateway_keys_on_are_never_guessed() {
    let plugin = json!({"routing": {"enabled": true, "refreshInterval": "50ms"}, "idempotency": {"enabled": true}});
    let g = gateway(&cache_sidecar_toml(100_000), plugin).build();
    let envoy = g.envoy();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let k = key.raw.as_str();
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&envoy.url("/warmup"), &[("x-api-key", k)]).status == 200);
    let before = g.upstream().calls();
    for _ in 0..2 {
        let r = raw::request(envoy.port, "GET", "/cached/twice", &[("x-api-key", k), ("x-user", "bob"), ("x-user", "mallory")], b"");
        assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("bypass")), "{r:?}");
    }
    assert_eq!(g.upstream().calls() - before, 2, "neither served from the cache");
    let twice = [("x-api-key", k), ("content-type", "application/json"), ("idempotency-key", "\"a\""), ("idempotency-key", "\"b\"")];
    let r = raw::request(envoy.port, "POST", "/orders", &twice, b"{}");
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("invalid_idempotency_key")), "{r:?}");
    assert_eq!(g.upstream().calls() - before, 2, "the refused POST never reached the upstream");
}

/// HTTP/2 trailers end a request while it waits for its decision. Envoy takes the trailers
/// callback's "continue" as "go on" for the whole request: before the filter answered it itself
/// (the SDK's default is "continue"), any key — a made-up one too — reached the upstream
/// undecided when its request had trailers.
#[test]
fn a_request_with_trailers_waits_for_its_decision() {
    let toml = limit_toml("p", "pm", "fixed_window", 1_000_000, "window = \"60s\"");
    let g = gateway(&toml, json!({"tokenEstimateField": "max_tokens"})).build();
    let (port, key) = (g.envoy().port, g.sidecar().create_key("acme", "p", &[]));
    let send = |key: &str, content_type: &str, body: &[u8]| {
        let headers = [("x-api-key", key), ("content-type", content_type)];
        tollgate_tests::h2c::send_with_trailers(port, "POST", "/v1/chat", &headers, body, &[("x-checksum", "abc")])
    };
    let json_body = br#"{"max_tokens":16}"#;
    for (content_type, body) in [("text/plain", &b"hello"[..]), ("text/plain", b""), ("application/json", json_body)] {
        let before = g.upstream().calls();
        for i in 0..3 {
            let made_up = format!("tg_madeup{i}{content_type}{}", body.len()).replace('/', "");
            let r = send(&made_up, content_type, body);
            assert_eq!(r.status, 401, "{content_type} {body:?}: {}", String::from_utf8_lossy(&r.body));
        }
        assert_eq!(g.upstream().calls(), before, "{content_type}: a made-up key reached the upstream");
        let r = send(&key.raw, content_type, body);
        assert_eq!(r.status, 200, "{content_type}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(g.upstream().calls(), before + 1, "{content_type}: the key's request went on once");
    }
}
