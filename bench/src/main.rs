//! `tollgate-bench`: measurements of the whole gateway on real processes (`./build.sh bench`),
//! built on the functional-test harness. Measurements, not tests: nothing here passes or fails on
//! a figure (the machine is shared and noisy); each prints what it measured.
//!
//! - no subcommand: Envoy alone vs Envoy's native rate limiter vs Envoy + Tollgate ([`compare`]);
//! - `cache`: a response-cache hit next to a miss and an uncached route ([`cache`]);
//! - `usage-intake [--aggregate-above-rps N] [--batches B]`: the sidecar's usage intake and
//!   delivery ([`usage`]);
//! - `usage-shipping [--events E]`: a full spool drained to the broker ([`usage`]);
//! - `instructions [--hosts wasm,native] [--only PATH,PATH] [--small N] [--large N] [--idle-secs S]`:
//!   instructions executed by Envoy per request under callgrind, per host and path ([`instructions`]).

mod cache;
mod compare;
mod floors;
mod hosts;
mod instructions;
mod limitador;
mod load;
mod profile;
mod usage;
mod zipf;

use std::time::Duration;
use tollgate_tests::Redis;

fn args() -> Vec<String> {
    std::env::args().collect()
}

/// The value after option `name`, if given.
fn arg_str(name: &str) -> Option<String> {
    let a = args();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1)).cloned()
}

/// Option `name` parsed, or `default`.
fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    arg_str(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// utime + stime of a process so far, in microseconds (`/proc/<pid>/stat`).
fn cpu_us(pid: Option<u32>) -> f64 {
    let Some(pid) = pid else { return 0.0 };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // after the command name: state is field 0, utime 11, stime 12 (clock ticks)
    let ticks: f64 = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ticks * 1_000_000.0 / 100.0 // USER_HZ = 100 on Linux
}

/// Envoy's memory in MB, after a measurement: its heap as its allocator counts it (admin
/// `/memory` `allocated`: shared data such as the auth cache and lease records lives there) and
/// its resident set (`VmRSS`, which also holds the Wasm VMs' linear memories). 0 when unreadable.
fn envoy_memory_mb(envoy: &tollgate_tests::Envoy) -> (f64, f64) {
    let heap = tollgate_tests::get(&format!("http://127.0.0.1:{}/memory", envoy.admin_port), &[]).json()["allocated"]
        .as_str()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    let status = envoy.pid().and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok()).unwrap_or_default();
    let rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    (heap / 1_048_576.0, rss_kb / 1024.0)
}

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("cache") => cache::run(),
        Some("usage-intake") => usage::intake(arg("--aggregate-above-rps", 0), arg("--batches", 200)),
        Some("usage-shipping") => usage::shipping(arg("--events", 400_000)),
        Some("instructions") => instructions::run(),
        Some("--help" | "-h" | "help") => println!(
            "usage: tollgate-bench [--duration SECS] [--rounds N] [--connections N] [--rate-fraction F] [--rate RPS]\n\
             \x20                     [--only NAME,NAME] [--compare-wasm PATH] [--saturation-only]\n\
             \x20                     [--zipf-keys N] [--zipf-s S] [--cpu-split]\n\
             \x20      tollgate-bench cache [--requests N] [--rounds N]\n\
             \x20      tollgate-bench usage-intake [--aggregate-above-rps N] [--batches B]\n\
             \x20      tollgate-bench usage-shipping [--events E]\n\
             \x20      tollgate-bench instructions [--hosts wasm,native] [--only PATH,PATH] [--warmup N] [--small N] [--large N]\n\
             \x20                                  [--idle-secs S] [--zipf-keys N] [--zipf-s S] [--dumps DIR] [--template PATH]\n\
             (docs/benchmarks.md)"
        ),
        _ => compare::run(),
    }
}

/// (all commands, EVALSHA calls) from `INFO commandstats`. Commands run inside a script count
/// in the first figure too; the second is the number of script round trips.
pub fn redis_calls(redis: &Redis) -> (f64, f64) {
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

/// Completion reports and usage batches are settled after the responses: wait (bounded) until
/// Redis is quiet so that a configuration's work is counted with it and not with the next one.
/// The pause is the poll interval of a quiet check, not a readiness wait.
pub fn settle(redis: &Redis) {
    let mut last = redis_calls(redis).0;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(200));
        let now = redis_calls(redis).0;
        if now == last {
            return;
        }
        last = now;
    }
}
