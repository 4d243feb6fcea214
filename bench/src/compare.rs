//! `tollgate-bench` (no subcommand): Envoy alone vs Envoy's native C++ rate limiter vs Envoy +
//! Tollgate in several configurations, measured in one run, interleaved (docs/benchmarks.md).
//!
//! Two phases, each in interleaved rounds (round 1: A, B, C, …; round 2: A, B, C, …) so that
//! machine noise hits every configuration alike:
//! 1. Saturation (closed loop): wrk `-t1 -cC` for `--duration` seconds → throughput, and CPU per
//!    request of Envoy and of the sidecar (`/proc/<pid>/stat`), Redis commands and scripts per
//!    request (`INFO commandstats`).
//! 2. Latency (open loop): oha at a fixed rate — `--rate-fraction` (0.5) of Envoy alone's mean
//!    saturation throughput of phase 1, the same rate for every configuration — with latency
//!    correction (a request's latency counts from when it was due, so a stalled server cannot
//!    hide its stall by slowing the client down: no coordinated omission) → p50/p99/p99.9 and the
//!    latency added to Envoy alone's. A configuration whose saturation throughput is below that
//!    rate cannot sustain it: it is marked `overloaded` and its latencies are queueing, not cost.
//!
//! Placement: Envoys `--concurrency 1` on CPU 0, wrk and oha on CPU 1, the rest floats. Prints
//! its tables and writes `.tollgate/bench/summary.json`.
//!
//! Options (docs/benchmarks.md, "End to end"): `--duration`, `--rounds`, `--connections`,
//! `--rate-fraction`/`--rate`, `--only`, `--compare-wasm PATH` (each Tollgate configuration also
//! on an Envoy loading that build of the filter, `NAME@compare`, measured next to it, in turn
//! first), `--saturation-only`, `--zipf-keys N`/`--zipf-s S` (the population of
//! `tollgate-full-policy-leased-zipf`), `--cpu-split` (`perf` samples of each saturation round:
//! where Envoy's CPU goes, crate::profile). The `wasm-floor-*` filters do nothing (crate::floors).

use crate::load::{oha, wrk, OpenLoop, ZipfClient};
use crate::profile::Recording;
use crate::limitador::Beside;
use crate::{arg, arg_str, args, cpu_us, redis_calls, settle};
use serde_json::{json, Value};
use tollgate_tests::{get, root, start_echo, Envoy, EnvoyOptions, Redis, Sidecar, SidecarTransport};

/// One closed-loop (saturation) measurement.
#[derive(Default, Clone, serde::Serialize)]
struct Saturation {
    rps: f64,
    /// wrk's latencies, under saturation (not the open-loop figures).
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    envoy_cpu_us_per_req: f64,
    sidecar_cpu_us_per_req: f64,
    redis_cmds_per_req: f64,
    redis_scripts_per_req: f64,
    requests: u64,
    non_2xx: u64,
    /// Decisions that rode a batch, per request (decision 127), and their mean batch size.
    batched_per_req: f64,
    mean_batch: f64,
    /// Envoy's heap and resident set after the round (`crate::envoy_memory_mb`), in MB.
    envoy_heap_mb: f64,
    envoy_rss_mb: f64,
    /// `--cpu-split`: where Envoy's CPU went in this round (crate::profile).
    cpu_split: Option<crate::profile::Split>,
}

/// The filter's counters of decision batches (decision 127), as Envoy names them.
const DECISION_BATCHES: &str = "wasmcustom.tollgate.decisions.batches";
const DECISIONS_BATCHED: &str = "wasmcustom.tollgate.decisions.batched";

/// A configuration under test: which Envoy, which key, which sidecar serves it.
struct Config<'a> {
    name: String,
    what: &'static str,
    envoy: &'a Envoy,
    key: Option<&'a str>,
    /// The service beside Envoy whose CPU the configuration also costs (a sidecar, Limitador).
    sidecar: Option<&'a dyn Beside>,
    /// Each request's key drawn from the Zipf population instead of `key` (saturation only).
    zipf: bool,
}

/// Plan "limited": one rate limit that never runs out, so every request pays the full limit path.
pub const LIMITED_PLAN: &str =
    "[[plans.limited.limits]]\nname = \"per-minute\"\nalgorithm = \"fixed_window\"\nlimit = 1000000000\nwindow = \"60s\"\n";
/// Plan "leased": the same limit, leased: most requests spend this Envoy's lease, no callout.
pub const LEASED_PLAN: &str =
    "[[plans.leased.limits]]\nname = \"per-minute\"\nalgorithm = \"fixed_window\"\nlimit = 1000000000\nwindow = \"60s\"\nmode = \"leased\"\n";

/// The plugin configuration of a Tollgate Envoy under load: a 25 ms sidecar timeout, failing
/// closed, and `extra`'s fields.
fn plugin(extra: Value) -> Value {
    let mut config = json!({"sidecar": {"timeout": "25ms"}, "failureMode": "closed"});
    if let (Some(config), Value::Object(extra)) = (config.as_object_mut(), extra) {
        config.extend(extra);
    }
    config
}

/// A breaker guarding the `upstream` cluster (closed all along under this load).
pub fn breaker_target() -> Value {
    json!({"name": "bench", "cluster": "upstream", "provider": "bench", "model": "m"})
}

fn mean<T>(v: &[T], f: impl Fn(&T) -> f64) -> f64 {
    v.iter().map(f).sum::<f64>() / v.len().max(1) as f64
}

/// The comparison run (options in the module documentation).
pub fn run() {
    let secs: u64 = arg("--duration", 10);
    let rounds: u64 = arg("--rounds", 2);
    let conns: u64 = arg("--connections", 16);
    let rate_fraction: f64 = arg("--rate-fraction", 0.5);
    let fixed_rate: Option<f64> = arg_str("--rate").and_then(|v| v.parse().ok());
    let cpu_split = args().iter().any(|a| a == "--cpu-split");
    let only: Option<Vec<String>> = arg_str("--only").map(|v| v.split(',').map(str::to_string).collect());
    if !args().iter().any(|a| a == "--saturation-only") {
        // before minutes of saturation rounds, not after them
        crate::load::require_oha();
    }

    let upstream = start_echo();
    let redis = Redis::start();
    let (limited_plan, leased_plan) = (LIMITED_PLAN, LEASED_PLAN);
    let sidecar = Sidecar::start_with_config(
        &redis.url(),
        &format!(
            "[plans.bench]\n{limited_plan}{leased_plan}[[plans.budget.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 1000000000000\nestimate = 10\n"
        ),
        &[("TOLLGATE_SIDECAR_LOG__LEVEL", "warn")],
    );
    // "bench": a plan without limits (auth only)
    let key = sidecar.create_key("bench", "bench", &[]);
    let limited_key = sidecar.create_key("bench", "limited", &[]);
    // "leased": the same limit with mode = "leased" (issue 8): requests spend this Envoy's lease.
    let leased_key = sidecar.create_key("bench", "leased", &[]);
    // "budget": a token budget, so every request holds a reservation and reports its completion
    // (batched by the filter, settled by complete.lua).
    let budget_key = sidecar.create_key("bench", "budget", &[]);
    let baseline = Envoy::start(EnvoyOptions { cpu: Some(0), ..EnvoyOptions::new(upstream.port, 0).baseline() });
    // Envoy's own C++ local rate limiter (a token bucket that never runs dry): the floor.
    let native = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        template: "envoy/local_ratelimit.yaml.tmpl",
        ..EnvoyOptions::new(upstream.port, 0)
    });
    let tollgate = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(plugin(json!({})))
    });
    // The same filter with its auth cache off: one callout per request.
    let callout = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, sidecar.port)
            .plugin_config(plugin(json!({"authCacheMaxTtl": "0ms"})))
    });
    // The same filter with a circuit breaker guarding the upstream cluster (closed: the request
    // path reads the breaker's shared state; no callout), and the hint poller ticking.
    let breaker = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(plugin(json!({"breakers": {"targets": [breaker_target()]}})))
    });
    for e in [&tollgate, &callout, &breaker] {
        assert_eq!(get(&e.url("/"), &[("x-api-key", &key.raw)]).status, 200, "tollgate stack not answering");
    }
    assert_eq!(get(&native.url("/"), &[]).status, 200, "native local_ratelimit stack not answering");
    const NATIVE_OK: &str = "http_local_rate_limiter.http_local_rate_limit.ok";
    const NATIVE_LIMITED: &str = "http_local_rate_limiter.http_local_rate_limit.rate_limited";
    assert!(native.counter(NATIVE_OK) >= 1, "the native local_ratelimit filter did not run (no {NATIVE_OK})");

    // Usage metering (issue 6): events batched per worker (POST /v1/usage every second) to a
    // second sidecar that spools and ships them to a real broker (tansu). It also knows the
    // "limited" plan, for the full policy path.
    let broker = tollgate_tests::broker::Broker::start();
    // A metering sidecar: both plans, one route for everything, usage spooled under `spool` and
    // shipped to the broker, and `extra` TOML.
    let metering_sidecar = |spool: &std::path::Path, extra: &str| {
        Sidecar::start_with_config(
            &redis.url(),
            &format!(
                "{limited_plan}{leased_plan}[[routes]]\nid = \"bench\"\ncluster = \"upstream\"\n[routes.match]\npath_prefix = \"/\"\n\
                 [usage]\nenabled = true\nspool_dir = \"{}\"\n[usage.kafka]\nbrokers = \"{}\"\n{extra}",
                spool.display(),
                broker.brokers()
            ),
            &[("TOLLGATE_SIDECAR_LOG__LEVEL", "warn")],
        )
    };
    let spool = tempfile::tempdir().expect("tempdir");
    let usage_sidecar = metering_sidecar(spool.path(), "");
    let metered = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, usage_sidecar.port)
            .plugin_config(plugin(json!({"usage": {"enabled": true}})))
    });
    assert_eq!(get(&metered.url("/"), &[("x-api-key", &key.raw)]).status, 200, "metered stack not answering");
    // The full policy path in one Envoy: key auth, one exact rate limit (the "limited" key: one
    // callout and one decide.lua per request), a circuit breaker on the upstream, usage metering.
    //
    // Routing is on: the sidecar's table (one route for everything, to `upstream`, guarded by the
    // breaker target of that cluster) is matched locally on every request.
    let full_policy_config = plugin(json!({
        "breakers": {"targets": [breaker_target()]},
        "usage": {"enabled": true},
        "routing": {"enabled": true},
    }));
    let full = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, usage_sidecar.port).plugin_config(full_policy_config.clone())
    });
    tollgate_tests::poll_until("the full policy stack's routing table", std::time::Duration::from_secs(10), || {
        get(&full.url("/"), &[("x-api-key", &limited_key.raw)]).status == 200
    });

    // Many keys (issue 16): `--zipf-keys` (100,000) keys of tenant "bench" on the leased plan,
    // requests spread over them by a Zipf law of exponent `--zipf-s` (1.1), on the full policy
    // path. 0 keys: not measured.
    let zipf_keys: usize = arg("--zipf-keys", 100_000);
    let zipf = (zipf_keys > 0).then(|| {
        let started = std::time::Instant::now();
        let keys = crate::zipf::seed_keys(&redis, zipf_keys, "bench", "leased");
        eprintln!("wrote {zipf_keys} keys into Redis in {:.1}s", started.elapsed().as_secs_f64());
        ZipfClient { script: crate::zipf::wrk_script(), keys, s: arg("--zipf-s", 1.1) }
    });

    // The same full policy path on a third sidecar whose per-tenant series are off
    // (`telemetry.per_tenant = false`): the A/B of what the issue-17 metrics cost (the filter's
    // share of them — the usage event's duration, the traceparent — is in both).
    let bare_spool = tempfile::tempdir().expect("tempdir");
    let bare_sidecar = metering_sidecar(bare_spool.path(), "[telemetry]\nper_tenant = false\n");
    let full_bare = Envoy::start(EnvoyOptions {
        cpu: Some(0),
        ..EnvoyOptions::new(upstream.port, bare_sidecar.port).plugin_config(full_policy_config)
    });
    // Polled with the exact key, like `full`: a leased key's first request here would start its
    // lease record long before the measurement, and an idle-then-busy record is slow to lease
    // (docs/benchmarks.md): the A/B would measure that, not the series.
    tollgate_tests::poll_until("the full policy stack without per-tenant series", std::time::Duration::from_secs(10), || {
        get(&full_bare.url("/"), &[("x-api-key", &limited_key.raw)]).status == 200
    });

    // The two callout-bound configurations again, with the filter reaching the sidecar by each
    // transport explicitly (docs/benchmarks.md, "Transport"); started only when selected.
    const TRANSPORTS: [(SidecarTransport, &str, &str, &str); 4] = [
        (SidecarTransport::Http1Tcp, "h1-tcp", "tollgate-auth+rate-limit-h1-tcp", "tollgate-auth-callout-every-request-h1-tcp"),
        (SidecarTransport::Http2Tcp, "h2", "tollgate-auth+rate-limit-h2", "tollgate-auth-callout-every-request-h2"),
        (SidecarTransport::Http1Unix, "uds", "tollgate-auth+rate-limit-uds", "tollgate-auth-callout-every-request-uds"),
        (SidecarTransport::Http2Unix, "h2-uds", "tollgate-auth+rate-limit-h2-uds", "tollgate-auth-callout-every-request-h2-uds"),
    ];
    let selected = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let mut by_transport: Vec<(&'static str, &'static str, Envoy, Envoy)> = Vec::new();
    for (transport, _, limit_name, callout_name) in TRANSPORTS {
        if !(selected(limit_name) || selected(callout_name)) {
            continue;
        }
        let start = |config: Value| {
            Envoy::start(EnvoyOptions {
                cpu: Some(0),
                ..EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(config).sidecar_transport(transport)
            })
        };
        let limit_envoy = start(plugin(json!({})));
        let callout_envoy = start(plugin(json!({"authCacheMaxTtl": "0ms"})));
        for (e, k) in [(&limit_envoy, &limited_key.raw), (&callout_envoy, &key.raw)] {
            assert_eq!(get(&e.url("/"), &[("x-api-key", k)]).status, 200, "{limit_name}: the tollgate stack is not answering");
        }
        by_transport.push((limit_name, callout_name, limit_envoy, callout_envoy));
    }

    // What a filter that does nothing costs, on the SDK and on the bare ABI (crate::floors).
    let floors = crate::floors::start(tollgate.options(), selected);
    // The peer: Envoy's C++ rate limit filter calling Limitador (crate::limitador).
    let peers = crate::limitador::start(upstream.port, &redis, &limited_key.raw, selected);

    let mut all = vec![
        Config { name: "envoy-alone".to_string(), what: "router only", envoy: &baseline, key: None, sidecar: None, zipf: false },
        Config { name: "envoy+native-local-ratelimit".to_string(), what: "Envoy's C++ local_ratelimit (never denies)", envoy: &native, key: None, sidecar: None, zipf: false },
        Config { name: "tollgate-auth".to_string(), what: "key auth, filter's auth cache answers", envoy: &tollgate, key: Some(key.raw.as_str()), sidecar: Some(&sidecar), zipf: false },
        Config { name: "tollgate-auth-callout-every-request".to_string(), what: "key auth, no auth cache: one callout", envoy: &callout, key: Some(key.raw.as_str()), sidecar: Some(&sidecar), zipf: false },
        Config { name: "tollgate-auth+rate-limit".to_string(), what: "auth + one exact limit: callout + EVALSHA", envoy: &tollgate, key: Some(limited_key.raw.as_str()), sidecar: Some(&sidecar), zipf: false },
        Config { name: "tollgate-auth+leased-limit".to_string(), what: "auth + one leased limit: most requests spend the lease", envoy: &tollgate, key: Some(leased_key.raw.as_str()), sidecar: Some(&sidecar), zipf: false },
        Config { name: "tollgate-auth-breaker".to_string(), what: "auth cache + closed breaker", envoy: &breaker, key: Some(key.raw.as_str()), sidecar: Some(&sidecar), zipf: false },
        Config { name: "tollgate-auth+token-budget+completion".to_string(), what: "auth + token budget + batched completion", envoy: &tollgate, key: Some(budget_key.raw.as_str()), sidecar: Some(&sidecar), zipf: false },
        Config { name: "tollgate-auth+usage".to_string(), what: "auth cache + usage metering", envoy: &metered, key: Some(key.raw.as_str()), sidecar: Some(&usage_sidecar), zipf: false },
        Config { name: "tollgate-full-policy".to_string(), what: "auth + one exact limit + routing + breaker + usage", envoy: &full, key: Some(limited_key.raw.as_str()), sidecar: Some(&usage_sidecar), zipf: false },
        Config { name: "tollgate-full-policy-leased".to_string(), what: "auth + one leased limit + routing + breaker + usage", envoy: &full, key: Some(leased_key.raw.as_str()), sidecar: Some(&usage_sidecar), zipf: false },
    ];
    // Right after Envoy alone and the native limiter: the references side by side.
    for (i, f) in floors.iter().enumerate() {
        all.insert(2 + i, Config { name: f.name.to_string(), what: f.what, envoy: &f.envoy, key: None, sidecar: None, zipf: false });
    }
    for p in &peers {
        all.push(Config { name: p.name.to_string(), what: p.what, envoy: &p.envoy, key: Some(limited_key.raw.as_str()), sidecar: Some(&p.service), zipf: false });
    }
    all.push(Config { name: "tollgate-full-policy-leased-no-tenant-metrics".to_string(), what: "the full leased path, the sidecar's per-tenant series off", envoy: &full_bare, key: Some(leased_key.raw.as_str()), sidecar: Some(&bare_sidecar), zipf: false });
    if zipf.is_some() {
        all.push(Config { name: "envoy-alone-zipf-client".to_string(), what: "router only, driven by the Zipf client script: the load generator's own limit", envoy: &baseline, key: None, sidecar: None, zipf: true });
        all.push(Config { name: "tollgate-full-policy-leased-zipf".to_string(), what: "the full leased path, each request's key drawn from the Zipf population", envoy: &full, key: None, sidecar: Some(&usage_sidecar), zipf: true });
    }
    for (limit_name, callout_name, limit_envoy, callout_envoy) in &by_transport {
        all.push(Config { name: limit_name.to_string(), what: "auth + one exact limit, by this transport", envoy: limit_envoy, key: Some(limited_key.raw.as_str()), sidecar: Some(&sidecar), zipf: false });
        all.push(Config { name: callout_name.to_string(), what: "key auth, no auth cache, by this transport", envoy: callout_envoy, key: Some(key.raw.as_str()), sidecar: Some(&sidecar), zipf: false });
    }
    // A/B: the same Tollgate configurations on Envoys that load another build of the filter.
    let compare_wasm = arg_str("--compare-wasm");
    let twin = |e: &Envoy| -> Option<Envoy> {
        let wasm = compare_wasm.as_ref()?;
        let mut opts = e.options().clone();
        opts.vars.push(("WASM_PATH", std::fs::canonicalize(wasm).expect("--compare-wasm: no such file").display().to_string()));
        Some(Envoy::start(opts))
    };
    let twins: Vec<(String, Option<Envoy>)> = [
        (&tollgate, "tollgate"),
        (&callout, "callout"),
        (&breaker, "breaker"),
        (&metered, "metered"),
        (&full, "full"),
    ]
    .iter()
    .map(|(e, n)| (n.to_string(), twin(e)))
    .collect();
    let twin_of = |n: &str| twins.iter().find(|(t, _)| t == n).and_then(|(_, e)| e.as_ref());
    let envoy_name = |e: &Envoy| -> &'static str {
        [(&tollgate, "tollgate"), (&callout, "callout"), (&breaker, "breaker"), (&metered, "metered"), (&full, "full")]
            .iter()
            .find(|(x, _)| std::ptr::eq(*x, e))
            .map_or("", |(_, n)| n)
    };
    let mut compared = Vec::new();
    for c in &all {
        if let Some(t) = twin_of(envoy_name(c.envoy)) {
            compared.push(Config { name: format!("{}@compare", c.name), what: c.what, envoy: t, key: c.key, sidecar: c.sidecar, zipf: c.zipf });
        }
    }
    all.extend(compared);
    let configs: Vec<&Config> =
        all.iter()
            .filter(|c| {
                let plain = c.name.trim_end_matches("@compare");
                c.name == "envoy-alone" || selected(plain)
            })
            .collect();

    // An A/B's twins run back to back, and in turn first (round 1: A, A@compare; round 2:
    // A@compare, A): this machine's slow spells last minutes, and hit both builds alike this way.
    let order = |round: u64| -> Vec<usize> {
        let mut v = Vec::new();
        for (i, c) in configs.iter().enumerate().filter(|(_, c)| !c.name.ends_with("@compare")) {
            match configs.iter().position(|t| t.name == format!("{}@compare", c.name)) {
                Some(j) if round % 2 == 1 => v.extend([j, i]),
                Some(j) => v.extend([i, j]),
                None => v.push(i),
            }
        }
        v
    };

    // ---- phase 1: saturation (closed loop) ----
    let mut sat: Vec<Vec<Saturation>> = vec![Vec::new(); configs.len()];
    eprintln!(
        "phase 1, saturation: {rounds} interleaved rounds x {secs}s, wrk -t1 -c{conns} on CPU 1, Envoy --concurrency 1 on CPU 0"
    );
    for round in 0..rounds {
        for i in order(round) {
            let c = configs[i];
            let url = c.envoy.url("/bench");
            // settle, then warm up right before measuring (a lease expires within 500 ms of the
            // last request: a pause would measure its slow start again)
            settle(&redis);
            let z = zipf.as_ref().filter(|_| c.zipf);
            let _ = wrk(&url, c.key, z, 2, conns);
            let spid = c.sidecar.and_then(|s| s.pid());
            let batching = || (c.envoy.counter(DECISION_BATCHES), c.envoy.counter(DECISIONS_BATCHED));
            let (e0, s0, r0, b0) = (cpu_us(c.envoy.pid()), cpu_us(spid), redis_calls(&redis), batching());
            let perf = c.envoy.pid().filter(|_| cpu_split).and_then(|pid| Recording::start(pid, &format!("{}-{}", c.name, round + 1)));
            let (rps, p50, p99, p999, reqs, non2xx) = wrk(&url, c.key, z, secs, conns);
            let cpu_split = perf.and_then(Recording::finish);
            settle(&redis);
            let (e1, s1, r1, b1) = (cpu_us(c.envoy.pid()), cpu_us(spid), redis_calls(&redis), batching());
            let n = reqs.max(1) as f64;
            let s = Saturation {
                rps,
                p50_ms: p50,
                p99_ms: p99,
                p999_ms: p999,
                envoy_cpu_us_per_req: (e1 - e0) / n,
                sidecar_cpu_us_per_req: (s1 - s0) / n,
                redis_cmds_per_req: if c.key.is_some() || c.sidecar.is_some() { (r1.0 - r0.0) / n } else { 0.0 },
                redis_scripts_per_req: if c.key.is_some() || c.sidecar.is_some() { (r1.1 - r0.1) / n } else { 0.0 },
                requests: reqs,
                non_2xx: non2xx,
                batched_per_req: (b1.1 - b0.1) as f64 / n,
                mean_batch: (b1.1 - b0.1) as f64 / (b1.0 - b0.0).max(1) as f64,
                cpu_split,
                ..Default::default()
            };
            let (s_heap, s_rss) = crate::envoy_memory_mb(c.envoy);
            let s = Saturation { envoy_heap_mb: s_heap, envoy_rss_mb: s_rss, ..s };
            eprintln!(
                "round {} {:<38} {:>9.0} rps  Envoy {:>4.0} µs/req  batched {:.2}/req (batches of {:.1})  non-2xx {}",
                round + 1,
                c.name,
                s.rps,
                s.envoy_cpu_us_per_req,
                s.batched_per_req,
                s.mean_batch,
                s.non_2xx
            );
            sat[i].push(s);
        }
    }
    let base_rps = mean(&sat[0], |s| s.rps);

    // ---- phase 2: latency at a fixed rate (open loop) ----
    let rate = fixed_rate.unwrap_or((base_rps * rate_fraction).max(1.0)).round();
    let mut open: Vec<Vec<OpenLoop>> = vec![Vec::new(); configs.len()];
    eprintln!(
        "phase 2, open loop: {rounds} interleaved rounds x {secs}s at {rate:.0} rps ({}), oha -c{conns} --latency-correction on CPU 1",
        if fixed_rate.is_some() { "--rate".to_string() } else { format!("{rate_fraction} x Envoy alone's {base_rps:.0} rps") }
    );
    let open_rounds = if args().iter().any(|a| a == "--saturation-only") { 0 } else { rounds };
    for round in 0..open_rounds {
        for i in order(round) {
            let c = configs[i];
            if c.zipf {
                continue; // oha sends one set of headers: the Zipf client is wrk's script only
            }
            let url = c.envoy.url("/bench");
            settle(&redis);
            let _ = oha(&url, c.key, 2, conns, rate); // warm-up at the same rate, right before
            let spid = c.sidecar.and_then(|s| s.pid());
            let (e0, s0) = (cpu_us(c.envoy.pid()), cpu_us(spid));
            let Some(mut o) = oha(&url, c.key, secs, conns, rate) else { continue };
            settle(&redis);
            let (e1, s1) = (cpu_us(c.envoy.pid()), cpu_us(spid));
            let n = o.requests.max(1) as f64;
            o.envoy_cpu_us_per_req = (e1 - e0) / n;
            o.sidecar_cpu_us_per_req = (s1 - s0) / n;
            eprintln!(
                "round {} {:<38} {:>7.0} rps  p50 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  non-2xx {} errors {}",
                round + 1,
                c.name,
                o.achieved_rps,
                o.p50_ms,
                o.p99_ms,
                o.p999_ms,
                o.non_2xx,
                o.errors
            );
            open[i].push(o);
        }
    }

    // ---- report ----
    let base_open = (mean(&open[0], |o| o.p50_ms), mean(&open[0], |o| o.p99_ms), mean(&open[0], |o| o.p999_ms));
    let base_cpu = mean(&sat[0], |s| s.envoy_cpu_us_per_req);
    let mut summary = Vec::new();
    let mut sat_table = vec![
        "| configuration | throughput (rps) | vs Envoy alone | Envoy CPU µs/req (its core busy) | vs Envoy alone | sidecar (or the peer's service) CPU µs/req | Redis cmds/req | Redis scripts/req | batched decisions/req (mean batch) | Envoy heap / RSS MB (end) | non-2xx |".to_string(),
        "|---|---|---|---|---|---|---|---|---|---|---|".to_string(),
    ];
    let mut lat_table = vec![
        format!("| configuration (open loop, {rate:.0} rps) | p50 ms | p99 ms | p99.9 ms | added p50 ms | added p99 ms | added p99.9 ms | achieved rps |"),
        "|---|---|---|---|---|---|---|---|".to_string(),
    ];
    for (i, c) in configs.iter().enumerate() {
        let (s, o) = (&sat[i], &open[i]);
        let rps = mean(s, |x| x.rps);
        let cpu = mean(s, |x| x.envoy_cpu_us_per_req);
        let (p50, p99, p999) = (mean(o, |x| x.p50_ms), mean(o, |x| x.p99_ms), mean(o, |x| x.p999_ms));
        let achieved = mean(o, |x| x.achieved_rps);
        // Cannot sustain the rate: saturation throughput below it, or the run fell short of it.
        let overloaded = rps < rate || (!o.is_empty() && achieved < 0.95 * rate);
        let mut row = json!({
            "name": c.name,
            "what": c.what,
            "throughput_rps": rps,
            "ratio_to_envoy_alone": rps / base_rps,
            "latency": {
                "rate_rps": rate,
                "achieved_rps": achieved,
                "p50_ms": p50,
                "p99_ms": p99,
                "p999_ms": p999,
                "added_p50_ms": p50 - base_open.0,
                "added_p99_ms": p99 - base_open.1,
                "added_p999_ms": p999 - base_open.2,
                "ratio_p50_to_envoy_alone": p50 / base_open.0,
                "ratio_p99_to_envoy_alone": p99 / base_open.1,
                "overloaded": overloaded,
                "envoy_cpu_us_per_req": mean(o, |x| x.envoy_cpu_us_per_req),
                "sidecar_cpu_us_per_req": mean(o, |x| x.sidecar_cpu_us_per_req),
            },
            "saturation_latency": {
                "p50_ms": mean(s, |x| x.p50_ms),
                "p99_ms": mean(s, |x| x.p99_ms),
                "p999_ms": mean(s, |x| x.p999_ms),
            },
            "envoy_cpu_us_per_req": cpu,
            "envoy_cpu_ratio_to_envoy_alone": cpu / base_cpu,
            // the share of its core Envoy used while wrk ran (CPU µs per request × requests per s)
            "envoy_core_busy": cpu * rps / 1e6,
            "sidecar_cpu_us_per_req": mean(s, |x| x.sidecar_cpu_us_per_req),
            "redis_cmds_per_req": mean(s, |x| x.redis_cmds_per_req),
            "redis_scripts_per_req": mean(s, |x| x.redis_scripts_per_req),
            "batched_decisions_per_req": mean(s, |x| x.batched_per_req),
            "mean_decision_batch": mean(s, |x| x.mean_batch),
            "envoy_memory_mb_at_end": s.last().map(|x| json!({"heap": x.envoy_heap_mb, "rss": x.envoy_rss_mb})),
            "non_2xx": s.iter().map(|x| x.non_2xx).sum::<u64>() + o.iter().map(|x| x.non_2xx).sum::<u64>(),
            "errors": o.iter().map(|x| x.errors).sum::<u64>(),
            "rounds": {"saturation": s, "open_loop": o},
        });
        sat_table.push(format!(
            "| {} | {:.0} | {:.2}× | {:.0} ({:.0}%) | {:.2}× | {:.0} | {:.3} | {:.3} | {:.2} ({:.1}) | {:.1} / {:.1} | {} |",
            c.name,
            rps,
            rps / base_rps,
            cpu,
            cpu * rps / 1e4,
            cpu / base_cpu,
            mean(s, |x| x.sidecar_cpu_us_per_req),
            mean(s, |x| x.redis_cmds_per_req),
            mean(s, |x| x.redis_scripts_per_req),
            mean(s, |x| x.batched_per_req),
            mean(s, |x| x.mean_batch),
            s.last().map_or(0.0, |x| x.envoy_heap_mb),
            s.last().map_or(0.0, |x| x.envoy_rss_mb),
            row["non_2xx"]
        ));
        if c.zipf {
            row["latency"] = Value::Null;
            summary.push(row);
            continue; // saturation only
        }
        if o.is_empty() || open[0].is_empty() {
            // no open-loop round of it (or of Envoy alone) measured: never a row of zeros
            row["latency"] = Value::Null;
            lat_table.push(format!("| {} | – | – | – | – | – | – | not measured (see the rounds' errors above) |", c.name));
            summary.push(row);
            continue;
        }
        lat_table.push(format!(
            "| {}{} | {:.3} | {:.3} | {:.3} | {:+.3} | {:+.3} | {:+.3} | {:.0} |",
            c.name,
            if overloaded { " (overloaded†)" } else { "" },
            p50,
            p99,
            p999,
            p50 - base_open.0,
            p99 - base_open.1,
            p999 - base_open.2,
            achieved
        ));
        summary.push(row);
    }
    let native_limited = native.counter(NATIVE_LIMITED);
    println!("\nSaturation (wrk, closed loop; CPU and Redis per request measured here)\n");
    println!("{}", sat_table.join("\n"));
    let idle = summary.iter().filter(|r| r["envoy_core_busy"].as_f64().is_some_and(|b| b < 0.9)).count();
    if idle > 0 {
        println!("\n{idle} configuration(s) where Envoy used less than 90% of its core (softirqs, unpinned processes or waits took the rest):");
        println!("their throughput ratios mix those in; compare Envoy CPU per request (docs/benchmarks.md, \"What the throughput ratio measures\").");
    }
    if cpu_split {
        let rows: Vec<_> = configs.iter().zip(&sat).map(|(c, s)| (c.name.clone(), s.iter().map(|x| (x.envoy_cpu_us_per_req, x.cpu_split)).collect())).collect();
        println!("\nWhere Envoy's CPU goes (--cpu-split: perf samples of each saturation round, by DSO; µs per request)\n");
        println!("{}", crate::profile::table(&rows).join("\n"));
    }
    if open_rounds > 0 {
        println!("\nLatency at a fixed rate (oha, open loop, latency-corrected)\n");
        println!("{}", lat_table.join("\n"));
    }
    if open_rounds > 0 && summary.iter().any(|r| r["latency"]["overloaded"] == true) {
        println!("\n† saturation throughput below the rate: the latencies are queueing, not the cost of the path.");
    }
    if native_limited > 0 {
        println!("\nwarning: the native local_ratelimit denied {native_limited} requests: its bucket is too small for this machine");
    }
    let dir = root().join(".tollgate/bench");
    let _ = std::fs::create_dir_all(&dir);
    let doc = json!({
        "method": {
            "rounds": rounds,
            "duration_s": secs,
            "connections": conns,
            "saturation": format!("wrk -t1 -c{conns} -d{secs}s (closed loop)"),
            "open_loop": format!("oha -c{conns} -z{secs}s -q {rate:.0} --latency-correction -w --worker-threads 1"),
            "open_loop_rate_rps": rate,
            "open_loop_rate_basis": if fixed_rate.is_some() { "--rate".to_string() } else { format!("{rate_fraction} x envoy-alone saturation throughput of this run") },
            "cores": {"envoy": "CPU 0 (--concurrency 1, taskset)", "load_generator": "CPU 1 (taskset)", "floating": "sidecars, Redis, tansu, echo upstream"},
        },
        "native_local_ratelimit_denied": native_limited,
        "configurations": summary,
    });
    let _ = std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(&doc).unwrap_or_default());
    println!("\nwrote .tollgate/bench/summary.json");
    drop(configs);
    drop(all);
    drop(twins);
    drop(by_transport);
    drop(peers);
    drop((tollgate, callout, breaker, metered, full, full_bare, bare_sidecar, native, baseline, sidecar, usage_sidecar, broker, redis, upstream));
}
