//! Sidecar configuration: a TOML file plus `TOLLGATE_SIDECAR_*` environment overrides.
//!
//! Unknown fields are refused (a typo must not silently fall back to a default). Nested fields
//! are reached from the environment with `__`: `TOLLGATE_SIDECAR_REDIS__URL=redis://…`.

use figment::providers::{Format, Serialized, Toml};
use tollgate_shared::settings;
use crate::invalid::{invalid, Invalid};
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "TOLLGATE_SIDECAR_";

/// `TOLLGATE_SIDECAR_*` variables that are not settings: the config file path (read by the CLI),
/// the binary path and URL that `.tollgate/demo.env` exports for scripts, and the port override
/// `TOLLGATE_SIDECAR_PORT` of `./build.sh up`.
const NOT_SETTINGS: &[&str] = &["config", "bin", "url", "port"];
/// Settings read from the environment as text, never parsed (settings::layers).
const SECRETS: &[&str] = &["server.secret", "admin.token"];

// Every section's type is defined by the module it configures (config depends on them, never
// the other way round); `[redis]` and `[cache]` are re-exported here by their old names.
pub use crate::decision::cache::CacheConfig;
pub use crate::store::{RedisConfig, RedisMode};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the filter-facing HTTP server (decisions, `/metrics`, `/healthz`). Loopback
    /// unless `server.allow_non_loopback`.
    pub listen: SocketAddr,
    /// Also serve the same API on this unix domain socket (the path of the socket file), e.g.
    /// `/run/tollgate/sidecar.sock`: the cheapest transport for an Envoy on the same host
    /// (docs/decisions.md). A stale socket file is removed at start; a live one (another sidecar
    /// answers on it) or a path that is not a socket is refused. Off by default.
    pub listen_unix: Option<std::path::PathBuf>,
    /// The filter-facing server (`[server]`: the filter secret, connection deadlines).
    pub server: crate::server::ServerConfig,
    pub redis: RedisConfig,
    pub cache: CacheConfig,
    /// Responses stored in Redis (`[responses]`: a tenant's bound, crate::decision::responses).
    pub responses: crate::decision::responses::ResponsesConfig,
    pub log: LogConfig,
    /// Plans by name, each a list of limits (docs/configuration.md). A key's `plan` selects one.
    pub plans: std::collections::BTreeMap<String, crate::decision::limits::PlanConfig>,
    /// How `failure_mode = "local"` limits are enforced while Redis cannot answer (`[limits]`,
    /// crate::decision::local).
    pub limits: crate::decision::local::LocalConfig,
    /// Circuit-breaker hints (`[breaker]`, see crate::decision::hints).
    pub breaker: crate::decision::hints::BreakerConfig,
    /// Where tenants, products, plans and routes come from (`[source]`, crate::control::source).
    pub source: crate::control::source::SourceConfig,
    /// The admin HTTP API (`[admin]`, crate::control::admin).
    pub admin: crate::control::admin::AdminConfig,
    /// The web console on the admin listener (`[console]`, crate::console).
    pub console: crate::console::config::ConsoleConfig,
    /// File source: tenants (`[[tenants]]`), API products (`[[products]]`), routes (`[[routes]]`).
    pub tenants: Vec<crate::control::model::Tenant>,
    pub products: Vec<crate::control::model::Product>,
    pub routes: Vec<crate::control::model::Route>,
    /// Usage metering (`[usage]`, see crate::usage).
    pub usage: crate::usage::UsageConfig,
    /// Per-tenant series for operators (`[telemetry]`, see crate::telemetry).
    pub telemetry: crate::telemetry::TelemetryConfig,
    /// Budget alerts and their webhooks (`[alerts]`, crate::alerts).
    pub alerts: crate::alerts::AlertsConfig,
    /// Threads of the sidecar's async runtime; 0 (the default): one per CPU core.
    pub worker_threads: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter directive, e.g. `info` or `tollgate_sidecar=debug`.
    pub level: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            listen_unix: None,
            server: Default::default(),
            redis: RedisConfig::default(),
            cache: CacheConfig::default(),
            responses: Default::default(),
            log: LogConfig::default(),
            plans: Default::default(),
            limits: Default::default(),
            breaker: Default::default(),
            source: Default::default(),
            admin: Default::default(),
            console: Default::default(),
            tenants: Vec::new(),
            products: Vec::new(),
            routes: Vec::new(),
            usage: Default::default(),
            telemetry: Default::default(),
            alerts: Default::default(),
            worker_threads: 0,
        }
    }
}

impl LogConfig {
    /// The `tracing` filter that `level` writes. A field value in a directive
    /// (`target[span{field=value}]=debug`) is matched literally, never compiled as a regular
    /// expression: a pattern there could take minutes to compile into a DFA at start (found by
    /// the `sidecar_toml` fuzz target), and filtering logs by field needs no patterns.
    pub fn filter(&self) -> Result<tracing_subscriber::EnvFilter, tracing_subscriber::filter::ParseError> {
        tracing_subscriber::EnvFilter::builder().with_regex(false).parse(&self.level)
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: LogFormat::Json, level: "info".into() }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Parse(#[from] Box<figment::Error>),
    #[error("configuration: {0}")]
    Invalid(#[from] Invalid),
    #[error("configuration: config file {0} does not exist")]
    NoFile(std::path::PathBuf),
}

impl Config {
    /// Defaults, then the file (if given), then `TOLLGATE_SIDECAR_*` from the environment.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::from_figment(settings::layers(Config::default(), file, ENV_PREFIX, NOT_SETTINGS, SECRETS).map_err(ConfigError::NoFile)?)
    }

    /// Parses TOML text alone (no environment), for tests and `--check-config` diagnostics.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        Self::from_figment(Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(text)))
    }

    fn from_figment(fig: Figment) -> Result<Config, ConfigError> {
        let config: Config = fig.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, reason: &str| Err(ConfigError::Invalid(invalid(field, reason)));
        if !self.listen.ip().is_loopback() && !self.server.allow_non_loopback {
            return bad("listen", "must be a loopback address (or set server.allow_non_loopback = true)");
        }
        self.server.validate()?;
        if let Some(path) = &self.listen_unix {
            // sun_path holds 108 bytes with the terminating NUL on Linux.
            if path.as_os_str().is_empty() || path.as_os_str().len() > 107 {
                return bad("listen_unix", "a socket path of 1 to 107 bytes");
            }
        }
        if !(self.redis.url.starts_with("redis://") || self.redis.url.starts_with("rediss://")) {
            return bad("redis.url", "must start with redis:// or rediss://");
        }
        if redis::Client::open(self.redis.url.as_str()).is_err() {
            return bad("redis.url", "not a valid Redis URL");
        }
        if self.redis.mode != RedisMode::Single && self.redis.nodes.is_empty() {
            return bad("redis.nodes", "cluster and sentinel modes need at least one node");
        }
        if self.redis.nodes.iter().any(|n| redis::Client::open(n.as_str()).is_err()) {
            return bad("redis.nodes", "not a list of valid Redis URLs");
        }
        if self.redis.timeout.is_zero() || self.redis.connect_timeout.is_zero() {
            return bad("redis.timeout and redis.connect_timeout", "must be above zero");
        }
        if self.redis.decision_timeout.is_zero() || self.redis.fail_fast.is_zero() {
            return bad("redis.decision_timeout and redis.fail_fast", "must be above zero");
        }
        if self.cache.max_entries == 0 {
            return bad("cache.max_entries", "must be at least 1");
        }
        if self.cache.last_used_interval < std::time::Duration::from_millis(100) {
            return bad("cache.last_used_interval", "must be at least 100ms");
        }
        if !(1..=crate::decision::responses::ResponsesConfig::MAX_MB).contains(&self.responses.tenant_max_mb) {
            return bad("responses.tenant_max_mb", "must be 1 to 1048576 (MiB)");
        }
        let in_flight = self.responses.idempotency_in_flight;
        if in_flight < std::time::Duration::from_secs(1) || in_flight > std::time::Duration::from_secs(24 * 3600) {
            return bad("responses.idempotency_in_flight", "must be 1s to 24h");
        }
        crate::decision::limits::Plans::compile(&self.plans)?;
        self.limits.validate()?;
        self.usage.validate()?;
        self.telemetry.validate()?;
        self.alerts.validate()?;
        if self.log.filter().is_err() {
            return bad("log.level", "not a tracing filter directive");
        }
        self.validate_config_model()
    }

    /// A copy fit to print (`--check-config`): secrets are [`Secret`](crate::secret::Secret)s
    /// (their `Debug` shows `<redacted>`), and here the passwords of the Redis and PostgreSQL
    /// URLs and every Kafka client property that holds a credential are replaced too.
    pub fn redacted(&self) -> Config {
        use crate::secret::redact_url;
        let mut c = self.clone();
        c.redis.url = redact_url(&c.redis.url);
        c.redis.nodes = c.redis.nodes.iter().map(|n| redact_url(n)).collect();
        c.source.postgres_url = redact_url(&c.source.postgres_url);
        c.console.usage_url = c.console.usage_url.as_deref().map(redact_url);
        c.admin.billing_url = c.admin.billing_url.as_deref().map(redact_url);
        for (name, value) in c.usage.kafka.properties.iter_mut() {
            let n = name.to_ascii_lowercase();
            if n.contains("password") || n.contains("secret") || n.ends_with(".pem") || n.contains("oauthbearer.config") || n.contains("jaas") {
                *value = "<redacted>".into();
            }
        }
        c
    }

    /// `[source]`, `[admin]` and the file's configuration model (crate::control::model).
    fn validate_config_model(&self) -> Result<(), ConfigError> {
        use crate::control::{model::Snapshot, source::SourceKind};
        self.admin.validate()?;
        self.console.validate(self.admin.listen.is_some())?;
        if self.source.kind == SourceKind::Postgres && self.source.postgres_url.parse::<tokio_postgres::Config>().is_err() {
            return Err(invalid("source.postgres_url", "not a PostgreSQL URL (postgres://user@host:port/db)").into());
        }
        Snapshot::from_file(&self.tenants, &self.products, &self.plans, &self.routes)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn defaults_are_valid_and_file_overrides() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c, Config::default());
        let c = Config::from_toml("listen = \"127.0.0.1:7000\"\n[redis]\ntimeout = \"40ms\"\n[cache]\nttl = \"2s\"").unwrap();
        assert_eq!(c.listen.port(), 7000);
        assert_eq!(c.redis.timeout, Duration::from_millis(40));
        assert_eq!(c.cache.ttl, Duration::from_secs(2));
        assert_eq!(c.redis.url, RedisConfig::default().url);
        assert_eq!(c.listen_unix, None);
        let c = Config::from_toml("listen_unix = \"/run/tollgate/sidecar.sock\"").unwrap();
        assert_eq!(c.listen_unix.as_deref(), Some(Path::new("/run/tollgate/sidecar.sock")));
        let err = Config::from_toml(&format!("listen_unix = \"/{}\"", "x".repeat(120))).unwrap_err().to_string();
        assert!(err.contains("listen_unix"), "{err}");
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API fixes the error type
    fn environment_overrides_the_file_and_is_checked_too() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("s.toml", "[redis]\nurl = \"redis://file:1/\"\ntimeout = \"9ms\"")?;
            jail.set_env("TOLLGATE_SIDECAR_REDIS__URL", "redis://env:2/");
            jail.set_env("TOLLGATE_SIDECAR_BIN", "/usr/bin/whatever");
            jail.set_env("TOLLGATE_SIDECAR_LISTEN_UNIX", "/tmp/t.sock");
            let c = Config::load(Some(Path::new("s.toml"))).unwrap();
            assert_eq!(c.redis.url, "redis://env:2/");
            assert_eq!(c.listen_unix.as_deref(), Some(Path::new("/tmp/t.sock")));
            assert_eq!(c.redis.timeout, Duration::from_millis(9));
            jail.set_env("TOLLGATE_SIDECAR_REDIS__TIMOUT", "1ms");
            let err = Config::load(Some(Path::new("s.toml"))).unwrap_err().to_string();
            assert!(err.contains("timout"), "{err}");
            Ok(())
        });
        // secrets are text as given: digits stay a secret, never a number in an error
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_SIDECAR_SERVER__SECRET", "12345678901234567890");
            jail.set_env("TOLLGATE_SIDECAR_ADMIN__TOKEN", "0000000000000000000000001");
            let c = Config::load(None).unwrap();
            assert_eq!(c.server.secret.expose(), "12345678901234567890");
            assert_eq!(c.admin.token.expose(), "0000000000000000000000001");
            Ok(())
        });
    }

    #[test]
    fn plans_are_read_and_checked() {
        let c = Config::from_toml("[[plans.demo.limits]]\nname = \"per-minute\"\nalgorithm = \"fixed_window\"\nlimit = 10\n").unwrap();
        assert_eq!(c.plans["demo"].limits[0].limit, 10);
        let err = Config::from_toml("[[plans.demo.limits]]\nname = \"x\"\nalgorithm = \"fixed_window\"\nlimit = 0\n").unwrap_err().to_string();
        assert!(err.contains("plans.demo.limits[0].limit"), "{err}");
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API fixes the error type
    fn the_local_replica_count_is_discovered_unless_set_and_at_least_one() {
        let c = Config::from_toml("").unwrap();
        assert_eq!((c.limits.local_replicas, c.limits.local_max_entries), (None, 100_000));
        assert_eq!(Config::from_toml("[limits]\nlocal_replicas = 3").unwrap().limits.local_replicas, Some(3));
        for (bad, field) in [("local_replicas = 0", "limits.local_replicas"), ("local_max_entries = 0", "limits.local_max_entries")] {
            let err = Config::from_toml(&format!("[limits]\n{bad}")).unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_SIDECAR_LIMITS__LOCAL_REPLICAS", "2");
            assert_eq!(Config::load(None).unwrap().limits.local_replicas, Some(2));
            Ok(())
        });
    }

    #[test]
    fn usage_is_off_by_default_and_checked_when_on() {
        assert!(!Config::default().usage.enabled);
        let c = Config::from_toml(
            "[usage]\nenabled = true\nspool_dir = \"/tmp/s\"\n[usage.kafka]\nbrokers = \"k:9092\"\ntopic = \"usage_events\"\n\
             [usage.kafka.properties]\n\"compression.type\" = \"zstd\"\n",
        )
        .unwrap();
        assert!(c.usage.enabled);
        assert_eq!(c.usage.kafka.brokers, "k:9092");
        assert_eq!(c.usage.kafka.properties["compression.type"], "zstd");
        let err = Config::from_toml("[usage]\nenabled = true\n[usage.kafka.properties]\nacks = \"1\"\n").unwrap_err().to_string();
        assert!(err.contains("usage.kafka.properties.acks"), "{err}");
        let err = Config::from_toml("[usage]\nenabled = true\nsegment_age = \"1ms\"\n").unwrap_err().to_string();
        assert!(err.contains("usage.segment_age"), "{err}");
    }

    #[test]
    fn log_level_field_values_are_literal_never_regular_expressions() {
        // `(` is no regular expression: with patterns on, this directive is refused
        let directive = "tollgate_sidecar[decide{tenant=(}]=debug";
        assert!(tracing_subscriber::EnvFilter::try_new(directive).is_err(), "patterns are on by default");
        let c = Config::from_toml(&format!("[log]\nlevel = \"{directive}\"")).unwrap();
        assert!(c.log.filter().is_ok(), "read as the literal value `(`");
        let err = Config::from_toml("[log]\nlevel = \"a=b=c\"").unwrap_err().to_string();
        assert!(err.contains("log.level"), "{err}");
    }

    #[test]
    fn the_printed_configuration_shows_no_secret() {
        let c = Config::from_toml(
            "[server]\nsecret = \"filter-secret-0123456789\"\nticket_key = \"ticket-key-0123456789\"\n[admin]\nlisten = \"127.0.0.1:9091\"\ntoken = \"admin-token-0123456789\"\nbilling_url = \"postgres://u:billingpass123@h/db\"\n\
             [redis]\nurl = \"redis://:redispass123@127.0.0.1:6379/\"\n[source]\npostgres_url = \"postgres://u:pgpass123@h/db\"\n\
             [console]\nusage_url = \"postgres://u:consolepass123@h/db\"\n\
             [usage.kafka.properties]\n\"sasl.password\" = \"kafkapass123\"\n\"compression.type\" = \"zstd\"\n",
        )
        .unwrap();
        let printed = format!("{:#?}", c.redacted());
        for secret in ["filter-secret", "ticket-key", "admin-token", "redispass123", "pgpass123", "consolepass123", "billingpass123", "kafkapass123"] {
            assert!(!printed.contains(secret), "{secret} printed:\n{printed}");
        }
        assert!(printed.contains("zstd") && printed.contains("127.0.0.1:6379"), "{printed}");
        assert_eq!(c.redacted().redis.url, "redis://:<redacted>@127.0.0.1:6379/");
    }

    #[test]
    fn listen_is_loopback_unless_allowed_and_the_secret_is_checked() {
        let err = Config::from_toml("listen = \"0.0.0.0:9090\"").unwrap_err().to_string();
        assert!(err.contains("listen"), "{err}");
        assert!(Config::from_toml("listen = \"0.0.0.0:9090\"\n[server]\nallow_non_loopback = true").is_ok());
        assert!(Config::from_toml("listen = \"[::1]:9090\"").is_ok());
        let err = Config::from_toml("[server]\nsecret = \"short\"").unwrap_err().to_string();
        assert!(err.contains("server.secret") && !err.contains("short\""), "{err}");
        let err = Config::from_toml("[server]\nsecret = \"0123456789abcdef\"\nsecret_file = \"/x\"").unwrap_err().to_string();
        assert!(err.contains("server.secret"), "{err}");
        let none = Config::from_toml("").unwrap();
        assert_eq!(none.server.resolve_secret().unwrap_err().field, "server.secret", "a secret is required to serve");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "from-a-file-0123456789\n").unwrap();
        let c = Config::from_toml(&format!("[server]\nsecret_file = \"{}\"", file.display())).unwrap();
        assert_eq!(c.server.resolve_secret().unwrap().expose(), "from-a-file-0123456789");

        // the admin token from a mounted file too (deploy/, decision 233), not both
        let token = dir.path().join("token");
        std::fs::write(&token, "admin-token-from-a-file-01\n").unwrap();
        let admin = format!("[admin]\nlisten = \"127.0.0.1:9091\"\ntoken_file = \"{}\"", token.display());
        let c = Config::from_toml(&admin).unwrap();
        assert_eq!(c.admin.resolve_token().unwrap().expose(), "admin-token-from-a-file-01");
        let err = Config::from_toml(&format!("{admin}\ntoken = \"0123456789abcdef0\"")).unwrap_err().to_string();
        assert!(err.contains("admin.token"), "{err}");
        std::fs::write(&token, "short\n").unwrap();
        assert_eq!(c.admin.resolve_token().unwrap_err().field, "admin.token_file");
        let err = Config::from_toml("[server]\nshutdown_quiet = \"0s\"").unwrap_err().to_string();
        assert!(err.contains("server.shutdown_quiet"), "{err}");
    }

    #[test]
    fn unknown_and_bad_fields_are_refused_by_name() {
        let err = Config::from_toml("[redis]\nurll = \"x\"").unwrap_err().to_string();
        assert!(err.contains("urll"), "{err}");
        let err = Config::from_toml("[redis]\nurl = \"http://x\"").unwrap_err().to_string();
        assert!(err.contains("redis.url"), "{err}");
        let err = Config::from_toml("[redis]\ntimeout = \"soon\"").unwrap_err().to_string();
        assert!(err.contains("timeout"), "{err}");
        let err = Config::from_toml("[redis]\nmode = \"cluster\"").unwrap_err().to_string();
        assert!(err.contains("redis.nodes"), "{err}");
        for bad in ["0", "1048577"] {
            let err = Config::from_toml(&format!("[responses]\ntenant_max_mb = {bad}")).unwrap_err().to_string();
            assert!(err.contains("responses.tenant_max_mb"), "{err}");
        }
        assert_eq!(Config::from_toml("[responses]\ntenant_max_mb = 3").unwrap().responses.tenant_max_bytes(), 3 << 20);
        assert_eq!(Config::default().responses.tenant_max_bytes(), 256 << 20);
        assert_eq!(Config::default().responses.idempotency_in_flight, Duration::from_secs(300));
        for bad in ["\"999ms\"", "\"25h\""] {
            let err = Config::from_toml(&format!("[responses]\nidempotency_in_flight = {bad}")).unwrap_err().to_string();
            assert!(err.contains("responses.idempotency_in_flight"), "{err}");
        }
        let err = Config::from_toml("[cache]\nmax_entries = 0").unwrap_err().to_string();
        assert!(err.contains("max_entries"), "{err}");
    }
}
