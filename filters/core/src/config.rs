//! Plugin configuration: the JSON Envoy hands to `on_configure`, parsed and validated once into
//! an immutable [`FilterConfig`] shared by every HTTP context of the VM.
//!
//! Unknown fields are refused and every field has an explicit default, so `{}` is a valid
//! configuration and a typo is an error that makes Envoy refuse the plugin.

use serde::Deserialize;
use std::time::Duration;

/// The namespace of headers that only Tollgate may set. Client-supplied ones are stripped.
pub const INTERNAL_HEADER_PREFIX: &str = "x-tollgate-";

/// What the filter does when the sidecar cannot decide (no answer in time, or an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailureMode {
    /// Reply 503 `sidecar_unavailable`.
    Closed,
    /// Let the request through without identity, marked `x-tollgate-degraded`.
    Open,
}

/// Where the API key may be found, tried in the configured order.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum KeySource {
    /// `Authorization: Bearer <key>`.
    Bearer,
    /// A request header holding the key alone.
    Header { name: String },
    /// A query parameter holding the key (percent-decoded).
    Query { name: String },
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawSidecar {
    #[serde(default = "default_cluster")]
    cluster: String,
    #[serde(default = "default_authority")]
    authority: String,
    #[serde(default = "default_timeout")]
    timeout: String,
}

impl Default for RawSidecar {
    fn default() -> Self {
        RawSidecar { cluster: default_cluster(), authority: default_authority(), timeout: default_timeout() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    sidecar: RawSidecar,
    #[serde(default = "default_failure_mode")]
    failure_mode: FailureMode,
    #[serde(default = "default_key_sources")]
    key_sources: Vec<KeySource>,
    #[serde(default = "default_auth_cache_max_ttl")]
    auth_cache_max_ttl: String,
    #[serde(default)]
    forward_headers: Vec<String>,
    #[serde(default = "default_token_usage")]
    token_usage: TokenUsage,
    #[serde(default = "default_flush_interval")]
    completion_flush_interval: String,
    #[serde(default)]
    token_estimate_field: Option<String>,
    #[serde(default)]
    breakers: crate::breaker_config::RawBreakers,
    #[serde(default)]
    usage: RawUsage,
    /// Leased limits (crate::lease).
    #[serde(default)]
    leases: crate::lease::RawLeases,
    #[serde(default)]
    routing: RawRouting,
    #[serde(default)]
    response_cache: RawResponseCache,
    #[serde(default)]
    idempotency: RawIdempotency,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawResponseCache {
    #[serde(default = "default_true")]
    enabled: bool,
    #[serde(default = "default_cache_max_body")]
    max_body_bytes: usize,
}

impl Default for RawResponseCache {
    fn default() -> Self {
        RawResponseCache { enabled: true, max_body_bytes: default_cache_max_body() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawIdempotency {
    #[serde(default)]
    enabled: bool,
    #[serde(default = "default_idem_max_body")]
    max_body_bytes: usize,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        RawIdempotency { enabled: false, max_body_bytes: default_idem_max_body() }
    }
}

fn default_true() -> bool {
    true
}
fn default_cache_max_body() -> usize {
    256 * 1024
}
fn default_idem_max_body() -> usize {
    1 << 20
}

/// The response cache (issue 7): routes with a `cache_ttl` are looked up in the decision call and
/// their successful responses stored off the request path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseCacheConfig {
    /// Honour routes' cache TTLs (off: no lookups, no stores, no `x-tollgate-cache`).
    pub enabled: bool,
    /// Larger response bodies are not stored.
    pub max_body_bytes: usize,
}

impl Default for ResponseCacheConfig {
    fn default() -> Self {
        ResponseCacheConfig { enabled: true, max_body_bytes: default_cache_max_body() }
    }
}

/// Idempotency-Key replay (issue 7, seed 002).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyConfig {
    /// Honour `Idempotency-Key` on POST, PATCH, PUT and DELETE.
    pub enabled: bool,
    /// A larger 2xx body is remembered without its body (status and headers are replayed).
    pub max_body_bytes: usize,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig { enabled: false, max_body_bytes: default_idem_max_body() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawRouting {
    #[serde(default)]
    enabled: bool,
    #[serde(default = "default_routing_refresh")]
    refresh_interval: String,
}

impl Default for RawRouting {
    fn default() -> Self {
        RawRouting { enabled: false, refresh_interval: default_routing_refresh() }
    }
}

fn default_routing_refresh() -> String {
    "200ms".into()
}

/// Routing (issue 4): the filter matches every request against the sidecar's routing table,
/// kept in shared data, and steers it to the route's cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingConfig {
    pub enabled: bool,
    /// How often one root context per Envoy asks the sidecar whether the table changed.
    pub refresh_interval: Duration,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig { enabled: false, refresh_interval: Duration::from_millis(200) }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawUsage {
    #[serde(default)]
    enabled: bool,
    #[serde(default = "default_usage_flush_interval")]
    flush_interval: String,
    #[serde(default = "default_usage_max_queued")]
    max_queued: usize,
}

impl Default for RawUsage {
    fn default() -> Self {
        RawUsage { enabled: false, flush_interval: default_usage_flush_interval(), max_queued: default_usage_max_queued() }
    }
}

fn default_usage_flush_interval() -> String {
    "1s".into()
}
fn default_usage_max_queued() -> usize {
    50_000
}

/// Usage metering (issue 6): what the filter records and how it sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageConfig {
    /// Record a usage event for every request with an identity and send them to the sidecar.
    pub enabled: bool,
    /// How often each worker sends its batched events (`POST /v1/usage`).
    pub flush_interval: Duration,
    /// Events a worker keeps while the sidecar cannot take them; past it the oldest are dropped
    /// and counted (`tollgate.usage.dropped`).
    pub max_queued: usize,
}

impl Default for UsageConfig {
    fn default() -> Self {
        UsageConfig { enabled: false, flush_interval: Duration::from_secs(1), max_queued: default_usage_max_queued() }
    }
}

/// Where the tokens a request used come from, for token budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TokenUsage {
    /// `usage.total_tokens` of the JSON (or SSE) response body.
    ResponseJson,
    /// Not read: the reservation (estimate) stands as the charge.
    None,
}

fn default_token_usage() -> TokenUsage {
    TokenUsage::ResponseJson
}
fn default_flush_interval() -> String {
    "100ms".into()
}

fn default_cluster() -> String {
    "tollgate_sidecar".into()
}
fn default_authority() -> String {
    "tollgate-sidecar".into()
}
fn default_timeout() -> String {
    "25ms".into()
}
fn default_failure_mode() -> FailureMode {
    FailureMode::Closed
}
fn default_auth_cache_max_ttl() -> String {
    "500ms".into()
}
fn default_key_sources() -> Vec<KeySource> {
    vec![
        KeySource::Bearer,
        KeySource::Header { name: "x-api-key".into() },
        KeySource::Query { name: "api_key".into() },
    ]
}

/// The validated, immutable configuration of one plugin instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterConfig {
    /// Envoy cluster that reaches the sidecar.
    pub sidecar_cluster: String,
    /// `:authority` of calls to the sidecar.
    pub sidecar_authority: String,
    /// How long a decision call may take before the failure mode applies.
    pub sidecar_timeout: Duration,
    pub failure_mode: FailureMode,
    /// Key sources in the order they are tried. Header names are lowercase.
    pub key_sources: Vec<KeySource>,
    /// Upper bound on how long an allow answer is reused from the VM-wide cache without a call
    /// (the sidecar proposes the time; zero disables the cache).
    pub auth_cache_max_ttl: Duration,
    /// Request headers whose values are sent with the decision (for header-subject limits).
    pub forward_headers: Vec<String>,
    /// Read `usage.total_tokens` from responses of requests holding a token reservation.
    pub token_usage_from_response: bool,
    /// How often each worker flushes its completion reports.
    pub completion_flush_interval: Duration,
    /// A top-level field of a JSON request body that tells the tokens a request may use (e.g.
    /// `max_tokens`). When set, JSON requests with a body are decided once the body is in.
    pub token_estimate_field: Option<String>,
    /// Circuit breakers per upstream target (none unless configured).
    pub breakers: crate::breaker_config::BreakerConfig,
    /// Usage metering (off unless configured).
    pub usage: UsageConfig,
    /// Routing by the sidecar's routing table (off unless configured).
    pub routing: RoutingConfig,
    /// The response cache (on; applies to routes with a cache TTL).
    pub response_cache: ResponseCacheConfig,
    /// Idempotency-Key replay (off unless configured).
    pub idempotency: IdempotencyConfig,
    /// Leased limits: how the filter asks for, sizes and renews leases (crate::lease).
    pub leases: crate::lease::LeaseConfig,
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            sidecar_cluster: default_cluster(),
            sidecar_authority: default_authority(),
            sidecar_timeout: Duration::from_millis(25),
            failure_mode: FailureMode::Closed,
            key_sources: default_key_sources(),
            auth_cache_max_ttl: Duration::from_millis(500),
            forward_headers: Vec::new(),
            token_usage_from_response: true,
            completion_flush_interval: Duration::from_millis(100),
            token_estimate_field: None,
            breakers: Default::default(),
            usage: UsageConfig::default(),
            routing: RoutingConfig::default(),
            response_cache: ResponseCacheConfig::default(),
            idempotency: IdempotencyConfig::default(),
            leases: crate::lease::LeaseConfig::default(),
        }
    }
}

/// Why a configuration was refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid tollgate plugin configuration: {}", self.0)
    }
}

impl FilterConfig {
    /// Parses and validates the plugin configuration. Empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|_| ConfigError("not UTF-8".into()))?;
        let raw: RawConfig = if text.trim().is_empty() {
            serde_json::from_str("{}")
        } else {
            serde_json::from_str(text)
        }
        .map_err(|e| ConfigError(e.to_string()))?;

        let timeout = parse_duration(&raw.sidecar.timeout)
            .map_err(|e| ConfigError(format!("sidecar.timeout: {e}")))?;
        if timeout.is_zero() || timeout > Duration::from_secs(60) {
            return Err(ConfigError("sidecar.timeout: must be between 1ms and 60s".into()));
        }
        let auth_cache_max_ttl = parse_duration(&raw.auth_cache_max_ttl)
            .map_err(|e| ConfigError(format!("authCacheMaxTtl: {e}")))?;
        if auth_cache_max_ttl > Duration::from_secs(60) {
            return Err(ConfigError("authCacheMaxTtl: must be at most 60s".into()));
        }
        let completion_flush_interval = parse_duration(&raw.completion_flush_interval)
            .map_err(|e| ConfigError(format!("completionFlushInterval: {e}")))?;
        if completion_flush_interval < Duration::from_millis(10) || completion_flush_interval > Duration::from_secs(10) {
            return Err(ConfigError("completionFlushInterval: must be between 10ms and 10s".into()));
        }
        let usage_flush_interval = parse_duration(&raw.usage.flush_interval)
            .map_err(|e| ConfigError(format!("usage.flushInterval: {e}")))?;
        if usage_flush_interval < Duration::from_millis(10) || usage_flush_interval > Duration::from_secs(60) {
            return Err(ConfigError("usage.flushInterval: must be between 10ms and 60s".into()));
        }
        let routing_refresh = parse_duration(&raw.routing.refresh_interval)
            .map_err(|e| ConfigError(format!("routing.refreshInterval: {e}")))?;
        if routing_refresh < Duration::from_millis(10) || routing_refresh > Duration::from_secs(10) {
            return Err(ConfigError("routing.refreshInterval: must be between 10ms and 10s".into()));
        }
        if raw.usage.max_queued == 0 || raw.usage.max_queued > 1_000_000 {
            return Err(ConfigError("usage.maxQueued: must be between 1 and 1000000".into()));
        }
        let max = tollgate_wire::responses::MAX_STORED_BODY;
        if raw.response_cache.max_body_bytes == 0 || raw.response_cache.max_body_bytes > max {
            return Err(ConfigError(format!("responseCache.maxBodyBytes: must be between 1 and {max}")));
        }
        if raw.idempotency.max_body_bytes == 0 || raw.idempotency.max_body_bytes > max {
            return Err(ConfigError(format!("idempotency.maxBodyBytes: must be between 1 and {max}")));
        }
        let mut forward_headers = Vec::with_capacity(raw.forward_headers.len());
        for (i, h) in raw.forward_headers.iter().enumerate() {
            let h = h.to_ascii_lowercase();
            check_header_name(&h).map_err(|e| ConfigError(format!("forwardHeaders[{i}]: {e}")))?;
            forward_headers.push(h);
        }
        if raw.sidecar.cluster.trim().is_empty() {
            return Err(ConfigError("sidecar.cluster: must not be empty".into()));
        }
        if raw.key_sources.is_empty() {
            return Err(ConfigError("keySources: at least one source is required".into()));
        }
        let mut key_sources = Vec::with_capacity(raw.key_sources.len());
        for (i, source) in raw.key_sources.into_iter().enumerate() {
            key_sources.push(match source {
                KeySource::Bearer => KeySource::Bearer,
                KeySource::Header { name } => {
                    let name = name.to_ascii_lowercase();
                    check_header_name(&name).map_err(|e| ConfigError(format!("keySources[{i}].name: {e}")))?;
                    KeySource::Header { name }
                }
                KeySource::Query { name } => {
                    if name.is_empty() || name.contains(['&', '=', '#', '?']) {
                        return Err(ConfigError(format!("keySources[{i}].name: not a query parameter name")));
                    }
                    KeySource::Query { name }
                }
            });
        }
        Ok(FilterConfig {
            sidecar_cluster: raw.sidecar.cluster,
            sidecar_authority: raw.sidecar.authority,
            sidecar_timeout: timeout,
            failure_mode: raw.failure_mode,
            key_sources,
            auth_cache_max_ttl,
            forward_headers,
            token_usage_from_response: raw.token_usage == TokenUsage::ResponseJson,
            completion_flush_interval,
            token_estimate_field: match raw.token_estimate_field {
                Some(f) if f.is_empty() => return Err(ConfigError("tokenEstimateField: must not be empty".into())),
                other => other,
            },
            breakers: crate::breaker_config::BreakerConfig::compile(raw.breakers)?,
            usage: UsageConfig {
                enabled: raw.usage.enabled,
                flush_interval: usage_flush_interval,
                max_queued: raw.usage.max_queued,
            },
            routing: RoutingConfig { enabled: raw.routing.enabled, refresh_interval: routing_refresh },
            response_cache: ResponseCacheConfig {
                enabled: raw.response_cache.enabled,
                max_body_bytes: raw.response_cache.max_body_bytes,
            },
            idempotency: IdempotencyConfig { enabled: raw.idempotency.enabled, max_body_bytes: raw.idempotency.max_body_bytes },
            leases: crate::lease::LeaseConfig::compile(raw.leases)?,
        })
    }
}

fn check_header_name(name: &str) -> Result<(), String> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(format!("'{name}' is not a header name"));
    }
    if name.starts_with(INTERNAL_HEADER_PREFIX) {
        return Err(format!("'{name}' is in the internal {INTERNAL_HEADER_PREFIX}* namespace"));
    }
    if name == "authorization" {
        return Err("use the bearer source for the authorization header".into());
    }
    Ok(())
}

/// Parses a duration like `25ms`, `2s`, `1m` (a whole number and a unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("'{s}' is not a duration like \"25ms\""))?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(format!("'{s}': unit must be ms, s or m")),
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn empty_and_braces_mean_defaults() {
        assert_eq!(FilterConfig::parse(b"").unwrap(), FilterConfig::default());
        assert_eq!(FilterConfig::parse(b"{}").unwrap(), FilterConfig::default());
    }

    #[test]
    fn full_config_parses() {
        let c = FilterConfig::parse(
            br#"{"sidecar":{"cluster":"sc","authority":"a","timeout":"2s"},"failureMode":"open",
                 "keySources":[{"type":"header","name":"X-Key"},{"type":"query","name":"k"}]}"#,
        )
        .unwrap();
        assert_eq!(c.sidecar_cluster, "sc");
        assert_eq!(c.sidecar_timeout, Duration::from_secs(2));
        assert_eq!(c.failure_mode, FailureMode::Open);
        assert_eq!(
            c.key_sources,
            vec![KeySource::Header { name: "x-key".into() }, KeySource::Query { name: "k".into() }]
        );
    }

    #[test]
    fn bad_configs_are_refused_naming_the_field() {
        let cases: &[(&[u8], &str)] = &[
            (br#"{"failureMode":"sometimes"}"#, "unknown variant"),
            (br#"{"timeout":"25ms"}"#, "unknown field"),
            (br#"{"sidecar":{"timeout":"soon"}}"#, "sidecar.timeout"),
            (br#"{"sidecar":{"timeout":"0ms"}}"#, "sidecar.timeout"),
            (br#"{"keySources":[]}"#, "keySources"),
            (br#"{"authCacheMaxTtl":"2m"}"#, "authCacheMaxTtl"),
            (br#"{"completionFlushInterval":"1ms"}"#, "completionFlushInterval"),
            (br#"{"forwardHeaders":["x-tollgate-user"]}"#, "forwardHeaders[0]"),
            (br#"{"tokenUsage":"sometimes"}"#, "unknown variant"),
            (br#"{"keySources":[{"type":"header","name":"x-tollgate-tenant"}]}"#, "keySources[0].name"),
            (br#"{"keySources":[{"type":"query","name":"a=b"}]}"#, "keySources[0].name"),
            (br#"{"usage":{"flushInterval":"5ms"}}"#, "usage.flushInterval"),
            (br#"{"usage":{"maxQueued":0}}"#, "usage.maxQueued"),
            (br#"{"usage":{"enable":true}}"#, "unknown field"),
            (br#"{"responseCache":{"maxBodyBytes":0}}"#, "responseCache.maxBodyBytes"),
            (br#"{"idempotency":{"maxBodyBytes":2000000}}"#, "idempotency.maxBodyBytes"),
            (br#"{"idempotency":{"on":true}}"#, "unknown field"),
            (b"not json", "expected"),
        ];
        for (input, needle) in cases {
            let err = FilterConfig::parse(input).unwrap_err();
            assert!(err.to_string().contains(needle), "{err} should mention {needle}");
        }
    }

    #[test]
    fn usage_is_off_by_default_and_configurable() {
        assert!(!FilterConfig::default().usage.enabled);
        let c = FilterConfig::parse(br#"{"usage":{"enabled":true,"flushInterval":"200ms","maxQueued":10}}"#).unwrap();
        assert_eq!(c.usage, UsageConfig { enabled: true, flush_interval: Duration::from_millis(200), max_queued: 10 });
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("25ms").unwrap(), Duration::from_millis(25));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("5h").is_err());
    }
}
