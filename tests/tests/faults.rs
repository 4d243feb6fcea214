//! Functional tests of decisions under Redis faults (issue 15): a hung Redis (SIGSTOP: it keeps
//! accepting connections and answers nothing) must yield each limit's own failure mode and the
//! key cache's stale grace within the filter's callout timeout — never `sidecar_unavailable` —
//! and decisions come back soon after it answers again.

use serde_json::json;
use std::time::{Duration, Instant};
use tollgate_tests::redis::command_calls;
use tollgate_tests::{get, poll_until, Gateway, GatewayBuilder};

/// Two plans, one limit each: `open` fails open (the default), `closed` fails closed.
const PLANS: &str = "[[plans.open.limits]]\nname = \"o\"\nalgorithm = \"fixed_window\"\nlimit = 1000000\nwindow = \"60s\"\n\
                     [[plans.closed.limits]]\nname = \"c\"\nalgorithm = \"token_bucket\"\nlimit = 1000000\nfailure_mode = \"closed\"\n";

/// A gateway on `plans` whose sidecar gives each Redis command 200 ms and each decision 200 ms,
/// behind a filter that waits 350 ms for the sidecar and fails closed: one deadline per command
/// would overrun the filter's wait, the decision's budget does not.
fn redis_deadlines(plans: &str) -> GatewayBuilder {
    Gateway::builder()
        .sidecar_toml(plans)
        .sidecar_env("TOLLGATE_SIDECAR_REDIS__TIMEOUT", "200ms")
        .sidecar_env("TOLLGATE_SIDECAR_REDIS__DECISION_TIMEOUT", "200ms")
        .plugin(json!({"sidecar": {"timeout": "350ms"}, "failureMode": "closed"}))
}

#[test]
fn a_hung_redis_yields_each_limits_failure_mode_never_a_callout_timeout() {
    // Per-command deadlines long enough that one deadline per command (the key lookup, then the
    // limits script: 2 × 200 ms) overruns the filter's 350 ms; the decision's budget (200 ms in
    // all) does not. Long timeouts keep the test honest on a loaded 2-core machine.
    let g = redis_deadlines(PLANS).build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    // ready means connected, with the request path's scripts loaded (decide, complete, idem)
    let loads = command_calls(&redis.commandstats(), "script|load");
    assert!(loads >= 3, "scripts loaded before the sidecar reported healthy: {loads}");
    let open = sidecar.create_key("acme", "open", &[]);
    let closed = sidecar.create_key("acme", "closed", &[]);
    // a key no one has used yet: the sidecar has no cached record of it
    let fresh = sidecar.create_key("acme", "closed", &[]);
    let call = |raw: &str| get(&envoy.url("/"), &[("x-api-key", raw)]);
    // warm keys: the sidecar has their records cached
    for _ in 0..3 {
        assert_eq!(call(&open.raw).status, 200);
        assert_eq!(call(&closed.raw).status, 200);
    }

    redis.pause();
    // Traffic for 4 s (well past the key cache's 500 ms TTL, so the stale grace is exercised);
    // the loop is the traffic, not a wait.
    let started = Instant::now();
    let (mut open_n, mut closed_n) = (0, 0);
    while started.elapsed() < Duration::from_secs(4) {
        let r = call(&open.raw);
        assert_eq!(r.status, 200, "fail-open plan at {:?}: {}", started.elapsed(), r.body);
        assert_eq!(r.echoed().header("x-tollgate-tenant"), Some("acme"), "decided by the sidecar, not the filter's failure mode");
        let r = call(&closed.raw);
        assert_eq!(r.status, 503, "fail-closed plan at {:?}: {}", started.elapsed(), r.body);
        assert_eq!(r.json()["error"], "limits_unavailable", "at {:?}: {}", started.elapsed(), r.body);
        open_n += 1;
        closed_n += 1;
    }
    assert!(open_n >= 5 && closed_n >= 5, "traffic: {open_n} + {closed_n}");
    assert_eq!(envoy.counter("wasmcustom.tollgate.sidecar.errors"), 0, "no callout failed or timed out");
    let metrics = get(&sidecar.url("/metrics"), &[]).body;
    assert!(metrics.contains(r#"kind="fail_fast""#), "the sidecar stopped waiting on Redis:\n{metrics}");
    assert!(sidecar.log_text().contains("redis does not answer"));

    redis.resume();
    let resumed = Instant::now();
    loop {
        let r = call(&fresh.raw);
        if r.status == 200 {
            break;
        }
        assert!(resumed.elapsed() < Duration::from_secs(1), "a fresh key still not decided {:?} after SIGCONT: {} {}", resumed.elapsed(), r.status, r.body);
    }
    let r = call(&closed.raw);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("ratelimit-policy").is_some(), "limits checked again");
    assert!(sidecar.log_text().contains("redis answers again"));
}

/// Concurrent traffic while Redis hangs: the decisions that wait for their worker's batch
/// (decision 127), or ride its decision stream (decision 223), get each limit's failure mode like
/// lone ones — no batch or stream holds them past the
/// filter's timeout into `sidecar_unavailable` — and the same burst is decided normally once
/// Redis answers again. The filter waits 1 s here: what is checked is that batched decisions are
/// answered by the sidecar's Redis budget (200 ms), not the timeout's arithmetic on a loaded box.
#[test]
fn a_hung_redis_under_concurrent_traffic_gives_batched_decisions_their_limits_failure_mode() {
    if !tollgate_tests::wasm_host_only("decision batching is the Wasm host's (decision 257)") {
        return;
    }
    // the batches with the decision stream off, then the stream's messages (decision 223)
    for stream in [false, true] {
        hung_redis_under_concurrent_traffic(stream);
    }
}

fn hung_redis_under_concurrent_traffic(stream: bool) {
    let plugin = json!({"sidecar": {"timeout": "1s", "decisionStream": stream}, "failureMode": "closed"});
    let g = redis_deadlines(PLANS).plugin(plugin).build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    let open = sidecar.create_key("acme", "open", &[]);
    let closed = sidecar.create_key("acme", "closed", &[]);
    let call = |raw: &str| get(&envoy.url("/"), &[("x-api-key", raw)]);
    assert_eq!((call(&open.raw).status, call(&closed.raw).status), (200, 200));
    if stream {
        poll_until("the worker opened its decision stream", Duration::from_secs(20), || {
            envoy.counter("wasmcustom.tollgate.decisions.streams_opened") >= 1
        });
    }
    let rode = if stream { "wasmcustom.tollgate.decisions.streamed" } else { "wasmcustom.tollgate.decisions.batched" };
    // 16 clients, 4 requests each, half on each plan: (plan, status, error) of every answer
    let burst = || -> Vec<(&str, u16, String)> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..16)
                .map(|i| {
                    let (plan, raw) = if i % 2 == 0 { ("open", &open.raw) } else { ("closed", &closed.raw) };
                    s.spawn(move || {
                        (0..4)
                            .map(|_| {
                                let r = call(raw);
                                (plan, r.status, r.json()["error"].as_str().unwrap_or("").to_string())
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().flat_map(|t| t.join().unwrap()).collect()
        })
    };
    let rode_before = envoy.counter_reaching(rode, 0);
    redis.pause();
    for (plan, status, error) in burst() {
        match plan {
            "open" => assert_eq!(status, 200, "fail-open plan while Redis hangs: {error}"),
            _ => assert_eq!((status, error.as_str()), (503, "limits_unavailable"), "fail-closed plan while Redis hangs"),
        }
    }
    let rode_now = envoy.counter_reaching(rode, rode_before + 1) - rode_before;
    assert!(rode_now >= 1, "the burst's decisions rode {} ({rode_now})", if stream { "the stream" } else { "batches" });
    assert_eq!(envoy.counter("wasmcustom.tollgate.sidecar.errors"), 0, "no decision timed out or failed");
    redis.resume();
    poll_until("decisions with Redis again", Duration::from_secs(5), || call(&closed.raw).status == 200);
    let after = burst();
    assert!(after.iter().all(|(_, status, _)| *status == 200), "the same burst once Redis answers: {after:?}");
    eprintln!("{rode_now} decisions rode {} while Redis hung", if stream { "the stream" } else { "batches" });
}

/// `local` limits: 10 per hour as a token bucket (no window boundary to straddle; it refills 10
/// an hour, nothing within the test), and a leased fixed window of 40 a day.
const LOCAL_PLAN: &str = "[[plans.local.limits]]\nname = \"l\"\nalgorithm = \"token_bucket\"\nlimit = 10\nwindow = \"1h\"\nfailure_mode = \"local\"\n\
                          [[plans.leased.limits]]\nname = \"ll\"\nalgorithm = \"fixed_window\"\nlimit = 40\nwindow = \"24h\"\nmode = \"leased\"\nfailure_mode = \"local\"\n";

#[test]
fn a_hung_redis_lets_each_replica_enforce_its_share_of_a_local_limit() {
    // Two Envoys, each with its sidecar, on one Redis; the replica count is not configured: the
    // sidecars discover each other in Redis (`sidecars:live`) before it stops.
    let g = redis_deadlines(LOCAL_PLAN).replicas(2).build();
    let redis = g.redis();
    let replicas = [g.replica(0), g.replica(1)];
    for r in &replicas {
        poll_until("each sidecar counts 2 replicas", Duration::from_secs(10), || r.sidecar().metric("tollgate_sidecar_local_replicas") == 2);
    }
    let key = g.sidecar().create_key("acme", "local", &[]);
    // keys no one has used yet, one per replica
    let fresh = [g.sidecar().create_key("acme", "local", &[]), g.sidecar().create_key("acme", "local", &[])];
    let call = |i: usize, raw: &str| get(&replicas[i].envoy().url("/"), &[("x-api-key", raw)]);
    let leased = g.sidecar().create_key("acme", "leased", &[]);
    // warm: each sidecar has the keys' records cached (Redis' bucket takes these 2); each Envoy
    // holds a lease of the leased key's units
    for i in 0..2 {
        assert_eq!(call(i, &key.raw).status, 200);
        for _ in 0..5 {
            assert_eq!(call(i, &leased.raw).status, 200);
        }
    }

    redis.pause();
    // 3 s of traffic on both replicas (past the key cache's 500 ms TTL: the stale grace serves
    // the record, the limits cannot be checked); the loop is the traffic, not a wait.
    let started = Instant::now();
    let mut admitted = [0u32; 2];
    let mut denied = [0u32; 2];
    let mut leased_admitted = 0u64;
    while started.elapsed() < Duration::from_secs(3) {
        for i in 0..2 {
            let r = call(i, &leased.raw);
            match r.status {
                200 => leased_admitted += 1,
                429 => {}
                s => panic!("leased key, replica {i} at {:?}: {s} {}", started.elapsed(), r.body),
            }
            let r = call(i, &key.raw);
            match r.status {
                200 => admitted[i] += 1,
                429 => {
                    denied[i] += 1;
                    assert_eq!(r.json()["error"], "rate_limited", "{}", r.body);
                    assert!(r.header("retry-after").is_some() && r.header("ratelimit-policy").is_some(), "the usual 429 headers");
                }
                s => panic!("replica {i} at {:?}: {s} {}", started.elapsed(), r.body),
            }
        }
    }
    eprintln!("during the stop: admitted {admitted:?}, denied {denied:?}; leased key: {leased_admitted} admitted");
    assert!(admitted[0] + admitted[1] <= 10, "at most the limit across the replicas: {admitted:?}");
    assert!(admitted.iter().all(|a| *a >= 1), "each replica admitted its share, not closed: {admitted:?}");
    assert!(denied.iter().all(|d| *d >= 1), "each replica then denied: {denied:?}");
    for (i, r) in replicas.iter().enumerate() {
        let s = r.sidecar();
        let allowed = s.metric(r#"tollgate_sidecar_local_decisions_total{outcome="allowed"}"#);
        assert!(allowed > u64::from(admitted[i]), "replica {i}: the leased key was decided locally too once its lease ran out ({allowed})");
        assert!(s.metric(r#"tollgate_sidecar_local_decisions_total{outcome="denied"}"#) >= u64::from(denied[i]), "replica {i}");
        assert!(s.metric(r#"tollgate_sidecar_limits_unavailable_total{mode="local"}"#) >= u64::from(admitted[i] + denied[i]));
        assert_eq!(r.envoy().counter("wasmcustom.tollgate.sidecar.errors"), 0, "no callout failed or timed out");
    }

    redis.resume();
    let resumed = Instant::now();
    for (i, fresh) in fresh.iter().enumerate() {
        loop {
            let r = call(i, &fresh.raw);
            // Redis' bucket: 10 less this one, the first request Redis decided for this key (a
            // local answer would say 5 less those answered locally)
            if r.status == 200 && r.header("ratelimit").is_some_and(|h| h.starts_with("\"l\";r=9;")) {
                break;
            }
            assert!(resumed.elapsed() < Duration::from_secs(1), "replica {i}: a fresh key not decided {:?} after SIGCONT: {} {}", resumed.elapsed(), r.status, r.body);
        }
    }
    // The leased limit: what the Envoys held in leases when Redis stopped (taken in Redis before,
    // so in Redis' count now — read once it answers again: a renewal sent just before the stop
    // may have landed late) and then 2 × 20 locally. Redis' count minus the 10 warm requests
    // bounds the leases held (it may include a lease taken after the stop: a looser bound).
    let taken: u64 = redis.keys("rl:*").iter().map(|k| redis.cmd::<u64>(&["GET", k])).sum();
    eprintln!("leased key: {leased_admitted} admitted during the stop; Redis counts {taken} (10 warm)");
    assert!(leased_admitted <= taken - 10 + 40, "leased key: {leased_admitted} admitted with at most {} units held", taken - 10);
}

/// A limits script Redis runs only after the sidecar gave up on it (decision 137). The sidecar
/// sends the decision's script into a hung Redis, answers 503 `limits_unavailable` (fail closed)
/// when its deadline passes, and Redis runs the script once it is resumed: it takes a unit of the
/// day and the one concurrency slot for a request that was refused. The sidecar refunds it
/// itself from the record the script wrote; before, the tenant was locked out by that slot until
/// its timeout (300 s) and the refused request counted against its day. The same failing open.
#[test]
fn a_limits_script_that_runs_after_its_deadline_gives_back_what_it_took() {
    const PLAN: &str = "[[plans.capped.limits]]\nname = \"day\"\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"24h\"\nfailure_mode = \"closed\"\n\
                        [[plans.capped.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 1\nfailure_mode = \"closed\"\n\
                        [[plans.open-cap.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 1\n";
    // the key record stays fresh in the sidecar's cache: the one command sent into the hung
    // Redis is the limits script, not the key lookup
    let g = redis_deadlines(PLAN).sidecar_env("TOLLGATE_SIDECAR_CACHE__TTL", "60s").build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    let key = sidecar.create_key("acme", "capped", &[]);
    let call = || get(&envoy.url("/"), &[("x-api-key", key.raw.as_str())]);
    let held = || -> (usize, usize) {
        let slots: usize = redis.keys("q:conc:*").iter().map(|k| redis.cmd::<usize>(&["ZCARD", k])).sum();
        (slots, redis.keys("dec:*").len())
    };
    assert_eq!(call().status, 200, "1 of 2 today");
    poll_until("the first request's slot to be freed by its completion", Duration::from_secs(10), || held() == (0, 0));

    redis.pause();
    let r = call();
    // the refund waits for Redis: operators see it waiting
    poll_until("the late refund to be shown waiting", Duration::from_secs(10), || sidecar.metric("tollgate_sidecar_late_refunds_pending{source=\"timeout\"}") == 1);
    redis.resume();
    assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("limits_unavailable")), "fail closed while Redis hangs: {}", r.body);
    poll_until("the late script to be refunded", Duration::from_secs(20), || {
        sidecar.metric("tollgate_sidecar_late_refunds_total{source=\"timeout\",outcome=\"refunded\"}") == 1
    });
    assert_eq!(sidecar.metric("tollgate_sidecar_late_refunds_pending{source=\"timeout\"}"), 0, "nothing waits any more");
    assert_eq!(held(), (0, 0), "the slot and the decision's record are gone");
    let day: Vec<i64> = redis.keys("rl:*day*").iter().map(|k| redis.cmd::<i64>(&["GET", k])).collect();
    assert_eq!(day, vec![1], "the refused request is not counted against the day");
    let r = call();
    assert_eq!(r.status, 200, "the slot is free and the day has room: {}", r.body);
    poll_until("the second request's slot to be freed", Duration::from_secs(10), || held() == (0, 0));
    let r = call();
    assert_eq!(r.status, 429, "2 of 2 today: the limit still holds: {}", r.body);

    // Failing open, the request goes through uncounted, like every one failed fast meanwhile; its
    // late take is given back too: the slot no completion would free (the answer had no ticket)
    let open = sidecar.create_key("acme", "open-cap", &[]);
    let call = || get(&envoy.url("/"), &[("x-api-key", open.raw.as_str())]);
    assert_eq!(call().status, 200);
    poll_until("the slot to be freed by its completion", Duration::from_secs(10), || held() == (0, 0));
    redis.pause();
    let r = call();
    redis.resume();
    assert_eq!((r.status, r.header("ratelimit-policy")), (200, None), "fail open while Redis hangs: {}", r.body);
    poll_until("the second late script to be refunded", Duration::from_secs(20), || {
        sidecar.metric("tollgate_sidecar_late_refunds_total{source=\"timeout\",outcome=\"refunded\"}") == 2
    });
    assert_eq!(held(), (0, 0), "no slot left behind");
    let r = call();
    assert_eq!(r.status, 200, "the cap of 1 is free: {}", r.body);
}

/// A Redis connection whose peer vanished without a reset (a host or a NAT entry gone, an
/// address moved): the sidecar's commands time out on it and nothing ever closes it. While it
/// fails fast, the sidecar tries a new connection and keeps it once it answers (decision 140);
/// before, single mode stayed on the dead one until TCP gave up, minutes later.
#[test]
fn a_redis_connection_gone_silent_is_replaced_by_one_that_answers() {
    let redis = tollgate_tests::redis::Redis::start();
    let relay = tollgate_tests::relay::Relay::start(redis.port);
    let g = redis_deadlines(PLANS)
        .sidecar_env("TOLLGATE_SIDECAR_REDIS__URL", &relay.url())
        .plugin(json!({"sidecar": {"timeout": "1s"}, "failureMode": "closed"}))
        .build();
    let (envoy, sidecar) = (g.envoy(), g.sidecar());
    let closed = sidecar.create_key("acme", "closed", &[]);
    let call = || get(&envoy.url("/"), &[("x-api-key", closed.raw.as_str())]);
    assert_eq!(call().status, 200, "through the relay");
    relay.stall();
    let r = call();
    assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("limits_unavailable")), "the silent connection times out: {}", r.body);
    poll_until("decisions on a new connection", Duration::from_secs(15), || call().status == 200);
    let r = call();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("ratelimit-policy").is_some(), "limits checked in Redis again");
    assert_eq!(sidecar.metric("tollgate_sidecar_redis_connections_replaced_total"), 1);
    assert!(sidecar.log_text().contains("redis answers on a new connection"));
}

/// Decision 188: an idempotency outcome Redis could not take is tried again for as long as its
/// claim can live — the configured `[responses] idempotency_in_flight` from the outcome's first
/// try — not a fixed 5 minutes. Here the setting is 2 s and Redis stays down: the sidecar gives
/// the outcome up within seconds. Before, it tried for 5 minutes whatever the setting, so with a
/// setting above 5 minutes an outcome Redis could take back after the fifth minute was lost, and
/// the client's retry ran the operation again once the claim expired.
#[test]
fn an_outcome_redis_could_not_take_is_tried_for_the_configured_in_flight_ttl() {
    use tollgate_tests::fixtures::{cache_plugin, cache_sidecar_toml};
    let toml = cache_sidecar_toml(1000) + "\n[responses]\nidempotency_in_flight = \"2s\"\n";
    let mut g = Gateway::builder().sidecar_toml(&toml).plugin(cache_plugin()).build();
    let acme = g.sidecar().create_key("acme", "p", &[]).raw;
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&g.envoy().url("/warmup"), &[("x-api-key", &acme)]).status == 200);
    let url = g.envoy().url("/orders");
    let h = [("x-api-key", acme.as_str()), ("content-type", "application/json"), ("idempotency-key", "\"gone-1\""), ("x-echo-delay-ms", "1500")];
    let first = std::thread::scope(|s| {
        let request = s.spawn(|| tollgate_tests::post(&url, &h, r#"{"item":"cup"}"#));
        poll_until("the claim in Redis", Duration::from_secs(10), || !g.redis().keys("idem:*").is_empty());
        g.redis_mut().kill();
        request.join().unwrap()
    });
    assert_eq!(first.status, 200, "{}", first.body);
    let retried = |outcome: &str| g.sidecar().metric(&format!("tollgate_sidecar_idempotency_outcome_retries_total{{outcome=\"{outcome}\"}}"));
    poll_until("the outcome given up after the in-flight TTL", Duration::from_secs(60), || retried("gave_up") == 1);
    assert_eq!((retried("stored"), retried("dropped")), (0, 0));
}
