//! Configuration propagation across replicas.
//!
//! Writers (the admin API of any replica) commit to the store of record, then `INCR
//! cfg:routing:version` and `PUBLISH config_changed:{tenant}` with the new version
//! ([`Control::announce`]). Every replica runs [`run`]: a dedicated pub/sub connection
//! PSUBSCRIBEd to `config_changed:*`; a message reloads the configuration and evicts that
//! tenant's cached key answers (`_all`: every tenant's). After every (re)subscription, and every
//! `admin.resync_interval`, the replica compares `cfg:routing:version` with the version it last
//! loaded and reloads everything if they differ, so a message missed while disconnected cannot
//! leave it stale. The key cache's TTL stays the last safety net.
//!
//! A reload that fails (PostgreSQL down) keeps the configuration in force and is retried at the
//! next resync; the request path never waits on any of this.

use crate::control::model::{ConfigSource, Live, Snapshot, Source, SourceError};
use crate::keys::{ConfigChangedChannel, Id, RoutingVersionKey, CONFIG_CHANGED_PATTERN};
use crate::decision::limits::Plans;
use crate::server::AppState;
use crate::store::{Store, StoreError};
use futures_util::StreamExt;
use redis::AsyncCommands;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What the admin API and the subscriber share: the source, the configuration in force, Redis.
pub struct Control {
    pub source: Source,
    pub live: Live,
    pub store: Store,
    pub app: Arc<AppState>,
    /// Whether the last reload failed (log the transition once, not every retry).
    reload_failing: AtomicBool,
    /// Held across load-and-install (reloads) and validate-commit-install (admin writes), so a
    /// reload that read the store before a local write committed cannot install over it.
    pub installing: tokio::sync::Mutex<()>,
}

impl Control {
    pub fn new(source: Source, snapshot: Snapshot, store: Store, app: Arc<AppState>) -> Control {
        Control { source, live: Live::new(snapshot), store, app, reload_failing: AtomicBool::new(false), installing: tokio::sync::Mutex::new(()) }
    }

    /// Puts `snapshot` (validated) in force: routes and products for the admin view, plans for
    /// decisions.
    pub fn install(&self, snapshot: Snapshot) {
        match Plans::compile(&snapshot.plans) {
            Ok(plans) => {
                self.app.decider.set_plans(plans);
                self.app.decider.set_routing(crate::decision::Routing::of(&snapshot, self.live.version()));
                self.live.set(snapshot);
            }
            // cannot happen for a validated snapshot; keep what runs
            Err(e) => tracing::error!(error = %e, "refused a configuration whose plans do not compile"),
        }
    }

    /// Loads from the source and installs; evicts `tenant`'s cached keys (`None`: all).
    pub async fn reload(&self, tenant: Option<&Id>, version: u64) -> Result<(), SourceError> {
        let _installing = self.installing.lock().await;
        match self.source.load().await {
            Ok(s) => {
                self.live.set_version(version);
                self.install(s);
                self.app.decider.evict(tenant);
                if self.reload_failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(version, "configuration reloads work again");
                }
                Ok(())
            }
            Err(e) => {
                // Keys are still revoked in Redis by the writer: forget cached answers anyway.
                self.app.decider.evict(tenant);
                if !self.reload_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "cannot reload the configuration; keeping the one in force");
                }
                Err(e)
            }
        }
    }

    /// After a committed write: bump the generation and tell every replica. Returns the version.
    pub async fn announce(&self, tenant: Option<&Id>) -> Result<u64, StoreError> {
        let channel = tenant.map_or_else(ConfigChangedChannel::all, ConfigChangedChannel::tenant);
        let version: u64 = self
            .store
            .run_with_deadline("announce_change", Duration::from_secs(5), |mut c| async move {
                let v: u64 = c.incr(RoutingVersionKey::new(), 1u64).await?;
                c.publish::<_, _, ()>(channel, v).await?;
                Ok(v)
            })
            .await?;
        Ok(version)
    }

    /// `cfg:routing:version` now (0 when never written).
    pub async fn routing_version(&self) -> Result<u64, StoreError> {
        self.store
            .run_with_deadline("routing_version", Duration::from_secs(2), |mut c| async move {
                let v: Option<u64> = c.get(RoutingVersionKey::new()).await?;
                Ok(v.unwrap_or(0))
            })
            .await
    }

    /// Copies every key record from PostgreSQL into Redis (a wiped Redis loses no key).
    /// Returns how many; a no-op for the file source (Redis is the keys' store there).
    pub async fn rewarm_keys(&self) -> Result<usize, String> {
        let Source::Postgres(pg) = &self.source else { return Ok(0) };
        let keys = pg.keys(None).await.map_err(|e| e.to_string())?;
        for (hash, record) in &keys {
            self.store.create_key(hash, record).await.map_err(|e| e.to_string())?;
        }
        Ok(keys.len())
    }
}

/// Re-warms Redis from PostgreSQL until it works once (Redis may come up after the sidecar).
pub async fn rewarm(control: Arc<Control>, shutdown: CancellationToken) {
    let mut pause = Duration::from_millis(100);
    loop {
        match control.rewarm_keys().await {
            Ok(n) => {
                tracing::info!(keys = n, "API-key records re-warmed into Redis from the store of record");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot re-warm API keys yet; retrying"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Where the subscriber subscribes.
#[derive(Debug, Clone)]
pub enum SubscribeTo {
    /// A node (any node of a Cluster sees every PUBLISH).
    Node(String),
    /// The master Sentinel names now, asked again on every (re)connection, so a failover moves
    /// the subscription to the new master (where the writers now publish).
    Sentinel { sentinels: Vec<String>, master_name: String },
}

impl SubscribeTo {
    async fn client(&self) -> redis::RedisResult<redis::Client> {
        match self {
            SubscribeTo::Node(url) => redis::Client::open(url.as_str()),
            SubscribeTo::Sentinel { sentinels, master_name } => {
                let mut last = None;
                for url in sentinels {
                    let asked = async {
                        let mut c = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
                        let (host, port): (String, u16) =
                            redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg(master_name).query_async(&mut c).await?;
                        redis::Client::open(format!("redis://{host}:{port}/"))
                    };
                    match tokio::time::timeout(Duration::from_secs(2), asked).await {
                        Ok(Ok(client)) => return Ok(client),
                        Ok(Err(e)) => last = Some(e),
                        Err(_) => last = Some(redis::RedisError::from((redis::ErrorKind::Io, "sentinel timed out"))),
                    }
                }
                Err(last.unwrap_or_else(|| redis::RedisError::from((redis::ErrorKind::Client, "no sentinel configured"))))
            }
        }
    }
}

/// The subscriber: runs until `shutdown`.
pub async fn run(control: Arc<Control>, to: SubscribeTo, resync_interval: Duration, shutdown: CancellationToken) {
    if let SubscribeTo::Node(url) = &to {
        if let Err(e) = redis::Client::open(url.as_str()) {
            tracing::error!(error = %e, "config propagation disabled: bad Redis URL");
            return;
        }
    }
    let mut pause = Duration::from_millis(20);
    while !shutdown.is_cancelled() {
        let subscribed = async {
            let mut ps = to.client().await?.get_async_pubsub().await?;
            ps.psubscribe(CONFIG_CHANGED_PATTERN).await?;
            redis::RedisResult::Ok(ps)
        };
        let ps = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = tokio::time::timeout(Duration::from_secs(4), subscribed) => r,
        };
        let mut ps = match ps {
            Ok(Ok(ps)) => ps,
            Ok(Err(_)) | Err(_) => {
                tracing::debug!("cannot subscribe to config changes yet; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        pause = Duration::from_millis(20);
        tracing::info!(pattern = CONFIG_CHANGED_PATTERN, "subscribed to config changes");
        // Subscribed first, compared second: a change after this point arrives as a message.
        resync(&control).await;
        let mut messages = ps.on_message();
        let mut tick = tokio::time::interval(resync_interval);
        tick.reset();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => resync(&control).await,
                msg = messages.next() => {
                    let Some(msg) = msg else {
                        tracing::warn!("config change subscription dropped; reconnecting and resynchronising");
                        break;
                    };
                    let channel = msg.get_channel_name().to_string();
                    let version: u64 = msg.get_payload::<String>().ok().and_then(|v| v.parse().ok()).unwrap_or(0);
                    match ConfigChangedChannel::tenant_of(&channel) {
                        Some(tenant) => {
                            tracing::debug!(channel, version, "config changed");
                            let _ = control.reload(tenant.as_ref(), version.max(control.live.version())).await;
                        }
                        None => tracing::debug!(channel, "ignored a message on an unknown channel"),
                    }
                }
            }
        }
    }
}

/// Reloads everything if `cfg:routing:version` moved past what this replica loaded.
async fn resync(control: &Control) {
    let Ok(version) = control.routing_version().await else { return };
    if version != control.live.version() {
        tracing::info!(from = control.live.version(), to = version, "configuration version moved; resynchronising");
        let _ = control.reload(None, version).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_pattern_matches_every_channel() {
        use crate::keys::{ConfigChangedChannel, Id, CONFIG_CHANGED_PATTERN};
        let prefix = CONFIG_CHANGED_PATTERN.trim_end_matches('*');
        assert!(ConfigChangedChannel::all().as_str().starts_with(prefix));
        assert!(ConfigChangedChannel::tenant(&Id::parse("a").unwrap()).as_str().starts_with(prefix));
    }
}
