//! `tollgate-bench cache`: what a response-cache hit costs next to a miss and an uncached route
//! (issue 7): Envoy CPU per request (`/proc`) and client latency, interleaved rounds of
//! sequential requests on one keep-alive connection (so that connection setup does not dominate
//! Envoy's CPU per request). One Envoy (`--concurrency 1`), one sidecar, the local echo upstream,
//! a plan with one fixed-window limit (every request makes the decision call). Options:
//! `--requests N` per kind per round (1500), `--rounds N` (3).

use crate::{arg, cpu_us};
use std::time::{Duration, Instant};
use tollgate_tests::fixtures::{cache_plugin, cache_sidecar_toml};
use tollgate_tests::{get, poll_until, Gateway};

pub fn run() {
    let n: usize = arg("--requests", 1500);
    let rounds: usize = arg("--rounds", 3);
    // the functional cache tests' gateway, with a limit that never runs out
    let g = Gateway::builder().sidecar_toml(&cache_sidecar_toml(1_000_000)).plugin(cache_plugin()).build();
    let key = g.sidecar().create_key("acme", "p", &[]).raw;
    let hit_url = g.envoy().url("/cached/hot");
    // the routing table reached the filter, then the hot response is stored
    poll_until("the routing table in the filter", Duration::from_secs(20), || {
        get(&hit_url, &[("x-api-key", &key)]).status == 200
    });
    poll_until("the hot response cached", Duration::from_secs(20), || !g.redis().keys("cache:exact:{acme}:*").is_empty());
    let pid = g.envoy().pid();
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut miss_i = 0;
    for round in 0..rounds {
        for kind in ["hit", "miss", "uncached"] {
            let cpu0 = cpu_us(pid);
            let t0 = Instant::now();
            let mut lat = Vec::with_capacity(n);
            for _ in 0..n {
                let url = match kind {
                    "hit" => hit_url.clone(),
                    "miss" => {
                        miss_i += 1;
                        g.envoy().url(&format!("/cached/m{miss_i}"))
                    }
                    _ => g.envoy().url("/plain"),
                };
                let s = Instant::now();
                let mut r = agent.get(&url).header("x-api-key", &key).call().expect("request");
                let _ = r.body_mut().read_to_string();
                lat.push(s.elapsed().as_micros() as f64);
                // a measurement of something else is no measurement
                assert_eq!(r.status().as_u16(), 200, "{kind}");
                if kind == "hit" {
                    assert_eq!(r.headers().get("x-tollgate-cache").and_then(|v| v.to_str().ok()), Some("hit"));
                }
            }
            let wall = t0.elapsed().as_secs_f64();
            let us_per_req = (cpu_us(pid) - cpu0) / n as f64;
            lat.sort_by(f64::total_cmp);
            println!(
                "round {round} {kind:>8}: {:.0} req/s sequential, p50 {:.0} µs, p99 {:.0} µs, Envoy CPU {us_per_req:.0} µs/req",
                n as f64 / wall,
                lat[n / 2],
                lat[n * 99 / 100]
            );
        }
    }
}
