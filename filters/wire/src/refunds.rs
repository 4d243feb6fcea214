//! Abandoned decisions (issue 15.2): decisions whose answer the filter gave up on.
//!
//! When the decision call times out, fails, or its stream goes away before the answer, the client
//! never sees the request admitted, yet the sidecar may have allowed it and taken from its limits.
//! The filter queues the decision's id (the one it minted and sent as `decisionId`) with the key
//! hash and sends them in [`RefundBatch`]es to `POST /v1/refunds` on its flush tick; the sidecar
//! gives back everything that decision took (window and bucket units, log members, concurrency
//! slots, budget reservations, an idempotency claim). A refund is idempotent: the sidecar's record
//! of what a decision took is deleted by the refund, so a re-delivered item is a no-op.

use serde::{Deserialize, Serialize};

/// Path of the refund endpoint on the sidecar.
pub const REFUNDS_PATH: &str = "/v1/refunds";

/// One decision the filter gave up on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Abandoned {
    /// The `decisionId` the decision call carried (32 lowercase hex).
    pub decision_id: String,
    /// The key hash the decision call carried: the sidecar finds the tenant (the hash tag of what
    /// the decision took) from the key's record.
    pub key_hash: String,
}

/// The body of `POST /v1/refunds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefundBatch {
    pub abandoned: Vec<Abandoned>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_in_camel_case() {
        let b = RefundBatch { abandoned: vec![Abandoned { decision_id: "ab".repeat(16), key_hash: "cd".repeat(32) }] };
        let s = serde_json::to_string(&b).unwrap();
        assert_eq!(s, format!(r#"{{"abandoned":[{{"decisionId":"{}","keyHash":"{}"}}]}}"#, "ab".repeat(16), "cd".repeat(32)));
        assert_eq!(serde_json::from_str::<RefundBatch>(&s).unwrap(), b);
    }
}
