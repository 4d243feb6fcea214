//! The load generators of the comparison run, pinned to CPU 1: wrk (closed loop; one key, or a
//! key per request from the Zipf population) and oha (open loop at a fixed rate).

use serde_json::Value;
use std::process::Command;
use tollgate_tests::root;

/// One open-loop measurement at a fixed rate.
#[derive(Default, Clone, serde::Serialize)]
pub struct OpenLoop {
    pub rate_rps: f64,
    pub achieved_rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub envoy_cpu_us_per_req: f64,
    pub sidecar_cpu_us_per_req: f64,
    pub requests: u64,
    pub non_2xx: u64,
    pub errors: u64,
}

/// The load generator on CPU 1.
fn pinned(program: &str) -> Command {
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", "1", program]);
    cmd
}

/// The Zipf client: the wrk script, the key list and the exponent.
pub struct ZipfClient {
    pub script: std::path::PathBuf,
    pub keys: std::path::PathBuf,
    pub s: f64,
}

/// wrk, closed loop: (rps, p50, p99, p99.9 in ms, requests, non-2xx). With `zipf`, each request
/// carries a key drawn from its population instead of `key`.
pub fn wrk(url: &str, key: Option<&str>, zipf: Option<&ZipfClient>, secs: u64, conns: u64) -> (f64, f64, f64, f64, u64, u64) {
    if let Some(z) = zipf {
        let mut cmd = pinned("wrk");
        cmd.args(["-t1", &format!("-c{conns}"), &format!("-d{secs}s"), "-s"]).arg(&z.script).arg(url).arg("--").arg(&z.keys).arg(z.s.to_string());
        return wrk_output(cmd);
    }
    let lua = root().join("target/bench-percentiles.lua");
    std::fs::write(
        &lua,
        "done = function(summary, latency, requests)\n\
         io.write(string.format(\"P50 %d\\nP99 %d\\nP999 %d\\nREQS %d\\n\", latency:percentile(50), latency:percentile(99), latency:percentile(99.9), summary.requests))\n\
         end\n",
    )
    .expect("write wrk script");
    let mut cmd = pinned("wrk");
    cmd.args(["-t1", &format!("-c{conns}"), &format!("-d{secs}s"), "-s"]).arg(&lua);
    if let Some(k) = key {
        cmd.args(["-H", &format!("x-api-key: {k}")]);
    }
    cmd.arg(url);
    wrk_output(cmd)
}

/// Runs a wrk command whose script prints the percentiles, and reads its report.
fn wrk_output(mut cmd: Command) -> (f64, f64, f64, f64, u64, u64) {
    let out = cmd.output().expect("run wrk (apt-get install wrk)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let field = |p: &str| text.lines().find_map(|l| l.strip_prefix(p)).map(|v| v.trim().to_string()).unwrap_or_default();
    let rps = field("Requests/sec:").parse().unwrap_or(0.0);
    let us = |p: &str| field(p).parse::<f64>().unwrap_or(f64::NAN) / 1000.0;
    let non2xx = field("Non-2xx or 3xx responses:").parse().unwrap_or(0);
    (rps, us("P50 "), us("P99 "), us("P999 "), field("REQS ").parse().unwrap_or(0), non2xx)
}

fn oha_bin() -> std::path::PathBuf {
    std::env::var_os("TOLLGATE_OHA_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root().join(".tollgate/tools/oha/bin/oha"))
}

/// Exits with how to get oha when it is not there (`./build.sh bench` installs it; a
/// `tollgate-bench` run by hand does not).
pub fn require_oha() {
    let bin = oha_bin();
    if !bin.is_file() {
        eprintln!("tollgate-bench: no oha at {} (run ./build.sh bench, which installs it, set TOLLGATE_OHA_BIN, or pass --saturation-only)", bin.display());
        std::process::exit(2);
    }
}

/// oha, open loop at `rate` requests/s with latency correction. `None` if oha failed.
pub fn oha(url: &str, key: Option<&str>, secs: u64, conns: u64, rate: f64) -> Option<OpenLoop> {
    let bin = oha_bin();
    let mut cmd = pinned(&bin.display().to_string());
    cmd.args(["-z", &format!("{secs}s"), "-c", &conns.to_string(), "-q", &format!("{rate:.0}")])
        // -w: requests in flight at the deadline are waited for, not aborted (and counted as errors).
        .args(["--latency-correction", "-w", "--worker-threads", "1", "--no-tui", "--output-format", "json"]);
    if let Some(k) = key {
        cmd.args(["-H", &format!("x-api-key: {k}")]);
    }
    let out = cmd.arg(url).output().unwrap_or_else(|e| panic!("run {} (./build.sh bench installs it): {e}", bin.display()));
    let doc: Value = match serde_json::from_slice(&out.stdout) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("oha output is not JSON ({e}): {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            return None;
        }
    };
    let ms = |p: &str| doc["latencyPercentiles"][p].as_f64().map_or(f64::NAN, |s| s * 1000.0);
    let codes = doc["statusCodeDistribution"].as_object().cloned().unwrap_or_default();
    let count = |ok: bool| -> u64 {
        codes.iter().filter(|(c, _)| c.starts_with('2') == ok).filter_map(|(_, n)| n.as_u64()).sum()
    };
    let errors = doc["errorDistribution"].as_object().map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
    Some(OpenLoop {
        rate_rps: rate,
        achieved_rps: doc["summary"]["requestsPerSec"].as_f64().unwrap_or(0.0),
        p50_ms: ms("p50"),
        p99_ms: ms("p99"),
        p999_ms: ms("p99.9"),
        requests: count(true) + count(false),
        non_2xx: count(false),
        errors,
        ..OpenLoop::default()
    })
}
