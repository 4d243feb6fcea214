//! `sidecar/lua/touch_key.lua`: a key's last-use time into its Redis record (decision 336), only
//! into a record that exists and never back in time. Off the request path (the last-use flusher).

use super::call::{BadReply, Invocation, ScriptError};
use crate::keys::{ApiKeyRecordKey, KeyHash};
use crate::store::Store;
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/touch_key.lua")));

const DEADLINE: Duration = Duration::from_secs(5);

/// Reads the script's reply: whether it wrote.
pub fn parse(reply: i64) -> Result<bool, BadReply> {
    match reply {
        1 => Ok(true),
        0 => Ok(false),
        other => Err(BadReply::new("touch_key.lua", format!("answered {other}, not 0 or 1"))),
    }
}

/// Records that the key hashing to `hash` was used at `at` (unix seconds).
pub async fn run(store: &Store, hash: &KeyHash, at: u64) -> Result<bool, ScriptError> {
    let keys = vec![ApiKeyRecordKey::new(hash).as_str().to_string()];
    let reply = Invocation { script: &SCRIPT, op: "touch_key", keys, args: vec![at.to_string()] }.run(store, Some(DEADLINE)).await?;
    Ok(parse(reply)?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_reply_is_read_strictly() {
        assert!(super::parse(1).unwrap());
        assert!(!super::parse(0).unwrap());
        assert!(super::parse(2).is_err());
    }
}
