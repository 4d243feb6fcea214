//! Sample values shared by tests and the bench, so that what the tests check and what the bench
//! measures are the same: usage events, limits of a sidecar configuration, the response-cache
//! gateway's configuration.

use serde_json::{json, Value};
use tollgate_wire::usage::UsageEvent;

/// 2025-11-30T00:00:00Z: the day the sample events are billed on.
pub const DAY: u64 = 1_764_460_800_000;

/// Event number `seq` of `tenant`: a GET of `/v1/items/<seq>` (404 for every tenth), `seq`
/// tokens, started `seq` ms into [`DAY`]; its id is unique per tenant and `seq`.
pub fn usage_event(tenant: &str, seq: u64) -> UsageEvent {
    UsageEvent {
        id: format!("{tenant}-{seq:08}-0123456789"),
        tenant: tenant.into(),
        key_id: format!("key_{tenant}"),
        plan: "gold".into(),
        method: "GET".into(),
        authority: "api.test".into(),
        path: format!("/v1/items/{seq}"),
        status: if seq.is_multiple_of(10) { 404 } else { 200 },
        start_ms: DAY + seq,
        duration_ms: 3,
        tokens: Some(seq),
        tokens_unread: false,
        request_bytes: Some(100),
        response_bytes: Some(200),
        ..UsageEvent::default()
    }
}

/// One limit of plan `plan` in a sidecar's TOML: `[[plans.<plan>.limits]]` with `name`,
/// `algorithm` and `limit`, then `extra` (more settings, one a line: `window = "1h"` …).
pub fn limit_toml(plan: &str, name: &str, algorithm: &str, limit: u64, extra: &str) -> String {
    format!("[[plans.{plan}.limits]]\nname = \"{name}\"\nalgorithm = \"{algorithm}\"\nlimit = {limit}\n{extra}\n")
}

/// The response-cache gateway's sidecar (issue 7): plan `p` with one fixed-window limit of
/// `limit` a minute; route `cached` (`/cached…`) caches responses for a minute, keyed also by
/// `x-user`; route `plain` (everything else) does not cache.
pub fn cache_sidecar_toml(limit: u64) -> String {
    format!(
        r#"
[[plans.p.limits]]
name = "pm"
algorithm = "fixed_window"
limit = {limit}
window = "60s"

[[routes]]
id = "cached"
cluster = "upstream"
priority = 10
cache_ttl = "60s"
cache_key_headers = ["x-user"]
[routes.match]
path_prefix = "/cached"

[[routes]]
id = "plain"
cluster = "upstream"
priority = 20
[routes.match]
path_prefix = "/"
"#
    )
}

/// The response-cache gateway's plugin: routing on (the cache TTL is the route's), idempotency
/// on, small cache bodies, fast flushes.
pub fn cache_plugin() -> Value {
    json!({
        "sidecar": {"timeout": "2s"}, "failureMode": "closed",
        "routing": {"enabled": true, "refreshInterval": "50ms"},
        "responseCache": {"maxBodyBytes": 4096}, "idempotency": {"enabled": true},
        "completionFlushInterval": "20ms",
    })
}

/// Waits (bounded) until the current UTC hour has a minute left at least: a test whose limit
/// window is the hour must not see it roll over mid-test (that resets the counter by itself).
pub fn well_inside_the_hour() {
    crate::poll_until("well inside the hour's window", std::time::Duration::from_secs(90), || {
        let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        s % 3600 < 3600 - 60
    });
}

/// The sidecar's test-only hold on decision answers (`TOLLGATE_TEST_DECIDE_DELAY_FILE`,
/// sidecar/src/testing.rs): a file of milliseconds the test writes to turn it on and off.
pub struct DecideDelay {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

impl DecideDelay {
    pub fn new(ms: u64) -> DecideDelay {
        let dir = tempfile::tempdir().unwrap();
        let delay = DecideDelay { path: dir.path().join("decide-delay-ms"), _dir: dir };
        delay.set(ms);
        delay
    }

    pub fn set(&self, ms: u64) {
        std::fs::write(&self.path, ms.to_string()).unwrap();
    }

    /// The sidecar environment variable that points at it.
    pub fn env(&self) -> (&'static str, String) {
        ("TOLLGATE_TEST_DECIDE_DELAY_FILE", self.path.display().to_string())
    }
}

/// A client that leaves before its answer: it sends `GET /` with `api_key` to the Envoy at `url`
/// (one of its URLs), waits `patience` for an answer that must not come (the test holds answers
/// longer: an answer within it would be the test's fault), then drops its connection, which ends
/// the request.
pub fn leave_before_the_answer(url: &str, api_key: &str, patience: std::time::Duration) {
    use std::io::{Read, Write};
    let port: u16 = url.trim_start_matches("http://").split([':', '/']).nth(1).unwrap().parse().unwrap();
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.write_all(format!("GET / HTTP/1.1\r\nhost: api.test\r\nx-api-key: {api_key}\r\n\r\n").as_bytes()).unwrap();
    c.set_read_timeout(Some(patience)).unwrap();
    let mut buf = [0u8; 64];
    assert!(c.read(&mut buf).is_err(), "a leaving client was answered before it left");
}

/// The count of the key's `pm` fixed-window limit in Redis (`rl:{tenant}:pm:k.<key id>:*`), 0
/// before any.
pub fn window_count(redis: &crate::redis::Redis, tenant: &str, key_id: &str) -> u64 {
    let keys = redis.keys(&format!("rl:{{{tenant}}}:pm:k.{key_id}:*"));
    keys.first().map_or(0, |k| redis.cmd::<Option<u64>>(&["GET", k]).unwrap_or(0))
}

/// What the filter sends for an API key: the lowercase hex sha256 of the raw key.
pub fn key_hash(raw: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(raw.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}
