//! Functional tests of issue 4 with real processes: PostgreSQL as the configuration source, the
//! admin API (auth, validation, OpenAPI) and the `tollgate` CLI over it, propagation to two
//! sidecar + Envoy replicas within 1 s (also after a dropped pub/sub connection), a PostgreSQL
//! outage under traffic, and Redis re-warmed from PostgreSQL.

use std::process::{Command, Output};
use std::time::{Duration, Instant};
use tollgate_tests::postgres::Postgres;
use tollgate_tests::{free_port, get, poll_until, root, start_echo, Envoy, EnvoyOptions, Redis, Resp, Sidecar};

const PLUGIN: &str = r#"{"sidecar":{"timeout":"2s"},"failureMode":"closed"}"#;
const TOKEN: &str = "test-admin-token-0123456789";

/// A sidecar on PostgreSQL with its admin API; `extra` are more settings.
fn pg_sidecar(redis: &Redis, pg: &Postgres, extra: &[(&str, &str)]) -> (Sidecar, String) {
    let admin_port = free_port();
    let listen = format!("127.0.0.1:{admin_port}");
    let mut env = vec![
        ("TOLLGATE_SIDECAR_SOURCE__KIND", "postgres"),
        ("TOLLGATE_SIDECAR_SOURCE__POSTGRES_URL", pg_url_leak(pg)),
        ("TOLLGATE_SIDECAR_ADMIN__LISTEN", leak(listen)),
        ("TOLLGATE_SIDECAR_ADMIN__TOKEN", TOKEN),
    ];
    env.extend_from_slice(extra);
    let s = Sidecar::start(&redis.url(), &env);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let probe = format!("{admin}/openapi.json");
    poll_until("admin API", Duration::from_secs(20), || get(&probe, &[]).status == 200);
    (s, admin)
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}
fn pg_url_leak(pg: &Postgres) -> &'static str {
    leak(pg.url())
}

fn call(method: &str, url: &str, token: Option<&str>, body: Option<serde_json::Value>) -> Resp {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(15))).build().into();
    let auth = token.map(|t| format!("Bearer {t}"));
    let r = match method {
        "GET" => {
            let mut r = agent.get(url);
            if let Some(a) = &auth {
                r = r.header("authorization", a);
            }
            r.call()
        }
        "DELETE" => {
            let mut r = agent.delete(url);
            if let Some(a) = &auth {
                r = r.header("authorization", a);
            }
            r.call()
        }
        m => {
            let mut r = if m == "PUT" { agent.put(url) } else { agent.post(url) };
            if let Some(a) = &auth {
                r = r.header("authorization", a);
            }
            r.header("content-type", "application/json").send(body.unwrap_or_default().to_string())
        }
    };
    match r {
        Ok(mut r) => Resp {
            status: r.status().as_u16(),
            headers: vec![],
            body: r.body_mut().read_to_string().unwrap_or_default(),
        },
        Err(e) => Resp { status: 0, headers: vec![], body: e.to_string() },
    }
}

fn admin(method: &str, base: &str, path: &str, body: Option<serde_json::Value>) -> Resp {
    call(method, &format!("{base}{path}"), Some(TOKEN), body)
}

fn cli(base: &str, args: &[&str]) -> Output {
    let bin = std::env::var_os("TOLLGATE_CLI").map(std::path::PathBuf::from).unwrap_or_else(|| root().join("target/release/tollgate"));
    Command::new(bin).env("TOLLGATE_ADMIN_URL", base).env("TOLLGATE_ADMIN_TOKEN", TOKEN).args(args).output().expect("run tollgate")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "tollgate failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// A product, a tenant subscribed to it, and a plan `p` with one generous limit.
fn seed(base: &str, limit: u64) {
    assert_eq!(admin("POST", base, "/v1/products", Some(serde_json::json!({"id": "chat"}))).status, 201);
    assert_eq!(admin("POST", base, "/v1/tenants", Some(serde_json::json!({"id": "acme", "products": ["chat"]}))).status, 201);
    set_limit(base, limit);
}

fn set_limit(base: &str, limit: u64) {
    let plan = serde_json::json!({"id": "p", "limits": [{"name": "pm", "algorithm": "fixed_window", "limit": limit, "window": "60s"}]});
    let r = admin("PUT", base, "/v1/plans/p", Some(plan));
    assert_eq!(r.status, 200, "{}", r.body);
}

fn issue(base: &str) -> (String, String) {
    let r = admin("POST", base, "/v1/keys", Some(serde_json::json!({"tenant": "acme", "plan": "p"})));
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    (v["key_id"].as_str().unwrap().to_string(), v["key"].as_str().unwrap().to_string())
}

#[test]
fn admin_api_and_cli_manage_configuration_with_auth_validation_and_openapi() {
    let (redis, pg) = (Redis::start(), Postgres::start());
    let (sidecar, base) = pg_sidecar(&redis, &pg, &[]);
    let upstream = start_echo();
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN));

    // OpenAPI served and identical to docs/openapi.json; auth required on /v1
    let doc = get(&format!("{base}/openapi.json"), &[]);
    assert_eq!(doc.status, 200);
    assert_eq!(doc.json(), serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(root().join("docs/openapi.json")).unwrap()).unwrap());
    assert_eq!(call("GET", &format!("{base}/v1/tenants"), None, None).status, 401);
    assert_eq!(call("GET", &format!("{base}/v1/tenants"), Some("wrong-token-wrong-token"), None).status, 401);
    assert_eq!(admin("GET", &base, "/v1/tenants", None).body, "[]");

    // the CLI creates, lists, refuses with the field named
    ok(&cli(&base, &["products", "create", "chat"]));
    ok(&cli(&base, &["tenants", "create", "acme", "--product", "chat"]));
    ok(&cli(&base, &["plans", "set", "p", "--limit", "pm:fixed_window:1000:60s"]));
    ok(&cli(&base, &["routes", "set", "chat", "--cluster", "upstream", "--path-prefix", "/v1/chat", "--product", "chat"]));
    let tenants = ok(&cli(&base, &["tenants", "list"]));
    assert!(tenants.lines().any(|l| l.starts_with("acme") && l.contains("chat")), "{tenants}");
    let routes: serde_json::Value = serde_json::from_str(&ok(&cli(&base, &["--json", "routes", "list"]))).unwrap();
    assert_eq!(routes[0]["match"]["path_prefix"], "/v1/chat");
    let bad = cli(&base, &["plans", "set", "p", "--limit", "pm:fixed_window:0:60s"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("plans.p.limits[0].limit"), "{}", String::from_utf8_lossy(&bad.stderr));
    // bad admin input names the field and changes nothing
    let r = admin("POST", &base, "/v1/tenants", Some(serde_json::json!({"id": "t2", "products": ["nope"]})));
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("tenants.t2.products")));
    let r = admin("POST", &base, "/v1/routes", Some(serde_json::json!({"id": "r", "cluster": "c", "match": {"pth": "/"}})));
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("pth")));
    let r = admin("DELETE", &base, "/v1/products/chat", None);
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("tenants.acme.products")));
    assert_eq!(admin("POST", &base, "/v1/tenants", Some(serde_json::json!({"id": "acme"}))).status, 409);
    assert_eq!(admin("GET", &base, "/v1/plans/p", None).json()["limits"][0]["limit"], 1000);

    // keys: the raw key alone on the last line; listing shows neither hash nor raw key
    let out = ok(&cli(&base, &["keys", "create", "--tenant", "acme", "--plan", "p"]));
    let raw = out.lines().last().unwrap().trim().to_string();
    let id = out.lines().find_map(|l| l.strip_prefix("key id:")).unwrap().trim().to_string();
    assert!(raw.starts_with("tg_") && id.starts_with("key_"), "{out}");
    let listed = ok(&cli(&base, &["--json", "keys", "list", "--tenant", "acme"]));
    assert!(listed.contains(&id) && !listed.contains(&raw) && !listed.contains("hash"), "{listed}");
    let refused = cli(&base, &["keys", "create", "--tenant", "nobody", "--plan", "p"]);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("[tenant]"));

    assert_eq!(get(&envoy.url("/"), &[("x-api-key", &raw)]).status, 200);
    ok(&cli(&base, &["keys", "revoke", &id]));
    poll_until("the revocation through Envoy", Duration::from_secs(1), || get(&envoy.url("/"), &[("x-api-key", &raw)]).status == 401);
    let table = ok(&cli(&base, &["keys", "list", "--tenant", "acme"]));
    assert!(table.lines().any(|l| l.starts_with(&id) && l.contains("revoked")), "{table}");

    // removal, then the version counts every write
    ok(&cli(&base, &["routes", "delete", "chat"]));
    assert_eq!(admin("GET", &base, "/v1/routes/chat", None).status, 404);
    let v = admin("GET", &base, "/v1/version", None).json();
    assert!(v["version"].as_u64().unwrap() >= 7, "{v}");
    assert!(!sidecar.log_text().contains(TOKEN), "the admin token must never be logged");
}

/// Polls both URLs with `raw` until both answer `want`; the time it took.
fn until_both(urls: &[String; 2], raw: &str, want: u16) -> Duration {
    let start = Instant::now();
    let mut done = [false, false];
    while !(done[0] && done[1]) {
        for (i, u) in urls.iter().enumerate() {
            if !done[i] && get(u, &[("x-api-key", raw)]).status == want {
                done[i] = true;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(1), "not effective on both replicas within 1 s (done: {done:?})");
    }
    start.elapsed()
}

#[test]
fn changes_reach_two_replicas_within_a_second_even_after_a_dropped_subscription() {
    let (redis, pg) = (Redis::start(), Postgres::start());
    // A long key-cache TTL: only the change events can make a revocation effective in time.
    let slow_cache = [("TOLLGATE_SIDECAR_CACHE__TTL", "60s")];
    let (a, base_a) = pg_sidecar(&redis, &pg, &slow_cache);
    seed(&base_a, 1_000_000);
    let (b, base_b) = pg_sidecar(&redis, &pg, &slow_cache);
    let upstream = start_echo();
    let ea = Envoy::start(EnvoyOptions::new(upstream.port, a.port).plugin_config(PLUGIN));
    let eb = Envoy::start(EnvoyOptions::new(upstream.port, b.port).plugin_config(PLUGIN));
    let urls = [ea.url("/"), eb.url("/")];

    let mut samples = Vec::new();
    for round in 0..12 {
        let (id, raw) = issue(if round % 2 == 0 { &base_a } else { &base_b });
        // a fresh key works on both (and is now cached on both)
        until_both(&urls, &raw, 200);
        if round == 6 {
            // drop every pub/sub connection: the revocation below may be published before the
            // replicas resubscribe, and their resync by version must catch it
            let mut c = redis.connection().unwrap();
            let killed: i64 = redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub").query(&mut c).unwrap();
            assert!(killed >= 2, "both sidecars hold a pub/sub connection ({killed})");
        }
        let start = Instant::now();
        assert_eq!(admin("POST", &base_a, &format!("/v1/keys/{id}/revoke"), None).status, 200);
        until_both(&urls, &raw, 401);
        samples.push(start.elapsed());
    }

    // a plan's limit: lowered to 2 → the third request on either replica is refused
    let (_, raw) = issue(&base_a);
    until_both(&urls, &raw, 200);
    let start = Instant::now();
    set_limit(&base_b, 2);
    until_both(&urls, &raw, 429);
    samples.push(start.elapsed());

    samples.sort();
    let p99 = samples[(samples.len() * 99).div_ceil(100) - 1];
    eprintln!("propagation over {} changes: median {:?}, p99 {:?}, max {:?}", samples.len(), samples[samples.len() / 2], p99, samples.last().unwrap());
    assert!(p99 < Duration::from_secs(1));
    assert!(b.log_text().contains("subscribed to config changes"));
}

#[test]
fn postgres_going_away_leaves_the_hot_path_alone_and_a_wiped_redis_is_rewarmed() {
    let (mut redis, mut pg) = (Redis::start(), Postgres::start());
    let (sidecar, base) = pg_sidecar(&redis, &pg, &[]);
    seed(&base, 1_000_000);
    let (_, raw) = issue(&base);
    let upstream = start_echo();
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN));
    assert_eq!(get(&envoy.url("/"), &[("x-api-key", &raw)]).status, 200);

    // The harness runs PostgreSQL with synchronous_commit=off and stops it with `-m immediate` (a
    // crash): make the commits so far durable first, as a real server's synchronous commit would.
    let psql = tollgate_tests::postgres::pg_bin_dir().join("psql");
    let out = Command::new(psql).args([pg.url().as_str(), "-c", "CHECKPOINT"]).output().expect("psql");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    pg.stop();
    for _ in 0..50 {
        let r = get(&envoy.url("/"), &[("x-api-key", &raw)]);
        assert_eq!(r.status, 200, "PostgreSQL is not on the request path: {}", r.body);
    }
    let r = admin("PUT", &base, "/v1/products/other", Some(serde_json::json!({"id": "other"})));
    assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("store_unavailable")), "{}", r.body);
    assert_eq!(admin("GET", &base, "/v1/products/other", None).status, 404, "a failed write changes nothing");
    pg.start_again();
    poll_until("admin writes after PostgreSQL is back", Duration::from_secs(20), || {
        admin("PUT", &base, "/v1/products/other", Some(serde_json::json!({"id": "other"}))).status == 200
    });

    // a wiped Redis loses no key: a sidecar starting re-warms it from PostgreSQL
    drop(envoy);
    drop(sidecar);
    redis.kill();
    redis.restart();
    let (sidecar, _) = pg_sidecar(&redis, &pg, &[]);
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN));
    poll_until("the key to work again after re-warming", Duration::from_secs(10), || {
        get(&envoy.url("/"), &[("x-api-key", &raw)]).status == 200
    });
}

#[test]
fn an_unreachable_postgres_at_start_is_a_clear_error() {
    let redis = Redis::start();
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let out = Command::new(tollgate_tests::sidecar_bin())
        .env("TOLLGATE_SIDECAR_LISTEN", format!("127.0.0.1:{}", free_port()))
        .env("TOLLGATE_SIDECAR_REDIS__URL", redis.url())
        .env("TOLLGATE_SIDECAR_SOURCE__KIND", "postgres")
        .env("TOLLGATE_SIDECAR_SOURCE__POSTGRES_URL", &url)
        .env("TOLLGATE_SIDECAR_SOURCE__CONNECT_TIMEOUT", "2s")
        .output()
        .expect("run the sidecar");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PostgreSQL source (source.postgres_url) cannot be used"), "{err}");
}

/// Routing on, with the breaker template's two upstream clusters (`upstream`, `upstream_b`).
const ROUTED: &str = r#"{"sidecar":{"timeout":"2s"},"failureMode":"closed","routing":{"enabled":true,"refreshInterval":"100ms"}}"#;

/// Which upstream served a 200 for `path`, judged by the upstreams' request counters.
fn served_by(url: &str, raw: &str, counters: &[&std::sync::atomic::AtomicU64; 2]) -> (u16, Option<usize>) {
    use std::sync::atomic::Ordering::SeqCst;
    let before = [counters[0].load(SeqCst), counters[1].load(SeqCst)];
    let r = get(url, &[("x-api-key", raw)]);
    let moved: Vec<usize> = (0..2).filter(|&i| counters[i].load(SeqCst) != before[i]).collect();
    assert!(moved.len() <= 1, "one request reached both upstreams?");
    (r.status, moved.first().copied())
}

#[test]
fn routes_steer_by_path_to_two_upstreams_and_route_changes_reach_two_replicas_within_a_second() {
    let (redis, pg) = (Redis::start(), Postgres::start());
    let (a, base_a) = pg_sidecar(&redis, &pg, &[]);
    let (b, base_b) = pg_sidecar(&redis, &pg, &[]);
    seed(&base_a, 1_000_000);
    assert_eq!(admin("POST", &base_a, "/v1/products", Some(serde_json::json!({"id": "embed"}))).status, 201);
    for route in [
        serde_json::json!({"id": "chat", "match": {"path_prefix": "/v1/chat"}, "cluster": "upstream", "product": "chat"}),
        serde_json::json!({"id": "models", "match": {"path": "/v1/models", "method": "GET"}, "cluster": "upstream_b"}),
        serde_json::json!({"id": "embed", "match": {"path_prefix": "/v1/embed"}, "cluster": "upstream_b", "product": "embed"}),
    ] {
        let r = admin("POST", &base_b, "/v1/routes", Some(route));
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let (_, raw) = issue(&base_a);
    let ((u1, c1), (u2, c2)) = (tollgate_tests::start_counting_echo(), tollgate_tests::start_counting_echo());
    let opts = |sidecar: u16| {
        EnvoyOptions { template: "envoy/breaker.yaml.tmpl", vars: vec![("FALLBACK_PORT", u2.port.to_string())], ..EnvoyOptions::new(u1.port, sidecar) }
            .plugin_config(ROUTED)
    };
    let envoys = [Envoy::start(opts(a.port)), Envoy::start(opts(b.port))];
    let counters = [c1.as_ref(), c2.as_ref()];
    for e in &envoys {
        // the first table arrives within a refresh or two
        poll_until("routing table loaded", Duration::from_secs(10), || get(&e.url("/v1/chat/x"), &[("x-api-key", &raw)]).status == 200);
    }

    for e in &envoys {
        assert_eq!(served_by(&e.url("/v1/chat/completions"), &raw, &counters), (200, Some(0)));
        assert_eq!(served_by(&e.url("/v1/models"), &raw, &counters), (200, Some(1)));
        assert_eq!(served_by(&e.url("/v1/models?limit=2"), &raw, &counters), (200, Some(1)));
        // no route: 404 from the filter, no upstream; a product the tenant lacks: 403
        let (status, by) = served_by(&e.url("/nowhere"), &raw, &counters);
        assert_eq!((status, by), (404, None));
        assert_eq!(get(&e.url("/nowhere"), &[("x-api-key", &raw)]).json()["error"], "no_route");
        let r = get(&e.url("/v1/embed"), &[("x-api-key", &raw)]);
        assert_eq!((r.status, r.json()["error"].as_str()), (403, Some("not_subscribed")), "{}", r.body);
        // a client cannot pick the cluster itself
        let r = get(&e.url("/v1/chat/x"), &[("x-api-key", &raw), ("x-tollgate-cluster", "upstream_b")]);
        assert_eq!(r.status, 200);
    }
    assert_eq!(a.log_text().matches("panicked").count(), 0);

    // a route moved to the other upstream, and a subscription added: both replicas within 1 s
    let mut samples = Vec::new();
    for (round, cluster) in ["upstream", "upstream_b", "upstream"].into_iter().enumerate() {
        let want = usize::from(cluster == "upstream_b");
        let start = Instant::now();
        let route = serde_json::json!({"id": "models", "match": {"path": "/v1/models", "method": "GET"}, "cluster": cluster});
        let base = if round % 2 == 0 { &base_a } else { &base_b };
        assert_eq!(admin("PUT", base, "/v1/routes/models", Some(route)).status, 200);
        for e in &envoys {
            let url = e.url("/v1/models");
            while served_by(&url, &raw, &counters) != (200, Some(want)) {
                assert!(start.elapsed() < Duration::from_secs(1), "route change not effective within 1 s");
            }
        }
        samples.push(start.elapsed());
    }
    let start = Instant::now();
    let tenant = serde_json::json!({"id": "acme", "products": ["chat", "embed"]});
    assert_eq!(admin("PUT", &base_a, "/v1/tenants/acme", Some(tenant)).status, 200);
    for e in &envoys {
        while served_by(&e.url("/v1/embed/x"), &raw, &counters) != (200, Some(1)) {
            assert!(start.elapsed() < Duration::from_secs(1), "subscription not effective within 1 s");
        }
    }
    samples.push(start.elapsed());
    samples.sort();
    eprintln!("route/subscription propagation over {} changes: median {:?}, max {:?}", samples.len(), samples[samples.len() / 2], samples.last().unwrap());
}
