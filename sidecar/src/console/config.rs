//! `[console]`: the console's settings and their checks.

use crate::invalid::{invalid, Invalid};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[console]`: the web console on the admin listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// Serve `/console` on the admin listener (`admin.listen` must be set). Off by default.
    pub enabled: bool,
    /// How long a session lasts after its sign-in.
    #[serde(with = "humantime_serde")]
    pub session_ttl: Duration,
    /// Wrong passwords in a row that lock a tenant user's sign-in.
    pub lockout_after: u32,
    /// How long a locked sign-in stays locked (counted from the last wrong password).
    #[serde(with = "humantime_serde")]
    pub lockout_for: Duration,
    /// How long an invite link can be used (once).
    #[serde(with = "humantime_serde")]
    pub invite_ttl: Duration,
    /// The PostgreSQL database of the billing consumer (`usage_daily`), for the portal's usage
    /// chart and CSV. Empty: the portal says no usage store is configured.
    pub usage_url: Option<String>,
    /// Prometheus's HTTP API (e.g. `http://127.0.0.1:9090`): the operator overview's figures per
    /// tenant from every replica's series. Unset, or not answering: this sidecar's own counters.
    pub prometheus_url: Option<String>,
    /// The pricing currency (`usage.pricing.currency`) the portal names beside costs: set from
    /// the sidecar's configuration, not a console setting.
    #[serde(skip)]
    pub currency: String,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            enabled: false,
            session_ttl: Duration::from_secs(8 * 3600),
            lockout_after: 20,
            lockout_for: Duration::from_secs(15 * 60),
            invite_ttl: Duration::from_secs(72 * 3600),
            usage_url: None,
            currency: String::new(),
            prometheus_url: None,
        }
    }
}

impl ConsoleConfig {
    pub fn validate(&self, admin_listen: bool) -> Result<(), Invalid> {
        if self.enabled && !admin_listen {
            return Err(invalid("console.enabled", "the console is served by the admin listener: set admin.listen"));
        }
        if self.session_ttl < Duration::from_secs(60) {
            return Err(invalid("console.session_ttl", "at least 1m"));
        }
        if self.lockout_after == 0 {
            return Err(invalid("console.lockout_after", "at least 1"));
        }
        if self.lockout_for.is_zero() || self.invite_ttl.is_zero() {
            return Err(invalid("console.lockout_for", "lockout_for and invite_ttl must be above zero"));
        }
        if let Some(url) = &self.usage_url {
            if url.parse::<tokio_postgres::Config>().is_err() {
                return Err(invalid("console.usage_url", "not a PostgreSQL URL (postgres://user@host:port/db)"));
            }
        }
        if let Some(url) = &self.prometheus_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid("console.prometheus_url", "an http:// or https:// URL"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_config_is_checked() {
        let c = ConsoleConfig { enabled: true, ..Default::default() };
        assert_eq!(c.validate(false).unwrap_err().field, "console.enabled");
        assert!(c.validate(true).is_ok());
        assert!(ConsoleConfig::default().validate(false).is_ok(), "off by default, nothing needed");
        let c = ConsoleConfig { usage_url: Some("not a url".into()), ..Default::default() };
        assert_eq!(c.validate(true).unwrap_err().field, "console.usage_url");
        let c = ConsoleConfig { lockout_after: 0, ..Default::default() };
        assert_eq!(c.validate(true).unwrap_err().field, "console.lockout_after");
        let c = ConsoleConfig { prometheus_url: Some("127.0.0.1:9090".into()), ..Default::default() };
        assert_eq!(c.validate(true).unwrap_err().field, "console.prometheus_url");
    }
}
