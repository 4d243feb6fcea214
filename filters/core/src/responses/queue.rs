//! The per-worker queue of responses to store, and what a request keeps of its response until
//! it is complete ([`PendingStore`]).

use crate::completions::{encode_item, BatchItem, BatchQueue};
use crate::flush::{Delivery, Outbox};
use tollgate_wire::responses::StoreItem;
#[cfg(doc)]
use tollgate_wire::responses::RESPONSES_BODY_LIMIT;
use tollgate_wire::Header;

/// The per-worker queue of finished responses to store, sent in batches by the root context's
/// tick: a [`BatchQueue`] with two rules of its own. Bounded in items and bytes, but past either
/// bound the *new* item is dropped and counted; and a batch is sent once: any failure but a 413
/// drops it (storing is best effort, never retried).
///
/// Sizes are exact: an item counts the bytes of its JSON in the batch body (status, headers, the
/// body JSON-escaped or base64, the ticket) and its comma, so a batch bounded by `max_batch_bytes`
/// is a body of at most that many bytes (the 16 of `{"responses":[]}` included) — always below
/// the sidecar's limit for `POST /v1/responses` ([`RESPONSES_BODY_LIMIT`]) when the bound is. A
/// batch refused as too large anyway (413) is split as the [`BatchQueue`] splits: its items go
/// back to the front and batches are halved until one is taken (then they grow back); a single
/// item refused as too large is dropped and counted.
#[derive(Debug)]
pub struct ResponseQueue {
    /// Unbounded itself: `push` applies this queue's bounds.
    batches: BatchQueue<StoreItem>,
    max_items: usize,
    max_bytes: usize,
}

/// Bytes of `{"responses":[` and `]}` around a batch's items.
pub const BATCH_OVERHEAD: usize = 16;

impl BatchItem for StoreItem {
    const FIELD: &'static str = "responses";
}

impl ResponseQueue {
    pub fn new(max_items: usize, max_bytes: usize) -> ResponseQueue {
        ResponseQueue {
            batches: BatchQueue::bounded(usize::MAX, usize::MAX, usize::MAX),
            max_items: max_items.max(1),
            max_bytes,
        }
    }

    pub fn push(&mut self, item: StoreItem) {
        let Some(json) = encode_item(&item) else {
            self.batches.dropped += 1;
            return;
        };
        // its JSON and the comma before it
        if self.len() >= self.max_items || self.bytes() + json.len() + 1 > self.max_bytes {
            self.batches.dropped += 1;
            return;
        }
        self.batches.push_encoded(json);
    }

    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Bytes waiting (their JSON and commas in a batch body; not counting a batch in flight).
    pub fn bytes(&self) -> usize {
        self.batches.bytes() + self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Items dropped: the queue was full, or their batch failed.
    pub fn dropped(&self) -> u64 {
        self.batches.dropped
    }

    /// Items per batch while a split after a 413 is in force.
    pub fn split_cap(&self) -> Option<usize> {
        self.batches.split_cap()
    }

    /// A batch body of at most `max_batch_bytes` and its item count (at least one item; at most
    /// the split bound after a 413), unless one is in flight or nothing waits.
    pub fn begin_flush(&mut self, max_batch_bytes: usize) -> Option<(Vec<u8>, usize)> {
        let body = self.batches.begin_flush_within(usize::MAX, max_batch_bytes.saturating_sub(BATCH_OVERHEAD))?;
        Some((body, self.batches.in_flight_len()))
    }

    /// The batch in flight is done; `failed` of its items did not get through (not retried).
    pub fn end_flush(&mut self, failed: usize) {
        if failed == 0 {
            self.batches.end_flush(true);
        } else {
            self.batches.discard_in_flight();
        }
    }
}

/// A batch is sent once: one that was not taken is dropped and counted; one refused as too large
/// is split.
impl Outbox for ResponseQueue {
    fn dropped(&self) -> u64 {
        self.batches.dropped
    }
    fn take_batch(&mut self, max_bytes: usize) -> Option<Vec<u8>> {
        self.begin_flush(max_bytes).map(|(body, _)| body)
    }
    fn full_batch_waits(&self, max_bytes: usize) -> bool {
        self.batches.full_batch_waits_within(usize::MAX, max_bytes.saturating_sub(BATCH_OVERHEAD))
    }
    fn waiting(&self) -> usize {
        self.batches.waiting()
    }
    fn abandon(&mut self) {
        self.batches.abandon();
    }
    fn settle(&mut self, delivery: Delivery) {
        match delivery {
            Delivery::Delivered => self.batches.end_flush(true),
            Delivery::TooLarge => self.batches.split_in_flight(),
            Delivery::Failed | Delivery::Refused => self.batches.discard_in_flight(),
        }
    }
}

/// A stored-response ticket's request, kept until the response is complete. Not `Clone`: its
/// claim is open while it lives (decision 186).
#[derive(Debug)]
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
    /// An idempotency claim, kept by the worker while the request runs (decision 186).
    pub claim: Option<std::rc::Rc<super::claims::OpenClaim>>,
    /// A cache fill's own freshness left, when its `Cache-Control` says one (decision 211).
    pub max_age_ms: Option<u64>,
}

impl PendingStore {
    pub fn new(ticket: tollgate_wire::responses::StoreTicket, max_body: usize) -> PendingStore {
        PendingStore { ticket, status: 0, headers: Vec::new(), storable: false, max_body, complete: false, claim: None, max_age_ms: None }
    }

    /// Keeps its idempotency claim in `book` while the request runs (from `now_ms`).
    pub fn kept_in(mut self, book: &std::rc::Rc<std::cell::RefCell<super::claims::ClaimBook>>, now_ms: u64) -> PendingStore {
        self.claim = super::claims::OpenClaim::open(book, &self.ticket, now_ms).map(std::rc::Rc::new);
        self
    }

    /// Its ticket as it is now: an idempotency claim's is sealed again while the worker keeps it.
    pub fn current_ticket(&self) -> tollgate_wire::responses::StoreTicket {
        self.claim.as_ref().and_then(|c| c.ticket()).unwrap_or_else(|| self.ticket.clone())
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
    use crate::completions::tests::split_on_413_then_grow_back;
    use crate::flush::Delivery;
    use tollgate_wire::responses::{StoreBatch, StoreTicket, StoredResponse, MAX_STORED_BODY, RESPONSES_BODY_LIMIT};
    use tollgate_wire::Header;

    fn item(n: usize, body: usize) -> StoreItem {
        StoreItem {
            ticket: StoreTicket::Cache { tenant: "t".into(), plan: "p".into(), route: "r".into(), hash: n.to_string(), seal: Default::default() },
            response: Some(StoredResponse::new(200, vec![], vec![b'a'; body], 0)),
            max_age_ms: None,
        }
    }

    #[test]
    fn the_queue_is_bounded_and_sends_each_batch_once() {
        let mut q = ResponseQueue::new(3, 10_000);
        for i in 0..4 {
            q.push(item(i, 10));
        }
        assert_eq!((q.len(), q.dropped()), (3, 1));
        let (body, n) = q.begin_flush(1 << 20).unwrap();
        assert_eq!(n, 3);
        let b: StoreBatch = serde_json::from_slice(&body).unwrap();
        assert_eq!(b.responses.len(), 3);
        q.push(item(9, 10));
        assert!(q.begin_flush(1 << 20).is_none(), "one batch in flight");
        q.end_flush(3);
        assert_eq!(q.dropped(), 4, "a failed batch is dropped, not retried");
        assert_eq!(q.begin_flush(1 << 20).unwrap().1, 1);
        q.end_flush(0);
        assert!(q.is_empty());

        let mut q = ResponseQueue::new(100, 5_000);
        q.push(item(1, 3_000));
        q.push(item(2, 3_000));
        assert_eq!((q.len(), q.dropped()), (1, 1), "bounded in bytes");
        q.push(item(3, 100));
        assert_eq!(q.begin_flush(1_000).unwrap().1, 1, "a batch takes at least one item, then stops at the byte bound");
    }

    fn heavy(n: usize, body: Vec<u8>) -> StoreItem {
        let headers = (0..20).map(|i| Header::new(format!("x-h{i}"), "v\"\\".repeat(50))).collect();
        StoreItem {
            ticket: StoreTicket::Cache { tenant: "t".into(), plan: "p".into(), route: "r".into(), hash: n.to_string(), seal: Default::default() },
            response: Some(StoredResponse::new(200, headers, body, 0)),
            max_age_ms: None,
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
        assert_eq!((q.len(), q.dropped()), (0, 0));
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
        let take = |q: &mut ResponseQueue| {
            let (body, n) = q.begin_flush(1 << 20).unwrap();
            let b: StoreBatch = serde_json::from_slice(&body).unwrap();
            assert_eq!(b.responses.len(), n);
            b.responses.iter().map(|r| item_number(&r.ticket)).collect()
        };
        split_on_413_then_grow_back(&mut q, take, |q| (q.len(), q.dropped(), q.split_cap()));
        q.settle(Delivery::Failed);
        assert_eq!((q.len(), q.dropped()), (0, 5), "any other failure drops the batch (best effort)");
    }

    /// `n` of the [`item`] whose ticket this is.
    fn item_number(ticket: &StoreTicket) -> usize {
        let StoreTicket::Cache { hash, .. } = ticket else { panic!("{ticket:?}") };
        hash.parse().unwrap()
    }

}
