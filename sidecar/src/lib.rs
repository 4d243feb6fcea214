//! Tollgate's sidecar: decides requests for the Envoy filter from Redis, meters usage, serves the
//! configuration plane, and exports metrics. `main.rs` is a thin CLI over this library; tests run
//! [`Sidecar`] in-process.
//!
//! Laid out by plane:
//! - [`decision`]: the request path — a filter's decision (key, limits, lookup) and completion.
//! - [`usage`]: the usage pipeline — intake, durable spool, Kafka shipper, Redis meter.
//! - [`control`]: the configuration plane — model, sources, admin API, propagation, key commands.
//!
//! and the infrastructure they share: [`server`] (the filter-facing HTTP API), [`store`] (the
//! Redis connection and the API-key store), [`scripts`] (one module per Lua script), [`keys`]
//! (typed Redis keys), [`apikey`] (key records), [`config`] (the settings file), [`clock`],
//! [`metrics`], [`invalid`]. The shared modules use no plane; `scripts/module-graph.py` checks
//! that no module imports another in a circle.

pub mod alerts;
pub mod apikey;
pub mod clock;
pub mod config;
pub mod conn;
pub mod console;
pub mod control;
pub mod decision;
pub mod errors;
pub mod invalid;
pub mod lifecycle;
pub mod metrics;
pub mod models;
pub mod scopes;
pub mod scripts;
pub mod secret;
pub mod server;
pub mod store;
pub mod stream;
pub mod telemetry;
pub mod testing;
pub mod trace;
pub mod usage;

/// The typed Redis keys (shared with billing: `tollgate_shared::keys`).
pub use tollgate_shared::keys;

use config::Config;
use control::{admin, propagation, Control};
use decision::{hints, limits};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("cannot listen on the unix socket {path} (listen_unix): {why}")]
    BindUnix { path: std::path::PathBuf, why: String },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("server: {0}")]
    Serve(std::io::Error),
    #[error("configuration: {0}")]
    Config(String),
    #[error("configuration: {0}")]
    Invalid(#[from] invalid::Invalid),
    #[error(transparent)]
    Usage(#[from] usage::UsageError),
}

/// A bound, not yet serving sidecar.
pub struct Sidecar {
    listener: tokio::net::TcpListener,
    /// The same API on a unix domain socket (`listen_unix`), and its path (removed at exit).
    unix: Option<(tokio::net::UnixListener, std::path::PathBuf)>,
    state: Arc<server::AppState>,
    /// Configuration in force, its source, and what the admin API and the subscriber share.
    control: Arc<Control>,
    /// The admin API's listener and token, when `admin.listen` is set.
    admin: Option<(tokio::net::TcpListener, secret::Secret)>,
    /// `[console]`: served on the admin listener when enabled.
    console: console::config::ConsoleConfig,
    /// The connection deadlines of the filter-facing server.
    deadlines: conn::Deadlines,
    /// A Redis node to subscribe to change events on, and how often to resync and ping it.
    propagation: Option<(propagation::SubscribeTo, propagation::Cadence)>,
    /// After the shutdown signal: serve on until the filter is quiet this long, at most this
    /// long (`server.shutdown_quiet`, `server.shutdown_wait`; crate::lifecycle).
    stop_after: (std::time::Duration, std::time::Duration),
    /// Budget alerts (`[alerts]`): delivered by a loop of this sidecar's.
    alerts: Arc<alerts::Alerts>,
    /// How often keys' last-use times are written (`cache.last_used_interval`).
    last_used_interval: std::time::Duration,
}

impl Sidecar {
    /// Binds the listener (port 0 picks a free one) and prepares the store; does not need Redis
    /// to be up.
    pub async fn bind(config: &Config) -> Result<Sidecar, Error> {
        Self::bind_with_clock(config, std::sync::Arc::new(clock::SystemClock)).await
    }

    /// As [`Sidecar::bind`], with the clock the limits use (tests drive a `ManualClock`).
    pub async fn bind_with_clock(config: &Config, clock: Arc<dyn clock::Clock>) -> Result<Sidecar, Error> {
        let secret = config.server.resolve_secret()?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| Error::Bind { addr: config.listen, source })?;
        let unix = match &config.listen_unix {
            Some(path) => Some((bind_unix(path)?, path.clone())),
            None => None,
        };
        telemetry::install(&config.telemetry);
        let store = store::Store::new(&config.redis)?;
        // Before the listener serves (and so before /healthz answers): a connection to Redis and
        // the scripts loaded, so the first decisions pay neither. Redis down now is no reason
        // not to start (the stale grace, the failure modes, and reconnects take over).
        match store.warm_up(&scripts::all()).await {
            Ok(()) => tracing::debug!("redis connected and scripts loaded"),
            Err(e) => tracing::warn!(error = %e, "redis could not be reached at start; continuing"),
        }
        // one table of prices for usage intake and money budgets, swapped by the configuration
        // plane when the stored prices change (crate::control)
        let prices = Arc::new(usage::pricing::PriceTable::new(usage::pricing::Pricing::compile(&config.usage.pricing)?));
        let usage = match config.usage.enabled {
            true => Some(Arc::new(usage::Usage::start(&config.usage, store.clone(), prices.clone())?)),
            false => None,
        };
        let ticket_key = decision::tickets::TicketKey::derive(&secret, &config.server.ticket_key);
        let state = Arc::new(server::AppState {
            secret,
            decider: Arc::new(
                decision::Decider::new(store.clone(), &config.cache, limits::Plans::compile(&config.plans)?, clock)
                    .with_usage(usage.clone())
                    .with_ticket_key(ticket_key)
                    .with_local(Arc::new(decision::local::LocalLimits::new(&config.limits)))
                    .with_responses(&config.responses)
                    // money budgets reserve and settle at the prices usage events are billed at
                    .with_pricing(prices),
            ),
            store,
            prometheus: metrics::handle(),
            hints: hints::Hints::new(&config.breaker),
            usage,
            tracer: trace::Tracer::start(&config.telemetry.traces),
            responses: config.responses.clone(),
            filter_calls: Arc::new(lifecycle::FilterCalls::default()),
            stopping: tokio_util::sync::CancellationToken::new(),
        });
        // the first sidecar of a process installs them (one per process outside tests)
        let alerts = alerts::install(state.store.clone(), config.alerts.clone());
        let (control, admin, propagation) = config_parts(config, state.clone()).await?;
        let deadlines = conn::Deadlines { header_read: config.server.header_read_timeout, idle: config.server.idle_timeout };
        let stop_after = (config.server.shutdown_quiet, config.server.shutdown_wait);
        let last_used_interval = config.cache.last_used_interval;
        let console = console::config::ConsoleConfig { currency: config.usage.pricing.currency.clone(), ..config.console.clone() };
        Ok(Sidecar { listener, unix, state, control, admin, deadlines, propagation, stop_after, last_used_interval, alerts, console })
    }

    /// The admin API's address, when it is on.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// The configuration in force and its source.
    pub fn control(&self) -> Arc<Control> {
        self.control.clone()
    }

    /// The unix socket's path, when `listen_unix` is set.
    pub fn unix_path(&self) -> Option<&std::path::Path> {
        self.unix.as_ref().map(|(_, p)| p.as_path())
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Serves until `shutdown` completes, then stops accepting and drains in-flight requests;
    /// then seals the usage spool and lets the shipper send what it can (`usage.shutdown_grace`).
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), Error> {
        tracing::info!(addr = %self.local_addr(), unix = ?self.unix_path(), "tollgate sidecar listening");
        // cancelled at the stop: the server's decision streams end then too (crate::stream)
        let background = self.state.stopping.clone();
        let mut tasks = tokio::task::JoinSet::new();
        if let Some((url, every)) = self.propagation.clone() {
            tasks.spawn(propagation::run(self.control.clone(), url, every, background.clone()));
        }
        if matches!(self.control.source, control::Source::Postgres(_)) {
            tasks.spawn(propagation::rewarm(self.control.clone(), background.clone()));
        }
        let local = self.state.decider.local();
        ::metrics::gauge!(metrics::LOCAL_REPLICAS).set(f64::from(local.replicas()));
        if !local.configured() {
            tasks.spawn(decision::replicas::run(self.state.store.clone(), self.state.decider.clone(), background.clone()));
        }
        tasks.spawn(alerts::deliver::run(self.alerts.clone(), background.clone()));
        tasks.spawn(control::last_used::run(self.control.clone(), self.last_used_interval, background.clone()));
        if let Some((listener, token)) = self.admin {
            let (router, writes) = admin::router(self.control.clone(), token.clone());
            // the console on the same listener, calling the API's handlers in-process (crate::console)
            let router = match self.console.enabled {
                true => (router.clone().merge(console::router::router(self.console.clone(), router, token, self.control.clone(), self.state.clone())), writes),
                false => (router, writes),
            };
            tasks.spawn(admin::run(listener, router, self.deadlines, background.clone()));
        }
        // One shutdown for both listeners: each stops accepting and drains its connections
        // (HTTP/2 ones get a GOAWAY), and the background tasks stop — once the filter is done
        // calling (its Envoy drained and gone, or `server.shutdown_wait`; crate::lifecycle).
        let stop = background.clone();
        let calls = self.state.filter_calls.clone();
        let (quiet, wait) = self.stop_after;
        tokio::spawn(async move {
            shutdown.await;
            match lifecycle::until_filter_gone(&calls, quiet, wait).await {
                lifecycle::Gone::NoWait => {}
                lifecycle::Gone::Quiet => tracing::info!(quiet = ?quiet, "the filter stopped calling; stopping"),
                lifecycle::Gone::WaitElapsed => {
                    tracing::warn!(wait = ?wait, "the filter still calls after server.shutdown_wait; stopping anyway")
                }
            }
            stop.cancel();
        });
        let usage = self.state.usage.clone();
        let router = server::router(self.state, stream::routes());
        // Both HTTP/1.1 and HTTP/2 (h2c with prior knowledge) on each listener: the connection's
        // first bytes tell them apart (crate::conn, with its deadlines).
        // TCP_NODELAY: an HTTP/2 answer is written as a HEADERS and a DATA frame; with Nagle on,
        // the second waits for the peer's delayed ACK (~40 ms) — longer than the filter's
        // timeout. HTTP/1.1 answers go out in one write and did not show it.
        use axum::serve::ListenerExt;
        let listener = self.listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
        });
        let tcp = conn::serve(listener, router.clone(), self.deadlines, background.clone());
        match self.unix {
            Some((listener, path)) => {
                tokio::join!(tcp, conn::serve(listener, router, self.deadlines, background.clone()));
                let _ = std::fs::remove_file(&path);
            }
            None => tcp.await,
        }
        background.cancel();
        while tasks.join_next().await.is_some() {}
        if let Some(u) = usage {
            u.shutdown().await;
        }
        tracing::info!("tollgate sidecar stopped");
        Ok(())
    }
}

/// Binds the unix socket at `path`. A socket file left by a sidecar that is gone (nothing accepts
/// on it) is removed first; a socket someone still answers on, or a path that exists and is not
/// a socket, is refused rather than taken over.
fn bind_unix(path: &std::path::Path) -> Result<tokio::net::UnixListener, Error> {
    use std::os::unix::fs::FileTypeExt;
    let refuse = |why: String| Error::BindUnix { path: path.to_path_buf(), why };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(refuse("another process is listening on it".into()));
            }
            std::fs::remove_file(path).map_err(|e| refuse(format!("cannot remove the stale socket file: {e}")))?;
            tracing::info!(path = %path.display(), "removed a stale unix socket file");
        }
        Ok(_) => return Err(refuse("the path exists and is not a socket; not removing it".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(refuse(e.to_string())),
    }
    tokio::net::UnixListener::bind(path).map_err(|e| refuse(e.to_string()))
}

/// Binds and serves until `shutdown`.
pub async fn run(config: &Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), Error> {
    Sidecar::bind(config).await?.serve(shutdown).await
}

type ConfigParts =
    (Arc<Control>, Option<(tokio::net::TcpListener, secret::Secret)>, Option<(propagation::SubscribeTo, propagation::Cadence)>);

/// Opens the configuration source (PostgreSQL: connect, migrate, load — an unreachable server is
/// an error), puts its plans in force, binds the admin listener, picks the pub/sub node.
async fn config_parts(config: &Config, state: Arc<server::AppState>) -> Result<ConfigParts, Error> {
    use control::model::Snapshot;
    use control::source::{postgres::PgSource, ConfigSource, FileSource, SourceKind};
    use control::Source;
    let (source, snapshot, unusable) = match config.source.kind {
        SourceKind::File => {
            let s = Snapshot::from_file(&config.tenants, &config.products, &config.plans, &config.routes)?;
            (Source::File(FileSource::new(s.clone())), s, Vec::new())
        }
        SourceKind::Postgres => {
            let pg = PgSource::connect(&config.source.postgres_url, config.source.connect_timeout)
                .await
                .map_err(|e| Error::Config(format!("the PostgreSQL source (source.postgres_url) cannot be used: {e}")))?
                .with_currency(&config.usage.pricing.currency);
            let (read, unread) = pg.load().await.map_err(|e| Error::Config(format!("loading from PostgreSQL: {e}")))?;
            // a stored object this sidecar cannot use is left out and reported, never a refused
            // start (decision 206): an older sidecar starting beside a newer one's rows included
            let (s, unusable) = control::salvage::salvage(read, unread, &Snapshot::default());
            if !(config.plans.is_empty() && config.tenants.is_empty() && config.products.is_empty() && config.routes.is_empty()) {
                tracing::warn!("source.kind = postgres: plans, tenants, products and routes of the file are ignored");
            }
            (Source::Postgres(pg), s, unusable)
        }
    };
    let store = state.store.clone();
    let billing = config.admin.billing_url.clone().or_else(|| config.console.usage_url.clone());
    let control = Arc::new(Control::new(source, snapshot.clone(), store, state.decider.clone()).with_pricing(&config.usage.pricing)?.with_billing(billing));
    control.install(snapshot);
    control.report(unusable);
    let admin = match config.admin.listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Bind { addr, source })?;
            Some((l, config.admin.resolve_token()?))
        }
        None => None,
    };
    use propagation::SubscribeTo;
    let node = match config.redis.mode {
        config::RedisMode::Single => Some(SubscribeTo::Nodes(vec![config.redis.url.clone()])),
        config::RedisMode::Cluster => (!config.redis.nodes.is_empty()).then(|| SubscribeTo::Nodes(config.redis.nodes.clone())),
        config::RedisMode::Sentinel => Some(SubscribeTo::Sentinel {
            sentinels: config.redis.nodes.clone(),
            master_name: config.redis.master_name.clone(),
        }),
    };
    let cadence = propagation::Cadence { resync: config.admin.resync_interval, ping: config.admin.subscriber_ping };
    Ok((control, admin, node.map(|n| (n, cadence))))
}
