//! The `breakers` section of the plugin configuration: the policy shared by every breaker, the
//! failure classification, the hint poller, and the targets (one breaker each).
//!
//! A target is an Envoy cluster the filter recognises by the routed cluster name
//! (`xds.cluster_name`), optionally with the provider/model that names its hint key
//! (`cb:hint:{provider}:{model}`), and an ordered list of fallback targets used while it is open.
//! No `breakers` section (or no targets) means no breaker at all.

use super::{Policy, Transition};
use crate::settings::{duration_within, ConfigError};
use serde::Deserialize;
use std::time::Duration;
use tollgate_wire::breaker::valid_hint_part;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawTarget {
    name: String,
    cluster: String,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    fallback: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawHints {
    #[serde(default = "default_true")]
    enabled: bool,
    #[serde(default = "default_poll_interval")]
    poll_interval: String,
    #[serde(default = "default_hint_timeout")]
    timeout: String,
}

impl Default for RawHints {
    fn default() -> Self {
        RawHints { enabled: true, poll_interval: default_poll_interval(), timeout: default_hint_timeout() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawBreakers {
    #[serde(default)]
    targets: Vec<RawTarget>,
    #[serde(default = "default_consecutive")]
    consecutive_failures: u32,
    #[serde(default = "default_ratio")]
    failure_ratio: f64,
    #[serde(default = "default_window")]
    window: String,
    #[serde(default = "default_min_requests")]
    min_requests: u32,
    #[serde(default = "default_open_for")]
    open_for: String,
    #[serde(default = "default_trials")]
    half_open_trials: u32,
    #[serde(default = "default_trial_timeout")]
    trial_timeout: String,
    #[serde(default = "default_statuses")]
    failure_statuses: Vec<String>,
    #[serde(default)]
    fail_on429: bool,
    #[serde(default)]
    hints: RawHints,
}

impl Default for RawBreakers {
    fn default() -> Self {
        RawBreakers {
            targets: Vec::new(),
            consecutive_failures: default_consecutive(),
            failure_ratio: default_ratio(),
            window: default_window(),
            min_requests: default_min_requests(),
            open_for: default_open_for(),
            half_open_trials: default_trials(),
            trial_timeout: default_trial_timeout(),
            failure_statuses: default_statuses(),
            fail_on429: false,
            hints: RawHints::default(),
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_poll_interval() -> String {
    "500ms".into()
}
fn default_hint_timeout() -> String {
    "1s".into()
}
fn default_consecutive() -> u32 {
    5
}
fn default_ratio() -> f64 {
    0.5
}
fn default_window() -> String {
    "10s".into()
}
fn default_min_requests() -> u32 {
    20
}
fn default_open_for() -> String {
    "30s".into()
}
fn default_trials() -> u32 {
    1
}
fn default_trial_timeout() -> String {
    "10s".into()
}
fn default_statuses() -> Vec<String> {
    vec!["5xx".into()]
}

/// One breaker's target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub name: String,
    /// The Envoy cluster requests to this target are routed to.
    pub cluster: String,
    /// `(provider, model)` of the hint key, when hints are shared for this target.
    pub hint: Option<(String, String)>,
    /// Indexes into [`BreakerConfig::targets`], tried in order while this target is open.
    pub fallback: Vec<usize>,
}

impl Target {
    /// The counter of a transition (or of `rejected` / `fallback`), under `wasmcustom.`.
    pub fn stat(&self, event: &str) -> String {
        format!("tollgate.breaker.{}.{event}", self.name)
    }
}

/// The hint poller's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintSettings {
    pub enabled: bool,
    pub poll_interval: Duration,
    /// Deadline of one call to the sidecar's hint endpoints.
    pub timeout: Duration,
}

/// The validated `breakers` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerConfig {
    pub policy: Policy,
    /// Upstream statuses that count as failures, as inclusive ranges.
    pub failure_statuses: Vec<(u16, u16)>,
    /// A 429 from the upstream counts as a failure.
    pub fail_on_429: bool,
    pub targets: Vec<Target>,
    pub hints: HintSettings,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        // Infallible for the defaults; an empty target list either way.
        BreakerConfig::compile(RawBreakers::default()).unwrap_or(BreakerConfig {
            policy: Policy::default(),
            failure_statuses: vec![(500, 599)],
            fail_on_429: false,
            targets: Vec::new(),
            hints: HintSettings { enabled: true, poll_interval: Duration::from_millis(500), timeout: Duration::from_secs(1) },
        })
    }
}

fn err(field: &str, why: impl std::fmt::Display) -> ConfigError {
    ConfigError(format!("breakers.{field}: {why}"))
}

fn duration(field: &str, s: &str, min: Duration, max: Duration) -> Result<Duration, ConfigError> {
    duration_within(&format!("breakers.{field}"), s, min, max, &format!("{min:?} and {max:?}"))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
}

fn status_range(s: &str) -> Option<(u16, u16)> {
    let s = s.trim();
    if let Some(d) = s.strip_suffix("xx") {
        let d: u16 = d.parse().ok()?;
        return (1..=5).contains(&d).then_some((d * 100, d * 100 + 99));
    }
    let n: u16 = s.parse().ok()?;
    (100..=599).contains(&n).then_some((n, n))
}

impl BreakerConfig {
    pub fn compile(raw: RawBreakers) -> Result<BreakerConfig, ConfigError> {
        if !(0.0..=1.0).contains(&raw.failure_ratio) {
            return Err(err("failureRatio", "must be between 0 and 1 (0: off)"));
        }
        if raw.consecutive_failures == 0 && raw.failure_ratio == 0.0 {
            return Err(err("consecutiveFailures", "and failureRatio cannot both be off"));
        }
        if raw.half_open_trials == 0 {
            return Err(err("halfOpenTrials", "must be at least 1"));
        }
        let ms = |d: Duration| d.as_millis() as u64;
        let policy = Policy {
            consecutive_failures: raw.consecutive_failures,
            failure_ratio_permille: (raw.failure_ratio * 1000.0).round() as u32,
            window_ms: ms(duration("window", &raw.window, Duration::from_millis(100), Duration::from_secs(3600))?),
            min_requests: raw.min_requests.max(1),
            open_ms: ms(duration("openFor", &raw.open_for, Duration::from_millis(100), Duration::from_secs(3600))?),
            half_open_trials: raw.half_open_trials,
            trial_timeout_ms: ms(duration("trialTimeout", &raw.trial_timeout, Duration::from_millis(100), Duration::from_secs(600))?),
        };
        let mut failure_statuses = Vec::new();
        for (i, s) in raw.failure_statuses.iter().enumerate() {
            failure_statuses.push(
                status_range(s).ok_or_else(|| err(&format!("failureStatuses[{i}]"), format!("'{s}' is not a status or class like \"5xx\"")))?,
            );
        }
        let hints = HintSettings {
            enabled: raw.hints.enabled,
            poll_interval: duration("hints.pollInterval", &raw.hints.poll_interval, Duration::from_millis(50), Duration::from_secs(60))?,
            timeout: duration("hints.timeout", &raw.hints.timeout, Duration::from_millis(1), Duration::from_secs(60))?,
        };
        let names: Vec<&str> = raw.targets.iter().map(|t| t.name.as_str()).collect();
        let mut targets = Vec::with_capacity(raw.targets.len());
        for (i, t) in raw.targets.iter().enumerate() {
            let field = |f: &str| format!("targets[{i}].{f}");
            if !valid_name(&t.name) {
                return Err(err(&field("name"), "1-64 of [A-Za-z0-9_-]"));
            }
            if names.iter().filter(|n| **n == t.name).count() > 1 {
                return Err(err(&field("name"), format!("'{}' is not unique", t.name)));
            }
            if t.cluster.trim().is_empty() {
                return Err(err(&field("cluster"), "must not be empty"));
            }
            if raw.targets.iter().filter(|o| o.cluster == t.cluster).count() > 1 {
                return Err(err(&field("cluster"), format!("'{}' belongs to two targets", t.cluster)));
            }
            let hint = match (&t.provider, &t.model) {
                (None, None) => None,
                (Some(p), Some(m)) if valid_hint_part(p) && valid_hint_part(m) => Some((p.clone(), m.clone())),
                (Some(_), Some(_)) => return Err(err(&field("provider"), "provider and model: 1-128 of [A-Za-z0-9_.-/]")),
                _ => return Err(err(&field("provider"), "provider and model go together")),
            };
            let mut fallback = Vec::with_capacity(t.fallback.len());
            for (j, f) in t.fallback.iter().enumerate() {
                let Some(k) = names.iter().position(|n| n == f) else {
                    return Err(err(&format!("targets[{i}].fallback[{j}]"), format!("no target named '{f}'")));
                };
                if k == i || fallback.contains(&k) {
                    return Err(err(&format!("targets[{i}].fallback[{j}]"), format!("'{f}' is itself or listed twice")));
                }
                fallback.push(k);
            }
            targets.push(Target { name: t.name.clone(), cluster: t.cluster.clone(), hint, fallback });
        }
        Ok(BreakerConfig { policy, failure_statuses, fail_on_429: raw.fail_on429, targets, hints })
    }

    /// Every per-target counter name, for the adapter to define once per VM.
    pub fn metric_names(&self) -> Vec<String> {
        let mut out = Vec::new();
        for t in &self.targets {
            for tr in Transition::ALL {
                out.push(t.stat(tr.name()));
            }
            for e in EXTRA_STATS {
                out.push(t.stat(e));
            }
        }
        out
    }

    /// Whether an upstream status counts as a failure (Envoy's own local replies are classified
    /// separately, see `crate::breaker::guard::classify`).
    pub fn is_failure_status(&self, status: u16) -> bool {
        (status == 429 && self.fail_on_429) || self.failure_statuses.iter().any(|(lo, hi)| (*lo..=*hi).contains(&status))
    }

    /// Whether any target shares hints (so the poller has work).
    pub fn shares_hints(&self) -> bool {
        self.hints.enabled && self.targets.iter().any(|t| t.hint.is_some())
    }
}

/// Per-request counters besides the transitions: requests rejected while open, requests sent to
/// a fallback, hints seen but not applied (the breaker was not closed).
pub const EXTRA_STATS: [&str; 3] = ["rejected", "fallback", "hint_ignored"];
