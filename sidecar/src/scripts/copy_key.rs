//! `sidecar/lua/copy_key.lua`: one API-key record from PostgreSQL into Redis, never undoing a
//! revocation (decision 130). Used by a start's re-warm and by the completion of a revocation
//! whose Redis write failed; never by the request path.
//!
//! The script writes the record (`apikey:{sha256}`) unless Redis holds it revoked and the copy is
//! not, and on a single node the key's id mapping and tenant index in the same call (one round
//! trip per key for a start's copy of every key). On Cluster the three keys live in different
//! slots: the script gets the record alone and [`Store::index_key`] follows (idempotent; the
//! record first, so the id and the index only ever point at a record that exists).

use super::call::{BadReply, Invocation, ScriptError};
use crate::apikey::KeyRecord;
use crate::keys::{ApiKeyIdKey, ApiKeyIndexKey, ApiKeyRecordKey, KeyHash};
use crate::store::Store;
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/copy_key.lua")));

/// Off the request path: a start or an operator's revocation waits, not a request.
const DEADLINE: Duration = Duration::from_secs(5);

/// What a copy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copied {
    /// Written over a record of the same status.
    Written,
    /// Written where Redis held no record, or one of another status: a write it had lost (a
    /// failover to a replica behind, a wipe), or a revocation being made (decision 197).
    Restored,
    /// Redis holds the key revoked and the copy was not: a revocation newer than the copy stays.
    KeptRevoked,
}

/// Reads the script's reply (1 written, 2 restored, 0 kept).
pub fn parse(reply: i64) -> Result<Copied, BadReply> {
    match reply {
        1 => Ok(Copied::Written),
        2 => Ok(Copied::Restored),
        0 => Ok(Copied::KeptRevoked),
        other => Err(BadReply::new("copy_key.lua", format!("answered {other}, not 0, 1 or 2"))),
    }
}

/// The script's arguments: the key hash, the key id, then the record's fields as field/value
/// pairs.
fn args(hash: &KeyHash, record: &KeyRecord) -> Vec<String> {
    let fields = record.to_fields().into_iter().flat_map(|(field, value)| [field.to_string(), value]);
    [hash.as_str().to_string(), record.key_id.to_string()].into_iter().chain(fields).collect()
}

/// The script's keys: the record, and where one node holds every key, the id mapping and the
/// tenant's index.
fn keys(hash: &KeyHash, record: &KeyRecord, single_node: bool) -> Vec<String> {
    let mut keys = vec![ApiKeyRecordKey::new(hash).as_str().to_string()];
    if single_node {
        keys.push(ApiKeyIdKey::new(&record.key_id).as_str().to_string());
        keys.push(ApiKeyIndexKey::new(&record.tenant).as_str().to_string());
    }
    keys
}

/// Copies `record` (of the key hashing to `hash`) into Redis unless that would undo a revocation.
pub async fn run(store: &Store, hash: &KeyHash, record: &KeyRecord) -> Result<Copied, ScriptError> {
    let single_node = !store.is_cluster();
    let keys = keys(hash, record, single_node);
    let reply = Invocation { script: &SCRIPT, op: "copy_key", keys, args: args(hash, record) }.run(store, Some(DEADLINE)).await?;
    let copied = parse(reply)?;
    if !single_node {
        store.index_key(hash, record).await?;
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apikey::KeyStatus;
    use crate::keys::Id;

    #[test]
    fn the_arguments_are_the_records_fields_and_the_reply_is_read_strictly() {
        let id = |s: &str| Id::parse(s).unwrap();
        let record = KeyRecord {
            key_id: id("key_1"),
            tenant: id("acme"),
            plan: id("pro"),
            status: KeyStatus::Revoked,
            created_at: 10,
            expires_at: None,
            revoked_at: Some(20),
            label: None,
            scopes: Default::default(),
            last_used_at: None,
        };
        let hash = KeyHash::parse(&"ab".repeat(32)).unwrap();
        let mut want = vec!["ab".repeat(32), "key_1".to_string()];
        want.extend(["key_id", "key_1", "tenant", "acme", "plan", "pro", "status", "revoked", "created_at", "10", "revoked_at", "20"].map(String::from));
        assert_eq!(args(&hash, &record), want);
        assert_eq!(keys(&hash, &record, true), [format!("apikey:{}", "ab".repeat(32)), "apikey-id:key_1".into(), "apikey-index:acme".into()]);
        assert_eq!(keys(&hash, &record, false).len(), 1, "Cluster: the record alone");
        assert_eq!(parse(1).unwrap(), Copied::Written);
        assert_eq!(parse(2).unwrap(), Copied::Restored);
        assert_eq!(parse(0).unwrap(), Copied::KeptRevoked);
        assert!(parse(3).is_err());
    }
}
