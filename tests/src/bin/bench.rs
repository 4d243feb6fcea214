//! `tollgate-bench`: Envoy alone vs Envoy + Tollgate (auth cache on; off = one callout per
//! request; auth + one exact rate limit = one callout and one EVALSHA per request), measured in
//! one run, interleaved.
//! `tollgate-bench`: Envoy alone vs Envoy + Tollgate (auth cache on, and off = one callout per
//! request; and auth cache on with a circuit breaker on the upstream), measured in one run,
//! interleaved.
//!
//! Every configuration runs against the same in-process echo upstream; Envoy runs with
//! `--concurrency 1` pinned to CPU 0 and wrk (`-t1`) pinned to CPU 1; the sidecar, Redis and the
//! upstream share the machine. Rounds alternate the configurations so that machine noise hits
//! both alike. Prints a table and writes `.tollgate/bench/summary.json`.
//!
//! `tollgate-auth+usage` adds usage metering (one event per request, batched to a sidecar that
//! spools and ships to tansu); its sidecar CPU column is that sidecar's (spool + Kafka producer).
//!
//! Options: `--duration SECS` (default 10), `--rounds N` (default 2), `--connections N` (16).

use std::process::Command;
use tollgate_tests::{get, root, start_echo, Envoy, EnvoyOptions, Redis, Sidecar};

#[derive(Default, Clone, serde::Serialize)]
struct Sample {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    envoy_cpu_us_per_req: f64,
    sidecar_cpu_us_per_req: f64,
    redis_cmds_per_req: f64,
    redis_scripts_per_req: f64,
    requests: u64,
    non_2xx: u64,
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// utime + stime of a process, in microseconds.
fn cpu_us(pid: Option<u32>) -> f64 {
    let Some(pid) = pid else { return 0.0 };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ticks * 1_000_000.0 / 100.0 // USER_HZ = 100 on Linux
}

/// (all commands, EVALSHA calls) from `INFO commandstats`. Commands run inside a script count
/// in the first figure too; the second is the number of script round trips.
fn redis_calls(redis: &Redis) -> (f64, f64) {
    let Some(mut c) = redis.connection() else { return (0.0, 0.0) };
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut c).unwrap_or_default();
    let calls = |l: &str| l.split("calls=").nth(1)?.split(',').next()?.parse::<f64>().ok();
    let all = info
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info"))
        .filter_map(calls)
        .sum();
    let evalsha = info.lines().filter(|l| l.starts_with("cmdstat_evalsha:")).filter_map(calls).sum();
    (all, evalsha)
}

fn wrk(url: &str, key: Option<&str>, secs: u64, conns: u64) -> (f64, f64, f64, f64, u64, u64) {
    let lua = root().join("target/bench-percentiles.lua");
    std::fs::write(
        &lua,
        "done = function(summary, latency, requests)\n\
         io.write(string.format(\"P50 %d\\nP99 %d\\nP999 %d\\nREQS %d\\n\", latency:percentile(50), latency:percentile(99), latency:percentile(99.9), summary.requests))\n\
         end\n",
    )
    .expect("write wrk script");
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", "1", "wrk", "-t1", &format!("-c{conns}"), &format!("-d{secs}s"), "-s"]).arg(&lua);
    if let Some(k) = key {
        cmd.args(["-H", &format!("x-api-key: {k}")]);
    }
    let out = cmd.arg(url).output().expect("run wrk (apt-get install wrk)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let field = |p: &str| text.lines().find_map(|l| l.strip_prefix(p)).map(|v| v.trim().to_string()).unwrap_or_default();
    let rps = field("Requests/sec:").parse().unwrap_or(0.0);
    let us = |p: &str| field(p).parse::<f64>().unwrap_or(f64::NAN) / 1000.0;
    let non2xx = field("Non-2xx or 3xx responses:").parse().unwrap_or(0);
    (rps, us("P50 "), us("P99 "), us("P999 "), field("REQS ").parse().unwrap_or(0), non2xx)
}

fn main() {
    let secs = arg("--duration", 10);
    let rounds = arg("--rounds", 2);
    let conns = arg("--connections", 16);

    let upstream = start_echo();
    let redis = Redis::start();
    // "limited": one rate limit that never runs out, so every request pays the full limit path.
    let sidecar = Sidecar::start_with_config(
        &redis.url(),
        "[[plans.limited.limits]]\nname = \"per-minute\"\nalgorithm = \"fixed_window\"\nlimit = 1000000000\nwindow = \"60s\"\n\
         [[plans.leased.limits]]\nname = \"per-minute\"\nalgorithm = \"fixed_window\"\nlimit = 1000000000\nwindow = \"60s\"\nmode = \"leased\"\n\
         [[plans.budget.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 1000000000000\nestimate = 10\n",
        &[("TOLLGATE_SIDECAR_LOG__LEVEL", "warn")],
    );
    let key = sidecar.create_key("bench", "bench", &[]);
    let limited_key = sidecar.create_key("bench", "limited", &[]);
    // "leased": the same limit with mode = "leased" (issue 8): requests spend this Envoy's lease.
    let leased_key = sidecar.create_key("bench", "leased", &[]);
    // "budget": a token budget, so every request holds a reservation and reports its completion
    // (batched by the filter, settled by complete.lua).
    let budget_key = sidecar.create_key("bench", "budget", &[]);
    let baseline = Envoy::start(EnvoyOptions { cpu: Some(0), ..EnvoyOptions::new(upstream.port, 0).baseline() });
    let tollgate = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(r#"{"sidecar":{"timeout":"25ms"},"failureMode":"closed"}"#)
    });
    // The same filter with its auth cache off: one callout per request.
    let callout = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, sidecar.port)
            .plugin_config(r#"{"sidecar":{"timeout":"25ms"},"failureMode":"closed","authCacheMaxTtl":"0ms"}"#)
    });
    // The same filter with a circuit breaker guarding the upstream cluster (closed: the request
    // path reads the breaker's shared state; no callout), and the hint poller ticking.
    let breaker = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(
            r#"{"sidecar":{"timeout":"25ms"},"failureMode":"closed",
                "breakers":{"targets":[{"name":"bench","cluster":"upstream","provider":"bench","model":"m"}]}}"#,
        )
    });
    for e in [&tollgate, &callout, &breaker] {
        assert_eq!(get(&e.url("/"), &[("x-api-key", &key.raw)]).status, 200, "tollgate stack not answering");
    }
    // Usage metering (issue 6): the auth-cache configuration plus one usage event per request,
    // batched per worker (POST /v1/usage every second) to a second sidecar that spools and ships
    // them to a real broker (tansu).
    let broker = tollgate_tests::broker::Broker::start();
    let spool = tempfile::tempdir().expect("tempdir");
    let usage_sidecar = Sidecar::start_with_config(
        &redis.url(),
        &format!(
            "[usage]\nenabled = true\nspool_dir = \"{}\"\n[usage.kafka]\nbrokers = \"{}\"\n",
            spool.path().display(),
            broker.brokers()
        ),
        &[("TOLLGATE_SIDECAR_LOG__LEVEL", "warn")],
    );
    let metered = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, usage_sidecar.port)
            .plugin_config(r#"{"sidecar":{"timeout":"25ms"},"failureMode":"closed","usage":{"enabled":true}}"#)
    });
    assert_eq!(get(&metered.url("/"), &[("x-api-key", &key.raw)]).status, 200, "metered stack not answering");

    let configs: [(&str, &Envoy, Option<&str>); 8] = [
        ("envoy-alone", &baseline, None),
        ("tollgate-auth", &tollgate, Some(key.raw.as_str())),
        ("tollgate-auth-callout-every-request", &callout, Some(key.raw.as_str())),
        ("tollgate-auth+rate-limit", &tollgate, Some(limited_key.raw.as_str())),
        ("tollgate-auth+leased-limit", &tollgate, Some(leased_key.raw.as_str())),
        ("tollgate-auth-breaker", &breaker, Some(key.raw.as_str())),
        ("tollgate-auth+token-budget+completion", &tollgate, Some(budget_key.raw.as_str())),
        ("tollgate-auth+usage", &metered, Some(key.raw.as_str())),
    ];
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); configs.len()];
    eprintln!("benchmark: {rounds} interleaved rounds x {secs}s, wrk -t1 -c{conns}, Envoy --concurrency 1 on CPU 0, wrk on CPU 1");
    for round in 0..rounds {
        for (i, (name, envoy, key)) in configs.iter().enumerate() {
            // warm-up (connections, caches)
            let _ = wrk(&envoy.url("/bench"), *key, 1, conns);
            // the metered Envoy talks to its own sidecar (the one that spools and ships)
            let spid = if *name == "tollgate-auth+usage" { usage_sidecar.pid() } else { sidecar.pid() };
            let (e0, s0, r0) = (cpu_us(envoy.pid()), cpu_us(spid), redis_calls(&redis));
            let (rps, p50, p99, p999, reqs, non2xx) = wrk(&envoy.url("/bench"), *key, secs, conns);
            // Completion reports are settled after the responses: wait until Redis is quiet so
            // that this configuration's work is counted here and not in the next one's.
            let mut last = redis_calls(&redis).0;
            for _ in 0..50 {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let now = redis_calls(&redis).0;
                if now == last {
                    break;
                }
                last = now;
            }
            let (e1, s1, r1) = (cpu_us(envoy.pid()), cpu_us(spid), redis_calls(&redis));
            let n = reqs.max(1) as f64;
            let s = Sample {
                rps,
                p50_ms: p50,
                p99_ms: p99,
                p999_ms: p999,
                envoy_cpu_us_per_req: (e1 - e0) / n,
                sidecar_cpu_us_per_req: if key.is_some() { (s1 - s0) / n } else { 0.0 },
                redis_cmds_per_req: if key.is_some() { (r1.0 - r0.0) / n } else { 0.0 },
                redis_scripts_per_req: if key.is_some() { (r1.1 - r0.1) / n } else { 0.0 },
                requests: reqs,
                non_2xx: non2xx,
            };
            eprintln!("round {} {:<36} {:>9.0} rps  p50 {:.2} ms  p99 {:.2} ms  non-2xx {}", round + 1, name, s.rps, s.p50_ms, s.p99_ms, s.non_2xx);
            samples[i].push(s);
        }
    }

    let mean = |v: &[Sample], f: fn(&Sample) -> f64| v.iter().map(f).sum::<f64>() / v.len().max(1) as f64;
    let base_rps = mean(&samples[0], |s| s.rps);
    let base_p50 = mean(&samples[0], |s| s.p50_ms);
    let base_p99 = mean(&samples[0], |s| s.p99_ms);
    println!("\n| configuration | throughput (rps) | vs Envoy alone | p50 ms | p99 ms | p99.9 ms | Envoy CPU µs/req | sidecar CPU µs/req | Redis cmds/req | Redis scripts/req |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut summary = Vec::new();
    for (i, (name, _, _)) in configs.iter().enumerate() {
        let v = &samples[i];
        let rps = mean(v, |s| s.rps);
        let row = serde_json::json!({
            "name": name,
            "throughput_rps": rps,
            "ratio_to_envoy_alone": rps / base_rps,
            "p50_ms": mean(v, |s| s.p50_ms),
            "p99_ms": mean(v, |s| s.p99_ms),
            "p999_ms": mean(v, |s| s.p999_ms),
            "added_p50_ms": mean(v, |s| s.p50_ms) - base_p50,
            "added_p99_ms": mean(v, |s| s.p99_ms) - base_p99,
            "envoy_cpu_us_per_req": mean(v, |s| s.envoy_cpu_us_per_req),
            "sidecar_cpu_us_per_req": mean(v, |s| s.sidecar_cpu_us_per_req),
            "redis_cmds_per_req": mean(v, |s| s.redis_cmds_per_req),
            "redis_scripts_per_req": mean(v, |s| s.redis_scripts_per_req),
            "non_2xx": v.iter().map(|s| s.non_2xx).sum::<u64>(),
            "rounds": v,
        });
        println!(
            "| {} | {:.0} | {:.2}× | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.3} | {:.3} |",
            name,
            rps,
            rps / base_rps,
            mean(v, |s| s.p50_ms),
            mean(v, |s| s.p99_ms),
            mean(v, |s| s.p999_ms),
            mean(v, |s| s.envoy_cpu_us_per_req),
            mean(v, |s| s.sidecar_cpu_us_per_req),
            mean(v, |s| s.redis_cmds_per_req),
            mean(v, |s| s.redis_scripts_per_req)
        );
        summary.push(row);
    }
    let dir = root().join(".tollgate/bench");
    let _ = std::fs::create_dir_all(&dir);
    let doc = serde_json::json!({
        "method": format!("{rounds} interleaved rounds x {secs}s; wrk -t1 -c{conns} (closed loop) on CPU 1; Envoy --concurrency 1 on CPU 0"),
        "configurations": summary,
    });
    let _ = std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(&doc).unwrap_or_default());
    println!("\nwrote .tollgate/bench/summary.json");
    drop((tollgate, callout, breaker, metered, baseline, sidecar, usage_sidecar, broker, redis, upstream));
}

