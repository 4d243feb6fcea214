//! The request's decision call and its answer: alone (`/v1/decide`, answered in the request's
//! context) or, while its worker has one out, in the worker's next batch ([`crate::batch`],
//! decision 127, answered through the root context); and the failure mode when no answer comes.

use super::{AuthFilter, State, DEGRADED_HEADER};
use crate::batch::Cancelled;
use crate::config::FailureMode;
use crate::host::{Action, Host, LogLevel};
use crate::lease;
use crate::shared_keys;
use crate::sidecar::{interpret, CallStatus};
use crate::stats::Metric;
use tollgate_wire::refunds::Abandoned;
use tollgate_wire::routes::RouteFailureMode;
use tollgate_wire::{codes, DecideRequest, DecideResponse};

impl AuthFilter {
    pub(super) fn call_sidecar(&mut self, host: &mut impl Host, mut request: DecideRequest) -> Action {
        // The gateway names the decision: what it takes in Redis keys on this id, never on
        // anything the client sent.
        request.decision_id = self.worker.decision_ids.as_ref().map(|ids| ids.borrow_mut().next_id());
        if request.lease.is_some() {
            self.lease_sent_ms = Some(host.now_ms()); // leased limits: the grant's clock starts here
        }
        self.sent_gen = self.worker.gen.get();
        // before its answer can be cached: the change poller must be awake (crate::changes)
        self.worker.gen.note_call(host);
        if let Some((batcher, ctx)) = &self.worker.batcher {
            // on the worker's decision stream (crate::stream); if it cannot take it (closed: the
            // root opens it; off), as before
            let deadline = host.now_ms().saturating_add(self.config.sidecar.timeout.as_millis() as u64);
            if batcher.borrow_mut().stream.send(host, *ctx, &request, self.traceparent.as_deref(), deadline).is_ok() {
                self.state = State::Queued { key_hash: request.key_hash, decision_id: request.decision_id };
                return Action::Pause;
            }
        }
        if let Some((batcher, ctx)) = self.worker.batcher.as_ref().filter(|(b, _)| !b.borrow().goes_alone()) {
            // it waits at most the sidecar timeout for its batch to leave (crate::batch)
            let deadline = host.now_ms().saturating_add(self.config.sidecar.timeout.as_millis() as u64);
            let pushed = batcher.borrow_mut().push(*ctx, &request, self.traceparent.as_deref(), deadline);
            match pushed {
                Ok(wake) => {
                    if wake && !host.wake_root() {
                        batcher.borrow_mut().wake_failed(); // the root's tick sends it
                    }
                    self.state = State::Queued { key_hash: request.key_hash, decision_id: request.decision_id };
                    return Action::Pause;
                }
                Err(e) => return self.sidecar_failed(host, &e),
            }
        }
        let body = match serde_json::to_vec(&request) {
            Ok(b) => b,
            Err(e) => return self.sidecar_failed(host, &format!("cannot encode decision request: {e}")),
        };
        match host.dispatch(self.config.sidecar.decide(body, self.traceparent.as_deref())) {
            Ok(token) => {
                if let Some((batcher, _)) = &self.worker.batcher {
                    batcher.borrow_mut().went_alone();
                }
                self.state = State::Waiting { token, key_hash: request.key_hash, decision_id: request.decision_id };
                Action::Pause
            }
            Err(e) => self.sidecar_failed(host, &format!("cannot call the sidecar: {e}")),
        }
    }

    /// The sidecar's answer: `status` is the call response's `:status` (Envoy synthesizes 503
    /// when the sidecar is unreachable and 504 on timeout), read only when needed
    /// ([`crate::sidecar::interpret`]). Returns `Continue` when the adapter
    /// must resume the request.
    pub fn on_sidecar_response(&mut self, host: &mut impl Host, token: u32, status: impl CallStatus, body: &[u8]) -> Action {
        if self.outcome_call.as_ref().is_some_and(|(t, _)| *t == token) {
            self.outcome_stored(status.read());
            return Action::Pause;
        }
        let (key_hash, decision_id) = match &mut self.state {
            State::Waiting { token: t, key_hash, decision_id } if *t == token => (std::mem::take(key_hash), decision_id.take()),
            _ => {
                host.log(LogLevel::Debug, "ignoring a call response with an unexpected token");
                return Action::Pause;
            }
        };
        if let Some((batcher, _)) = &self.worker.batcher {
            batcher.borrow_mut().alone_back();
        }
        self.answered(host, key_hash, decision_id, interpret(status, body))
    }

    /// Whether the request's decision waits in (or rides) its worker's batch: the adapter then
    /// keeps the request where the batch's answer can find it.
    pub fn waits_for_batch(&self) -> bool {
        matches!(self.state, State::Queued { .. })
    }

    /// This request's outcome from its worker's decision batch (the adapter delivers it in the
    /// request's context; `sent`: its decision left, see [`crate::batch::Delivery`]). Returns
    /// `Continue` when the adapter must resume the request.
    pub fn on_batched_answer(&mut self, host: &mut impl Host, answer: Result<DecideResponse, String>, sent: bool) -> Action {
        match std::mem::replace(&mut self.state, State::Done) {
            // a decision never sent took nothing: no refund for it
            State::Queued { key_hash, decision_id } => self.answered(host, key_hash, decision_id.filter(|_| sent), answer),
            other => {
                self.state = other;
                host.log(LogLevel::Debug, "ignoring a batched decision this request did not wait for");
                Action::Pause
            }
        }
    }

    fn answered(&mut self, host: &mut impl Host, key_hash: String, decision_id: Option<String>, answer: Result<DecideResponse, String>) -> Action {
        self.state = State::Done;
        if answer.is_err() {
            // the sidecar may have decided and taken, but its answer is lost (timeout, error)
            self.abandoned = decision_id.map(|decision_id| Abandoned { decision_id, key_hash: key_hash.clone() });
        }
        let no_lease = matches!(answer, Ok(DecideResponse::Allow { no_lease: true, .. }));
        if let (true, Some(local)) = (no_lease, &self.worker.local_allows) {
            // a plan never leased: no lease bookkeeping for this key (crate::auth_cache)
            local.borrow_mut().mark_unleased(&self.auth_key(&key_hash), host.now_ms());
        }
        if let (Some(leases), false) = (&self.worker.leases, no_lease) {
            // ---- leased limits (crate::lease): keep a grant, release the ask, forget on a 401 ----
            let (now, key) = (host.now_ms(), shared_keys::lease(&key_hash, self.route_id()));
            let gens = lease::Gens { sent: self.sent_gen, now: self.worker.gen.get() };
            lease::on_answer(host, &mut leases.borrow_mut().shares, &key, &answer, self.lease_sent_ms.take(), self.lease_recorded, now, false, gens);
        }
        let decision = self.decide(host, &key_hash, answer);
        self.apply(host, decision)
    }

    /// The request ends with its decision call out or waiting: the answer is lost with its
    /// context, so what the sidecar took for it is queued for a refund; a decision still waiting
    /// for its batch is dropped (nothing was taken).
    pub(super) fn abandon_call(&mut self, host: &mut impl Host) {
        let (key_hash, decision_id) = match std::mem::replace(&mut self.state, State::Done) {
            State::Waiting { key_hash, decision_id, .. } => {
                if let Some((batcher, _)) = &self.worker.batcher {
                    batcher.borrow_mut().alone_back();
                }
                (key_hash, decision_id)
            }
            State::Queued { key_hash, decision_id } => {
                let cancelled = self.worker.batcher.as_ref().map(|(b, ctx)| b.borrow_mut().cancel(*ctx));
                if cancelled == Some(Cancelled::Unsent) {
                    return;
                }
                (key_hash, decision_id)
            }
            other => {
                self.state = other;
                return;
            }
        };
        if let Some(decision_id) = decision_id {
            self.queue_refund(host, Abandoned { decision_id, key_hash });
        }
    }

    pub(super) fn sidecar_failed(&mut self, host: &mut impl Host, why: &str) -> Action {
        host.count(Metric::SidecarError);
        let mode = match self.route().and_then(|r| r.failure_mode) {
            Some(RouteFailureMode::Open) => FailureMode::Open,
            Some(RouteFailureMode::Closed) => FailureMode::Closed,
            None => self.config.failure_mode,
        };
        match mode {
            FailureMode::Closed => {
                host.log(LogLevel::Warn, &format!("tollgate: sidecar failed ({why}); failing closed"));
                host.count(Metric::FailedClosed);
                // refused: whatever the lost answer's decision took is given back
                if let Some(a) = self.abandoned.take() {
                    self.queue_refund(host, a);
                }
                self.response.cache_status = None;
                let message = "the gateway cannot decide this request now";
                crate::reply::json_error(host, 503, codes::SIDECAR_UNAVAILABLE, message, None, &[]);
                Action::Pause
            }
            FailureMode::Open => {
                host.log(LogLevel::Warn, &format!("tollgate: sidecar failed ({why}); failing open"));
                host.count(Metric::FailedOpen);
                host.set_request_header(DEGRADED_HEADER, "sidecar_unavailable");
                self.steer(host, false);
                Action::Continue
            }
        }
    }

    /// Queues an abandoned decision for the sidecar to refund (crate::refunds).
    fn queue_refund(&self, host: &mut impl Host, a: Abandoned) {
        if let Some(q) = &self.worker.refunds {
            q.borrow_mut().push(a);
            host.count(Metric::RefundQueued);
        }
    }

}
