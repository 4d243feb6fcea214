#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Model aliases in the filter (issue 42 item 4, decision 309): a body that names its model is
//! kept buffered while its decision is out, rewritten in place when the answer names the real
//! model (its `content-length` with it), and a request that cannot be rewritten safely is
//! refused, never sent on with the alias.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::host::Action;
use tollgate_filter_core::mock::MockHost;
use tollgate_wire::DecideRequest;

const ALIASED: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","model":"gpt-4o-mini"}"#;

/// An LLM request (every request is one: `usage.llm = "all"`) with `body`, its decision called
/// once the body is in: what the body's end answered.
fn llm_request(path: &str, body: &[u8]) -> (AuthFilter, MockHost, Action) {
    let config = Rc::new(FilterConfig::parse(br#"{"usage":{"llm":"all"}}"#).unwrap());
    let mut f = AuthFilter::new(config, Rc::new(RefCell::new(CompletionQueue::new(10))));
    let mut host = MockHost::new()
        .with_header(":method", "POST")
        .with_header(":path", path)
        .with_header("content-type", "application/json")
        .with_header("content-length", &body.len().to_string())
        .with_header("x-api-key", "tg_secret_key_123");
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    host.request_body = body.to_vec();
    let end = f.on_request_body(&mut host, body.len(), true);
    assert_eq!(host.calls.len(), 1, "decided once the body is in");
    (f, host, end)
}

#[test]
fn a_body_naming_an_alias_stays_buffered_and_is_rewritten_from_the_answer() {
    let (mut f, mut host, end) = llm_request("/v1/chat/completions", br#"{"model":"fast","messages":[{"content":"fast"}]}"#);
    assert_eq!(end, Action::Pause, "kept buffered: the answer may rewrite it");
    let asked: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(asked.llm.and_then(|l| l.model).as_deref(), Some("fast"));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), ALIASED), Action::Continue);
    assert_eq!(host.request_body, br#"{"model":"gpt-4o-mini","messages":[{"content":"fast"}]}"#);
    assert_eq!(host.header("content-length"), Some(host.request_body.len().to_string().as_str()));
    assert!(host.reply.is_none());

    // an answer without a model leaves the body as it was
    let (mut f, mut host, _) = llm_request("/v1/chat/completions", br#"{"model":"gpt-4o"}"#);
    let plain = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold"}"#;
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), plain), Action::Continue);
    assert_eq!(host.request_body, br#"{"model":"gpt-4o"}"#);
}

#[test]
fn a_gemini_paths_alias_is_rewritten_in_the_path() {
    let (mut f, mut host, end) = llm_request("/v1beta/models/fast:generateContent?alt=sse", br#"{"contents":[]}"#);
    assert_eq!(end, Action::Hold, "a body naming no model is not kept");
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), ALIASED), Action::Continue);
    assert_eq!(host.header(":path"), Some("/v1beta/models/gpt-4o-mini:generateContent?alt=sse"));
    assert_eq!(host.request_body, br#"{"contents":[]}"#);
}

#[test]
fn a_request_the_filter_cannot_rewrite_is_refused_never_sent_with_the_alias() {
    // the sidecar names a model for a request whose own the filter could not read (a body naming
    // it twice): nothing to rewrite, so refused
    let (mut f, mut host, end) = llm_request("/v1/chat/completions", br#"{"model":"fast","model":"fast"}"#);
    assert_eq!(end, Action::Hold);
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), ALIASED), Action::Pause);
    let reply = host.reply.as_ref().expect("refused");
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("model_required"));
    assert_eq!(host.request_body, br#"{"model":"fast","model":"fast"}"#, "never rewritten");
}
