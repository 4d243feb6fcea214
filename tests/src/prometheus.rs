//! A real Prometheus (Debian's `prometheus` package, installed by build.sh) for the observability
//! tests: scrapes the targets it is given every 500 ms with Tollgate's rule file loaded, answers
//! PromQL over its HTTP API. Killed on drop; its data lives in a temporary directory.

use crate::process::{bin, free_port, poll_until, root, Proc};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub fn prometheus_bin() -> PathBuf {
    bin("TOLLGATE_PROMETHEUS_BIN", PathBuf::from("/usr/bin/prometheus"))
}

/// One scrape job: its name and `host:port` targets, and the metrics path.
pub struct Job {
    pub name: String,
    pub path: String,
    pub targets: Vec<String>,
}

impl Job {
    pub fn new(name: &str, path: &str, targets: impl IntoIterator<Item = String>) -> Job {
        Job { name: name.into(), path: path.into(), targets: targets.into_iter().collect() }
    }
}

pub struct Prometheus {
    pub port: u16,
    proc: Proc,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    pub fn start(jobs: &[Job]) -> Prometheus {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let rules = root().join("observability/rules.yml");
        let mut config = format!(
            "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\nrule_files: [\"{}\"]\nscrape_configs:\n",
            rules.display()
        );
        for j in jobs {
            let targets = j.targets.iter().map(|t| format!("\"{t}\"")).collect::<Vec<_>>().join(", ");
            config.push_str(&format!(
                "  - job_name: \"{}\"\n    metrics_path: \"{}\"\n    static_configs:\n      - targets: [{targets}]\n",
                j.name, j.path
            ));
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let mut cmd = Command::new(prometheus_bin());
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let proc = Proc::spawn("prometheus", cmd, dir.path().join("prometheus.log"));
        let p = Prometheus { port, proc, _dir: dir };
        poll_until("prometheus to be ready", Duration::from_secs(60), || {
            crate::http::get(&format!("{}/-/ready", p.url()), &[]).status == 200
        });
        p
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// An instant query's result vector (`data.result`); panics on a query error.
    pub fn query(&self, expr: &str) -> Vec<Value> {
        let url = format!("{}/api/v1/query?query={}", self.url(), encode(expr));
        let r = crate::http::get(&url, &[]);
        let v = r.json();
        assert_eq!(v["status"], "success", "query {expr} failed: {}", r.body);
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The value of a one-sample query, if it has exactly one sample.
    pub fn value(&self, expr: &str) -> Option<f64> {
        let r = self.query(expr);
        match r.as_slice() {
            [one] => one["value"][1].as_str().and_then(|s| s.parse().ok()),
            _ => None,
        }
    }

    /// Every scrape target is up.
    pub fn wait_targets_up(&self, n: usize) {
        poll_until("every scrape target to be up", Duration::from_secs(60), || {
            let up = self.query("up == 1");
            up.len() >= n
        });
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

/// Percent-encodes a query string value.
pub fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}
