//! The configuration plane: tenants, products, plans and routes — their model and validation
//! ([`model`]), where they come from (the TOML file or PostgreSQL, [`source`]), the routing table
//! built from them ([`routes`]), the admin HTTP API that changes them ([`admin`]), and how a
//! change reaches every replica ([`propagation`]). [`Control`] is what the admin API and the
//! subscriber share. Nothing here is on the request path: the decision path only sees what
//! [`Control::install`] hands it (plans and routing) and the key records in Redis.

pub mod admin;
pub mod admin_alerts;
pub mod admin_http;
pub mod admin_invoices;
pub mod admin_keys;
pub mod keys;
pub mod last_used;
pub mod model;
pub mod prices;
#[cfg(test)]
mod prices_tests;
pub mod propagation;
pub mod routes;
pub mod salvage;
pub mod source;

use crate::decision::limits::Plans;
use crate::decision::{Decider, Routing};
use crate::keys::{ConfigChangedChannel, Id, RoutingVersionKey};
use crate::scripts::{copy_key, ScriptError};
use crate::store::{Store, StoreError};
use model::Snapshot;
use salvage::Unusable;
use redis::AsyncCommands;
use source::postgres::PgSource;
use source::{ConfigSource, FileSource, SourceError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Either source, chosen by `[source] kind`. One per process: the size difference is moot.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    File(FileSource),
    Postgres(PgSource),
}

impl ConfigSource for Source {
    async fn load(&self) -> Result<(Snapshot, Vec<Unusable>), SourceError> {
        match self {
            Source::File(f) => f.load().await,
            Source::Postgres(p) => p.load().await,
        }
    }
}

/// Why API-key records could not be copied into Redis.
#[derive(Debug, thiserror::Error)]
pub enum RewarmError {
    #[error("reading the store of record: {0}")]
    Source(#[from] SourceError),
    #[error("writing Redis: {0}")]
    Store(#[from] ScriptError),
}

/// How far back each resync re-copies revocations and new keys into Redis (decisions 197, 209):
/// well past how long a write can wait to reach a replica before a failover promotes it.
pub const RECENT_REVOCATIONS: Duration = Duration::from_secs(600);
/// At most this many of each per resync (the latest): a mass revocation or a bulk creation is
/// bounded work.
pub const MAX_RECENT_REVOCATIONS: i64 = 1_000;

/// What the admin API and the subscriber share: the source, the configuration in force, Redis.
pub struct Control {
    pub source: Source,
    pub live: Live,
    pub store: Store,
    /// The decision path, whose plans and routing an install replaces.
    pub decider: Arc<Decider>,
    /// Whether the last reload failed (log the transition once, not every retry).
    reload_failing: AtomicBool,
    /// Held across load-and-install (reloads) and validate-commit-install (admin writes), so a
    /// reload that read the store before a local write committed cannot install over it.
    pub installing: tokio::sync::Mutex<()>,
    /// The keys whose revocation is being completed in the background ([`Control::complete_revocation`]).
    completing: std::sync::Mutex<std::collections::HashSet<Id>>,
    /// An announcement Redis did not take is being made again ([`Control::announce_later`]).
    announcing: AtomicBool,
    /// The deployment's pricing currency and the file's prices, which the stored ones are merged
    /// with into the table in force (decision 337).
    pub pricing: FilePricing,
    /// The billing consumer's PostgreSQL (`admin.billing_url`, else `console.usage_url`), for
    /// `GET /v1/invoices`; `None`: not configured.
    pub billing_url: Option<String>,
}

/// `[usage.pricing]` of the file, checked: what the stored prices are merged with.
#[derive(Debug, Clone)]
pub struct FilePricing {
    /// `usage.pricing.currency`: every price is in it.
    pub currency: String,
    pub entries: Vec<crate::usage::pricing::Entry>,
}

impl Default for FilePricing {
    fn default() -> Self {
        FilePricing { currency: crate::usage::pricing::PricingConfig::default().currency, entries: Vec::new() }
    }
}

impl Control {
    pub fn new(source: Source, snapshot: Snapshot, store: Store, decider: Arc<Decider>) -> Control {
        Control {
            source,
            live: Live::new(snapshot),
            store,
            decider,
            reload_failing: AtomicBool::new(false),
            installing: tokio::sync::Mutex::new(()),
            completing: Default::default(),
            announcing: AtomicBool::new(false),
            pricing: FilePricing::default(),
            billing_url: None,
        }
    }

    /// Merges the stored prices with `[usage.pricing]` of the file (checked).
    pub fn with_pricing(mut self, config: &crate::usage::pricing::PricingConfig) -> Result<Control, crate::invalid::Invalid> {
        self.pricing = FilePricing { currency: config.currency.clone(), entries: crate::usage::pricing::file_entries(config)? };
        Ok(self)
    }

    /// Reads invoices from the billing consumer's PostgreSQL at `url`.
    pub fn with_billing(mut self, url: Option<String>) -> Control {
        self.billing_url = url.filter(|u| !u.is_empty());
        self
    }

    /// The prices in force: the file's merged with `snapshot`'s (crate::usage::pricing::merge).
    pub fn prices_of(&self, snapshot: &Snapshot) -> Vec<crate::usage::pricing::Entry> {
        crate::usage::pricing::merge(self.pricing.entries.clone(), snapshot.price_entries())
    }

    /// Puts `snapshot` (validated) in force: routes and products for the admin view, plans for
    /// decisions, prices for usage intake and money budgets.
    pub fn install(&self, snapshot: Snapshot) {
        if let Some(table) = self.decider.price_table() {
            table.set(crate::usage::pricing::Pricing::of(&self.prices_of(&snapshot)));
        }
        match Plans::compile(&snapshot.plans) {
            Ok(plans) => {
                // one swap: no decision sees a route of one configuration with the plans of
                // another (decision 208)
                self.decider.set_config(plans, Routing::of(&snapshot, self.live.version()));
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
            Ok((read, unread)) => {
                // a row this sidecar cannot use keeps its last good version, or is left out: it
                // fails no reload (decision 206)
                let (s, unusable) = salvage::salvage(read, unread, &self.live.get());
                self.live.set_version(version);
                self.install(s);
                self.report(unusable);
                self.decider.evict(tenant);
                if self.reload_failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(version, "configuration reloads work again");
                }
                Ok(())
            }
            Err(e) => {
                // Keys are still revoked in Redis by the writer: forget cached answers anyway.
                self.decider.evict(tenant);
                if !self.reload_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "cannot reload the configuration; keeping the one in force");
                }
                Err(e)
            }
        }
    }

    /// Records the stored objects not in force as stored (decision 206): shown by `GET
    /// /v1/version` and `tollgate version`, counted by a gauge, and logged when the set changes
    /// (not at every reload).
    pub fn report(&self, unusable: Vec<Unusable>) {
        metrics::gauge!(crate::metrics::CONFIG_UNUSABLE).set(unusable.len() as f64);
        let mut held = self.live.unusable.write().unwrap_or_else(|p| p.into_inner());
        if *held == unusable {
            return;
        }
        for u in unusable.iter().filter(|u| !held.contains(u)) {
            let in_force = if u.kept { "its last good version stays in force" } else { "left out" };
            tracing::warn!(kind = u.kind.name(), id = %u.id, reason = %u.reason, "a stored configuration object cannot be used as stored: {in_force}");
        }
        if unusable.is_empty() {
            tracing::info!("every stored configuration object is in force as stored again");
        }
        *held = unusable;
    }

    /// After a committed write: bump the generation and tell every replica. Returns the version.
    ///
    /// The writer forgets its own cached answers for `tenant` first, at once (decision 212): it
    /// marks the version it wrote as loaded, so when its own message is lost — its subscription
    /// dropped or replaced just then — no resync of its would find anything moved, and its
    /// filters kept a revoked key's cached allow for as long as it was cached.
    pub async fn announce(&self, tenant: Option<&Id>) -> Result<u64, StoreError> {
        self.decider.evict(tenant);
        announce(&self.store, tenant).await
    }

    /// Announces a committed change ([`Control::announce`]) and marks its version loaded here;
    /// `None` when Redis did not take the announcement: it is then made again in the background
    /// until Redis does (decision 198).
    pub async fn publish(self: &Arc<Self>, tenant: Option<&Id>) -> Option<u64> {
        match self.announce(tenant).await {
            Ok(v) => {
                self.live.advance_version(v);
                Some(v)
            }
            Err(e) => {
                // the version did not move: no replica's resync would see it
                tracing::warn!(error = %e, "a committed change could not be announced; announcing it again until Redis takes it");
                self.announce_later();
                None
            }
        }
    }

    /// A committed change whose announcement Redis did not take (out of memory, restarting):
    /// every replica still has to learn of it, and the version it compares did not move. So it
    /// is announced again in the background — for every tenant, `_all`, whichever changes wait —
    /// until Redis takes it (decision 198); one task however many changes wait. The process's
    /// end stops it (a restarted replica loads the store of record anyway).
    pub fn announce_later(self: &Arc<Self>) {
        if self.announcing.swap(true, Ordering::AcqRel) {
            return;
        }
        let control = self.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(100);
            loop {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
                match control.announce(None).await {
                    Ok(v) => {
                        control.live.advance_version(v);
                        tracing::info!(version = v, "a change Redis could not announce is now announced");
                        break;
                    }
                    Err(e) => tracing::debug!(error = %e, "a change still waits to be announced"),
                }
            }
            control.announcing.store(false, Ordering::Release);
        });
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

    /// Copies every key record from PostgreSQL into Redis (a wiped Redis loses no key), never
    /// undoing a revocation made since the records were read (`scripts::copy_key`). Returns how
    /// many; a no-op for the file source (Redis is the keys' store there).
    pub async fn rewarm_keys(&self) -> Result<usize, RewarmError> {
        let Source::Postgres(pg) = &self.source else { return Ok(0) };
        let keys = pg.keys(None).await?;
        for (hash, record) in &keys {
            copy_key::run(&self.store, hash, record).await?;
        }
        Ok(keys.len())
    }

    /// Re-copies into Redis the revocations of the last [`RECENT_REVOCATIONS`] (at most
    /// [`MAX_RECENT_REVOCATIONS`], the latest), and the keys created in that time (as many, the
    /// latest): a revocation or a new key Redis acknowledged and then lost — a failover to a
    /// replica that had not received it, a restart without persistence — is in force again, and
    /// the tenants whose records it restored are announced (their cached answers, an "unknown
    /// key" among them, evicted everywhere). Every resync runs it (decisions 197 and 209); a
    /// no-op for the file source (Redis is the keys' store there). Returns how many records it
    /// restored.
    pub async fn restore_recent_keys(&self) -> Result<usize, RewarmError> {
        let Source::Postgres(pg) = &self.source else { return Ok(0) };
        let since = crate::decision::unix_now().saturating_sub(RECENT_REVOCATIONS.as_secs());
        // revocations last: a key created and revoked within the window is copied revoked
        let created = pg.keys_created_since(since, MAX_RECENT_REVOCATIONS).await?;
        let revoked = pg.keys_revoked_since(since, MAX_RECENT_REVOCATIONS).await?;
        let mut restored = std::collections::BTreeMap::<Id, (usize, usize)>::new();
        for (i, (hash, record)) in created.iter().chain(&revoked).enumerate() {
            if copy_key::run(&self.store, hash, record).await? == copy_key::Copied::Restored {
                let n = restored.entry(record.tenant.clone()).or_default();
                if i < created.len() && record.status == crate::apikey::KeyStatus::Active {
                    n.0 += 1;
                } else {
                    n.1 += 1;
                }
            }
        }
        for (tenant, (keys, revocations)) in &restored {
            tracing::warn!(%tenant, keys, revocations, "Redis had lost key records PostgreSQL holds (a failover, a restart): restored");
            if let Err(e) = self.announce(Some(tenant)).await {
                tracing::warn!(%tenant, error = %e, "restored key records could not be announced: cached answers end within their TTL");
            }
        }
        Ok(restored.values().map(|(k, r)| k + r).sum())
    }

    /// A revocation the admin API could not finish (PostgreSQL or Redis did not take it): done
    /// again in the background — PostgreSQL, then Redis, then announced — until both take it
    /// (revoking is idempotent: `revoked_at` keeps its first value). One task per key however
    /// often it is asked again; an error retrying cannot mend (a corrupt row, a script answering
    /// against its contract) ends it with an error line. The process's end stops it: a revocation
    /// PostgreSQL took is copied to Redis by every sidecar's start anyway.
    pub fn complete_revocation(self: &Arc<Self>, key_id: Id, now: u64) {
        let Source::Postgres(_) = &self.source else { return };
        if !self.completing.lock().unwrap_or_else(|p| p.into_inner()).insert(key_id.clone()) {
            return; // already being completed
        }
        let control = self.clone();
        tokio::spawn(async move {
            control.finish_revocation(&key_id, now).await;
            control.completing.lock().unwrap_or_else(|p| p.into_inner()).remove(&key_id);
        });
    }

    async fn finish_revocation(&self, key_id: &Id, now: u64) {
        let Source::Postgres(pg) = &self.source else { return };
        let mut pause = Duration::from_millis(100);
        let record = loop {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
            let (hash, record) = match pg.revoke_key(key_id, now).await {
                Ok(Some(r)) => r,
                // a key PostgreSQL lacks lives in Redis alone (an older `keys create`): revoked
                // there, as the admin API does when PostgreSQL answers (decision 199)
                Ok(None) => match self.store.revoke_key(key_id, now).await {
                    Ok(r) => break r,
                    Err(StoreError::NotFound(_)) => return tracing::warn!(%key_id, "a revocation to complete names no key in PostgreSQL or Redis"),
                    Err(e) => {
                        tracing::warn!(%key_id, error = %e, "a revocation of a key PostgreSQL lacks still waits for Redis; retrying");
                        continue;
                    }
                },
                Err(e @ (SourceError::Corrupt(_) | SourceError::Invalid(_))) => {
                    return tracing::error!(%key_id, error = %e, "a revocation cannot be completed: its PostgreSQL row is unreadable");
                }
                Err(e) => {
                    tracing::warn!(%key_id, error = %e, "a revocation still waits for PostgreSQL; retrying");
                    continue;
                }
            };
            match copy_key::run(&self.store, &hash, &record).await {
                Ok(_) => break record,
                Err(e @ ScriptError::Reply(_)) => return tracing::error!(%key_id, error = %e, "a revocation cannot be copied to Redis"),
                Err(e) => tracing::warn!(%key_id, error = %e, "a revocation still waits for Redis; retrying"),
            }
        };
        match self.announce(Some(&record.tenant)).await {
            Ok(_) => tracing::info!(%key_id, "a revocation the admin API could not finish is now in force"),
            // written: every replica's key cache ends within its TTL without the message
            Err(e) => tracing::warn!(%key_id, error = %e, "a revocation is in force but could not be announced"),
        }
    }
}

/// Bumps `cfg:routing:version` and publishes it on `config_changed:{tenant}` (`None`: `_all`):
/// every replica's subscriber reloads and evicts that tenant's cached key answers (and its
/// filters then drop theirs). Returns the version. Also used by `tollgate-sidecar keys revoke`,
/// which writes Redis directly.
pub async fn announce(store: &Store, tenant: Option<&Id>) -> Result<u64, StoreError> {
    let channel = tenant.map_or_else(ConfigChangedChannel::all, ConfigChangedChannel::tenant);
    store
        .run_with_deadline("announce_change", Duration::from_secs(5), |mut c| async move {
            let v: u64 = c.incr(RoutingVersionKey::new(), 1u64).await?;
            c.publish::<_, _, ()>(channel, v).await?;
            Ok(v)
        })
        .await
}

/// The configuration in force in this process, and the generation it was loaded at.
pub struct Live {
    snapshot: RwLock<Arc<Snapshot>>,
    version: AtomicU64,
    /// The stored objects not in force as stored ([`Control::report`]).
    unusable: RwLock<Vec<Unusable>>,
}

impl Live {
    pub fn new(snapshot: Snapshot) -> Live {
        Live { snapshot: RwLock::new(Arc::new(snapshot)), version: AtomicU64::new(0), unusable: RwLock::default() }
    }
    /// The stored objects not in force as stored, by kind and id.
    pub fn unusable(&self) -> Vec<Unusable> {
        self.unusable.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    pub fn get(&self) -> Arc<Snapshot> {
        self.snapshot.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    pub fn set(&self, s: Snapshot) {
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(s);
    }
    /// The `cfg:routing:version` this process last synchronised with.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }
    pub fn set_version(&self, v: u64) {
        self.version.store(v, Ordering::Relaxed);
    }
    /// After this process's own write announced as `v`: `v` is marked loaded only when it follows
    /// what was loaded, so no change of another replica was missed between them. Otherwise
    /// the version stays and the next resync reloads everything (announcements can come in
    /// another order than commits; marking `v` would hide a change not loaded yet).
    pub fn advance_version(&self, v: u64) -> bool {
        self.version.compare_exchange(v.wrapping_sub(1), v, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}
