//! Lease renewals, off the request path: a request that leaves its key's lease low claims the
//! renewal in the record and queues it here ([`RenewalQueue`], one per worker); the worker's root
//! context sends it as a decision call with `lease.renewal = true` ([`LeaseRenewer`], a
//! background job) and applies the answer.

use super::{forget, on_answer, release_claim, Gens, Shares, MAX_QUEUED_RENEWALS, RENEWAL_TIMEOUT};
use crate::changes::Generation;
use crate::host::{Host, LogLevel};
use crate::jobs::Job;
use crate::shared_keys::SharedKey;
use crate::sidecar::{interpret, Sidecar};
use crate::stats::Metric;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use tollgate_wire::{DecideRequest, DecideResponse, LeaseAsk, DECIDE_PATH};

/// A renewal waiting for the root context's tick.
#[derive(Debug, Clone, PartialEq)]
pub struct Renewal {
    /// The lease's shared-data key ([`super::key_of`] its request).
    pub key: SharedKey,
    /// The decision request to send (the request that claimed it, with `lease.renewal`).
    pub request: DecideRequest,
}

/// The worker's lease state: its queue of renewals (HTTP contexts push, the root context sends)
/// and its [`Shares`] of the Envoy's leases.
#[derive(Debug, Default)]
pub struct RenewalQueue {
    pending: VecDeque<Renewal>,
    /// Renewals dropped because the queue was full.
    pub dropped: u64,
    /// The units this worker took from its Envoy's leases (crate::lease::share).
    pub shares: Shares,
}

impl RenewalQueue {
    /// Queues a renewal for `request`'s key, asking for `want` units.
    pub fn push(&mut self, mut request: DecideRequest, want: u64) {
        let key = super::key_of(&request);
        if self.pending.iter().any(|r| r.key == key) {
            return;
        }
        if self.pending.len() >= MAX_QUEUED_RENEWALS {
            self.dropped += 1;
            return;
        }
        request.lease = Some(LeaseAsk { want, renewal: true });
        request.token_estimate = None;
        self.pending.push_back(Renewal { key, request });
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Sends a worker's queued renewals from its root context and applies their answers.
pub struct LeaseRenewer {
    queue: Rc<RefCell<RenewalQueue>>,
    sidecar: Sidecar,
    /// Calls in flight: token → (the lease's key, sent at, the generation sent under).
    in_flight: Vec<(u32, SharedKey, u64, u64)>,
    /// The worker's generation (crate::changes); none: always 0.
    gen: Generation,
    /// When it last sent a renewal (host ms; 0: never).
    last_sent_ms: u64,
}

/// How long after its last renewal a worker keeps its fast tick ([`LeaseRenewer::busy`]).
pub const BUSY_AFTER_RENEWAL_MS: u64 = 1_000;

impl LeaseRenewer {
    pub fn new(queue: Rc<RefCell<RenewalQueue>>, sidecar: Sidecar) -> LeaseRenewer {
        LeaseRenewer { queue, sidecar, in_flight: Vec::new(), gen: Generation::default(), last_sent_ms: 0 }
    }

    /// Whether renewals wait, are out, or were sent within [`BUSY_AFTER_RENEWAL_MS`]: the
    /// worker's leases are in use, and its next renewals should not wait for a slow tick
    /// (decision 272).
    pub fn busy(&self, now_ms: u64) -> bool {
        !self.queue.borrow().is_empty()
            || !self.in_flight.is_empty()
            || (self.last_sent_ms != 0 && now_ms.saturating_sub(self.last_sent_ms) < BUSY_AFTER_RENEWAL_MS)
    }

    /// Stamps grants with the worker's generation `gen`.
    pub fn with_generation(mut self, gen: Generation) -> LeaseRenewer {
        self.gen = gen;
        self
    }

    /// Applies a call's answer; false when `token` is not a renewal of this renewer.
    pub fn apply_answer(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) -> bool {
        let Some(i) = self.in_flight.iter().position(|(t, ..)| *t == token) else { return false };
        let (_, key, sent_ms, sent_gen) = self.in_flight.swap_remove(i);
        let now = host.now_ms();
        let answer = interpret(status, body);
        if let Err(e) = &answer {
            host.log(LogLevel::Debug, &format!("tollgate: lease renewal failed: {e}"));
        }
        // A denied renewal (the key was revoked or expired; limits unavailable and closed) drops
        // the lease: on_answer forgets it on a 401, and a 503 brings no units.
        let shares = &mut self.queue.borrow_mut().shares;
        if let Ok(DecideResponse::Deny { .. }) = &answer {
            shares.drop_key(key.as_str());
            forget(host, &key);
        }
        on_answer(host, shares, &key, &answer, Some(sent_ms), true, now, true, Gens { sent: sent_gen, now: self.gen.get() });
        true
    }

    /// Renewals waiting for an answer.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

/// Runs on every tick of its root context (a queued renewal waits at most one tick).
impl Job for LeaseRenewer {
    /// Sends every queued renewal (the root context's tick).
    fn on_tick(&mut self, host: &mut impl Host) {
        let pending: Vec<Renewal> = self.queue.borrow_mut().pending.drain(..).collect();
        if !pending.is_empty() {
            self.gen.note_call(host); // the poller must be awake for what they lease (crate::changes)
            self.last_sent_ms = host.now_ms().max(1);
        }
        for r in pending {
            let now = host.now_ms();
            let Ok(body) = serde_json::to_vec(&r.request) else { continue };
            let call = self.sidecar.post_json(DECIDE_PATH, body, RENEWAL_TIMEOUT);
            match host.dispatch(call) {
                Ok(token) => {
                    host.count(Metric::LeaseRenewal);
                    self.in_flight.push((token, r.key, now, self.gen.get()));
                }
                Err(e) => {
                    host.log(LogLevel::Debug, &format!("tollgate: cannot send a lease renewal: {e}"));
                    release_claim(host, &r.key, now, true);
                }
            }
        }
    }

    /// Whether `token` is one of this renewer's calls.
    fn owns(&self, token: u32) -> bool {
        self.in_flight.iter().any(|(t, ..)| *t == token)
    }

    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        self.apply_answer(host, token, status, body);
    }
}

