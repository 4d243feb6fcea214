//! The Redis side: the connections (single, cluster or sentinel mode; in every mode two, the
//! request path's and the off-path one, so an off-path command keeps its own deadline and never
//! delays a decision: decisions 141, 144 and 147) with a deadline on every command, counted
//! from the call, connecting included (decision 144), fail-fast while Redis is unreachable, and
//! the API-key store operations (`store/apikeys.rs`); how connections are made and replaced is
//! `store/connections.rs`. What runs on it is the callers': the scripts'
//! modules (crate::scripts), the hints, the meter, the configuration plane.
//!
//! Failure policy: a command that errors or misses its deadline returns [`StoreError`] at once,
//! with `is_transient()` telling callers whether retrying (or serving stale) makes sense. While
//! Redis is down, reconnects are attempted at most once per `reconnect_interval`; requests in
//! between fail immediately instead of piling up. "Down" and "back" are logged once, on the
//! transition, never per request.
//!
//! A Redis that accepts connections but does not answer (hung, SIGSTOPped, a long-running
//! script) is the other case: a command that waited its whole deadline with no reply at all from
//! Redis meanwhile marks it *unresponsive*. From then on every command fails at once (no caller
//! waits on it: a decision falls to the stale grace and the limits' failure modes within its
//! budget), and one background task PINGs it every `fail_fast` until it answers — on a new
//! connection too from its second try, kept if it answers (a connection whose peer vanished
//! without a reset is otherwise never replaced: decision 140).

mod apikeys;
mod connections;
mod scan;

use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// `[redis]` of the sidecar configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `single` (default: `url`), `cluster` (`nodes` are seed nodes) or `sentinel` (`nodes` are
    /// the sentinels, `master_name` the monitored master).
    pub mode: RedisMode,
    /// `redis://host:port/db` (or `rediss://`), for `single` mode.
    pub url: String,
    /// Cluster seed nodes or sentinel addresses (`redis://host:port`).
    pub nodes: Vec<String>,
    /// The master's name in Sentinel.
    pub master_name: String,
    /// Deadline for one Redis command on the request path. Keep it under the filter's timeout so
    /// the sidecar still answers (from cache, or "unavailable") before Envoy gives up.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// All the Redis time one decision may take (the key lookup and the limits script together):
    /// each command gets what is left of it (at most `timeout`). Keep it under the filter's
    /// `sidecar.timeout` with room for the HTTP hop, so a decision is answered — from the stale
    /// grace or by each limit's failure mode — before Envoy gives up on it.
    #[serde(with = "humantime_serde")]
    pub decision_timeout: Duration,
    /// After a command waited its whole deadline (at least `min(timeout, decision_timeout)`)
    /// and no reply at all came meanwhile, Redis is taken as unresponsive: commands fail at once
    /// for this long, then a background PING probes it (again every `fail_fast` until it answers).
    #[serde(with = "humantime_serde")]
    pub fail_fast: Duration,
    /// Deadline for (re)connecting.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// While Redis is unreachable, reconnects are attempted at most this often; requests in
    /// between fail fast instead of queueing on a dead connection.
    #[serde(with = "humantime_serde")]
    pub reconnect_interval: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    Single,
    Cluster,
    Sentinel,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            mode: RedisMode::Single,
            nodes: Vec::new(),
            master_name: "mymaster".into(),
            url: "redis://127.0.0.1:6379".into(),
            timeout: Duration::from_millis(15),
            decision_timeout: Duration::from_millis(20),
            fail_fast: Duration::from_millis(250),
            connect_timeout: Duration::from_millis(250),
            reconnect_interval: Duration::from_millis(500),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis is unreachable: {0}")]
    Unreachable(String),
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("malformed record: {0}")]
    Malformed(String),
    #[error("not found: {0}")]
    NotFound(String),
}

impl StoreError {
    /// A write reached a replica (a Sentinel failover happened): reconnect to the new master.
    pub fn is_read_only(&self) -> bool {
        matches!(self, StoreError::Redis(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly))
    }

    /// A reply or a connection error that says the master this connection reached is no longer
    /// one: a write refused by a replica, or the connection dropped, refused or broken.
    fn moves_the_master(&self) -> bool {
        self.is_read_only()
            || matches!(self, StoreError::Redis(e) if e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error())
    }

    /// What Redis said about the data itself, not about its own state: a record it holds that
    /// cannot be read as one (malformed, of another type: `WRONGTYPE`), or a key it does not
    /// hold. Every other error — a timeout, a lost connection, or an error reply such as
    /// `LOADING`, `BUSY`, `MASTERDOWN`, `NOPERM` — says nothing about the record.
    pub fn is_about_the_record(&self) -> bool {
        match self {
            StoreError::Malformed(_) | StoreError::NotFound(_) => true,
            StoreError::Redis(e) => {
                e.code() == Some("WRONGTYPE") || matches!(e.kind(), redis::ErrorKind::UnexpectedReturnType | redis::ErrorKind::Parse)
            }
            StoreError::Timeout(_) | StoreError::Unreachable(_) => false,
        }
    }

    /// Timeouts and connection trouble may pass; a malformed record or a missing key will not.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Timeout(_) | StoreError::Unreachable(_) => true,
            StoreError::Redis(e) => {
                e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error()
            }
            StoreError::Malformed(_) | StoreError::NotFound(_) => false,
        }
    }
}

struct ConnState {
    conn: Option<Conn>,
    /// Which connection `conn` is: bumped each time one is stored (from 1), so an error of a
    /// command that ran on an older one never drops its replacement.
    generation: u64,
    /// When `conn` was stored: Sentinel drops the other path's connection only when it is older
    /// than the command that found the master gone (decision 147).
    made: Option<Instant>,
    last_attempt: Option<Instant>,
    /// The attempt under way: its result, when it comes (`None` until then). Callers wait for it
    /// within their own deadlines; the attempt goes on without them (decision 144).
    attempt: Option<Receiver>,
}

/// Where an attempt's result comes: `None` until it does.
type Receiver = tokio::sync::watch::Receiver<Option<Result<(Conn, u64), Failed>>>;

/// A failed connection attempt, as each caller that waited for it reads it.
#[derive(Debug, Clone)]
enum Failed {
    Unreachable(String),
    TimedOut(Duration),
}

impl From<Failed> for StoreError {
    fn from(f: Failed) -> StoreError {
        match f {
            Failed::Unreachable(why) => StoreError::Unreachable(why),
            Failed::TimedOut(d) => StoreError::Timeout(d),
        }
    }
}

impl ConnState {
    fn new() -> Arc<Mutex<ConnState>> {
        Arc::new(Mutex::new(ConnState { conn: None, generation: 0, made: None, last_attempt: None, attempt: None }))
    }
}

/// Which connection a command takes (in every mode: decisions 141, 144, 147). The request path's
/// has `redis.timeout` as its response timeout; off-path commands (stores, refunds, completions,
/// the meter, hints, the admin API) have deadlines of their own, up to seconds, which that
/// response timeout would cut to the request path's, and a slow one of them would delay the
/// decisions queued behind it on a shared connection (decision 141).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Request,
    OffPath,
}

/// The off-path connection's response timeout: above every off-path deadline (each command's own
/// deadline ends it first).
const OFF_PATH_RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// The response timeout of `path`'s connections.
fn response_timeout(config: &RedisConfig, path: Path) -> Duration {
    match path {
        Path::Request => config.timeout.max(Duration::from_millis(1)),
        Path::OffPath => OFF_PATH_RESPONSE_TIMEOUT,
    }
}

/// How to reach Redis.
enum Backend {
    Single(redis::Client),
    Cluster(Box<ClusterClients>),
    Sentinel(Box<SentinelClients>),
}

/// Sentinel: the request path's client and the off-path one's, each resolving the master on its
/// own, so one path's connection attempt never waits behind the other's (decision 147).
struct SentinelClients {
    request: Mutex<redis::sentinel::SentinelClient>,
    off_path: Mutex<redis::sentinel::SentinelClient>,
}

/// The request path's client (response timeout `redis.timeout`) and the off-path one's.
struct ClusterClients {
    request: redis::cluster::ClusterClient,
    off_path: redis::cluster::ClusterClient,
}

/// A connection of any mode. Single mode reconnects by itself (ConnectionManager); cluster and
/// sentinel connections are dropped on connection errors and made again (for Sentinel that
/// re-resolves the master, which is how a failover is followed).
#[derive(Clone)]
pub enum Conn {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    Sentinel(redis::aio::MultiplexedConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// Whether Redis is known unresponsive, and when it last answered.
struct Health {
    /// The origin of the microsecond clocks below.
    base: Instant,
    /// Microseconds since `base` of the last reply from Redis (any command).
    last_reply_us: AtomicU64,
    /// Commands fail at once (a probe is running).
    failing_fast: AtomicBool,
}

impl Health {
    fn new() -> Health {
        Health { base: Instant::now(), last_reply_us: AtomicU64::new(0), failing_fast: AtomicBool::new(false) }
    }

    fn micros(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.base).as_micros() as u64
    }

    fn replied(&self) {
        self.last_reply_us.fetch_max(self.micros(Instant::now()), Ordering::Relaxed);
    }

    /// Whether any reply came after `at` (or in the same microsecond).
    fn replied_since(&self, at: Instant) -> bool {
        self.last_reply_us.load(Ordering::Relaxed) >= self.micros(at).max(1)
    }
}

/// A shared handle on Redis. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    backend: Arc<Backend>,
    config: RedisConfig,
    state: Arc<Mutex<ConnState>>,
    /// The connection of off-path commands (decisions 141, 144, 147).
    off_path: Arc<Mutex<ConnState>>,
    up: Arc<AtomicBool>,
    health: Arc<Health>,
}

impl Store {
    /// Does not connect: the first command does (so the sidecar starts while Redis is down).
    pub fn new(config: &RedisConfig) -> Result<Store, StoreError> {
        let backend = match config.mode {
            RedisMode::Single => Backend::Single(redis::Client::open(config.url.as_str())?),
            RedisMode::Cluster => {
                let client = |response_timeout: Duration| {
                    redis::cluster::ClusterClientBuilder::new(config.nodes.clone())
                        .connection_timeout(config.connect_timeout)
                        .response_timeout(response_timeout)
                        .build()
                };
                Backend::Cluster(Box::new(ClusterClients {
                    request: client(response_timeout(config, Path::Request))?,
                    off_path: client(response_timeout(config, Path::OffPath))?,
                }))
            }
            RedisMode::Sentinel => {
                let client = || {
                    redis::sentinel::SentinelClient::build(
                        config.nodes.clone(),
                        config.master_name.clone(),
                        None,
                        redis::sentinel::SentinelServerType::Master,
                    )
                    .map(Mutex::new)
                };
                Backend::Sentinel(Box::new(SentinelClients { request: client()?, off_path: client()? }))
            }
        };
        Ok(Store {
            backend: Arc::new(backend),
            config: config.clone(),
            state: ConnState::new(),
            off_path: ConnState::new(),
            up: Arc::new(AtomicBool::new(true)),
            health: Arc::new(Health::new()),
        })
    }

    /// Whether the keys live on a Cluster (a script may only touch keys of one slot there).
    pub fn is_cluster(&self) -> bool {
        matches!(self.backend.as_ref(), Backend::Cluster(_))
    }

    /// Whether the last command reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Whether commands fail at once because Redis did not answer (see the module doc).
    pub fn is_failing_fast(&self) -> bool {
        self.health.failing_fast.load(Ordering::Relaxed)
    }

    /// The Redis time one decision may take in all (`redis.decision_timeout`).
    pub fn decision_timeout(&self) -> Duration {
        self.config.decision_timeout
    }

    /// The deadline of one request-path command with `left` of its decision's budget.
    pub fn request_deadline(&self, left: Duration) -> Duration {
        left.min(self.config.timeout)
    }

    /// Connects and loads every script of the request path, so the first decisions find a
    /// connection and their scripts (no NOSCRIPT round trip). Best effort within
    /// `connect_timeout` each: a Redis that is down now is reconnected to later.
    pub async fn warm_up(&self, scripts: &[&redis::Script]) -> Result<(), StoreError> {
        for script in scripts {
            let script = (*script).clone();
            // the deadline covers the connect (up to connect_timeout) and the load
            let deadline = self.config.connect_timeout + self.config.timeout;
            self.run_on(Path::Request, "script_load", deadline, |mut c| async move {
                script.load_async(&mut c).await.map(|_| ())
            })
            .await?;
        }
        Ok(())
    }

    /// Redis did not answer a command within its deadline, nor any other meanwhile: fail fast,
    /// and probe it in the background until it answers.
    fn unresponsive(&self) {
        if self.health.failing_fast.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(probe_every = ?self.config.fail_fast, "redis does not answer: failing fast until a probe gets a reply");
        let store = self.clone();
        tokio::spawn(async move { store.probe().await });
    }

    async fn probe(self) {
        let mut failed = 0u32;
        loop {
            tokio::time::sleep(self.config.fail_fast).await;
            let mut answered = match self.connection(Path::Request).await {
                Ok((c, _)) => self.answers(c).await,
                Err(_) => false,
            };
            failed += 1;
            // Single mode's connection is never replaced on timeouts (only on errors), and one
            // whose peer vanished without a reset (a host or NAT entry gone, an address moved)
            // times out until TCP gives up, minutes later: from the second failed probe, a new
            // connection is tried and kept if it answers. A hung Redis answers neither.
            if !answered && failed >= 2 && matches!(self.backend.as_ref(), Backend::Single(_)) {
                if let Ok(Ok(fresh)) = tokio::time::timeout(self.config.connect_timeout, self.connect(Path::Request)).await {
                    if self.answers(fresh.clone()).await {
                        let mut state = self.state.lock().await;
                        state.conn = Some(fresh);
                        state.generation += 1;
                        state.made = Some(Instant::now());
                        drop(state);
                        // the off-path one went the same way: made anew on its next use
                        self.off_path.lock().await.conn = None;
                        metrics::counter!(crate::metrics::REDIS_CONNECTIONS_REPLACED).increment(1);
                        tracing::warn!("redis answers on a new connection: the old one was dead and is replaced");
                        answered = true;
                    }
                }
            }
            if answered {
                self.health.replied();
                self.health.failing_fast.store(false, Ordering::Relaxed);
                self.mark(true, "");
                tracing::info!("redis answers again: no longer failing fast");
                return;
            }
            self.forget_connection(Path::Request, None).await;
            self.forget_connection(Path::OffPath, None).await;
        }
    }

    /// Whether a PING sent now on the request path's connection is answered (within
    /// `redis.timeout`): the commands sent on it before have all run (decision 137).
    pub async fn request_path_barrier(&self) -> bool {
        let ping = |mut c: Conn| async move { redis::cmd("PING").query_async::<String>(&mut c).await };
        self.run_on(Path::Request, "barrier", self.config.timeout, ping).await.is_ok()
    }

    /// Whether `conn` answers a PING within the command deadline.
    async fn answers(&self, mut conn: Conn) -> bool {
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut conn);
        matches!(tokio::time::timeout(self.config.timeout, ping).await, Ok(Ok(_)))
    }

    fn mark(&self, up: bool, why: &str) {
        let was = self.up.swap(up, Ordering::Relaxed);
        if was && !up {
            tracing::warn!(reason = why, "redis went down");
        } else if !was && up {
            tracing::info!("redis is back");
        }
    }

    /// Runs one command with the configured deadline, recording latency and errors.
    pub(crate) async fn run<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        self.run_with_deadline(op, self.config.timeout, f).await
    }

    /// Runs one command within `deadline`: on the request path's connection when the deadline is
    /// the request path's (`redis.timeout` or less), else on the off-path one (decision 141).
    pub(crate) async fn run_with_deadline<T, F, Fut>(&self, op: &'static str, deadline: Duration, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let path = if deadline > self.config.timeout { Path::OffPath } else { Path::Request };
        self.run_on(path, op, deadline, f).await
    }

    async fn run_on<T, F, Fut>(&self, path: Path, op: &'static str, deadline: Duration, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        if self.is_failing_fast() {
            metrics::counter!(crate::metrics::REDIS_ERRORS, "op" => op, "kind" => "fail_fast").increment(1);
            return Err(StoreError::Unreachable("redis does not answer; failing fast until it does".into()));
        }
        if deadline.is_zero() {
            // the caller's budget is spent: not Redis' fault, nothing to learn about it
            return Err(StoreError::Timeout(deadline));
        }
        let started = Instant::now();
        // the deadline counts from here: waiting for a connection is part of it (decision 144)
        // the generation of the connection the command was sent on (0: not sent)
        let used = AtomicU64::new(0);
        let command = async {
            let (conn, generation) = self.connection(path).await?;
            used.store(generation, Ordering::Relaxed);
            f(conn).await.map_err(StoreError::Redis)
        };
        let result = match tokio::time::timeout(deadline, command).await {
            Ok(r) => r,
            // still waiting for a connection: the command was never sent (it cannot run late)
            // and Redis said nothing about itself: not a timeout of Redis'
            Err(_) if used.load(Ordering::Relaxed) == 0 => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "op" => op, "kind" => "connecting").increment(1);
                return Err(StoreError::Unreachable("still connecting to redis".into()));
            }
            Err(_) => Err(StoreError::Timeout(deadline)),
        };
        metrics::histogram!(crate::metrics::REDIS_SECONDS, "op" => op).record(started.elapsed().as_secs_f64());
        match &result {
            Ok(_) => {
                self.health.replied();
                self.mark(true, "");
            }
            Err(e) if e.is_transient() || e.is_read_only() => {
                let timed_out = matches!(e, StoreError::Timeout(_)) || matches!(e, StoreError::Redis(r) if r.is_timeout());
                let waited = started.elapsed() >= self.config.timeout.min(self.config.decision_timeout);
                if timed_out && waited && !self.health.replied_since(started) {
                    self.unresponsive();
                }
                metrics::counter!(crate::metrics::REDIS_ERRORS, "op" => op, "kind" => "transient").increment(1);
                self.mark(false, &e.to_string());
                if timed_out {
                    // A slow answer is no broken connection: a cluster or sentinel connection
                    // keeps serving while a new one is made in the background (before, it was
                    // dropped and the next commands waited for a reconnect; decision 144). An
                    // off-path command that waited its whole deadline (seconds) drops its own:
                    // it may be dead without knowing it, and the request path's replies keep the
                    // probe from ever running for it (decision 141).
                    let used = Some(used.load(Ordering::Relaxed)).filter(|g| *g != 0);
                    if path == Path::OffPath {
                        let mut off_path = self.slot(Path::OffPath).lock().await;
                        if used == Some(off_path.generation) {
                            off_path.conn = None;
                        }
                    } else {
                        self.replace_in_background(path).await;
                    }
                } else {
                    let used = Some(used.load(Ordering::Relaxed)).filter(|g| *g != 0);
                    self.forget_connection(path, used).await;
                    if used.is_some() && e.moves_the_master() && matches!(self.backend.as_ref(), Backend::Sentinel(_)) {
                        // Sentinel: both paths' connections go to the same master, so what a
                        // command sent on one found (a failover's READONLY, the master gone)
                        // holds for the other if it is as old: it points at a replica now, whose
                        // reads may lag, or at nothing. One made since follows Sentinel already.
                        let other = if path == Path::Request { Path::OffPath } else { Path::Request };
                        self.forget_made_before(other, started).await;
                    }
                }
            }
            Err(_) => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "op" => op, "kind" => "other").increment(1);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_of_the_master_itself_moves_both_sentinel_connections() {
        let read_only = redis::RedisError::from((redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly), "READONLY"));
        let broken = redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe"));
        assert!(StoreError::Redis(read_only).moves_the_master());
        assert!(StoreError::Redis(broken).moves_the_master());
        // no command reached the master, or it was only slow: the other path keeps its connection
        assert!(!StoreError::Unreachable("waiting before the next connection attempt".into()).moves_the_master());
        assert!(!StoreError::Timeout(Duration::from_millis(15)).moves_the_master());
        let script = redis::RedisError::from((redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError), "ERR"));
        assert!(!StoreError::Redis(script).moves_the_master());
    }

    #[test]
    fn a_reply_to_any_command_meanwhile_means_redis_answers() {
        let h = Health { base: Instant::now() - Duration::from_secs(1), ..Health::new() };
        let sent = Instant::now();
        assert!(!h.replied_since(sent), "no reply yet: a timeout now would be Redis'");
        h.replied();
        assert!(h.replied_since(sent), "another command's reply came after this one was sent");
        assert!(!h.replied_since(Instant::now() + Duration::from_secs(1)));
    }
}
