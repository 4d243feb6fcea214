//! Prices in the configuration plane and invoices over the admin API (issue 42 items 2 and 6,
//! decisions 337–342), all real: Envoy with the filter, two sidecars on PostgreSQL (the
//! configuration source), Redis, tansu, the billing consumer, an upstream answering as OpenAI.
//!
//! A price stored through one replica's admin API prices the usage events the other replica
//! takes and its money budgets' reservations; changed, it prices what is taken after the change
//! and never what was billed before; `*` is the default rates. The invoice the admin API answers
//! is the one `tollgate-billing invoice` prints. Hostile input to `/v1/prices` is refused with
//! 400s naming the field, and a price row written by hand that a sidecar cannot use is reported
//! and left out, the rest in force.
//!
//! The echo upstream answers every OpenAI call with 20 input tokens (16 of them cached) and 7
//! output tokens.

use serde_json::{json, Value};
use std::time::Duration;
use tollgate_tests::billing::{psql, psql_i64};
use tollgate_tests::{admin_call, poll_until, post, Gateway, Resp};

const TOKEN: &str = "test-admin-token-0123456789";

/// The file's prices: gpt-4o-mini's, no default.
const FILE_PRICES: &str = "[usage.pricing]\ncurrency = \"USD\"\n\
    [[usage.pricing.prices]]\nmodel = \"gpt-4o-mini*\"\ninput_per_mtok = 150000\noutput_per_mtok = 600000\ncached_input_per_mtok = 75000\n";

fn admin(method: &str, base: &str, path: &str, body: Option<Value>) -> Resp {
    admin_call(method, base, TOKEN, path, body)
}

/// A chat completion asking for `model`, answered as `answered` by the echo upstream.
fn chat(url: &str, key: &str, model: &str, answered: &str) -> Resp {
    let body = format!(r#"{{"model":"{model}","max_tokens":10,"messages":[]}}"#);
    post(url, &[("x-api-key", key), ("content-type", "application/json"), ("x-echo-llm", "openai"), ("x-echo-llm-model", answered)], &body)
}

/// The micro-units `tenant`'s money budgets hold in Redis.
fn spent(g: &Gateway, tenant: &str) -> i64 {
    let redis = g.redis();
    redis.keys(&format!("q:spend:{{{tenant}}}:*")).iter().map(|k| redis.cmd::<i64>(&["GET", k])).sum()
}

/// Whether `base`'s table in force holds the stored price `id` with input rate `input`.
fn in_force(base: &str, id: &str, input: u64) -> bool {
    let r = admin("GET", base, "/v1/pricing", None);
    r.status == 200 && r.json()["prices"].as_array().is_some_and(|ps| ps.iter().any(|p| p["id"] == id && p["input_per_mtok"] == input))
}

/// The costs billed for `tenant`'s calls answered by `model`, in order.
fn billed(g: &Gateway, tenant: &str, model: &str) -> Vec<String> {
    psql(g.pg(), &format!("SELECT cost_micros FROM usage_events WHERE tenant = '{tenant}' AND model = '{model}' ORDER BY cost_micros")).unwrap_or_default()
}

#[test]
fn a_price_stored_on_one_replica_prices_what_the_other_takes_and_never_past_usage() {
    let mut g = crate::llm::metered("", FILE_PRICES).config_in_postgres().admin_api(TOKEN).replicas(2).build();
    let (a, b) = (g.replica(0).admin().to_string(), g.replica(1).admin().to_string());
    // through replica A: a route, a plan pricing unknown models by the default (there is none
    // yet) and one refusing them, three tenants
    let route = json!({"id": "llm", "cluster": "upstream", "llm": true, "match": {"path_prefix": "/v1"}});
    assert_eq!(admin("POST", &a, "/v1/routes", Some(route)).status, 201);
    let plan = |id: &str, unpriced: &str| json!({"id": id, "limits": [{"name": "month", "algorithm": "spend_budget", "subject": "tenant", "limit": 1_000_000, "unpriced": unpriced}]});
    assert_eq!(admin("POST", &a, "/v1/plans", Some(plan("llm", "default"))).status, 201);
    assert_eq!(admin("POST", &a, "/v1/plans", Some(plan("strict", "refuse"))).status, 201);
    let key = |tenant: &str, plan: &str| {
        assert_eq!(admin("PUT", &a, &format!("/v1/tenants/{tenant}"), Some(json!({"id": tenant}))).status, 200);
        let r = admin("POST", &a, "/v1/keys", Some(json!({"tenant": tenant, "plan": plan})));
        assert_eq!(r.status, 201, "{}", r.body);
        r.json()["key"].as_str().unwrap().to_string()
    };
    let (acme, strict, warm) = (key("acme", "llm"), key("strict", "strict"), key("warm", "llm"));
    let url = g.replica(1).envoy().url("/v1/chat/completions");
    poll_until("the route in replica B's filter", Duration::from_secs(20), || chat(&url, &warm, "gpt-4o-mini", "gpt-4o-mini-2024-07-18").status == 200);

    // no price names qwen or llama and there is no default: both budgets refuse them
    for k in [&acme, &strict] {
        let r = chat(&url, k, "qwen-2", "qwen-2");
        assert_eq!((r.status, r.json()["error"].as_str()), (403, Some("model_not_priced")), "{}", r.body);
    }

    // the default rates (`*`), stored through A, in the deployment's currency
    let any = json!({"id": "any", "model": "*", "input_per_mtok": 1_000_000, "output_per_mtok": 1_000_000});
    let r = admin("PUT", &a, "/v1/prices/any", Some(any));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["currency"], "USD");
    poll_until("replica B has the default", Duration::from_secs(10), || in_force(&b, "any", 1_000_000));
    // B's money budget reserves at it, B's intake bills at it: 20 + 7 at 1 per token = 27
    let r = chat(&url, &acme, "qwen-2", "qwen-2");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = chat(&url, &strict, "llama-3", "llama-3-70b");
    assert_eq!((r.status, r.json()["error"].as_str()), (403, Some("model_not_priced")), "a budget refusing unpriced models ignores the default");

    // llama's own price, through A: B's refusing budget now admits it; 4 × 1 + 16 × 0.5 + 7 × 2 = 26
    let llama = |input: u64| json!({"id": "llama", "model": "llama-3*", "provider": "meta", "input_per_mtok": input, "output_per_mtok": 2 * input, "cached_input_per_mtok": input / 2});
    assert_eq!(admin("POST", &a, "/v1/prices", Some(llama(1_000_000))).status, 201);
    poll_until("replica B has llama's price", Duration::from_secs(10), || in_force(&b, "llama", 1_000_000));
    let r = chat(&url, &strict, "llama-3", "llama-3-70b");
    assert_eq!(r.status, 200, "{}", r.body);
    poll_until("settled at llama's price on B", Duration::from_secs(20), || spent(&g, "strict") == 26);
    poll_until("billed at llama's price", Duration::from_secs(60), || billed(&g, "strict", "llama-3-70b") == ["26"]);

    // the price doubled: what B takes now costs 52, what was billed stays 26
    assert_eq!(admin("PUT", &a, "/v1/prices/llama", Some(llama(2_000_000))).status, 200);
    poll_until("replica B has the new price", Duration::from_secs(10), || in_force(&b, "llama", 2_000_000));
    assert_eq!(chat(&url, &strict, "llama-3", "llama-3-70b").status, 200);
    poll_until("billed at each call's price", Duration::from_secs(60), || billed(&g, "strict", "llama-3-70b") == ["26", "52"]);
    poll_until("the budget charged each call its price", Duration::from_secs(20), || spent(&g, "strict") == 78);
    poll_until("billed at the default", Duration::from_secs(60), || billed(&g, "acme", "qwen-2") == ["27"]);
    // the table in force on B: the file's price and the two stored ones
    let table = admin("GET", &b, "/v1/pricing", None).json();
    let sources: Vec<(String, String)> =
        table["prices"].as_array().unwrap().iter().map(|p| (p["model"].as_str().unwrap().into(), p["source"].as_str().unwrap().into())).collect();
    assert_eq!(sources, [("gpt-4o-mini*".into(), "file".into()), ("*".into(), "stored".into()), ("llama-3*".into(), "stored".into())], "{table}");

    // the invoice over B's admin API is the billing CLI's, to the micro-unit
    let month = psql(g.pg(), "SELECT DISTINCT to_char(day, 'YYYY-MM') FROM usage_events WHERE tenant = 'strict'").unwrap();
    assert_eq!(month.len(), 1, "{month:?}");
    let month = &month[0];
    poll_until("the rollup by model", Duration::from_secs(60), || {
        psql_i64(g.pg(), "SELECT coalesce(sum(cost_micros), 0) FROM usage_daily_models WHERE tenant = 'strict'") == 78
    });
    let api = admin("GET", &b, &format!("/v1/invoices?tenant=strict&month={month}"), None);
    assert_eq!(api.status, 200, "{}", api.body);
    let inv = api.json();
    assert_eq!((inv["currency"].as_str(), inv["totalCostMicros"].as_i64(), inv["totalCost"].as_str()), (Some("USD"), Some(78), Some("0.000078")), "{inv}");
    assert_eq!(inv["lines"][0]["model"], "llama-3-70b");
    assert_eq!((inv["lines"][0]["requests"].as_i64(), inv["lines"][0]["inputTokens"].as_i64()), (Some(2), Some(40)));
    let mut cli = |format: &str| {
        let out = g.billing_mut().cli(&["invoice", "--tenant", "strict", "--month", month, "--format", format]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(serde_json::from_str::<Value>(&cli("json")).unwrap(), inv, "the same invoice as `tollgate-billing invoice`");
    let csv = admin("GET", &b, &format!("/v1/invoices?tenant=strict&month={month}&format=csv"), None);
    assert_eq!((csv.status, csv.header("content-type")), (200, Some("text/csv; charset=utf-8")));
    assert_eq!(csv.body, cli("csv"));
    // a bad query is 400 naming it; the billing database gone is 503, said so
    let r = admin("GET", &b, "/v1/invoices?tenant=strict&month=2026-13", None);
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("month")));
    g.pg_mut().stop();
    let r = admin("GET", &b, &format!("/v1/invoices?tenant=strict&month={month}"), None);
    assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("billing_unavailable")), "{}", r.body);
}

/// Hostile input to `/v1/prices`: each refused with a 400 (413 past the size bound) naming the
/// field, nothing stored. Then rows written by hand that this sidecar cannot use — a rate with a
/// fraction, another currency, a second price of one model from one moment — are reported and
/// left out, the rest in force, and each can be deleted.
#[test]
fn hostile_prices_are_refused_and_an_unusable_row_is_reported_and_skipped() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).without_envoy().build();
    let base = g.replica(0).admin().to_string();
    let ok = json!({"id": "mini", "model": "gpt-4o-mini*", "input_per_mtok": 150_000, "output_per_mtok": 600_000, "effective_from": "2026-03-01"});
    let with = |k: &str, v: Value| {
        let mut p = ok.clone();
        p[k] = v;
        p
    };
    let cases = [
        (with("input_per_mtok", json!(0.15)), "input_per_mtok"),
        (with("output_per_mtok", json!(-1)), "output_per_mtok"),
        (with("input_per_mtok", json!((1u64 << 53) + 1)), "input_per_mtok"),
        (with("input_per_mtok", json!(1e20)), "input_per_mtok"),
        (with("cached_input_per_mtok", json!("75000")), "cached_input_per_mtok"),
        (with("rate", json!(1)), "rate"),
        (with("currency", json!("EUR")), "currency"),
        (with("model", json!("gpt 4o")), "prices.mini.model"),
        (with("effective_from", json!("next tuesday")), "prices.mini.effective_from"),
        (with("provider", json!("x".repeat(65))), "prices.mini.provider"),
        (with("provider", json!("a\u{0}b")), "prices.mini.provider"),
        (with("id", json!("a b")), "id"),
    ];
    for (body, field) in cases {
        let r = admin("POST", &base, "/v1/prices", Some(body.clone()));
        assert_eq!((r.status, r.json()["error"].as_str(), r.json()["field"].as_str()), (400, Some("invalid"), Some(field)), "{body}: {}", r.body);
        assert!(!r.json()["message"].as_str().unwrap_or("").is_empty());
    }
    // a body past the bound, one that is not UTF-8, one that is not an object
    let port: u16 = base.rsplit(':').next().unwrap().parse().unwrap();
    let raw = |body: &[u8]| {
        let mut req = format!(
            "POST /v1/prices HTTP/1.1\r\nhost: admin\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        let r = tollgate_tests::raw::send(port, &req);
        (r.status, serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null))
    };
    let huge = with("provider", json!("x".repeat(70_000))).to_string();
    assert_eq!(raw(huge.as_bytes()).0, 413);
    let (status, body) = raw(b"{\"id\": \"m\xff\xfe\", \"model\": \"m\", \"input_per_mtok\": 1, \"output_per_mtok\": 1}");
    assert_eq!((status, body["field"].as_str()), (400, Some("body")), "{body}");
    assert_eq!(raw(b"[1, 2]").0, 400);
    assert_eq!(admin("GET", &base, "/v1/prices", None).json(), json!([]), "nothing stored");

    // a good one: stored in the deployment's currency, its moment in one spelling
    let r = admin("POST", &base, "/v1/prices", Some(ok.clone()));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!((r.json()["currency"].as_str(), r.json()["effective_from"].as_str()), (Some("USD"), Some("2026-03-01T00:00:00Z")));
    let twice = json!({"id": "mini2", "model": "gpt-4o-mini*", "input_per_mtok": 1, "output_per_mtok": 1, "effective_from": "2026-03-01T00:00:00Z"});
    let r = admin("POST", &base, "/v1/prices", Some(twice));
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("prices.mini2.effective_from")), "{}", r.body);

    // rows by hand: a fraction, another currency, a duplicate of mini's model and moment
    let row = |id: &str, doc: &str| assert!(psql(g.pg(), &format!("INSERT INTO prices (id, doc) VALUES ('{id}', '{doc}'::jsonb)")).is_some(), "{id}");
    row("fraction", r#"{"id": "fraction", "model": "m", "input_per_mtok": 1.5, "output_per_mtok": 1}"#);
    row("euro", r#"{"id": "euro", "model": "e", "input_per_mtok": 1, "output_per_mtok": 1, "currency": "EUR"}"#);
    row("same", r#"{"id": "same", "model": "gpt-4o-mini*", "input_per_mtok": 1, "output_per_mtok": 1, "effective_from": "2026-03-01T00:00:00Z"}"#);
    // any write reads them (and every replica's reload): the other prices go on in force
    assert_eq!(admin("PUT", &base, "/v1/prices/other", Some(json!({"model": "o", "input_per_mtok": 1, "output_per_mtok": 1}))).status, 200);
    let unusable = || {
        let v = admin("GET", &base, "/v1/version", None).json();
        v["unusable"].as_array().unwrap().iter().map(|u| (u["kind"].as_str().unwrap().to_string(), u["id"].as_str().unwrap().to_string())).collect::<Vec<_>>()
    };
    let p = |id: &str| ("prices".to_string(), id.to_string());
    assert_eq!(unusable(), [p("euro"), p("fraction"), p("same")]);
    let v = admin("GET", &base, "/v1/version", None).json();
    let reason = |id: &str| v["unusable"].as_array().unwrap().iter().find(|u| u["id"] == id).unwrap()["reason"].as_str().unwrap().to_string();
    assert!(reason("euro").contains("EUR") && reason("euro").contains("USD"), "{}", reason("euro"));
    assert!(reason("fraction").contains("u64"), "{}", reason("fraction"));
    assert!(reason("same").contains("'mini'"), "{}", reason("same"));
    let in_force: Vec<String> = admin("GET", &base, "/v1/pricing", None).json()["prices"].as_array().unwrap().iter().map(|p| p["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(in_force, ["mini", "other"]);
    // each can be deleted; the report empties
    for id in ["fraction", "euro", "same"] {
        assert_eq!(admin("DELETE", &base, &format!("/v1/prices/{id}"), None).status, 200, "{id}");
    }
    assert_eq!(unusable(), Vec::<(String, String)>::new());

    // the CLI: set, list (the table in force, with each price's source), refuse a fraction, delete
    let cli = |args: &[&str]| {
        std::process::Command::new(tollgate_tests::process::native_bin("TOLLGATE_CLI", "tollgate"))
            .env("TOLLGATE_ADMIN_URL", &base)
            .env("TOLLGATE_ADMIN_TOKEN", TOKEN)
            .args(args)
            .output()
            .expect("run tollgate")
    };
    let out = cli(&["prices", "set", "sonnet", "--model", "claude-sonnet-4*", "--input", "3000000", "--output", "15000000", "--from", "2026-01-01"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed = String::from_utf8(cli(&["prices", "list"]).stdout).unwrap();
    assert!(listed.starts_with("currency USD"), "{listed}");
    let row = listed.lines().find(|l| l.starts_with("sonnet")).unwrap_or_else(|| panic!("{listed}"));
    assert!(row.contains("claude-sonnet-4*") && row.contains("3000000") && row.contains("2026-01-01T00:00:00Z") && row.ends_with("stored"), "{row}");
    let out = cli(&["prices", "set", "half", "--model", "m", "--input", "0.5", "--output", "1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("0.5"), "a fraction is refused before any call");
    assert!(cli(&["prices", "delete", "sonnet"]).status.success());
    assert_eq!(admin("GET", &base, "/v1/prices/sonnet", None).status, 404);
}

/// With the file source the prices are the file's: `/v1/prices` is read-only (409), and an
/// invoice with no billing database configured is 503, said so.
#[test]
fn the_file_source_reads_prices_and_an_invoice_needs_a_billing_database() {
    let g = Gateway::builder()
        .sidecar_toml(&format!("{FILE_PRICES}[usage.pricing.default]\ninput_per_mtok = 5\noutput_per_mtok = 5\n"))
        .admin_api(TOKEN)
        .without_envoy()
        .build();
    let base = g.replica(0).admin();
    let r = admin("PUT", base, "/v1/prices/x", Some(json!({"model": "m", "input_per_mtok": 1, "output_per_mtok": 1})));
    assert_eq!((r.status, r.json()["error"].as_str()), (409, Some("read_only_source")), "{}", r.body);
    let table = admin("GET", base, "/v1/pricing", None).json();
    let models: Vec<&str> = table["prices"].as_array().unwrap().iter().map(|p| p["model"].as_str().unwrap()).collect();
    assert_eq!((table["currency"].as_str(), models), (Some("USD"), vec!["*", "gpt-4o-mini*"]), "{table}");
    let r = admin("GET", base, "/v1/invoices?tenant=acme&month=2026-01", None);
    assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("billing_unavailable")), "{}", r.body);
    assert!(r.json()["message"].as_str().unwrap().contains("admin.billing_url"), "{}", r.body);
    let r = admin("GET", base, "/v1/invoices?tenant=a%20b&month=2026-01", None);
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("tenant")));
}
