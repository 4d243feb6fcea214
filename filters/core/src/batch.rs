//! A worker's decision calls in batches (decision 127).
//!
//! Each decision call costs Envoy far more than the filter's own work (its HTTP client, a stream,
//! the codec: ~25–30 µs of a quiet core), so under concurrency a worker's decisions share calls:
//! - a request whose worker has no decision call out, and none waiting, calls alone, at once
//!   (`/v1/decide`, answered in its own context) — a lone request pays nothing for batching;
//! - otherwise its decision waits here, and leaves with every other one waiting in one
//!   `POST /v1/decide/batch` sent by the root context as soon as no batch of this worker is out
//!   (the adapter wakes the root when the first one waits; each batch's answer sends the next).
//!
//! Every item is decided as if it had come alone (its own decision id, lease ask, traceparent),
//! so exactness, refunds and leases are unchanged. Time is bounded twice by the sidecar timeout:
//! a decision waits at most that long for its batch to leave (past it, it fails without a call:
//! the failure mode applies, nothing was taken, nothing is refunded), and the batch's call has
//! the whole timeout, like a lone call (a batch timed from its oldest item would leave with
//! little time whenever that item had waited out the previous batch, and fail). The answers go
//! back to each request's context by the adapter ([`Delivery`]); a request that ends while it
//! waits is dropped from the queue (nothing taken) or, once sent, refunded like any abandoned
//! decision.

use crate::call_batch::MAX_BATCH_BYTES;
use crate::host::{Host, LogLevel};
use crate::sidecar::{CallStatus, Sidecar};
use crate::stats::Metric;
use serde::Serialize;
use tollgate_wire::batch::{DecideBatchAnswer, DECIDE_BATCH_PATH, MAX_DECIDE_BATCH};
use tollgate_wire::DecideRequest;


pub use crate::delivery::Delivery;

/// A decision waiting for the next batch.
struct Waiting {
    ctx: u32,
    /// The serialized batch item.
    item: Vec<u8>,
    /// When it stops waiting for its batch to leave (the sidecar timeout after it started).
    deadline_ms: u64,
}

/// The batch out: its call's token and its items' contexts, in order (`None`: the request ended).
struct Flight {
    token: u32,
    members: Vec<Option<u32>>,
}

/// What became of a request that ended while its decision was here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// It was still waiting: it is dropped, nothing was asked or taken.
    Unsent,
    /// It rode the batch that is out: the sidecar decides it; its answer will be ignored.
    Sent,
    /// Not here.
    Unknown,
}

/// One worker's decisions: those that went alone and are out, those waiting, the batch out.
#[derive(Default)]
pub struct DecisionBatcher {
    /// Batching is on (the adapter can wake its root context, and the configuration allows it).
    enabled: bool,
    alone_out: usize,
    waiting: Vec<Waiting>,
    flight: Option<Flight>,
    /// The adapter was asked to wake the root, which has not sent yet.
    wake_pending: bool,
    /// The worker's decision stream, when its host has one (crate::stream): a decision goes on
    /// it while it is open, before any call or batch.
    pub stream: crate::stream::DecisionStream,
}

/// A batch item as sent, borrowing the request.
#[derive(Serialize)]
struct ItemRef<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    request: &'a DecideRequest,
}

impl DecisionBatcher {
    pub fn enable(&mut self) {
        self.enabled = true;
    }

    /// Whether a request's decision call goes alone now: batching off, or nothing of this worker
    /// out or waiting.
    pub fn goes_alone(&self) -> bool {
        !self.enabled || (self.alone_out == 0 && self.flight.is_none() && self.waiting.is_empty())
    }

    /// A decision call went alone.
    pub fn went_alone(&mut self) {
        self.alone_out += 1;
    }

    /// A decision call that went alone is over (answered, or its request ended).
    pub fn alone_back(&mut self) {
        self.alone_out = self.alone_out.saturating_sub(1);
    }

    /// Queues a request's decision; `true` when the adapter must wake the root context to send it.
    pub fn push(&mut self, ctx: u32, request: &DecideRequest, traceparent: Option<&str>, deadline_ms: u64) -> Result<bool, String> {
        let item = serde_json::to_vec(&ItemRef { traceparent, request }).map_err(|e| format!("cannot encode decision request: {e}"))?;
        self.waiting.push(Waiting { ctx, item, deadline_ms });
        let wake = self.flight.is_none() && !self.wake_pending;
        self.wake_pending |= wake;
        Ok(wake)
    }

    /// The wake could not be asked for: the root sends at its next tick instead.
    pub fn wake_failed(&mut self) {
        self.wake_pending = false;
    }

    /// A request ended while its decision was here.
    pub fn cancel(&mut self, ctx: u32) -> Cancelled {
        if self.stream.cancel(ctx) {
            return Cancelled::Sent;
        }
        if let Some(i) = self.waiting.iter().position(|w| w.ctx == ctx) {
            self.waiting.remove(i);
            return Cancelled::Unsent;
        }
        match self.flight.as_mut().and_then(|f| f.members.iter_mut().find(|m| **m == Some(ctx))) {
            Some(m) => {
                *m = None;
                Cancelled::Sent
            }
            None => Cancelled::Unknown,
        }
    }

    /// Whether `token` is the batch out.
    pub fn owns(&self, token: u32) -> bool {
        self.flight.as_ref().is_some_and(|f| f.token == token)
    }

    /// At the root context (woken, ticking, or a batch answered): fails the decisions that
    /// waited past their deadline, and sends the others unless a batch is out. Returns the
    /// failures, for the adapter to deliver.
    pub fn send(&mut self, host: &mut impl Host, sidecar: &Sidecar) -> Vec<Delivery> {
        self.wake_pending = false;
        let now = host.now_ms();
        let mut failed = Vec::new();
        self.waiting.retain(|w| {
            let expired = w.deadline_ms <= now;
            if expired {
                failed.push(Delivery::unsent(w.ctx, "waited past the sidecar timeout for its worker's batch".into()));
            }
            !expired
        });
        if self.flight.is_some() || self.waiting.is_empty() {
            return failed;
        }
        let (mut body, mut members) = (b"{\"requests\":[".to_vec(), Vec::new());
        for w in &self.waiting {
            if members.len() == MAX_DECIDE_BATCH || (!members.is_empty() && body.len() + w.item.len() > MAX_BATCH_BYTES) {
                break;
            }
            if !members.is_empty() {
                body.push(b',');
            }
            body.extend_from_slice(&w.item);
            members.push(Some(w.ctx));
        }
        self.waiting.drain(..members.len());
        body.extend_from_slice(b"]}");
        let n = members.len() as u64;
        match host.dispatch(sidecar.post_json(DECIDE_BATCH_PATH, body, sidecar.timeout)) {
            Ok(token) => {
                host.count(Metric::DecisionBatches);
                host.count_by(Metric::DecisionsBatched, n);
                self.flight = Some(Flight { token, members });
            }
            Err(e) => {
                host.log(LogLevel::Warn, &format!("tollgate: cannot send a decision batch: {e}"));
                failed.extend(members.into_iter().flatten().map(|ctx| Delivery::unsent(ctx, format!("cannot call the sidecar: {e}"))));
            }
        }
        failed
    }

    /// The batch's answer: each item's outcome for its request (an item without one fails).
    pub fn on_answer(&mut self, token: u32, status: impl CallStatus, body: &[u8]) -> Vec<Delivery> {
        let Some(flight) = self.flight.take_if(|f| f.token == token) else { return Vec::new() };
        // as crate::sidecar::interpret: a decodable batch answer is the sidecar's 200
        let answers = match serde_json::from_slice::<DecideBatchAnswer>(body) {
            Ok(a) => Ok(a),
            Err(e) => match status.read() {
                Some(200) => Err(format!("undecodable decision batch: {e}")),
                Some(s) => Err(format!("sidecar answered {s}")),
                None => Err("sidecar response has no :status".into()),
            },
        };
        // Answers are matched to requests by position: an answer with more or fewer items than
        // were sent cannot say which is whose (one item dropped mid-list would hand every later
        // request its neighbour's decision, another tenant's identity included), so none is used.
        let n = flight.members.len();
        let answers: Vec<_> = match answers {
            Ok(a) if a.answers.len() == n => a.answers.into_iter().map(|a| a.into_result()).collect(),
            Ok(a) => vec![Err(format!("the decision batch answered {} items for {n}", a.answers.len())); n],
            Err(why) => vec![Err(why); n],
        };
        let sent = |(ctx, answer): (Option<u32>, _)| Some(Delivery { ctx: ctx?, answer, sent: true });
        flight.members.into_iter().zip(answers).filter_map(sent).collect()
    }
}
