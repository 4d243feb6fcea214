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
use tollgate_wire::usage::UsageEvent;
use tollgate_wire::Completion;
#[cfg(doc)]
use tollgate_wire::{usage::UsageBatch, CompletionBatch};

/// What a queue carries: how a batch of items becomes a request body (the JSON of
/// [`CompletionBatch`] or [`UsageBatch`]).
pub trait BatchItem: Sized + serde::Serialize {
    /// The batch body's field holding the items.
    const FIELD: &'static str;
    fn encode(batch: &[Self]) -> Option<Vec<u8>> {
        // `{"FIELD":[...]}` written straight out (no intermediate JSON value of the batch);
        // FIELD is a plain identifier, nothing to escape
        let mut body = Vec::with_capacity(16 + batch.len() * 256);
        body.extend_from_slice(b"{\"");
        body.extend_from_slice(Self::FIELD.as_bytes());
        body.extend_from_slice(b"\":");
        serde_json::to_writer(&mut body, batch).ok()?;
        body.push(b'}');
        Some(body)
    }
}

impl BatchItem for Completion {
    const FIELD: &'static str = "completions";
}

impl BatchItem for UsageEvent {
    const FIELD: &'static str = "events";
}

/// A bounded queue of items sent in batches, one batch in flight at a time.
#[derive(Debug)]
pub struct BatchQueue<T> {
    pending: VecDeque<T>,
    in_flight: Option<Vec<T>>,
    max_queued: usize,
    /// Items dropped because the queue was full (or refused for good by the sidecar).
    pub dropped: u64,
}

/// Completion reports (settle reservations, free slots).
pub type CompletionQueue = BatchQueue<Completion>;
/// Usage events (billing).
pub type UsageQueue = BatchQueue<UsageEvent>;

impl<T: BatchItem> BatchQueue<T> {
    pub fn new(max_queued: usize) -> BatchQueue<T> {
        BatchQueue { pending: VecDeque::new(), in_flight: None, max_queued: max_queued.max(1), dropped: 0 }
    }

    pub fn push(&mut self, c: T) {
        self.pending.push_back(c);
        self.trim();
    }

    fn trim(&mut self) {
        while self.pending.len() > self.max_queued {
            self.pending.pop_front();
            self.dropped += 1;
        }
    }

    /// Reports waiting (not counting a batch in flight).
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Takes up to `max_batch` reports as a JSON body to send, unless a batch is in flight or
    /// nothing waits.
    pub fn begin_flush(&mut self, max_batch: usize) -> Option<Vec<u8>> {
        if self.in_flight.is_some() || self.pending.is_empty() {
            return None;
        }
        let n = self.pending.len().min(max_batch.max(1));
        let batch: Vec<T> = self.pending.drain(..n).collect();
        match T::encode(&batch) {
            Some(bytes) => {
                self.in_flight = Some(batch);
                Some(bytes)
            }
            None => {
                self.dropped += batch.len() as u64;
                None
            }
        }
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
            if !ok {
                for c in batch.into_iter().rev() {
                    self.pending.push_front(c);
                }
                self.trim();
            }
        }
    }
}

/// A batch that was not taken goes back to the front (sent again); one refused for good is
/// dropped and counted.
impl<T: BatchItem> Outbox for BatchQueue<T> {
    fn dropped(&self) -> u64 {
        self.dropped
    }
    fn take_batch(&mut self, max: usize) -> Option<Vec<u8>> {
        self.begin_flush(max)
    }
    fn settle(&mut self, delivery: Delivery) {
        match delivery {
            Delivery::Delivered => self.end_flush(true),
            Delivery::Failed => self.end_flush(false),
            Delivery::Refused => self.discard_in_flight(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use tollgate_wire::usage::UsageBatch;
    use tollgate_wire::{CompletionBatch, Ticket};

    fn c(id: &str) -> Completion {
        Completion {
            ticket: Ticket { tenant: "t".into(), request_id: id.into(), budgets: vec![], slots: vec![] },
            status: 200,
            tokens: None,
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
                request_bytes: None,
                response_bytes: None,
                denied: None,
                route: None,
                product: None,
            });
        }
        let body = q.begin_flush(2).unwrap();
        let b: UsageBatch = serde_json::from_slice(&body).unwrap();
        assert_eq!(b.events.len(), 2);
        q.discard_in_flight();
        assert_eq!((q.dropped, q.len(), q.in_flight()), (2, 1, false));
    }
}
