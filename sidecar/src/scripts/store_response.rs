//! `sidecar/lua/store_response.lua` (after `ledger.lua`): store one cached response where none
//! is, within its tenant's bound of stored bytes (decision 185).

use super::call::{BadReply, Invocation, ScriptError};
use crate::keys::{ResponseCacheKey, ResponsesBytesKey, ResponsesLiveKey};
use crate::store::Store;
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(concat!(include_str!("../../lua/ledger.lua"), include_str!("../../lua/store_response.lua"))));

/// Off the request path: the filter's batch waits, not a request.
const DEADLINE: Duration = Duration::from_secs(2);

/// One `store_response.lua` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreResponse {
    pub key: ResponseCacheKey,
    pub live: ResponsesLiveKey,
    pub bytes: ResponsesBytesKey,
    pub json: String,
    pub ttl_ms: u64,
    pub now_ms: u64,
    /// The tenant's bound: bytes of stored responses it may hold at once.
    pub bound: u64,
}

/// What the script did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Stored,
    /// An entry is there: nothing changed.
    Exists,
    /// The tenant's bound would be passed: nothing stored.
    OverBound,
}

impl StoreResponse {
    /// KEYS and ARGV, in the order of `store_response.lua`'s contract.
    pub fn encode(&self) -> (Vec<String>, Vec<String>) {
        let keys = vec![self.key.as_str().to_string(), self.live.as_str().to_string(), self.bytes.as_str().to_string()];
        let args = vec![self.json.clone(), self.ttl_ms.max(1).to_string(), self.now_ms.to_string(), self.bound.to_string()];
        (keys, args)
    }
}

/// The script's reply, read.
pub fn read(reply: i64) -> Option<Stored> {
    match reply {
        1 => Some(Stored::Stored),
        0 => Some(Stored::Exists),
        -1 => Some(Stored::OverBound),
        _ => None,
    }
}

/// Runs the call.
pub async fn run(store: &Store, call: &StoreResponse) -> Result<Stored, ScriptError> {
    let (keys, args) = call.encode();
    let reply: i64 = Invocation { script: &SCRIPT, op: "store_response_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    read(reply).ok_or_else(|| BadReply::new("store_response.lua", format!("replied {reply}")).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{CacheHash, Id};

    #[test]
    fn keys_and_arguments_in_the_contracts_order() {
        let t = Id::parse("acme").unwrap();
        let call = StoreResponse {
            key: ResponseCacheKey::new(&t, &Id::parse("p").unwrap(), &Id::parse("chat").unwrap(), &CacheHash::parse(&"ab".repeat(32)).unwrap()),
            live: ResponsesLiveKey::new(&t),
            bytes: ResponsesBytesKey::new(&t),
            json: "{}".into(),
            ttl_ms: 0,
            now_ms: 7,
            bound: 1 << 20,
        };
        let (keys, args) = call.encode();
        assert_eq!(&keys[1..], ["responses:live:{acme}", "responses:bytes:{acme}"]);
        assert_eq!(args, ["{}", "1", "7", "1048576"]);
        assert_eq!([read(1), read(0), read(-1), read(2)], [Some(Stored::Stored), Some(Stored::Exists), Some(Stored::OverBound), None]);
    }
}
