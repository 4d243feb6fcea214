//! Sample values shared by tests and the bench, so that what the tests check and what the bench
//! measures are the same: the response-cache gateway's configuration.

use serde_json::{json, Value};

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
