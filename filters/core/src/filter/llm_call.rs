//! One LLM request's facts as the filter gathers them (issue 42): the model the request asks
//! for — from a Gemini-style path at once, from its JSON body once that is in — for its usage
//! event; the response's model and tokens are read by the response side
//! ([`super::response::ResponseSide`]) from the body it keeps for token usage.
//!
//! The body is read where the filter reads it anyway (a decision that waits for it, up to
//! [`MAX_USAGE_BODY`]); a request the auth cache or a lease let through at once streams on, and
//! its body is copied as it passes (never held back), up to the same bound. A larger body, or
//! one that is not a JSON document with a top-level `model` string, names no model (the event
//! says none; the request is metered all the same).

use super::MAX_USAGE_BODY;
use crate::host::Host;
use crate::llm::{path_model, request_ask, ResponseFacts};
use tollgate_wire::llm::{LlmAsk, LlmUsage};

#[derive(Debug, Default)]
pub struct LlmCall {
    /// The model the request asks for.
    pub requested_model: Option<String>,
    /// The output the request allows (`max_tokens` and the like), for money budgets.
    max_output_tokens: Option<u64>,
    /// The body copied as it passes (bounded), when it is to be read that way.
    copy: Option<Vec<u8>>,
    /// The model was named by the body read for the decision (not by the path).
    from_body: bool,
    /// That body, until the decision's answer: an alias rewrites it (decision 309).
    kept: Option<Vec<u8>>,
    /// The model the upstream was asked for in place of the one asked (an alias's).
    resolved: Option<String>,
}

impl LlmCall {
    /// An LLM request on `path`; `json_body`: a JSON body follows, small enough to read.
    pub fn start(path: &str, json_body: bool) -> LlmCall {
        LlmCall { requested_model: path_model(path), copy: json_body.then(Vec::new), ..LlmCall::default() }
    }

    /// The whole body, read by the filter for its decision. A path that names a model (Gemini)
    /// and a body that names another ask for two: which one the upstream uses is not the
    /// gateway's to guess, so the request names none (a model policy then refuses it,
    /// `model_required`; decision 308).
    pub fn read_body(&mut self, body: Option<&[u8]>) {
        self.copy = None;
        let (model, max) = body.map(request_ask).unwrap_or_default();
        match (&self.requested_model, model) {
            (_, None) => {}
            (None, Some(model)) => {
                self.requested_model = Some(model);
                self.from_body = true;
            }
            (Some(path), Some(model)) if *path == model => {}
            (Some(_), Some(_)) => self.requested_model = None,
        }
        self.max_output_tokens = max;
    }

    /// Keeps the body read for the decision when it named the model: an alias rewrites it.
    pub fn keep(&mut self, body: Vec<u8>) {
        if self.from_body && self.requested_model.is_some() {
            self.kept = Some(body);
        }
    }

    /// Whether the body is kept for a rewrite (it stays buffered in Envoy until the answer).
    pub fn keeps_body(&self) -> bool {
        self.kept.is_some()
    }

    /// The kept body, once (the answer came).
    pub fn take_kept(&mut self) -> Option<Vec<u8>> {
        self.kept.take()
    }

    /// The upstream was asked for `model` (an alias's real model).
    pub fn resolved(&mut self, model: &str) {
        self.resolved = Some(model.to_string());
    }

    /// The usage event's facts: the model asked for (an alias as the client named it), and the
    /// model that answered — else, when the response names none, the one the upstream was asked
    /// for in its place.
    pub fn usage(self, mut facts: ResponseFacts) -> Option<LlmUsage> {
        facts.model = facts.model.or(self.resolved);
        facts.into_usage(self.requested_model)
    }

    /// What the decision call says of this request for money budgets: `input_bytes`, the body's
    /// size as the filter knows it (read, else announced); `start_ms`, when the filter took it.
    pub fn ask(&self, input_bytes: u64, start_ms: Option<u64>) -> LlmAsk {
        LlmAsk { model: self.requested_model.clone(), input_bytes, max_output_tokens: self.max_output_tokens, start_ms }
    }

    /// A chunk of a body that streams on (the filter answered `Continue` before, so Envoy
    /// presents only this chunk): copied while the body is within bound, read at its end.
    pub fn on_passing_body(&mut self, host: &impl Host, chunk_size: usize, end_of_stream: bool) {
        let Some(copy) = &mut self.copy else { return };
        if copy.len() + chunk_size > MAX_USAGE_BODY {
            self.copy = None;
            return;
        }
        if chunk_size > 0 {
            match host.request_body(0, chunk_size) {
                Some(chunk) => copy.extend_from_slice(&chunk),
                None => {
                    self.copy = None;
                    return;
                }
            }
        }
        if end_of_stream {
            let body = self.copy.take();
            self.read_body(body.as_deref());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::MockHost;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_passing_body_is_copied_chunk_by_chunk() {
        let mut call = LlmCall::start("/v1/chat/completions", true);
        let mut host = MockHost::new();
        host.request_body = br#"{"model":"gpt-"#.to_vec();
        call.on_passing_body(&host, 14, false);
        assert_eq!(call.requested_model, None);
        host.request_body = br#"4o","messages":[]}"#.to_vec();
        call.on_passing_body(&host, 18, true);
        assert_eq!(call.requested_model.as_deref(), Some("gpt-4o"));
    }

    #[test]
    fn a_read_body_says_what_a_money_budget_reserves_from() {
        let mut call = LlmCall::start("/v1/chat/completions", true);
        call.read_body(Some(br#"{"model":"gpt-4o","max_tokens":20,"messages":[]}"#));
        let ask = call.ask(48, Some(7));
        assert_eq!(ask, LlmAsk { model: Some("gpt-4o".into()), input_bytes: 48, max_output_tokens: Some(20), start_ms: Some(7) });
        call.read_body(None);
        assert_eq!(call.ask(0, None).max_output_tokens, None, "an unread body allows what the limit says");
    }

    #[test]
    fn a_body_past_the_bound_names_no_model() {
        let mut call = LlmCall::start("/v1/messages", true);
        let mut host = MockHost::new();
        host.request_body = br#"{"model":"claude"}"#.to_vec();
        call.on_passing_body(&host, MAX_USAGE_BODY + 1, false);
        call.on_passing_body(&host, 18, true);
        assert_eq!(call.requested_model, None);
        // a Gemini path names its model without a body
        let call = LlmCall::start("/v1beta/models/gemini-2.5-pro:generateContent", false);
        assert_eq!(call.requested_model.as_deref(), Some("gemini-2.5-pro"));
    }

    #[test]
    fn a_path_and_a_body_naming_two_models_name_none() {
        let path = "/v1beta/models/gemini-2.5-pro:generateContent";
        let mut call = LlmCall::start(path, true);
        call.read_body(Some(br#"{"contents":[]}"#));
        assert_eq!(call.requested_model.as_deref(), Some("gemini-2.5-pro"), "a body without a model leaves the path's");
        call.read_body(Some(br#"{"model":"gemini-2.5-pro","contents":[]}"#));
        assert_eq!(call.requested_model.as_deref(), Some("gemini-2.5-pro"), "the same model twice is that model");
        let mut call = LlmCall::start(path, true);
        call.read_body(Some(br#"{"model":"gemini-2.5-flash","contents":[]}"#));
        assert_eq!(call.requested_model, None, "two models: the upstream may use either");
    }

    #[test]
    fn a_body_naming_the_model_is_kept_for_an_alias_and_the_event_names_both() {
        let mut call = LlmCall::start("/v1/chat/completions", true);
        call.read_body(Some(br#"{"model":"fast"}"#));
        call.keep(br#"{"model":"fast"}"#.to_vec());
        assert!(call.keeps_body());
        assert_eq!(call.take_kept().as_deref(), Some(&br#"{"model":"fast"}"#[..]));
        assert!(!call.keeps_body());
        call.resolved("gpt-4o-mini");
        let u = call.usage(ResponseFacts { output: Some(3), ..ResponseFacts::default() }).unwrap();
        assert_eq!((u.requested_model.as_deref(), u.model.as_deref()), (Some("fast"), Some("gpt-4o-mini")), "the answer named none");
        // a path's model: nothing kept (the path is rewritten); a body naming none: nothing kept
        let mut call = LlmCall::start("/v1beta/models/fast:generateContent", true);
        call.read_body(Some(br#"{"contents":[]}"#));
        call.keep(br#"{"contents":[]}"#.to_vec());
        assert!(!call.keeps_body());
        let answered = ResponseFacts { model: Some("gemini-2.5-flash-001".into()), ..ResponseFacts::default() };
        let u = LlmCall { resolved: Some("gemini-2.5-flash".into()), ..call }.usage(answered).unwrap();
        assert_eq!((u.requested_model.as_deref(), u.model.as_deref()), (Some("fast"), Some("gemini-2.5-flash-001")), "the answer's own model first");
    }

    #[test]
    fn hostile_bodies_name_no_model() {
        for body in [
            &br#"{"model":"gpt-4o-mini","model":"gpt-4o"}"#[..],
            br#"{"model":["gpt-4o"]}"#,
            br#"{"model":null}"#,
            br#"{"model":"gpt-4o"} {"model":"o1"}"#,
            b"{\"model\":\"gpt-4o\xff\"}",
            br#"{"model":"gpt\u0000"}"#,
            br#"{"Model":"gpt-4o"}"#,
        ] {
            let mut call = LlmCall::start("/v1/chat/completions", true);
            call.read_body(Some(body));
            assert_eq!(call.requested_model, None, "{}", String::from_utf8_lossy(body));
        }
        // an escaped name is the name the upstream decodes
        let mut call = LlmCall::start("/v1/chat/completions", true);
        call.read_body(Some(br#"{"model":"gpt\u002d4o"}"#));
        assert_eq!(call.requested_model.as_deref(), Some("gpt-4o"));
    }
}
