//! Billing consumer configuration: a TOML file plus `TOLLGATE_BILLING_*` environment overrides
//! (`__` for nesting), unknown fields refused.

use tollgate_shared::settings;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

pub const ENV_PREFIX: &str = "TOLLGATE_BILLING_";

/// `TOLLGATE_BILLING_*` variables that are not settings: the config file path (read by the CLI)
/// and the binary path that build.sh and `.tollgate/demo.env` export.
const NOT_SETTINGS: &[&str] = &["config", "bin"];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub kafka: KafkaConfig,
    pub postgres: PostgresConfig,
    /// Most events stored in one transaction.
    pub batch_max: usize,
    /// How long a batch waits for more events after its first.
    #[serde(with = "humantime_serde")]
    pub batch_wait: Duration,
    /// How long event ids are kept for deduplication (and as the audit trail). Must outlast the
    /// topic's retention (7 days), or a replay could count an event again.
    #[serde(with = "humantime_serde")]
    pub events_retention: Duration,
    pub log: LogConfig,
    /// Serve the consumer's metrics (Prometheus text) on this address, e.g. `127.0.0.1:9095`.
    /// Off by default.
    pub metrics_listen: Option<std::net::SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topic: String,
    pub group_id: String,
    /// Consumer-group session timeout (tansu needs ≤ 6 s for a prompt first join).
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
    /// Further librdkafka properties.
    pub properties: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostgresConfig {
    /// `postgres://user@host:port/db` (or a key=value connection string).
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `json` or `text`.
    pub format: String,
    pub level: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            kafka: KafkaConfig::default(),
            postgres: PostgresConfig { url: "postgres://postgres@127.0.0.1:5432/postgres".into() },
            batch_max: 1000,
            batch_wait: Duration::from_millis(200),
            events_retention: Duration::from_secs(35 * 24 * 3600),
            log: LogConfig { format: "json".into(), level: "info".into() },
            metrics_listen: None,
        }
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topic: "usage_events".into(),
            group_id: "tollgate-billing".into(),
            session_timeout: Duration::from_secs(6),
            properties: BTreeMap::new(),
        }
    }
}

impl Default for PostgresConfig {
    fn default() -> Self {
        Config::default().postgres
    }
}

impl LogConfig {
    /// The `tracing` filter that `level` writes, field values matched literally (never compiled
    /// as regular expressions: see the sidecar's `LogConfig::filter`).
    pub fn filter(&self) -> Result<tracing_subscriber::EnvFilter, tracing_subscriber::filter::ParseError> {
        tracing_subscriber::EnvFilter::builder().with_regex(false).parse(&self.level)
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Config::default().log
    }
}

/// Properties the exactly-once bookkeeping depends on.
const FIXED: &[&str] = &["enable.auto.commit", "enable.auto.offset.store", "group.id", "bootstrap.servers"];

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    NoFile(std::path::PathBuf),
    #[error("{0}")]
    Parse(#[from] Box<figment::Error>),
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: &'static str },
}

fn invalid(field: impl Into<String>, reason: &'static str) -> ConfigError {
    ConfigError::Invalid { field: field.into(), reason }
}

impl Config {
    /// Defaults, then the file (if any), then `TOLLGATE_BILLING_*`.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let fig = settings::layers(Config::default(), file, ENV_PREFIX, NOT_SETTINGS, &[]).map_err(ConfigError::NoFile)?;
        let c: Config = fig.extract().map_err(Box::new)?;
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.kafka.brokers.trim().is_empty() || self.kafka.topic.is_empty() || self.kafka.group_id.is_empty() {
            return Err(invalid("kafka.brokers, kafka.topic and kafka.group_id", "required"));
        }
        if let Some(k) = self.kafka.properties.keys().find(|k| FIXED.contains(&k.as_str())) {
            return Err(invalid(format!("kafka.properties.{k}"), "fixed by the billing consumer"));
        }
        if self.batch_max == 0 || self.batch_max > 100_000 {
            return Err(invalid("batch_max", "between 1 and 100000"));
        }
        if self.events_retention < Duration::from_secs(8 * 24 * 3600) {
            return Err(invalid("events_retention", "at least 8 days (longer than the topic's 7-day retention)"));
        }
        if self.postgres.url.is_empty() || self.postgres.url.parse::<tokio_postgres::Config>().is_err() {
            return Err(invalid("postgres.url", "not a PostgreSQL connection string"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        let mut c = Config::default();
        c.kafka.properties.insert("enable.auto.commit".into(), "true".into());
        assert!(c.validate().unwrap_err().to_string().contains("kafka.properties.enable.auto.commit"));
        let c = Config { events_retention: Duration::from_secs(3600), ..Config::default() };
        assert!(c.validate().unwrap_err().to_string().contains("events_retention"));
        let c = Config { postgres: PostgresConfig { url: "nope://".into() }, ..Config::default() };
        assert!(c.validate().unwrap_err().to_string().contains("postgres.url"));
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API fixes the error type
    fn the_environment_overrides_and_non_settings_are_ignored() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_BILLING_BIN", "/usr/bin/tollgate-billing");
            jail.set_env("TOLLGATE_BILLING_KAFKA__TOPIC", "t2");
            let c = Config::load(None).unwrap();
            assert_eq!(c.kafka.topic, "t2");
            jail.set_env("TOLLGATE_BILLING_BATCH_MAXX", "1");
            assert!(Config::load(None).unwrap_err().to_string().contains("batch_maxx"));
            Ok(())
        });
    }

    #[test]
    fn the_consumer_commits_only_by_hand() {
        let m: BTreeMap<String, String> = crate::consumer_config(&KafkaConfig::default()).into_iter().collect();
        assert_eq!(m["enable.auto.commit"], "false");
        assert_eq!(m["enable.auto.offset.store"], "false");
        assert_eq!(m["auto.offset.reset"], "earliest");
        assert_eq!(m["session.timeout.ms"], "6000");
    }
}
