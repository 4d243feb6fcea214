//! Configuration propagation across replicas.
//!
//! Writers (the admin API of any replica) commit to the store of record, then `INCR
//! cfg:routing:version` and `PUBLISH config_changed:{tenant}` with the new version
//! ([`Control::announce`](super::Control::announce)). Every replica runs [`run`]: a dedicated pub/sub connection
//! PSUBSCRIBEd to `config_changed:*`; a message reloads the configuration and evicts that
//! tenant's cached key answers (`_all`: every tenant's). After every (re)subscription, and every
//! `admin.resync_interval`, the replica compares `cfg:routing:version` with the version it last
//! loaded and reloads everything if they differ, so a message missed while disconnected cannot
//! leave it stale; while it cannot subscribe at all (the node down, pub/sub refused), it still
//! compares every `admin.resync_interval`, through the store's own connections. The connection
//! is pinged every `admin.subscriber_ping` (50 ms); one that does not answer within twice that —
//! it stopped delivering without closing — is replaced, and the replica resynchronises (decision
//! 207). On a Cluster
//! each attempt to subscribe takes the next configured node. The key cache's TTL stays the last
//! safety net.
//!
//! A reload that fails (PostgreSQL down) keeps the configuration in force and is retried at the
//! next resync; the request path never waits on any of this.

use super::Control;
use crate::keys::{ConfigChangedChannel, CONFIG_CHANGED_PATTERN};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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
    /// A node: the single one, or any of a Cluster's (each sees every PUBLISH), tried in turn.
    Nodes(Vec<String>),
    /// The master Sentinel names now, asked again on every (re)connection, so a failover moves
    /// the subscription to the new master (where the writers now publish).
    Sentinel { sentinels: Vec<String>, master_name: String },
}

impl SubscribeTo {
    /// The client of the `attempt`-th attempt to subscribe.
    async fn client(&self, attempt: usize) -> redis::RedisResult<redis::Client> {
        match self {
            SubscribeTo::Nodes(urls) => match urls.get(attempt % urls.len().max(1)) {
                Some(url) => redis::Client::open(url.as_str()),
                None => Err(redis::RedisError::from((redis::ErrorKind::Client, "no node configured"))),
            },
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

/// How often the subscriber compares versions and pings its connection (`[admin]`).
#[derive(Debug, Clone, Copy)]
pub struct Cadence {
    /// `admin.resync_interval`.
    pub resync: Duration,
    /// `admin.subscriber_ping`: a ping unanswered within twice this replaces the connection.
    pub ping: Duration,
}

/// The subscriber: runs until `shutdown`.
pub async fn run(control: Arc<Control>, to: SubscribeTo, cadence: Cadence, shutdown: CancellationToken) {
    let resync_interval = cadence.resync;
    let mut silent = Silences::default();
    if let SubscribeTo::Nodes(urls) = &to {
        if let Some(e) = urls.iter().find_map(|url| redis::Client::open(url.as_str()).err()) {
            tracing::error!(error = %e, "config propagation disabled: bad Redis URL");
            return;
        }
    }
    let mut pause = Duration::from_millis(20);
    let mut attempt = 0usize;
    let mut last_resync = tokio::time::Instant::now();
    while !shutdown.is_cancelled() {
        let client = to.client(attempt);
        attempt = attempt.wrapping_add(1);
        let subscribed = async {
            let mut ps = client.await?.get_async_pubsub().await?;
            ps.psubscribe(CONFIG_CHANGED_PATTERN).await?;
            redis::RedisResult::Ok(ps)
        };
        let ps = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = tokio::time::timeout(Duration::from_secs(4), subscribed) => r,
        };
        let ps = match ps {
            Ok(Ok(ps)) => ps,
            Ok(Err(_)) | Err(_) => {
                tracing::debug!("cannot subscribe to config changes yet; retrying");
                // no message can come meanwhile: the version is compared all the same
                if last_resync.elapsed() >= resync_interval {
                    resync(&control).await;
                    last_resync = tokio::time::Instant::now();
                }
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
        last_resync = tokio::time::Instant::now();
        // The sink pings while the stream delivers: a connection that stopped delivering without
        // closing (a peer gone without a reset, a frozen path) answers no ping either, and is
        // replaced within twice the ping interval — not at the next resync (decision 207).
        let (mut sink, mut messages) = ps.split();
        let mut tick = tokio::time::interval(resync_interval);
        tick.reset();
        let mut ping = tokio::time::interval(cadence.ping);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping.reset();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {
                    resync(&control).await;
                    last_resync = tokio::time::Instant::now();
                }
                _ = ping.tick() => {
                    let answered = tokio::time::timeout(cadence.ping * 2, sink.ping::<redis::Value>()).await;
                    if !matches!(answered, Ok(Ok(_))) {
                        metrics::counter!(crate::metrics::SUBSCRIBER_REPLACED).increment(1);
                        let pause = silent.pause();
                        silent.note(cadence.ping * 2);
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(pause) => {}
                        }
                        break;
                    }
                }
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

/// Replacements of a silent subscription, logged at most once a minute (a machine too loaded
/// to answer in time would otherwise log at every ping), and made at most once a second after
/// the first (each costs a resubscription and a resync).
#[derive(Default)]
struct Silences {
    logged: Option<tokio::time::Instant>,
    since: u64,
    /// When the last replacement subscribes again (after its pause).
    last: Option<tokio::time::Instant>,
}

impl Silences {
    /// How long to wait before subscribing again: nothing after a first replacement (the
    /// revocation bound), a second after one that came within a second of the last.
    fn pause(&self) -> Duration {
        match self.last {
            Some(t) if tokio::time::Instant::now().saturating_duration_since(t) < Duration::from_secs(1) => Duration::from_secs(1),
            _ => Duration::ZERO,
        }
    }

    fn note(&mut self, waited: Duration) {
        let pause = self.pause();
        self.last = Some(tokio::time::Instant::now() + pause);
        self.since += 1;
        if self.logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            tracing::warn!(waited = ?waited, replaced = self.since, "the config change subscription answered no ping: replacing it and resynchronising");
            self.logged = Some(tokio::time::Instant::now());
            self.since = 0;
        }
    }
}

/// Reloads everything if `cfg:routing:version` moved past what this replica loaded, and puts
/// back the recent revocations and new keys Redis may have lost (decisions 197, 209).
async fn resync(control: &Control) {
    let Ok(version) = control.routing_version().await else { return };
    if version != control.live.version() {
        tracing::info!(from = control.live.version(), to = version, "configuration version moved; resynchronising");
        let _ = control.reload(None, version).await;
    }
    if let Err(e) = control.restore_recent_keys().await {
        tracing::debug!(error = %e, "recent key records not re-copied this time");
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
