//! Criterion micro-benchmarks of the filter's pure per-request logic, run natively
//! (`./build.sh bench micro`). In Envoy the same code runs as wasm32 under V8, so these figures
//! are a lower bound and a way to compare changes, not the filter's cost in Envoy (the
//! end-to-end bench, `./build.sh bench`, measures that as Envoy CPU per request).
//!
//! - `key/*`: finding the API key in the request (default sources: bearer, `x-api-key`,
//!   `api_key` query parameter), planning its removal, and hashing it (sha256, lowercase hex).
//! - `breaker/*`: the circuit-breaker decision as a request pays it: decode the 194-byte shared
//!   state and admit (closed: read only), then on the response decode, record and re-encode
//!   (the CAS write's payload).
//! - `route/*`: matching a request against a 50-route table (a late hit and a miss).
//! - `lease/*`: what a leased request pays besides the shared-data calls: decode its key's record,
//!   take a unit, encode it again (the CAS write's payload).
//! - `usage/*`: reading `usage.total_tokens` from a 1 KiB JSON response without it (most
//!   responses: a scan, no parse) and from an LLM-style response with it.
//! - `wire/*`: the decision call's JSON as the filter pays it (docs/benchmarks.md, "Transport"):
//!   encoding a typical `DecideRequest` and decoding a typical allow with rate-limit headers
//!   (`interpret`), and the same round trip with a hand-written length-prefixed binary encoding
//!   of the same fields — a lower bound for any smaller wire format. Prints the body sizes.
//! - `hostmap/*`: decoding the request's header map as the host hands it over (8 headers, as a
//!   load generator's request reaches the filter) and the reads the auth path makes of it.
//! - `request/*`: one whole request through a worker's filter on the mock host, every callback
//!   Envoy makes (headers, the call's answer if any, response headers and body, log): the
//!   auth path from the worker's auth cache, and the exact path (a decision call every request),
//!   each with the 8 request headers of `hostmap/*`.
//!   What the filter's own code costs per request, natively, the mock's work included; `perf
//!   record` on this bench shows where it goes (Envoy's binary is stripped).

// Benchmarks are not filter code: a broken fixture should stop the run loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use tollgate_filter_core::breaker::{self, Admission, Outcome, Phase, Policy, State};
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::Action;
use tollgate_filter_core::key;
use tollgate_filter_core::mock::MockHost;

const RAW_KEY: &str = "tg_8Jq2vXbN4kLmP0sR7tYw1zC3dF5gH6jK9aQeUiOp";

/// The request headers a load generator's request carries through Envoy to the filter.
const TYPICAL_REQUEST: [(&str, &str); 8] = [
    (":authority", "127.0.0.1:10000"),
    (":path", "/v1/chat"),
    (":method", "GET"),
    (":scheme", "http"),
    ("user-agent", "oha/1.4.6"),
    ("accept", "*/*"),
    ("x-api-key", RAW_KEY),
    ("x-forwarded-proto", "http"),
];

fn key_benches(c: &mut Criterion) {
    // The default key sources, exactly as a `{}` plugin configuration yields them.
    let config = FilterConfig::parse(b"{}").expect("default plugin configuration");
    let sources = config.key_sources.clone();
    let mut g = c.benchmark_group("key");

    g.bench_function("sha256_hex", |b| b.iter(|| key::hash_key(black_box(RAW_KEY))));

    // The key in a header: in `x-api-key`, the common case (the bearer source is looked at first,
    // absent); in `Authorization: Bearer <key>`, the first source.
    let bearer = format!("Bearer {RAW_KEY}");
    for (bench, headers) in [
        ("extract_header_and_hash", vec![("host", "api.example.com"), ("x-api-key", RAW_KEY), ("accept", "application/json")]),
        ("extract_bearer_and_hash", vec![("host", "api.example.com"), ("authorization", bearer.as_str())]),
    ] {
        let header = |name: &str| headers.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.as_bytes()).collect::<Vec<_>>();
        g.bench_function(bench, |b| {
            b.iter(|| {
                let plan = key::plan(black_box(&sources), header, black_box("/v1/chat/completions"));
                plan.key.map(|k| k.hash())
            })
        });
    }

    // The key in the query string: percent-decoding and the rewritten `:path`.
    let path = format!("/v1/items?page=2&api_key={RAW_KEY}&sort=name%20asc");
    let no_headers = |_: &str| -> Vec<&[u8]> { Vec::new() };
    g.bench_function("extract_query_and_hash", |b| {
        b.iter(|| {
            let plan = key::plan(black_box(&sources), no_headers, black_box(&path));
            (plan.key.map(|k| k.hash()), plan.new_path)
        })
    });
    g.finish();
}

fn breaker_benches(c: &mut Criterion) {
    let policy = Policy::default();
    let now_ms = 1_764_460_800_000u64;
    // A closed breaker with some history in its window (as under steady traffic).
    let mut state = State::default();
    for i in 0..200u64 {
        let outcome = if i % 50 == 0 { Outcome::Failure } else { Outcome::Success };
        state.record(&policy, now_ms + i * 40, None, outcome);
    }
    assert_eq!(state.phase, Phase::Closed, "fixture must stay closed");
    let closed = state.encode();
    let open = State::with_phase(Phase::Open { until_ms: now_ms + 30_000 }).encode();
    let mut g = c.benchmark_group("breaker");

    // Request side on a closed breaker: decode the shared state, admit; nothing to write.
    g.bench_function("admit_closed", |b| {
        b.iter(|| {
            let mut s = State::decode(black_box(&closed)).unwrap_or_default();
            let (admission, changed, _) = s.admit(&policy, black_box(now_ms + 9_000));
            assert!(admission == Admission::Pass && !changed);
            admission
        })
    });

    // Request side on an open breaker: decode, reject with Retry-After.
    g.bench_function("admit_open_reject", |b| {
        b.iter(|| {
            let mut s = State::decode(black_box(&open)).unwrap_or_default();
            s.admit(&policy, black_box(now_ms + 9_000)).0
        })
    });

    // Response side: decode, record a success into the rolling window, encode for the CAS write.
    g.bench_function("record_success_encode", |b| {
        b.iter(|| {
            let mut s = State::decode(black_box(&closed)).unwrap_or_default();
            let (changed, _) = s.record(&policy, black_box(now_ms + 9_000), None, Outcome::Success);
            (changed, s.encode())
        })
    });

    g.bench_function("hint_fingerprint", |b| b.iter(|| breaker::hint_fingerprint(black_box("replica-7f3a"), black_box(now_ms))));
    g.finish();
}

/// The route match as a request pays it: the first route of a 50-route table whose host, path or
/// prefix, method and headers match (a hit near the end, and a miss that scans them all).
fn route_benches(c: &mut Criterion) {
    use tollgate_wire::routes::{HeaderRule, RequestView, RouteSpec, RouteTable};
    let routes: Vec<RouteSpec> = (0..50)
        .map(|i| RouteSpec {
            id: format!("r{i}"),
            host: (i % 3 == 0).then(|| "api.example.com".to_string()),
            path: None,
            path_prefix: Some(format!("/v1/svc{i}/")),
            method: (i % 2 == 0).then(|| "POST".to_string()),
            headers: if i % 5 == 0 { vec![HeaderRule { name: "x-tier".into(), value: Some("gold".into()) }] } else { vec![] },
            cluster: format!("c{i}"),
            product: None,
            failure_mode: None,
            cache_ttl_ms: None,
            cache_key_headers: vec![],
            breaker: None,
            llm: false,
        })
        .collect();
    let table = RouteTable { version: 1, etag: "e".into(), routes };
    let headers = [("x-tier", "gold"), ("accept", "application/json")];
    let header = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    let mut g = c.benchmark_group("route");
    g.bench_function("match_50_hit_at_48", |b| {
        b.iter(|| {
            let req = RequestView { authority: "api.example.com:443", method: "POST", path: black_box("/v1/svc48/items?x=1"), header };
            table.find(&req).map(|r| r.cluster.len())
        })
    });
    g.bench_function("match_50_miss", |b| {
        b.iter(|| {
            let req = RequestView { authority: "api.example.com", method: "GET", path: black_box("/nowhere"), header };
            table.find(&req).is_none()
        })
    });
    g.finish();
}

fn lease_benches(c: &mut Criterion) {
    use tollgate_filter_core::lease::{Batch, LeaseIdentity, LeaseRecord};
    let rec = LeaseRecord {
        identity: LeaseIdentity { tenant: "acme".into(), key_id: "key_01HZX3".into(), plan: "pro".into(), ..LeaseIdentity::default() },
        batches: vec![Batch { units: 500, until_ms: 1_700_000_000_500 }, Batch { units: 800, until_ms: 1_700_000_001_000 }],
        obs_spent: 120,
        obs_since_ms: 1_700_000_000_000,
        rate_per_s: 2_400.0,
        last_granted: 800,
        ..LeaseRecord::default()
    };
    let bytes = rec.encode();
    let mut g = c.benchmark_group("lease");
    g.bench_function("decode_take_encode", |b| {
        b.iter(|| {
            let mut r = LeaseRecord::decode(black_box(&bytes)).expect("record");
            r.obs_spent += 1;
            r.batches[0].units -= 1;
            r.encode()
        })
    });
    g.finish();
}

fn usage_benches(c: &mut Criterion) {
    use tollgate_filter_core::usage::usage_tokens;
    let headers: Vec<(String, String)> = (0..20).map(|i| (format!("x-header-{i}"), "v".repeat(30))).collect();
    let plain = serde_json::to_vec(&serde_json::json!({"method": "GET", "path": "/bench", "headers": headers})).expect("json");
    let llm = serde_json::to_vec(&serde_json::json!({
        "id": "chatcmpl-1", "choices": [{"message": {"role": "assistant", "content": "x".repeat(800)}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 200, "total_tokens": 212}
    }))
    .expect("json");
    let mut g = c.benchmark_group("usage");
    g.bench_function("total_tokens_absent_1k", |b| b.iter(|| usage_tokens(black_box(&plain))));
    g.bench_function("total_tokens_llm_1k", |b| b.iter(|| usage_tokens(black_box(&llm))));
    g.finish();
}

/// One request through `w`'s filter, as Envoy drives it: `answer` if it calls the sidecar.
fn one_request(w: &tollgate_filter_core::worker::Worker, root: &mut MockHost, answer: &[u8]) -> bool {
    let mut mock = MockHost::next_request(root);
    for (name, value) in TYPICAL_REQUEST {
        mock = mock.with_header(name, value);
    }
    mock.client_ip = Some("192.0.2.7".into());
    mock.properties.insert("request.id".into(), b"0f1e2d".to_vec());
    mock.upstream_response = vec![(":status".into(), b"200".to_vec()), ("content-type".into(), b"text/plain".to_vec())];
    let mut f = w.request();
    let called = f.on_request_headers(&mut mock, true) == Action::Pause;
    assert!(mock.reply.is_none(), "answered locally: {:?}", mock.reply.as_ref().map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned())));
    if called {
        assert_eq!(f.on_call_response(&mut mock, 1, Some(200), answer), Action::Continue, "{:?}", mock.logs);
    }
    assert_eq!(f.on_response_headers(&mut mock, false), Action::Continue);
    mock.response_chunk = b"ok".to_vec();
    assert_eq!(f.on_response_body(&mut mock, 2, true), Action::Continue);
    f.on_log(&mut mock);
    root.shared = mock.shared;
    root.cas = mock.cas;
    called
}

fn request_benches(c: &mut Criterion) {
    use std::rc::Rc;
    use tollgate_filter_core::worker::{Seeds, Worker};
    const SEEDS: Seeds = Seeds { decision_ids: [3; 32], usage_ids: 0xfeed, hints_owner: 11, routes_owner: 12, changes_owner: 13 };
    let config = serde_json::json!({"sidecar": {"timeout": "25ms"}, "failureMode": "closed", "changes": {"enabled": false}});
    let worker = || {
        let mut root = MockHost::new();
        root.now_ms = 1_000_000;
        let w = Worker::new(&mut root, Rc::new(FilterConfig::parse(config.to_string().as_bytes()).unwrap()), SEEDS);
        (w, root)
    };
    let mut g = c.benchmark_group("request");
    let (w, mut root) = worker();
    // the sidecar lets this allow be reused, and the clock stands still: every request after the
    // first is answered from the worker's auth cache
    let cached = br#"{"verdict":"allow","tenant":"bench","keyId":"key_1","plan":"free","cacheForMs":3600000}"#;
    assert!(one_request(&w, &mut root, cached), "the first one asks");
    g.bench_function("auth_cached", |b| b.iter(|| assert!(!one_request(&w, &mut root, b""))));
    let (w, mut root) = worker();
    let exact = br#"{"verdict":"allow","tenant":"bench","keyId":"key_1","plan":"exact","noLease":true,
        "responseHeaders":[{"name":"ratelimit","value":"\"l\";r=5;t=1"}]}"#;
    g.bench_function("exact_call", |b| b.iter(|| assert!(one_request(&w, &mut root, exact))));
    g.finish();
}

fn hostmap_benches(c: &mut Criterion) {
    use tollgate_filter_core::headers::RequestHeaders;
    use tollgate_filter_core::hostmap::{serialize_pairs, HeaderMap};
    let refs: Vec<(&[u8], &[u8])> = TYPICAL_REQUEST.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())).collect();
    let serialized = serialize_pairs(&refs);
    let mut g = c.benchmark_group("hostmap");
    // what the filter does with the host's copy of the request's headers on the auth path: decode
    // it, set aside Tollgate's namespace, read the key's sources, the path and accept-encoding
    g.bench_function("request_headers_8", |b| {
        b.iter(|| {
            let h = RequestHeaders::new(HeaderMap::parse(black_box(serialized.clone())).unwrap());
            let found = (h.all_raw("authorization").len(), h.all_raw("x-api-key").len(), h.get(":path"), h.all_raw("accept-encoding").len());
            black_box(found);
        })
    });
    g.finish();
}

criterion_group!(benches, key_benches, breaker_benches, route_benches, lease_benches, usage_benches, wire_benches, request_benches, hostmap_benches);
/// A decision request as the filter sends it for a key with an exact limit (no route, no cache).
fn typical_request() -> tollgate_wire::DecideRequest {
    tollgate_wire::DecideRequest {
        key_hash: key::hash_key(RAW_KEY),
        method: "POST".into(),
        authority: "api.example.com".into(),
        path: "/v1/chat/completions".into(),
        request_id: Some("9f1c7e52-3a4b-4c8d-9e0f-1a2b3c4d5e6f".into()),
        decision_id: None,
        client_ip: Some("10.1.2.3:53412".into()),
        headers: Vec::new(),
        token_estimate: None,
        route: None,
        cache_key: None,
        idempotency: None,
        lease: None,
        llm: None,
    }
}

/// The sidecar's answer to it: allowed, with the RateLimit headers of one limit.
fn typical_allow() -> tollgate_wire::DecideResponse {
    let mut allow = tollgate_wire::DecideResponse::allow("acme", "key_afsdh93hxdksn2qa", "limited");
    if let tollgate_wire::DecideResponse::Allow { response_headers, .. } = &mut allow {
        *response_headers = vec![
            tollgate_wire::Header::new("ratelimit-policy", "\"per-minute\";q=1000000000;w=60"),
            tollgate_wire::Header::new("ratelimit", "\"per-minute\";r=999978851;t=12"),
        ];
    }
    allow
}

/// The binary comparison: every string as a u16 length and its bytes, in field order.
fn put(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn take<'a>(buf: &mut &'a [u8]) -> Option<&'a str> {
    let (len, rest) = buf.split_first_chunk::<2>()?;
    let len = u16::from_le_bytes(*len) as usize;
    let (s, rest) = (rest.get(..len)?, rest.get(len..)?);
    *buf = rest;
    std::str::from_utf8(s).ok()
}

fn binary_request(r: &tollgate_wire::DecideRequest) -> Vec<u8> {
    let mut out = Vec::with_capacity(192);
    for s in [&r.key_hash, &r.method, &r.authority, &r.path] {
        put(&mut out, s);
    }
    put(&mut out, r.request_id.as_deref().unwrap_or(""));
    put(&mut out, r.client_ip.as_deref().unwrap_or(""));
    out
}

fn binary_allow(tenant: &str, key_id: &str, plan: &str, headers: &[tollgate_wire::Header]) -> Vec<u8> {
    let mut out = vec![1u8];
    for s in [tenant, key_id, plan] {
        put(&mut out, s);
    }
    out.push(headers.len() as u8);
    for h in headers {
        put(&mut out, &h.name);
        put(&mut out, &h.value);
    }
    out
}

/// Decodes [`binary_allow`] into owned strings, as the filter would need them.
fn decode_binary_allow(mut buf: &[u8]) -> Option<(String, String, String, Vec<tollgate_wire::Header>)> {
    let (&verdict, rest) = buf.split_first()?;
    buf = rest;
    if verdict != 1 {
        return None;
    }
    let (tenant, key_id, plan) = (take(&mut buf)?.to_string(), take(&mut buf)?.to_string(), take(&mut buf)?.to_string());
    let (&n, rest) = buf.split_first()?;
    buf = rest;
    let mut headers = Vec::with_capacity(n as usize);
    for _ in 0..n {
        headers.push(tollgate_wire::Header::new(take(&mut buf)?, take(&mut buf)?));
    }
    Some((tenant, key_id, plan, headers))
}

fn wire_benches(c: &mut Criterion) {
    let request = typical_request();
    let answer = serde_json::to_vec(&typical_allow()).expect("encode the allow");
    let tollgate_wire::DecideResponse::Allow { tenant, key_id, plan, response_headers, .. } = typical_allow() else {
        unreachable!()
    };
    let answer_bin = binary_allow(&tenant, &key_id, &plan, &response_headers);
    let request_json = serde_json::to_vec(&request).expect("encode the request");
    let request_bin = binary_request(&request);
    eprintln!(
        "wire sizes: DecideRequest JSON {} B, binary {} B; allow JSON {} B, binary {} B",
        request_json.len(),
        request_bin.len(),
        answer.len(),
        answer_bin.len()
    );
    assert!(decode_binary_allow(&answer_bin).is_some_and(|(t, _, _, h)| t == "acme" && h.len() == 2));

    let mut g = c.benchmark_group("wire");
    g.bench_function("json_encode_request", |b| b.iter(|| serde_json::to_vec(black_box(&request))));
    g.bench_function("json_decode_allow", |b| {
        b.iter(|| tollgate_filter_core::sidecar::interpret(Some(200), black_box(&answer)).is_ok())
    });
    g.bench_function("json_round_trip", |b| {
        b.iter(|| {
            let body = serde_json::to_vec(black_box(&request));
            (body.map(|v| v.len()), tollgate_filter_core::sidecar::interpret(Some(200), black_box(&answer)).is_ok())
        })
    });
    g.bench_function("binary_round_trip", |b| {
        b.iter(|| (binary_request(black_box(&request)).len(), decode_binary_allow(black_box(&answer_bin)).is_some()))
    });
    g.finish();
}

criterion_main!(benches);
