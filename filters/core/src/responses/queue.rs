//! The per-worker queue of responses to store, and what a request keeps of its response until
//! it is complete ([`PendingStore`]).

use crate::flush::{Delivery, Outbox};
use std::collections::VecDeque;
use tollgate_wire::responses::StoreItem;
#[cfg(doc)]
use tollgate_wire::responses::RESPONSES_BODY_LIMIT;
use tollgate_wire::Header;

/// The per-worker queue of finished responses to store, sent in batches by the root context's
/// tick. Bounded in items and bytes; past either bound new items are dropped and counted.
///
/// Sizes are exact: an item counts the bytes of its JSON in the batch body (status, headers, the
/// body JSON-escaped or base64, the ticket), so a batch bounded by `max_batch_bytes` is a body of
/// at most that many bytes (plus the 16 of `{"responses":[]}`) — always below the sidecar's limit
/// for `POST /v1/responses` ([`RESPONSES_BODY_LIMIT`]) when the bound is. A batch refused as too
/// large anyway (413) is split: its items go back to the front and batches are halved until one
/// is taken (then they grow back); a single item refused as too large is dropped and counted.
/// Any other failure drops the batch (storing is best effort, never retried).
#[derive(Debug)]
pub struct ResponseQueue {
    pending: VecDeque<(StoreItem, usize)>,
    bytes: usize,
    max_items: usize,
    max_bytes: usize,
    /// The batch in flight.
    in_flight: Option<Vec<(StoreItem, usize)>>,
    /// Items per batch while the sidecar refuses larger batches (413).
    split_cap: Option<usize>,
    /// Items dropped: the queue was full, or their batch failed.
    pub dropped: u64,
}

/// Bytes of `{"responses":[` and `]}` around a batch's items.
pub const BATCH_OVERHEAD: usize = 16;

impl ResponseQueue {
    pub fn new(max_items: usize, max_bytes: usize) -> ResponseQueue {
        ResponseQueue {
            pending: VecDeque::new(),
            bytes: 0,
            max_items: max_items.max(1),
            max_bytes,
            in_flight: None,
            split_cap: None,
            dropped: 0,
        }
    }

    pub fn push(&mut self, item: StoreItem) {
        // its JSON and the comma before it
        let size = crate::completions::encoded_len(&item) + 1;
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

    /// Bytes waiting (their JSON in a batch body; not counting a batch in flight).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Items per batch while a split after a 413 is in force.
    pub fn split_cap(&self) -> Option<usize> {
        self.split_cap
    }

    /// A batch body of at most `max_batch_bytes` (at least one item; at most the split bound
    /// after a 413), unless one is in flight or nothing waits.
    pub fn begin_flush(&mut self, max_batch_bytes: usize) -> Option<(Vec<u8>, usize)> {
        if self.in_flight.is_some() || self.pending.is_empty() {
            return None;
        }
        let max_items = self.split_cap.unwrap_or(usize::MAX).max(1);
        let (mut n, mut size) = (0, BATCH_OVERHEAD);
        for (_, s) in self.pending.iter().take(max_items) {
            if n > 0 && size + s > max_batch_bytes {
                break;
            }
            size += s;
            n += 1;
        }
        let batch: Vec<(StoreItem, usize)> = self.pending.drain(..n).collect();
        self.bytes -= batch.iter().map(|(_, s)| s).sum::<usize>();
        let items: Vec<&StoreItem> = batch.iter().map(|(i, _)| i).collect();
        let mut body = Vec::with_capacity(size);
        body.extend_from_slice(b"{\"responses\":");
        match serde_json::to_writer(&mut body, &items) {
            Ok(()) => {
                body.push(b'}');
                self.in_flight = Some(batch);
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
        if self.in_flight.take().is_some() {
            self.dropped += failed as u64;
            if failed == 0 {
                // batches grow back after a split
                self.split_cap = self.split_cap.and_then(|c| c.checked_mul(2));
            }
        }
    }

    /// The sidecar refused the batch in flight as too large (413): it is split (see the type's
    /// docs), never dropped whole.
    pub fn split_in_flight(&mut self) {
        let Some(batch) = self.in_flight.take() else { return };
        if batch.len() <= 1 {
            self.dropped += batch.len() as u64;
            return;
        }
        self.split_cap = Some(batch.len() / 2);
        for (item, size) in batch.into_iter().rev() {
            self.bytes += size;
            self.pending.push_front((item, size));
        }
    }
}

/// A batch is sent once: one that was not taken is dropped and counted; one refused as too large
/// is split.
impl Outbox for ResponseQueue {
    fn dropped(&self) -> u64 {
        self.dropped
    }
    fn take_batch(&mut self, max_bytes: usize) -> Option<Vec<u8>> {
        self.begin_flush(max_bytes).map(|(body, _)| body)
    }
    fn settle(&mut self, delivery: Delivery) {
        let in_flight = self.in_flight.as_ref().map_or(0, Vec::len);
        match delivery {
            Delivery::Delivered => self.end_flush(0),
            Delivery::TooLarge => self.split_in_flight(),
            Delivery::Failed | Delivery::Refused => self.end_flush(in_flight),
        }
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
    use crate::flush::Delivery;
    use tollgate_wire::responses::{StoreBatch, StoreTicket, StoredResponse, MAX_STORED_BODY, RESPONSES_BODY_LIMIT};
    use tollgate_wire::Header;

    fn item(n: usize, body: usize) -> StoreItem {
        StoreItem {
            ticket: StoreTicket::Cache { tenant: "t".into(), route: "r".into(), hash: n.to_string(), seal: Default::default() },
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

    fn heavy(n: usize, body: Vec<u8>) -> StoreItem {
        let headers = (0..20).map(|i| Header::new(format!("x-h{i}"), "v\"\\".repeat(50))).collect();
        StoreItem {
            ticket: StoreTicket::Cache { tenant: "t".into(), route: "r".into(), hash: n.to_string(), seal: Default::default() },
            response: Some(StoredResponse::new(200, headers, body, 0)),
        }
    }

    #[test]
    fn a_batch_is_bounded_by_its_serialized_size_headers_escaping_and_base64_included() {
        // bodies that JSON escaping inflates 6x (control characters) or 2x (quotes), base64
        // (4/3), and many escaped headers: the raw body length says little about the batch
        let bodies = [vec![1u8; 8_000], vec![b'"'; 8_000], vec![0xff; 8_000], b"plain".repeat(1_600)];
        let mut q = ResponseQueue::new(1_000, 1 << 30);
        for i in 0..40 {
            q.push(heavy(i, bodies[i % 4].clone()));
        }
        let waiting = q.bytes();
        let bound = 64 << 10;
        let mut sent = 0;
        while let Some((body, n)) = q.begin_flush(bound) {
            assert!(body.len() <= bound, "a batch of {} bytes over its bound of {bound}", body.len());
            let b: StoreBatch = serde_json::from_slice(&body).unwrap();
            assert_eq!(b.responses.len(), n);
            sent += body.len() - (BATCH_OVERHEAD - 1);
            q.settle(Delivery::Delivered);
        }
        assert_eq!((q.len(), q.dropped), (0, 0));
        assert_eq!(sent, waiting, "the sizes counted are the bytes sent, exactly");
        // the largest item the sidecar may store, at its worst inflation, fits its limit alone
        let mut q = ResponseQueue::new(10, 1 << 30);
        q.push(heavy(0, vec![1u8; MAX_STORED_BODY]));
        let (body, _) = q.begin_flush(4 << 20).unwrap();
        assert!(body.len() > 6 * MAX_STORED_BODY && body.len() < RESPONSES_BODY_LIMIT, "{}", body.len());
    }

    #[test]
    fn a_batch_refused_as_too_large_is_split_never_dropped_whole() {
        let mut q = ResponseQueue::new(100, 1 << 30);
        for i in 0..8 {
            q.push(item(i, 100));
        }
        let take = |q: &mut ResponseQueue| q.begin_flush(1 << 20).unwrap().1;
        assert_eq!(take(&mut q), 8);
        q.settle(Delivery::TooLarge);
        assert_eq!((q.len(), q.dropped, q.split_cap()), (8, 0, Some(4)), "back at the front, halved");
        assert_eq!(take(&mut q), 4);
        q.settle(Delivery::TooLarge);
        assert_eq!(take(&mut q), 2);
        q.settle(Delivery::TooLarge);
        assert_eq!(take(&mut q), 1);
        q.settle(Delivery::TooLarge);
        assert_eq!((q.len(), q.dropped), (7, 1), "a single item refused as too large is dropped and counted");
        let (body, _) = q.begin_flush(1 << 20).unwrap();
        let b: StoreBatch = serde_json::from_slice(&body).unwrap();
        assert_eq!(b.responses[0].ticket, item(1, 0).ticket, "in order, the oldest first");
        q.settle(Delivery::Delivered);
        assert_eq!(q.split_cap(), Some(2), "batches grow back once one is taken");
        assert_eq!(take(&mut q), 2);
        q.settle(Delivery::Delivered);
        assert_eq!(take(&mut q), 4);
        q.settle(Delivery::Failed);
        assert_eq!((q.len(), q.dropped), (0, 5), "any other failure drops the batch (best effort)");
    }
}
