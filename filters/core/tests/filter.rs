#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The filter's behaviour through a mock host. The same tests run natively and, on
//! wasm32-unknown-unknown, under wasm-bindgen-test (node): the logic is what ships in the .wasm.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::{AuthFilter, MAX_USAGE_BODY};
use tollgate_filter_core::host::Action;
use tollgate_filter_core::stats::{DenyReason, Metric};
use tollgate_filter_core::key::hash_key;
use tollgate_filter_core::mock::MockHost;
use tollgate_wire::DecideRequest;

const KEY: &str = "tg_secret_key_123";

fn filter(config: &str) -> AuthFilter {
    filter_with_queue(config, Rc::new(RefCell::new(CompletionQueue::new(100))))
}

fn filter_with_queue(config: &str, queue: Rc<RefCell<CompletionQueue>>) -> AuthFilter {
    AuthFilter::new(Rc::new(FilterConfig::parse(config.as_bytes()).unwrap()), queue)
}

/// `f` through the headers phase of a request with the key: its call to the sidecar is out.
fn with_key(mut f: AuthFilter) -> (AuthFilter, MockHost) {
    let mut host = MockHost::new().with_header("x-api-key", KEY);
    f.on_request_headers(&mut host, true);
    (f, host)
}

fn allow_body() -> &'static [u8] {
    br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","responseHeaders":[{"name":"x-rl","value":"9"}]}"#
}

#[test]
fn missing_key_is_denied_locally_without_a_callout() {
    let mut host = MockHost::new();
    let mut f = filter("{}");
    assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
    assert!(host.calls.is_empty());
    let reply = host.reply.clone().unwrap();
    assert_eq!(reply.status, 401);
    assert_eq!(reply.body, br#"{"error":"missing_key","message":"an API key is required"}"#);
    assert!(reply.headers.contains(&("content-type".into(), "application/json".into())));
    assert_eq!(host.count_of(Metric::Denied(DenyReason::of("missing_key"))), 1);
}

#[test]
fn key_is_hashed_stripped_and_never_leaves_the_filter() {
    let mut host = MockHost::new()
        .with_header(":path", &format!("/v1/chat?api_key={KEY}&x=1"))
        .with_header("x-api-key", KEY)
        .with_header("authorization", &format!("Bearer {KEY}"))
        .with_header("x-request-id", "req-1");
    host.client_ip = Some("10.1.2.3".into());
    let mut f = filter("{}");
    assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
    assert_eq!(host.calls.len(), 1);
    let call = &host.calls[0];
    assert_eq!(call.cluster, "tollgate_sidecar");
    assert_eq!(call.timeout.as_millis(), 25);
    let req: DecideRequest = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(req.key_hash, hash_key(KEY));
    assert_eq!(req.path, "/v1/chat?x=1");
    assert_eq!(req.request_id.as_deref(), Some("req-1"));
    assert_eq!(req.client_ip.as_deref(), Some("10.1.2.3"));
    assert_eq!(host.header(":path"), Some("/v1/chat?x=1"));
    assert_eq!(host.header("authorization"), None);
    assert_eq!(host.header("x-api-key"), None);

    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);
    assert_eq!(f.on_response_headers(&mut host, false), Action::Continue);
    assert!(!host.everything_sent().contains(KEY), "raw key leaked: {}", host.everything_sent());
}

#[test]
fn allow_sets_identity_headers_and_response_headers() {
    let (mut f, mut host) = with_key(filter("{}"));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);
    assert_eq!(host.header("x-tollgate-tenant"), Some("acme"));
    assert_eq!(host.header("x-tollgate-key-id"), Some("key_7"));
    assert_eq!(host.header("x-tollgate-plan"), Some("gold"));
    f.on_response_headers(&mut host, false);
    assert_eq!(host.response_headers, vec![("x-rl".to_string(), "9".to_string())]);
    assert_eq!(host.count_of(Metric::Allowed), 1);
}

#[test]
fn client_supplied_internal_headers_are_stripped_first() {
    let mut host = MockHost::new()
        .with_header("x-tollgate-tenant", "evil")
        .with_header("x-tollgate-anything", "x")
        .with_header("x-other", "kept");
    let mut f = filter("{}");
    f.on_request_headers(&mut host, true); // no key: denied, but the strip happened first
    assert_eq!(host.header("x-tollgate-tenant"), None);
    assert_eq!(host.header("x-tollgate-anything"), None);
    assert_eq!(host.header("x-other"), Some("kept"));
}

#[test]
fn sidecar_deny_becomes_a_json_reply_with_its_status_and_code() {
    let (mut f, mut host) = with_key(filter("{}"));
    let body = br#"{"verdict":"deny","status":401,"error":"revoked_key","message":"this key was revoked"}"#;
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), body), Action::Pause);
    let reply = host.reply.clone().unwrap();
    assert_eq!(reply.status, 401);
    assert_eq!(reply.body, br#"{"error":"revoked_key","message":"this key was revoked"}"#);
    assert_eq!(host.count_of(Metric::Denied(DenyReason::of("revoked_key"))), 1);
    assert_eq!(host.header("x-tollgate-tenant"), None);
}

#[test]
fn sidecar_failures_fail_closed_by_default() {
    for (status, body) in [(Some(503), &b""[..]), (Some(504), b""), (Some(500), b"oops"), (Some(200), b"{bad"), (None, b"")] {
        let (mut f, mut host) = with_key(filter("{}"));
        assert_eq!(f.on_sidecar_response(&mut host, 1, status, body), Action::Pause, "{status:?}");
        let reply = host.reply.clone().unwrap();
        assert_eq!(reply.status, 503);
        assert!(String::from_utf8_lossy(&reply.body).contains("sidecar_unavailable"));
        assert_eq!(host.count_of(Metric::SidecarError), 1);
        assert_eq!(host.count_of(Metric::FailedClosed), 1);
    }
}

#[test]
fn sidecar_failures_fail_open_when_configured() {
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_header("x-tollgate-degraded", "spoof");
    let mut f = filter(r#"{"failureMode":"open"}"#);
    f.on_request_headers(&mut host, true);
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(504), b""), Action::Continue);
    assert!(host.reply.is_none());
    assert_eq!(host.header("x-tollgate-degraded"), Some("sidecar_unavailable"));
    assert_eq!(host.header("x-tollgate-tenant"), None);
    assert_eq!(host.header("x-api-key"), None);
    assert_eq!(host.count_of(Metric::FailedOpen), 1);
}

#[test]
fn dispatch_error_applies_the_failure_mode_at_once() {
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_dispatch_error("BadArgument");
    let mut f = filter("{}");
    assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
    assert_eq!(host.reply.clone().unwrap().status, 503);
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_dispatch_error("BadArgument");
    let mut f = filter(r#"{"failureMode":"open"}"#);
    assert_eq!(f.on_request_headers(&mut host, true), Action::Continue);
}

#[test]
fn a_response_with_another_token_is_ignored() {
    let (mut f, mut host) = with_key(filter("{}"));
    assert_eq!(f.on_sidecar_response(&mut host, 99, Some(200), allow_body()), Action::Pause);
    assert_eq!(host.header("x-tollgate-tenant"), None);
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);
}

#[test]
fn every_metric_has_a_distinct_name() {
    let names: Vec<String> = Metric::all().into_iter().map(|m| m.name()).collect();
    let mut dedup = names.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(names.len(), dedup.len());
    assert!(names.contains(&"tollgate.requests.denied.unknown_key".to_string()));
}

fn allow_cacheable(ms: u64) -> Vec<u8> {
    format!(r#"{{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":{ms}}}"#).into_bytes()
}

#[test]
fn a_cacheable_allow_is_reused_without_a_call_until_it_expires() {
    let mut first = MockHost::new().with_header("x-api-key", KEY);
    first.now_ms = 1_000;
    let mut f = filter("{}");
    f.on_request_headers(&mut first, true);
    assert_eq!(f.on_sidecar_response(&mut first, 1, Some(200), &allow_cacheable(300)), Action::Continue);
    assert!(!first.everything_sent().contains(KEY), "raw key in shared data");

    // Same Envoy, next request, 299 ms later: no call, same identity.
    let mut second = MockHost::next_request(&first).with_header("x-api-key", KEY).with_header("x-tollgate-tenant", "evil");
    second.now_ms = 1_299;
    assert_eq!(filter("{}").on_request_headers(&mut second, true), Action::Continue);
    assert!(second.calls.is_empty());
    assert_eq!(second.header("x-tollgate-tenant"), Some("acme"));
    assert_eq!(second.header("x-tollgate-key-id"), Some("key_7"));
    assert_eq!(second.header("x-api-key"), None);
    assert_eq!(second.count_of(Metric::AuthCacheHit), 1);
    assert_eq!(second.count_of(Metric::Allowed), 1);

    // At 300 ms the entry has expired: back to the sidecar.
    let mut third = MockHost::next_request(&first).with_header("x-api-key", KEY);
    third.now_ms = 1_300;
    assert_eq!(filter("{}").on_request_headers(&mut third, true), Action::Pause);
    assert_eq!(third.calls.len(), 1);

    // Another key is not served from this entry.
    let mut other = MockHost::next_request(&first).with_header("x-api-key", "another");
    other.now_ms = 1_100;
    assert_eq!(filter("{}").on_request_headers(&mut other, true), Action::Pause);
}

#[test]
fn a_worker_keeps_its_own_copy_of_auth_cache_entries_with_the_same_expiry() {
    use tollgate_filter_core::auth_cache::LocalAllows;
    let worker = Rc::new(RefCell::new(LocalAllows::default()));
    let on_worker = |config: &str| filter(config).with_local_allows(worker.clone());
    let mut first = MockHost::new().with_header("x-api-key", KEY);
    first.now_ms = 1_000;
    let mut f = on_worker("{}");
    f.on_request_headers(&mut first, true);
    assert_eq!(f.on_sidecar_response(&mut first, 1, Some(200), &allow_cacheable(300)), Action::Continue);
    assert_eq!(worker.borrow().len(), 1);

    // Same worker, shared data gone (not even read): answered from the worker's copy.
    let mut second = MockHost::new().with_header("x-api-key", KEY);
    second.now_ms = 1_299;
    assert_eq!(on_worker("{}").on_request_headers(&mut second, true), Action::Continue);
    assert!(second.calls.is_empty());
    assert_eq!(second.header("x-tollgate-tenant"), Some("acme"));
    assert_eq!(second.count_of(Metric::AuthCacheHit), 1);

    // Expired at the same time as the shared entry: back to the sidecar.
    let mut third = MockHost::next_request(&first).with_header("x-api-key", KEY);
    third.now_ms = 1_300;
    assert_eq!(on_worker("{}").on_request_headers(&mut third, true), Action::Pause);
    assert_eq!(third.calls.len(), 1);

    // Another worker reads the shared entry once, then keeps its own copy.
    let other = Rc::new(RefCell::new(LocalAllows::default()));
    let mut fourth = MockHost::next_request(&first).with_header("x-api-key", KEY);
    fourth.now_ms = 1_100;
    assert_eq!(filter("{}").with_local_allows(other.clone()).on_request_headers(&mut fourth, true), Action::Continue);
    assert_eq!(other.borrow().len(), 1);
    let mut fifth = MockHost::new().with_header("x-api-key", KEY);
    fifth.now_ms = 1_200;
    assert_eq!(filter("{}").with_local_allows(other.clone()).on_request_headers(&mut fifth, true), Action::Continue);
    assert!(fifth.calls.is_empty());
    // Another key is not served from it.
    let mut sixth = MockHost::new().with_header("x-api-key", "another");
    sixth.now_ms = 1_200;
    assert_eq!(filter("{}").with_local_allows(other).on_request_headers(&mut sixth, true), Action::Pause);
}

#[test]
fn the_cache_time_is_capped_by_config_and_only_plain_allows_are_cached() {
    // Capped to authCacheMaxTtl.
    let mut h = MockHost::new().with_header("x-api-key", KEY);
    let mut f = filter(r#"{"authCacheMaxTtl":"100ms"}"#);
    f.on_request_headers(&mut h, true);
    f.on_sidecar_response(&mut h, 1, Some(200), &allow_cacheable(60_000));
    let mut next = MockHost::next_request(&h).with_header("x-api-key", KEY);
    next.now_ms = 100;
    assert_eq!(filter(r#"{"authCacheMaxTtl":"100ms"}"#).on_request_headers(&mut next, true), Action::Pause);

    // Disabled with 0ms.
    let mut h = MockHost::new().with_header("x-api-key", KEY);
    let mut f = filter(r#"{"authCacheMaxTtl":"0ms"}"#);
    f.on_request_headers(&mut h, true);
    f.on_sidecar_response(&mut h, 1, Some(200), &allow_cacheable(300));
    assert!(h.cached_keys().is_empty());

    // Not without cacheForMs, not with per-request response headers, never a deny.
    for body in [
        allow_body().to_vec(),
        br#"{"verdict":"allow","tenant":"a","keyId":"k","plan":"p","cacheForMs":300,"responseHeaders":[{"name":"x","value":"1"}]}"#.to_vec(),
        br#"{"verdict":"deny","status":401,"error":"revoked_key","message":"m"}"#.to_vec(),
    ] {
        let mut h = MockHost::new().with_header("x-api-key", KEY);
        let mut f = filter("{}");
        f.on_request_headers(&mut h, true);
        f.on_sidecar_response(&mut h, 1, Some(200), &body);
        assert!(h.cached_keys().is_empty(), "cached: {}", String::from_utf8_lossy(&body));
    }
}

#[test]
fn a_429_names_the_limit_and_carries_the_sidecars_headers() {
    let (mut f, mut host) = with_key(filter("{}"));
    let body = br#"{"verdict":"deny","status":429,"error":"rate_limited","message":"slow down","limit":"per-minute",
        "responseHeaders":[{"name":"retry-after","value":"7"},{"name":"ratelimit","value":"\"per-minute\";r=0;t=7"}]}"#;
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), body), Action::Pause);
    let reply = host.reply.clone().unwrap();
    assert_eq!(reply.status, 429);
    assert_eq!(reply.body, br#"{"error":"rate_limited","message":"slow down","limit":"per-minute"}"#);
    assert!(reply.headers.contains(&("retry-after".into(), "7".into())));
    assert_eq!(host.count_of(Metric::Denied(DenyReason::of("rate_limited"))), 1);
}

fn allow_with_ticket() -> &'static [u8] {
    br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":500,
        "ticket":{"tenant":"acme","requestId":"req-9","budgets":[{"limit":"tokens","subject":"k.key_7","period":202611,"reserved":1000}],
        "expiresAtMs":1764374700000,"mac":"0f1e"}}"#
}

#[test]
fn a_request_holding_a_ticket_reports_its_completion_with_the_tokens_used() {
    let queue = Rc::new(RefCell::new(CompletionQueue::new(100)));
    let (mut f, mut host) = with_key(filter_with_queue("{}", queue.clone()));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_with_ticket()), Action::Continue);
    assert!(host.cached_keys().is_empty(), "an answer holding a ticket is never cached");
    host.upstream_response = vec![(":status".into(), "200".into())];
    f.on_response_headers(&mut host, false);
    for chunk in [&br#"{"id":"x","usage":{"prompt_tokens":5,"#[..], br#""total_tokens":42}}"#] {
        host.response_chunk = chunk.to_vec();
        assert_eq!(f.on_response_body(&mut host, chunk.len(), false), Action::Continue);
    }
    assert!(queue.borrow().is_empty(), "reported only when the request is over");
    f.on_log(&mut host);
    let body = queue.borrow_mut().begin_flush(10).unwrap();
    let batch: tollgate_wire::CompletionBatch = serde_json::from_slice(&body).unwrap();
    assert_eq!(batch.completions.len(), 1);
    let c = &batch.completions[0];
    assert_eq!(c.status, 200);
    assert_eq!(c.tokens, Some(42));
    assert_eq!(c.ticket.request_id, "req-9");
    assert_eq!(c.ticket.budgets[0].reserved, 1000);
    assert_eq!((c.ticket.expires_at_ms, c.ticket.mac.as_str()), (1_764_374_700_000, "0f1e"), "echoed as sealed");
}

/// A budget reads its charge from a response's own usage: `data:` frames only when the response
/// says it is an event stream. In plain text or a page, such a line is what the client or a
/// model wrote as it is (an echo), and would let a client choose its charge.
#[test]
fn sse_frames_are_read_for_a_budget_only_from_an_event_stream() {
    let body = b"you said:\ndata: {\"usage\":{\"total_tokens\":0}}\n";
    for (content_type, tokens) in [(Some("text/plain"), None), (None, None), (Some("text/event-stream; charset=utf-8"), Some(0))] {
        let queue = Rc::new(RefCell::new(CompletionQueue::new(100)));
        let (mut f, mut host) = with_key(filter_with_queue("{}", queue.clone()));
        assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_with_ticket()), Action::Continue);
        host.upstream_response = vec![(":status".into(), "200".into())];
        if let Some(t) = content_type {
            host.upstream_response.push(("content-type".into(), t.into()));
        }
        f.on_response_headers(&mut host, false);
        host.response_chunk = body.to_vec();
        assert_eq!(f.on_response_body(&mut host, body.len(), true), Action::Continue);
        f.on_log(&mut host);
        let sent = queue.borrow_mut().begin_flush(10).unwrap();
        let batch: tollgate_wire::CompletionBatch = serde_json::from_slice(&sent).unwrap();
        assert_eq!(batch.completions[0].tokens, tokens, "{content_type:?}: the reservation is the charge unless a stream says");
    }
}

/// A request the gateway answered itself after its allow (an open breaker), or Envoy answered
/// finding nothing to send it to (decision 175), used no tokens: its budget's reservation is
/// settled at 0 even where responses are not read for usage. A reset after it went out is not.
#[test]
fn a_request_that_never_reached_its_upstream_settles_its_reservation_at_0() {
    let reset = "upstream_reset_before_response_started{";
    let cases = [("breaker", Some(0)), ("no_healthy_upstream", Some(0)), ("connection_failure}", Some(0)), ("connection_termination}", None)];
    for config in [r#"{}"#, r#"{"tokenUsage":"none"}"#] {
        for (end, tokens) in cases {
            let queue = Rc::new(RefCell::new(CompletionQueue::new(100)));
            let (mut f, mut host) = with_key(filter_with_queue(config, queue.clone()));
            assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_with_ticket()), Action::Continue);
            if end == "breaker" {
                f.refused_before_upstream();
            } else {
                let details = if end.ends_with('}') { format!("{reset}{end}") } else { end.to_string() };
                host.properties.insert("response.code_details".into(), details.into_bytes());
                host.upstream_response = vec![(":status".into(), "503".into())];
                f.on_response_headers(&mut host, true);
            }
            f.on_log(&mut host);
            let sent = queue.borrow_mut().begin_flush(10).unwrap();
            let batch: tollgate_wire::CompletionBatch = serde_json::from_slice(&sent).unwrap();
            assert_eq!(batch.completions[0].tokens, tokens, "{config} {end}");
        }
    }
}

#[test]
fn requests_without_a_ticket_report_nothing() {
    let queue = Rc::new(RefCell::new(CompletionQueue::new(100)));
    let (mut f, mut host) = with_key(filter_with_queue("{}", queue.clone()));
    f.on_sidecar_response(&mut host, 1, Some(200), allow_body());
    f.on_log(&mut host);
    assert!(queue.borrow().is_empty());
}

#[test]
fn usage_is_read_from_json_and_from_sse_frames() {
    use tollgate_filter_core::usage::usage_tokens;
    assert_eq!(usage_tokens(br#"{"usage":{"total_tokens":17}}"#), Some(17));
    let sse = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":3,\"total_tokens\": 9}}\n\ndata: [DONE]\n\n";
    assert_eq!(usage_tokens(sse), Some(9));
    assert_eq!(usage_tokens(b"no usage here"), None);
    // the response's usage object wins over a total_tokens elsewhere in the document
    let nested = br#"{"total_tokens":1,"choices":[{"x":{"total_tokens":5}}],"usage":{"prompt_tokens":2,"total_tokens":30},"model":"m"}"#;
    assert_eq!(usage_tokens(nested), Some(30));
    // and only it counts: a total_tokens elsewhere may be what a client or a model wrote (an
    // echoed request, a tool call's input), which would let a client choose its own charge
    assert_eq!(usage_tokens(br#"{"usage":null,"meta":{"total_tokens": 4}}"#), None);
    let anthropic_like = br#"{"content":[{"type":"tool_use","input":{"total_tokens":0}}],"usage":{"input_tokens":9,"output_tokens":40}}"#;
    assert_eq!(usage_tokens(anthropic_like), None);
    assert_eq!(usage_tokens(br#"{"echo":{"usage":{"total_tokens":0}}}"#), None);
    let sse_content = b"data: {\"usage\":{\"total_tokens\": 50}}\n\ndata: {\"delta\":{\"x\":{\"total_tokens\":0}}}\n\n";
    assert_eq!(usage_tokens(sse_content), Some(50), "an SSE frame's own usage object, not a later frame's content");
    assert_eq!(usage_tokens(br#"{"method":"GET","headers":[["a","b"]]}"#), None, "an echo without usage");
    assert_eq!(usage_tokens(b"\xff\xfe {\"total_tokens\": 12}"), None, "neither JSON nor SSE");
    assert_eq!(usage_tokens(br#"{"total_tokens":"many"}"#), None);
    // the scan's edges: the field first, underscores elsewhere, bodies shorter than the field
    assert_eq!(usage_tokens(br#"{"usage":{"total_tokens":3}}"#), Some(3));
    assert_eq!(usage_tokens(b"a_b\ndata: {\"usage\":{\"total_tokens\": 8}}\n_c_"), Some(8));
    assert_eq!(usage_tokens(b"data:{\"usage\":{\"total_tokens\":6}}\r\n"), Some(6), "CRLF, no space after the colon");
    assert_eq!(usage_tokens(b"_"), None);
    assert_eq!(usage_tokens(b""), None);
    assert_eq!(usage_tokens(br#"total_tokens": 5"#), None, "no opening quote: not the field");
}

#[test]
fn configured_headers_are_forwarded_for_limit_subjects() {
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_header("x-user", "u-1");
    let mut f = filter(r#"{"forwardHeaders":["X-User","x-absent"]}"#);
    f.on_request_headers(&mut host, true);
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.headers, vec![tollgate_wire::Header::new("x-user", "u-1")]);
}

#[test]
fn the_token_estimate_is_read_from_the_json_body_before_deciding() {
    let cfg = r#"{"tokenEstimateField":"max_tokens"}"#;
    let mut host = MockHost::new()
        .with_header(":method", "POST")
        .with_header("content-type", "application/json")
        .with_header("x-api-key", KEY);
    let mut f = filter(cfg);
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    assert!(host.calls.is_empty(), "no decision before the body is in");
    host.request_body = br#"{"model":"m","max_tokens":256,"messages":[]}"#.to_vec();
    assert_eq!(f.on_request_body(&mut host, 10, false), Action::Pause);
    let n = host.request_body.len();
    assert_eq!(f.on_request_body(&mut host, n, true), Action::Hold, "read, decided: the body now only waits");
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.token_estimate, Some(256));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);

    // no such field, or not JSON: decided without an estimate
    let mut host = MockHost::new().with_header("content-type", "application/json").with_header("x-api-key", KEY);
    let mut f = filter(cfg);
    f.on_request_headers(&mut host, false);
    host.request_body = b"not json".to_vec();
    f.on_request_body(&mut host, 8, true);
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.token_estimate, None);

    // without the option, or without a JSON body, the decision does not wait
    let mut host = MockHost::new().with_header("content-type", "application/json").with_header("x-api-key", KEY);
    assert_eq!(filter("{}").on_request_headers(&mut host, false), Action::Pause);
    assert_eq!(host.calls.len(), 1);
    let mut host = MockHost::new().with_header("x-api-key", KEY);
    filter(cfg).on_request_headers(&mut host, true);
    assert_eq!(host.calls.len(), 1);
}

#[test]
fn a_body_past_what_the_filter_reads_is_decided_without_it_and_held_not_buffered() {
    // Decision 139: the filter reads a JSON body up to 1 MiB for the token estimate; past that it
    // decides without the body, and what follows waits with flow control, never buffered
    // against Envoy's limit (which would answer the client Envoy's plain 413).
    let mut host = MockHost::new().with_header(":method", "POST").with_header("content-type", "application/json").with_header("x-api-key", KEY);
    let mut f = filter(r#"{"tokenEstimateField":"max_tokens"}"#);
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    assert_eq!(f.on_request_body(&mut host, MAX_USAGE_BODY, false), Action::Pause, "read up to the bound: buffered");
    assert!(host.calls.is_empty());
    assert_eq!(f.on_request_body(&mut host, MAX_USAGE_BODY + 1, false), Action::Hold, "decided, the rest held");
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.token_estimate, None, "no estimate from a body it did not read");
    assert_eq!(f.on_request_body(&mut host, 3 * MAX_USAGE_BODY, false), Action::Hold);
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);
    assert_eq!(f.on_request_body(&mut host, 3 * MAX_USAGE_BODY, true), Action::Continue);
}

#[test]
fn a_body_arriving_while_the_decision_is_pending_is_held_back() {
    let mut host = MockHost::new().with_header(":method", "POST").with_header("x-api-key", KEY);
    let mut f = filter("{}");
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    // the decision is still out: the body must not let the request through, and waits with
    // flow control, not buffered against Envoy's limit (decision 139)
    assert_eq!(f.on_request_body(&mut host, 5, false), Action::Hold);
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);
    assert_eq!(f.on_request_body(&mut host, 5, true), Action::Continue);
}

#[test]
fn the_gateway_names_each_decision_never_the_client() {
    let ids = Rc::new(RefCell::new(tollgate_filter_core::ids::DecisionIds::new([9; 32])));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let mut host = MockHost::new().with_header("x-api-key", KEY).with_header("x-request-id", "fixed-1");
        let mut f = filter("{}").with_decision_ids(ids.clone());
        assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
        let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
        // the client's id is only carried along for tracing
        assert_eq!(req.request_id.as_deref(), Some("fixed-1"));
        let id = req.decision_id.expect("a decision id");
        assert_eq!(id.len(), 32);
        assert!(!id.contains("fixed"));
        seen.push(id);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 3, "one id per decision, whatever the client sent");
}

#[test]
fn bytes_that_are_not_utf8_never_panic_and_are_judged_per_header() {
    // in an unrelated header: absent for the filter, the request goes on as usual
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_raw_header("user-agent", b"curl\xff");
    let mut f = filter(r#"{"forwardHeaders":["user-agent"]}"#);
    assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert!(req.headers.is_empty(), "an unreadable value is not forwarded: {:?}", req.headers);

    // in the key: a 400 JSON error, and the header is stripped all the same
    let mut host = MockHost::new().with_raw_header("x-api-key", b"tg_\xff\xfe");
    assert_eq!(filter("{}").on_request_headers(&mut host, true), Action::Pause);
    let reply = host.reply.clone().unwrap();
    assert_eq!(reply.status, 400);
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&reply.body).unwrap()["error"], "invalid_request");
    assert!(host.request_headers.iter().all(|(n, _)| n != "x-api-key"));
    assert!(host.calls.is_empty());
    assert_eq!(host.count_of(Metric::Denied(DenyReason::of("invalid_request"))), 1);

    // in the path
    let mut host = MockHost::new().with_header("x-api-key", KEY);
    host.request_headers.retain(|(n, _)| n != ":path");
    let mut host = host.with_raw_header(":path", b"/caf\xe9?api_key=x");
    assert_eq!(filter("{}").on_request_headers(&mut host, true), Action::Pause);
    assert_eq!(host.reply.clone().unwrap().status, 400);
    assert!(host.calls.is_empty());
}

#[test]
fn two_different_keys_are_refused_and_neither_reaches_the_upstream() {
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_header(":path", "/v1?api_key=tg_other");
    assert_eq!(filter("{}").on_request_headers(&mut host, true), Action::Pause);
    let reply = host.reply.clone().unwrap();
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("more than one API key"));
    assert!(host.calls.is_empty());
    // the same key twice is one key
    let mut host = MockHost::new().with_header("x-api-key", KEY).with_header(":path", &format!("/v1?api_key={KEY}"));
    assert_eq!(filter("{}").on_request_headers(&mut host, true), Action::Pause);
    assert_eq!(host.calls.len(), 1);
    assert_eq!(host.header(":path"), Some("/v1"));
}

#[test]
fn trailers_never_let_a_request_go_on_before_its_decision() {
    // Envoy takes a trailers callback's `Continue` as "go on" for the whole request, headers and
    // body included: before, the SDK's default answered it, and an HTTP/2 request with trailers
    // went upstream undecided (any key, a wrong one too).
    let mut host = MockHost::new().with_header(":method", "POST").with_header("x-api-key", KEY);
    host.request_trailers = vec![("x-tollgate-tenant".into(), b"forged".to_vec()), ("grpc-status".into(), b"0".to_vec())];
    let mut f = filter("{}");
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    assert_eq!(host.calls.len(), 1, "the decision is asked for");
    assert_eq!(f.on_request_body(&mut host, 5, false), Action::Hold);
    assert_eq!(f.on_request_trailers(&mut host), Action::Pause, "still waiting for the decision");
    assert_eq!(host.request_trailers, [("grpc-status".to_string(), b"0".to_vec())], "a client's internal names are removed from trailers");
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);

    // a denial: the request never goes on
    let mut host = MockHost::new().with_header(":method", "POST").with_header("x-api-key", KEY);
    let mut f = filter("{}");
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    assert_eq!(f.on_request_trailers(&mut host), Action::Pause);
    let deny = br#"{"verdict":"deny","status":401,"error":"unknown_key","message":"unknown key"}"#;
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), deny), Action::Pause);
    assert_eq!(host.reply.as_ref().map(|r| r.status), Some(401));

    // waiting for the body (the token estimate): trailers end it, and the decision is asked for
    let mut host = MockHost::new()
        .with_header(":method", "POST")
        .with_header("content-type", "application/json")
        .with_header("x-api-key", KEY);
    let mut f = filter(r#"{"tokenEstimateField":"max_tokens"}"#);
    assert_eq!(f.on_request_headers(&mut host, false), Action::Pause);
    host.request_body = br#"{"max_tokens":64}"#.to_vec();
    let n = host.request_body.len();
    assert_eq!(f.on_request_body(&mut host, n, false), Action::Pause);
    assert!(host.calls.is_empty());
    assert_eq!(f.on_request_trailers(&mut host), Action::Pause);
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.token_estimate, Some(64));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow_body()), Action::Continue);
    // a request decided already goes on
    assert_eq!(f.on_request_trailers(&mut host), Action::Continue);
}
