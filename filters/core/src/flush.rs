//! The batch flusher: one background job that sends a worker's queue to the sidecar in
//! batches, one batch in flight at a time, counting what happens under its stream's counters
//! (`tollgate.{completions,usage,responses}.{batches_sent,dropped,flush_errors}`).
//!
//! What becomes of a batch the sidecar did not take is the queue's to say ([`Outbox::settle`]):
//! completion reports go back to the front and are sent again, usage events stay queued until a
//! 200 (and are dropped when the sidecar refuses them for good), responses to store are sent
//! once. A batch refused as too large (413) is split by its queue, never resent whole. The flusher only tells the queue how the call went ([`Delivery`]).

use crate::host::{Host, LogLevel};
use crate::jobs::{Every, Job};
use crate::sidecar::Sidecar;
use crate::stats::{FlushEvent, Metric, Stream};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// How a batch's call went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The sidecar took it (200).
    Delivered,
    /// Not sent, or not taken: the queue retries or drops it, by its own rule.
    Failed,
    /// Refused for good (a status in [`FlushSpec::refused`]): retrying cannot help.
    Refused,
    /// Refused as too large (413): the queue splits it, or drops a single item (never resends
    /// the same batch whole).
    TooLarge,
}

/// A queue a [`BatchFlusher`] sends.
pub trait Outbox {
    /// Items lost so far (the queue was full, or their batch was dropped).
    fn dropped(&self) -> u64;
    /// The next batch's body (at most `max` in the queue's unit: items, or bytes), unless a batch
    /// is in flight or nothing waits.
    fn take_batch(&mut self, max: usize) -> Option<Vec<u8>>;
    /// The batch in flight is settled.
    fn settle(&mut self, delivery: Delivery);
    /// Whether no batch is in flight and a whole one (`max`, in the queue's unit, or its bytes'
    /// bound) waits: the flusher sends it at once instead of at its next turn.
    fn full_batch_waits(&self, max: usize) -> bool;
    /// Items waiting or in flight.
    fn waiting(&self) -> usize;
    /// Drops every item waiting or in flight, counted in [`Outbox::dropped`].
    fn abandon(&mut self);
}

/// What a flusher sends, where, and how it reads the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlushSpec {
    /// Whose counters it bumps.
    pub stream: Stream,
    /// What its batches carry, for log lines.
    pub what: &'static str,
    pub path: &'static str,
    /// A batch's bound, in the queue's unit.
    pub max_batch: usize,
    pub timeout: Duration,
    /// Statuses that refuse a batch for good: it is dropped and counted, and a warning is logged
    /// once, until the sidecar takes a batch again.
    pub refused: &'static [u16],
}

impl FlushSpec {
    /// A stream's batches to `path`, refused for good by no status.
    pub const fn new(stream: Stream, what: &'static str, path: &'static str, max_batch: usize, timeout: Duration) -> FlushSpec {
        FlushSpec { stream, what, path, max_batch, timeout, refused: &[] }
    }

    /// Batches answered with one of `statuses` are refused for good.
    pub const fn refused_by(self, statuses: &'static [u16]) -> FlushSpec {
        FlushSpec { refused: statuses, ..self }
    }
}

/// Sends one queue in batches (a [`Job`]).
pub struct BatchFlusher<Q> {
    queue: Rc<RefCell<Q>>,
    spec: FlushSpec,
    sidecar: Sidecar,
    /// The batch in flight.
    token: Option<u32>,
    /// `dropped` as last counted.
    reported_dropped: u64,
    /// The sidecar refuses this stream (logged once).
    refused: bool,
}

impl<Q: Outbox> BatchFlusher<Q> {
    pub fn new(queue: Rc<RefCell<Q>>, spec: FlushSpec, sidecar: Sidecar) -> BatchFlusher<Q> {
        BatchFlusher { queue, spec, sidecar, token: None, reported_dropped: 0, refused: false }
    }

    fn count(&self, host: &mut impl Host, event: FlushEvent, n: u64) {
        if n > 0 {
            host.count_by(Metric::Flush(self.spec.stream, event), n);
        }
    }

    /// Sends the next batch, unless one is in flight or nothing waits.
    fn send(&mut self, host: &mut impl Host) {
        let Some(body) = self.queue.borrow_mut().take_batch(self.spec.max_batch) else { return };
        match host.dispatch(self.sidecar.post_json(self.spec.path, body, self.spec.timeout)) {
            Ok(token) => self.token = Some(token),
            Err(e) => {
                self.queue.borrow_mut().settle(Delivery::Failed);
                self.count(host, FlushEvent::Errors, 1);
                host.log(LogLevel::Debug, &format!("tollgate: cannot send {}: {e}", self.spec.what));
            }
        }
    }

    fn report_dropped(&mut self, host: &mut impl Host) {
        let dropped = self.queue.borrow().dropped();
        self.count(host, FlushEvent::Dropped, dropped.saturating_sub(self.reported_dropped));
        self.reported_dropped = dropped;
    }
}

impl<Q: Outbox> Job for BatchFlusher<Q> {
    /// Sends the next batch, unless one is in flight or nothing waits.
    fn on_tick(&mut self, host: &mut impl Host) {
        self.report_dropped(host);
        self.send(host);
    }

    fn owns(&self, token: u32) -> bool {
        self.token == Some(token)
    }

    /// The status says it all.
    fn reads_body(&self) -> bool {
        false
    }

    fn on_call_response(&mut self, host: &mut impl Host, _token: u32, status: Option<u16>, _body: &[u8]) {
        self.token = None;
        let delivery = match status {
            Some(200) => Delivery::Delivered,
            Some(s) if self.spec.refused.contains(&s) => Delivery::Refused,
            Some(413) => Delivery::TooLarge,
            _ => Delivery::Failed,
        };
        let event = if delivery == Delivery::Delivered { FlushEvent::BatchesSent } else { FlushEvent::Errors };
        self.count(host, event, 1);
        self.queue.borrow_mut().settle(delivery);
        match delivery {
            Delivery::Delivered if self.refused => {
                self.refused = false;
                host.log(LogLevel::Info, &format!("tollgate: the sidecar takes {} again", self.spec.what));
            }
            Delivery::TooLarge => {
                host.log(LogLevel::Info, &format!("tollgate: the sidecar refused a batch of {} as too large (413); splitting it", self.spec.what));
            }
            Delivery::Refused if !self.refused => {
                self.refused = true;
                let what = self.spec.what;
                host.log(LogLevel::Warn, &format!("tollgate: the sidecar refused {what} ({status:?}); they are dropped and counted"));
            }
            _ => {}
        }
        self.report_dropped(host);
        if delivery == Delivery::Delivered && self.queue.borrow().full_batch_waits(self.spec.max_batch) {
            // A backlog: the next batch leaves now, not at the stream's next turn, or a worker
            // could send no more than a batch per turn (1000 usage events a second by default)
            // and drop the rest under steady load with a healthy sidecar.
            self.send(host);
        }
    }
}

/// A job holding items a root context's end must not lose: when Envoy drops a plugin
/// configuration, its root context keeps sending them on its ticks, whatever the job's cadence,
/// until nothing is left or its time is up (crate::worker, `Worker::end`).
pub trait Drain {
    /// Sends what waits now (unless a batch is in flight).
    fn drain(&mut self, host: &mut impl Host);
    /// Items waiting or in flight.
    fn left(&self) -> usize;
    /// Drops what is left, counted as dropped; returns how many.
    fn abandon(&mut self, host: &mut impl Host) -> usize;
}

impl<Q: Outbox> Drain for BatchFlusher<Q> {
    fn drain(&mut self, host: &mut impl Host) {
        self.on_tick(host);
    }
    fn left(&self) -> usize {
        self.queue.borrow().waiting()
    }
    fn abandon(&mut self, host: &mut impl Host) -> usize {
        let left = self.left();
        self.queue.borrow_mut().abandon();
        // an answer to the batch in flight, if one comes, finds nothing to settle
        self.token = None;
        self.report_dropped(host);
        left
    }
}

impl<J: Drain> Drain for Every<J> {
    fn drain(&mut self, host: &mut impl Host) {
        self.job.drain(host);
    }
    fn left(&self) -> usize {
        self.job.left()
    }
    fn abandon(&mut self, host: &mut impl Host) -> usize {
        self.job.abandon(host)
    }
}

impl<J: Drain> Drain for Option<J> {
    fn drain(&mut self, host: &mut impl Host) {
        if let Some(j) = self {
            j.drain(host);
        }
    }
    fn left(&self) -> usize {
        self.as_ref().map_or(0, Drain::left)
    }
    fn abandon(&mut self, host: &mut impl Host) -> usize {
        self.as_mut().map_or(0, |j| j.abandon(host))
    }
}
