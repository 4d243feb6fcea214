//! Per-tenant series for operators (issue 17; docs/observability.md).
//!
//! Leased and cached requests never reach the sidecar one by one, but every request of a known
//! tenant does reach it as a usage event (the filter's batches, and the denials the sidecar
//! decides itself), so the per-request series are derived from the usage stream once it is
//! durable: `tollgate_requests_total`, `tollgate_request_tokens_total`,
//! `tollgate_request_duration_seconds`. The per-limit series come from the decisions the sidecar
//! makes (exact limits, lease grants): `tollgate_limit_*`.
//!
//! Cardinality is bounded by configuration: the first `telemetry.max_tenants` tenants seen get
//! their own label value, every later one is `other`; routes, plans and limits are the
//! operator's configuration; outcomes are the deny codes of the wire (`other` for anything else)
//! and status classes are five values.

use crate::decision::checks::Meta;
use crate::decision::limits::Algorithm;
use crate::invalid::{invalid, Invalid};
use crate::scripts::decide::LimitState;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};
use tollgate_wire::codes;
use tollgate_wire::usage::UsageEvent;

/// Requests of known tenants, labelled `tenant`, `route`, `plan`, `outcome` (`allowed` or the
/// gateway's deny code) and `status_class` (`2xx` … `5xx`, `none` when the client went away).
pub const REQUESTS: &str = "tollgate_requests_total";
/// Tokens used (`usage.total_tokens` of the upstream's answers), labelled `tenant`.
pub const TOKENS: &str = "tollgate_request_tokens_total";
/// Limit checks the sidecar made (one per decision that ran the limit), labelled `tenant`, `limit`, `kind` (the algorithm).
pub const LIMIT_HITS: &str = "tollgate_limit_hits_total";
/// Decisions a limit denied, labelled `tenant`, `limit`, `kind` (the algorithm).
pub const LIMIT_OVER: &str = "tollgate_limit_over_limit_total";
/// Decisions that left a limit at or above `telemetry.near_limit` of its quota used (allowed or
/// not), labelled `tenant`, `limit`, `kind` (the algorithm).
pub const LIMIT_NEAR: &str = "tollgate_limit_near_limit_total";
/// Decisions a shadow limit would have denied, labelled `tenant`, `limit`, `kind` (the algorithm).
pub const LIMIT_SHADOW: &str = "tollgate_limit_shadow_denials_total";
/// The share of a limit used after the tenant's last decision that ran it (0–1), labelled
/// `tenant`, `limit`.
pub const LIMIT_USED: &str = "tollgate_limit_used_ratio";

// The two histograms with buckets of their own are named in `metrics` (the recorder sets them).
pub use crate::metrics::{DECISION_SECONDS, DURATION};

/// The label value of tenants past `max_tenants`.
pub const OTHER: &str = "other";

/// `[telemetry]` of the sidecar configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The per-tenant series (`tollgate_requests_total`, `tollgate_request_*`, `tollgate_limit_*`)
    /// on (the default) or off: off, a usage event or a decision records none of them (what
    /// `./build.sh bench` compares against to measure their cost).
    pub per_tenant: bool,
    /// How many tenants get their own `tenant` label value (the first ones seen since start);
    /// the rest are counted as `other`.
    pub max_tenants: usize,
    /// The share of a limit's quota from which a decision counts as near the limit (0–1).
    pub near_limit: f64,
    /// Decision spans over OTLP (crate::trace); off unless an endpoint is set.
    pub traces: crate::trace::TracesConfig,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig { per_tenant: true, max_tenants: 200, near_limit: 0.8, traces: Default::default() }
    }
}

impl TelemetryConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.max_tenants > 100_000 {
            return Err(invalid("telemetry.max_tenants", "at most 100000 (each tenant multiplies every per-tenant series)"));
        }
        if !(self.near_limit > 0.0 && self.near_limit <= 1.0) {
            return Err(invalid("telemetry.near_limit", "a fraction in (0, 1]"));
        }
        self.traces.validate()
    }
}

/// The bounded set of tenant label values: pure, so its bound is tested without a recorder.
#[derive(Debug)]
pub struct TenantLabels {
    max: usize,
    seen: HashSet<String>,
}

impl TenantLabels {
    pub fn new(max: usize) -> TenantLabels {
        TenantLabels { max, seen: HashSet::new() }
    }

    /// `tenant` itself while it has (or can take) one of the `max` places, else [`OTHER`].
    pub fn label(&mut self, tenant: &str) -> String {
        if self.seen.contains(tenant) {
            return tenant.to_string();
        }
        if self.seen.len() < self.max && tenant != OTHER {
            self.seen.insert(tenant.to_string());
            return tenant.to_string();
        }
        OTHER.to_string()
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

struct Telemetry {
    per_tenant: AtomicBool,
    near_limit: RwLock<f64>,
    tenants: Mutex<TenantLabels>,
}

static TELEMETRY: OnceLock<Telemetry> = OnceLock::new();

fn global() -> &'static Telemetry {
    TELEMETRY.get_or_init(|| {
        let d = TelemetryConfig::default();
        Telemetry { per_tenant: AtomicBool::new(d.per_tenant), near_limit: RwLock::new(d.near_limit), tenants: Mutex::new(TenantLabels::new(d.max_tenants)) }
    })
}

/// Applies the configuration (the series are process-wide, like the metrics recorder; the last
/// sidecar started in a process sets them).
pub fn install(config: &TelemetryConfig) {
    let t = global();
    t.per_tenant.store(config.per_tenant, Ordering::Relaxed);
    if let Ok(mut n) = t.near_limit.write() {
        *n = config.near_limit;
    }
    if let Ok(mut labels) = t.tenants.lock() {
        if labels.max != config.max_tenants {
            *labels = TenantLabels::new(config.max_tenants);
        }
    }
}

fn tenant_label(tenant: &str) -> String {
    global().tenants.lock().map(|mut l| l.label(tenant)).unwrap_or_else(|_| OTHER.to_string())
}

/// The `outcome` label of a usage event.
pub fn outcome(e: &UsageEvent) -> &'static str {
    match e.denied.as_deref() {
        None => "allowed",
        Some(code) => codes::ALL_DENY.iter().find(|c| **c == code).copied().unwrap_or("other"),
    }
}

/// The `status_class` label of a status.
pub fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "none",
    }
}

/// Counts durable usage events (called once per event, after the spool took it).
pub fn observe_usage(events: &[UsageEvent]) {
    if !global().per_tenant.load(Ordering::Relaxed) {
        return;
    }
    for e in events {
        let tenant = tenant_label(&e.tenant);
        let route = e.route.clone().unwrap_or_else(|| "none".into());
        metrics::counter!(REQUESTS,
            "tenant" => tenant.clone(), "route" => route, "plan" => e.plan.clone(),
            "outcome" => outcome(e), "status_class" => status_class(e.status))
        .increment(1);
        if let Some(t) = e.tokens.filter(|t| *t > 0) {
            metrics::counter!(TOKENS, "tenant" => tenant.clone()).increment(t);
        }
        if e.denied.is_none() {
            metrics::histogram!(DURATION, "tenant" => tenant).record(e.duration_ms as f64 / 1000.0);
        }
    }
}

/// The `kind` label of a limit: its algorithm.
pub fn kind(a: Algorithm) -> &'static str {
    match a {
        Algorithm::FixedWindow => "fixed_window",
        Algorithm::SlidingWindow => "sliding_window",
        Algorithm::TokenBucket => "token_bucket",
        Algorithm::SlidingLog => "sliding_log",
        Algorithm::TokenBudget => "token_budget",
        Algorithm::SpendBudget => "spend_budget",
        Algorithm::Concurrency => "concurrency",
        Algorithm::TokensPerMinute => "tokens_per_minute",
    }
}

/// How much of a limit a decision left used (0–1).
pub fn used_ratio(meta: &Meta, state: &LimitState) -> f64 {
    if meta.limit == 0 {
        return 1.0;
    }
    1.0 - (state.remaining.min(meta.limit) as f64 / meta.limit as f64)
}

/// Counts one decision's limit checks: hits, the limit that denied, near-limit and shadow denials.
pub fn observe_limits(tenant: &str, meta: &[Meta], states: &[LimitState], denied: Option<usize>) {
    if meta.is_empty() || !global().per_tenant.load(Ordering::Relaxed) {
        return;
    }
    let tenant = tenant_label(tenant);
    let near = global().near_limit.read().map(|n| *n).unwrap_or(0.8);
    for (i, (m, s)) in meta.iter().zip(states).enumerate() {
        let labels = [("tenant", tenant.clone()), ("limit", m.name.clone()), ("kind", kind(m.algorithm).to_string())];
        metrics::counter!(LIMIT_HITS, &labels).increment(1);
        let used = used_ratio(m, s);
        metrics::gauge!(LIMIT_USED, &labels).set(used);
        if denied == Some(i) {
            metrics::counter!(LIMIT_OVER, &labels).increment(1);
        }
        if used >= near {
            metrics::counter!(LIMIT_NEAR, &labels).increment(1);
        }
        if m.shadow && s.would_deny {
            metrics::counter!(LIMIT_SHADOW, &labels).increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_thousand_tenants_take_at_most_max_labels() {
        let mut labels = TenantLabels::new(200);
        let mut values = HashSet::new();
        for i in 0..10_000 {
            values.insert(labels.label(&format!("tenant{i}")));
        }
        assert_eq!(labels.len(), 200);
        assert_eq!(values.len(), 201, "200 tenants and `other`");
        assert!(values.contains(OTHER));
        // the first ones keep their label; a later one stays `other`
        assert_eq!(labels.label("tenant0"), "tenant0");
        assert_eq!(labels.label("tenant199"), "tenant199");
        assert_eq!(labels.label("tenant200"), OTHER);
        // a tenant literally named `other` cannot take a place of its own
        let mut l = TenantLabels::new(5);
        assert_eq!(l.label(OTHER), OTHER);
        assert!(l.is_empty());
    }

    #[test]
    fn outcomes_and_status_classes_are_bounded() {
        let mut e = UsageEvent::default();
        assert_eq!(outcome(&e), "allowed");
        e.denied = Some("rate_limited".into());
        assert_eq!(outcome(&e), "rate_limited");
        e.denied = Some("anything a future version invents".into());
        assert_eq!(outcome(&e), "other");
        assert_eq!((status_class(0), status_class(200), status_class(429), status_class(503), status_class(999)), ("none", "2xx", "4xx", "5xx", "none"));
    }

    #[test]
    fn config_is_checked() {
        assert!(TelemetryConfig::default().validate().is_ok());
        assert!(TelemetryConfig { near_limit: 0.0, ..Default::default() }.validate().is_err());
        assert!(TelemetryConfig { near_limit: 1.5, ..Default::default() }.validate().is_err());
        assert!(TelemetryConfig { max_tenants: 1_000_000, ..Default::default() }.validate().is_err());
    }
}
