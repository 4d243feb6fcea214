//! `sidecar/lua/idem_keep.lua`: keep an idempotency claim in flight while its request still runs
//! (decision 186), only while the claim is still this request's.

use super::call::Invocation;
use crate::keys::{IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest};
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/idem_keep.lua")));

/// Off the request path (`POST /v1/responses/claims`).
const DEADLINE: Duration = Duration::from_secs(2);

/// One `idem_keep.lua` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemKeep {
    pub memo: IdempotencyMemoKey,
    pub owner: IdempotencyOwnerKey,
    /// The claim token the decision handed out.
    pub token: String,
    pub digest: RequestDigest,
    pub in_flight_ms: u64,
}

/// KEYS and ARGV, in the order of `idem_keep.lua`'s contract.
pub fn encode(c: &IdemKeep) -> (Vec<String>, Vec<String>) {
    (
        vec![c.memo.as_str().to_string(), c.owner.as_str().to_string()],
        vec![c.token.clone(), c.in_flight_ms.max(1).to_string(), c.digest.as_str().to_string()],
    )
}

/// Runs the call: `true` when kept, `false` when the claim is no longer this request's.
pub async fn run(store: &Store, call: &IdemKeep) -> Result<bool, StoreError> {
    let (keys, args) = encode(call);
    let kept: i64 = Invocation { script: &SCRIPT, op: "idem_keep_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    Ok(kept == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{IdemKey, Id};

    #[test]
    fn memo_owner_token_ttl_and_digest_in_the_contracts_order() {
        let (t, k, i) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap(), IdemKey::parse("k-1").unwrap());
        let digest = RequestDigest::parse(&"0a".repeat(16)).unwrap();
        let call = IdemKeep {
            memo: IdempotencyMemoKey::new(&t, &k, &digest, &i),
            owner: IdempotencyOwnerKey::new(&t, &k, &i),
            token: "tok".into(),
            digest,
            in_flight_ms: 300_000,
        };
        let (keys, args) = encode(&call);
        assert_eq!(keys, [format!("idem:api:{{acme}}:key_1:{}:k-1", "0a".repeat(16)), "idem:key:{acme}:key_1:k-1".to_string()]);
        assert_eq!(args, ["tok", "300000", &"0a".repeat(16)]);
    }
}
