//! The PostgreSQL source: the store of record for configuration and API-key records.
//!
//! Migrations (`sidecar/migrations/config/*.sql`, shipped in the binary) are applied on start in
//! one transaction under an advisory lock, so replicas starting together apply each once; the
//! applied versions are rows of `config_schema_version`. PostgreSQL is never on the request
//! path: it is read at start, on change events and by admin writes. One connection, re-made on
//! demand after it breaks (an outage fails admin writes with a clear error; decisions go on).

use super::{ConfigSource, SourceError};
use crate::control::model::{Kind, Plan, PriceEntry, Product, Route, Snapshot, Tenant};
use crate::control::salvage::Unusable;
use crate::apikey::{KeyRecord, KeyStatus};
use crate::keys::{Id, KeyHash};
use crate::scopes::KeyScopes;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};

/// The migrations, in order: (version, SQL).
pub const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../../../migrations/config/0001_init.sql")),
    (2, include_str!("../../../migrations/config/0002_api_keys_plan.sql")),
    (3, include_str!("../../../migrations/config/0003_api_keys_id_order.sql")),
    (4, include_str!("../../../migrations/config/0004_api_keys_recent.sql")),
    (5, include_str!("../../../migrations/config/0005_api_keys_created.sql")),
    (6, include_str!("../../../migrations/config/0006_api_keys_scopes.sql")),
    (7, include_str!("../../../migrations/config/0007_prices.sql")),
];

/// How long one use of the connection (a query, a transaction) may wait for the server: a
/// PostgreSQL that hangs (stopped, a lock held elsewhere) fails admin writes and reloads with a
/// clear error instead of holding them, and the one connection behind its lock, for ever.
pub const QUERY_DEADLINE: Duration = Duration::from_secs(10);

/// Any constant: the advisory lock that serialises migrations across replicas.
const MIGRATION_LOCK: i64 = 0x7011_6a7e;
/// Another: the one every replica's admin writes take (decision 157).
const WRITE_LOCK: i64 = 0x7011_6a7f;

/// The `api_keys` columns [`key_row`] reads, in its order.
macro_rules! key_columns {
    () => {
        "key_id, key_hash, tenant_id, plan_id, status, created_at, expires_at, revoked_at, label, scopes::text, last_used_at"
    };
}

/// The row an admin write stores.
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    /// Insert or replace one object (its normalised document).
    Put(Kind, String, serde_json::Value),
    Delete(Kind, String),
}

pub struct PgSource {
    config: tokio_postgres::Config,
    client: Mutex<Option<Client>>,
    /// The deployment's pricing currency (`usage.pricing.currency`): a stored price in another
    /// is not used (decision 339). `None`: not checked (the offline CLI, which reads no price).
    currency: Option<String>,
}

impl PgSource {
    /// Connects (within `connect_timeout`) and applies pending migrations. An unreachable server
    /// is an error: the sidecar refuses to start without its store of record (docs/operations.md).
    pub async fn connect(url: &str, connect_timeout: Duration) -> Result<PgSource, SourceError> {
        let source = PgSource::open(url, connect_timeout)?;
        source.migrate().await?;
        Ok(source)
    }

    /// The source without connecting nor migrating (the offline CLI: it writes key records into
    /// the schema the sidecars migrated, and never changes the schema itself).
    pub fn open(url: &str, connect_timeout: Duration) -> Result<PgSource, SourceError> {
        let mut config: tokio_postgres::Config =
            url.parse().map_err(|e| SourceError::Unreachable(format!("source.postgres_url: {e}")))?;
        config.connect_timeout(connect_timeout);
        Ok(PgSource { config, client: Mutex::new(None), currency: None })
    }

    /// Prices stored in another currency than `currency` are not used (reported unusable).
    pub fn with_currency(mut self, currency: &str) -> PgSource {
        self.currency = Some(currency.to_string());
        self
    }

    /// The one connection, made if there is none; waiting for it (another use holds it) is
    /// bounded by [`QUERY_DEADLINE`] too.
    async fn client(&self) -> Result<tokio::sync::MutexGuard<'_, Option<Client>>, SourceError> {
        let mut guard = tokio::time::timeout(QUERY_DEADLINE, self.client.lock())
            .await
            .map_err(|_| SourceError::Unreachable(format!("the connection stayed busy for {QUERY_DEADLINE:?}")))?;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            let timeout = self.config.get_connect_timeout().copied().unwrap_or(Duration::from_secs(5));
            let (client, connection) = tokio::time::timeout(timeout, self.config.connect(NoTls))
                .await
                .map_err(|_| SourceError::Unreachable(format!("no connection within {timeout:?}")))?
                .map_err(|e| SourceError::Unreachable(e.to_string()))?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(error = %e, "PostgreSQL connection closed");
                }
            });
            *guard = Some(client);
        }
        Ok(guard)
    }

    /// Runs `f` on the connection within [`QUERY_DEADLINE`] ([`PgSource::with_deadline`]).
    async fn with<T>(&self, f: impl AsyncFnOnce(&mut Client) -> Result<T, tokio_postgres::Error>) -> Result<T, SourceError> {
        self.with_deadline(Some(QUERY_DEADLINE), f).await
    }

    /// Runs `f` on the connection, within `deadline` if any. Forgets a broken connection so the
    /// next call makes a new one — and one whose server did not answer in time: its query is
    /// cancelled (a cancel request on a connection of its own, itself bounded by the deadline;
    /// a stopped server sees it when it resumes), so the server neither runs it on nor keeps
    /// a backend blocked for each retry; what it left open is rolled back.
    async fn with_deadline<T>(
        &self,
        deadline: Option<Duration>,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, SourceError> {
        let mut guard = self.client().await?;
        let Some(client) = guard.as_mut() else { return Err(SourceError::Unreachable("no connection".into())) };
        let result = match deadline {
            Some(d) => match tokio::time::timeout(d, f(client)).await {
                Ok(r) => r,
                Err(_) => {
                    if let Some(c) = guard.take() {
                        let cancel = c.cancel_token();
                        tokio::spawn(async move {
                            let _ = tokio::time::timeout(QUERY_DEADLINE, cancel.cancel_query(NoTls)).await;
                        });
                    }
                    return Err(SourceError::Unreachable(format!("no answer within {d:?}")));
                }
            },
            None => f(client).await,
        };
        if result.is_err() && guard.as_ref().is_some_and(|c| c.is_closed()) {
            *guard = None;
        }
        result.map_err(SourceError::from)
    }

    /// Applies the migrations not yet recorded in `config_schema_version`. Idempotent.
    /// No deadline: a migration may rewrite a large table, and a replica must not give up on one
    /// half-way at every start.
    pub async fn migrate(&self) -> Result<Vec<i32>, SourceError> {
        self.with_deadline(None, async |c| {
            let tx = c.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).await?;
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS config_schema_version (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
            )
            .await?;
            let done: Vec<i32> = tx.query("SELECT version FROM config_schema_version", &[]).await?.iter().map(|r| r.get(0)).collect();
            let mut applied = Vec::new();
            for (version, sql) in MIGRATIONS {
                if !done.contains(version) {
                    tx.batch_execute(sql).await?;
                    tx.execute("INSERT INTO config_schema_version (version) VALUES ($1)", &[version]).await?;
                    applied.push(*version);
                }
            }
            tx.commit().await?;
            Ok(applied)
        })
        .await
    }

    /// An admin write, as one transaction under [`WRITE_LOCK`]: `check` gets the configuration as
    /// stored now — every write a replica committed before is in it, and none can commit until
    /// this one ends — and answers the row to store (stored only then) with its own result, or a
    /// refusal that stores nothing. So two replicas whose copies each lack the other's change
    /// never store a configuration that fails validation (a plan deleted on one while a route
    /// naming it is written on the other): the second write is checked against the first.
    /// `check` gets the rows that could not be read beside the rest (decision 206): it sets them
    /// aside as a load does, so one such row refuses no write — its own DELETE included.
    pub async fn write<T, E>(&self, check: impl FnOnce(Snapshot, Vec<Unusable>) -> Result<(Row, T), E>) -> Result<Result<T, E>, SourceError> {
        self.with(async move |c| {
            let tx = c.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&WRITE_LOCK]).await?;
            let rows = tx.query(&load_sql(), &[]).await?;
            let (stored, unread) = snapshot_of(&rows, self.currency.as_deref());
            let (row, answer) = match check(stored, unread) {
                Ok(r) => r,
                Err(refused) => return Ok(Ok(Err(refused))),
            };
            match &row {
                Row::Put(kind, id, doc) => {
                    let table = kind.name();
                    let sql = format!(
                        "INSERT INTO {table} (id, doc) VALUES ($1, $2::text::jsonb) ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc, updated_at = now()"
                    );
                    tx.execute(&sql, &[id, &doc.to_string()]).await?;
                    if *kind == Kind::Tenants {
                        tx.execute("DELETE FROM subscriptions WHERE tenant_id = $1", &[id]).await?;
                        tx.execute(
                            "INSERT INTO subscriptions (tenant_id, product_id) SELECT $1, jsonb_array_elements_text(doc->'products') FROM tenants WHERE id = $1",
                            &[id],
                        )
                        .await?;
                    }
                }
                Row::Delete(kind, id) => {
                    // A key names its tenant and plan: one of them deleted would leave live keys
                    // with no tenant, or no limits at all (an unknown plan has none, decision 12).
                    if let Some(column) = key_column(*kind) {
                        let held = keys_holding(&tx, column, id).await?;
                        if held > 0 {
                            return Ok(Err(SourceError::InUse(format!(
                                "{} '{id}' is held by {held} active key(s); revoke them first (`tollgate keys list`)",
                                kind.name().trim_end_matches('s')
                            ))));
                        }
                    }
                    tx.execute(&format!("DELETE FROM {} WHERE id = $1", kind.name()), &[id]).await?;
                }
            }
            tx.commit().await?;
            Ok(Ok(Ok(answer)))
        })
        .await?
    }

    /// Stores a new key record, under [`WRITE_LOCK`] and only while its tenant and plan are
    /// stored: a delete of either (on any replica) is then either before this, and the key is
    /// refused, or after it, and refused itself while the key is active. The key's checks in
    /// this replica's copy alone would let the two cross (decision 174).
    pub async fn create_key(&self, hash: &KeyHash, r: &KeyRecord) -> Result<(), SourceError> {
        let to_i = |v: Option<u64>| v.map(|x| x as i64);
        let (created, expires, revoked) = (r.created_at as i64, to_i(r.expires_at), to_i(r.revoked_at));
        let scopes = scopes_text(&r.scopes);
        self.with(async |c| {
            let tx = c.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&WRITE_LOCK]).await?;
            let found = tx
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM tenants WHERE id = $1), EXISTS (SELECT 1 FROM plans WHERE id = $2)",
                    &[&r.tenant.as_str(), &r.plan.as_str()],
                )
                .await?;
            if !found.get::<_, bool>(0) {
                return Ok(Err(SourceError::Missing("tenant", format!("no tenant '{}'", r.tenant))));
            }
            if !found.get::<_, bool>(1) {
                return Ok(Err(SourceError::Missing("plan", format!("no plan '{}'", r.plan))));
            }
            tx.execute(
                "INSERT INTO api_keys (key_id, key_hash, tenant_id, plan_id, status, created_at, expires_at, revoked_at, label, scopes) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::text::jsonb)",
                &[&r.key_id.as_str(), &hash.as_str(), &r.tenant.as_str(), &r.plan.as_str(), &r.status.as_str(), &created, &expires, &revoked, &r.label, &scopes],
            )
            .await?;
            tx.commit().await?;
            Ok(Ok(()))
        })
        .await?
    }

    /// Removes a key record (a key whose creation did not complete: its raw value was never
    /// shown to anyone).
    pub async fn delete_key(&self, key_id: &Id) -> Result<(), SourceError> {
        self.with(async |c| c.execute("DELETE FROM api_keys WHERE key_id = $1", &[&key_id.as_str()]).await.map(|_| ())).await
    }

    /// Marks a key revoked; its hash and updated record, or `None` if there is no such key.
    pub async fn revoke_key(&self, key_id: &Id, now: u64) -> Result<Option<(KeyHash, KeyRecord)>, SourceError> {
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("UPDATE api_keys SET status = 'revoked', revoked_at = COALESCE(revoked_at, $2) WHERE key_id = $1 \
                     RETURNING ", key_columns!()),
                    &[&key_id.as_str(), &(now as i64)],
                )
                .await
            })
            .await?;
        rows.first().map(key_row).transpose()
    }

    /// The record of one key (with its hash), or `None` if there is no such key.
    pub async fn key(&self, key_id: &Id) -> Result<Option<(KeyHash, KeyRecord)>, SourceError> {
        let rows = self
            .with(async |c| c.query(concat!("SELECT ", key_columns!(), " FROM api_keys WHERE key_id = $1"), &[&key_id.as_str()]).await)
            .await?;
        rows.first().map(key_row).transpose()
    }

    /// Sets a key's expiry to `at` unless it expires sooner (a rotation's end of the previous
    /// key); its hash and updated record, or `None` if there is no such key.
    pub async fn shorten_key(&self, key_id: &Id, at: u64) -> Result<Option<(KeyHash, KeyRecord)>, SourceError> {
        let at = i64::try_from(at).unwrap_or(i64::MAX);
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("UPDATE api_keys SET expires_at = LEAST(COALESCE(expires_at, $2), $2) WHERE key_id = $1 RETURNING ", key_columns!()),
                    &[&key_id.as_str(), &at],
                )
                .await
            })
            .await?;
        rows.first().map(key_row).transpose()
    }

    /// Sets a key's label, scopes and expiry (a `PATCH /v1/keys/{id}`; its status untouched);
    /// its hash and updated record, or `None` if there is no such key.
    pub async fn update_key(&self, key_id: &Id, label: Option<&str>, scopes: &KeyScopes, expires_at: Option<u64>) -> Result<Option<(KeyHash, KeyRecord)>, SourceError> {
        let scopes = scopes_text(scopes);
        let expires = expires_at.map(|e| i64::try_from(e).unwrap_or(i64::MAX));
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("UPDATE api_keys SET label = $2, scopes = $3::text::jsonb, expires_at = $4 WHERE key_id = $1 RETURNING ", key_columns!()),
                    &[&key_id.as_str(), &label, &scopes, &expires],
                )
                .await
            })
            .await?;
        rows.first().map(key_row).transpose()
    }

    /// Records when keys were last used (unix seconds), never moving one back: one statement
    /// for a batch (decision 336).
    pub async fn touch_keys(&self, used: &[(Id, u64)]) -> Result<(), SourceError> {
        let ids: Vec<&str> = used.iter().map(|(id, _)| id.as_str()).collect();
        let at: Vec<i64> = used.iter().map(|(_, t)| i64::try_from(*t).unwrap_or(i64::MAX)).collect();
        self.with(async |c| {
            c.execute(
                "UPDATE api_keys SET last_used_at = u.at FROM unnest($1::text[], $2::bigint[]) AS u(id, at) \
                 WHERE api_keys.key_id = u.id AND (api_keys.last_used_at IS NULL OR api_keys.last_used_at < u.at)",
                &[&ids, &at],
            )
            .await
            .map(|_| ())
        })
        .await
    }

    /// Key records (with their hashes), of one tenant or all, by creation time.
    pub async fn keys(&self, tenant: Option<&Id>) -> Result<Vec<(KeyHash, KeyRecord)>, SourceError> {
        let t = tenant.map(|t| t.to_string());
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("SELECT ", key_columns!(), " FROM api_keys \
                     WHERE $1::text IS NULL OR tenant_id = $1 ORDER BY created_at, key_id"),
                    &[&t],
                )
                .await
            })
            .await?;
        rows.iter().map(key_row).collect()
    }

    /// The keys revoked at `since` (Unix seconds) or later, the latest `limit` (decision 197).
    pub async fn keys_revoked_since(&self, since: u64, limit: i64) -> Result<Vec<(KeyHash, KeyRecord)>, SourceError> {
        let since = i64::try_from(since).unwrap_or(i64::MAX);
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("SELECT ", key_columns!(), " FROM api_keys \
                     WHERE revoked_at >= $1 ORDER BY revoked_at DESC LIMIT $2"),
                    &[&since, &limit],
                )
                .await
            })
            .await?;
        rows.iter().map(key_row).collect()
    }

    /// The keys created at `since` (Unix seconds) or later, the latest `limit` (decision 209).
    pub async fn keys_created_since(&self, since: u64, limit: i64) -> Result<Vec<(KeyHash, KeyRecord)>, SourceError> {
        let since = i64::try_from(since).unwrap_or(i64::MAX);
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("SELECT ", key_columns!(), " FROM api_keys \
                     WHERE created_at >= $1 ORDER BY created_at DESC LIMIT $2"),
                    &[&since, &limit],
                )
                .await
            })
            .await?;
        rows.iter().map(key_row).collect()
    }

    /// One page of [`PgSource::keys`] in key-id order (byte order, as the file source's; decision
    /// 184), and whether more follow.
    pub async fn keys_page(&self, tenant: Option<&Id>, page: &crate::apikey::KeyPage) -> Result<(Vec<(KeyHash, KeyRecord)>, bool), SourceError> {
        let t = tenant.map(|t| t.to_string());
        let after = page.after.as_ref().map(|a| a.to_string());
        let limit = i64::try_from(page.limit).unwrap_or(i64::MAX).saturating_add(1);
        let rows = self
            .with(async |c| {
                c.query(
                    concat!("SELECT ", key_columns!(), " FROM api_keys \
                     WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR key_id COLLATE \"C\" > $2) \
                     ORDER BY key_id COLLATE \"C\" LIMIT $3"),
                    &[&t, &after, &limit],
                )
                .await
            })
            .await?;
        let more = rows.len() > page.limit;
        let keys: Result<Vec<_>, _> = rows.iter().take(page.limit).map(key_row).collect();
        Ok((keys?, more))
    }
}

/// The `api_keys` column naming an object of `kind`, for kinds a key names.
fn key_column(kind: Kind) -> Option<&'static str> {
    match kind {
        Kind::Plans => Some("plan_id"),
        Kind::Tenants => Some("tenant_id"),
        Kind::Products | Kind::Routes | Kind::Prices => None,
    }
}

/// How many keys that still authenticate (active, not expired) name `id` in `column`.
async fn keys_holding(tx: &tokio_postgres::Transaction<'_>, column: &str, id: &str) -> Result<i64, tokio_postgres::Error> {
    let now = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)) as i64;
    let sql = format!("SELECT count(*) FROM api_keys WHERE {column} = $1 AND status = 'active' AND (expires_at IS NULL OR expires_at > $2)");
    Ok(tx.query_one(&sql, &[&id, &now]).await?.get(0))
}

/// A key's scopes as stored: `NULL` when they restrict nothing.
fn scopes_text(s: &KeyScopes) -> Option<String> {
    (!s.is_empty()).then(|| s.to_json().to_string())
}

fn key_row(row: &tokio_postgres::Row) -> Result<(KeyHash, KeyRecord), SourceError> {
    let bad = |f: &str| SourceError::Corrupt(format!("api_keys.{f}"));
    let id = |i: usize, f: &str| Id::parse(row.get::<_, &str>(i)).ok_or_else(|| bad(f));
    let hash = KeyHash::parse(row.get::<_, &str>(1)).ok_or_else(|| bad("key_hash"))?;
    let status = match row.get::<_, &str>(4) {
        "active" => KeyStatus::Active,
        "revoked" => KeyStatus::Revoked,
        _ => return Err(bad("status")),
    };
    let opt = |i: usize| row.get::<_, Option<i64>>(i).map(|v| v.max(0) as u64);
    Ok((
        hash,
        KeyRecord {
            key_id: id(0, "key_id")?,
            tenant: id(2, "tenant_id")?,
            plan: id(3, "plan_id")?,
            status,
            created_at: row.get::<_, i64>(5).max(0) as u64,
            expires_at: opt(6),
            revoked_at: opt(7),
            label: row.get::<_, Option<String>>(8),
            scopes: match row.get::<_, Option<&str>>(9) {
                None => KeyScopes::default(),
                Some(text) => serde_json::from_str(text).ok().and_then(|v| KeyScopes::from_json(&v).ok()).ok_or_else(|| bad("scopes"))?,
            },
            last_used_at: opt(10),
        },
    ))
}

/// One statement over the four tables: one snapshot of them all. Four queries could see a change
/// made of two writes half done (a tenant still naming a product deleted since), refuse the whole
/// configuration, and so refuse a start. Rows: (table's index in [`Kind::ALL`], id, document).
fn load_sql() -> String {
    Kind::ALL
        .iter()
        .enumerate()
        .map(|(i, kind)| format!("SELECT {i}::int AS kind, id, doc::text FROM {}", kind.name()))
        .collect::<Vec<_>>()
        .join(" UNION ALL ")
        + " ORDER BY kind, id"
}

/// The configuration the rows of [`load_sql`] hold, not yet validated, and the rows that could
/// not be read (decision 206): a document that does not parse (a field a newer sidecar wrote, a
/// hand edit) or whose `id` differs from its key column (decision 208: the admin API would show
/// one id and the configuration use another) is set aside alone, never failing the rest.
fn snapshot_of(rows: &[tokio_postgres::Row], currency: Option<&str>) -> (Snapshot, Vec<Unusable>) {
    let mut s = Snapshot::default();
    let mut unread = Vec::new();
    for r in rows {
        let Some(kind) = usize::try_from(r.get::<_, i32>(0)).ok().and_then(|i| Kind::ALL.get(i).copied()) else { continue };
        let (id, doc) = (r.get::<_, String>(1), r.get::<_, String>(2));
        if let Err(reason) = read_row(&mut s, kind, &id, &doc, currency) {
            unread.push(Unusable::new(kind, id, reason));
        }
    }
    (s, unread)
}

/// Puts one stored document into `s`, or says why it cannot be read (a price in another currency
/// than `currency`, when given, among the reasons).
fn read_row(s: &mut Snapshot, kind: Kind, id: &str, doc: &str, currency: Option<&str>) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_str(doc).map_err(|e| format!("not JSON: {e}"))?;
    match v.get("id").and_then(serde_json::Value::as_str) {
        Some(own) if own != id => return Err(format!("its document's id '{}' differs from its key column", own.escape_debug())),
        _ => {}
    }
    let read = match kind {
        Kind::Tenants => serde_json::from_value::<Tenant>(v).map(|t| drop(s.tenants.insert(id.to_string(), t))),
        Kind::Products => serde_json::from_value::<Product>(v).map(|p| drop(s.products.insert(id.to_string(), p))),
        Kind::Plans => serde_json::from_value::<Plan>(v).map(|p| drop(s.plans.insert(id.to_string(), p.config()))),
        Kind::Routes => serde_json::from_value::<Route>(v).map(|r| drop(s.routes.insert(id.to_string(), r))),
        Kind::Prices => {
            let p = serde_json::from_value::<PriceEntry>(v).map_err(|e| e.to_string())?;
            match (p.currency.as_deref(), currency) {
                (Some(theirs), Some(ours)) if theirs != ours => {
                    return Err(format!("priced in {}; this deployment prices in {ours} (usage.pricing.currency)", theirs.escape_debug()))
                }
                _ => {
                    s.prices.insert(id.to_string(), p);
                    Ok(())
                }
            }
        }
    };
    read.map_err(|e| e.to_string())
}

impl ConfigSource for PgSource {
    async fn load(&self) -> Result<(Snapshot, Vec<Unusable>), SourceError> {
        let rows = self.with(async |c| c.query(&load_sql(), &[]).await).await?;
        Ok(snapshot_of(&rows, self.currency.as_deref()))
    }
}
