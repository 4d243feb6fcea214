//! `sidecar/lua/copy_key.lua`: one API-key record from PostgreSQL into Redis, never undoing a
//! revocation (decision 130). Used by a start's re-warm and by the completion of a revocation
//! whose Redis write failed; never by the request path.
//!
//! The script writes the record (`apikey:{sha256}`) unless Redis holds it revoked and the copy is
//! not; the key's id mapping and tenant index follow ([`Store::index_key`]: idempotent, and the
//! record is written first, as on Cluster where the three keys live in different slots).

use super::call::{BadReply, Invocation, ScriptError};
use crate::apikey::KeyRecord;
use crate::keys::{ApiKeyRecordKey, KeyHash};
use crate::store::Store;
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/copy_key.lua")));

/// Off the request path: a start or an operator's revocation waits, not a request.
const DEADLINE: Duration = Duration::from_secs(5);

/// What a copy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copied {
    Written,
    /// Redis holds the key revoked and the copy was not: a revocation newer than the copy stays.
    KeptRevoked,
}

/// Reads the script's reply (1 written, 0 kept).
pub fn parse(reply: i64) -> Result<Copied, BadReply> {
    match reply {
        1 => Ok(Copied::Written),
        0 => Ok(Copied::KeptRevoked),
        other => Err(BadReply::new("copy_key.lua", format!("answered {other}, not 0 or 1"))),
    }
}

/// The script's arguments: the record's fields as field/value pairs.
fn args(record: &KeyRecord) -> Vec<String> {
    record.to_fields().into_iter().flat_map(|(field, value)| [field.to_string(), value]).collect()
}

/// Copies `record` (of the key hashing to `hash`) into Redis unless that would undo a revocation.
pub async fn run(store: &Store, hash: &KeyHash, record: &KeyRecord) -> Result<Copied, ScriptError> {
    let keys = vec![ApiKeyRecordKey::new(hash).as_str().to_string()];
    let reply = Invocation { script: &SCRIPT, op: "copy_key", keys, args: args(record) }.run(store, Some(DEADLINE)).await?;
    let copied = parse(reply)?;
    store.index_key(hash, record).await?;
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
        };
        assert_eq!(
            args(&record),
            ["key_id", "key_1", "tenant", "acme", "plan", "pro", "status", "revoked", "created_at", "10", "revoked_at", "20"]
        );
        assert_eq!(parse(1).unwrap(), Copied::Written);
        assert_eq!(parse(0).unwrap(), Copied::KeptRevoked);
        assert!(parse(2).is_err());
    }
}
