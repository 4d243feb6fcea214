//! The `leases` section of the plugin configuration (leased limits, crate::lease).

use crate::settings::{duration_within, ConfigError};
use serde::Deserialize;
use std::time::Duration;

/// Lease settings (plugin configuration `leases`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Ask for leases at all (off: every request of a limited key is a call).
    pub enabled: bool,
    /// The lifetime a lease is sized for (the sidecar bounds the real one, 500 ms by default).
    pub target_lifetime: Duration,
    /// Renew when the lease has less than this much time or rate-worth of units left.
    pub renew_ahead: Duration,
    /// The first lease of a key asks at most this much.
    pub initial_want: u64,
    /// No lease asks for more.
    pub max_want: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            enabled: true,
            target_lifetime: Duration::from_millis(500),
            renew_ahead: Duration::from_millis(250),
            initial_want: 8,
            max_want: 10_000,
        }
    }
}

/// `leases` as written in the plugin configuration.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawLeases {
    #[serde(default = "yes")]
    enabled: bool,
    #[serde(default)]
    target_lifetime: Option<String>,
    #[serde(default)]
    renew_ahead: Option<String>,
    #[serde(default)]
    initial_want: Option<u64>,
    #[serde(default)]
    max_want: Option<u64>,
}

fn yes() -> bool {
    true
}

impl Default for RawLeases {
    fn default() -> Self {
        RawLeases { enabled: true, target_lifetime: None, renew_ahead: None, initial_want: None, max_want: None }
    }
}

impl LeaseConfig {
    pub fn compile(raw: RawLeases) -> Result<LeaseConfig, ConfigError> {
        let d = LeaseConfig::default();
        let dur = |v: Option<String>, dflt: Duration, name: &str| -> Result<Duration, ConfigError> {
            let Some(v) = v else { return Ok(dflt) };
            let (min, max) = (Duration::from_millis(10), Duration::from_secs(10));
            duration_within(&format!("leases.{name}"), &v, min, max, "10ms and 10s")
        };
        let c = LeaseConfig {
            enabled: raw.enabled,
            target_lifetime: dur(raw.target_lifetime, d.target_lifetime, "targetLifetime")?,
            renew_ahead: dur(raw.renew_ahead, d.renew_ahead, "renewAhead")?,
            initial_want: raw.initial_want.unwrap_or(d.initial_want),
            max_want: raw.max_want.unwrap_or(d.max_want),
        };
        if c.initial_want == 0 || c.max_want == 0 || c.initial_want > c.max_want || c.max_want > 1_000_000 {
            return Err(ConfigError("leases: need 1 <= initialWant <= maxWant <= 1000000".into()));
        }
        if c.renew_ahead >= c.target_lifetime {
            return Err(ConfigError("leases.renewAhead: must be shorter than targetLifetime".into()));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn config_defaults_and_refusals() {
        let c = LeaseConfig::compile(RawLeases::default()).unwrap();
        assert_eq!(c, LeaseConfig::default());
        let raw: RawLeases = serde_json::from_str(r#"{"renewAhead":"600ms"}"#).unwrap();
        assert!(LeaseConfig::compile(raw).unwrap_err().0.contains("renewAhead"));
        let raw: RawLeases = serde_json::from_str(r#"{"initialWant":0}"#).unwrap();
        assert!(LeaseConfig::compile(raw).is_err());
        assert!(serde_json::from_str::<RawLeases>(r#"{"want":1}"#).is_err());
    }
}
