//! Fuzz entries over the filter's readers of untrusted bytes (filters/wire, filters/core).
//!
//! One function per fuzz target. The same file is compiled into the stable replay test
//! `filters/core/tests/fuzz_regressions.rs` (by `#[path]`), which runs every committed
//! `fuzz/regressions/<target>/*` through the same function: uses only `tollgate_wire`,
//! `tollgate_filter_core` and `serde_json`. Each entry states invariants with `assert!`: a
//! failed one is a crash like a panic in the code under test.
//!
//! Inputs are split into fields at NUL bytes ([`fields`]); no header value a client can send
//! through Envoy holds a NUL, and libFuzzer learns the separator quickly.

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::key::{self, KeySource};
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::responses::{self, queue::ResponseQueue};
use tollgate_filter_core::routing::WorkerRoutes;
use tollgate_filter_core::shared_keys::ROUTES_TABLE;
use tollgate_filter_core::usage;
use tollgate_wire::routes::{RequestView, RouteSpec, RouteTable};

/// The NUL-separated fields of an input.
pub fn fields(data: &[u8]) -> Vec<&[u8]> {
    data.split(|b| *b == 0).collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn field<'a>(f: &[&'a [u8]], i: usize) -> &'a [u8] {
    f.get(i).copied().unwrap_or_default()
}

/// `(name, value)` pairs from the fields after `from`; names lowercased as Envoy hands them over.
fn pairs<'a>(f: &[&'a [u8]], from: usize) -> Vec<(String, &'a [u8])> {
    f.get(from..)
        .unwrap_or_default()
        .chunks(2)
        .filter_map(|c| match c {
            [n, v] => Some((text(n).to_ascii_lowercase(), *v)),
            _ => None,
        })
        .collect()
}

/// `key_plan`: key extraction from headers and the query (`key::plan`, bearer parsing,
/// percent-decoding, query parameter removal). Input: `path \0 (name \0 value \0)*`.
pub fn key_plan(data: &[u8]) {
    let f = fields(data);
    let path = text(field(&f, 0));
    let headers = pairs(&f, 1);
    let mut sources = key::default_sources();
    sources.push(KeySource::Query { name: "key".into() });
    sources.push(KeySource::Header { name: "x-key".into() });
    let lookup = |name: &str| headers.iter().filter(|(n, _)| n == name).map(|(_, v)| *v).collect::<Vec<&[u8]>>();
    let plan = key::plan(&sources, lookup, &path);

    assert!(plan.key.is_none() || plan.problem.is_none(), "a key is used despite a problem");
    if let Some(k) = &plan.key {
        let h = k.hash();
        assert!(h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    }
    // every source that carried anything is stripped
    for (name, _) in &headers {
        let carries_key = match name.as_str() {
            "x-api-key" | "x-key" => true,
            "authorization" => lookup(name).iter().any(|v| key::bearer_token(&String::from_utf8_lossy(v)).is_some()),
            _ => false,
        };
        if carries_key {
            assert!(plan.remove_headers.iter().any(|h| h == name), "{name} not stripped");
        }
    }
    let after = plan.new_path.clone().unwrap_or_else(|| path.clone());
    for name in ["api_key", "key"] {
        assert!(key::query_params(&after, name).is_empty(), "query parameter {name} survives in {after:?}");
        assert_eq!(key::query_param(&path, name), key::query_params(&path, name).into_iter().next());
    }
    if let Some(p) = &plan.new_path {
        let base = path.split('?').next().unwrap_or_default();
        assert!(p.starts_with(base), "the path before the query changed");
    }
    // the decoder itself: never longer than its input (escapes shrink, others map 1:1 or to U+FFFD)
    for s in [path.as_str(), text(field(&f, 1)).as_str()] {
        let d = key::percent_decode(s);
        assert!(d.chars().count() <= s.chars().count() * 3);
    }
    if let Some(t) = key::bearer_token(&text(field(&f, 1))) {
        // trimmed of HTTP's optional whitespace (SP, HTAB; a value with other controls never
        // passes Envoy's codec)
        assert!(!t.is_empty() && t.trim_matches([' ', '\t']) == t);
    }
}

/// `plugin_config`: the filter's plugin configuration (`FilterConfig::parse`).
pub fn plugin_config(data: &[u8]) {
    if let Ok(c) = FilterConfig::parse(data) {
        let _ = c.breakers.metric_names();
        assert!(!c.key_sources.is_empty());
    }
}

/// The matching rule of `RouteSpec::matches`, written again from its documentation.
pub fn reference_matches(r: &RouteSpec, authority: &str, method: &str, path: &str, header: &dyn Fn(&str) -> Option<String>) -> bool {
    let path = match path.find(['?', '#']) {
        Some(i) => &path[..i],
        None => path,
    };
    let host = match authority.rfind(':') {
        Some(i) if i + 1 < authority.len() && authority[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &authority[..i],
        _ => authority,
    };
    if let Some(h) = &r.host {
        if !h.eq_ignore_ascii_case(host) {
            return false;
        }
    }
    if r.path.as_deref().is_some_and(|p| p != path) {
        return false;
    }
    if let Some(p) = &r.path_prefix {
        if path.len() < p.len() || path.as_bytes()[..p.len()] != *p.as_bytes() {
            return false;
        }
    }
    if r.method.as_deref().is_some_and(|m| m != method) {
        return false;
    }
    for rule in &r.headers {
        match header(&rule.name) {
            None => return false,
            Some(v) => {
                if rule.value.as_ref().is_some_and(|want| *want != v) {
                    return false;
                }
            }
        }
    }
    true
}

/// `route_match`: the routing table answer (`GET /v1/routes`) and route matching against a
/// reference implementation. Input: `table-json \0 authority \0 method \0 path \0 (name \0 value \0)*`;
/// a table that does not decode is replaced by a small fixed one so matching is fuzzed anyway.
pub fn route_match(data: &[u8]) {
    let f = fields(data);
    let table = match serde_json::from_slice::<RouteTable>(field(&f, 0)) {
        Ok(t) => {
            let again: RouteTable = serde_json::from_slice(&serde_json::to_vec(&t).unwrap_or_default()).unwrap_or_default();
            assert_eq!(again, t, "the routing table does not round-trip");
            t
        }
        Err(_) => serde_json::from_str(
            r#"{"routes":[{"id":"a","host":"api.test","pathPrefix":"/v1/","method":"POST","cluster":"c"},
               {"id":"b","path":"/exact","headers":[{"name":"x-v","value":"1"}],"cluster":"c"},
               {"id":"c","headers":[{"name":"x-p"}],"cluster":"c"},{"id":"d","pathPrefix":"/","cluster":"c"}]}"#,
        )
        .unwrap_or_default(),
    };
    let (authority, method, path) = (text(field(&f, 1)), text(field(&f, 2)), text(field(&f, 3)));
    let headers: Vec<(String, String)> = pairs(&f, 4).into_iter().map(|(n, v)| (n, text(v))).collect();
    let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    let view = RequestView { authority: &authority, method: &method, path: &path, header };
    let owned = |name: &str| header(name).map(str::to_string);
    let expected = table.routes.iter().find(|r| reference_matches(r, &authority, &method, &path, &owned)).map(|r| &r.id);
    assert_eq!(table.find(&view).map(|r| &r.id), expected);
}

/// `wire_answers`: every answer and stored record the filter decodes — the decision
/// (`sidecar::interpret`), the hint list, the routing table, cached allows, stored responses
/// (base64 bodies), lease records, breaker states, serialized header maps from the host and the
/// decision stream's answers (JSON and compact).
/// The whole input is offered to every decoder.
pub fn wire_answers(data: &[u8]) {
    use tollgate_filter_core::{auth_cache::CachedAllow, breaker::State, hostmap, lease::record::LeaseRecord, sidecar};
    use tollgate_wire::breaker::HintList;
    use tollgate_wire::responses::{base64_decode, base64_encode, StoredResponse};

    if let Ok(answer) = sidecar::interpret(Some(200), data) {
        if let tollgate_wire::DecideResponse::Allow { replay: Some(r), .. } = &answer {
            let _ = r.response.body_bytes();
        }
        let again: Result<tollgate_wire::DecideResponse, _> = serde_json::from_slice(&serde_json::to_vec(&answer).unwrap_or_default());
        assert_eq!(again.ok(), Some(answer), "a decision does not round-trip");
    }
    // an answer on the native host's own connection (decision 219): read whole or refused,
    // never more than the bound, and the bytes after a whole answer never taken into it
    let mut scratch = [0u8; 64];
    if let Some(((status, body), _)) = tollgate_filter_core::sidecar_http1::read_response(&mut &data[..], &mut scratch) {
        assert!(status.is_some() && body.len() <= tollgate_filter_core::sidecar_http1::MAX_ANSWER);
        assert!(body.len() <= data.len(), "an answer's body longer than the bytes read");
    }
    // a message of the decision stream (decision 223), as the Wasm root reads it
    if let Ok(a) = serde_json::from_slice::<tollgate_wire::stream::StreamAnswer>(data) {
        let _ = a.into_result();
    }
    // and a compact one (decision 224): what reads writes back as what reads the same
    if let Ok(a) = tollgate_wire::compact::decode_answer(data) {
        let again = tollgate_wire::compact::encode_answer(&a).and_then(|b| tollgate_wire::compact::decode_answer(&b));
        assert_eq!(again.ok(), Some(a.clone()), "a compact answer does not round-trip");
        let _ = a.into_result();
    }
    // a decision batch's answer split for the native host's calls (decision 225): one answer
    // per call, each read as its item's outcome
    if let Ok(batch) = serde_json::from_slice::<tollgate_wire::batch::DecideBatchAnswer>(data) {
        let split = tollgate_filter_core::call_batch::split((Some(200), data.to_vec()), batch.answers.len());
        assert_eq!(split.len(), batch.answers.len(), "a call without its answer");
        for ((status, body), item) in split.iter().zip(batch.answers) {
            assert_eq!(sidecar::interpret(*status, body).ok(), item.into_result().ok(), "a call read another outcome than its item's");
        }
    }
    // ...and the batch call around a request's traceparent, whatever the client sent: its items
    // read back as the calls, none added (decision 225)
    let tp = text(data);
    let call = |key: &str, tp: Option<&str>| {
        let body = serde_json::to_vec(&tollgate_wire::DecideRequest::new(key, "GET", "h", "/")).unwrap_or_default();
        sidecar::Sidecar::default().decide(body, tp)
    };
    let (a, b) = (call("aa", Some(&tp)), call("bb", None));
    if let Some(batch) = tollgate_filter_core::call_batch::join(&[&a, &b]) {
        let read: tollgate_wire::batch::DecideBatch = serde_json::from_slice(&batch.body).expect("a batch call that does not parse");
        let keys: Vec<_> = read.requests.iter().map(|i| i.request.key_hash.as_str()).collect();
        assert_eq!(keys, ["aa", "bb"], "a traceparent wrote into the batch");
        assert_eq!(read.requests[0].traceparent.as_deref(), sidecar::traceparent(Some(&tp)));
    }
    let _ = serde_json::from_slice::<HintList>(data);
    let _ = serde_json::from_slice::<RouteTable>(data);
    let _ = serde_json::from_slice::<CachedAllow>(data);
    if let Ok(s) = serde_json::from_slice::<StoredResponse>(data) {
        let _ = (s.body_bytes(), s.body_len());
    }
    if let Some(rec) = LeaseRecord::decode(data) {
        assert_eq!(rec.encode(), data, "a lease record decodes from other bytes than its encoding");
    }
    if let Some(st) = State::decode(data) {
        // (decoding ignores the fields a phase does not use, so only the state round-trips)
        assert_eq!(State::decode(&st.encode()), Some(st), "a breaker state does not round-trip");
    }
    if let Some(p) = hostmap::parse_pairs(data) {
        let refs: Vec<(&[u8], &[u8])> = p.iter().map(|(n, v)| (n.as_slice(), v.as_slice())).collect();
        assert_eq!(hostmap::parse_pairs(&hostmap::serialize_pairs(&refs)), Some(p.clone()));
    }
    let s = text(data);
    if let Some(b) = base64_decode(&s) {
        assert_eq!(base64_decode(&base64_encode(&b)), Some(b));
    }
    assert_eq!(base64_decode(&base64_encode(data)).as_deref(), Some(data));
}

/// `usage_tokens`: the `usage.total_tokens` scan over JSON and SSE bodies, and the integer
/// attribute decoder.
pub fn usage_tokens(data: &[u8]) {
    let got = usage::usage_tokens(data);
    let field = b"\"total_tokens\"";
    let occurrences = data.windows(field.len()).filter(|w| w == field).count();
    if occurrences == 0 {
        assert_eq!(got, None, "tokens found without the field");
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        // a JSON document: its own usage object's count, and nothing else (decision 134)
        let n = v.get("usage").and_then(|u| u.get("total_tokens"));
        if n.is_none() && v.is_object() {
            assert_eq!(got, None, "a total_tokens outside the document's usage object was read");
        }
        let usages = data.windows(7).filter(|w| w == b"\"usage\"").count();
        // (counts above 2^53 may be clamped: issue 13.6)
        if let Some(n) = n.and_then(serde_json::Value::as_u64).filter(|n| *n < 1 << 53 && occurrences == 1 && usages == 1) {
            assert_eq!(got, Some(n), "the JSON field was not read");
        }
    }
    // decision 191: a count read is never also unparsable, and neither without the field
    for stream in [false, true] {
        let unparsable = usage::usage_unparsable(data, stream);
        assert!(!(unparsable && occurrences == 0), "unparsable without the field");
        assert!(stream || !(unparsable && usage::read_tokens(data, false).is_some()), "a document read and unparsable at once");
    }
    let _ = usage::int_property(Some(data.to_vec()));
    let _ = tollgate_filter_core::filter::stages::token_estimate("max_tokens", data);
}

/// `cache_key`: the response cache's key (canonical JSON body, normalised query, key headers),
/// the idempotency digest and key, and the cache-control rules.
/// Input: `content-type \0 body \0 method \0 path \0 (name \0 value \0)*`.
pub fn cache_key(data: &[u8]) {
    let f = fields(data);
    let ct = text(field(&f, 0));
    let body = field(&f, 1);
    let (method, path) = (text(field(&f, 2)), text(field(&f, 3)));
    let canon = responses::canonical_body(Some(&ct), body);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        if ct.contains("json") {
            let back: serde_json::Value = serde_json::from_slice(&canon).unwrap_or(serde_json::Value::Null);
            assert!(back.is_null() == v.is_null(), "canonical JSON does not parse back");
            assert_eq!(responses::canonical_body(Some("application/json"), &canon), canon, "canonical JSON is not idempotent");
        }
    }
    let query = path.split_once('?').map_or("", |(_, q)| q);
    let once = responses::normalize_query(query);
    assert_eq!(responses::normalize_query(&once), once, "query normalisation is not idempotent");

    let headers: Vec<(String, Option<String>)> =
        pairs(&f, 4).into_iter().map(|(n, v)| (n, (!v.is_empty()).then(|| text(v)))).collect();
    let k = responses::cache_key(&method, &path, &headers, &canon);
    assert!(k.len() == 64 && k.bytes().all(|b| b.is_ascii_hexdigit()));
    let reversed: Vec<_> = headers.iter().rev().cloned().collect();
    assert_eq!(responses::cache_key(&method, &path, &reversed, &canon), k, "the key depends on header order");

    let _ = responses::request_digest(&method, &path, body);
    if let Ok(key) = responses::parse_idempotency_key(&ct) {
        assert!(!key.is_empty());
    }
    let _ = responses::forbids_caching(&ct);
    let plain: Vec<(String, String)> = headers.iter().map(|(n, v)| (n.clone(), v.clone().unwrap_or_default())).collect();
    let _ = responses::storable_headers(&plain);
    let _ = responses::cacheable_response(200, &plain, &[ct.to_ascii_lowercase()]);
}

/// The plugin configurations `filter_request` runs under (picked by the input's first byte).
pub const FILTER_CONFIGS: &[&str] = &[
    "{}",
    r#"{"routing":{"enabled":true},"idempotency":{"enabled":true},"responseCache":{"maxBodyBytes":64},"tokenEstimateField":"max_tokens"}"#,
    r#"{"usage":{"enabled":true},"failureMode":"open","forwardHeaders":["x-user"],"keySources":[{"type":"header","name":"x-k"},{"type":"query","name":"k"},{"type":"bearer"}]}"#,
];

const FILTER_ROUTES: &str = r#"{"version":1,"etag":"e","routes":[
  {"id":"chat","pathPrefix":"/v1/chat","cluster":"llm","cacheTtlMs":60000,"cacheKeyHeaders":["x-user"]},
  {"id":"other","pathPrefix":"/","cluster":"llm"}]}"#;

/// `filter_request`: one whole request through the filter on a mock host — raw request headers
/// (any bytes), the sidecar's answer, the upstream's response headers and body.
/// Input: `config-byte method \0 path \0 decision-status \0 decision-body \0 response-body \0
/// (name \0 value \0)*`, where a name starting with `<` is an upstream response header.
/// Invariant beyond "no panic": the raw key never leaves the filter.
pub fn filter_request(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else { return };
    let Ok(config) = FilterConfig::parse(FILTER_CONFIGS[pick as usize % FILTER_CONFIGS.len()].as_bytes()) else { return };
    const KEY: &str = "tg_fuzz_secret_key_42";
    // The key is the client's to send elsewhere too (a header name, a path, a body): the
    // invariant is that the key given in its key source never leaves, so such inputs prove nothing
    // (in any case: a header name is lowercased on its way, and so becomes the key).
    if rest.windows(KEY.len()).any(|w| w.eq_ignore_ascii_case(KEY.as_bytes())) {
        return;
    }
    let f = fields(rest);
    // the key in a header that is a key source of the picked configuration
    let key_header = if pick as usize % FILTER_CONFIGS.len() == 2 { "x-k" } else { "x-api-key" };
    let mut host = MockHost::new().with_header(key_header, KEY);
    host.request_headers.retain(|(n, _)| n != ":method" && n != ":path");
    host.request_headers.push((":method".into(), field(&f, 0).to_vec()));
    host.request_headers.push((":path".into(), field(&f, 1).to_vec()));
    for (name, value) in pairs(&f, 5) {
        match name.strip_prefix('<') {
            Some(upstream) => host.upstream_response.push((upstream.to_string(), value.to_vec())),
            None => host.request_headers.push((name, value.to_vec())),
        }
    }
    host.shared.insert(ROUTES_TABLE.as_str().into(), FILTER_ROUTES.as_bytes().to_vec());
    host.cas.insert(ROUTES_TABLE.as_str().into(), 1);
    host.now_ms = 10_000;
    host.request_body = field(&f, 4).to_vec();

    let queue = Rc::new(RefCell::new(ResponseQueue::new(16, 1 << 16)));
    let mut filter = AuthFilter::new(Rc::new(config), Rc::new(RefCell::new(CompletionQueue::new(16))))
        .with_routes(Rc::new(RefCell::new(WorkerRoutes::default())))
        .with_responses(queue.clone(), Default::default());
    filter.on_request_headers(&mut host, false);
    let size = host.request_body.len();
    filter.on_request_body(&mut host, size, true);
    let status = std::str::from_utf8(field(&f, 2)).ok().and_then(|s| s.parse::<u16>().ok());
    let token = host.calls.len() as u32;
    if token > 0 {
        filter.on_sidecar_response(&mut host, token, status, field(&f, 3));
    }
    filter.on_response_headers(&mut host, false);
    host.response_chunk = field(&f, 4).to_vec();
    let size = host.response_chunk.len();
    filter.on_response_body(&mut host, size, true);
    filter.on_log(&mut host);
    if let Some((batch, _)) = queue.borrow_mut().begin_flush(1 << 16) {
        assert!(serde_json::from_slice::<serde_json::Value>(&batch).is_ok(), "a store batch is not JSON");
    }
    let sent = host.everything_sent();
    assert!(!sent.contains(KEY), "the raw key left the filter: {sent}");
}
