//! `sidecar/lua/idem_complete.lua`: settle an idempotency claim once its request is over — store
//! the 2xx response (24 h) or release the claim — only if the claim is still this request's.

use super::call::Invocation;
use crate::keys::{IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest, IDEMPOTENCY_TTL_MS};
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/idem_complete.lua")));

/// Off the request path (`POST /v1/responses`).
const DEADLINE: Duration = Duration::from_millis(tollgate_wire::responses::OUTCOME_STORE_DEADLINE_MS);

/// One `idem_complete.lua` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemComplete {
    pub owner: IdempotencyOwnerKey,
    pub memo: IdempotencyMemoKey,
    /// The claim token the decision handed out.
    pub token: String,
    pub digest: RequestDigest,
    /// `Some(json)`: store this response; `None`: release the claim (not memoized).
    pub response: Option<String>,
}

impl IdemComplete {
    /// KEYS and ARGV, in the order of `idem_complete.lua`'s contract.
    pub fn encode(&self) -> (Vec<String>, Vec<String>) {
        let keys = vec![self.owner.as_str().to_string(), self.memo.as_str().to_string()];
        let (action, json) = match &self.response {
            Some(j) => ("store", j.clone()),
            None => ("release", String::new()),
        };
        let args = vec![self.token.clone(), self.digest.as_str().to_string(), action.to_string(), json, IDEMPOTENCY_TTL_MS.to_string()];
        (keys, args)
    }
}

/// Runs the call: `true` when settled, `false` when the claim is no longer this request's
/// (nothing changed).
pub async fn run(store: &Store, call: &IdemComplete) -> Result<bool, StoreError> {
    let (keys, args) = call.encode();
    let done: i64 = Invocation { script: &SCRIPT, op: "idem_complete_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    Ok(done == 1)
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
            token: "tok".into(),
            digest,
            response: Some("{}".into()),
        };
        let (keys, args) = call.encode();
        assert_eq!(keys[0], "idem:key:{acme}:key_1:k-1");
        assert_eq!(args, ["tok", &"0a".repeat(16), "store", "{}", "86400000"]);
        let (_, args) = IdemComplete { response: None, ..call }.encode();
        assert_eq!(&args[2..4], ["release", ""]);
    }
}
