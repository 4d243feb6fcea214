#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Routing in the filter through a mock host (natively and on wasm32 under wasm-bindgen-test):
//! local matching, steering, no-route and not-loaded replies, per-route failure mode and auth
//! cache, and the table poller's lease, conditional refresh and shared-data write.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::host::Action;
use tollgate_filter_core::key::hash_key;
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::routing::{RouteTablePoller, WorkerRoutes};
use tollgate_filter_core::shared_keys::{self, ROUTES_POLLER, ROUTES_TABLE};
use tollgate_wire::routes::RouteTable;
use tollgate_wire::DecideRequest;

const KEY: &str = "tg_route_key_1";
const ROUTED: &str = r#"{"routing":{"enabled":true},"authCacheMaxTtl":"1s"}"#;

fn table_json() -> String {
    serde_json::json!({
        "version": 4,
        "etag": "e1",
        "routes": [
            {"id": "chat", "pathPrefix": "/v1/chat", "cluster": "llm_a", "product": "chat"},
            {"id": "models", "path": "/v1/models", "method": "GET", "cluster": "llm_b", "failureMode": "open"},
        ]
    })
    .to_string()
}

fn host_with_table(path: &str, table: Option<&str>) -> MockHost {
    let mut h = MockHost::new().with_header(":path", path).with_header("x-api-key", KEY);
    h.now_ms = 1_000;
    if let Some(t) = table {
        h.shared.insert(ROUTES_TABLE.as_str().into(), t.as_bytes().to_vec());
        h.cas.insert(ROUTES_TABLE.as_str().into(), 1);
    }
    h
}

fn filter(config: &str, routes: &Rc<RefCell<WorkerRoutes>>) -> AuthFilter {
    let config = Rc::new(FilterConfig::parse(config.as_bytes()).unwrap());
    AuthFilter::new(config, Rc::new(RefCell::new(CompletionQueue::new(10)))).with_routes(routes.clone())
}

const ALLOW: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p","cacheForMs":500}"#;

#[test]
fn a_matched_route_travels_in_the_decision_and_steers_the_request() {
    let routes = Rc::default();
    let mut host = host_with_table("/v1/chat/completions?x=1", Some(&table_json()));
    let mut f = filter(ROUTED, &routes);
    assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.route.as_deref(), Some("chat"));
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), ALLOW), Action::Continue);
    assert_eq!(host.header("x-tollgate-cluster"), Some("llm_a"));
    assert_eq!(f.route().map(|r| r.product.clone()), Some(Some("chat".into())));

    // the cached answer is per route: the same key on another route asks again
    assert!(host.shared.contains_key(shared_keys::auth_cache(&hash_key(KEY), Some("chat")).as_str()));
    let mut again = MockHost::next_request(&host).with_header(":path", "/v1/chat/x").with_header("x-api-key", KEY);
    assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut again, true), Action::Continue);
    assert!(again.calls.is_empty());
    assert_eq!(again.header("x-tollgate-cluster"), Some("llm_a"));
    let mut other = MockHost::next_request(&host).with_header(":path", "/v1/models").with_header("x-api-key", KEY);
    assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut other, true), Action::Pause);
    assert_eq!(other.calls.len(), 1);
}

#[test]
fn headers_the_sidecar_asks_for_never_double_the_filters_own() {
    // the sidecar may name headers of Tollgate's namespace for the request: set over the identity
    // headers, and under the route's cluster, each request header with one value
    let routes = Rc::default();
    let mut host = host_with_table("/v1/chat/completions", Some(&table_json()));
    let mut f = filter(ROUTED, &routes);
    assert_eq!(f.on_request_headers(&mut host, true), Action::Pause);
    let allow = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p","requestHeaders":[{"name":"x-tollgate-cluster","value":"elsewhere"},{"name":"x-tollgate-plan","value":"gold"}]}"#;
    assert_eq!(f.on_sidecar_response(&mut host, 1, Some(200), allow), Action::Continue);
    let values = |name: &str| host.request_headers.iter().filter(|(n, _)| n == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).collect::<Vec<_>>();
    assert_eq!(values("x-tollgate-cluster"), ["llm_a"], "the route steers");
    assert_eq!(values("x-tollgate-plan"), ["gold"]);
    assert_eq!(values("x-tollgate-tenant"), ["acme"]);
}

#[test]
fn a_client_header_in_tollgates_namespace_matches_no_route() {
    // A rule on an internal name (the sidecar refuses one; a table from elsewhere could hold it)
    // must never let the client choose the route: the client's x-tollgate-* headers are removed
    // and never read, so only the catch-all matches, whatever it sends.
    let table = serde_json::json!({"version": 1, "etag": "e", "routes": [
        {"id": "gold", "pathPrefix": "/", "headers": [{"name": "x-tollgate-plan", "value": "gold"}], "cluster": "gold_pool"},
        {"id": "gold-any", "pathPrefix": "/", "headers": [{"name": "x-tollgate-tier"}], "cluster": "gold_pool"},
        {"id": "all", "pathPrefix": "/", "cluster": "shared_pool"},
    ]})
    .to_string();
    let routes = Rc::default();
    let mut host = host_with_table("/v1/x", Some(&table)).with_header("x-tollgate-plan", "gold").with_header("x-tollgate-tier", "1");
    assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut host, true), Action::Pause);
    let req: DecideRequest = serde_json::from_slice(&host.calls[0].body).unwrap();
    assert_eq!(req.route.as_deref(), Some("all"));
    assert_eq!(host.header("x-tollgate-plan"), None, "the client's copy removed");
}

#[test]
fn a_header_a_route_reads_sent_twice_or_not_utf8_is_refused() {
    // `premium` reads x-model; a client sending `x-model: small` and `x-model: gpt-4` matched on
    // the first value only (the route `standard`) while the upstream may read the other: it
    // chose a product and plan the upstream does not serve. Now: 400, no call, no upstream.
    let table = serde_json::json!({"version": 1, "etag": "e", "routes": [
        {"id": "files", "path": "/files", "cluster": "files"},
        {"id": "premium", "pathPrefix": "/", "headers": [{"name": "x-model", "value": "gpt-4"}], "cluster": "llm", "product": "premium"},
        {"id": "standard", "pathPrefix": "/", "cluster": "llm", "product": "standard"},
    ]})
    .to_string();
    let routes = Rc::default();
    let twice = host_with_table("/v1/chat", Some(&table)).with_raw_header("x-model", b"small").with_raw_header("x-model", b"gpt-4");
    let not_utf8 = host_with_table("/v1/chat", Some(&table)).with_raw_header("x-model", b"gpt-4\xff");
    for mut host in [twice, not_utf8] {
        assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut host, true), Action::Pause);
        assert!(host.calls.is_empty(), "no decision asked");
        let reply = host.reply.clone().expect("a local reply");
        assert_eq!(reply.status, 400);
        assert!(String::from_utf8_lossy(&reply.body).contains(r#""error":"invalid_request""#));
    }
    // once, as UTF-8: the route it names
    let mut once = host_with_table("/v1/chat", Some(&table)).with_raw_header("x-model", b"gpt-4");
    assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut once, true), Action::Pause);
    let req: DecideRequest = serde_json::from_slice(&once.calls[0].body).unwrap();
    assert_eq!(req.route.as_deref(), Some("premium"));
    // a request no rule reading x-model could take: x-model is the upstream's business
    let mut files = host_with_table("/files", Some(&table)).with_raw_header("x-model", b"a").with_raw_header("x-model", b"b");
    assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut files, true), Action::Pause);
    let req: DecideRequest = serde_json::from_slice(&files.calls[0].body).unwrap();
    assert_eq!(req.route.as_deref(), Some("files"));
}

#[test]
fn no_matching_route_is_a_404_without_a_callout() {
    let routes = Rc::default();
    let mut host = host_with_table("/elsewhere", Some(&table_json()));
    assert_eq!(filter(ROUTED, &routes).on_request_headers(&mut host, true), Action::Pause);
    assert!(host.calls.is_empty());
    let reply = host.reply.clone().unwrap();
    assert_eq!(reply.status, 404);
    assert!(String::from_utf8_lossy(&reply.body).contains(r#""error":"no_route""#));
    // the method is part of the match
    let mut post = host_with_table("/v1/models", Some(&table_json())).with_header(":method", "POST");
    filter(ROUTED, &routes).on_request_headers(&mut post, true);
    assert_eq!(post.reply.map(|r| r.status), Some(404));
}

#[test]
fn without_a_table_the_failure_mode_decides_and_an_empty_table_leaves_envoy_routing() {
    let mut closed = host_with_table("/v1/chat", None);
    assert_eq!(filter(ROUTED, &Rc::default()).on_request_headers(&mut closed, true), Action::Pause);
    let reply = closed.reply.clone().unwrap();
    assert_eq!(reply.status, 503);
    assert!(reply.headers.contains(&("retry-after".into(), "1".into())));
    assert!(closed.calls.is_empty());

    let open = r#"{"routing":{"enabled":true},"failureMode":"open"}"#;
    let mut h = host_with_table("/v1/chat", None);
    assert_eq!(filter(open, &Rc::default()).on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.header("x-tollgate-degraded"), Some("routes_unavailable"));
    assert_eq!(serde_json::from_slice::<DecideRequest>(&h.calls[0].body).unwrap().route, None);

    let empty = r#"{"version":1,"etag":"x","routes":[]}"#;
    let mut h = host_with_table("/anything", Some(empty));
    let mut f = filter(ROUTED, &Rc::default());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(200), ALLOW), Action::Continue);
    assert_eq!(h.header("x-tollgate-cluster"), None);
}

#[test]
fn a_route_failure_mode_overrides_the_filters_and_still_steers() {
    let mut h = host_with_table("/v1/models", Some(&table_json()));
    let mut f = filter(ROUTED, &Rc::default());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    // the filter fails closed by default; this route fails open
    assert_eq!(f.on_sidecar_response(&mut h, 1, Some(504), b""), Action::Continue);
    assert_eq!(h.header("x-tollgate-degraded"), Some("sidecar_unavailable"));
    assert_eq!(h.header("x-tollgate-cluster"), Some("llm_b"));
}

#[test]
fn a_worker_reparses_only_when_the_shared_table_changed() {
    let mut routes = WorkerRoutes::default();
    let mut h = host_with_table("/", Some(&table_json()));
    routes.refresh(&h);
    assert_eq!(routes.table().unwrap().etag, "e1");
    // same CAS token, different bytes (cannot happen in Envoy): proves no re-read
    h.shared.insert(ROUTES_TABLE.as_str().into(), br#"{"etag":"e2","routes":[]}"#.to_vec());
    routes.refresh(&h);
    assert_eq!(routes.table().unwrap().etag, "e1");
    h.cas.insert(ROUTES_TABLE.as_str().into(), 2);
    routes.refresh(&h);
    assert_eq!(routes.table().unwrap().etag, "e2");
    // garbage is not installed
    h.shared.insert(ROUTES_TABLE.as_str().into(), b"not json".to_vec());
    h.cas.insert(ROUTES_TABLE.as_str().into(), 3);
    routes.refresh(&h);
    assert_eq!(routes.table().unwrap().etag, "e2");
}

#[test]
fn one_poller_per_envoy_asks_conditionally_and_writes_only_good_tables() {
    let config = Rc::new(FilterConfig::parse(br#"{"routing":{"enabled":true,"refreshInterval":"100ms"}}"#).unwrap());
    let mut h = MockHost::new();
    h.now_ms = 10_000;
    let mut a = RouteTablePoller::new(config.routing.clone(), config.sidecar.clone(), 1);
    let mut b = RouteTablePoller::new(config.routing.clone(), config.sidecar.clone(), 2);
    a.on_tick(&mut h);
    b.on_tick(&mut h);
    assert_eq!(h.calls.len(), 1, "only the lease holder polls");
    assert!(h.shared.contains_key(ROUTES_POLLER.as_str()));
    assert!(!h.calls[0].headers.iter().any(|(n, _)| n == "if-none-match"), "nothing to compare with yet");
    a.on_call_response(&mut h, 1, Some(200), table_json().as_bytes());
    let stored: RouteTable = serde_json::from_slice(&h.shared[ROUTES_TABLE.as_str()]).unwrap();
    assert_eq!(stored.routes.len(), 2);

    // next interval: conditional; 304 keeps the table; a bad body is not written
    h.now_ms += 100;
    a.on_tick(&mut h);
    assert_eq!(h.calls.len(), 2);
    assert!(h.calls[1].headers.contains(&("if-none-match".into(), "\"e1\"".into())));
    a.on_call_response(&mut h, 2, Some(304), b"");
    h.now_ms += 100;
    a.on_tick(&mut h);
    a.on_call_response(&mut h, 3, Some(200), b"{broken");
    assert_eq!(serde_json::from_slice::<RouteTable>(&h.shared[ROUTES_TABLE.as_str()]).unwrap().etag, "e1");
    assert!(h.logs.iter().any(|(_, l)| l.contains("not refreshed")));

    // the holder goes quiet: after its lease the other takes over
    h.now_ms += 5_000;
    b.on_tick(&mut h);
    assert_eq!(h.calls.len(), 4);
}
