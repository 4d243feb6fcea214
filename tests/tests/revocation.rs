//! Revocation reaching every replica's own state (issue 15.5), with real processes: two Envoys
//! (two workers each) and their sidecars on one Redis. For 20 keys of each kind — a plan without
//! limits (answered from the filter's auth cache), a leased limit (spent from the Envoy's lease)
//! and an exact limit (a decision call per request) — traffic runs on both Envoys until the key's
//! state is warm there, the key is revoked through the admin API, and each Envoy is polled until
//! it answers 401. Every revocation must be seen on both replicas within 2 s (a bound for a noisy
//! machine, not the goal); p50/p99/max per kind, from the admin API's answer to the first 401 on
//! each replica, are printed.
//!
//! The sidecar's key cache and the filter's auth cache are given 5 s TTLs here, so an expiry
//! cannot make a revocation effective in time: only the change count (`GET /v1/changes`, polled
//! by the filter) and the sidecar's pub/sub eviction can. The figures are therefore those of the
//! change path; with the default 500 ms TTLs a revocation can only come sooner. A second test
//! turns the change poll off and keeps the default TTLs: revocations then end with the caches'
//! lifetimes (README: ≤ 1 s; checked against the same 2 s bound).

use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tollgate_tests::fixtures::limit_toml;
use tollgate_tests::{default_plugin, get, send, Envoy, Gateway};

const TOKEN: &str = "test-admin-token-0123456789";
const ROUNDS: usize = 20;
const BOUND: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Plan `open`: no limits, the filter's auth cache answers.
    NoLimits,
    /// Plan `leased`: a leased token bucket, the Envoy's lease answers.
    Leased,
    /// Plan `exact`: an exact fixed window, every request is a decision call.
    Exact,
}

impl Kind {
    fn plan(self) -> &'static str {
        match self {
            Kind::NoLimits => "open",
            Kind::Leased => "leased",
            Kind::Exact => "exact",
        }
    }

    /// The Envoy counter that shows the key's state is reused there (none for exact limits).
    fn reuse_counter(self) -> Option<&'static str> {
        match self {
            Kind::NoLimits => Some("wasmcustom.tollgate.auth_cache.hits"),
            Kind::Leased => Some("wasmcustom.tollgate.leases.hits"),
            Kind::Exact => None,
        }
    }
}

/// Answers cached 5 s; plan `leased` leases a big bucket, plan `exact` counts every request.
fn sidecar_toml() -> String {
    let big = |plan: &str, algorithm: &str, extra: &str| limit_toml(plan, "big", algorithm, 1_000_000, &format!("window = \"1h\"\n{extra}"));
    ["[cache]\nttl = \"5s\"\n".to_string(), big("leased", "token_bucket", "mode = \"leased\""), big("exact", "fixed_window", "")].concat()
}

/// What one poller saw on one Envoy.
#[derive(Default)]
struct Seen {
    ok: AtomicU64,
    first_401: Mutex<Option<Instant>>,
    other: Mutex<Vec<u16>>,
}

/// One revocation of a fresh key of `kind`: the time from the admin API's answer to the first 401
/// on each Envoy.
fn revoke_once(g: &Gateway, envoys: [&Envoy; 2], kind: Kind) -> [Duration; 2] {
    let key = g.sidecar().create_key("acme", kind.plan(), &[]);
    let before: Vec<u64> = envoys.iter().map(|e| kind.reuse_counter().map_or(0, |c| e.counter(c))).collect();
    let seen = [Seen::default(), Seen::default()];
    let stop = AtomicBool::new(false);
    let revoked_at = std::thread::scope(|s| {
        for (envoy, seen) in envoys.iter().zip(&seen) {
            let (url, key, stop) = (envoy.url("/"), key.raw.as_str(), &stop);
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                    let status = get(&url, &[("x-api-key", key)]).status;
                    match status {
                        200 => {
                            seen.ok.fetch_add(1, Ordering::SeqCst);
                        }
                        401 => {
                            *seen.first_401.lock().unwrap() = Some(Instant::now());
                            return;
                        }
                        s => seen.other.lock().unwrap().push(s),
                    }
                }
            });
        }
        // warm: both Envoys admitted the key, and reuse its state (auth cache, lease)
        let warm_by = Instant::now() + Duration::from_secs(20);
        loop {
            let warm = envoys.iter().zip(&seen).zip(&before).all(|((e, seen), before)| {
                seen.ok.load(Ordering::SeqCst) >= 20 && kind.reuse_counter().is_none_or(|c| e.counter(c) > *before + 10)
            });
            if warm {
                break;
            }
            if Instant::now() > warm_by {
                stop.store(true, Ordering::SeqCst);
                panic!("{kind:?}: the key's state never became warm on both Envoys");
            }
            std::thread::sleep(Duration::from_millis(10)); // the poll interval of a deadline-bounded wait
        }
        let r = send(
            "POST",
            &format!("{}/v1/keys/{}/revoke", g.replica(0).admin(), key.id),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            None,
        );
        let at = Instant::now();
        assert_eq!(r.status, 200, "{}", r.body);
        // the pollers stop at their first 401, or give up after their deadline
        at
    });
    let mut took = [Duration::ZERO; 2];
    for (i, seen) in seen.iter().enumerate() {
        let other = seen.other.lock().unwrap();
        assert!(other.is_empty(), "{kind:?}: Envoy {i} answered {other:?}");
        let first = seen.first_401.lock().unwrap().unwrap_or_else(|| panic!("{kind:?}: Envoy {i} never answered 401"));
        took[i] = first.saturating_duration_since(revoked_at);
        assert!(took[i] <= BOUND, "{kind:?}: Envoy {i} saw the revocation only after {:?}", took[i]);
    }
    took
}

/// The `q` quantile (nearest rank) of `v` (sorted), in ms.
fn quantile(v: &[Duration], q: f64) -> f64 {
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i].as_secs_f64() * 1000.0
}

#[test]
fn revocations_reach_both_replicas_filters_for_every_kind_of_key() {
    let mut plugin = default_plugin();
    plugin["authCacheMaxTtl"] = json!("5s");
    let g = Gateway::builder().sidecar_toml(&sidecar_toml()).admin_api(TOKEN).plugin(plugin).replicas(2).concurrency(2).build();
    let envoys = [g.replica(0).envoy(), g.replica(1).envoy()];
    let mut report = Vec::new();
    for kind in [Kind::NoLimits, Kind::Leased, Kind::Exact] {
        let mut all: Vec<Duration> = (0..ROUNDS).flat_map(|_| revoke_once(&g, envoys, kind)).collect();
        all.sort();
        report.push(format!(
            "{kind:?}: {} revocations × 2 replicas: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            ROUNDS,
            quantile(&all, 0.5),
            quantile(&all, 0.99),
            quantile(&all, 1.0)
        ));
    }
    for line in &report {
        eprintln!("revocation latency, admin API answer → first 401: {line}");
    }
}

#[test]
fn without_the_change_poll_revocations_still_end_with_the_caches_lifetimes() {
    // README: a replica that misses the change path still sees a revocation "within one sidecar
    // cache TTL plus one lease lifetime (≤ 1 s)". Here the filters' change poll is off and every
    // TTL is its default (500 ms): the filter's cached answers and leases must end by expiry.
    // The bound checked is BOUND (2 s: the promise plus this noisy machine's slack); with the
    // poll off and 5 s TTLs the test above takes ~5 s, so an answer kept past its TTL fails here.
    let mut plugin = default_plugin();
    plugin["changes"] = json!({"enabled": false});
    let toml = sidecar_toml().replace("[cache]\nttl = \"5s\"\n", "");
    let g = Gateway::builder().sidecar_toml(&toml).admin_api(TOKEN).plugin(plugin).replicas(2).concurrency(2).build();
    let envoys = [g.replica(0).envoy(), g.replica(1).envoy()];
    for kind in [Kind::NoLimits, Kind::Leased, Kind::Exact] {
        let mut all: Vec<Duration> = (0..5).flat_map(|_| revoke_once(&g, envoys, kind)).collect();
        all.sort();
        eprintln!("without the change poll, {kind:?}: 5 revocations × 2 replicas, max {:.1} ms", quantile(&all, 1.0));
    }
}
