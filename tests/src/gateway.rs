//! One test gateway, whatever a functional test needs of it: Redis (single, Cluster or
//! Sentinel), optionally PostgreSQL, a tansu broker and the billing consumer, an upstream (echo,
//! flaky or dead) and optionally a second one, and `replicas` of a sidecar with an Envoy in front
//! of it, all replicas sharing the one Redis (and PostgreSQL, broker, upstreams).
//!
//! ```no_run
//! use serde_json::json;
//! use tollgate_tests::{Gateway, Upstream};
//! let g = Gateway::builder()
//!     .plugin(json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed"}))
//!     .sidecar_toml("[[plans.p.limits]]\nname = \"pm\"\nalgorithm = \"fixed_window\"\nlimit = 10\n")
//!     .upstream(Upstream::flaky("a"))
//!     .replicas(2)
//!     .build();
//! let key = g.sidecar().create_key("acme", "p", &[]);
//! let r = tollgate_tests::get(&g.replica(1).envoy().url("/"), &[("x-api-key", &key.raw)]);
//! ```
//!
//! Everything is a guard: dropping the gateway stops the Envoys first, then the sidecars, the
//! billing consumer, the upstreams, the broker, PostgreSQL and Redis; when a test panics, each
//! process's log is printed. Readiness is polled, never slept for.

use crate::billing::Billing;
use crate::broker::Broker;
use crate::envoy::{Envoy, EnvoyOptions, SidecarTransport};
use crate::http::get;
use crate::postgres::Postgres;
use crate::process::{free_port, poll_until};
use crate::redis::{Redis, RedisCluster, RedisSentinel};
use crate::sidecar::Sidecar;
use crate::upstream::{start_black_hole, InProcess, RunningUpstream, Upstream};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The plugin configuration a gateway gets unless told otherwise: a sidecar timeout generous for
/// a noisy 2-core machine, failing closed.
pub fn default_plugin() -> Value {
    json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed"})
}

/// Which Redis the sidecars share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    Single,
    /// Three masters (`TOLLGATE_SIDECAR_REDIS__MODE=cluster`).
    Cluster,
    /// A master, a replica and three sentinels (`…__MODE=sentinel`).
    Sentinel,
}

/// What Envoy calls as its sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SidecarSpec {
    /// The real sidecar binary (and Redis for it).
    Real,
    /// A server that accepts and never answers (no Redis).
    BlackHole,
    /// Whatever listens on this port, if anything (no Redis).
    At(u16),
}

/// How to start a [`Gateway`]; from [`Gateway::builder`].
#[derive(Debug, Clone)]
pub struct GatewayBuilder {
    plugins: Vec<String>,
    replicas: usize,
    concurrency: u32,
    transport: Option<SidecarTransport>,
    sidecar: SidecarSpec,
    sidecar_toml: String,
    sidecar_env: Vec<(String, String)>,
    topology: Topology,
    upstream: Upstream,
    fallback: Option<Upstream>,
    postgres: bool,
    config_in_postgres: bool,
    admin_token: Option<String>,
    console: bool,
    broker: bool,
    billing: Option<(String, String)>,
    envoy: bool,
    /// The deployment's filter secret, shared by its sidecars and Envoys.
    secret: String,
}

/// Builder methods that set one field: `name(argument: Type) => field = value;`.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty)?) => $field:ident = $value:expr;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self $(, $arg: $ty)?) -> Self {
                self.$field = $value;
                self
            }
        )*
    };
}

impl GatewayBuilder {
    setters! {
        /// How many sidecar + Envoy pairs (default 1), all on the same Redis and upstreams.
        replicas(n: usize) => replicas = n;
        /// Envoy's worker threads (`--concurrency`, default 1).
        concurrency(n: u32) => concurrency = n;
        /// How Envoy reaches the sidecar (default [`SidecarTransport::DEFAULT`]).
        transport(t: SidecarTransport) => transport = Some(t);
        /// The sidecars' TOML file. `${SPOOL_DIR}` becomes the replica's usage spool directory
        /// and `${BROKERS}` the broker's address (with [`GatewayBuilder::broker`]).
        sidecar_toml(toml: &str) => sidecar_toml = toml.to_string();
        /// Envoy calls a server that accepts connections and never answers (a hung sidecar); no
        /// sidecar, no Redis.
        black_hole_sidecar() => sidecar = SidecarSpec::BlackHole;
        /// Envoy calls whatever listens on `port` (a fake sidecar, or nothing); no sidecar, no
        /// Redis.
        sidecar_at(port: u16) => sidecar = SidecarSpec::At(port);
        /// The Redis the sidecars share (default [`Topology::Single`]).
        redis(topology: Topology) => topology = topology;
        /// The upstream (cluster `upstream`; default [`Upstream::Echo`]).
        upstream(u: Upstream) => upstream = u;
        /// A second upstream (cluster `upstream_b`, `envoy/breaker.yaml.tmpl`): breaker
        /// fallbacks, routes to two clusters.
        fallback(u: Upstream) => fallback = Some(u);
        /// A PostgreSQL server (for the billing consumer, or the configuration source).
        postgres() => postgres = true;
        /// Every sidecar serves its admin API on a free port with this bearer token.
        admin_api(token: &str) => admin_token = Some(token.to_string());
        /// The web console on the admin listener (with [`GatewayBuilder::admin_api`]); its usage
        /// store is the gateway's PostgreSQL when it has one.
        console() => console = true;
        /// A tansu broker (usage events).
        broker() => broker = true;
        /// Sidecars without an Envoy in front (start them later with [`Gateway::start_envoys`],
        /// or more with [`Gateway::start_envoy`]).
        without_envoy() => envoy = false;
    }

    /// The plugin configuration of every replica's Envoy (default: [`default_plugin`]).
    pub fn plugin(mut self, json: Value) -> Self {
        self.plugins = vec![json.to_string()];
        self
    }
    /// One replica per plugin configuration, in order.
    pub fn plugins(mut self, each: impl IntoIterator<Item = Value>) -> Self {
        self.plugins = each.into_iter().map(|j| j.to_string()).collect();
        self.replicas = self.plugins.len();
        self
    }
    /// One more `TOLLGATE_SIDECAR_*` setting for every sidecar (over the harness's own).
    pub fn sidecar_env(mut self, name: &str, value: &str) -> Self {
        self.sidecar_env.push((name.to_string(), value.to_string()));
        self
    }
    /// The sidecars load their configuration from PostgreSQL (`source.kind = "postgres"`).
    pub fn config_in_postgres(self) -> Self {
        GatewayBuilder { config_in_postgres: true, ..self.postgres() }
    }
    /// The billing consumer on `topic` as consumer group `group` (implies the broker and
    /// PostgreSQL).
    pub fn billing(self, topic: &str, group: &str) -> Self {
        GatewayBuilder { billing: Some((topic.to_string(), group.to_string())), ..self.broker().postgres() }
    }

    /// Starts everything; panics (printing the logs) if anything does not come up.
    pub fn build(self) -> Gateway {
        self.try_build().unwrap_or_else(|why| panic!("the gateway did not start: {why}"))
    }

    /// Starts everything; `Err` with Envoy's log when an Envoy refuses its configuration (the
    /// processes started so far are stopped).
    pub fn try_build(self) -> Result<Gateway, String> {
        assert!(
            self.plugins.len() == 1 || self.plugins.len() == self.replicas,
            "{} plugin configurations for {} replicas",
            self.plugins.len(),
            self.replicas
        );
        let real = self.sidecar == SidecarSpec::Real;
        let redis = match (real, self.topology) {
            (false, _) => None,
            (true, Topology::Single) => Some(RedisServers::Single(Redis::start())),
            (true, Topology::Cluster) => Some(RedisServers::Cluster(RedisCluster::start())),
            (true, Topology::Sentinel) => Some(RedisServers::Sentinel(RedisSentinel::start())),
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let spool = dir.path().join("spool");
        std::fs::create_dir_all(&spool).expect("spool dir");
        let mut g = Gateway {
            replicas: Vec::new(),
            billing: None,
            upstream: self.upstream.start(),
            fallback: self.fallback.as_ref().map(Upstream::start),
            broker: self.broker.then(Broker::start),
            pg: self.postgres.then(Postgres::start),
            redis,
            spool,
            _dir: dir,
            spec: self,
        };
        for _ in 0..g.spec.replicas {
            g.add_replica()?;
        }
        if let Some((topic, group)) = &g.spec.billing {
            g.billing = Some(Billing::start(&g.broker().brokers(), topic, group, g.pg(), &[]));
        }
        Ok(g)
    }
}

/// The Redis servers of a gateway.
enum RedisServers {
    Single(Redis),
    Cluster(RedisCluster),
    Sentinel(RedisSentinel),
}

impl RedisServers {
    /// The sidecar's settings to reach them.
    fn env(&self) -> Vec<(String, String)> {
        let list = |urls: Vec<String>| format!("[{}]", urls.iter().map(|u| format!("\"{u}\"")).collect::<Vec<_>>().join(", "));
        let setting = |name: &str, value: String| (format!("TOLLGATE_SIDECAR_REDIS__{name}"), value);
        // `url` is only read in single mode, but must be a valid one in every mode.
        match self {
            RedisServers::Single(r) => vec![setting("URL", r.url())],
            RedisServers::Cluster(c) => {
                vec![setting("MODE", "cluster".into()), setting("URL", c.nodes()[0].clone()), setting("NODES", list(c.nodes()))]
            }
            RedisServers::Sentinel(s) => {
                vec![setting("MODE", "sentinel".into()), setting("URL", s.sentinels()[0].clone()), setting("NODES", list(s.sentinels()))]
            }
        }
    }
}

/// What a replica's Envoy calls.
enum ReplicaSidecar {
    Real(Sidecar),
    BlackHole(InProcess),
    At(u16),
}

/// One sidecar and the Envoy in front of it. Fields in drop order: the Envoy goes first.
pub struct Replica {
    envoy: Option<Envoy>,
    sidecar: ReplicaSidecar,
    admin: Option<String>,
}

impl Replica {
    /// The Envoy (panics for a gateway built [`GatewayBuilder::without_envoy`]).
    pub fn envoy(&self) -> &Envoy {
        self.envoy.as_ref().expect("this gateway has no Envoy")
    }

    /// The sidecar (panics when Envoy calls a black hole or a bare port).
    pub fn sidecar(&self) -> &Sidecar {
        match &self.sidecar {
            ReplicaSidecar::Real(s) => s,
            _ => panic!("this gateway has no real sidecar"),
        }
    }

    pub fn sidecar_mut(&mut self) -> &mut Sidecar {
        match &mut self.sidecar {
            ReplicaSidecar::Real(s) => s,
            _ => panic!("this gateway has no real sidecar"),
        }
    }

    fn sidecar_port(&self) -> u16 {
        match &self.sidecar {
            ReplicaSidecar::Real(s) => s.port,
            ReplicaSidecar::BlackHole(hole) => hole.port,
            ReplicaSidecar::At(port) => *port,
        }
    }

    /// The base URL of the sidecar's admin API (with [`GatewayBuilder::admin_api`]).
    pub fn admin(&self) -> &str {
        self.admin.as_deref().expect("this gateway has no admin API")
    }
}

/// A running gateway; see the module documentation. Fields in drop order.
pub struct Gateway {
    replicas: Vec<Replica>,
    billing: Option<Billing>,
    upstream: RunningUpstream,
    fallback: Option<RunningUpstream>,
    broker: Option<Broker>,
    pg: Option<Postgres>,
    redis: Option<RedisServers>,
    spool: PathBuf,
    _dir: tempfile::TempDir,
    spec: GatewayBuilder,
}

impl Gateway {
    /// One replica with a real sidecar on a single Redis, an echo upstream and an Envoy with
    /// [`default_plugin`]; change what the test needs.
    pub fn builder() -> GatewayBuilder {
        GatewayBuilder {
            plugins: vec![default_plugin().to_string()],
            replicas: 1,
            concurrency: 1,
            transport: None,
            sidecar: SidecarSpec::Real,
            sidecar_toml: String::new(),
            sidecar_env: Vec::new(),
            topology: Topology::Single,
            upstream: Upstream::Echo,
            fallback: None,
            postgres: false,
            config_in_postgres: false,
            admin_token: None,
            console: false,
            broker: false,
            billing: None,
            envoy: true,
            secret: crate::sidecar::new_secret(),
        }
    }

    /// Replica `i` (in the order started).
    pub fn replica(&self, i: usize) -> &Replica {
        &self.replicas[i]
    }

    pub fn replica_mut(&mut self, i: usize) -> &mut Replica {
        &mut self.replicas[i]
    }

    /// The first replica's Envoy.
    pub fn envoy(&self) -> &Envoy {
        self.replica(0).envoy()
    }

    /// The first replica's sidecar.
    pub fn sidecar(&self) -> &Sidecar {
        self.replica(0).sidecar()
    }

    pub fn sidecar_mut(&mut self) -> &mut Sidecar {
        self.replica_mut(0).sidecar_mut()
    }

    /// The single Redis (panics for another topology, or none).
    pub fn redis(&self) -> &Redis {
        match &self.redis {
            Some(RedisServers::Single(r)) => r,
            _ => panic!("this gateway has no single Redis"),
        }
    }

    pub fn redis_mut(&mut self) -> &mut Redis {
        match &mut self.redis {
            Some(RedisServers::Single(r)) => r,
            _ => panic!("this gateway has no single Redis"),
        }
    }

    /// The Sentinel setup (with [`Topology::Sentinel`]).
    pub fn redis_sentinel(&self) -> &RedisSentinel {
        match &self.redis {
            Some(RedisServers::Sentinel(s)) => s,
            _ => panic!("this gateway has no Sentinel"),
        }
    }

    pub fn pg(&self) -> &Postgres {
        self.pg.as_ref().expect("this gateway has no PostgreSQL")
    }

    pub fn pg_mut(&mut self) -> &mut Postgres {
        self.pg.as_mut().expect("this gateway has no PostgreSQL")
    }

    pub fn broker(&self) -> &Broker {
        self.broker.as_ref().expect("this gateway has no broker")
    }

    pub fn broker_mut(&mut self) -> &mut Broker {
        self.broker.as_mut().expect("this gateway has no broker")
    }

    pub fn billing_mut(&mut self) -> &mut Billing {
        self.billing.as_mut().expect("this gateway has no billing consumer")
    }

    /// The upstream (cluster `upstream`).
    pub fn upstream(&self) -> &RunningUpstream {
        &self.upstream
    }

    /// The second upstream (cluster `upstream_b`).
    pub fn fallback(&self) -> &RunningUpstream {
        self.fallback.as_ref().expect("this gateway has no second upstream")
    }

    /// The directory `${SPOOL_DIR}` names in the first replica's sidecar TOML (each other replica
    /// has its own beside it).
    pub fn spool_dir(&self) -> &Path {
        &self.spool
    }

    /// Stops every replica (Envoy, then sidecar); [`Gateway::add_replica`] starts new ones.
    pub fn drop_replicas(&mut self) {
        self.replicas.clear();
    }

    /// Starts one more replica as the builder said (the `i`-th plugin configuration when there is
    /// one per replica); `Err` with Envoy's log if it refuses its configuration.
    pub fn add_replica(&mut self) -> Result<&Replica, String> {
        let i = self.replicas.len();
        let (sidecar, admin) = self.start_sidecar(i);
        let mut replica = Replica { envoy: None, sidecar, admin };
        if self.spec.envoy {
            replica.envoy = Some(Envoy::try_start(self.envoy_options(&replica, i))?);
        }
        self.replicas.push(replica);
        Ok(&self.replicas[i])
    }

    /// Starts the Envoy of every replica that has none: a gateway built
    /// [`GatewayBuilder::without_envoy`], once the test prepared what Envoy must find at its start.
    pub fn start_envoys(&mut self) {
        for i in 0..self.replicas.len() {
            if self.replicas[i].envoy.is_none() {
                let options = self.envoy_options(&self.replicas[i], i);
                self.replicas[i].envoy = Some(Envoy::start(options));
            }
        }
    }

    /// Another Envoy in front of the first replica's sidecar and the gateway's upstreams, started
    /// as that replica's would be and then changed by `change` (a plugin configuration, a
    /// transport). The caller owns it.
    pub fn start_envoy(&self, change: impl FnOnce(EnvoyOptions) -> EnvoyOptions) -> Envoy {
        Envoy::start(change(self.envoy_options(self.replica(0), 0)))
    }

    fn envoy_options(&self, replica: &Replica, i: usize) -> EnvoyOptions {
        let plugin = if self.spec.plugins.len() == 1 { &self.spec.plugins[0] } else { &self.spec.plugins[i] };
        let mut o = EnvoyOptions::new(self.upstream.port(), replica.sidecar_port())
            .plugin_config(plugin)
            .concurrency(self.spec.concurrency);
        if let Some(t) = self.spec.transport {
            o = o.sidecar_transport(t);
        }
        if let Some(b) = &self.fallback {
            o = o.two_upstreams(b.port());
        }
        o
    }

    /// The sidecar of replica `i`; its usage spool is [`Gateway::spool_dir`] for the first replica
    /// and a sibling directory of its own for each other (a spool belongs to one sidecar).
    fn start_sidecar(&self, i: usize) -> (ReplicaSidecar, Option<String>) {
        match self.spec.sidecar {
            SidecarSpec::BlackHole => return (ReplicaSidecar::BlackHole(start_black_hole()), None),
            SidecarSpec::At(port) => return (ReplicaSidecar::At(port), None),
            SidecarSpec::Real => {}
        }
        let redis = self.redis.as_ref().expect("a real sidecar has Redis");
        let mut env = redis.env();
        env.push((crate::sidecar::SECRET_ENV.into(), self.spec.secret.clone()));
        if self.spec.config_in_postgres {
            env.push(("TOLLGATE_SIDECAR_SOURCE__KIND".into(), "postgres".into()));
            env.push(("TOLLGATE_SIDECAR_SOURCE__POSTGRES_URL".into(), self.pg().url()));
        }
        let admin = self.spec.admin_token.as_ref().map(|token| {
            let port = free_port();
            env.push(("TOLLGATE_SIDECAR_ADMIN__LISTEN".into(), format!("127.0.0.1:{port}")));
            env.push(("TOLLGATE_SIDECAR_ADMIN__TOKEN".into(), token.clone()));
            // `GET /v1/invoices` reads the gateway's PostgreSQL (the billing consumer's)
            if let Some(pg) = &self.pg {
                env.push(("TOLLGATE_SIDECAR_ADMIN__BILLING_URL".into(), pg.url()));
            }
            if self.spec.console {
                env.push(("TOLLGATE_SIDECAR_CONSOLE__ENABLED".into(), "true".into()));
                if let Some(pg) = &self.pg {
                    env.push(("TOLLGATE_SIDECAR_CONSOLE__USAGE_URL".into(), pg.url()));
                }
            }
            format!("http://127.0.0.1:{port}")
        });
        env.extend(self.spec.sidecar_env.iter().cloned());
        let spool = match i {
            0 => self.spool.clone(),
            i => self.spool.with_file_name(format!("spool-{i}")),
        };
        let toml = self.spec.sidecar_toml.replace("${SPOOL_DIR}", &spool.display().to_string());
        let toml = match &self.broker {
            Some(b) => toml.replace("${BROKERS}", &b.brokers()),
            None => toml,
        };
        assert!(!toml.contains("${"), "an unfilled placeholder in the sidecar TOML (a broker needs .broker()):\n{toml}");
        let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let sidecar = Sidecar::start_with_config("", &toml, &extra);
        if let Some(base) = &admin {
            let probe = format!("{base}/openapi.json");
            poll_until("admin API", Duration::from_secs(20), || get(&probe, &[]).status == 200);
        }
        (ReplicaSidecar::Real(sidecar), admin)
    }
}
