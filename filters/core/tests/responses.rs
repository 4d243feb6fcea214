#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The response cache and Idempotency-Key replay in the filter, through a mock host (natively and
//! on wasm32 under wasm-bindgen-test): what the decision call carries, hits and replays as local
//! replies that still count, stores queued when the response is complete and qualifies, bypass,
//! 400 for a malformed key, releases of failed idempotent requests.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::kept::KeptBudget;
use tollgate_filter_core::filter::{AuthFilter, MAX_USAGE_BODY};
use tollgate_filter_core::host::{Action, Host};
use tollgate_filter_core::stats::Metric;
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::responses::queue::ResponseQueue;
use tollgate_filter_core::responses::{cache_key, canonical_body, request_digest};
use tollgate_filter_core::routing::WorkerRoutes;
use tollgate_filter_core::shared_keys::{self, ROUTES_TABLE};
use tollgate_wire::responses::{StoreBatch, StoreTicket};
use tollgate_wire::DecideRequest;

const KEY: &str = "tg_cache_key_1";
pub(crate) const CONFIG: &str = r#"{"routing":{"enabled":true},"idempotency":{"enabled":true},"responseCache":{"maxBodyBytes":64}}"#;

fn table() -> String {
    serde_json::json!({"version": 1, "etag": "e", "routes": [
        {"id": "chat", "pathPrefix": "/v1/chat", "cluster": "llm", "cacheTtlMs": 60000, "cacheKeyHeaders": ["x-user"]},
        {"id": "other", "pathPrefix": "/", "cluster": "llm"},
    ]})
    .to_string()
}

pub(crate) struct Rig {
    pub(crate) routes: Rc<RefCell<WorkerRoutes>>,
    pub(crate) queue: Rc<RefCell<ResponseQueue>>,
}

impl Rig {
    pub(crate) fn new() -> Rig {
        Rig { routes: Rc::default(), queue: Rc::new(RefCell::new(ResponseQueue::new(100, 1 << 20))) }
    }
    pub(crate) fn filter(&self) -> AuthFilter {
        let config = Rc::new(FilterConfig::parse(CONFIG.as_bytes()).unwrap());
        AuthFilter::new(config, Rc::new(RefCell::new(CompletionQueue::new(10))))
            .with_routes(self.routes.clone())
            .with_responses(self.queue.clone(), Default::default())
    }
    /// A filter through the headers phase of `h` (its call to the sidecar is out).
    pub(crate) fn request(&self, h: &mut MockHost) -> AuthFilter {
        let mut f = self.filter();
        f.on_request_headers(h, true);
        f
    }
    pub(crate) fn stored(&self) -> StoreBatch {
        let mut q = self.queue.borrow_mut();
        let batch = q.begin_flush(1 << 20).map(|(b, _)| serde_json::from_slice(&b).unwrap()).unwrap_or_default();
        q.end_flush(0);
        batch
    }
}

pub(crate) fn host(method: &str, path: &str) -> MockHost {
    let mut h = MockHost::new().with_header(":method", method).with_header(":path", path).with_header("x-api-key", KEY);
    h.shared.insert(ROUTES_TABLE.as_str().into(), table().into_bytes());
    h.cas.insert(ROUTES_TABLE.as_str().into(), 1);
    h.now_ms = 10_000;
    h
}

fn decision(host: &MockHost) -> DecideRequest {
    serde_json::from_slice(&host.calls.last().unwrap().body).unwrap()
}

pub(crate) const MISS: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p",
  "responseHeaders":[{"name":"ratelimit","value":"\"pm\";r=9;t=60"}],
  "store":{"kind":"cache","tenant":"acme","plan":"p","route":"chat","hash":"h","id":"d1","expiresAtMs":99,"mac":"5eal"}}"#;

pub(crate) fn upstream(host: &mut MockHost, status: &str, headers: &[(&str, &str)]) {
    host.upstream_response = vec![(":status".into(), status.into())];
    host.upstream_response.extend(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
}

#[test]
fn a_cacheable_request_carries_its_key_and_a_complete_success_is_queued() {
    let rig = Rig::new();
    let mut h = host("POST", "/v1/chat?b=2&a=1").with_header("content-type", "application/json").with_header("x-user", "u1");
    h.request_body = br#"{ "b": [1, 2], "a": "x" }"#.to_vec();
    let mut f = rig.filter();
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert!(h.calls.is_empty(), "the key needs the body");
    let n = h.request_body.len();
    assert_eq!(f.on_request_body(&mut h, n, true), Action::Hold);
    let req = decision(&h);
    let canonical = canonical_body(Some("application/json"), br#"{"a":"x","b":[1,2]}"#);
    let key_headers = [("x-user".into(), Some("u1".into())), (":authority".into(), Some("api.test".into())), ("x-forwarded-host".into(), None)];
    assert_eq!(req.cache_key, Some(cache_key("POST", "/v1/chat?a=1&b=2", &key_headers, &canonical)));
    assert_eq!(req.route.as_deref(), Some("chat"));
    assert_eq!(req.idempotency, None);

    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), MISS), Action::Continue);
    assert_eq!(h.count_of(Metric::CacheMiss), 1);
    upstream(&mut h, "200", &[("content-type", "application/json"), ("date", "now"), ("x-tollgate-target", "t")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    assert!(h.response_headers.contains(&("x-tollgate-cache".into(), "miss".into())));
    h.response_chunk = br#"{"answer":"#.to_vec();
    let n = h.response_chunk.len();
    f.on_response_body(&mut h, n, false);
    h.response_chunk = b"42}".to_vec();
    let n = h.response_chunk.len();
    f.on_response_body(&mut h, n, true);
    f.on_log(&mut h);
    let batch = rig.stored();
    assert_eq!(batch.responses.len(), 1);
    let item = &batch.responses[0];
    // the ticket is echoed as the sidecar sealed it (opaque: the filter checks no MAC)
    let seal = tollgate_wire::responses::Seal { id: "d1".into(), expires_at_ms: 99, mac: "5eal".into() };
    assert_eq!(item.ticket, StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "chat".into(), hash: "h".into(), seal });
    let r = item.response.as_ref().unwrap();
    assert_eq!((r.status, r.body.as_str(), r.stored_at_ms), (200, r#"{"answer":42}"#, 10_000));
    assert_eq!(r.headers, vec![tollgate_wire::Header::new("content-type", "application/json")], "no date, no gateway headers");
}

/// Decision 193: the host a request was sent to, and the one a proxy before Envoy names, are in
/// every cache key (an upstream may build its answer's links from them; a route without a host
/// match serves any): requests that differ only there never share an entry, case aside; a
/// repeated `x-forwarded-host` bypasses the cache.
#[test]
fn the_requests_host_is_in_its_cache_key() {
    let rig = Rig::new();
    let key_of = |h: MockHost| {
        let mut h = h;
        rig.request(&mut h);
        decision(&h).cache_key
    };
    let base = key_of(host("GET", "/v1/chat/models"));
    assert!(base.is_some());
    assert_eq!(key_of(host("GET", "/v1/chat/models").with_header(":authority", "API.test")), base, "case aside");
    assert_ne!(key_of(host("GET", "/v1/chat/models").with_header(":authority", "evil.example")), base);
    assert_ne!(key_of(host("GET", "/v1/chat/models").with_header("x-forwarded-host", "evil.example")), base);
    let mut h = host("GET", "/v1/chat/models").with_raw_header("x-forwarded-host", b"a.example").with_raw_header("x-forwarded-host", b"b.example");
    rig.request(&mut h);
    assert_eq!(decision(&h).cache_key, None, "a repeated forwarded host bypasses the cache");
}

#[test]
fn responses_that_must_not_be_cached_are_not_queued() {
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [u8], bool);
    let cases: &[Case] = &[
        ("500", &[], b"{}", true),
        ("200", &[("cache-control", "private, max-age=60")], b"{}", true),
        ("200", &[("cache-control", "public, max-age=0")], b"{}", true), // stale at once (decision 205)
        ("200", &[("set-cookie", "s=1")], b"{}", true),
        ("200", &[], &[b'x'; 65], true), // over responseCache.maxBodyBytes (64)
        ("200", &[], b"{}", false),      // the stream did not complete (client went away)
    ];
    for (status, headers, body, complete) in cases {
        let rig = Rig::new();
        let mut h = host("GET", "/v1/chat");
        let mut f = rig.request(&mut h);
        f.on_sidecar_response(&mut h, 1, Some(200), MISS);
        upstream(&mut h, status, headers);
        f.on_response_headers(&mut h, false);
        h.response_chunk = body.to_vec();
        f.on_response_body(&mut h, body.len(), *complete);
        f.on_log(&mut h);
        assert!(rig.stored().responses.is_empty(), "{status} {headers:?} {} bytes complete={complete}", body.len());
    }
}

/// A chunk of body Envoy would not give (its read failed): nothing is kept of that response, so
/// neither the cache nor an idempotency outcome ever stores it with bytes missing.
#[test]
fn a_body_with_a_chunk_that_could_not_be_read_is_not_stored() {
    let rig = Rig::new();
    let mut h = host("GET", "/v1/chat");
    let mut f = rig.request(&mut h);
    f.on_sidecar_response(&mut h, 1, Some(200), MISS);
    upstream(&mut h, "200", &[("content-type", "application/json")]);
    f.on_response_headers(&mut h, false);
    h.response_chunk = br#"{"a":"#.to_vec();
    f.on_response_body(&mut h, 5, false);
    h.response_chunk = Vec::new(); // Envoy presents 4 bytes it then cannot give
    f.on_response_body(&mut h, 4, false);
    h.response_chunk = b"2}".to_vec();
    f.on_response_body(&mut h, 2, true);
    f.on_log(&mut h);
    assert!(rig.stored().responses.is_empty(), "{:?}", rig.stored());
}

#[test]
fn a_hit_is_a_local_reply_that_still_counts() {
    let rig = Rig::new();
    let mut h = host("GET", "/v1/chat/x");
    let mut f = rig.filter();
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert!(decision(&h).cache_key.is_some());
    let hit = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p",
      "responseHeaders":[{"name":"ratelimit","value":"\"pm\";r=8;t=60"}],
      "ticket":{"tenant":"acme","requestId":"r1","slots":[{"limit":"c","subject":"t"}]},
      "replay":{"kind":"cache","response":{"status":200,"headers":[{"name":"content-type","value":"application/json"}],
        "body":"{\"answer\":42}","storedAtMs":7000}}}"#;
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), hit), Action::Pause, "nothing goes upstream");
    let reply = h.reply.clone().unwrap();
    assert_eq!((reply.status, reply.body.as_slice()), (200, br#"{"answer":42}"#.as_slice()));
    for (n, v) in [("content-type", "application/json"), ("x-tollgate-cache", "hit"), ("age", "3"), ("ratelimit", "\"pm\";r=8;t=60")] {
        assert!(reply.headers.contains(&(n.into(), v.into())), "{n}: {:?}", reply.headers);
    }
    assert_eq!(h.count_of(Metric::CacheHit), 1);
    assert_eq!(h.count_of(Metric::Allowed), 1);
    assert_eq!(h.header("x-tollgate-cluster"), None, "not steered");
    // Envoy may run the filter's response path for its own reply: nothing is added twice
    f.on_response_headers(&mut h, false);
    assert!(h.response_headers.is_empty());
    f.on_log(&mut h);
    assert!(rig.stored().responses.is_empty());
}

/// `h` asks the sidecar with no cache key, and its response says `x-tollgate-cache: bypass`.
fn assert_bypassed(rig: &Rig, mut h: MockHost) {
    let mut f = rig.request(&mut h);
    assert_eq!(decision(&h).cache_key, None);
    f.on_sidecar_response(&mut h, 1, Some(200), br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p"}"#);
    upstream(&mut h, "200", &[]);
    f.on_response_headers(&mut h, true);
    assert!(h.response_headers.contains(&("x-tollgate-cache".into(), "bypass".into())));
}

#[test]
fn bypass_no_lookup_and_no_auth_cache_shortcut() {
    let rig = Rig::new();
    // Cache-Control: no-store → no key, x-tollgate-cache: bypass
    assert_bypassed(&rig, host("GET", "/v1/chat").with_header("cache-control", "no-store"));
    // a method the cache does not serve
    let mut h = host("DELETE", "/v1/chat");
    rig.filter().on_request_headers(&mut h, true);
    assert_eq!(decision(&h).cache_key, None);
    // a cacheable request never takes the auth-cache shortcut (the lookup rides on the call)
    let mut h = host("GET", "/v1/chat");
    let key = shared_keys::auth_cache(&tollgate_filter_core::key::hash_key(KEY), Some("chat")).into_string();
    h.shared.insert(key, br#"{"untilMs":99999999,"tenant":"acme","keyId":"k1","plan":"p"}"#.to_vec());
    assert_eq!(rig.filter().on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.calls.len(), 1);
    // a route without a TTL: no lookup, no header
    let mut h = host("GET", "/elsewhere");
    let mut f = rig.request(&mut h);
    assert_eq!(decision(&h).cache_key, None);
    f.on_sidecar_response(&mut h, 1, Some(200), br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p"}"#);
    f.on_response_headers(&mut h, true);
    assert!(!h.response_headers.iter().any(|(n, _)| n == "x-tollgate-cache"));
}

pub(crate) const CLAIMED: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p",
  "store":{"kind":"idempotency","tenant":"acme","keyId":"k1","digest":"d","key":"order-1","token":"t"}}"#;

#[test]
fn an_idempotency_key_carries_the_seed_digest_and_its_outcome_is_stored_or_released() {
    for (status, stored) in [("201", true), ("503", false)] {
        let rig = Rig::new();
        let mut h = host("POST", "/v1/chat?x=1").with_header("content-type", "application/json").with_header("idempotency-key", "\"order-1\"");
        h.request_body = br#"{"b":1,"a":2}"#.to_vec();
        let mut f = rig.filter();
        f.on_request_headers(&mut h, false);
        let n = h.request_body.len();
        f.on_request_body(&mut h, n, true);
        let req = decision(&h);
        let i = req.idempotency.clone().unwrap();
        assert_eq!(i.key, "order-1");
        assert_eq!(i.digest, request_digest("POST", "/v1/chat?x=1", br#"{"a":2,"b":1}"#));
        assert_eq!(req.cache_key, None, "an idempotency key bypasses the cache");
        f.on_sidecar_response(&mut h, 1, Some(200), CLAIMED);
        upstream(&mut h, status, &[("content-type", "application/json"), ("location", "/orders/1")]);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunk = br#"{"id":1}"#.to_vec();
        let n = h.response_chunk.len();
        // the response's end waits until its outcome is stored: a retry must find it
        assert_eq!(f.on_response_body(&mut h, n, true), Action::Pause, "{status}");
        assert_eq!(h.calls.len(), 2);
        let call = &h.calls[1];
        assert!(call.headers.contains(&(":path".into(), "/v1/responses".into())));
        let batch: StoreBatch = serde_json::from_slice(&call.body).unwrap();
        assert!(!f.take_resume_response(), "not before the answer");
        assert_eq!(f.on_sidecar_response(&mut h, 2, Some(200), br#"{"stored":1}"#), Action::Pause, "the request is not resumed");
        assert!(f.take_resume_response(), "the response is");
        assert!(!f.take_resume_response(), "once");
        f.on_log(&mut h);
        assert!(rig.stored().responses.is_empty(), "{status}: stored already, not queued again");
        assert_eq!(batch.responses.len(), 1, "{status}");
        let item = &batch.responses[0];
        assert!(matches!(item.ticket, StoreTicket::Idempotency { .. }));
        if stored {
            let r = item.response.as_ref().unwrap();
            assert_eq!((r.status, r.body.as_str()), (201, r#"{"id":1}"#));
            assert!(r.headers.contains(&tollgate_wire::Header::new("location", "/orders/1")));
        } else {
            assert!(item.response.is_none(), "a failure releases the claim");
        }
    }
}

#[test]
fn the_last_byte_of_a_sized_response_waits_for_its_outcome() {
    // A client reading a content-length body is done at its last byte: that chunk is held with
    // the end (Envoy's HTTP/1 codec ends the stream in a later, empty frame); earlier chunks
    // stream through. With no body, the headers are held. Like Envoy, the mock presents a held
    // chunk again at the start of the next call's buffer: it is read once.
    for (length, chunks) in [("7", vec!["abc", "defg"]), ("0", vec![])] {
        let rig = Rig::new();
        let mut h = host("POST", "/orders").with_header("idempotency-key", "order-1");
        let mut f = rig.request(&mut h);
        f.on_sidecar_response(&mut h, 1, Some(200), CLAIMED);
        upstream(&mut h, "201", &[("content-length", length)]);
        let headers = f.on_response_headers(&mut h, false);
        assert_eq!(headers, if chunks.is_empty() { Action::Pause } else { Action::Continue }, "{length}");
        let mut held = Vec::new();
        for chunk in &chunks {
            h.response_chunk = chunk.as_bytes().to_vec();
            held.push(f.on_response_body(&mut h, chunk.len(), false));
        }
        if !chunks.is_empty() {
            assert_eq!(held, [Action::Continue, Action::Pause], "only the chunk with the last byte");
        }
        // the end: an empty frame, presented with what Envoy buffered ("defg")
        let buffered = h.response_chunk.len();
        assert_eq!(f.on_response_body(&mut h, buffered, true), Action::Pause, "{length}: the end waits too");
        assert_eq!(h.calls.len(), 2, "{length}: the outcome call");
        let batch: StoreBatch = serde_json::from_slice(&h.calls[1].body).unwrap();
        let stored = batch.responses[0].response.as_ref().unwrap();
        assert_eq!(stored.body, chunks.concat(), "{length}: each byte once");
        assert!(!f.take_resume_response());
        f.on_sidecar_response(&mut h, 2, Some(200), br#"{"stored":1}"#);
        assert!(f.take_resume_response(), "{length}: released once stored");
    }
    // not a claim: a sized response streams through
    let rig = Rig::new();
    let mut h = host("GET", "/plain");
    let mut f = rig.request(&mut h);
    f.on_sidecar_response(&mut h, 1, Some(200), br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p"}"#);
    upstream(&mut h, "200", &[("content-length", "3")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    h.response_chunk = b"abc".to_vec();
    assert_eq!(f.on_response_body(&mut h, 3, false), Action::Continue);
}

#[test]
fn an_outcome_the_sidecar_did_not_take_now_goes_with_the_batch() {
    for failure in ["status", "dispatch", "gone"] {
        let rig = Rig::new();
        let mut h = host("POST", "/orders").with_header("idempotency-key", "order-1");
        let mut f = rig.request(&mut h);
        f.on_sidecar_response(&mut h, 1, Some(200), CLAIMED);
        upstream(&mut h, "201", &[]);
        if failure == "dispatch" {
            h.dispatch_error = Some("no cluster".into());
        }
        let held = f.on_response_headers(&mut h, true);
        match failure {
            "dispatch" => assert_eq!(held, Action::Continue, "nothing to wait for"),
            "status" => {
                assert_eq!(held, Action::Pause);
                f.on_sidecar_response(&mut h, 2, Some(503), b"");
                assert!(f.take_resume_response());
            }
            _ => assert_eq!(held, Action::Pause), // the client goes away while it waits
        }
        f.on_log(&mut h);
        let batch = rig.stored();
        assert_eq!(batch.responses.len(), 1, "{failure}");
        assert_eq!(batch.responses[0].response.as_ref().map(|r| r.status), Some(201), "{failure}");
    }
}

#[test]
fn replays_conflicts_and_malformed_keys() {
    let rig = Rig::new();
    let mut h = host("POST", "/orders").with_header("idempotency-key", "order-1");
    let mut f = rig.request(&mut h);
    let replay = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p",
      "replay":{"kind":"idempotency","response":{"status":201,"body":"AAH/","base64":true,"storedAtMs":1}}}"#;
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), replay), Action::Pause);
    let reply = h.reply.clone().unwrap();
    assert_eq!((reply.status, reply.body), (201, vec![0, 1, 0xff]));
    assert!(reply.headers.contains(&("idempotent-replayed".into(), "true".into())));
    assert_eq!(h.count_of(Metric::IdempotentReplay), 1);

    // 409 / 422 come from the sidecar as denials
    let mut h = host("POST", "/orders").with_header("idempotency-key", "order-1");
    let mut f = rig.request(&mut h);
    let conflict = br#"{"verdict":"deny","status":422,"error":"idempotency_key_reused","message":"m"}"#;
    f.on_sidecar_response(&mut h, 1, Some(200), conflict);
    assert_eq!(h.reply.clone().unwrap().status, 422);

    // a malformed key: 400 without a call; a GET's key is ignored (safe methods are idempotent)
    let mut h = host("POST", "/orders").with_header("idempotency-key", "\"open");
    assert_eq!(rig.filter().on_request_headers(&mut h, true), Action::Pause);
    assert!(h.calls.is_empty());
    let reply = h.reply.clone().unwrap();
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("invalid_idempotency_key"));
    let mut h = host("GET", "/orders").with_header("idempotency-key", "\"open");
    rig.filter().on_request_headers(&mut h, true);
    assert_eq!(decision(&h).idempotency, None);

    // a repeated key, even the same one twice: which would the client mean? 400 without a call
    for second in ["\"order-2\"", "\"order-1\""] {
        let mut h = host("POST", "/orders").with_header("idempotency-key", "\"order-1\"");
        h.request_headers.push(("idempotency-key".into(), second.as_bytes().to_vec()));
        assert_eq!(rig.filter().on_request_headers(&mut h, true), Action::Pause);
        assert!(h.calls.is_empty());
        let reply = h.reply.clone().unwrap();
        assert_eq!(reply.status, 400);
        assert!(String::from_utf8_lossy(&reply.body).contains("more than one Idempotency-Key"), "{reply:?}");
    }
}

#[test]
fn a_cache_key_header_sent_twice_or_not_utf8_bypasses_the_cache() {
    // the upstream sees both values (or the bytes); the key could hold only one (or none), so a
    // response for "bob, mallory" could be stored under bob's key: never looked up, never stored
    let rig = Rig::new();
    let mut twice = host("GET", "/v1/chat").with_header("x-user", "bob");
    twice.request_headers.push(("x-user".into(), b"mallory".to_vec()));
    let mut latin1 = host("GET", "/v1/chat");
    latin1.request_headers.push(("x-user".into(), b"b\xf6b".to_vec()));
    for h in [twice, latin1] {
        assert_bypassed(&rig, h);
    }
    assert!(rig.stored().responses.is_empty(), "nothing queued for the cache");
    // one UTF-8 value: a key, as before
    let mut h = host("GET", "/v1/chat").with_header("x-user", "bob");
    rig.request(&mut h);
    assert!(decision(&h).cache_key.is_some());
}

#[test]
fn a_denial_on_a_caching_route_says_nothing_about_the_cache() {
    let rig = Rig::new();
    let mut h = host("GET", "/v1/chat");
    let mut f = rig.request(&mut h);
    let deny = br#"{"verdict":"deny","status":429,"error":"rate_limited","message":"m","limit":"pm"}"#;
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), deny), Action::Pause);
    assert_eq!(h.reply.clone().unwrap().status, 429);
    // Envoy may run the response path for the local reply
    upstream(&mut h, "429", &[]);
    f.on_response_headers(&mut h, false);
    assert!(!h.response_headers.iter().any(|(n, _)| n == "x-tollgate-cache"), "{:?}", h.response_headers);
    f.on_log(&mut h);
    assert!(rig.stored().responses.is_empty());
}

#[test]
fn a_response_the_filter_reads_is_asked_for_uncompressed() {
    // a cache miss the sidecar will take: its response may be stored, so it must come as the
    // upstream wrote it
    let rig = Rig::new();
    let allow = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p"}"#;
    let mut h = host("GET", "/v1/chat").with_header("accept-encoding", "gzip, br");
    let mut f = rig.request(&mut h);
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), MISS), Action::Continue);
    assert_eq!(h.header("accept-encoding"), None);
    // a request whose response the filter never reads keeps it
    let mut h = host("GET", "/elsewhere").with_header("accept-encoding", "gzip");
    let mut f = rig.request(&mut h);
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), allow), Action::Continue);
    assert_eq!(h.header("accept-encoding"), Some("gzip"));
}

#[test]
fn a_request_carrying_another_credential_bypasses_the_shared_cache() {
    // a Cookie or a non-bearer Authorization goes to the upstream, whose answer may be that
    // caller's alone (RFC 9111 §3.5): not served to, nor stored for, the tenant's other keys
    let rig = Rig::new();
    assert_bypassed(&rig, host("GET", "/v1/chat").with_header("authorization", "Basic YWxpY2U6c2VjcmV0"));
    assert_bypassed(&rig, host("GET", "/v1/chat").with_header("cookie", "session=alice"));
    assert!(rig.stored().responses.is_empty(), "nothing queued for the cache");
    // the API key as a bearer token is stripped: it never reaches the upstream, so it is no reason
    let mut h = host("GET", "/v1/chat");
    h.remove_request_header("x-api-key");
    let mut h = h.with_header("authorization", &format!("Bearer {KEY}"));
    rig.request(&mut h);
    assert!(decision(&h).cache_key.is_some());
}

#[test]
fn a_body_announced_larger_than_the_filter_reads_is_decided_at_once() {
    // Decision 139: a content-length over 1 MiB is not waited for (Envoy would buffer it up to
    // its limit and answer 413 itself): the cache is bypassed, an Idempotency-Key is refused by
    // the filter's own 413, and the body is held with flow control while the decision is out.
    let rig = Rig::new();
    let big = (MAX_USAGE_BODY + 1).to_string();
    let mut h = host("POST", "/v1/chat").with_header("content-type", "application/json").with_header("content-length", &big);
    let mut f = rig.filter();
    assert_eq!(f.on_request_headers(&mut h, false), Action::Pause);
    assert_eq!(h.calls.len(), 1, "decided at the headers");
    assert_eq!(decision(&h).cache_key, None);
    assert_eq!(f.on_request_body(&mut h, 64 << 10, false), Action::Hold);
    f.on_sidecar_response(&mut h, 1, Some(200), br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p"}"#);
    upstream(&mut h, "200", &[]);
    f.on_response_headers(&mut h, true);
    assert!(h.response_headers.contains(&("x-tollgate-cache".into(), "bypass".into())));

    let mut h = host("POST", "/orders").with_header("idempotency-key", "\"order-1\"").with_header("content-length", &big);
    assert_eq!(rig.filter().on_request_headers(&mut h, false), Action::Pause);
    assert!(h.calls.is_empty());
    let reply = h.reply.clone().unwrap();
    assert_eq!(reply.status, 413);
    assert!(String::from_utf8_lossy(&reply.body).contains("idempotency_body_too_large"), "{reply:?}");

    // at the bound, the body is read as before
    let mut h = host("POST", "/orders").with_header("idempotency-key", "\"order-1\"").with_header("content-length", &MAX_USAGE_BODY.to_string());
    assert_eq!(rig.filter().on_request_headers(&mut h, false), Action::Pause);
    assert!(h.calls.is_empty() && h.reply.is_none(), "waits for the body");
}

#[test]
fn a_workers_requests_keep_response_bodies_within_its_budget() {
    // Decisions 142 and 195: 4 MiB for the worker, a quarter of it (1 MiB) for one tenant. A
    // keeps 700 kB of its response; B's 400 kB, of the same tenant, would go past its share, so
    // B's outcome is stored without its body (its operation is not run again), and A's,
    // complete, with it. C, of another tenant, keeps its body while acme holds its share.
    // Every byte is given back at the end.
    let rig = Rig::new();
    let budget = KeptBudget::new(4 << 20);
    let claimed = |h: &mut MockHost, answer: &[u8]| {
        let mut f = rig.filter().with_kept_budget(budget.clone());
        f.on_request_headers(h, true);
        f.on_sidecar_response(h, 1, Some(200), answer);
        upstream(h, "200", &[("content-type", "text/plain")]);
        assert_eq!(f.on_response_headers(h, false), Action::Continue);
        f
    };
    let (mut ha, mut hb) = (host("POST", "/orders").with_header("idempotency-key", "\"a\""), host("POST", "/orders").with_header("idempotency-key", "\"b\""));
    let (mut a, mut b) = (claimed(&mut ha, CLAIMED), claimed(&mut hb, CLAIMED));
    ha.response_chunk = vec![b'a'; 700_000];
    assert_eq!(a.on_response_body(&mut ha, 700_000, false), Action::Continue);
    assert_eq!(budget.left(), (4 << 20) - 700_000);
    hb.response_chunk = vec![b'b'; 400_000];
    assert_eq!(b.on_response_body(&mut hb, 400_000, true), Action::Pause, "the outcome is stored before the end");
    let outcome: StoreBatch = serde_json::from_slice(&hb.calls[1].body).unwrap();
    let r = outcome.responses[0].response.as_ref().unwrap();
    assert!(r.truncated && r.body.is_empty(), "B's outcome without its body: {r:?}");
    assert_eq!(budget.left(), (4 << 20) - 700_000, "B keeps nothing");
    let other = String::from_utf8(CLAIMED.to_vec()).unwrap().replace("acme", "beta");
    let mut hc = host("POST", "/orders").with_header("idempotency-key", "\"c\"");
    let mut c = claimed(&mut hc, other.as_bytes());
    hc.response_chunk = vec![b'c'; 400_000];
    assert_eq!(c.on_response_body(&mut hc, 400_000, true), Action::Pause);
    let outcome: StoreBatch = serde_json::from_slice(&hc.calls[1].body).unwrap();
    let r = outcome.responses[0].response.as_ref().unwrap();
    assert_eq!((r.truncated, r.body.len()), (false, 400_000), "another tenant's outcome whole");
    ha.response_chunk = vec![b'a'; 100];
    assert_eq!(a.on_response_body(&mut ha, 100, true), Action::Pause);
    let outcome: StoreBatch = serde_json::from_slice(&ha.calls[1].body).unwrap();
    let r = outcome.responses[0].response.as_ref().unwrap();
    assert_eq!((r.truncated, r.body.len()), (false, 700_100), "A's outcome whole");
    a.on_sidecar_response(&mut ha, 2, Some(200), br#"{"stored":1}"#);
    b.on_sidecar_response(&mut hb, 2, Some(200), br#"{"stored":1}"#);
    c.on_sidecar_response(&mut hc, 2, Some(200), br#"{"stored":1}"#);
    a.on_log(&mut ha);
    b.on_log(&mut hb);
    c.on_log(&mut hc);
    drop((a, b, c));
    assert_eq!(budget.left(), 4 << 20, "every kept byte given back");
}
