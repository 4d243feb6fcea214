//! The request body: read for the decision (the token estimate, a lookup's digest, an LLM call's
//! model), held until the decision comes, copied as it passes when a reused answer let the
//! request through at once; and an alias's rewrite of the model the request names (issue 42
//! item 4, decision 309) — in its JSON body, held buffered for it, or in its Gemini path.

use super::decision::{Decision, Denial};
use super::llm_call::LlmCall;
use super::{stages, AuthFilter, State, MAX_USAGE_BODY};
use crate::headers::RequestHeaders;
use crate::host::{Action, Host};
use crate::usage::RequestInfo;
use tollgate_wire::codes;

impl AuthFilter {
    /// The request's trailers (HTTP/2, HTTP/3), which end its stream. Envoy takes a `Continue`
    /// here as "go on" for the whole request, headers and body included, even while they are
    /// paused for a decision: so a request still waiting for its decision stays paused (it goes
    /// on with its answer), and one waiting for its body is decided now, on the body it has. A
    /// client's internal header names are removed from trailers too.
    pub fn on_request_trailers(&mut self, host: &mut impl Host) -> Action {
        for name in host.request_trailer_names() {
            if crate::headers::is_internal(&name) {
                host.remove_request_trailer(&name);
            }
        }
        match self.state {
            State::AwaitingBody { .. } => match self.on_request_body(host, self.request_body_size, true) {
                Action::Hold => Action::Pause,
                action => action,
            },
            State::Waiting { .. } | State::Queued { .. } => Action::Pause,
            State::Start | State::Done => Action::Continue,
        }
    }

    /// The request body, for the token estimate and a lookup: `Pause` (buffered) until the whole
    /// body is in. A body that only waits for the decision is held with flow control (`Hold`),
    /// never buffered against Envoy's limit: a request over it (1 MiB by default) is not refused
    /// with Envoy's 413 for having waited for its decision (decision 139).
    pub fn on_request_body(&mut self, host: &mut impl Host, body_size: usize, end_of_stream: bool) -> Action {
        match (self.request_body(host, body_size, end_of_stream), &self.state) {
            (Action::Pause, State::AwaitingBody { .. }) => Action::Pause,
            // a body an alias may rewrite stays buffered, where the answer can replace it
            (Action::Pause, _) if self.llm.as_ref().is_some_and(LlmCall::keeps_body) => Action::Pause,
            (Action::Pause, _) => Action::Hold,
            (action, _) => action,
        }
    }

    fn request_body(&mut self, host: &mut impl Host, body_size: usize, end_of_stream: bool) -> Action {
        self.request_body_size = body_size;
        match self.state {
            State::AwaitingBody { .. } => {}
            State::Waiting { .. } | State::Queued { .. } => return Action::Pause,
            State::Start | State::Done => {
                // let through at once (auth cache, lease): the body streams on, copied for its model
                if let Some(llm) = &mut self.llm {
                    llm.on_passing_body(host, body_size, end_of_stream);
                }
                return Action::Continue;
            }
        }
        if !end_of_stream && body_size <= MAX_USAGE_BODY {
            return Action::Pause;
        }
        let State::AwaitingBody { request, lookup } = std::mem::replace(&mut self.state, State::Done) else {
            return Action::Continue;
        };
        let mut request = *request;
        let body = stages::request_body(host, body_size);
        if let Some(llm) = &mut self.llm {
            llm.read_body(body.as_deref());
            request.llm = Some(llm.ask(body_size as u64, self.request.as_ref().map(RequestInfo::start_ms)));
        }
        if let (Some(field), Some(b)) = (&self.config.token_estimate_field, &body) {
            request.token_estimate = stages::token_estimate(field, b);
        }
        if let Some(plan) = &lookup {
            match stages::complete_lookup(&mut request, plan, body.as_deref()) {
                Ok(status) => self.response.cache_status = status.or(self.response.cache_status),
                Err(d) => return self.apply(host, Decision::Deny(d)),
            }
        }
        if let (Some(llm), Some(body)) = (&mut self.llm, body) {
            llm.keep(body);
        }
        self.apply(host, Decision::Call(request))
    }

    /// Asks the upstream for `model` in place of the model the request names (an alias its
    /// plan resolved): the kept body's top-level `model` rewritten and its `content-length`
    /// with it, else a Gemini path's model. A request that cannot be rewritten safely is
    /// refused (400), never sent on with the alias; what its decision reserved is settled at 0.
    pub(super) fn rewrite_model(&mut self, host: &mut impl Host, model: &str) -> Result<(), Denial> {
        let refuse = |this: &mut AuthFilter| {
            this.refused_before_upstream();
            let why = "this request's model is an alias the gateway cannot rewrite safely: name the model once, as a string, in a UTF-8 JSON body's top-level \"model\"";
            Denial::local(400, codes::MODEL_REQUIRED, why)
        };
        let Some(llm) = &mut self.llm else { return Err(refuse(self)) };
        let Some(asked) = llm.requested_model.clone() else { return Err(refuse(self)) };
        let rewritten = match llm.take_kept() {
            Some(body) => crate::llm::rewrite_model(&body, &asked, model).filter(|new| host.replace_request_body(body.len(), new)).map(|new| {
                let headers = RequestHeaders::new(host.request_headers());
                if headers.get("content-length").is_some() {
                    host.set_request_header("content-length", &new.len().to_string());
                }
            }),
            None => {
                let path = RequestHeaders::new(host.request_headers()).get(":path").and_then(|p| crate::llm::rewrite_path_model(p, &asked, model));
                path.map(|p| host.set_request_header(":path", &p))
            }
        };
        match rewritten {
            Some(()) => {
                llm.resolved(model);
                Ok(())
            }
            None => Err(refuse(self)),
        }
    }
}
