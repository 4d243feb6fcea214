//! The API-key store in Redis: `apikey:{sha256}` records (the hot copy the decision path reads),
//! the `apikey-id:` mapping and the per-tenant `apikey-index:` (docs/redis-keys.md), the
//! once-an-hour audit claim.

use super::{Backend, Store, StoreError};
use crate::apikey::{KeyPage, KeyRecord, KeyStatus};
use crate::keys::{ApiKeyIdKey, ApiKeyIndexKey, ApiKeyRecordKey, AuthFailKey, Id, KeyHash, API_KEY_ID_PATTERN, AUTH_FAIL_TTL_SECS};
use redis::AsyncCommands;
use std::collections::HashMap;
use std::time::Duration;

impl Store {
    /// The record of a key hash, or `None` when there is none.
    pub async fn lookup(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, StoreError> {
        self.lookup_within(hash, self.config.timeout).await
    }

    /// [`Store::lookup`] within `deadline`.
    pub async fn lookup_within(&self, hash: &KeyHash, deadline: Duration) -> Result<Option<KeyRecord>, StoreError> {
        let key = ApiKeyRecordKey::new(hash);
        let map: HashMap<String, String> = self.run_with_deadline("hgetall", deadline, |mut c| async move { c.hgetall(key).await }).await?;
        KeyRecord::from_fields(&map).map_err(|e| StoreError::Malformed(e.to_string()))
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
            self.run_with_deadline("create_key", Self::ADMIN_DEADLINE, |mut c| async move { c.hset_multiple::<_, _, _, ()>(rec_key, &fields).await })
                .await?;
            self.index_key(hash, record).await
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

    /// Points the key's id mapping and its tenant's index at the key hash (idempotent), after its
    /// record was written (`create_key` and `scripts::copy_key` on Cluster).
    pub async fn index_key(&self, hash: &KeyHash, record: &KeyRecord) -> Result<(), StoreError> {
        let id_key = ApiKeyIdKey::new(&record.key_id);
        let idx_key = ApiKeyIndexKey::new(&record.tenant);
        let hash_s = hash.as_str().to_string();
        let key_id = record.key_id.to_string();
        self.run_with_deadline("index_key", Self::ADMIN_DEADLINE, |mut c| async move {
            c.set::<_, _, ()>(id_key, hash_s).await?;
            c.sadd::<_, _, ()>(idx_key, key_id).await
        })
        .await
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

    /// The hash and record a key id maps to, or `None` when there is none.
    pub async fn key_by_id(&self, key_id: &Id) -> Result<Option<(KeyHash, KeyRecord)>, StoreError> {
        let hash = match self.hash_of(key_id).await {
            Ok(h) => h,
            Err(StoreError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(self.lookup_admin(&hash).await?.map(|r| (hash, r)))
    }

    /// Sets a key's `expires_at` to `at` unless it expires sooner (a rotation's end of the
    /// previous key). Only that field is written, so a revocation made meanwhile stays. Returns
    /// the updated record.
    pub async fn shorten_key(&self, key_id: &Id, at: u64) -> Result<KeyRecord, StoreError> {
        let Some((hash, record)) = self.key_by_id(key_id).await? else {
            return Err(StoreError::NotFound(format!("no key with id {key_id}")));
        };
        if record.expires_at.is_none_or(|e| e > at) {
            let rec_key = ApiKeyRecordKey::new(&hash);
            self.run_with_deadline("shorten_key", Self::ADMIN_DEADLINE, |mut c| async move { c.hset::<_, _, _, ()>(rec_key, "expires_at", at).await })
                .await?;
        }
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
        KeyRecord::from_fields(&map).map_err(|e| StoreError::Malformed(e.to_string()))
    }

    /// The records of one tenant's keys, or of every key, sorted by creation time. Every key
    /// is a `SCAN` of the whole keyspace in steps (on every primary of a Cluster), each its own
    /// command; records are read [`Self::READS_IN_FLIGHT`] at a time.
    pub async fn list_keys(&self, tenant: Option<&Id>) -> Result<Vec<KeyRecord>, StoreError> {
        let ids = self.key_ids(tenant).await?;
        let mut out = self.records_of(&ids).await?;
        out.sort_by(|a, b| (a.created_at, &a.key_id).cmp(&(b.created_at, &b.key_id)));
        Ok(out)
    }

    /// One page of [`Store::list_keys`] in key-id order (decision 184): the records of the first
    /// `page.limit` ids after `page.after`, and, when more ids follow, the id the next page
    /// starts after — the page's last id, whether or not its record is still there (an id whose
    /// record is gone leaves a page short, never ends the listing). The scan reads every name
    /// still (names are cheap); only the page's records are read.
    pub async fn list_keys_page(&self, tenant: Option<&Id>, page: &KeyPage) -> Result<(Vec<KeyRecord>, Option<Id>), StoreError> {
        let mut ids = self.key_ids(tenant).await?;
        ids.retain(|id| page.after.as_ref().is_none_or(|after| id > after));
        let more = ids.len() > page.limit;
        ids.truncate(page.limit);
        let mut out = self.records_of(&ids).await?;
        out.sort_by(|a, b| a.key_id.cmp(&b.key_id));
        Ok((out, ids.pop().filter(|_| more)))
    }

    /// The ids of one tenant's keys (its index), or of every key (a scan), sorted, each once.
    async fn key_ids(&self, tenant: Option<&Id>) -> Result<Vec<Id>, StoreError> {
        let mut ids: Vec<Id> = match tenant {
            Some(t) => {
                let idx = ApiKeyIndexKey::new(t);
                let members: Vec<String> =
                    self.run_with_deadline("smembers", Self::ADMIN_DEADLINE, |mut c| async move { c.smembers(idx).await }).await?;
                members.iter().filter_map(|m| Id::parse(m)).collect()
            }
            None => {
                let names = self.scan_names("scan", API_KEY_ID_PATTERN, Self::ADMIN_DEADLINE).await?;
                names.iter().filter_map(|n| ApiKeyIdKey::key_id_of(n)).collect()
            }
        };
        // a SCAN may return a name twice
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// The records `ids` map to (an id whose mapping or record is gone is left out).
    async fn records_of(&self, ids: &[Id]) -> Result<Vec<KeyRecord>, StoreError> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(Self::READS_IN_FLIGHT) {
            for r in futures::future::join_all(chunk.iter().map(|id| self.record_of(id))).await {
                out.extend(r?);
            }
        }
        Ok(out)
    }

    /// Records read at once by a listing (each two commands, on the admin connection).
    const READS_IN_FLIGHT: usize = 64;

    /// The record a listed key id maps to; `None` when the mapping or the record is gone.
    async fn record_of(&self, id: &Id) -> Result<Option<KeyRecord>, StoreError> {
        match self.hash_of(id).await {
            Ok(hash) => self.lookup_admin(&hash).await,
            Err(StoreError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
