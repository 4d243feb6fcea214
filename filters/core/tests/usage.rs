#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Usage metering in the filter (issue 6), through a mock host: one event per request let through
//! with an identity, none otherwise; ids made by the filter; tokens, status, sizes and duration.
//! Runs natively and on wasm32 under wasm-bindgen-test.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::host::Action;
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::usage::Meter;
use tollgate_wire::usage::{UsageBatch, UsageEvent};

const KEY: &str = "tg_secret_key_123";
const METERED: &str = r#"{"usage":{"enabled":true}}"#;

fn metered(config: &str, meter: &Rc<RefCell<Meter>>) -> AuthFilter {
    let config = Rc::new(FilterConfig::parse(config.as_bytes()).unwrap());
    AuthFilter::new(config, Rc::new(RefCell::new(CompletionQueue::new(100)))).with_meter(meter.clone())
}

fn meter() -> Rc<RefCell<Meter>> {
    Rc::new(RefCell::new(Meter::new(100, 0xabc)))
}

fn events(meter: &Rc<RefCell<Meter>>) -> Vec<UsageEvent> {
    let mut m = meter.borrow_mut();
    let Some(body) = m.queue.begin_flush(1000) else { return vec![] };
    m.queue.end_flush(true);
    serde_json::from_slice::<UsageBatch>(&body).unwrap().events
}

/// `f` through the headers phase of a request with the key: its call to the sidecar is out.
fn with_key(f: AuthFilter) -> (AuthFilter, MockHost) {
    with_key_on(f, MockHost::new().with_header("x-api-key", KEY))
}

/// [`with_key`] on `host` (which carries the key).
fn with_key_on(mut f: AuthFilter, mut host: MockHost) -> (AuthFilter, MockHost) {
    f.on_request_headers(&mut host, true);
    (f, host)
}

fn allow() -> &'static [u8] {
    br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":500}"#
}

fn respond(f: &mut AuthFilter, host: &mut MockHost, status: &str, content_type: &str, body: &[u8]) {
    host.upstream_response = vec![(":status".into(), status.into()), ("content-type".into(), content_type.into())];
    f.on_response_headers(host, false);
    host.response_chunk = body.to_vec();
    f.on_response_body(host, body.len(), true);
}

#[test]
fn an_allowed_request_becomes_one_event_when_it_ends() {
    let m = meter();
    let mut host = MockHost::new()
        .with_header(":method", "POST")
        .with_header(":path", &format!("/v1/chat?api_key={KEY}&x=1"))
        .with_header("x-request-id", "client-chosen");
    host.now_ms = 1_764_460_800_000;
    let mut f = metered(METERED, &m);
    f.on_request_headers(&mut host, true);
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow()), Action::Continue);
    respond(&mut f, &mut host, "200", "application/json", br#"{"usage":{"total_tokens":42}}"#);
    host.properties.insert("request.total_size".into(), 120i64.to_le_bytes().to_vec());
    host.properties.insert("response.total_size".into(), 300i64.to_le_bytes().to_vec());
    host.now_ms += 35;
    assert!(m.borrow().queue.is_empty(), "recorded only when the request is over");
    f.on_log(&mut host);
    let e = events(&m);
    assert_eq!(e.len(), 1);
    let e = &e[0];
    assert_eq!(e.id, "0000000000000abc0000000000000001", "the filter's own id, not x-request-id");
    assert_eq!((e.tenant.as_str(), e.key_id.as_str(), e.plan.as_str()), ("acme", "key_7", "gold"));
    assert_eq!((e.method.as_str(), e.authority.as_str(), e.path.as_str()), ("POST", "api.test", "/v1/chat"));
    assert_eq!((e.status, e.start_ms, e.duration_ms), (200, 1_764_460_800_000, 35));
    assert_eq!((e.tokens, e.request_bytes, e.response_bytes), (Some(42), Some(120), Some(300)));
    assert_eq!(e.denied, None);
    let json = serde_json::to_string(e).unwrap();
    assert!(!json.contains(KEY), "raw key leaked into a usage event: {json}");
}

#[test]
fn auth_cache_hits_are_metered_too() {
    let m = meter();
    let (mut f, mut host) = with_key(metered(METERED, &m));
    f.on_sidecar_response(&mut host, 1, Some(200), allow());
    f.on_log(&mut host);
    // the same key again on this Envoy: answered from the auth cache, no call
    let mut host = MockHost::next_request(&host).with_header("x-api-key", KEY);
    let mut f = metered(METERED, &m);
    assert_eq!(f.on_request_headers(&mut host, true), Action::Continue);
    assert!(host.calls.is_empty());
    respond(&mut f, &mut host, "404", "text/plain", b"nope");
    f.on_log(&mut host);
    let e = events(&m);
    assert_eq!(e.len(), 2);
    assert_ne!(e[0].id, e[1].id);
    assert_eq!((e[1].tenant.as_str(), e[1].status, e[1].tokens), ("acme", 404, None));
}

#[test]
fn requests_without_an_identity_are_not_metered() {
    let m = meter();
    // no key: the filter's own 401
    let mut host = MockHost::new();
    let mut f = metered(METERED, &m);
    f.on_request_headers(&mut host, true);
    f.on_log(&mut host);
    // denied by the sidecar (the sidecar meters its own denials)
    let (mut f, mut host) = with_key(metered(METERED, &m));
    let deny = br#"{"verdict":"deny","status":429,"error":"rate_limited","message":"m","limit":"l"}"#;
    f.on_sidecar_response(&mut host, 1, Some(200), deny);
    f.on_log(&mut host);
    // the sidecar failed and the filter failed open: nobody to bill
    let (mut f, mut host) = with_key(metered(r#"{"usage":{"enabled":true},"failureMode":"open"}"#, &m));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(503), b""), Action::Continue);
    f.on_log(&mut host);
    assert!(events(&m).is_empty());
}

#[test]
fn metering_is_off_unless_configured() {
    let m = meter();
    let (mut f, mut host) = with_key(metered("{}", &m));
    f.on_sidecar_response(&mut host, 1, Some(200), allow());
    f.on_log(&mut host);
    assert!(events(&m).is_empty());
}

#[test]
fn a_client_that_goes_away_is_metered_as_aborted() {
    let m = meter();
    let (mut f, mut host) = with_key(metered(METERED, &m));
    f.on_sidecar_response(&mut host, 1, Some(200), allow());
    f.on_log(&mut host); // no response headers ever came
    let e = events(&m);
    assert_eq!(e[0].status, 0);
    assert_eq!(e[0].class(), tollgate_wire::usage::UsageClass::Aborted);
}

#[test]
fn tokens_of_a_streamed_response_are_read_without_holding_it() {
    let m = meter();
    let (mut f, mut host) = with_key(metered(METERED, &m));
    f.on_sidecar_response(&mut host, 1, Some(200), allow());
    host.upstream_response = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    f.on_response_headers(&mut host, false);
    for chunk in [&b"data: {\"choices\":[]}\n\n"[..], b"data: {\"usage\":{\"total_tokens\":7}}\n\ndata: [DONE]\n\n"] {
        host.response_chunk = chunk.to_vec();
        assert_eq!(f.on_response_body(&mut host, chunk.len(), false), Action::Continue, "never held back");
    }
    f.on_log(&mut host);
    assert_eq!(events(&m)[0].tokens, Some(7));
}

/// Decision 170: an event stream longer than the body bound (1 MiB: ~4 000 tokens of an
/// LLM's chunks) still has its usage read — only its tail is kept. Before, the kept body was
/// dropped past 1 MiB and the request was metered with no tokens.
#[test]
fn the_usage_of_an_event_stream_longer_than_the_body_bound_is_read() {
    let m = meter();
    let (mut f, mut host) = with_key(metered(METERED, &m));
    f.on_sidecar_response(&mut host, 1, Some(200), allow());
    host.upstream_response = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    f.on_response_headers(&mut host, false);
    let frame = b"data: {\"choices\":[{\"delta\":{\"content\":\"word \"}}]}\n\n".repeat(1000);
    for _ in 0..60 {
        host.response_chunk = frame.clone(); // 60 x ~49 KB: ~2.9 MB
        assert_eq!(f.on_response_body(&mut host, frame.len(), false), Action::Continue);
    }
    let last = b"data: {\"choices\":[],\"usage\":{\"total_tokens\":4321}}\n\ndata: [DONE]\n\n";
    host.response_chunk = last.to_vec();
    f.on_response_body(&mut host, last.len(), true);
    f.on_log(&mut host);
    assert_eq!(events(&m)[0].tokens, Some(4321));
}

/// Decision 183: a response whose usage could not be read says so on its event — a JSON
/// document over the body bound, an event stream the client left before its end — and one read
/// and holding no usage (an upstream's error) does not. Before, all three were metered alike,
/// with no tokens.
#[test]
fn an_event_says_when_its_token_usage_could_not_be_read() {
    let m = meter();
    let (mut f, mut host) = with_key(metered(METERED, &m));
    f.on_sidecar_response(&mut host, 1, Some(200), allow());
    let big = format!(r#"{{"pad":"{}","usage":{{"total_tokens":9}}}}"#, "x".repeat(1100 << 10));
    respond(&mut f, &mut host, "200", "application/json", big.as_bytes());
    f.on_log(&mut host);
    // an error without `usage`, read whole
    let mut host = MockHost::next_request(&host).with_header("x-api-key", KEY);
    let mut f = metered(METERED, &m);
    f.on_request_headers(&mut host, true);
    respond(&mut f, &mut host, "400", "application/json", br#"{"error":{"message":"bad"}}"#);
    f.on_log(&mut host);
    // a stream the client left before its last frame
    let mut host = MockHost::next_request(&host).with_header("x-api-key", KEY);
    let mut f = metered(METERED, &m);
    f.on_request_headers(&mut host, true);
    host.upstream_response = vec![(":status".into(), "200".into()), ("content-type".into(), "text/event-stream".into())];
    f.on_response_headers(&mut host, false);
    let frame = b"data: {\"choices\":[]}\n\n";
    host.response_chunk = frame.to_vec();
    f.on_response_body(&mut host, frame.len(), false);
    f.on_log(&mut host);
    let e = events(&m);
    let said: Vec<(u16, Option<u64>, bool)> = e.iter().map(|e| (e.status, e.tokens, e.tokens_unread)).collect();
    assert_eq!(said, [(200, None, true), (400, None, false), (200, None, true)]);
}

/// Decision 191: a whole response that names `total_tokens` but cannot be read as a response
/// with a usage object (a number past f64, a repeated `usage`, a count that is a string; in a
/// stream, any frame naming it) is unread, not read as holding none; a document that reads and
/// has the field only in its content is not, nor an error without it.
#[test]
fn a_usage_the_upstream_wrote_unreadably_is_said_unread() {
    let m = meter();
    let bodies: [(&str, &[u8]); 7] = [
        ("application/json", br#"{"usage":{"total_tokens":1e400}}"#),
        ("application/json", br#"{"usage":{"total_tokens":3},"usage":{"total_tokens":4}}"#),
        ("application/json", br#"{"usage":{"total_tokens":"12"}}"#),
        ("text/event-stream", b"data: {\"usage\":{\"total_tokens\":1e999}}\n\n"),
        ("application/json", br#"{"choices":[{"message":{"total_tokens":5}}]}"#),
        ("application/json", br#"{"error":"bad"}"#),
        ("text/event-stream", b"data: {\"x\":\"total_tokens\"}\n\ndata: {\"usage\":{\"total_tokens\":1e999}}\n\n"),
    ];
    let mut host = MockHost::new();
    for (i, (content_type, body)) in bodies.iter().enumerate() {
        let (mut f, mut h) = with_key_on(metered(METERED, &m), MockHost::next_request(&host).with_header("x-api-key", KEY));
        if i == 0 {
            f.on_sidecar_response(&mut h, 1, Some(200), allow());
        }
        respond(&mut f, &mut h, "200", content_type, body);
        f.on_log(&mut h);
        host = h;
    }
    let said: Vec<(Option<u64>, bool)> = events(&m).iter().map(|e| (e.tokens, e.tokens_unread)).collect();
    assert_eq!(said, [(None, true), (None, true), (None, true), (None, true), (None, false), (None, false), (None, true)]);
}

/// Decision 183's edges, with a token budget (which reads any response): unread is said for
/// Envoy's own reply after the request went upstream (what the upstream spent is unknown), and
/// not for a response that ended with trailers, a client gone before any response (`aborted`
/// says it), or a large body of a type that carries no usage; and for a body encoded anyway.
#[test]
fn unread_is_said_for_envoys_reply_after_sending_and_not_for_trailers_or_other_types() {
    const BUDGETED: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold",
      "ticket":{"tenant":"acme","requestId":"r1","budgets":[{"limit":"tokens","subject":"k.k1","period":202611,"reserved":1000}],"expiresAtMs":1,"mac":"0f"}}"#;
    let m = meter();
    let start = |m: &Rc<RefCell<Meter>>, details: &str| {
        let host = MockHost::new().with_header("x-api-key", KEY).with_property("response.code_details", details);
        let (mut f, mut host) = with_key_on(metered(METERED, m), host);
        f.on_sidecar_response(&mut host, 1, Some(200), BUDGETED);
        (f, host)
    };
    // Envoy's 504 after the request went upstream: its JSON has no usage, the upstream's is unknown
    let (mut f, mut host) = start(&m, "upstream_response_timeout");
    respond(&mut f, &mut host, "504", "application/json", br#"{"error":"upstream_timeout"}"#);
    f.on_log(&mut host);
    // a JSON answer whose end came with trailers (HTTP/2)
    let (mut f, mut host) = start(&m, "via_upstream");
    host.upstream_response = vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())];
    f.on_response_headers(&mut host, false);
    host.response_chunk = br#"{"ok":true}"#.to_vec();
    f.on_response_body(&mut host, 11, false);
    f.on_response_trailers(&mut host);
    f.on_log(&mut host);
    // the client left before the response headers
    let (mut f, mut host) = start(&m, "downstream_remote_disconnect");
    f.on_log(&mut host);
    // an image over the body bound
    let (mut f, mut host) = start(&m, "via_upstream");
    respond(&mut f, &mut host, "200", "image/png", &vec![0u8; 1100 << 10]);
    f.on_log(&mut host);
    // JSON the upstream compressed though the filter asked for it plain
    let (mut f, mut host) = start(&m, "via_upstream");
    host.upstream_response = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "application/json".into()),
        ("content-encoding".into(), "gzip".into()),
    ];
    f.on_response_headers(&mut host, false);
    host.response_chunk = vec![0x1f, 0x8b, 8, 0];
    f.on_response_body(&mut host, 4, true);
    f.on_log(&mut host);
    let said: Vec<(u16, bool)> = events(&m).iter().map(|e| (e.status, e.tokens_unread)).collect();
    assert_eq!(said, [(504, true), (200, false), (0, false), (200, false), (200, true)]);
}

#[test]
fn a_full_queue_drops_the_oldest_and_counts_them() {
    let m = Rc::new(RefCell::new(Meter::new(2, 1)));
    for _ in 0..3 {
        let (mut f, mut host) = with_key(metered(METERED, &m));
        f.on_sidecar_response(&mut host, 1, Some(200), allow());
        f.on_log(&mut host);
    }
    assert_eq!(m.borrow().queue.dropped, 1);
    let ids: Vec<String> = events(&m).into_iter().map(|e| e.id).collect();
    assert_eq!(ids, ["00000000000000010000000000000002", "00000000000000010000000000000003"]);
}
