//! The per-worker queue of abandoned decisions, flushed to the sidecar in batches (issue 15.2).
//!
//! A decision is abandoned when the filter gives up on its answer and the client never sees the
//! request admitted: the call timed out, failed, or answered something unreadable and the failure
//! mode refused the request (503 `sidecar_unavailable`), or the client went away while the call
//! was in flight. The sidecar may still have allowed it and taken from its limits, so the filter
//! queues the decision's id (the one it minted, crate::ids) with the key hash, and the worker's
//! root context sends them with `POST /v1/refunds` on the completion flush interval; the sidecar
//! gives back what the decision took. A request the failure mode let through (open) is admitted:
//! what its decision took stays taken.
//!
//! Bounded like the completion queue (the same [`BatchQueue`]): past `MAX_QUEUED_REFUNDS` the
//! oldest are dropped and counted (`tollgate.refunds.dropped`) — a dropped refund leaves what its
//! decision took to expire, as before refunds. A failed batch is sent again (a refund is
//! idempotent at the sidecar).

use crate::completions::{BatchItem, BatchQueue};
use tollgate_wire::refunds::Abandoned;

impl BatchItem for Abandoned {
    const FIELD: &'static str = "abandoned";
}

/// Abandoned decisions to refund.
pub type RefundQueue = BatchQueue<Abandoned>;

/// Abandoned decisions a worker keeps while the sidecar is unreachable.
pub const MAX_QUEUED_REFUNDS: usize = 10_000;
/// Abandoned decisions per `POST /v1/refunds`.
pub const MAX_REFUND_BATCH: usize = 500;

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use tollgate_wire::refunds::RefundBatch;

    #[test]
    fn abandoned_decisions_batch_as_the_sidecar_reads_them_and_are_bounded() {
        let mut q = RefundQueue::new(2);
        for i in 0..3 {
            q.push(Abandoned { decision_id: format!("{i:032}"), key_hash: "ab".repeat(32) });
        }
        assert_eq!(q.dropped, 1, "the oldest is dropped past the bound");
        let b: RefundBatch = serde_json::from_slice(&q.begin_flush(MAX_REFUND_BATCH).unwrap()).unwrap();
        assert_eq!(b.abandoned.iter().map(|a| a.decision_id.clone()).collect::<Vec<_>>(), [format!("{:032}", 1), format!("{:032}", 2)]);
        q.end_flush(false);
        assert_eq!(q.len(), 2, "a failed batch is sent again");
    }
}
