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
    /// Usage as CloudEvents to a Kafka topic (issue 42 item 6; crate::outbox). Off by default.
    pub export: ExportConfig,
}

/// The CloudEvents export (docs/usage-events.md, "CloudEvents export").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExportConfig {
    /// The topic the CloudEvents go to; empty: no export.
    pub topic: String,
    /// The Kafka cluster of that topic (`host:port,…`, e.g. the metering system's); empty: `kafka.brokers`.
    pub brokers: String,
    /// Every event's `source` (a URI reference naming this deployment).
    pub source: String,
    /// The ISO 4217 code of the sidecars' `usage.pricing.currency`, written beside each cost.
    pub currency: String,
    /// Most events sent per round.
    pub batch_max: usize,
    /// How long the exporter waits for its round's deliveries (librdkafka's `message.timeout.ms`).
    #[serde(with = "humantime_serde")]
    pub delivery_timeout: Duration,
}

impl Default for ExportConfig {
    fn default() -> Self {
        ExportConfig {
            topic: String::new(),
            brokers: String::new(),
            source: "tollgate".into(),
            currency: "USD".into(),
            batch_max: 500,
            delivery_timeout: Duration::from_secs(10),
        }
    }
}

impl ExportConfig {
    pub fn enabled(&self) -> bool {
        !self.topic.is_empty()
    }

    /// Who the events come from, for [`crate::cloudevents`].
    pub fn origin(&self) -> crate::cloudevents::Origin {
        crate::cloudevents::Origin { source: self.source.clone(), currency: self.currency.clone() }
    }
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
            export: ExportConfig::default(),
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
        let e = &self.export;
        if e.topic == self.kafka.topic && (e.brokers.is_empty() || e.brokers == self.kafka.brokers) {
            return Err(invalid("export.topic", "another topic than kafka.topic on the same brokers (the usage events themselves)"));
        }
        if e.topic.len() > 249 || !e.topic.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
            return Err(invalid("export.topic", "a Kafka topic name: at most 249 of [A-Za-z0-9._-]"));
        }
        if let Some(why) = crate::cloudevents::invalid_source(&e.source) {
            return Err(invalid("export.source", why));
        }
        if e.currency.len() != 3 || !e.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(invalid("export.currency", "an ISO 4217 code such as USD"));
        }
        if e.batch_max == 0 || e.batch_max > 10_000 {
            return Err(invalid("export.batch_max", "between 1 and 10000"));
        }
        if e.delivery_timeout < Duration::from_millis(100) || e.delivery_timeout > Duration::from_secs(300) {
            return Err(invalid("export.delivery_timeout", "between 100ms and 5m"));
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
    fn the_export_is_off_by_default_and_its_bad_settings_are_refused_by_name() {
        assert!(!Config::default().export.enabled());
        let with = |f: &dyn Fn(&mut ExportConfig)| {
            let mut c = Config::default();
            c.export.topic = "usage_cloudevents".into();
            f(&mut c.export);
            c.validate().map_err(|e| e.to_string())
        };
        with(&|_| {}).unwrap();
        assert!(with(&|e| e.topic = "usage_events".into()).unwrap_err().contains("export.topic"));
        assert!(with(&|e| e.topic = "a b".into()).unwrap_err().contains("export.topic"));
        assert!(with(&|e| e.source = "has space".into()).unwrap_err().contains("export.source"));
        assert!(with(&|e| e.currency = "usd".into()).unwrap_err().contains("export.currency"));
        assert!(with(&|e| e.batch_max = 0).unwrap_err().contains("export.batch_max"));
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
