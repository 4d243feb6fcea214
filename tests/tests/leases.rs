//! Functional tests of leased limits through real Envoys (issue 8): two replicas with their own
//! sidecars on one Redis never admit more than a leased limit while most requests pay no callout;
//! a window rollover admits again; revoking a key applies within about a second with leases warm.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tollgate_tests::redis::command_calls;
use tollgate_tests::{get, keyed_burst, poll_until, Envoy, Gateway, Redis, Sidecar};

/// One leased limit `name` of plan `p`: `algorithm` over `window`, `limit` units.
fn leased_plan(name: &str, algorithm: &str, limit: u64, window: &str) -> String {
    format!("[[plans.p.limits]]\nname = \"{name}\"\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nwindow = \"{window}\"\nmode = \"leased\"\n")
}

/// Decision calls a sidecar answered (requests and renewals), from its `/metrics`.
fn decide_calls(sidecar: &Sidecar) -> u64 {
    let text = get(&sidecar.url("/metrics"), &[]).body;
    let sum = |name: &str, filter: &dyn Fn(&str) -> bool| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(name) && filter(l))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    sum("tollgate_sidecar_decisions_total", &|_| true)
        + sum("tollgate_sidecar_leases_total", &|l| l.contains("call=\"renewal\""))
}

/// EVALSHA calls Redis served (limit round trips).
fn evalsha_calls(redis: &Redis) -> u64 {
    command_calls(&redis.commandstats(), "evalsha")
}

/// Fixed-window counters (`rl:` keys) and their values.
fn counters(redis: &Redis) -> Vec<(String, u64)> {
    redis.keys("rl:*").into_iter().map(|k| (k.clone(), redis.cmd(&["GET", &k]))).collect()
}

#[test]
fn two_replicas_never_admit_more_than_a_leased_limit_and_most_requests_pay_no_callout() {
    const LIMIT: usize = 1000;
    const REQUESTS: usize = 1200;
    const THREADS: usize = 16;
    let g = Gateway::builder().sidecar_toml(&leased_plan("total", "fixed_window", LIMIT as u64, "1h")).replicas(2).concurrency(2).build();
    let (a, b, redis) = (g.replica(0).sidecar(), g.replica(1).sidecar(), g.redis());
    let (envoy_a, envoy_b) = (g.replica(0).envoy(), g.replica(1).envoy());
    let key = a.create_key("acme", "p", &[]);
    let (calls_before, evalsha_before) = (decide_calls(a) + decide_calls(b), evalsha_calls(redis));

    let urls = [envoy_a.url("/"), envoy_b.url("/")];
    let statuses = keyed_burst(&urls, &key.raw, THREADS, REQUESTS / THREADS);
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    let calls = decide_calls(a) + decide_calls(b) - calls_before;
    let evalsha = evalsha_calls(redis) - evalsha_before;
    let allowed = |e: &Envoy| e.counter("wasmcustom.tollgate.requests.allowed");
    poll_until("both Envoys to count what they admitted", Duration::from_secs(10), || allowed(envoy_a) + allowed(envoy_b) >= ok as u64);
    let hits = envoy_a.counter("wasmcustom.tollgate.leases.hits") + envoy_b.counter("wasmcustom.tollgate.leases.hits");
    eprintln!(
        "leased: {ok} allowed, {limited} limited of {REQUESTS}; {calls} decision calls, {evalsha} EVALSHA, {hits} lease hits, counters {:?}",
        counters(redis)
    );
    assert_eq!(ok + limited, REQUESTS, "statuses: {statuses:?}");
    // Never over-admitted: what the upstream saw is what was allowed, and that is within the limit.
    assert!(ok <= LIMIT, "over-admission: {ok} > {LIMIT}");
    assert_eq!(g.upstream().calls() as usize, ok);
    assert!(counters(redis).iter().all(|(_, v)| *v as usize <= LIMIT));
    // At worst under-used by what is leased and unspent when the traffic ends.
    assert!(ok >= LIMIT / 2, "leases wasted most of the limit: {ok}");
    // Most requests paid no callout and no Redis round trip (denials still call, one each).
    assert!(calls < (REQUESTS / 2) as u64, "{calls} decision calls for {REQUESTS} requests");
    assert!(evalsha < (REQUESTS / 2) as u64, "{evalsha} EVALSHA for {REQUESTS} requests");
    assert!(hits as usize >= ok / 2, "{hits} lease hits for {ok} allowed");
    assert_eq!((allowed(envoy_a) + allowed(envoy_b)) as usize, ok);
    redis.assert_ttl_invariant();
}

#[test]
fn a_window_rollover_admits_again_and_no_window_is_over_admitted() {
    const LIMIT: u64 = 20;
    let g = Gateway::builder().sidecar_toml(&leased_plan("w", "fixed_window", LIMIT, "2s")).build();
    let (envoy, redis) = (g.envoy(), g.redis());
    let key = g.sidecar().create_key("acme", "p", &[]);
    let h = [("x-api-key", key.raw.as_str())];
    let mut allowed = 0u64;
    // Exhaust a window (fast enough that leases are granted)...
    poll_until("a 429", Duration::from_secs(20), || match get(&envoy.url("/"), &h).status {
        200 => {
            allowed += 1;
            false
        }
        429 => true,
        s => panic!("unexpected status {s}"),
    });
    // ...then the next window admits again.
    poll_until("a 200 in a later window", Duration::from_secs(10), || get(&envoy.url("/"), &h).status == 200);
    allowed += 1;
    for _ in 0..10 {
        if get(&envoy.url("/"), &h).status == 200 {
            allowed += 1;
        }
    }
    assert!(envoy.counter_reaching("wasmcustom.tollgate.leases.hits", 1) > 0, "leases were used");
    assert_eq!(g.upstream().calls(), allowed);
    let windows = counters(redis);
    assert!(windows.len() >= 2, "{windows:?}");
    // Each window's counter holds what it admitted plus what it leased: never over the limit.
    for (k, v) in &windows {
        assert!(*v <= LIMIT, "{k} = {v}");
    }
    assert!(allowed <= LIMIT * windows.len() as u64);
    redis.assert_ttl_invariant();
}

#[test]
fn revoking_a_key_applies_within_about_a_second_with_leases_warm() {
    let g = Gateway::builder().sidecar_toml(&leased_plan("big", "token_bucket", 1_000_000, "1h")).concurrency(2).build();
    let (envoy, sidecar) = (g.envoy(), g.sidecar());
    let key = sidecar.create_key("acme", "p", &[]);
    let stop = AtomicBool::new(false);
    let log: Mutex<Vec<(Instant, u16)>> = Mutex::new(Vec::new());
    let revoked_at = std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let status = get(&envoy.url("/"), &[("x-api-key", key.raw.as_str())]).status;
                    log.lock().unwrap().push((Instant::now(), status));
                }
            });
        }
        poll_until("leases to be warm", Duration::from_secs(20), || {
            envoy.counter("wasmcustom.tollgate.leases.hits") > 200 && envoy.counter("wasmcustom.tollgate.leases.renewals") > 0
        });
        sidecar.revoke_key(&key.id);
        let revoked_at = Instant::now();
        poll_until("requests to be refused", Duration::from_secs(10), || {
            log.lock().unwrap().iter().rev().take(20).filter(|(t, s)| *t > revoked_at && *s == 401).count() == 20
        });
        stop.store(true, Ordering::SeqCst);
        revoked_at
    });
    let log = log.into_inner().unwrap();
    assert!(log.iter().all(|(_, s)| *s == 200 || *s == 401), "only 200 and 401");
    let last_ok = log.iter().filter(|(_, s)| *s == 200).map(|(t, _)| *t).max().unwrap();
    let took = last_ok.saturating_duration_since(revoked_at);
    let served = log.len();
    eprintln!("revocation: last 200 {took:?} after the revoke; {served} requests, {} lease hits", envoy.counter("wasmcustom.tollgate.leases.hits"));
    // Bound: the sidecar's key cache (500 ms) + a lease's lifetime (500 ms); generous for noise.
    assert!(took < Duration::from_millis(2000), "a revoked key was admitted {took:?} after the revoke");
}
