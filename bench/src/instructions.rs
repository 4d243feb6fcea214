//! `tollgate-bench instructions` (issue 41): instructions executed by Envoy per request, counted by
//! valgrind's callgrind, for every path of each host. Deterministic where throughput on this
//! shared machine is not (repeat runs agree within ~0.1 % without a filter, ~1 % on leased paths).
//!
//! Method (docs/benchmarks.md, "Instructions per request"): each configuration gets its own Envoy
//! (`--concurrency 1`) under `valgrind --tool=callgrind --instr-atstart=no
//! --smc-check=all-non-file` (V8's JIT needs the check), the filter's sidecar timeout raised to
//! 5 s (Envoy runs ~50× slower). Sequential requests on one keep-alive connection; with
//! `callgrind_control` the bench turns collection on, then measures windows, each zeroed before
//! and dumped after: idle before any request (`--idle-secs`: the timers of an Envoy that holds
//! nothing), a warm-up (not counted), a small window (`--small` requests), a large one
//! (`--large`), and idle again right after (the timers as they ran beside the requests). Per
//! request: `(large − small − warm idle rate × (large's seconds − small's)) ÷ (large − small
//! requests)`: what every window pays once (a dump, a lease's slow start) cancels, and what the
//! timers cost while the windows ran is taken out. Only Envoy is counted; the sidecar, Redis
//! and the client run natively beside it.
//!
//! A host is a parameter (`--hosts wasm,native`): each path runs on each host named. The Wasm
//! host is the filter `./build.sh` builds; the native host is selected through the harness
//! (`TOLLGATE_HOST=native`, its module in `TOLLGATE_NATIVE_MODULE`) — see [`Host`]. The run ends
//! with one line per host and path, its instructions ÷ Envoy alone's of the same run
//! (`wasm auth 1.52`). Dumps are kept under `.tollgate/bench/callgrind/<host>-<path>/` for
//! `callgrind_annotate` (where the instructions go).

use crate::{arg, arg_str};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use crate::hosts::Host;
use tollgate_tests::{root, start_echo, Envoy, EnvoyOptions, Redis, Sidecar};

/// Which key a path's requests carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyOf {
    None,
    /// Plan `bench`: no limits (auth only).
    Auth,
    /// Plan `limited`: one exact limit, never reached.
    Exact,
    /// Plan `leased`: the same limit, leased.
    Leased,
    /// A key per request from the Zipf population (plan `leased`).
    Zipf,
}

/// One path of the table: an Envoy configuration and the key its requests carry.
struct Case {
    name: &'static str,
    what: &'static str,
    key: KeyOf,
    /// The Envoy: `Filter` (the host's filter with this plugin configuration), or a floor.
    envoy: Setup,
    /// The figure for the Wasm host before this work (× Envoy alone), if it had one.
    before: Option<f64>,
    /// The goals (× Envoy alone): Wasm, native.
    goal: (Option<f64>, Option<f64>),
}

enum Setup {
    Baseline,
    /// A filter that does nothing in `template`: the SDK's (bench/floors/sdk) on the Wasm host,
    /// or (`native`) a dynamic module's (bench/floors/native) on the native host.
    Floor { template: &'static str, native: bool },
    Filter { extra: fn() -> Value },
}

fn none() -> Value {
    json!({})
}
/// Usage batches every 10 s (1 s by default): under valgrind a batch of at most 1,000 events
/// then holds about as many as at speed, and its call is shared by as many requests (decision 270).
fn metered_breaker() -> Value {
    json!({"usage": {"enabled": true, "flushInterval": "10s"}, "breakers": {"targets": [crate::compare::breaker_target()]}})
}
fn full() -> Value {
    let mut v = metered_breaker();
    v["routing"] = json!({"enabled": true});
    v
}

const FLOOR_MINIMAL_TEMPLATE: &str = "bench/envoy/wasm-minimal.yaml.tmpl";

fn paths() -> Vec<Case> {
    let p = |name, what, key, envoy, before, goal| Case { name, what, key, envoy, before, goal };
    vec![
        p("envoy-alone", "router only (envoy/baseline.yaml.tmpl)", KeyOf::None, Setup::Baseline, Some(1.0), (None, None)),
        p("floor-sdk-minimal-template", "a no-op filter on the SDK, minimal template", KeyOf::None, Setup::Floor { template: FLOOR_MINIMAL_TEMPLATE, native: false }, Some(1.11), (None, None)),
        p("floor-sdk", "the same no-op filter in envoy/tollgate.yaml.tmpl", KeyOf::None, Setup::Floor { template: "envoy/tollgate.yaml.tmpl", native: false }, Some(1.20), (None, None)),
        p("floor-native", "a no-op dynamic module in envoy/tollgate.yaml.tmpl", KeyOf::None, Setup::Floor { template: "envoy/tollgate.yaml.tmpl", native: true }, None, (None, None)),
        p("auth", "auth only (the auth cache answers)", KeyOf::Auth, Setup::Filter { extra: none }, Some(1.59), (Some(1.30), Some(1.10))),
        p("leased", "one leased limit", KeyOf::Leased, Setup::Filter { extra: none }, Some(1.71), (Some(1.40), Some(1.15))),
        p("exact", "one exact limit (a decision per request)", KeyOf::Exact, Setup::Filter { extra: none }, Some(2.75), (Some(2.00), Some(1.40))),
        p("auth+usage+breaker", "auth + usage metering + a closed breaker", KeyOf::Auth, Setup::Filter { extra: metered_breaker }, Some(2.05), (None, None)),
        p("leased+usage+breaker", "leased + usage + breaker (no routing)", KeyOf::Leased, Setup::Filter { extra: metered_breaker }, Some(2.15), (None, None)),
        p("exact+usage+breaker", "exact + usage + breaker", KeyOf::Exact, Setup::Filter { extra: metered_breaker }, Some(3.22), (Some(2.40), Some(1.60))),
        p("full-leased", "full policy, leased: auth, lease, routing, breaker, usage", KeyOf::Leased, Setup::Filter { extra: full }, None, (Some(1.60), Some(1.25))),
        p("full-leased-zipf", "the full leased path, 100,000 keys, Zipf 1.1", KeyOf::Zipf, Setup::Filter { extra: full }, None, (Some(1.80), Some(1.35))),
    ]
}

/// One measured path.
#[derive(Clone, serde::Serialize)]
struct Measured {
    host: &'static str,
    path: &'static str,
    what: &'static str,
    /// Instructions per request, the idle timers' cost during the windows taken out.
    per_request: f64,
    /// The same without taking the timers out.
    per_request_gross: f64,
    /// The idle timers, instructions per second: before any request (nothing held), and right
    /// after the windows (what the net figure takes out).
    idle_cold_per_s: f64,
    idle_warm_per_s: f64,
    /// Requests per second in the large window (under valgrind).
    rps: f64,
    before: Option<f64>,
    goal_wasm: Option<f64>,
    goal_native: Option<f64>,
}

/// The script the harness starts as Envoy: Envoy under callgrind, its dumps in
/// `$TOLLGATE_CALLGRIND_OUT` (set before each Envoy starts).
fn callgrind_wrapper(envoy: &Path) -> PathBuf {
    let dir = root().join("target/bench-callgrind");
    std::fs::create_dir_all(&dir).expect("create target/bench-callgrind");
    let path = dir.join("envoy-under-callgrind.sh");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no --smc-check=all-non-file \
             --callgrind-out-file=\"$TOLLGATE_CALLGRIND_OUT/callgrind.out.%p\" \"{}\" \"$@\"\n",
            envoy.display()
        ),
    )
    .expect("write the callgrind wrapper");
    let mut perms = std::fs::metadata(&path).expect("wrapper").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&path, perms).expect("chmod the wrapper");
    path
}

/// `callgrind_control ARGS PID`; panics when it fails (the measurement would be wrong).
fn control(pid: u32, args: &[&str]) {
    let out = Command::new("callgrind_control").args(args).arg(pid.to_string()).output().expect("run callgrind_control (apt-get install valgrind)");
    assert!(out.status.success(), "callgrind_control {args:?} {pid}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The instructions of the dump whose `trigger` line names `label`, in `dir`.
fn dumped(dir: &Path, label: &str) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for entry in std::fs::read_dir(dir).expect("read the dump folder").flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path()) else { continue };
            if !text.lines().any(|l| l.strip_prefix("desc: Trigger: dump ") == Some(label)) {
                continue;
            }
            if let Some(total) = text.lines().find_map(|l| l.strip_prefix("totals: ")) {
                return total.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
            }
        }
        assert!(Instant::now() < deadline, "no callgrind dump {label} in {}", dir.display());
        std::thread::sleep(Duration::from_millis(50)); // the poll interval of a bounded wait
    }
}

/// One keep-alive HTTP/1.1 connection sending sequential GETs.
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(port: u16) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to Envoy");
        s.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
        let _ = s.set_nodelay(true);
        Client { writer: s.try_clone().expect("clone the socket"), reader: BufReader::new(s) }
    }

    /// One GET; its status.
    fn get(&mut self, key: Option<&str>) -> u16 {
        let key = key.map(|k| format!("x-api-key: {k}\r\n")).unwrap_or_default();
        write!(self.writer, "GET /bench HTTP/1.1\r\nhost: bench\r\n{key}\r\n").expect("send a request");
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("read the status line");
        let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let (mut length, mut chunked) = (0usize, false);
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("read a header");
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let (name, value) = l.split_once(':').unwrap_or((l, ""));
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            } else if name.eq_ignore_ascii_case("transfer-encoding") && value.to_ascii_lowercase().contains("chunked") {
                chunked = true;
            }
        }
        if chunked {
            loop {
                line.clear();
                self.reader.read_line(&mut line).expect("read a chunk size");
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
                let mut chunk = vec![0; size + 2];
                self.reader.read_exact(&mut chunk).expect("read a chunk");
                if size == 0 {
                    break;
                }
            }
        } else {
            let mut body = vec![0; length];
            self.reader.read_exact(&mut body).expect("read the body");
        }
        status
    }
}

/// Keys drawn from a Zipf law over a population (rank r with weight r^-s), by a seeded
/// generator: every run sends the same sequence.
struct ZipfKeys {
    keys: Vec<String>,
    cdf: Vec<f64>,
    state: u64,
}

impl ZipfKeys {
    fn new(keys: Vec<String>, s: f64) -> ZipfKeys {
        let mut total = 0.0;
        let mut cdf: Vec<f64> = (1..=keys.len())
            .map(|r| {
                total += (r as f64).powf(-s);
                total
            })
            .collect();
        cdf.iter_mut().for_each(|c| *c /= total);
        ZipfKeys { keys, cdf, state: 0x9E37_79B9_7F4A_7C15 }
    }

    fn next(&mut self) -> &str {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let u = (self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
        let i = self.cdf.partition_point(|&c| c < u).min(self.keys.len() - 1);
        &self.keys[i]
    }
}

/// The keys of the run, by kind.
struct Keys {
    auth: String,
    exact: String,
    leased: String,
    zipf: Option<ZipfKeys>,
}

impl Keys {
    fn key(&mut self, kind: KeyOf) -> Option<String> {
        match kind {
            KeyOf::None => None,
            KeyOf::Auth => Some(self.auth.clone()),
            KeyOf::Exact => Some(self.exact.clone()),
            KeyOf::Leased => Some(self.leased.clone()),
            KeyOf::Zipf => self.zipf.as_mut().map(|z| z.next().to_string()),
        }
    }
}

/// Sends `n` requests; (seconds taken, non-2xx answers).
fn send(client: &mut Client, keys: &mut Keys, kind: KeyOf, n: u64) -> (f64, u64) {
    let started = Instant::now();
    let mut bad = 0;
    for _ in 0..n {
        let key = keys.key(kind);
        if !(200..300).contains(&client.get(key.as_deref())) {
            bad += 1;
        }
    }
    (started.elapsed().as_secs_f64(), bad)
}

/// The run's windows.
struct Windows {
    warmup: u64,
    small: u64,
    large: u64,
    idle: Duration,
}

/// What one path measured: instructions per request (net of the timers, and gross), the idle
/// timers' instructions per second before any request and right after the windows, and the
/// large window's requests per second.
struct Figures {
    net: f64,
    gross: f64,
    idle_cold: f64,
    idle_warm: f64,
    rps: f64,
}

/// An idle window of `secs`: nothing is sent; instructions per second.
fn idle(pid: u32, out: &Path, label: &str, secs: Duration) -> f64 {
    control(pid, &["-z"]);
    let started = Instant::now();
    std::thread::sleep(secs); // the window itself: nothing is sent
    control(pid, &[&format!("--dump={label}")]);
    dumped(out, label) / started.elapsed().as_secs_f64()
}

/// Measures one path on a running Envoy (under callgrind, collection off).
fn measure(envoy: &Envoy, out: &Path, keys: &mut Keys, kind: KeyOf, w: &Windows) -> Result<Figures, String> {
    let pid = envoy.pid().ok_or("Envoy has no pid")?;
    let mut client = Client::connect(envoy.port);
    control(pid, &["--instr=on"]);
    // before any request: the timers of an Envoy that holds nothing (no answer, no lease)
    let idle_cold = idle(pid, out, "idle-cold", w.idle);
    let (_, bad) = send(&mut client, keys, kind, w.warmup);
    if bad > 0 {
        // not counted; a first call slower than the timeout on a busy machine is no reason to
        // drop the path (the windows must be all 2xx)
        eprint!("({bad} of {} warm-up requests answered non-2xx)  ", w.warmup);
    }
    let mut window = |n: u64, label: &str| -> Result<f64, String> {
        control(pid, &["-z"]);
        let (secs, bad) = send(&mut client, keys, kind, n);
        control(pid, &[&format!("--dump={label}")]);
        if bad > 0 {
            return Err(format!("{bad} of {n} requests answered non-2xx in window {label}"));
        }
        Ok(secs)
    };
    let small_secs = window(w.small, "small")?;
    let large_secs = window(w.large, "large")?;
    // right after: the timers as they ran beside the requests (pollers awake, leases held)
    let idle_warm = idle(pid, out, "idle-warm", w.idle);
    let (small, large) = (dumped(out, "small"), dumped(out, "large"));
    let n = (w.large - w.small) as f64;
    Ok(Figures {
        net: (large - small - idle_warm * (large_secs - small_secs)) / n,
        gross: (large - small) / n,
        idle_cold,
        idle_warm,
        rps: w.large as f64 / large_secs,
    })
}

/// The instructions run (module documentation).
pub fn run() {
    let hosts: Vec<Host> = arg_str("--hosts")
        .unwrap_or_else(|| "wasm".into())
        .split(',')
        .map(|h| Host::parse(h).unwrap_or_else(|| panic!("--hosts: unknown host {h} (wasm, native, native-direct)")))
        .collect();
    let only: Option<Vec<String>> = arg_str("--only").map(|v| v.split(',').map(str::to_string).collect());
    let selected = |name: &str| name == "envoy-alone" || only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let w = Windows {
        warmup: arg("--warmup", 200),
        small: arg("--small", 500),
        large: arg("--large", 2500),
        idle: Duration::from_secs_f64(arg("--idle-secs", 5.0)),
    };
    assert!(w.large > w.small, "--large must exceed --small");
    let real_envoy = tollgate_tests::envoy_bin();
    std::env::set_var("TOLLGATE_ENVOY_BIN", callgrind_wrapper(&real_envoy));
    // V8 compiling the filter under valgrind, on a busy machine, can take minutes
    std::env::set_var("TOLLGATE_ENVOY_READY_SECS", "600");
    let dumps = arg_str("--dumps").map_or_else(|| root().join(".tollgate/bench/callgrind"), PathBuf::from);

    let upstream = start_echo();
    let redis = Redis::start();
    let broker = tollgate_tests::broker::Broker::start();
    let spool = tempfile::tempdir().expect("tempdir");
    // One sidecar for every path: plans `bench` (no limits), `limited` (an exact limit that never
    // runs out), `leased` (the same, leased), one route for everything, usage metering to tansu.
    let sidecar = Sidecar::start_with_config(
        &redis.url(),
        &format!(
            "[plans.bench]\n{}{}[[routes]]\nid = \"bench\"\ncluster = \"upstream\"\n[routes.match]\npath_prefix = \"/\"\n\
             [usage]\nenabled = true\nspool_dir = \"{}\"\n[usage.kafka]\nbrokers = \"{}\"\n",
            crate::compare::LIMITED_PLAN,
            crate::compare::LEASED_PLAN,
            spool.path().display(),
            broker.brokers()
        ),
        &[("TOLLGATE_SIDECAR_LOG__LEVEL", "warn")],
    );
    let zipf_n: usize = arg("--zipf-keys", 100_000);
    let zipf = (selected("full-leased-zipf") && zipf_n > 0).then(|| {
        let file = crate::zipf::seed_keys(&redis, zipf_n, "bench", "leased");
        let keys = std::fs::read_to_string(file).expect("the key list").lines().map(str::to_string).collect();
        ZipfKeys::new(keys, arg("--zipf-s", 1.1))
    });
    let mut keys = Keys {
        auth: sidecar.create_key("bench", "bench", &[]).raw,
        exact: sidecar.create_key("bench", "limited", &[]).raw,
        leased: sidecar.create_key("bench", "leased", &[]).raw,
        zipf,
    };
    let floor = std::env::var_os("TOLLGATE_FLOOR_SDK_WASM").map(PathBuf::from);
    // `--template PATH` (relative to the workspace): the filter's paths in another Envoy template,
    // to take one apart a setting at a time
    let template: Option<&'static str> = arg_str("--template").map(|t| &*Box::leak(t.into_boxed_str()));
    // The plugin configuration: the bench's, its sidecar timeout raised for valgrind.
    let plugin = |extra: Value| {
        // authCacheMaxTtl 60 s: the auth cache's refresh is time-driven (a call per key every
        // 500 ms by default), and under valgrind a second holds 50× fewer requests than at
        // speed: kept at 500 ms, it would charge each request ~50× its share (decision 270)
        let mut config = json!({"sidecar": {"timeout": "5s"}, "failureMode": "closed", "authCacheMaxTtl": "60s"});
        if let (Some(config), Value::Object(extra)) = (config.as_object_mut(), extra) {
            config.extend(extra);
        }
        config
    };

    eprintln!(
        "instructions per request: Envoy --concurrency 1 under callgrind, one keep-alive connection; windows: idle {:?}, warm-up {}, {} and {} requests",
        w.idle, w.warmup, w.small, w.large
    );
    let mut results: Vec<Measured> = Vec::new();
    for host in &hosts {
        if let Err(why) = host.prepare() {
            eprintln!("{}: not measured ({why})", host.name());
            continue;
        }
        for path in paths().iter().filter(|p| selected(p.name)) {
            // Envoy alone is no host's: measured once, with the first host; a floor, with its own
            // host (the native one on `native`, not again on `native-direct`)
            let hostless = matches!(path.envoy, Setup::Baseline);
            let other_hosts_floor = matches!(path.envoy, Setup::Floor { native, .. } if native != (*host == Host::Native) || *host == Host::NativeDirect);
            if (hostless && results.iter().any(|r| r.path == path.name)) || other_hosts_floor {
                continue;
            }
            // the harness loads the native module named by TOLLGATE_NATIVE_MODULE: the floor's
            // for its path only
            let mut swapped = None;
            let opts = match &path.envoy {
                Setup::Baseline => EnvoyOptions::new(upstream.port, 0).baseline(),
                Setup::Floor { template, native: true } => {
                    let Some(module) = crate::floors::native_module(&dumps) else { continue };
                    swapped = std::env::var_os("TOLLGATE_NATIVE_MODULE");
                    std::env::set_var("TOLLGATE_NATIVE_MODULE", module);
                    EnvoyOptions { template, ..EnvoyOptions::new(upstream.port, sidecar.port) }
                }
                Setup::Floor { template, native: false } => {
                    let Some(floor) = &floor else {
                        eprintln!("{}: not measured (TOLLGATE_FLOOR_SDK_WASM unset; `./build.sh bench` builds it)", path.name);
                        continue;
                    };
                    let mut o = EnvoyOptions { template, ..EnvoyOptions::new(upstream.port, sidecar.port) };
                    o.vars.push(("WASM_PATH", floor.display().to_string()));
                    o
                }
                Setup::Filter { extra } => {
                    let o = EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(plugin(extra()));
                    match &template {
                        Some(t) => EnvoyOptions { template: t, ..o },
                        None => o,
                    }
                }
            };
            let label = if hostless { path.name.to_string() } else { format!("{}-{}", host.name(), path.name) };
            let out = dumps.join(&label);
            // this path's dumps only: another run may be measuring other paths
            let _ = std::fs::remove_dir_all(&out);
            std::fs::create_dir_all(&out).expect("create the dump folder");
            std::env::set_var("TOLLGATE_CALLGRIND_OUT", &out);
            if path.key == KeyOf::Zipf && keys.zipf.is_none() {
                eprintln!("{label}: not measured (--zipf-keys 0)");
                continue;
            }
            let started = Instant::now();
            let envoy = Envoy::start(opts);
            if let Some(module) = swapped {
                std::env::set_var("TOLLGATE_NATIVE_MODULE", module);
            }
            eprint!("{label:<36} Envoy up in {:>4.1}s  ", started.elapsed().as_secs_f64());
            match measure(&envoy, &out, &mut keys, path.key, &w) {
                Ok(f) => {
                    eprintln!(
                        "{:>9.0} instr/req ({:>9.0} gross)  idle {:>5.2} / {:>5.2} M instr/s (cold / warm)  {:.0} rps",
                        f.net,
                        f.gross,
                        f.idle_cold / 1e6,
                        f.idle_warm / 1e6,
                        f.rps
                    );
                    results.push(Measured {
                        host: if hostless { "-" } else { host.name() },
                        path: path.name,
                        what: path.what,
                        per_request: f.net,
                        per_request_gross: f.gross,
                        idle_cold_per_s: f.idle_cold,
                        idle_warm_per_s: f.idle_warm,
                        rps: f.rps,
                        before: path.before,
                        goal_wasm: path.goal.0,
                        goal_native: path.goal.1,
                    });
                }
                Err(why) => eprintln!("NOT MEASURED: {why}\n{}", envoy.log_text().lines().rev().take(20).collect::<Vec<_>>().join("\n")),
            }
        }
    }
    report(&results, &w, &dumps);
    drop((sidecar, broker, redis, upstream));
}

/// The table (docs/benchmarks.md's form), the JSON, and one line per host and path.
fn report(results: &[Measured], w: &Windows, dumps: &Path) {
    let Some(base) = results.iter().find(|r| r.path == "envoy-alone").map(|r| r.per_request) else {
        eprintln!("Envoy alone was not measured: no ratios");
        return;
    };
    println!("\n| host | path | instructions / request | × Envoy alone | before (issue 41) | goal | idle timers, M instr/s (cold / warm) |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for r in results {
        let goal = if r.host.starts_with("native") { r.goal_native } else { r.goal_wasm };
        println!(
            "| {} | {} | {:.1} k | {:.2} | {} | {} | {:.2} / {:.2} |",
            r.host,
            r.path,
            r.per_request / 1e3,
            r.per_request / base,
            r.before.map_or("–".into(), |b| format!("{b:.2}")),
            goal.map_or("–".into(), |g| format!("≤ {g:.2}")),
            r.idle_cold_per_s / 1e6,
            r.idle_warm_per_s / 1e6
        );
    }
    let dir = root().join(".tollgate/bench");
    let _ = std::fs::create_dir_all(&dir);
    let doc = json!({
        "method": {
            "valgrind": "--tool=callgrind --instr-atstart=no --smc-check=all-non-file",
            "windows": {"idle_s": w.idle.as_secs_f64(), "warmup": w.warmup, "small": w.small, "large": w.large},
            "per_request": "(large - small - warm idle rate x (large s - small s)) / (large - small requests)",
        },
        "envoy_alone_per_request": base,
        "paths": results,
    });
    let _ = std::fs::write(dir.join("instructions.json"), serde_json::to_string_pretty(&doc).unwrap_or_default());
    println!("\nwrote .tollgate/bench/instructions.json; dumps under {} (callgrind_annotate)\n", dumps.display());
    for r in results {
        let host = if r.host == "-" { "envoy" } else { r.host };
        println!("{host} {} {:.2}", r.path, r.per_request / base);
    }
}
