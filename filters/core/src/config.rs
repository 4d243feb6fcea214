//! Plugin configuration: the JSON Envoy hands to `on_configure`, parsed and validated once into
//! an immutable [`FilterConfig`] shared by every HTTP context of the VM.
//!
//! Unknown fields are refused and every field has an explicit default, so `{}` is a valid
//! configuration and a typo is an error that makes Envoy refuse the plugin. Each section's types
//! live beside the code they configure (`crate::sidecar`, `crate::key`, `crate::changes`, `crate::breaker::config`,
//! `crate::lease::config`, `crate::routing`, `crate::usage`, `crate::responses`); this module
//! only composes them.

use crate::breaker::config::{BreakerConfig, RawBreakers};
use crate::changes::{ChangesConfig, RawChanges};
use crate::headers::check_header_name;
use crate::key::{self, KeySource};
use crate::lease::config::{LeaseConfig, RawLeases};
use crate::responses::{IdempotencyConfig, RawStore, ResponseCacheConfig, StoreConfig};
use crate::routing::{RawRouting, RoutingConfig};
use crate::settings::{duration_within, parse_duration, ConfigError};
use crate::sidecar::{RawSidecar, Sidecar};
use crate::usage::{RawUsage, UsageConfig};
use serde::Deserialize;
use std::rc::Rc;
use std::time::Duration;

/// What the filter does when the sidecar cannot decide (no answer in time, or an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailureMode {
    /// Reply 503 `sidecar_unavailable`.
    Closed,
    /// Let the request through without identity, marked `x-tollgate-degraded`.
    Open,
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

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    sidecar: RawSidecar,
    #[serde(default = "default_failure_mode")]
    failure_mode: FailureMode,
    #[serde(default = "key::default_sources")]
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
    breakers: RawBreakers,
    #[serde(default)]
    usage: RawUsage,
    /// Leased limits (crate::lease).
    #[serde(default)]
    leases: RawLeases,
    #[serde(default)]
    routing: RawRouting,
    #[serde(default)]
    response_cache: RawStore,
    #[serde(default)]
    idempotency: RawStore,
    /// Revocations and plan changes reaching cached answers and leases (crate::changes).
    #[serde(default)]
    changes: RawChanges,
    /// Bytes of response bodies one worker keeps at once (crate::filter::kept).
    #[serde(default = "default_max_kept_body_bytes")]
    max_kept_body_bytes: u64,
}

fn default_max_kept_body_bytes() -> u64 {
    64 << 20
}

fn default_token_usage() -> TokenUsage {
    TokenUsage::ResponseJson
}
fn default_flush_interval() -> String {
    "100ms".into()
}
fn default_failure_mode() -> FailureMode {
    FailureMode::Closed
}
fn default_auth_cache_max_ttl() -> String {
    "500ms".into()
}

/// Most `forwardHeaders` names: each sends at most one header with a decision.
pub const MAX_FORWARD_HEADERS: usize = 64;

/// The validated, immutable configuration of one plugin instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterConfig {
    /// Where calls to the sidecar go, and the decision call's timeout.
    pub sidecar: Sidecar,
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
    /// Circuit breakers per upstream target (none unless configured); shared with every
    /// request's breaker guard.
    pub breakers: Rc<BreakerConfig>,
    /// Usage metering (off unless configured).
    pub usage: UsageConfig,
    /// Routing by the sidecar's routing table (off unless configured).
    pub routing: RoutingConfig,
    /// The response cache (on; applies to routes with a cache TTL).
    pub response_cache: ResponseCacheConfig,
    /// Idempotency-Key replay (off unless configured).
    pub idempotency: IdempotencyConfig,
    /// Leased limits: how the filter asks for, sizes and renews leases (crate::lease).
    pub leases: LeaseConfig,
    /// Polling the sidecar's change count (on): revocations and plan changes drop cached answers
    /// and leases (crate::changes).
    pub changes: ChangesConfig,
    /// Bytes of response bodies (to store, or to read token usage from) one worker keeps at once
    /// across its requests; past it a body is not kept (crate::filter::kept, decision 142).
    pub max_kept_body_bytes: usize,
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            sidecar: Sidecar::default(),
            failure_mode: FailureMode::Closed,
            key_sources: key::default_sources(),
            auth_cache_max_ttl: Duration::from_millis(500),
            forward_headers: Vec::new(),
            token_usage_from_response: true,
            completion_flush_interval: Duration::from_millis(100),
            token_estimate_field: None,
            breakers: Rc::default(),
            usage: UsageConfig::default(),
            routing: RoutingConfig::default(),
            response_cache: StoreConfig::RESPONSE_CACHE,
            idempotency: StoreConfig::IDEMPOTENCY,
            leases: LeaseConfig::default(),
            changes: ChangesConfig::default(),
            max_kept_body_bytes: 64 << 20,
        }
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

        let sidecar = Sidecar::compile(raw.sidecar)?;
        let auth_cache_max_ttl = parse_duration(&raw.auth_cache_max_ttl)
            .map_err(|e| ConfigError(format!("authCacheMaxTtl: {e}")))?;
        if auth_cache_max_ttl > Duration::from_secs(60) {
            return Err(ConfigError("authCacheMaxTtl: must be at most 60s".into()));
        }
        let (min, max) = (Duration::from_millis(10), Duration::from_secs(10));
        let completion_flush_interval =
            duration_within("completionFlushInterval", &raw.completion_flush_interval, min, max, "10ms and 10s")?;
        let usage = UsageConfig::compile(raw.usage)?;
        let routing = RoutingConfig::compile(raw.routing)?;
        let response_cache = StoreConfig::compile(raw.response_cache, StoreConfig::RESPONSE_CACHE, "responseCache")?;
        let idempotency = StoreConfig::compile(raw.idempotency, StoreConfig::IDEMPOTENCY, "idempotency")?;
        let key_sources = key::compile_sources(raw.key_sources)?;
        if raw.forward_headers.len() > MAX_FORWARD_HEADERS {
            return Err(ConfigError(format!("forwardHeaders: at most {MAX_FORWARD_HEADERS} names (the sidecar reads at most {} headers a decision)", tollgate_wire::compact::MAX_HEADERS)));
        }
        let mut forward_headers = Vec::with_capacity(raw.forward_headers.len());
        for (i, h) in raw.forward_headers.iter().enumerate() {
            let h = h.to_ascii_lowercase();
            check_header_name(&h).map_err(|e| ConfigError(format!("forwardHeaders[{i}]: {e}")))?;
            // the raw key never leaves the filter: a header a key is read from is never sent
            // (`authorization`, the bearer source's, is refused by `check_header_name`)
            let holds_key = key_sources.iter().any(|s| matches!(s, key::KeySource::Header { name } if *name == h));
            if holds_key {
                return Err(ConfigError(format!("forwardHeaders[{i}]: '{h}' is a key source: the raw key never leaves the filter")));
            }
            forward_headers.push(h);
        }
        if !(1 << 20..=1 << 30).contains(&raw.max_kept_body_bytes) {
            return Err(ConfigError("maxKeptBodyBytes: must be between 1048576 (1 MiB) and 1073741824 (1 GiB)".into()));
        }
        Ok(FilterConfig {
            max_kept_body_bytes: raw.max_kept_body_bytes as usize,
            sidecar,
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
            breakers: Rc::new(BreakerConfig::compile(raw.breakers)?),
            usage,
            routing,
            response_cache,
            idempotency,
            leases: LeaseConfig::compile(raw.leases)?,
            changes: ChangesConfig::compile(raw.changes)?,
        })
    }
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
        assert_eq!(c.sidecar.cluster, "sc");
        assert_eq!(c.sidecar.timeout, Duration::from_secs(2));
        assert_eq!(c.sidecar.address, None);
        assert_eq!(c.failure_mode, FailureMode::Open);
        let native = FilterConfig::parse(br#"{"sidecar":{"address":"127.0.0.1:9101"}}"#).unwrap();
        assert_eq!(native.sidecar.address, Some(crate::sidecar::SidecarAddress::Tcp("127.0.0.1:9101".parse().unwrap())));
        let unix = FilterConfig::parse(br#"{"sidecar":{"address":"unix:/run/tollgate/s.sock"}}"#).unwrap();
        assert_eq!(unix.sidecar.address, Some(crate::sidecar::SidecarAddress::Unix("/run/tollgate/s.sock".into())));
        assert_eq!(
            c.key_sources,
            vec![KeySource::Header { name: "x-key".into() }, KeySource::Query { name: "k".into() }]
        );
    }

    #[test]
    fn bad_configs_are_refused_naming_the_field() {
        let too_many = format!(r#"{{"forwardHeaders":[{}]}}"#, (0..=MAX_FORWARD_HEADERS).map(|i| format!("\"x-h{i}\"")).collect::<Vec<_>>().join(","));
        let cases: &[(&[u8], &str)] = &[
            (too_many.as_bytes(), "forwardHeaders: at most 64 names"),
            (br#"{"failureMode":"sometimes"}"#, "unknown variant"),
            (br#"{"timeout":"25ms"}"#, "unknown field"),
            (br#"{"sidecar":{"timeout":"soon"}}"#, "sidecar.timeout"),
            (br#"{"sidecar":{"timeout":"0ms"}}"#, "sidecar.timeout"),
            (br#"{"sidecar":{"address":"localhost:80"}}"#, "sidecar.address"),
            (br#"{"sidecar":{"address":"unix:run/s.sock"}}"#, "sidecar.address"),
            (br#"{"keySources":[]}"#, "keySources"),
            (br#"{"authCacheMaxTtl":"2m"}"#, "authCacheMaxTtl"),
            (br#"{"maxKeptBodyBytes":1000}"#, "maxKeptBodyBytes"),
            (br#"{"maxKeptBodyBytes":2147483648}"#, "maxKeptBodyBytes"),
            (br#"{"completionFlushInterval":"1ms"}"#, "completionFlushInterval"),
            (br#"{"forwardHeaders":["x-tollgate-user"]}"#, "forwardHeaders[0]"),
            (br#"{"forwardHeaders":["x-user","X-Api-Key"]}"#, "forwardHeaders[1]: 'x-api-key' is a key source"),
            (br#"{"forwardHeaders":["authorization"]}"#, "forwardHeaders[0]: use the bearer source"),
            (br#"{"keySources":[{"type":"header","name":"x-key"}],"forwardHeaders":["x-key"]}"#, "forwardHeaders[0]: 'x-key' is a key source"),
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
        assert_eq!(
            c.usage,
            UsageConfig { enabled: true, flush_interval: Duration::from_millis(200), max_queued: 10, max_queued_bytes: 32 << 20, llm_all: false }
        );
        assert!(FilterConfig::parse(br#"{"usage":{"enabled":true,"llm":"all"}}"#).unwrap().usage.llm_all);
        assert!(FilterConfig::parse(br#"{"usage":{"llm":"some"}}"#).is_err());
    }

    // ---- the breakers section (crate::breaker::config) ----

    #[test]
    fn no_section_means_no_breakers() {
        let c = FilterConfig::parse(b"{}").unwrap();
        assert!(c.breakers.targets.is_empty());
        assert_eq!(c.breakers.policy.open_ms, 30_000);
        assert_eq!(c.breakers.failure_statuses, vec![(500, 599)]);
    }

    #[test]
    fn full_section_parses() {
        let c = FilterConfig::parse(
            br#"{"breakers":{"consecutiveFailures":3,"failureRatio":0.25,"window":"5s","minRequests":4,
                "openFor":"2s","halfOpenTrials":2,"trialTimeout":"3s","failureStatuses":["502","503"],"failOn429":true,
                "hints":{"pollInterval":"200ms"},
                "targets":[{"name":"a","cluster":"ca","provider":"openai","model":"gpt-4o","fallback":["b"]},
                           {"name":"b","cluster":"cb"}]}}"#,
        )
        .unwrap();
        let b = &c.breakers;
        assert_eq!(b.policy.consecutive_failures, 3);
        assert_eq!(b.policy.failure_ratio_permille, 250);
        assert_eq!(b.policy.open_ms, 2_000);
        assert_eq!(b.policy.half_open_trials, 2);
        assert_eq!(b.targets[0].fallback, vec![1]);
        assert_eq!(b.targets[0].hint, Some(("openai".into(), "gpt-4o".into())));
        assert!(b.is_failure_status(502) && b.is_failure_status(429) && !b.is_failure_status(500));
        assert!(b.shares_hints());
        assert!(b.metric_names().contains(&"tollgate.breaker.a.opened_by_hint".to_string()));
    }

    #[test]
    fn bad_sections_are_refused_naming_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"breakers":{"targets":[{"name":"a b","cluster":"c"}]}}"#, "targets[0].name"),
            (r#"{"breakers":{"targets":[{"name":"a","cluster":"c"},{"name":"a","cluster":"d"}]}}"#, "targets[0].name"),
            (r#"{"breakers":{"targets":[{"name":"a","cluster":"c"},{"name":"b","cluster":"c"}]}}"#, "targets[0].cluster"),
            (r#"{"breakers":{"targets":[{"name":"a","cluster":"c","fallback":["z"]}]}}"#, "targets[0].fallback[0]"),
            (r#"{"breakers":{"targets":[{"name":"a","cluster":"c","fallback":["a"]}]}}"#, "targets[0].fallback[0]"),
            (r#"{"breakers":{"targets":[{"name":"a","cluster":"c","provider":"p"}]}}"#, "targets[0].provider"),
            (r#"{"breakers":{"targets":[{"name":"a","cluster":"c","provider":"p:x","model":"m"}]}}"#, "targets[0].provider"),
            (r#"{"breakers":{"openFor":"soon"}}"#, "breakers.openFor"),
            (r#"{"breakers":{"failureRatio":2}}"#, "breakers.failureRatio"),
            (r#"{"breakers":{"halfOpenTrials":0}}"#, "breakers.halfOpenTrials"),
            (r#"{"breakers":{"failureStatuses":["6xx"]}}"#, "failureStatuses[0]"),
            (r#"{"breakers":{"hints":{"pollInterval":"1ms"}}}"#, "hints.pollInterval"),
            (r#"{"breakers":{"targetz":[]}}"#, "unknown field"),
        ];
        for (input, needle) in cases {
            let e = FilterConfig::parse(input.as_bytes()).unwrap_err();
            assert!(e.to_string().contains(needle), "{e} should mention {needle}");
        }
    }
}
