//! The per-worker queue of completion reports, flushed to the sidecar in batches.
//!
//! HTTP contexts push a [`Completion`] when a request that holds something (a token reservation,
//! a concurrency slot) ends; the worker's root context flushes the queue on its tick with one
//! `POST /v1/completions` per batch (crate::flush), so no request waits on a call for its
//! completion. At most one batch is in flight per worker; a failed batch goes back to the front
//! of the queue. The queue is
//! bounded: past `max_queued` the oldest reports are dropped and counted — a dropped report leaves
//! its reservation charged (never an under-charge) and its slot to expire by timeout.
//!
//! The same [`BatchQueue`] carries usage events ([`UsageQueue`], `POST /v1/usage`): there a
//! dropped event is an event lost to billing, so it is counted (`tollgate.usage.dropped`) and the
//! queue is sized for a sidecar outage of a few minutes.

use crate::flush::{Delivery, Outbox};
use std::collections::VecDeque;
use std::marker::PhantomData;
use tollgate_wire::usage::UsageEvent;
use tollgate_wire::Completion;
#[cfg(doc)]
use tollgate_wire::{usage::UsageBatch, CompletionBatch};

/// What a queue carries: an item's JSON in a batch body (of [`CompletionBatch`] or
/// [`UsageBatch`]), and the body's field that holds the items.
pub trait BatchItem: Sized + serde::Serialize {
    /// The batch body's field holding the items.
    const FIELD: &'static str;
}

/// An item as it stands in a batch body: its JSON, written once when it is queued (None: it
/// cannot be encoded, which a derived `Serialize` of these types never is).
pub(crate) fn encode_item<T: serde::Serialize>(item: &T) -> Option<Box<[u8]>> {
    serde_json::to_vec(item).ok().map(Vec::into_boxed_slice)
}

/// `{"FIELD":[item,item,...]}`: the items' JSON as they were queued, byte for byte what
/// serializing the batch whole writes (FIELD is a plain identifier, nothing to escape).
fn batch_body(field: &str, items: &[Box<[u8]>]) -> Vec<u8> {
    let len = items.iter().map(|i| i.len() + 1).sum::<usize>();
    let mut body = Vec::with_capacity(field.len() + len + 8);
    body.extend_from_slice(b"{\"");
    body.extend_from_slice(field.as_bytes());
    body.extend_from_slice(b"\":[");
    for (n, item) in items.iter().enumerate() {
        if n > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item);
    }
    body.extend_from_slice(b"]}");
    body
}

impl BatchItem for Completion {
    const FIELD: &'static str = "completions";
}

impl BatchItem for UsageEvent {
    const FIELD: &'static str = "events";
}

/// A bounded queue of items sent in batches, one batch in flight at a time. An item is kept as
/// its JSON, encoded once when it is queued (decision 227): a batch body is those bytes joined,
/// and a batch sent again is not encoded again.
///
/// Bounds: at most `max_queued` items and `max_bytes` bytes (of their JSON) wait; past either
/// the oldest are dropped and counted. A batch holds at most the flusher's item bound and
/// `max_batch_bytes` bytes (at least one item). A batch the sidecar refuses as too large (413)
/// is split: its items go back to the front and batches are halved until one is taken (then
/// they grow back, doubling); a single item refused as too large is dropped and counted — no
/// batch is ever resent whole forever.
#[derive(Debug)]
pub struct BatchQueue<T> {
    /// Each item's JSON (its length is its size in a batch body, the comma aside).
    pending: VecDeque<Box<[u8]>>,
    /// Bytes of `pending`.
    bytes: usize,
    in_flight: Option<Vec<Box<[u8]>>>,
    max_queued: usize,
    max_bytes: usize,
    max_batch_bytes: usize,
    /// Items per batch while the sidecar refuses larger batches (413).
    split_cap: Option<usize>,
    /// Items dropped because the queue was full (or refused for good by the sidecar).
    pub dropped: u64,
    item: PhantomData<fn(T)>,
}

/// Completion reports (settle reservations, free slots).
pub type CompletionQueue = BatchQueue<Completion>;
/// Usage events (billing).
pub type UsageQueue = BatchQueue<UsageEvent>;

/// The default bounds in bytes: what waits, and one batch (half the sidecar's 2 MiB body limit).
pub const DEFAULT_MAX_QUEUED_BYTES: usize = 32 << 20;
pub const DEFAULT_MAX_BATCH_BYTES: usize = 1 << 20;

impl<T: BatchItem> BatchQueue<T> {
    pub fn new(max_queued: usize) -> BatchQueue<T> {
        BatchQueue::bounded(max_queued, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_BATCH_BYTES)
    }

    /// A queue of at most `max_queued` items and `max_bytes` bytes, sent in batches of at most
    /// `max_batch_bytes`.
    pub fn bounded(max_queued: usize, max_bytes: usize, max_batch_bytes: usize) -> BatchQueue<T> {
        BatchQueue {
            pending: VecDeque::new(),
            bytes: 0,
            in_flight: None,
            max_queued: max_queued.max(1),
            max_bytes: max_bytes.max(1),
            max_batch_bytes: max_batch_bytes.max(1),
            split_cap: None,
            dropped: 0,
            item: PhantomData,
        }
    }

    pub fn push(&mut self, c: T) {
        match encode_item(&c) {
            Some(json) => self.push_encoded(json),
            None => self.dropped += 1,
        }
    }

    /// [`Self::push`] of an item already encoded ([`encode_item`]).
    pub(crate) fn push_encoded(&mut self, json: Box<[u8]>) {
        self.bytes += json.len();
        self.pending.push_back(json);
        self.trim();
    }

    fn trim(&mut self) {
        while self.pending.len() > self.max_queued || self.bytes > self.max_bytes {
            let Some(json) = self.pending.pop_front() else { break };
            self.bytes -= json.len();
            self.dropped += 1;
        }
    }

    /// Reports waiting (not counting a batch in flight).
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Bytes waiting (their JSON; not counting a batch in flight).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Items in the batch in flight (0: none).
    pub(crate) fn in_flight_len(&self) -> usize {
        self.in_flight.as_ref().map_or(0, Vec::len)
    }

    /// Takes up to `max_batch` items (and `max_batch_bytes`, and the split bound after a 413)
    /// as a JSON body to send, unless a batch is in flight or nothing waits.
    pub fn begin_flush(&mut self, max_batch: usize) -> Option<Vec<u8>> {
        self.begin_flush_within(max_batch, self.max_batch_bytes)
    }

    /// [`Self::begin_flush`] with this batch's bound on its items' bytes (each item's JSON and a
    /// comma) instead of the queue's `max_batch_bytes`.
    pub(crate) fn begin_flush_within(&mut self, max_batch: usize, max_batch_bytes: usize) -> Option<Vec<u8>> {
        if self.in_flight.is_some() || self.pending.is_empty() {
            return None;
        }
        let max_items = max_batch.min(self.split_cap.unwrap_or(usize::MAX)).max(1);
        let (mut n, mut size) = (0, 0);
        for json in self.pending.iter().take(max_items) {
            if n > 0 && size + json.len() + 1 > max_batch_bytes {
                break;
            }
            size += json.len() + 1;
            n += 1;
        }
        let batch: Vec<Box<[u8]>> = self.pending.drain(..n).collect();
        self.bytes -= batch.iter().map(|j| j.len()).sum::<usize>();
        let body = batch_body(T::FIELD, &batch);
        self.in_flight = Some(batch);
        Some(body)
    }

    /// Whether no batch is in flight and a whole one waits: `max_batch` items (or the split
    /// bound after a 413), or `max_batch_bytes` of them.
    pub(crate) fn full_batch_waits_within(&self, max_batch: usize, max_batch_bytes: usize) -> bool {
        let max_items = max_batch.min(self.split_cap.unwrap_or(usize::MAX)).max(1);
        self.in_flight.is_none() && (self.pending.len() >= max_items || self.bytes + self.pending.len() >= max_batch_bytes)
    }

    /// The sidecar refused the in-flight batch for good (retrying cannot help): it is dropped
    /// and counted.
    pub fn discard_in_flight(&mut self) {
        if let Some(batch) = self.in_flight.take() {
            self.dropped += batch.len() as u64;
        }
    }

    /// The in-flight batch was delivered (`ok`) or must be retried.
    pub fn end_flush(&mut self, ok: bool) {
        if let Some(batch) = self.in_flight.take() {
            if ok {
                // batches grow back after a split
                self.split_cap = self.split_cap.and_then(|c| c.checked_mul(2));
            } else {
                self.requeue(batch);
            }
        }
    }

    /// The sidecar refused the in-flight batch as too large (413): it is split (see the type's
    /// docs).
    pub fn split_in_flight(&mut self) {
        let Some(batch) = self.in_flight.take() else { return };
        if batch.len() <= 1 {
            self.dropped += batch.len() as u64;
            return;
        }
        self.split_cap = Some(batch.len() / 2);
        self.requeue(batch);
    }

    fn requeue(&mut self, batch: Vec<Box<[u8]>>) {
        for json in batch.into_iter().rev() {
            self.bytes += json.len();
            self.pending.push_front(json);
        }
        self.trim();
    }

    /// Items per batch while a split after a 413 is in force.
    pub fn split_cap(&self) -> Option<usize> {
        self.split_cap
    }

    /// Items waiting or in flight.
    pub fn waiting(&self) -> usize {
        self.pending.len() + self.in_flight_len()
    }

    /// Drops every item waiting or in flight, counted as dropped (a root context's end ran out
    /// of time: crate::worker).
    pub fn abandon(&mut self) {
        self.dropped += self.waiting() as u64;
        self.pending.clear();
        self.bytes = 0;
        self.in_flight = None;
    }
}

/// A batch that was not taken goes back to the front (sent again); one refused for good is
/// dropped and counted; one refused as too large is split.
impl<T: BatchItem> Outbox for BatchQueue<T> {
    fn dropped(&self) -> u64 {
        self.dropped
    }
    fn take_batch(&mut self, max: usize) -> Option<Vec<u8>> {
        self.begin_flush(max)
    }
    fn full_batch_waits(&self, max: usize) -> bool {
        self.full_batch_waits_within(max, self.max_batch_bytes)
    }
    fn waiting(&self) -> usize {
        BatchQueue::waiting(self)
    }
    fn abandon(&mut self) {
        BatchQueue::abandon(self);
    }
    fn settle(&mut self, delivery: Delivery) {
        match delivery {
            Delivery::Delivered => self.end_flush(true),
            Delivery::Failed => self.end_flush(false),
            Delivery::Refused => self.discard_in_flight(),
            Delivery::TooLarge => self.split_in_flight(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use tollgate_wire::usage::UsageBatch;
    use tollgate_wire::{CompletionBatch, Ticket};

    fn c(id: &str) -> Completion {
        Completion {
            ticket: Ticket::new("t", id, vec![], vec![]),
            status: 200,
            tokens: None,
            llm: None,
        }
    }

    fn ids(body: &[u8]) -> Vec<String> {
        let b: CompletionBatch = serde_json::from_slice(body).unwrap();
        b.completions.into_iter().map(|c| c.ticket.request_id).collect()
    }

    #[test]
    fn batches_one_at_a_time_and_retries_failed_ones_first() {
        let mut q = CompletionQueue::new(100);
        for i in 0..5 {
            q.push(c(&i.to_string()));
        }
        let b = q.begin_flush(3).unwrap();
        assert_eq!(ids(&b), ["0", "1", "2"]);
        assert!(q.begin_flush(3).is_none(), "one batch in flight at a time");
        q.push(c("5"));
        q.end_flush(false);
        assert_eq!(ids(&q.begin_flush(10).unwrap()), ["0", "1", "2", "3", "4", "5"]);
        q.end_flush(true);
        assert!(q.is_empty());
        assert!(q.begin_flush(10).is_none());
    }

    #[test]
    fn bounded_dropping_the_oldest() {
        let mut q = CompletionQueue::new(3);
        for i in 0..5 {
            q.push(c(&i.to_string()));
        }
        assert_eq!(q.len(), 3);
        assert_eq!(q.dropped, 2);
        assert_eq!(ids(&q.begin_flush(10).unwrap()), ["2", "3", "4"]);
    }

    #[test]
    fn a_refused_batch_is_dropped_and_counted() {
        let mut q = UsageQueue::new(10);
        for i in 0..3 {
            q.push(UsageEvent {
                id: i.to_string(),
                tenant: "t".into(),
                key_id: "k".into(),
                plan: "p".into(),
                method: "GET".into(),
                authority: "a".into(),
                path: "/".into(),
                status: 200,
                start_ms: 1,
                duration_ms: 0,
                tokens: None,
                tokens_unread: false,
                request_bytes: None,
                response_bytes: None,
                denied: None,
                route: None,
                product: None,
                llm: None,
            });
        }
        let body = q.begin_flush(2).unwrap();
        let b: UsageBatch = serde_json::from_slice(&body).unwrap();
        assert_eq!(b.events.len(), 2);
        q.discard_in_flight();
        assert_eq!((q.dropped, q.len(), q.in_flight()), (2, 1, false));
    }

    fn ev(id: usize, host_len: usize) -> UsageEvent {
        UsageEvent { id: format!("{id:032}"), authority: "h".repeat(host_len), start_ms: 1, ..UsageEvent::default() }
    }

    fn event_ids(body: &[u8]) -> Vec<String> {
        let b: UsageBatch = serde_json::from_slice(body).unwrap();
        b.events.into_iter().map(|e| e.id).collect()
    }

    #[test]
    fn a_batch_body_is_what_serializing_the_batch_whole_writes() {
        // the items' JSON as queued, joined: byte for byte the derived encoding of the batch, for
        // a batch sent at once and for one sent again after a failure
        let events: Vec<UsageEvent> = (0..5).map(|i| ev(i, 3 + i)).collect();
        let mut q = UsageQueue::new(100);
        for e in &events {
            q.push(e.clone());
        }
        let whole = |events: &[UsageEvent]| serde_json::to_vec(&UsageBatch { events: events.to_vec() }).unwrap();
        let first = q.begin_flush(3).unwrap();
        assert_eq!(first, whole(&events[..3]));
        q.end_flush(false);
        assert_eq!(q.begin_flush(10).unwrap(), whole(&events));
        let mut one = UsageQueue::new(1);
        one.push(events[4].clone());
        assert_eq!(one.begin_flush(1).unwrap(), whole(&events[4..]));
        let mut q = CompletionQueue::new(10);
        q.push(c("r"));
        assert_eq!(q.begin_flush(1).unwrap(), serde_json::to_vec(&CompletionBatch { completions: vec![c("r")] }).unwrap());
    }

    #[test]
    fn the_queue_is_bounded_in_bytes_dropping_the_oldest() {
        let one = encode_item(&ev(0, 1_000)).unwrap().len();
        let mut q = UsageQueue::bounded(1_000, one * 3, 1 << 20);
        for i in 0..5 {
            q.push(ev(i, 1_000));
        }
        assert_eq!((q.len(), q.dropped, q.bytes()), (3, 2, one * 3), "three events' bytes, whatever the count bound");
        assert_eq!(event_ids(&q.begin_flush(100).unwrap()), [2, 3, 4].map(|i| format!("{i:032}")));
        assert_eq!(q.bytes(), 0, "the batch in flight is not waiting");
        q.end_flush(false);
        assert_eq!((q.len(), q.bytes()), (3, one * 3), "a failed batch waits again, bytes and all");
    }

    #[test]
    fn a_batch_is_bounded_in_bytes_but_takes_at_least_one_item() {
        let one = encode_item(&ev(0, 1_000)).unwrap().len();
        let mut q = UsageQueue::bounded(1_000, 1 << 30, (one + 1) * 4 + 20);
        for i in 0..10 {
            q.push(ev(i, 1_000));
        }
        let body = q.begin_flush(1_000).unwrap();
        assert_eq!(event_ids(&body).len(), 4);
        assert!(body.len() <= (one + 1) * 4 + 20, "{} bytes", body.len());
        q.end_flush(true);
        // an item larger than the bound still goes, alone
        let mut q = UsageQueue::bounded(1_000, 1 << 30, 100);
        q.push(ev(1, 1_000));
        q.push(ev(2, 1));
        assert_eq!(event_ids(&q.begin_flush(1_000).unwrap()).len(), 1);
    }

    /// Drives an [`Outbox`] holding 8 items numbered 0 to 7 through 413s: its batch is halved
    /// down to one item, which is dropped and counted; then batches grow back, doubling, and a
    /// batch of 4 is left in flight. `take`: a batch's item numbers; `state`: (waiting, dropped,
    /// split bound).
    pub(crate) fn split_on_413_then_grow_back<Q: Outbox>(
        q: &mut Q,
        take: impl Fn(&mut Q) -> Vec<usize>,
        state: impl Fn(&Q) -> (usize, u64, Option<usize>),
    ) {
        assert_eq!(take(q).len(), 8);
        q.settle(Delivery::TooLarge);
        assert_eq!(state(q), (8, 0, Some(4)), "back at the front, halved");
        for n in [4, 2, 1] {
            assert_eq!(take(q).len(), n);
            q.settle(Delivery::TooLarge);
        }
        assert_eq!((state(q).0, state(q).1), (7, 1), "a single item refused as too large is dropped and counted");
        assert_eq!(take(q)[0], 1, "in order, the oldest first");
        q.settle(Delivery::Delivered);
        assert_eq!(state(q).2, Some(2), "batches grow back once one is taken");
        assert_eq!(take(q).len(), 2);
        q.settle(Delivery::Delivered);
        assert_eq!(take(q).len(), 4);
    }

    #[test]
    fn a_batch_refused_as_too_large_is_split_never_resent_whole() {
        let mut q = UsageQueue::new(1_000);
        for i in 0..8 {
            q.push(ev(i, 10));
        }
        let take = |q: &mut UsageQueue| event_ids(&q.begin_flush(100).unwrap()).iter().map(|id| id.parse().unwrap()).collect();
        split_on_413_then_grow_back(&mut q, take, |q| (q.len(), q.dropped, q.split_cap()));
        q.settle(Delivery::Delivered);
        assert!(q.is_empty());
        assert_eq!(q.dropped, 1);
    }

}
