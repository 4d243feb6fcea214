//! Issue 43 item 1, per-key scopes and last use, through a real Envoy (both hosts) and sidecar:
//! a request outside a key's routes, products, methods or client networks is refused `403
//! key_scope` before any upstream call — also right after an allow of the same key was cached,
//! and when the scope is narrowed while one is (decisions 333–335); the client address is the one
//! Envoy trusts, never a header the client chose; a key's last use reaches the API, Redis and
//! PostgreSQL in batches (decision 336).

use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tollgate_tests::{admin_call, get, poll_until, raw, send, Gateway};

const TOKEN: &str = "test-admin-token-0123456789";

fn call(g: &Gateway, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let r = match method {
        "PATCH" => {
            let auth = format!("Bearer {TOKEN}");
            let headers = [("authorization", auth.as_str()), ("content-type", "application/json")];
            send("PATCH", &format!("{}{path}", g.replica(0).admin()), &headers, Some(&body.unwrap_or_default().to_string()))
        }
        _ => admin_call(method, g.replica(0).admin(), TOKEN, path, body),
    };
    (r.status, serde_json::from_str(&r.body).unwrap_or(Value::Null))
}

/// A key of acme on plan `p` with `scopes` (and a label): (id, raw).
fn key(g: &Gateway, scopes: Value) -> (String, String) {
    let (status, v) = call(g, "POST", "/v1/keys", Some(json!({"tenant": "acme", "plan": "p", "label": "ci deploy", "scopes": scopes})));
    assert_eq!(status, 201, "{v}");
    (v["key_id"].as_str().unwrap().to_string(), v["key"].as_str().unwrap().to_string())
}

/// `method` on `path` through the Envoy with `raw` (and `extra` headers): the status and the
/// error code, if any.
fn through(g: &Gateway, method: &str, path: &str, raw: &str, extra: &[(&str, &str)]) -> (u16, Option<String>) {
    let mut headers = vec![("x-api-key", raw)];
    headers.extend_from_slice(extra);
    let r = send(method, &g.envoy().url(path), &headers, (method == "POST").then_some("{}"));
    let code = serde_json::from_str::<Value>(&r.body).ok().and_then(|v| v["error"].as_str().map(str::to_string));
    (r.status, if r.status == 200 { None } else { code })
}

fn scope_refused() -> (u16, Option<String>) {
    (403, Some("key_scope".to_string()))
}

/// A gateway on PostgreSQL with routing: products chat and embed, both subscribed by acme, a
/// route to each, plan `p` without limits (answers cached by the filter); last uses written
/// every 200 ms. The Envoy starts once the routes are in place, and is used once a path no route
/// matches is refused (its routing table holds the routes).
fn gateway() -> Gateway {
    let mut g = Gateway::builder()
        .config_in_postgres()
        .admin_api(TOKEN)
        .sidecar_env("TOLLGATE_SIDECAR_CACHE__LAST_USED_INTERVAL", "200ms")
        .plugin(json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed", "routing": {"enabled": true, "refreshInterval": "100ms"}}))
        .without_envoy()
        .build();
    for (path, body) in [
        ("/v1/products", json!({"id": "chat"})),
        ("/v1/products", json!({"id": "embed"})),
        ("/v1/tenants", json!({"id": "acme", "products": ["chat", "embed"]})),
        ("/v1/plans", json!({"id": "p", "limits": []})),
        ("/v1/routes", json!({"id": "chat", "match": {"path_prefix": "/v1/chat"}, "cluster": "upstream", "product": "chat"})),
        ("/v1/routes", json!({"id": "embed", "match": {"path_prefix": "/v1/embed"}, "cluster": "upstream", "product": "embed"})),
    ] {
        let (status, v) = call(&g, "POST", path, Some(body));
        assert_eq!(status, 201, "{path}: {v}");
    }
    g.start_envoys();
    let (_, probe) = key(&g, json!({}));
    poll_until("the routing table reaches the filter", Duration::from_secs(10), || through(&g, "GET", "/nowhere", &probe, &[]).0 == 404);
    g
}

#[test]
fn requests_outside_a_keys_scopes_are_refused_before_the_upstream_even_after_cached_allows() {
    let g = gateway();
    let upstream = || g.upstream().calls();

    // routes and products: a cached allow is per route, so the first request of each route asks
    let (_, chat_only) = key(&g, json!({"routes": ["chat"]}));
    let (_, embed_product) = key(&g, json!({"products": ["embed"]}));
    for _ in 0..5 {
        assert_eq!(through(&g, "GET", "/v1/chat/x", &chat_only, &[]), (200, None));
        let before = upstream();
        assert_eq!(through(&g, "GET", "/v1/embed/x", &chat_only, &[]), scope_refused());
        assert_eq!(through(&g, "GET", "/v1/chat/x", &embed_product, &[]), scope_refused());
        assert_eq!(upstream(), before, "the upstream saw a refused request");
        assert_eq!(through(&g, "GET", "/v1/embed/x", &embed_product, &[]), (200, None));
    }

    // methods: answers of a method-scoped key are never reused, so a POST after many GETs is
    // still judged
    let (_, get_only) = key(&g, json!({"methods": ["GET"]}));
    for _ in 0..10 {
        assert_eq!(through(&g, "GET", "/v1/chat/x", &get_only, &[]), (200, None));
        let before = upstream();
        assert_eq!(through(&g, "POST", "/v1/chat/x", &get_only, &[]), scope_refused());
        assert_eq!(through(&g, "DELETE", "/v1/chat/x", &get_only, &[]), scope_refused());
        assert_eq!(upstream(), before);
    }
    // a method in another case is another method (Envoy refuses it or the scope does)
    let before = upstream();
    let request = format!("get /v1/chat/x HTTP/1.1\r\nhost: localhost\r\nx-api-key: {get_only}\r\nconnection: close\r\n\r\n");
    let r = raw::send(g.envoy().port, request.as_bytes());
    assert_ne!(r.status, 200, "a lower-case method passed a GET scope");
    assert_eq!(upstream(), before);

    // networks: the address Envoy trusts (the peer here: xff_num_trusted_hops 0), never a
    // forwarded header the client wrote — however long, repeated or not UTF-8
    let (_, loopback) = key(&g, json!({"networks": ["127.0.0.0/8", "::1"]}));
    let (_, elsewhere) = key(&g, json!({"networks": ["203.0.113.0/24"]}));
    let long = format!("203.0.113.7, {}", "203.0.113.8, ".repeat(500));
    let before = upstream();
    for xff in ["203.0.113.7", long.as_str()] {
        assert_eq!(through(&g, "GET", "/v1/chat/x", &elsewhere, &[("x-forwarded-for", xff), ("x-real-ip", "203.0.113.7")]), scope_refused());
        assert_eq!(through(&g, "GET", "/v1/chat/x", &loopback, &[("x-forwarded-for", xff)]), (200, None));
    }
    for xff in [&b"\xff\xfe203.0.113.7"[..], b"203.0.113.7"] {
        let r = raw::get(g.envoy().port, b"/v1/chat/x", &[("x-api-key", elsewhere.as_bytes()), ("x-forwarded-for", xff), ("x-forwarded-for", b"203.0.113.9")]);
        assert!(r.status == 403 || r.status == 400, "a forwarded header chose the client address: {}", r.status);
    }
    assert_eq!(upstream(), before + 2, "only the loopback key's requests went upstream");

    // a scope narrowed while the key's allow is cached: refused within a change poll
    let (id, narrowed) = key(&g, json!({}));
    let hits = g.envoy().counter("wasmcustom.tollgate.auth_cache.hits");
    poll_until("the key's allow is reused from the filter's cache", Duration::from_secs(10), || {
        assert_eq!(through(&g, "GET", "/v1/chat/x", &narrowed, &[]), (200, None));
        g.envoy().counter("wasmcustom.tollgate.auth_cache.hits") > hits + 3
    });
    let (status, v) = call(&g, "PATCH", &format!("/v1/keys/{id}"), Some(json!({"scopes": {"routes": ["embed"]}})));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["scopes"]["routes"], json!(["embed"]));
    assert_eq!(v["label"], "ci deploy", "a PATCH leaves what it does not name");
    poll_until("the narrowed scope holds", Duration::from_secs(2), || through(&g, "GET", "/v1/chat/x", &narrowed, &[]) == scope_refused());
    assert_eq!(through(&g, "GET", "/v1/embed/x", &narrowed, &[]), (200, None));

    // bad scopes are refused naming the field; nothing is issued
    for (scopes, field) in [
        (json!({"routes": ["nope"]}), "scopes.routes"),
        (json!({"products": ["nope"]}), "scopes.products"),
        (json!({"methods": ["get"]}), "scopes.methods"),
        (json!({"networks": ["10.0.0.0/33"]}), "scopes.networks"),
        (json!({"hosts": ["x"]}), "scopes"),
    ] {
        let (status, v) = call(&g, "POST", "/v1/keys", Some(json!({"tenant": "acme", "plan": "p", "scopes": scopes})));
        assert_eq!((status, v["field"].as_str()), (400, Some(field)), "{v}");
    }
}

/// A key's last use, to the minute, reaches `GET /v1/keys`, its Redis record and PostgreSQL from
/// the decisions' batches; a key never used has none; the listing shows scopes and label.
#[test]
fn a_keys_last_use_is_written_in_batches_and_listed() {
    let g = gateway();
    let (used_id, used) = key(&g, json!({"methods": ["GET"]}));
    let (idle_id, _) = key(&g, json!({}));
    assert_eq!(through(&g, "GET", "/v1/chat/x", &used, &[]), (200, None));
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let listed = |id: &str| -> Value {
        let (status, v) = call(&g, "GET", "/v1/keys?tenant=acme&limit=100", None);
        assert_eq!(status, 200, "{v}");
        v.as_array().unwrap().iter().find(|k| k["key_id"] == id).cloned().unwrap()
    };
    poll_until("the key's last use is listed", Duration::from_secs(30), || listed(&used_id)["last_used_at"].is_u64());
    let at = listed(&used_id)["last_used_at"].as_u64().unwrap();
    assert!(at % 60 == 0 && at <= now && now - at < 180, "last use {at}, now {now}");
    let k = listed(&used_id);
    assert_eq!((k["label"].as_str(), &k["scopes"]["methods"]), (Some("ci deploy"), &json!(["GET"])));
    assert_eq!(listed(&idle_id)["last_used_at"], Value::Null);
    assert_eq!(call(&g, "GET", &format!("/v1/keys/{used_id}"), None).1["last_used_at"], at);
    let sql = format!("SELECT last_used_at FROM api_keys WHERE key_id = '{used_id}'");
    assert_eq!(tollgate_tests::billing::psql_i64(g.pg(), &sql), at as i64);
    let mut c = g.redis().connection().unwrap();
    let hash: String = redis::cmd("GET").arg(format!("apikey-id:{used_id}")).query(&mut c).unwrap();
    let in_redis: Option<u64> = redis::cmd("HGET").arg(format!("apikey:{hash}")).arg("last_used_at").query(&mut c).unwrap();
    assert_eq!(in_redis, Some(at));
}

/// The file source (keys in Redis alone) through the CLI: `tollgate keys create --method GET
/// --label …` then `tollgate keys update --no-scopes`.
#[test]
fn the_cli_sets_and_clears_a_keys_scopes() {
    let g = Gateway::builder().admin_api(TOKEN).build();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(tollgate_tests::process::native_bin("TOLLGATE_CLI", "tollgate"))
            .env("TOLLGATE_ADMIN_URL", g.replica(0).admin())
            .env("TOLLGATE_ADMIN_TOKEN", TOKEN)
            .args(args)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{args:?}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    let (id, raw) = tollgate_tests::sidecar::parse_issued(&cli(&["keys", "create", "--tenant", "acme", "--plan", "free", "--method", "GET,HEAD", "--label", "read only"]));
    let through = |method: &str| send(method, &g.envoy().url("/x"), &[("x-api-key", raw.as_str())], (method == "POST").then_some("{}")).status;
    assert_eq!(through("GET"), 200);
    assert_eq!(through("POST"), 403);
    let listed = cli(&["--json", "keys", "list", "--tenant", "acme"]);
    assert!(listed.contains("read only") && listed.contains(&id), "{listed}");
    cli(&["keys", "update", &id, "--no-scopes"]);
    poll_until("the cleared scope is in force", Duration::from_secs(2), || through("POST") == 200);
    assert_eq!(get(&g.envoy().url("/x"), &[("x-api-key", raw.as_str())]).status, 200);
}

/// Behind a trusted proxy (`xff_num_trusted_hops: 1`), a network scope reads the address that
/// proxy forwarded — Envoy's downstream address, as the filter reads it on both hosts — while an
/// Envoy that trusts no proxy reads the peer, whatever `X-Forwarded-For` says.
#[test]
fn a_network_scope_reads_the_address_a_trusted_proxy_forwarded() {
    let g = Gateway::builder().admin_api(TOKEN).build();
    let template = std::fs::read_to_string(tollgate_tests::root().join("envoy/tollgate.yaml.tmpl")).unwrap();
    assert!(template.contains("xff_num_trusted_hops: 0"), "the shipped template trusts no proxy");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trusting-one-proxy.yaml.tmpl");
    std::fs::write(&path, template.replace("xff_num_trusted_hops: 0", "xff_num_trusted_hops: 1")).unwrap();
    let path: &'static str = Box::leak(path.to_string_lossy().into_owned().into_boxed_str());
    let behind_proxy = g.start_envoy(|o| tollgate_tests::EnvoyOptions { template: path, ..o });
    let (status, v) = call(&g, "POST", "/v1/keys", Some(json!({"tenant": "acme", "plan": "free", "scopes": {"networks": ["203.0.113.0/24"]}})));
    assert_eq!(status, 201, "{v}");
    let raw = v["key"].as_str().unwrap().to_string();
    let at = |envoy: &tollgate_tests::Envoy, xff: Option<&str>| {
        let mut headers = vec![("x-api-key", raw.as_str())];
        headers.extend(xff.map(|x| ("x-forwarded-for", x)));
        get(&envoy.url("/x"), &headers).status
    };
    assert_eq!(at(&behind_proxy, Some("203.0.113.7")), 200, "the proxy's client is in the scope");
    assert_eq!(at(&behind_proxy, Some("203.0.113.7, 198.51.100.1")), 403, "the proxy appended another client");
    assert_eq!(at(&behind_proxy, None), 403, "no forwarded address: the peer, outside the scope");
    assert_eq!(at(g.envoy(), Some("203.0.113.7")), 403, "an Envoy trusting no proxy reads the peer");
}
