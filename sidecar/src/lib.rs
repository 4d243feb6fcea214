//! Tollgate's sidecar: decides requests for the Envoy filter from Redis, manages API keys, and
//! exports metrics. `main.rs` is a thin CLI over this library; tests run [`Sidecar`] in-process.

pub mod apikey;
pub mod cache;
pub mod clock;
pub mod config;
pub mod decide;
pub mod hints;
pub mod kafka;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod server;
pub mod spool;
pub mod store;
pub mod usage;

use config::Config;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("server: {0}")]
    Serve(std::io::Error),
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Usage(#[from] usage::UsageError),
}

/// A bound, not yet serving sidecar.
pub struct Sidecar {
    listener: tokio::net::TcpListener,
    state: Arc<server::AppState>,
}

impl Sidecar {
    /// Binds the listener (port 0 picks a free one) and prepares the store; does not need Redis
    /// to be up.
    pub async fn bind(config: &Config) -> Result<Sidecar, Error> {
        Self::bind_with_clock(config, std::sync::Arc::new(clock::SystemClock)).await
    }

    /// As [`Sidecar::bind`], with the clock the limits use (tests drive a `ManualClock`).
    pub async fn bind_with_clock(config: &Config, clock: Arc<dyn clock::Clock>) -> Result<Sidecar, Error> {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| Error::Bind { addr: config.listen, source })?;
        let store = store::Store::new(&config.redis)?;
        let usage = match config.usage.enabled {
            true => Some(Arc::new(usage::Usage::start(&config.usage, store.clone())?)),
            false => None,
        };
        let state = Arc::new(server::AppState {
            decider: decide::Decider::new(
                store.clone(),
                &config.cache,
                limits::Plans::compile(&config.plans).map_err(Error::Config)?,
                clock,
            )
            .with_usage(usage.clone()),
            store,
            prometheus: metrics::handle(),
            hints: hints::Hints::new(&config.breaker),
            usage,
        });
        Ok(Sidecar { listener, state })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Serves until `shutdown` completes, then stops accepting and drains in-flight requests;
    /// then seals the usage spool and lets the shipper send what it can (`usage.shutdown_grace`).
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), Error> {
        tracing::info!(addr = %self.local_addr(), "tollgate sidecar listening");
        let usage = self.state.usage.clone();
        let served = axum::serve(self.listener, server::router(self.state)).with_graceful_shutdown(shutdown).await;
        if let Some(u) = usage {
            u.shutdown().await;
        }
        served.map_err(Error::Serve)?;
        tracing::info!("tollgate sidecar stopped");
        Ok(())
    }
}

/// Binds and serves until `shutdown`.
pub async fn run(config: &Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), Error> {
    Sidecar::bind(config).await?.serve(shutdown).await
}
