//! Test-only knobs, honoured only when their environment variable is set (never in a deployment:
//! nothing sets them but the functional tests).
//!
//! - `TOLLGATE_TEST_DECIDE_DELAY_FILE`: the path of a file holding a number of milliseconds (at
//!   most 10 s; absent, empty or unreadable: 0). Each `/v1/decide` answer is held back that long
//!   *after* the decision ran, so a test can make the filter give up on answers whose decisions
//!   took from their limits (issue 15.2: abandoned decisions are refunded); a `/v1/decide/batch`
//!   answer (decision 127) is held back the same, once per batch. The file is read on
//!   every decision while the variable is set, so a test turns the delay on and off by writing it.

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

/// The environment variable naming the delay file.
pub const DECIDE_DELAY_FILE_ENV: &str = "TOLLGATE_TEST_DECIDE_DELAY_FILE";

static DELAY_FILE: LazyLock<Option<PathBuf>> = LazyLock::new(|| {
    let path = std::env::var_os(DECIDE_DELAY_FILE_ENV).map(PathBuf::from);
    if let Some(p) = &path {
        tracing::warn!(file = %p.display(), "test-only: decision answers are delayed by the milliseconds in this file");
    }
    path
});

/// Holds a decision's answer back by the test delay, if one is set.
pub async fn decide_answer_delay() {
    let Some(path) = DELAY_FILE.as_ref() else { return };
    let ms = std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0).min(10_000);
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}
