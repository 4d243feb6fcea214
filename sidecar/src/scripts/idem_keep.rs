//! `sidecar/lua/idem_keep.lua`: keep an idempotency claim in flight while its request still runs
//! (decision 186), only while the claim is still this request's.

use super::call::Invocation;
use crate::keys::IdempotencyMemoKey;
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/idem_keep.lua")));

/// Off the request path (`POST /v1/responses/claims`).
const DEADLINE: Duration = Duration::from_secs(2);

/// KEYS and ARGV, in the order of `idem_keep.lua`'s contract.
pub fn encode(memo: &IdempotencyMemoKey, token: &str, in_flight_ms: u64) -> (Vec<String>, Vec<String>) {
    (vec![memo.as_str().to_string()], vec![token.to_string(), in_flight_ms.max(1).to_string()])
}

/// Runs the call: `true` when kept, `false` when the claim is no longer this request's.
pub async fn run(store: &Store, memo: &IdempotencyMemoKey, token: &str, in_flight_ms: u64) -> Result<bool, StoreError> {
    let (keys, args) = encode(memo, token, in_flight_ms);
    let kept: i64 = Invocation { script: &SCRIPT, op: "idem_keep_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    Ok(kept == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{IdemKey, Id, RequestDigest};

    #[test]
    fn memo_token_and_ttl_in_the_contracts_order() {
        let (t, k, i) = (Id::parse("acme").unwrap(), Id::parse("key_1").unwrap(), IdemKey::parse("k-1").unwrap());
        let memo = IdempotencyMemoKey::new(&t, &k, &RequestDigest::parse(&"0a".repeat(16)).unwrap(), &i);
        let (keys, args) = encode(&memo, "tok", 300_000);
        assert_eq!(keys, [format!("idem:api:{{acme}}:key_1:{}:k-1", "0a".repeat(16))]);
        assert_eq!(args, ["tok", "300000"]);
    }
}
