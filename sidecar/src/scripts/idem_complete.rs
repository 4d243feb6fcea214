//! `sidecar/lua/idem_complete.lua` (after `ledger.lua`): settle an idempotency claim once its
//! request is over — store the 2xx response (24 h), without its body when the whole would pass
//! the tenant's bound of stored bytes (decision 185), or release the claim — only if the claim is
//! still this request's.

use super::call::Invocation;
use crate::keys::{IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest, ResponsesBytesKey, ResponsesLiveKey, IDEMPOTENCY_TTL_MS};
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(concat!(include_str!("../../lua/ledger.lua"), include_str!("../../lua/idem_complete.lua"))));

/// Off the request path (`POST /v1/responses`).
const DEADLINE: Duration = Duration::from_millis(tollgate_wire::responses::OUTCOME_STORE_DEADLINE_MS);

/// What to store: the outcome's JSON, and the same without its body when it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub json: String,
    /// Stored instead of `json` when `json` would take the tenant past its bound (`None`: the
    /// response has no body to drop, `json` is stored whatever the bound).
    pub without_body: Option<String>,
}

/// One `idem_complete.lua` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemComplete {
    pub owner: IdempotencyOwnerKey,
    pub memo: IdempotencyMemoKey,
    /// The tenant's ledger of stored bytes.
    pub live: ResponsesLiveKey,
    pub bytes: ResponsesBytesKey,
    /// The claim token the decision handed out.
    pub token: String,
    pub digest: RequestDigest,
    /// `Some`: store this outcome; `None`: release the claim (not memoized).
    pub response: Option<Outcome>,
    /// The tenant's bound: bytes of stored responses it may hold at once.
    pub bound: u64,
}

/// How the claim was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Stored whole, or released.
    Done,
    /// Stored without its body: the whole would have passed the tenant's bound.
    WithoutBody,
    /// The claim is no longer this request's: nothing changed.
    NotOurs,
}

impl IdemComplete {
    /// The outcome's bytes (what waits in memory while it is tried again).
    pub fn outcome_bytes(&self) -> usize {
        self.response.as_ref().map_or(0, |o| o.json.len() + o.without_body.as_ref().map_or(0, String::len))
    }

    /// KEYS and ARGV at `now_ms`, in the order of `idem_complete.lua`'s contract.
    pub fn encode(&self, now_ms: u64) -> (Vec<String>, Vec<String>) {
        let keys = [self.owner.as_str(), self.memo.as_str(), self.live.as_str(), self.bytes.as_str()].map(String::from).to_vec();
        let (action, json, without) = match &self.response {
            Some(o) => ("store", o.json.clone(), o.without_body.clone().unwrap_or_default()),
            None => ("release", String::new(), String::new()),
        };
        let args = vec![
            self.token.clone(),
            self.digest.as_str().to_string(),
            action.to_string(),
            json,
            IDEMPOTENCY_TTL_MS.to_string(),
            without,
            now_ms.to_string(),
            self.bound.to_string(),
        ];
        (keys, args)
    }
}

/// The script's reply, read.
pub fn read(reply: i64) -> Option<Settled> {
    match reply {
        1 => Some(Settled::Done),
        2 => Some(Settled::WithoutBody),
        0 => Some(Settled::NotOurs),
        _ => None,
    }
}

/// Runs the call at `now_ms`.
pub async fn run(store: &Store, call: &IdemComplete, now_ms: u64) -> Result<Settled, StoreError> {
    let (keys, args) = call.encode(now_ms);
    let reply: i64 = Invocation { script: &SCRIPT, op: "idem_complete_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    read(reply).ok_or_else(|| StoreError::Malformed(format!("idem_complete.lua replied {reply}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{IdemKey, Id};

    #[test]
    fn store_or_release_in_the_contracts_order() {
        let (t, k, i) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap(), IdemKey::parse("k-1").unwrap());
        let digest = RequestDigest::parse(&"0a".repeat(16)).unwrap();
        let call = IdemComplete {
            owner: IdempotencyOwnerKey::new(&t, &k, &i),
            memo: IdempotencyMemoKey::new(&t, &k, &digest, &i),
            live: ResponsesLiveKey::new(&t),
            bytes: ResponsesBytesKey::new(&t),
            token: "tok".into(),
            digest,
            response: Some(Outcome { json: "{}".into(), without_body: Some("{ }".into()) }),
            bound: 9,
        };
        let (keys, args) = call.encode(5);
        assert_eq!(keys, ["idem:key:{acme}:key_1:k-1", &format!("idem:api:{{acme}}:key_1:{}:k-1", "0a".repeat(16)), "responses:live:{acme}", "responses:bytes:{acme}"]);
        assert_eq!(args, ["tok", &"0a".repeat(16), "store", "{}", "86400000", "{ }", "5", "9"]);
        assert_eq!(call.outcome_bytes(), 5);
        let (_, args) = IdemComplete { response: None, ..call }.encode(5);
        assert_eq!(&args[2..4], ["release", ""]);
        assert_eq!([read(1), read(2), read(0), read(3)], [Some(Settled::Done), Some(Settled::WithoutBody), Some(Settled::NotOurs), None]);
    }
}
