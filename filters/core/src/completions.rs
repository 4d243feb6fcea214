//! The per-worker queue of completion reports, flushed to the sidecar in batches.
//!
//! HTTP contexts push a [`Completion`] when a request that holds something (a token reservation,
//! a concurrency slot) ends; the worker's root context flushes the queue on its tick with one
//! `POST /v1/completions` per batch, so no request waits on a call for its completion. At most one
//! batch is in flight per worker; a failed batch goes back to the front of the queue. The queue is
//! bounded: past `max_queued` the oldest reports are dropped and counted — a dropped report leaves
//! its reservation charged (never an under-charge) and its slot to expire by timeout.

use std::collections::VecDeque;
use tollgate_wire::{Completion, CompletionBatch};

#[derive(Debug)]
pub struct CompletionQueue {
    pending: VecDeque<Completion>,
    in_flight: Option<Vec<Completion>>,
    max_queued: usize,
    /// Reports dropped because the queue was full.
    pub dropped: u64,
}

impl CompletionQueue {
    pub fn new(max_queued: usize) -> CompletionQueue {
        CompletionQueue { pending: VecDeque::new(), in_flight: None, max_queued: max_queued.max(1), dropped: 0 }
    }

    pub fn push(&mut self, c: Completion) {
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
        let batch: Vec<Completion> = self.pending.drain(..n).collect();
        let body = CompletionBatch { completions: batch };
        match serde_json::to_vec(&body) {
            Ok(bytes) => {
                self.in_flight = Some(body.completions);
                Some(bytes)
            }
            Err(_) => {
                self.dropped += body.completions.len() as u64;
                None
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use tollgate_wire::Ticket;

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
}
