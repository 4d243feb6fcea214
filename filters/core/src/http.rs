//! One HTTP request's whole filter: the auth filter's request path, then the breaker stage.
//!
//! The breaker guard runs once, when authentication lets the request on (at its headers, its
//! body, or the sidecar's answer): it admits the request to its target, sends it to a fallback,
//! or replies 503 itself. It records the outcome on the response headers and gives a half-open
//! trial's slot back if the request ends without them. Each method is one Envoy callback; the
//! adapter only forwards them and returns the [`Action`].

use crate::breaker::guard::BreakerGuard;
use crate::filter::AuthFilter;
use crate::host::{Action, Host};

pub struct HttpFilter {
    filter: AuthFilter,
    guard: BreakerGuard,
}

impl HttpFilter {
    pub fn new(filter: AuthFilter, guard: BreakerGuard) -> HttpFilter {
        HttpFilter { filter, guard }
    }

    /// The breaker stage, once authentication let the request on.
    fn guarded(&mut self, host: &mut impl Host, auth: Action) -> Action {
        match auth {
            Action::Continue => {
                let guarded = self.guard.on_request_routed(host, self.filter.route());
                if guarded == Action::Pause {
                    // the guard answered 503 itself: the request goes nowhere
                    self.filter.refused_before_upstream();
                }
                if self.guard.rerouted() {
                    // a fallback's answer is not the route's to cache (decision 192)
                    self.filter.forgo_cache_fill();
                }
                guarded
            }
            Action::Pause | Action::Hold => auth,
        }
    }

    pub fn on_request_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        let auth = self.filter.on_request_headers(host, end_of_stream);
        self.guarded(host, auth)
    }

    pub fn on_request_body(&mut self, host: &mut impl Host, body_size: usize, end_of_stream: bool) -> Action {
        let auth = self.filter.on_request_body(host, body_size, end_of_stream);
        self.guarded(host, auth)
    }

    /// The request's trailers: `Pause` while the decision is pending (see
    /// [`AuthFilter::on_request_trailers`]).
    pub fn on_request_trailers(&mut self, host: &mut impl Host) -> Action {
        let auth = self.filter.on_request_trailers(host);
        self.guarded(host, auth)
    }

    /// The sidecar's answer to this request's call: `Continue` when the adapter must resume the
    /// request.
    pub fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: impl crate::sidecar::CallStatus, body: &[u8]) -> Action {
        let auth = self.filter.on_sidecar_response(host, token, status, body);
        self.guarded(host, auth)
    }

    /// Whether the request's decision waits for its worker's batch (crate::batch).
    pub fn waits_for_batch(&self) -> bool {
        self.filter.waits_for_batch()
    }

    /// This request's outcome from its worker's decision batch (crate::batch): `Continue` when
    /// the adapter must resume the request.
    pub fn on_batched_answer(&mut self, host: &mut impl Host, delivery: crate::batch::Delivery) -> Action {
        let auth = self.filter.on_batched_answer(host, delivery.answer, delivery.sent);
        self.guarded(host, auth)
    }

    pub fn on_response_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        let auth = self.filter.on_response_headers(host, end_of_stream);
        let guard = self.guard.on_response(host);
        if auth == Action::Pause { Action::Pause } else { guard }
    }

    pub fn on_response_body(&mut self, host: &mut impl Host, body_size: usize, end_of_stream: bool) -> Action {
        self.filter.on_response_body(host, body_size, end_of_stream)
    }

    /// The response's trailers: they end it (see [`AuthFilter::on_response_trailers`]).
    pub fn on_response_trailers(&mut self, host: &mut impl Host) -> Action {
        self.filter.on_response_trailers(host)
    }

    /// Whether the adapter must resume the response now (its end waited for an idempotency
    /// outcome to be stored).
    pub fn take_resume_response(&mut self) -> bool {
        self.filter.take_resume_response()
    }

    pub fn on_log(&mut self, host: &mut impl Host) {
        self.guard.on_done(host);
        self.filter.on_log(host);
    }

    /// The auth filter (its route, for tests and tools).
    pub fn auth(&self) -> &AuthFilter {
        &self.filter
    }
}
