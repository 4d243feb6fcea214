//! Issue 44 with real processes: the configuration plane under faults. A stored row a sidecar
//! cannot use (decision 206), a pub/sub subscription gone silent (decision 207), bounds on what
//! the admin API takes (decision 208).

use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};
use tollgate_tests::{admin_call, get, poll_until, Gateway, Resp};

const TOKEN: &str = "test-admin-token-0123456789";

fn admin(method: &str, base: &str, path: &str, body: Option<serde_json::Value>) -> Resp {
    admin_call(method, base, TOKEN, path, body)
}

fn psql(g: &Gateway, sql: &str) {
    tollgate_tests::billing::psql(g.pg(), sql).expect("psql");
}

/// The `(kind, id, in_force)` of each stored object the replica at `base` reports unusable.
fn unusable(base: &str) -> Vec<(String, String, String)> {
    let v = admin("GET", base, "/v1/version", None).json();
    let rows = v["unusable"].as_array().cloned().unwrap_or_default();
    let text = |x: &serde_json::Value| x.as_str().unwrap_or_default().to_string();
    rows.iter().map(|u| (text(&u["kind"]), text(&u["id"]), text(&u["in_force"]))).collect()
}

/// Decision 206: rows a sidecar cannot use — a field a newer sidecar wrote, a document whose id
/// differs from its key column (decision 208), a plan edited by hand — are reported and set
/// aside one by one; every other change goes on, and each of them can be deleted or replaced
/// through the admin API. Before, one such row failed every reload and every admin write with
/// 503, its own DELETE included, and a replica could not start.
#[test]
fn rows_a_sidecar_cannot_use_are_reported_and_set_aside_while_every_other_change_works() {
    let mut g = Gateway::builder().config_in_postgres().admin_api(TOKEN).build();
    let base = g.replica(0).admin().to_string();
    assert_eq!(admin("POST", &base, "/v1/products", Some(json!({"id": "chat"}))).status, 201);
    assert_eq!(admin("POST", &base, "/v1/tenants", Some(json!({"id": "acme", "products": ["chat"]}))).status, 201);
    let plan = json!({"id": "p", "limits": [{"name": "pm", "algorithm": "fixed_window", "limit": 1000, "window": "60s"}]});
    assert_eq!(admin("POST", &base, "/v1/plans", Some(plan)).status, 201);
    let route = json!({"id": "r", "match": {"path_prefix": "/v1/chat"}, "cluster": "upstream", "product": "chat"});
    assert_eq!(admin("POST", &base, "/v1/routes", Some(route.clone())).status, 201);
    let r = admin("POST", &base, "/v1/keys", Some(json!({"tenant": "acme", "plan": "p"})));
    assert_eq!(r.status, 201, "{}", r.body);
    let raw = r.json()["key"].as_str().unwrap().to_string();
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &raw)]).status, 200);

    // a newer sidecar's field on the route, a row whose id is not its key, a hand-made plan
    psql(&g, r#"UPDATE routes SET doc = doc || '{"timeout": "5s"}' WHERE id = 'r'"#);
    psql(&g, r#"INSERT INTO products (id, doc) VALUES ('x', '{"id": "y"}')"#);
    psql(&g, r#"INSERT INTO plans (id, doc) VALUES ('bad', '{"id": "bad", "limits": [{"name": "pm", "algorithm": "fixed_window", "limit": 0}]}')"#);

    // every other change still works, and is reloaded around them
    let r = admin("POST", &base, "/v1/products", Some(json!({"id": "embed"})));
    assert_eq!(r.status, 201, "a write beside rows this sidecar cannot use: {}", r.body);
    // by kind (tenants, products, plans, routes), then id
    let want: Vec<_> = [("products", "x", "none"), ("plans", "bad", "none"), ("routes", "r", "last_good")].map(|(k, i, f)| (k.into(), i.into(), f.into())).into();
    poll_until("the rows reported", Duration::from_secs(20), || unusable(&base) == want);
    assert_eq!(admin("GET", &base, "/v1/routes/r", None).json()["cluster"], "upstream", "the route's last good version in force");
    assert_eq!(g.sidecar().metric("tollgate_sidecar_config_unusable_objects"), 3);
    poll_until("the unusable rows said in the log", Duration::from_secs(10), || g.sidecar().log_text().contains("cannot be used as stored"));
    let cli = tollgate_tests::process::native_bin("TOLLGATE_CLI", "tollgate");
    let out = Command::new(cli).env("TOLLGATE_ADMIN_URL", &base).env("TOLLGATE_ADMIN_TOKEN", TOKEN).arg("version").output().expect("run tollgate");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("3 stored object(s) not in force") && text.contains("last_good"), "{text}");
    for _ in 0..20 {
        assert_eq!(get(&url, &[("x-api-key", &raw)]).status, 200, "requests go on");
    }

    // a replica starts beside them (one with no last good version leaves the route out)
    g.add_replica().expect("a replica starts while the store holds rows it cannot use");
    let other = g.replica(1).admin().to_string();
    assert!(unusable(&other).contains(&("routes".into(), "r".into(), "none".into())), "{:?}", unusable(&other));

    // each can be deleted or replaced, and then nothing is reported
    assert_eq!(admin("POST", &base, "/v1/plans", Some(json!({"id": "bad", "limits": []}))).status, 409, "the row exists");
    assert_eq!(admin("DELETE", &base, "/v1/plans/bad", None).status, 200);
    assert_eq!(admin("DELETE", &base, "/v1/products/x", None).status, 200);
    assert_eq!(admin("PUT", &base, "/v1/routes/r", Some(route)).status, 200);
    for b in [&base, &other] {
        poll_until("nothing left to report", Duration::from_secs(20), || unusable(b).is_empty());
    }
    assert_eq!(g.sidecar().metric("tollgate_sidecar_config_unusable_objects"), 0);
    assert_eq!(admin("GET", &other, "/v1/routes/r", None).status, 200);
}

/// Decision 208: one object's size and a configuration's number of objects are bounded, and a
/// refusal names the bound.
#[test]
fn an_object_over_the_size_bound_is_refused_naming_it() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).build();
    let base = g.replica(0).admin().to_string();
    let r = admin("POST", &base, "/v1/products", Some(json!({"id": "big", "name": "n".repeat(70_000)})));
    assert_eq!((r.status, r.json()["error"].as_str(), r.json()["limit"].as_u64()), (413, Some("payload_too_large"), Some(65_536)), "{}", r.body);
    assert_eq!(admin("GET", &base, "/v1/products/big", None).status, 404);
    assert_eq!(admin("POST", &base, "/v1/products", Some(json!({"id": "big", "name": "n".repeat(60_000)}))).status, 201);
}

/// Decision 207: a pub/sub connection that stops delivering without closing (here: a relay that
/// stops forwarding the subscriber's socket alone; the sidecar's other connections and the
/// publisher stay healthy) answers no ping, and is replaced: a revocation published while it is
/// silent is in force within seconds. Before, the replica heard nothing until its resync (here
/// 60 s, 5 s by default), and its key cache (60 s here) kept the key working.
#[test]
fn a_silent_subscription_is_replaced_and_a_revocation_still_arrives() {
    let redis = tollgate_tests::Redis::start();
    let relay = tollgate_tests::relay::Relay::start(redis.port);
    let g = Gateway::builder()
        .sidecar_env("TOLLGATE_SIDECAR_REDIS__URL", &relay.url())
        .sidecar_env("TOLLGATE_SIDECAR_CACHE__TTL", "60s")
        .sidecar_env("TOLLGATE_SIDECAR_ADMIN__RESYNC_INTERVAL", "60s")
        .build();
    let sidecar = g.sidecar();
    let key = sidecar.create_key("acme", "free", &[]);
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &key.raw)]).status, 200);
    poll_until("the subscription", Duration::from_secs(10), || sidecar.log_text().contains("subscribed to config changes"));

    relay.stall_those_that_sent(b"PSUBSCRIBE");
    let start = Instant::now();
    sidecar.revoke_key(&key.id);
    poll_until("the revocation in force", Duration::from_secs(20), || get(&url, &[("x-api-key", &key.raw)]).status == 401);
    eprintln!("revocation in force {:?} after the subscriber's socket froze", start.elapsed());
    assert!(sidecar.metric("tollgate_sidecar_config_subscriber_replaced_total") >= 1);
    assert!(sidecar.log_text().contains("answered no ping"));
}

/// Decision 212: a replica that revokes a key through its own admin API while it cannot hear its
/// own change message (pub/sub refused here; in life, its subscription dropped or being replaced
/// at that moment) still tells its own filters. Before, it marked the version it wrote as loaded,
/// its resync found nothing moved, and its Envoy kept letting the revoked key through from its
/// cached allow (here a 60 s key cache and resync: the 10 s bound failed).
#[test]
fn a_revocation_reaches_the_writers_own_filters_without_its_message() {
    let g = Gateway::builder()
        .config_in_postgres()
        .admin_api(TOKEN)
        .sidecar_env("TOLLGATE_SIDECAR_CACHE__TTL", "60s")
        .sidecar_env("TOLLGATE_SIDECAR_ADMIN__RESYNC_INTERVAL", "60s")
        .build();
    let base = g.replica(0).admin().to_string();
    assert_eq!(admin("POST", &base, "/v1/products", Some(json!({"id": "chat"}))).status, 201);
    assert_eq!(admin("POST", &base, "/v1/tenants", Some(json!({"id": "acme", "products": ["chat"]}))).status, 201);
    assert_eq!(admin("POST", &base, "/v1/plans", Some(json!({"id": "p", "limits": []}))).status, 201);
    let key = admin("POST", &base, "/v1/keys", Some(json!({"tenant": "acme", "plan": "p"}))).json();
    let (id, raw) = (key["key_id"].as_str().unwrap().to_string(), key["key"].as_str().unwrap().to_string());
    let url = g.replica(0).envoy().url("/");
    let status = || get(&url, &[("x-api-key", raw.as_str())]).status;
    assert_eq!(status(), 200, "the key works, and its allow is now cached");
    let mut c = g.redis().connection().unwrap();
    let _: () = redis::cmd("ACL").arg("SETUSER").arg("default").arg("-psubscribe").query(&mut c).unwrap();
    let killed: i64 = redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub").query(&mut c).unwrap();
    assert!(killed >= 1, "the sidecar held a pub/sub connection ({killed})");
    assert_eq!(status(), 200);
    assert_eq!(admin("POST", &base, &format!("/v1/keys/{id}/revoke"), None).status, 200);
    poll_until("the revocation through the writer's own Envoy", Duration::from_secs(10), || status() == 401);
}
