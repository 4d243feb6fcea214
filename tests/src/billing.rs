//! The billing consumer (`tollgate-billing`) as a guard, and a `psql` helper to read what it
//! wrote. The binary comes from `TOLLGATE_BILLING_BIN` (set by build.sh) or the workspace's
//! release build.

use crate::postgres::{pg_bin_dir, Postgres};
use crate::{root, Proc};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

pub fn billing_bin() -> PathBuf {
    std::env::var_os("TOLLGATE_BILLING_BIN").map(PathBuf::from).unwrap_or_else(|| root().join("target/release/tollgate-billing"))
}

/// A running billing consumer, killed on drop (its log printed if the test failed).
pub struct Billing {
    proc: Proc,
    env: Vec<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Billing {
    /// Consumes `topic` on `brokers` as consumer group `group` into `pg`; `extra` are more
    /// `TOLLGATE_BILLING_*` settings.
    pub fn start(brokers: &str, topic: &str, group: &str, pg: &Postgres, extra: &[(&str, &str)]) -> Billing {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut env: Vec<(String, String)> = vec![
            ("TOLLGATE_BILLING_KAFKA__BROKERS".into(), brokers.into()),
            ("TOLLGATE_BILLING_KAFKA__TOPIC".into(), topic.into()),
            ("TOLLGATE_BILLING_KAFKA__GROUP_ID".into(), group.into()),
            ("TOLLGATE_BILLING_POSTGRES__URL".into(), pg.url()),
            ("TOLLGATE_BILLING_BATCH_WAIT".into(), "50ms".into()),
            ("TOLLGATE_BILLING_LOG__FORMAT".into(), "text".into()),
            ("TOLLGATE_BILLING_LOG__LEVEL".into(), "info,tollgate_billing=debug".into()),
        ];
        for (k, v) in extra {
            env.retain(|(ek, _)| ek != k);
            env.push((k.to_string(), v.to_string()));
        }
        let mut cmd = Command::new(billing_bin());
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let proc = Proc::spawn("billing", cmd, dir.path().join("billing.log"));
        Billing { proc, env, _dir: dir }
    }

    /// Runs `tollgate-billing <args>` with this consumer's configuration.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(billing_bin()).envs(self.env.iter().map(|(k, v)| (k, v))).args(args).output().expect("run tollgate-billing")
    }

    pub fn kill(&mut self) {
        self.proc.kill();
    }

    pub fn terminate(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        self.proc.terminate(deadline)
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

/// Runs one SQL statement with `psql` and returns its rows (`|`-separated columns); `None` when
/// psql fails (e.g. the table does not exist yet, or the server is down).
pub fn psql(pg: &Postgres, sql: &str) -> Option<Vec<String>> {
    let out = Command::new(pg_bin_dir().join("psql"))
        .args(["-h", "127.0.0.1", "-p", &pg.port.to_string(), "-U", "postgres", "-d", "postgres", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).filter(|l| !l.is_empty()).collect())
}

/// A single integer from `sql` (0 when there is nothing yet).
pub fn psql_i64(pg: &Postgres, sql: &str) -> i64 {
    psql(pg, sql).and_then(|r| r.first().and_then(|v| v.trim().parse().ok())).unwrap_or(0)
}
