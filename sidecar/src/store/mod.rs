//! The Redis side: one multiplexed connection (redis-rs `ConnectionManager`) with a deadline on
//! every command, fail-fast while Redis is unreachable, and the API-key store operations.
//!
//! Failure policy: a command that errors or misses its deadline returns [`StoreError`] at once,
//! with `is_transient()` telling callers whether retrying (or serving stale) makes sense. While
//! Redis is down, reconnects are attempted at most once per `reconnect_interval`; requests in
//! between fail immediately instead of piling up. "Down" and "back" are logged once, on the
//! transition, never per request.

use crate::apikey::{KeyRecord, KeyStatus};
use serde::{Deserialize, Serialize};
use crate::keys::{
    ApiKeyIdKey, ApiKeyIndexKey, ApiKeyRecordKey, AuthFailKey, ConcurrencyKey, Id, KeyHash, ReservationKey, TokenBudgetKey,
    API_KEY_ID_PATTERN, AUTH_FAIL_TTL_SECS, RESERVATION_TTL_MS, TOKEN_BUDGET_TTL_MS,
};
use std::sync::LazyLock;

/// `sidecar/lua/decide.lua`: every limit of a request, check-all-then-take-all.
static DECIDE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/decide.lua")));
/// `sidecar/lua/complete.lua`: settle a reservation, free a slot.
static COMPLETE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/complete.lua")));

/// `sidecar/lua/idem_complete.lua`: store or release an idempotency claim (issue 7).
static IDEM_COMPLETE_SCRIPT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../lua/idem_complete.lua")));

/// One `complete.lua` call.
#[derive(Debug, Clone)]
pub struct CompleteCall {
    pub budget: Option<(TokenBudgetKey, ReservationKey)>,
    pub slot: Option<ConcurrencyKey>,
    pub actual: u64,
    pub estimate: u64,
    pub request_id: String,
}
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
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
    last_attempt: Option<Instant>,
}

/// How to reach Redis.
enum Backend {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
    Sentinel(Mutex<redis::sentinel::SentinelClient>),
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

/// A shared handle on Redis. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    backend: Arc<Backend>,
    config: RedisConfig,
    state: Arc<Mutex<ConnState>>,
    up: Arc<AtomicBool>,
}

impl Store {
    /// Does not connect: the first command does (so the sidecar starts while Redis is down).
    pub fn new(config: &RedisConfig) -> Result<Store, StoreError> {
        let backend = match config.mode {
            RedisMode::Single => Backend::Single(redis::Client::open(config.url.as_str())?),
            RedisMode::Cluster => Backend::Cluster(
                redis::cluster::ClusterClientBuilder::new(config.nodes.clone())
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.timeout.max(Duration::from_millis(1)))
                    .build()?,
            ),
            RedisMode::Sentinel => Backend::Sentinel(Mutex::new(redis::sentinel::SentinelClient::build(
                config.nodes.clone(),
                config.master_name.clone(),
                None,
                redis::sentinel::SentinelServerType::Master,
            )?)),
        };
        Ok(Store {
            backend: Arc::new(backend),
            config: config.clone(),
            state: Arc::new(Mutex::new(ConnState { conn: None, last_attempt: None })),
            up: Arc::new(AtomicBool::new(true)),
        })
    }

    async fn connect(&self) -> redis::RedisResult<Conn> {
        match self.backend.as_ref() {
            Backend::Single(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.config.connect_timeout))
                    .set_response_timeout(Some(self.config.timeout.max(Duration::from_millis(1))))
                    .set_number_of_retries(1)
                    .set_max_delay(self.config.reconnect_interval);
                Ok(Conn::Single(ConnectionManager::new_with_config(client.clone(), cfg).await?))
            }
            Backend::Cluster(client) => Ok(Conn::Cluster(client.get_async_connection().await?)),
            Backend::Sentinel(client) => Ok(Conn::Sentinel(client.lock().await.get_async_connection().await?)),
        }
    }

    /// Drops a cluster/sentinel connection after a connection error, so the next command makes a
    /// new one (single mode's ConnectionManager reconnects by itself).
    async fn forget_connection(&self) {
        if !matches!(self.backend.as_ref(), Backend::Single(_)) {
            self.state.lock().await.conn = None;
        }
    }

    /// Whether the last command reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    async fn connection(&self) -> Result<Conn, StoreError> {
        let mut state = self.state.lock().await;
        if let Some(c) = &state.conn {
            return Ok(c.clone());
        }
        if let Some(at) = state.last_attempt {
            if at.elapsed() < self.config.reconnect_interval {
                return Err(StoreError::Unreachable("waiting before the next connection attempt".into()));
            }
        }
        state.last_attempt = Some(Instant::now());
        let attempt = tokio::time::timeout(self.config.connect_timeout, self.connect()).await;
        match attempt {
            Ok(Ok(conn)) => {
                state.conn = Some(conn.clone());
                Ok(conn)
            }
            Ok(Err(e)) => {
                self.mark(false, &e.to_string());
                Err(StoreError::Unreachable(e.to_string()))
            }
            Err(_) => {
                self.mark(false, "connect timed out");
                Err(StoreError::Timeout(self.config.connect_timeout))
            }
        }
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

    pub(crate) async fn run_with_deadline<T, F, Fut>(&self, op: &'static str, deadline: Duration, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let started = Instant::now();
        let result = match self.connection().await {
            Ok(conn) => match tokio::time::timeout(deadline, f(conn)).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(StoreError::Redis(e)),
                Err(_) => Err(StoreError::Timeout(deadline)),
            },
            Err(e) => Err(e),
        };
        metrics::histogram!(crate::metrics::REDIS_SECONDS, "op" => op).record(started.elapsed().as_secs_f64());
        match &result {
            Ok(_) => self.mark(true, ""),
            Err(e) if e.is_transient() || e.is_read_only() => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "op" => op, "kind" => "transient").increment(1);
                self.mark(false, &e.to_string());
                self.forget_connection().await;
            }
            Err(_) => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "op" => op, "kind" => "other").increment(1);
            }
        }
        result
    }

    /// The record of a key hash, or `None` when there is none.
    pub async fn lookup(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, StoreError> {
        let key = ApiKeyRecordKey::new(hash);
        let map: HashMap<String, String> = self.run("hgetall", |mut c| async move { c.hgetall(key).await }).await?;
        KeyRecord::from_fields(&map).map_err(StoreError::Malformed)
    }

    /// `SET apikey:authfail:{keyId} 1 EX 3600 NX`: true when this caller should write the audit
    /// line (the first failure of the hour for this key).
    pub async fn claim_auth_failure_audit(&self, key_id: &Id) -> Result<bool, StoreError> {
        let key = AuthFailKey::new(key_id);
        let opts = redis::SetOptions::default()
            .conditional_set(redis::ExistenceCheck::NX)
            .with_expiration(redis::SetExpiry::EX(AUTH_FAIL_TTL_SECS));
        let set: Option<String> = self.run("set_authfail", |mut c| async move { c.set_options(key, 1, opts).await }).await?;
        Ok(set.is_some())
    }

    /// Runs `decide.lua` for all of a request's limits and its response lookup: one round trip.
    /// The raw reply: numbers, then (with a lookup) an outcome and a value
    /// (crate::decision::responses::split_reply).
    pub async fn run_decide(&self, inv: &crate::decision::limits::Invocation) -> Result<Vec<redis::Value>, StoreError> {
        let keys = inv.keys.clone();
        let args = inv.args.clone();
        self.run("decide_lua", |mut c| async move {
            let mut call = DECIDE_SCRIPT.prepare_invoke();
            for k in &keys {
                call.key(k);
            }
            for a in &args {
                call.arg(a);
            }
            call.invoke_async(&mut c).await
        })
        .await
    }

    /// Runs `complete.lua` for one budget reservation and/or one concurrency slot.
    pub async fn run_complete(&self, call: CompleteCall) -> Result<(i64, i64), StoreError> {
        self.run_with_deadline("complete_lua", Self::BATCH_DEADLINE, |mut c| async move {
            let mut inv = COMPLETE_SCRIPT.prepare_invoke();
            if let Some((counter, reservation)) = &call.budget {
                inv.key(counter.as_str()).key(reservation.as_str());
            }
            if let Some(slot) = &call.slot {
                inv.key(slot.as_str());
            }
            inv.arg(call.actual)
                .arg(call.estimate)
                .arg(&call.request_id)
                .arg(TOKEN_BUDGET_TTL_MS)
                .arg(if call.budget.is_some() { "1" } else { "0" })
                .arg(if call.slot.is_some() { "1" } else { "0" })
                .arg(RESERVATION_TTL_MS);
            let (delta, found): (i64, i64) = inv.invoke_async(&mut c).await?;
            Ok((delta, found))
        })
        .await
    }

    const BATCH_DEADLINE: Duration = Duration::from_secs(2);

    /// `SET cache:exact:… <json> PX <ttl>`: one cached response (off the request path).
    pub async fn set_response(&self, key: &crate::keys::ResponseCacheKey, json: String, ttl_ms: u64) -> Result<(), StoreError> {
        let key = key.clone();
        let opts = redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(ttl_ms.max(1)));
        self.run_with_deadline("set_response", Self::BATCH_DEADLINE, |mut c| async move {
            c.set_options::<_, _, ()>(key, json, opts).await
        })
        .await
    }

    /// Runs `idem_complete.lua`: stores `json` (the 2xx outcome, 24 h) or, with `None`, releases
    /// the claim. `false` when the claim is no longer `token`'s (nothing changed).
    pub async fn run_idem_complete(
        &self,
        owner: &crate::keys::IdempotencyOwnerKey,
        memo: &crate::keys::IdempotencyMemoKey,
        token: &str,
        digest: &crate::keys::RequestDigest,
        json: Option<String>,
    ) -> Result<bool, StoreError> {
        let (owner, memo, token, digest) = (owner.clone(), memo.clone(), token.to_string(), digest.as_str().to_string());
        self.run_with_deadline("idem_complete_lua", Self::BATCH_DEADLINE, |mut c| async move {
            let mut inv = IDEM_COMPLETE_SCRIPT.prepare_invoke();
            inv.key(owner.as_str()).key(memo.as_str()).arg(token).arg(digest);
            match json {
                Some(j) => inv.arg("store").arg(j),
                None => inv.arg("release").arg(""),
            };
            inv.arg(crate::keys::IDEMPOTENCY_TTL_MS);
            let done: i64 = inv.invoke_async(&mut c).await?;
            Ok(done == 1)
        })
        .await
    }

    // ---- admin path (generous deadlines: a person or a script is waiting, not a request) ----

    const ADMIN_DEADLINE: Duration = Duration::from_secs(5);

    /// Stores a new key: the record, its id mapping and the tenant index — in one MULTI where a
    /// single node holds all three keys. On Cluster they live in different slots, so the writes
    /// go one by one in dependency order (record first: the id and the index only ever point at a
    /// record that exists).
    pub async fn create_key(&self, hash: &KeyHash, record: &KeyRecord) -> Result<(), StoreError> {
        let rec_key = ApiKeyRecordKey::new(hash);
        let id_key = ApiKeyIdKey::new(&record.key_id);
        let idx_key = ApiKeyIndexKey::new(&record.tenant);
        let fields = record.to_fields();
        let hash_s = hash.as_str().to_string();
        let key_id = record.key_id.to_string();
        if matches!(self.backend.as_ref(), Backend::Cluster(_)) {
            self.run_with_deadline("create_key", Self::ADMIN_DEADLINE, |mut c| async move {
                c.hset_multiple::<_, _, _, ()>(rec_key, &fields).await?;
                c.set::<_, _, ()>(id_key, hash_s).await?;
                c.sadd::<_, _, ()>(idx_key, key_id).await
            })
            .await
        } else {
            self.run_with_deadline("create_key", Self::ADMIN_DEADLINE, |mut c| async move {
                redis::pipe()
                    .atomic()
                    .hset_multiple(rec_key, &fields)
                    .ignore()
                    .set(id_key, hash_s)
                    .ignore()
                    .sadd(idx_key, key_id)
                    .ignore()
                    .query_async::<()>(&mut c)
                    .await
            })
            .await
        }
    }

    /// Marks a key revoked. Returns the updated record.
    pub async fn revoke_key(&self, key_id: &Id, now: u64) -> Result<KeyRecord, StoreError> {
        let hash = self.hash_of(key_id).await?;
        let rec_key = ApiKeyRecordKey::new(&hash);
        self.run_with_deadline("revoke_key", Self::ADMIN_DEADLINE, |mut c| async move {
            c.hset_multiple::<_, _, _, ()>(
                rec_key,
                &[("status", KeyStatus::Revoked.as_str().to_string()), ("revoked_at", now.to_string())],
            )
            .await
        })
        .await?;
        self.lookup_admin(&hash).await?.ok_or_else(|| StoreError::NotFound(key_id.to_string()))
    }

    async fn hash_of(&self, key_id: &Id) -> Result<KeyHash, StoreError> {
        let id_key = ApiKeyIdKey::new(key_id);
        let h: Option<String> = self.run_with_deadline("get_key_id", Self::ADMIN_DEADLINE, |mut c| async move { c.get(id_key).await }).await?;
        let h = h.ok_or_else(|| StoreError::NotFound(format!("no key with id {key_id}")))?;
        KeyHash::parse(&h).ok_or_else(|| StoreError::Malformed(format!("apikey-id:{key_id} holds no key hash")))
    }

    async fn lookup_admin(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, StoreError> {
        let key = ApiKeyRecordKey::new(hash);
        let map: HashMap<String, String> =
            self.run_with_deadline("hgetall", Self::ADMIN_DEADLINE, |mut c| async move { c.hgetall(key).await }).await?;
        KeyRecord::from_fields(&map).map_err(StoreError::Malformed)
    }

    /// The records of one tenant's keys, or of every key, sorted by creation time.
    pub async fn list_keys(&self, tenant: Option<&Id>) -> Result<Vec<KeyRecord>, StoreError> {
        let ids: Vec<Id> = match tenant {
            Some(t) => {
                let idx = ApiKeyIndexKey::new(t);
                let members: Vec<String> =
                    self.run_with_deadline("smembers", Self::ADMIN_DEADLINE, |mut c| async move { c.smembers(idx).await }).await?;
                members.iter().filter_map(|m| Id::parse(m)).collect()
            }
            None => {
                let names: Vec<String> = self
                    .run_with_deadline("scan", Self::ADMIN_DEADLINE, |mut c| async move {
                        let mut it = c.scan_match::<_, String>(API_KEY_ID_PATTERN).await?;
                        let mut out = Vec::new();
                        while let Some(n) = futures_next(&mut it).await {
                            out.push(n);
                        }
                        Ok(out)
                    })
                    .await?;
                names.iter().filter_map(|n| ApiKeyIdKey::key_id_of(n)).collect()
            }
        };
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let hash = self.hash_of(&id).await?;
            if let Some(r) = self.lookup_admin(&hash).await? {
                out.push(r);
            }
        }
        out.sort_by(|a, b| (a.created_at, &a.key_id).cmp(&(b.created_at, &b.key_id)));
        Ok(out)
    }
}

async fn futures_next<T: redis::FromRedisValue + Unpin + Send>(it: &mut redis::AsyncIter<'_, T>) -> Option<T> {
    loop {
        match it.next_item().await {
            Some(Ok(v)) => return Some(v),
            Some(Err(_)) => continue,
            None => return None,
        }
    }
}
