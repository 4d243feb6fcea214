//! The per-worker queue of responses to store, and what a request keeps of its response until
//! it is complete ([`PendingStore`]).

use crate::flush::{Delivery, Outbox};
use std::collections::VecDeque;
use tollgate_wire::responses::{StoreBatch, StoreItem};
use tollgate_wire::Header;

/// The per-worker queue of finished responses to store, sent in batches by the root context's
/// tick. Bounded in items and bytes; past either bound new items are dropped and counted.
#[derive(Debug)]
pub struct ResponseQueue {
    pending: VecDeque<(StoreItem, usize)>,
    bytes: usize,
    max_items: usize,
    max_bytes: usize,
    /// Items of the batch in flight.
    in_flight: Option<usize>,
    /// Items dropped: the queue was full, or their batch failed.
    pub dropped: u64,
}

impl ResponseQueue {
    pub fn new(max_items: usize, max_bytes: usize) -> ResponseQueue {
        ResponseQueue { pending: VecDeque::new(), bytes: 0, max_items: max_items.max(1), max_bytes, in_flight: None, dropped: 0 }
    }

    pub fn push(&mut self, item: StoreItem) {
        let size = item.response.as_ref().map_or(0, |r| r.body.len()) + 256;
        if self.pending.len() >= self.max_items || self.bytes + size > self.max_bytes {
            self.dropped += 1;
            return;
        }
        self.bytes += size;
        self.pending.push_back((item, size));
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// A batch body of up to `max_batch_bytes` (at least one item), unless one is in flight or
    /// nothing waits.
    pub fn begin_flush(&mut self, max_batch_bytes: usize) -> Option<(Vec<u8>, usize)> {
        if self.in_flight.is_some() || self.pending.is_empty() {
            return None;
        }
        let mut batch = StoreBatch::default();
        let mut size = 0;
        while let Some((_, s)) = self.pending.front() {
            if !batch.responses.is_empty() && size + *s > max_batch_bytes {
                break;
            }
            size += *s;
            if let Some((item, s)) = self.pending.pop_front() {
                self.bytes -= s;
                batch.responses.push(item);
            }
        }
        let n = batch.responses.len();
        match serde_json::to_vec(&batch) {
            Ok(body) => {
                self.in_flight = Some(n);
                Some((body, n))
            }
            Err(_) => {
                self.dropped += n as u64;
                None
            }
        }
    }

    /// The batch in flight is done; `failed` of its items did not get through (not retried).
    pub fn end_flush(&mut self, failed: usize) {
        self.in_flight = None;
        self.dropped += failed as u64;
    }
}

/// A batch is sent once: one that was not taken is dropped and counted.
impl Outbox for ResponseQueue {
    fn dropped(&self) -> u64 {
        self.dropped
    }
    fn take_batch(&mut self, max_bytes: usize) -> Option<Vec<u8>> {
        self.begin_flush(max_bytes).map(|(body, _)| body)
    }
    fn settle(&mut self, delivery: Delivery) {
        let failed = match delivery {
            Delivery::Delivered => 0,
            Delivery::Failed | Delivery::Refused | Delivery::TooLarge => self.in_flight.unwrap_or(0),
        };
        self.end_flush(failed);
    }
}

/// A stored-response ticket's request, kept until the response is complete.
#[derive(Debug, Clone)]
pub struct PendingStore {
    pub ticket: tollgate_wire::responses::StoreTicket,
    /// The response status, once its headers are in.
    pub status: u16,
    pub headers: Vec<Header>,
    /// Whether the response qualifies (decided on its headers).
    pub storable: bool,
    /// The body bound for this store.
    pub max_body: usize,
    /// The whole body went by (end of stream seen).
    pub complete: bool,
}

impl PendingStore {
    pub fn new(ticket: tollgate_wire::responses::StoreTicket, max_body: usize) -> PendingStore {
        PendingStore { ticket, status: 0, headers: Vec::new(), storable: false, max_body, complete: false }
    }

    pub fn is_idempotency(&self) -> bool {
        matches!(self.ticket, tollgate_wire::responses::StoreTicket::Idempotency { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use tollgate_wire::responses::{StoreTicket, StoredResponse};

    fn item(n: usize, body: usize) -> StoreItem {
        StoreItem {
            ticket: StoreTicket::Cache { tenant: "t".into(), route: "r".into(), hash: n.to_string() },
            response: Some(StoredResponse::new(200, vec![], vec![b'a'; body], 0)),
        }
    }

    #[test]
    fn the_queue_is_bounded_and_sends_each_batch_once() {
        let mut q = ResponseQueue::new(3, 10_000);
        for i in 0..4 {
            q.push(item(i, 10));
        }
        assert_eq!((q.len(), q.dropped), (3, 1));
        let (body, n) = q.begin_flush(1 << 20).unwrap();
        assert_eq!(n, 3);
        let b: StoreBatch = serde_json::from_slice(&body).unwrap();
        assert_eq!(b.responses.len(), 3);
        q.push(item(9, 10));
        assert!(q.begin_flush(1 << 20).is_none(), "one batch in flight");
        q.end_flush(3);
        assert_eq!(q.dropped, 4, "a failed batch is dropped, not retried");
        assert_eq!(q.begin_flush(1 << 20).unwrap().1, 1);
        q.end_flush(0);
        assert!(q.is_empty());

        let mut q = ResponseQueue::new(100, 5_000);
        q.push(item(1, 3_000));
        q.push(item(2, 3_000));
        assert_eq!((q.len(), q.dropped), (1, 1), "bounded in bytes");
        q.push(item(3, 100));
        assert_eq!(q.begin_flush(1_000).unwrap().1, 1, "a batch takes at least one item, then stops at the byte bound");
    }
}
