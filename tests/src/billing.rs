//! The billing consumer (`tollgate-billing`) as a guard, and a `psql` helper to read what it
//! wrote. The binary comes from `TOLLGATE_BILLING_BIN` (set by build.sh) or the workspace's
//! test build (`target/ci`).

use crate::postgres::{pg_bin_dir, Postgres};
use crate::process::{native_bin, service_guard, Service};
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub fn billing_bin() -> PathBuf {
    native_bin("TOLLGATE_BILLING_BIN", "tollgate-billing")
}

/// A running billing consumer, killed on drop (its log printed if the test failed). Process
/// control (`kill`, `restart` with the same settings, `terminate`, `log_text`, `cli`: runs
/// `tollgate-billing <args>` with this consumer's configuration) is the [`Service`]'s.
pub struct Billing {
    service: Service,
}

service_guard!(Billing);

impl Billing {
    /// Consumes `topic` on `brokers` as consumer group `group` into `pg`; `extra` are more
    /// `TOLLGATE_BILLING_*` settings.
    pub fn start(brokers: &str, topic: &str, group: &str, pg: &Postgres, extra: &[(&str, &str)]) -> Billing {
        let env: Vec<(String, String)> = vec![
            ("TOLLGATE_BILLING_KAFKA__BROKERS".into(), brokers.into()),
            ("TOLLGATE_BILLING_KAFKA__TOPIC".into(), topic.into()),
            ("TOLLGATE_BILLING_KAFKA__GROUP_ID".into(), group.into()),
            ("TOLLGATE_BILLING_POSTGRES__URL".into(), pg.url()),
            ("TOLLGATE_BILLING_BATCH_WAIT".into(), "50ms".into()),
            ("TOLLGATE_BILLING_LOG__FORMAT".into(), "text".into()),
            ("TOLLGATE_BILLING_LOG__LEVEL".into(), "info,tollgate_billing=debug".into()),
        ];
        let dir = tempfile::tempdir().expect("tempdir");
        Billing { service: Service::start("billing", billing_bin(), dir, env, extra) }
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
