//! How the store's connections are made and replaced (decisions 141, 144, 147): one per path (the
//! request path's and the off-path one), each made by one attempt at a time on a task of its own,
//! which callers wait for within their deadlines.

use super::{response_timeout, Backend, Conn, ConnState, Failed, Path, Receiver, Store, StoreError};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncConnectionConfig;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Mutex;

impl Store {
    pub(super) async fn connect(&self, path: Path) -> redis::RedisResult<Conn> {
        match self.backend.as_ref() {
            Backend::Single(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.config.connect_timeout))
                    .set_response_timeout(Some(response_timeout(&self.config, path)))
                    .set_number_of_retries(1)
                    .set_max_delay(self.config.reconnect_interval);
                Ok(Conn::Single(ConnectionManager::new_with_config(client.clone(), cfg).await?))
            }
            Backend::Cluster(clients) => {
                let client = if path == Path::Request { &clients.request } else { &clients.off_path };
                Ok(Conn::Cluster(client.get_async_connection().await?))
            }
            Backend::Sentinel(clients) => {
                let client = if path == Path::Request { &clients.request } else { &clients.off_path };
                // the library's default response timeout (500 ms) cut every off-path command
                // there, deadlines of seconds included (decision 147)
                let cfg = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.config.connect_timeout))
                    .set_response_timeout(Some(response_timeout(&self.config, path)));
                Ok(Conn::Sentinel(client.lock().await.get_async_connection_with_config(&cfg).await?))
            }
        }
    }

    /// Drops a cluster/sentinel connection after a connection error, so the next command makes a
    /// new one (single mode's ConnectionManager reconnects by itself). `used`: the generation the
    /// failed command ran on: a newer connection (made meanwhile) is kept; `None`: whichever.
    pub(super) async fn forget_connection(&self, path: Path, used: Option<u64>) {
        if !matches!(self.backend.as_ref(), Backend::Single(_)) {
            let mut state = self.slot(path).lock().await;
            if used.is_none_or(|g| g == state.generation) {
                state.conn = None;
            }
        }
    }

    /// Sentinel: drops `path`'s connection if it was made before `than`, when a command sent at
    /// `than` on the other path's found the master moved or gone (decision 147).
    pub(super) async fn forget_made_before(&self, path: Path, than: Instant) {
        let mut state = self.slot(path).lock().await;
        if state.made.is_some_and(|made| made <= than) {
            state.conn = None;
        }
    }

    /// When the request path's connection in use now was made, if it replaced another (`None`:
    /// the first, or none yet). Single mode's connection reconnects within itself, unseen here.
    pub async fn request_path_replaced_at(&self) -> Option<Instant> {
        let state = self.slot(Path::Request).lock().await;
        state.made.filter(|_| state.generation > 1)
    }

    /// The state of `path`'s connection.
    pub(super) fn slot(&self, path: Path) -> &Arc<Mutex<ConnState>> {
        match path {
            Path::Request => &self.state,
            Path::OffPath => &self.off_path,
        }
    }

    /// The connection for `path`, made if there is none. One attempt at a time: callers that
    /// come while it is under way wait for its result (within their deadlines: the attempt goes
    /// on without a caller that stops waiting, and keeps its connection for the next ones).
    /// Returns it with its generation.
    pub(super) async fn connection(&self, path: Path) -> Result<(Conn, u64), StoreError> {
        let slot = self.slot(path);
        let mut state = slot.lock().await;
        if let Some(c) = &state.conn {
            return Ok((c.clone(), state.generation));
        }
        let mut result = match state.attempt.clone() {
            Some(under_way) => under_way,
            None => {
                if let Some(at) = state.last_attempt {
                    if at.elapsed() < self.config.reconnect_interval {
                        return Err(StoreError::Unreachable("waiting before the next connection attempt".into()));
                    }
                }
                self.start_attempt(&mut state, path)
            }
        };
        drop(state);
        let ended = || StoreError::Unreachable("the connection attempt ended".into());
        let waited = result.wait_for(Option::is_some).await.map(|made| made.clone());
        let made = match waited {
            Ok(made) => made,
            Err(_) => {
                // the attempt's task ended without an answer (a panic, its runtime gone): it is
                // forgotten, so the next caller makes one anew
                let mut state = slot.lock().await;
                if state.attempt.as_ref().is_some_and(|a| a.same_channel(&result)) {
                    state.attempt = None;
                }
                return Err(ended());
            }
        };
        made.ok_or_else(ended)?.map_err(StoreError::from)
    }

    /// Starts a connection attempt for `path` on a task of its own; `state` is its slot's. Its
    /// connection replaces the slot's when it lands (a replacement in the background keeps the
    /// old one serving meanwhile).
    fn start_attempt(&self, state: &mut ConnState, path: Path) -> Receiver {
        state.last_attempt = Some(Instant::now());
        let (tx, rx) = tokio::sync::watch::channel(None);
        state.attempt = Some(rx.clone());
        let (store, slot) = (self.clone(), self.slot(path).clone());
        tokio::spawn(async move {
            let made = store.attempt(path).await;
            let mut state = slot.lock().await;
            state.attempt = None;
            let made = made.map(|conn| {
                state.conn = Some(conn.clone());
                state.generation += 1;
                state.made = Some(Instant::now());
                (conn, state.generation)
            });
            let _ = tx.send(Some(made));
        });
        rx
    }

    /// Cluster and Sentinel: a request-path command timed out on a connection that others may
    /// answer on (one silent master of several keeps the probe from running: the others reply).
    /// A new connection (a fresh slot map, the current master) is made in the background, at
    /// most once per `reconnect_interval`, and replaces it when it lands; the old one serves
    /// meanwhile, so a Redis that is only slow pays no reconnect on the request path.
    pub(super) async fn replace_in_background(&self, path: Path) {
        if matches!(self.backend.as_ref(), Backend::Single(_)) {
            return; // the probe replaces a silent single-mode connection (decision 140)
        }
        let mut state = self.slot(path).lock().await;
        let recent = state.last_attempt.is_some_and(|at| at.elapsed() < self.config.reconnect_interval);
        if state.attempt.is_none() && !recent {
            let _ = self.start_attempt(&mut state, path);
        }
    }

    /// One connection attempt, within `connect_timeout`.
    async fn attempt(&self, path: Path) -> Result<Conn, Failed> {
        match tokio::time::timeout(self.config.connect_timeout, self.connect(path)).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => {
                self.mark(false, &e.to_string());
                Err(Failed::Unreachable(e.to_string()))
            }
            Err(_) => {
                self.mark(false, "connect timed out");
                Err(Failed::TimedOut(self.config.connect_timeout))
            }
        }
    }
}
