//! A worker's decisions on one long-lived gRPC stream to the sidecar (decision 223).
//!
//! A decision call of its own costs Envoy a new HTTP/2 stream through its async HTTP client (the
//! stream, its router, headers both ways: ~190 k instructions, more than Envoy's whole request).
//! On a host that can hold a gRPC stream ([`Host::open_stream`]: the Wasm host), the root
//! context keeps one open per worker, and a request's decision goes on it as one message
//! ([`tollgate_wire::stream`]), sent from the request's own context; its answer comes back on
//! the stream, to the root, which hands it to the request's context like a batch's
//! ([`crate::delivery::Delivery`]). Decisions are pipelined: any number out at once, answered in
//! the order they finish.
//!
//! - **Opening.** A decision that finds the stream closed is called as before (alone or
//!   batched) and asks for it; the root opens it at its next tick (at most every
//!   [`REOPEN_AFTER`]), and it carries decisions once the sidecar's answer head says it serves
//!   it (`:status` 200, a gRPC content type). A stream that cannot open, or a sidecar that does
//!   not serve it (an older one), costs the attempt only; a worker that never decides (Envoy's
//!   main thread has a root context too) never opens one.
//! - **Timeout.** A message has no deadline of Envoy's: the root's tick fails each decision not
//!   answered within the sidecar timeout, so the failure mode applies between the timeout and
//!   the timeout plus one tick (a worker whose stream is on ticks at least every 50 ms:
//!   `crate::worker::STREAM_TICK`). Its decision may have been taken: it is
//!   refunded like any lost answer (crate::refunds); a late answer is ignored.
//! - **Format.** Messages are compact (decision 224: [`tollgate_wire::compact`], a fraction of
//!   JSON's cost to write and read in the filter) when the answer head says the sidecar reads
//!   them, else JSON (a sidecar of decision 223). An answer is read in the format it came in.
//! - **Closing.** When the stream ends (the sidecar restarted or stopped, a connection broke),
//!   every decision out fails the same way, and the stream opens again after [`REOPEN_AFTER`].
//!
//! Exactness is unchanged: each message is decided once, as `/v1/decide` would decide it.

use crate::delivery::Delivery;
use crate::host::{Host, LogLevel};
use crate::sidecar::Sidecar;
use crate::stats::Metric;
use serde::Serialize;
use std::collections::HashMap;
use tollgate_wire::compact;
use tollgate_wire::stream::{StreamAnswer, DECIDE_STREAM_METHOD, DECIDE_STREAM_SERVICE, MAX_STREAM_MESSAGE};
use tollgate_wire::{DecideRequest, SECRET_HEADER};

/// How long after a stream ended (or failed to open) the root opens it again.
pub const REOPEN_AFTER_MS: u64 = 1000;
/// [`REOPEN_AFTER_MS`] as a duration, for the docs.
pub const REOPEN_AFTER: std::time::Duration = std::time::Duration::from_millis(REOPEN_AFTER_MS);

/// A decision on the stream, waiting for its answer.
struct Out {
    ctx: u32,
    deadline_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conn {
    /// Not open; the root opens it at its first tick from `retry_at_ms`.
    Closed { retry_at_ms: u64 },
    /// Opened, the sidecar's answer head not seen yet: decisions are called as before (a sidecar
    /// that does not serve the stream — an older one: 404 — fails no decision).
    Opening { token: u32 },
    Open { token: u32, compact: bool },
}

/// What the sidecar's answer head says of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// Not served (`:status` not 200, or not a gRPC content type: an older sidecar's 404): the
    /// stream stays unused until it ends.
    NotServed,
    /// Served, with JSON messages (a sidecar of decision 223).
    Json,
    /// Served, and compact messages are read ([`compact::FORMAT_HEADER`]).
    Compact,
}

/// One worker's decision stream.
pub struct DecisionStream {
    /// The adapter's host can hold a stream and the configuration allows it.
    enabled: bool,
    conn: Conn,
    /// A decision found the stream closed since it was last opened: the root opens it. A worker
    /// that never decides (Envoy's main thread has one) never opens one.
    wanted: bool,
    next_seq: u64,
    out: HashMap<u64, Out>,
}

impl Default for DecisionStream {
    fn default() -> Self {
        DecisionStream { enabled: false, conn: Conn::Closed { retry_at_ms: 0 }, wanted: false, next_seq: 1, out: HashMap::new() }
    }
}

/// A message as sent, borrowing the request.
#[derive(Serialize)]
struct ItemRef<'a> {
    seq: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    request: &'a DecideRequest,
}

impl DecisionStream {
    pub fn enable(&mut self) {
        self.enabled = true;
    }

    /// The host holds streams and the configuration allows them (the worker's tick is then at
    /// most `crate::worker::STREAM_TICK`).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The stream is open: a decision goes on it.
    pub fn is_open(&self) -> bool {
        matches!(self.conn, Conn::Open { .. })
    }

    /// Whether `token` is this stream.
    pub fn owns(&self, token: u32) -> bool {
        matches!(self.conn, Conn::Open { token: t, .. } | Conn::Opening { token: t } if t == token)
    }

    /// The sidecar's answer head on stream `token`. When it serves the stream, decisions go on it
    /// from now on, in the format it reads; otherwise it stays unused until it ends.
    pub fn on_head(&mut self, host: &mut impl Host, token: u32, head: Head) {
        if self.conn != (Conn::Opening { token }) {
            return;
        }
        if head != Head::NotServed {
            self.conn = Conn::Open { token, compact: head == Head::Compact };
        } else {
            host.log(LogLevel::Warn, "tollgate: the sidecar does not serve the decision stream (an older sidecar?): decisions are called one by one");
        }
    }

    /// Decisions on the stream waiting for their answer.
    pub fn in_flight(&self) -> usize {
        self.out.len()
    }

    /// At the root's tick: opens the stream when a decision asked for it and its time came (it
    /// carries decisions once the sidecar's answer head came: [`Self::on_head`]).
    pub fn keep_open(&mut self, host: &mut impl Host, sidecar: &Sidecar) {
        let Conn::Closed { retry_at_ms } = self.conn else { return };
        let now = host.now_ms();
        if !self.enabled || !self.wanted || now < retry_at_ms {
            return;
        }
        let mut metadata: Vec<(&str, &[u8])> = Vec::new();
        if let Some(secret) = &sidecar.secret {
            metadata.push((SECRET_HEADER, secret.as_bytes()));
        }
        match host.open_stream(&sidecar.cluster, DECIDE_STREAM_SERVICE, DECIDE_STREAM_METHOD, &metadata) {
            Ok(token) => {
                host.count(Metric::DecisionStreamsOpened);
                self.conn = Conn::Opening { token };
                self.wanted = false;
            }
            Err(e) => {
                host.log(LogLevel::Warn, &format!("tollgate: cannot open the decision stream (decisions are called one by one meanwhile): {e}"));
                self.conn = Conn::Closed { retry_at_ms: now.saturating_add(REOPEN_AFTER_MS) };
            }
        }
    }

    /// From a request's context: sends its decision on the open stream. `Err`: not sent (the
    /// stream is closed or the send failed, and is then closed): the caller calls as before.
    pub fn send(&mut self, host: &mut impl Host, ctx: u32, request: &DecideRequest, traceparent: Option<&str>, deadline_ms: u64) -> Result<(), String> {
        let (token, compact) = match self.conn {
            Conn::Open { token, compact } => (token, compact),
            Conn::Opening { .. } => return Err("the decision stream is opening".into()),
            Conn::Closed { .. } => {
                self.wanted = self.enabled;
                return Err("the decision stream is not open".into());
            }
        };
        let seq = self.next_seq;
        let message = if compact {
            let mut m = Vec::with_capacity(256);
            compact::encode_item(&mut m, seq, traceparent, request).map_err(|e| format!("cannot encode decision request: {e}"))?;
            m
        } else {
            serde_json::to_vec(&ItemRef { seq, traceparent, request }).map_err(|e| format!("cannot encode decision request: {e}"))?
        };
        if message.len() > MAX_STREAM_MESSAGE {
            return Err("the decision request is too large for the stream".into());
        }
        if let Err(e) = host.stream_send(token, &message) {
            // the stream is gone without Envoy telling the root yet: fail what is out at its
            // deadline (or its close), and call this one on its own
            host.log(LogLevel::Debug, &format!("tollgate: the decision stream refused a message: {e}"));
            self.conn = Conn::Closed { retry_at_ms: host.now_ms().saturating_add(REOPEN_AFTER_MS) };
            return Err(e);
        }
        self.next_seq += 1;
        host.count(Metric::DecisionsStreamed);
        self.out.insert(seq, Out { ctx, deadline_ms });
        Ok(())
    }

    /// A request ended while its decision was out: its answer will be ignored. `true` when it
    /// was out here.
    pub fn cancel(&mut self, ctx: u32) -> bool {
        let before = self.out.len();
        self.out.retain(|_, o| o.ctx != ctx);
        self.out.len() != before
    }

    /// At the root's tick: the decisions out past their deadline fail (their answer is lost).
    pub fn expire(&mut self, now_ms: u64) -> Vec<Delivery> {
        let mut failed = Vec::new();
        self.out.retain(|_, o| {
            let expired = o.deadline_ms <= now_ms;
            if expired {
                failed.push(Delivery { ctx: o.ctx, answer: Err("no answer on the decision stream within the sidecar timeout".into()), sent: true });
            }
            !expired
        });
        failed
    }

    /// A message of the stream: the answer of one decision out (`None`: it is not out any more —
    /// expired, or its request ended — or the message is not an answer).
    pub fn on_message(&mut self, host: &mut impl Host, message: &[u8]) -> Option<Delivery> {
        let answer = if compact::is_compact(message) { compact::decode_answer(message) } else { serde_json::from_slice::<StreamAnswer>(message).map_err(|e| e.to_string()) };
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                host.log(LogLevel::Warn, &format!("tollgate: an undecodable message on the decision stream: {e}"));
                return None;
            }
        };
        let out = self.out.remove(&answer.seq)?;
        Some(Delivery { ctx: out.ctx, answer: answer.into_result(), sent: true })
    }

    /// The stream ended (`status`: its gRPC status): every decision out fails; it opens again
    /// after [`REOPEN_AFTER`].
    pub fn on_close(&mut self, host: &mut impl Host, token: u32, status: u32) -> Vec<Delivery> {
        if !self.owns(token) {
            return Vec::new();
        }
        let now = host.now_ms();
        self.conn = Conn::Closed { retry_at_ms: now.saturating_add(REOPEN_AFTER_MS) };
        if !self.out.is_empty() || status != 0 {
            let n = self.out.len();
            host.log(LogLevel::Info, &format!("tollgate: the decision stream ended (gRPC status {status}) with {n} decisions out; they fail, and it opens again"));
        }
        let why = format!("the decision stream ended (gRPC status {status})");
        self.out.drain().map(|(_, o)| Delivery { ctx: o.ctx, answer: Err(why.clone()), sent: true }).collect()
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
