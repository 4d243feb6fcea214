//! The web console (sidecar/src/console, docs/console.md) attacked over HTTP as a person with a
//! tenant's session would: tenant A's session cannot read or change tenant B's keys, usage or
//! users through any console or API URL (B's key ids named in URLs and forms, fields added to
//! forms, B's CSRF token replayed); a write without the CSRF token is refused; a copy of the
//! cookie is worth nothing after sign-out; another tenant's key cannot be revoked or rotated; 20 wrong passwords lock a user; an invite works once;
//! the admin API still wants its token whatever cookie comes with the call; the overview's
//! figures come from Prometheus when it is configured.

use serde_json::{json, Value};
use std::time::Duration;
use tollgate_tests::billing::psql;
use tollgate_tests::console::{csrf_of, ConsoleClient};
use tollgate_tests::prometheus::{Job, Prometheus};
use tollgate_tests::sidecar::Sidecar;
use tollgate_tests::{admin_call, free_port, get, poll_until, send, Gateway};

const TOKEN: &str = "test-admin-token-0123456789";
const PASSWORD: &str = "a long passphrase 1";

/// Creates a tenant user through the operator console's form; the answer.
fn create_user(op: &mut ConsoleClient, csrf: &str, tenant: &str, login: &str, plan: &str) -> tollgate_tests::Resp {
    op.post("/console/operator/users", csrf, &[("tenant", tenant), ("login", login), ("name", login), ("plan", plan), ("password", PASSWORD)])
}

/// The key ids of a tenant, from the admin API (the ground truth).
fn keys_of(base: &str, tenant: &str) -> Vec<Value> {
    let r = admin_call("GET", base, TOKEN, &format!("/v1/keys?tenant={tenant}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// Issues a key in the portal; its id (from the page that shows the raw key once).
fn portal_key(c: &mut ConsoleClient, csrf: &str, extra: &[(&str, &str)]) -> String {
    let r = c.post("/console/portal/keys", csrf, extra);
    assert_eq!(r.status, 201, "{}", r.body);
    assert!(r.body.contains("value=\"tg_"), "the raw key is shown once: {}", r.body);
    let at = r.body.find("id=\"newkeyid\">").expect("the new key's id") + "id=\"newkeyid\">".len();
    r.body[at..].split('<').next().unwrap().to_string()
}

#[test]
fn a_tenant_session_reaches_only_its_own_tenant() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).console().build();
    let base = g.replica(0).admin().to_string();
    for t in ["acme", "beta"] {
        assert_eq!(admin_call("POST", &base, TOKEN, "/v1/tenants", Some(json!({"id": t}))).status, 201);
    }
    for p in ["basic", "premium"] {
        assert_eq!(admin_call("POST", &base, TOKEN, "/v1/plans", Some(json!({"id": p, "limits": []}))).status, 201);
    }
    let (mut op, op_csrf) = ConsoleClient::operator(&base, TOKEN);
    // a write without the CSRF token (or with a wrong one) is refused and changes nothing
    let r = op.post_raw("/console/operator/users", &[("tenant", "acme"), ("login", "ana@acme.io"), ("plan", "basic"), ("password", PASSWORD)]);
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(op.post("/console/operator/users", "x".repeat(43).as_str(), &[("tenant", "acme"), ("login", "ana@acme.io"), ("plan", "basic"), ("password", PASSWORD)]).status, 403);
    assert!(ConsoleClient::tenant(&base, "ana@acme.io", PASSWORD).is_err(), "no user was made");
    assert_eq!(create_user(&mut op, &op_csrf, "acme", "ana@acme.io", "basic").status, 303);
    assert_eq!(create_user(&mut op, &op_csrf, "beta", "bob@beta.io", "basic").status, 303);
    // the operator's forms answer with the API's validation
    let r = op.post("/console/operator/tenants", &op_csrf, &[("json", r#"{"id": "bad id!"}"#)]);
    assert_eq!(r.status, 400, "{}", r.body);
    let api = admin_call("POST", &base, TOKEN, "/v1/tenants", Some(json!({"id": "bad id!"})));
    let message = serde_json::from_str::<Value>(&api.body).unwrap()["message"].as_str().unwrap().to_string();
    assert!(r.body.contains(&maud_escape(&message)), "the API's own error ({message}) in: {}", r.body);

    let (mut ana, ana_csrf) = ConsoleClient::tenant(&base, "ana@acme.io", PASSWORD).expect("ana signs in");
    let (mut bob, bob_csrf) = ConsoleClient::tenant(&base, "bob@beta.io", PASSWORD).expect("bob signs in");
    // fields a tenant adds to the form (another tenant, a better plan) are not read
    let ana_key = portal_key(&mut ana, &ana_csrf, &[("tenant", "beta"), ("plan", "premium")]);
    let bob_key = portal_key(&mut bob, &bob_csrf, &[]);
    let acme = keys_of(&base, "acme");
    assert_eq!(acme.len(), 1, "{acme:?}");
    assert_eq!((acme[0]["key_id"].as_str(), acme[0]["plan"].as_str()), (Some(ana_key.as_str()), Some("basic")));
    // her own key rotates: the successor is acme's too, on the same plan
    let r = ana.post(&format!("/console/portal/keys/{ana_key}/rotate"), &ana_csrf, &[("overlap", "1h")]);
    assert_eq!(r.status, 201, "{}", r.body);
    assert!(r.body.contains(&format!("It replaces {ana_key}")), "{}", r.body);
    let acme = keys_of(&base, "acme");
    assert_eq!(acme.len(), 2, "{acme:?}");
    assert!(acme.iter().all(|k| k["plan"] == "basic" && k["status"] == "active"));
    assert!(acme.iter().any(|k| k["key_id"] == ana_key.as_str() && k["expires_at"].is_u64()), "the old key got its overlap's expiry");
    assert!(keys_of(&base, "beta").iter().all(|k| k["key_id"] != ana_key.as_str()));

    // ana's pages show acme's keys alone
    let page = ana.get("/console/portal");
    assert!(page.body.contains(&ana_key) && !page.body.contains(&bob_key), "{}", page.body);
    // bob's key named in ana's URL: not found, bob's key untouched; with bob's CSRF token: refused
    let r = ana.post(&format!("/console/portal/keys/{bob_key}/revoke"), &ana_csrf, &[]);
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(ana.post(&format!("/console/portal/keys/{bob_key}/revoke"), &bob_csrf, &[]).status, 403);
    assert_eq!(ana.post(&format!("/console/portal/keys/{ana_key}/revoke"), &bob_csrf, &[]).status, 403, "a CSRF token is its session's");
    let r = ana.post(&format!("/console/portal/keys/{bob_key}/rotate"), &ana_csrf, &[("overlap", "0s")]);
    assert_eq!(r.status, 404, "another tenant's key cannot be rotated: {}", r.body);
    assert_eq!(ana.post(&format!("/console/portal/keys/{bob_key}/rotate"), &bob_csrf, &[]).status, 403);
    assert!(keys_of(&base, "beta").iter().all(|k| k["status"] == "active" && k["expires_at"].is_null()), "bob's key stays active, with no expiry");
    assert_eq!(keys_of(&base, "beta").len(), 1, "no successor was made for beta");
    assert!(keys_of(&base, "acme").iter().all(|k| k["status"] == "active"));
    // the operator's pages and writes: forbidden to a tenant session
    for path in ["/console/operator", "/console/operator/keys", "/console/operator/keys?tenant=beta", "/console/operator/tenants", "/console/operator/users?tenant=beta", "/console/operator/tenants/beta"] {
        let r = ana.get(path);
        assert_eq!(r.status, 403, "{path}: {}", r.body);
        assert!(!r.body.contains(&bob_key) && !r.body.contains("bob@beta.io"), "{path} leaks beta");
    }
    for (path, fields) in [
        (format!("/console/operator/keys/{bob_key}/revoke"), vec![]),
        (format!("/console/operator/keys/{bob_key}/rotate"), vec![]),
        ("/console/operator/keys".to_string(), vec![("tenant", "beta"), ("plan", "premium")]),
        ("/console/operator/users".to_string(), vec![("tenant", "beta"), ("login", "eve@beta.io"), ("plan", "premium"), ("password", PASSWORD)]),
        ("/console/operator/users/bob@beta.io/delete".to_string(), vec![("tenant", "beta")]),
        ("/console/operator/tenants/beta/delete".to_string(), vec![]),
    ] {
        assert_eq!(ana.post(&path, &ana_csrf, &fields).status, 403, "{path}");
    }
    assert_eq!(keys_of(&base, "beta").len(), 1);
    assert!(ConsoleClient::tenant(&base, "bob@beta.io", PASSWORD).is_ok(), "bob is still there");
    // the admin API wants its token, whatever cookie comes along
    let cookie = format!("tollgate_console={}", ana.session.clone().unwrap());
    for (method, path) in [("GET", "/v1/keys?tenant=beta"), ("GET", "/v1/tenants"), ("POST", &format!("/v1/keys/{bob_key}/revoke") as &str)] {
        let r = send(method, &format!("{base}{path}"), &[("cookie", &cookie)], (method == "POST").then_some("{}"));
        assert_eq!(r.status, 401, "{method} {path}: {}", r.body);
    }

    // usage: the rollup's rows of both tenants; ana's page and CSV show acme's alone
    let pg = g.pg();
    psql(pg, "CREATE TABLE IF NOT EXISTS usage_daily (day date, tenant text, key_id text, requests_ok bigint DEFAULT 0, requests_4xx bigint DEFAULT 0, requests_5xx bigint DEFAULT 0, requests_denied bigint DEFAULT 0, requests_aborted bigint DEFAULT 0, tokens bigint DEFAULT 0)").unwrap();
    psql(pg, &format!("INSERT INTO usage_daily (day, tenant, key_id, requests_ok, tokens) VALUES (current_date, 'acme', '{ana_key}', 7, 70), (current_date, 'beta', '{bob_key}', 5, 50)")).unwrap();
    let csv = ana.get("/console/portal/usage.csv");
    assert_eq!(csv.status, 200, "{}", csv.body);
    assert!(csv.body.contains(&format!(",{ana_key},7,0,70")), "{}", csv.body);
    assert!(!csv.body.contains(&bob_key) && !csv.body.contains(",5,0,50"), "{}", csv.body);
    // LLM calls by model with their cost (the rollup's `usage_daily_models`): acme's alone
    psql(pg, "CREATE TABLE IF NOT EXISTS usage_daily_models (day date, tenant text, key_id text, model text, requests bigint DEFAULT 0, input_tokens bigint DEFAULT 0, output_tokens bigint DEFAULT 0, cached_tokens bigint DEFAULT 0, tokens bigint DEFAULT 0, cost_micros bigint DEFAULT 0)").unwrap();
    psql(pg, &format!("INSERT INTO usage_daily_models (day, tenant, key_id, model, requests, input_tokens, output_tokens, cost_micros) VALUES \
         (current_date, 'acme', '{ana_key}', 'gpt-4o-mini', 3, 300, 90, 1500007), (current_date, 'beta', '{bob_key}', 'claude-secret-model', 1, 1, 1, 99)")).unwrap();
    let usage = ana.get("/console/portal/usage");
    assert!(usage.body.contains("<svg") && usage.body.contains(&ana_key) && !usage.body.contains(&bob_key), "{}", usage.body);
    assert!(usage.body.contains("gpt-4o-mini") && usage.body.contains("1.500007"), "acme's model and its cost: {}", usage.body);
    assert!(!usage.body.contains("claude-secret-model"), "another tenant's model: {}", usage.body);

    // sign-out ends the session on the server: a copy of the cookie taken before is worth nothing
    let mut stolen = ana.clone();
    assert_eq!(ana.post("/console/signout", &ana_csrf, &[]).status, 303);
    assert!(ana.session.is_none(), "the cookie is cleared");
    let r = stolen.get("/console/portal");
    assert_eq!(r.status, 303, "a signed-out session still works: {}", r.body);
    assert_eq!(stolen.post("/console/portal/keys", &ana_csrf, &[]).status, 303);
    assert_eq!(keys_of(&base, "acme").len(), 2, "nothing was issued with the stolen cookie");
    // a sign-out without the CSRF token is refused (no signing a victim out from another site)
    assert_eq!(bob.post_raw("/console/signout", &[]).status, 403);
    assert_eq!(bob.get("/console/portal").status, 200);
}

/// What maud makes of a message in a page.
fn maud_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[test]
fn twenty_wrong_passwords_lock_and_an_invite_works_once() {
    let toml = "[[tenants]]\nid = \"acme\"\n";
    let g = Gateway::builder().sidecar_toml(toml).admin_api(TOKEN).console().build();
    let base = g.replica(0).admin().to_string();
    let (mut op, csrf) = ConsoleClient::operator(&base, TOKEN);
    assert_eq!(create_user(&mut op, &csrf, "acme", "ana@acme.io", "free").status, 303);
    assert_eq!(create_user(&mut op, &csrf, "acme", "cy@acme.io", "free").status, 303);
    for i in 0..20 {
        let r = ConsoleClient::tenant(&base, "ana@acme.io", &format!("wrong password {i}")).err().expect("a wrong password is refused");
        assert_eq!(r.status, 401, "attempt {i}: {}", r.body);
    }
    // the right password now: locked
    let r = ConsoleClient::tenant(&base, "ana@acme.io", PASSWORD).err().expect("locked after 20 wrong passwords");
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("locked"), "{}", r.body);
    // another user of the tenant is not locked by it
    assert!(ConsoleClient::tenant(&base, "cy@acme.io", PASSWORD).is_ok());
    // 19 wrong then the right one: not locked, and the count starts again
    for i in 0..19 {
        assert_eq!(ConsoleClient::tenant(&base, "cy@acme.io", &format!("nope {i}")).err().unwrap().status, 401);
    }
    assert!(ConsoleClient::tenant(&base, "cy@acme.io", PASSWORD).is_ok());
    assert_eq!(ConsoleClient::tenant(&base, "cy@acme.io", "nope again").err().unwrap().status, 401);
    assert!(ConsoleClient::tenant(&base, "cy@acme.io", PASSWORD).is_ok());

    // an invite link: shown once, used once
    let r = op.post("/console/operator/invites", &csrf, &[("tenant", "acme"), ("login", "dee@acme.io"), ("name", "Dee"), ("plan", "free")]);
    assert_eq!(r.status, 201, "{}", r.body);
    let at = r.body.find("/console/invite/").expect("the link") ;
    let link = r.body[at..].split('"').next().unwrap().to_string();
    let mut dee = ConsoleClient::new(&base);
    assert_eq!(dee.get(&link).status, 200);
    assert_eq!(dee.post_raw(&link, &[("password", "short"), ("password2", "short")]).status, 400, "a short password");
    let r = dee.post_raw(&link, &[("password", PASSWORD), ("password2", PASSWORD)]);
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(dee.get("/console/portal").status, 200, "signed in by the invite");
    let mut again = ConsoleClient::new(&base);
    assert_eq!(again.get(&link).status, 404, "used");
    assert_eq!(again.post_raw(&link, &[("password", "another long one"), ("password2", "another long one")]).status, 404);
    assert!(ConsoleClient::tenant(&base, "dee@acme.io", PASSWORD).is_ok(), "the first password stands");
    // the operator deletes a user: its sessions end with it
    let page = dee.get("/console/portal");
    let dee_csrf = csrf_of(&page.body).unwrap();
    assert_eq!(op.post("/console/operator/users/dee@acme.io/delete", &csrf, &[("tenant", "acme")]).status, 303);
    assert_eq!(dee.get("/console/portal").status, 303);
    assert_eq!(dee.post("/console/portal/keys", &dee_csrf, &[]).status, 303);
}

#[test]
fn the_console_is_off_unless_enabled_and_says_when_redis_is_down() {
    let mut g = Gateway::builder().admin_api(TOKEN).build();
    let base = g.replica(0).admin().to_string();
    assert_eq!(ConsoleClient::new(&base).get("/console/signin").status, 404, "off by default");
    drop(g);
    g = Gateway::builder().admin_api(TOKEN).console().build();
    let base = g.replica(0).admin().to_string();
    let mut c = ConsoleClient::new(&base);
    let page = c.get("/console/signin");
    assert_eq!(page.status, 200);
    let csp = page.header("content-security-policy").unwrap_or_default().to_string();
    assert!(csp.contains("default-src 'self'") && csp.contains("script-src 'none'"), "{csp}");
    assert!(!page.body.contains("<script"));
    assert_eq!(c.get("/console/assets/console.css").status, 200);
    let (mut op, _) = ConsoleClient::operator(&base, TOKEN);
    g.redis_mut().kill();
    let r = op.get("/console/operator");
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("Redis does not answer"), "{}", r.body);
}

/// With `console.prometheus_url`, the overview's figures per tenant are every replica's, from
/// Prometheus: a sidecar that saw none of a tenant's requests shows them; with Prometheus gone, it
/// says so and falls back to its own counters.
#[test]
fn the_overview_reads_every_replicas_figures_from_prometheus() {
    let g = Gateway::builder()
        .sidecar_toml(
            "[usage]\nenabled = true\nspool_dir = \"${SPOOL_DIR}\"\nsegment_age = \"50ms\"\n\
             [usage.kafka]\nbrokers = \"${BROKERS}\"\ntopic = \"usage_events\"\npartitions = 1\ndelivery_timeout = \"3s\"\n",
        )
        .plugin(json!({"sidecar": {"timeout": "2s"}, "usage": {"enabled": true, "flushInterval": "100ms"}}))
        .broker()
        .build();
    let key = g.sidecar().create_key("acme", "free", &[]);
    for _ in 0..3 {
        assert_eq!(get(&g.envoy().url("/v1/items"), &[("x-api-key", &key.raw)]).status, 200);
    }
    let prom = Prometheus::start(&[Job::new("sidecar", "/metrics", [format!("127.0.0.1:{}", g.sidecar().port)])]);
    poll_until("acme's requests in Prometheus", Duration::from_secs(90), || {
        prom.query("sum(tollgate_requests_total{tenant=\"acme\"})").first().and_then(|s| s["value"][1].as_str().map(|v| v == "3")).unwrap_or(false)
    });
    // another sidecar on the same Redis, with the console: it saw none of acme's requests
    let listen = format!("127.0.0.1:{}", free_port());
    let prom_url = prom.url();
    let _other = Sidecar::start(
        &g.redis().url(),
        &[
            ("TOLLGATE_SIDECAR_ADMIN__LISTEN", &listen),
            ("TOLLGATE_SIDECAR_ADMIN__TOKEN", TOKEN),
            ("TOLLGATE_SIDECAR_CONSOLE__ENABLED", "true"),
            ("TOLLGATE_SIDECAR_CONSOLE__PROMETHEUS_URL", &prom_url),
        ],
    );
    let (mut op, _) = ConsoleClient::operator(&format!("http://{listen}"), TOKEN);
    let page = op.get("/console/operator");
    assert!(page.body.contains("From Prometheus"), "{}", page.body);
    assert!(page.body.contains(r#"<th scope="row">acme</th><td>3</td><td>3</td>"#), "acme's 3 allowed requests: {}", page.body);
    drop(prom);
    let page = op.get("/console/operator");
    assert!(page.body.contains("Prometheus did not answer"), "{}", page.body);
    assert!(!page.body.contains(r#"<th scope="row">acme</th>"#), "this sidecar's own counters have none: {}", page.body);
}
