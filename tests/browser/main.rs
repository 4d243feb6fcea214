//! The console in a real browser (issue 43): a headless Chromium driven over WebDriver by its
//! own chromedriver (tollgate_tests::webdriver), against a real gateway — Envoy, sidecar with its
//! console, Redis, PostgreSQL (configuration and the billing rollup), the broker and the billing
//! consumer. The flow of issue 43: an operator makes a tenant, a plan, a key and a tenant user in
//! the console; the tenant signs in, sees only its keys, rotates one (old and new both pass
//! through Envoy during the overlap, the old one fails after it), and finds its traffic in the
//! usage chart. Its own test binary and its own tier of `./build.sh test` (tier 7): it needs the
//! Debian packages `chromium` and `chromium-driver`.
//!
//! Each page the flow reaches is written as a PNG to `target/console-screenshots/` (docs/console.md
//! shows them, copied to docs/console/).

use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use tollgate_tests::webdriver::{Browser, Chromedriver};
use tollgate_tests::{admin_call, get, poll_until, root, Gateway};

const TOKEN: &str = "browser-admin-token-0123456789";
const PASSWORD: &str = "a long passphrase 1";

fn shot(b: &Browser, name: &str) {
    let path: PathBuf = root().join("target/console-screenshots").join(format!("{name}.png"));
    b.screenshot(&path);
    assert!(std::fs::metadata(&path).map(|m| m.len() > 1000).unwrap_or(false), "{name}: no screenshot");
}

fn gateway() -> Gateway {
    Gateway::builder()
        .sidecar_toml(
            "[usage]\nenabled = true\nspool_dir = \"${SPOOL_DIR}\"\nsegment_age = \"50ms\"\n\
             [usage.kafka]\nbrokers = \"${BROKERS}\"\ntopic = \"usage_events\"\npartitions = 1\ndelivery_timeout = \"3s\"\n",
        )
        .plugin(json!({"sidecar": {"timeout": "2s"}, "usage": {"enabled": true, "flushInterval": "100ms"}}))
        .billing("usage_events", "billing")
        .config_in_postgres()
        .admin_api(TOKEN)
        .console()
        .build()
}

#[test]
fn an_operator_and_a_tenant_use_the_console_in_chromium() {
    let g = gateway();
    let base = g.replica(0).admin().to_string();
    let driver = Chromedriver::start();
    let b = Browser::start(&driver, 1280, 1000);

    // the operator signs in with the admin token
    b.goto(&format!("{base}/console"));
    b.find("#token");
    shot(&b, "01-signin");
    b.find("#token").fill(TOKEN);
    b.find("#operator-signin").click();
    b.wait_for_text("Connections");
    shot(&b, "02-operator-overview");

    // a tenant and a plan, created in the console's forms (the API's JSON)
    b.goto(&format!("{base}/console/operator/tenants"));
    b.find("#json").fill(r#"{"id": "acme", "name": "Acme Corp", "products": []}"#);
    b.find("#save").click();
    b.wait_for_text("Created tenant 'acme'");
    // a refusal shows the API's own error, and keeps what was typed
    b.find("#json").fill(r#"{"id": "acme"}"#);
    b.find("#save").click();
    b.wait_for_text("exists; use PUT to replace it");
    shot(&b, "03-tenants");
    b.goto(&format!("{base}/console/operator/plans"));
    b.find("#json").fill(r#"{"id": "starter", "limits": [{"name": "per_minute", "algorithm": "fixed_window", "subject": "key", "limit": 100, "window": "1m"}]}"#);
    b.find("#save").click();
    b.wait_for_text("Created plan 'starter'");
    shot(&b, "04-plans");
    assert!(admin_call("GET", &base, TOKEN, "/v1/plans/starter", None).status == 200, "the plan is in force");

    // a key for acme, its raw value shown once
    b.goto(&format!("{base}/console/operator/keys"));
    b.find("#tenant").fill("acme");
    b.find("#plan").fill("starter");
    b.find("#issue").click();
    let operator_key = b.find("#rawkey").value();
    assert!(operator_key.starts_with("tg_"), "{operator_key}");
    let operator_key_id = b.find("#newkeyid").text();
    shot(&b, "05-key-issued");
    assert_eq!(get(&g.envoy().url("/v1/items"), &[("x-api-key", &operator_key)]).status, 200, "the key passes through Envoy");

    // a tenant user for acme, and a key of another tenant the user must never see
    assert_eq!(admin_call("POST", &base, TOKEN, "/v1/tenants", Some(json!({"id": "beta"}))).status, 201);
    let beta = admin_call("POST", &base, TOKEN, "/v1/keys", Some(json!({"tenant": "beta", "plan": "starter"})));
    let beta_key_id = beta.json()["key_id"].as_str().unwrap().to_string();
    b.goto(&format!("{base}/console/operator/users?tenant=acme"));
    b.find("#u-login").fill("ana@acme.io");
    b.find("#u-name").fill("Ana");
    b.find("#u-plan").fill("starter");
    b.find("#u-password").fill(PASSWORD);
    b.find("#create-user").click();
    b.wait_for_text("Created user ana@acme.io");
    shot(&b, "06-users");
    b.goto(&format!("{base}/console/operator/keys"));
    b.wait_for_text(&beta_key_id);
    shot(&b, "07-operator-keys");
    b.find("form.signout button").click();
    b.find("#login");

    // the tenant signs in and sees acme's keys alone
    b.find("#login").fill("ana@acme.io");
    b.find("#password").fill(PASSWORD);
    b.find("#tenant-signin").click();
    b.wait_for_text("Your API keys");
    let portal = b.source();
    assert!(portal.contains(&operator_key_id) && !portal.contains(&beta_key_id), "acme's keys alone");
    assert!(portal.contains("per_minute"), "the plan's limits are shown");
    b.find("#new-key").click();
    let tenant_key = b.find("#rawkey").value();
    assert!(tenant_key.starts_with("tg_"));
    let tenant_key_id = b.find("#newkeyid").text();
    shot(&b, "08-portal-key-issued");

    // traffic through Envoy with the tenant's key, then usage in the chart
    for _ in 0..6 {
        assert_eq!(get(&g.envoy().url("/v1/items"), &[("x-api-key", &tenant_key)]).status, 200);
    }
    b.goto(&format!("{base}/console/portal"));
    b.wait_for_text(&tenant_key_id);
    shot(&b, "09-portal");
    poll_until("the tenant's usage in the chart", Duration::from_secs(90), || {
        b.goto(&format!("{base}/console/portal/usage"));
        let page = b.source();
        page.contains("<svg") && page.contains(&tenant_key_id)
    });
    assert!(!b.source().contains(&beta_key_id));
    shot(&b, "10-usage");

    // rotate the tenant's key with a 30 s overlap: old and new both pass, then the old one fails
    b.goto(&format!("{base}/console/portal"));
    b.find(&format!("#overlap-{tenant_key_id}")).fill("30s");
    b.find(&format!("button[aria-label='Rotate {tenant_key_id}']")).click();
    let successor = b.find("#rawkey").value();
    let successor_id = b.find("#newkeyid").text();
    assert!(successor.starts_with("tg_") && successor_id != tenant_key_id);
    b.wait_for_text(&format!("It replaces {tenant_key_id}"));
    shot(&b, "11-key-rotated");
    let status = |key: &str| get(&g.envoy().url("/v1/items"), &[("x-api-key", key)]).status;
    assert_eq!(status(&tenant_key), 200, "the old key passes during the overlap");
    assert_eq!(status(&successor), 200, "the successor passes at once");
    poll_until("the old key refused after the overlap", Duration::from_secs(120), || status(&tenant_key) == 401);
    assert_eq!(status(&successor), 200, "the successor still passes");

    // revoke the operator's key from the portal: Envoy refuses it from then on
    b.goto(&format!("{base}/console/portal"));
    b.find(&format!("button[aria-label='Revoke {operator_key_id}']")).click();
    b.wait_for_text(&format!("Revoked {operator_key_id}"));
    poll_until("the revoked key refused through Envoy", Duration::from_secs(30), || {
        get(&g.envoy().url("/v1/items"), &[("x-api-key", &operator_key)]).status == 401
    });
    assert_eq!(status(&successor), 200, "the tenant's key still passes");

    // a phone-width window: the same portal, one column
    b.set_window(390, 844);
    b.goto(&format!("{base}/console/portal"));
    b.wait_for_text("Your API keys");
    shot(&b, "12-portal-phone");
}
