//! LLM calls' facts end to end (issue 42, item 1), all real: Envoy with the filter, the sidecar,
//! Redis, tansu, the billing consumer and PostgreSQL, an upstream answering as OpenAI (JSON and
//! an event stream with `include_usage`), Anthropic (JSON, and a stream long enough that its
//! `message_start` is dropped from what the filter keeps) and Gemini. On a route marked `llm`
//! each request's event carries the model asked for, the model that answered and the tokens
//! apart, and the billing rollup has them per model; a route not marked carries none.

use serde_json::json;
use std::time::Duration;
use tollgate_tests::billing::{psql, psql_i64};
use tollgate_tests::{poll_until, post, Gateway};

const ROUTES: &str = "[[routes]]\nid = \"llm\"\ncluster = \"upstream\"\nllm = true\n[routes.match]\npath_prefix = \"/v1\"\n\
                      [[routes]]\nid = \"plain\"\ncluster = \"upstream\"\n[routes.match]\npath_prefix = \"/plain\"\n";

/// USD micro-units per million tokens: dated OpenAI versions by prefix, Anthropic's price of today
/// and a later one (not yet in effect), every other model at the default rates.
const PRICES: &str = "[usage.pricing]\ncurrency = \"USD\"\n\
    [usage.pricing.default]\ninput_per_mtok = 1000000\noutput_per_mtok = 1000000\n\
    [[usage.pricing.prices]]\nmodel = \"gpt-4o-mini*\"\ninput_per_mtok = 150000\noutput_per_mtok = 600000\ncached_input_per_mtok = 75000\n\
    [[usage.pricing.prices]]\nmodel = \"claude-sonnet-4*\"\ninput_per_mtok = 3000000\noutput_per_mtok = 15000000\ncached_input_per_mtok = 300000\n\
    [[usage.pricing.prices]]\nmodel = \"claude-sonnet-4*\"\ninput_per_mtok = 30000000\noutput_per_mtok = 150000000\neffective_from = \"2099-01-01\"\n";

fn gateway() -> Gateway {
    metered(&format!("{ROUTES}[[plans.llm.limits]]\nname = \"month\"\nalgorithm = \"token_budget\"\nlimit = 1000000\nestimate = 400\n"), PRICES).build()
}

/// A gateway whose sidecars take `config` (routes, plans) and price LLM calls at `prices`, its
/// filter metering usage and matching routes, its usage shipped to Kafka and billed (the LLM
/// areas' common set-up: llm, spend, openai_client).
pub(crate) fn metered(config: &str, prices: &str) -> tollgate_tests::GatewayBuilder {
    Gateway::builder()
        .sidecar_toml(&format!(
            "{config}[usage]\nenabled = true\nspool_dir = \"${{SPOOL_DIR}}\"\nsegment_age = \"50ms\"\n{prices}\
             [usage.kafka]\nbrokers = \"${{BROKERS}}\"\ntopic = \"usage_events\"\npartitions = 2\ndelivery_timeout = \"3s\"\n"
        ))
        .plugin(json!({
            "sidecar": {"timeout": "2s"},
            "usage": {"enabled": true, "flushInterval": "100ms"},
            "routing": {"enabled": true, "refreshInterval": "50ms"},
        }))
        .billing("usage_events", "billing")
}

/// `(model, requests, input, output, cached, tokens, cost)` of acme's rows in `usage_daily_models`.
fn by_model(g: &Gateway) -> Vec<String> {
    psql(
        g.pg(),
        "SELECT model, sum(requests), sum(input_tokens), sum(output_tokens), sum(cached_tokens), sum(tokens), sum(cost_micros) \
         FROM usage_daily_models WHERE tenant = 'acme' GROUP BY model ORDER BY model",
    )
    .unwrap_or_default()
}

#[test]
fn llm_routes_bill_models_and_tokens_apart() {
    let mut g = gateway();
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let warm = g.sidecar().create_key("warmup", "llm", &[]);
    let call = |key: &str, path: &str, body: &str, shape: &str, model: &str| {
        post(&g.envoy().url(path), &[("x-api-key", key), ("content-type", "application/json"), ("x-echo-llm", shape), ("x-echo-llm-model", model)], body)
    };
    // the routing table reaches the filter: until then a request finds no route
    poll_until("the routing table in the filter", Duration::from_secs(20), || {
        call(&warm.raw, "/v1/chat/completions", "{}", "openai", "w").status == 200
    });

    let chat = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;
    let r = call(&key.raw, "/v1/chat/completions", chat, "openai", "gpt-4o-mini-2024-07-18");
    assert_eq!(r.status, 200, "{}", r.body);
    let streamed = r#"{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#;
    let r = call(&key.raw, "/v1/chat/completions", streamed, "openai-sse", "gpt-4o-mini-2024-07-18");
    assert!(r.status == 200 && r.body.ends_with("data: [DONE]\n\n"), "{} {}", r.status, r.body);
    let r = call(&key.raw, "/v1/messages", r#"{"model":"claude-sonnet-4","max_tokens":100,"messages":[]}"#, "anthropic", "claude-sonnet-4-20250514");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = call(&key.raw, "/v1/messages", r#"{"model":"claude-sonnet-4","stream":true,"messages":[]}"#, "anthropic-sse", "claude-sonnet-4-20250514");
    assert!(r.status == 200 && r.body.len() > 128 << 10, "a stream longer than the filter's 64 KiB tail: {}", r.body.len());
    let r = call(&key.raw, "/v1beta/models/gemini-2.5-flash:generateContent", r#"{"contents":[]}"#, "gemini", "gemini-2.5-flash-001");
    assert_eq!(r.status, 200, "{}", r.body);
    // a client's model that is no model name: left out, the request metered all the same
    let r = call(&key.raw, "/v1/chat/completions", "{\"model\":\"a b\\u0000c\"}", "openai", "gpt-4o");
    assert_eq!(r.status, 200, "{}", r.body);
    // a route not marked llm: the same answer carries no LLM facts (its total is read as ever)
    let r = call(&key.raw, "/plain/chat", chat, "openai", "gpt-4o-mini-2024-07-18");
    assert_eq!(r.status, 200, "{}", r.body);

    // costs in micro-USD: claude 105 × 3 + 1000 × 0.3 + 12 × 15 (795), then 15 out (840), today's
    // price not the later one; gpt-4o-mini 4 × 0.15 + 16 × 0.075 + 7 × 0.6 = 6 each; the
    // others at the default 1 per token
    let want = [
        "claude-sonnet-4-20250514|2|2210|27|2000|2237|1635", // 1105 in (5 + 100 written + 1000 read), 12 and 15 out
        "gemini-2.5-flash-001|1|11|8|4|19|19",               // 5 candidates + 3 thoughts out
        "gpt-4o|1|20|7|16|27|27",
        "gpt-4o-mini-2024-07-18|2|40|14|32|54|12",
    ];
    poll_until("the rollup by model", Duration::from_secs(60), || by_model(&g) == want);
    // every request once, the plain route's without facts, the hostile model left out
    let events = |cond: &str| psql_i64(g.pg(), &format!("SELECT count(*) FROM usage_events WHERE tenant = 'acme' AND {cond}"));
    assert_eq!(events("true"), 7);
    assert_eq!(events("path = '/plain/chat' AND model IS NULL AND requested_model IS NULL AND tokens = 27"), 1);
    assert_eq!(events("requested_model = 'gpt-4o-mini' AND model = 'gpt-4o-mini-2024-07-18'"), 2);
    assert_eq!(events("requested_model = 'claude-sonnet-4'"), 2);
    assert_eq!(events("requested_model = 'gemini-2.5-flash' AND path LIKE '/v1beta/models/%'"), 1, "the model named by the path");
    assert_eq!(events("model = 'gpt-4o' AND requested_model IS NULL"), 1);
    // each event carries its own cost (a later price never re-prices it)
    assert_eq!(events("cost_micros = 840 AND model = 'claude-sonnet-4-20250514'"), 1);
    // the token budget was charged the totals Anthropic and Gemini report only in parts
    assert_eq!(psql_i64(g.pg(), "SELECT sum(tokens) FROM usage_daily WHERE tenant = 'acme'"), 54 + 2237 + 19 + 27 + 27);
    assert_eq!(psql_i64(g.pg(), "SELECT count(*) FROM usage_events WHERE tenant = 'acme' AND tokens_unread"), 0);
    // the month's report says the same per model
    let out = g.billing_mut().cli(&["usage", "--tenant", "acme"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    let line = |model: &str| text.lines().find(|l| l.starts_with(model)).map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "));
    assert_eq!(line("claude-sonnet-4-20250514").as_deref(), Some("2 2210 27 2000 2237 0.001635"), "{text}");
    assert_eq!(line("gemini-2.5-flash-001").as_deref(), Some("1 11 8 4 19 0.000019"), "{text}");
}

/// Decision 294: a request the auth cache lets through at once is not held for its body; its
/// model is read from the body as Envoy streams it past (a plan without limits: its allows are
/// cached). Every request's event names the model asked for, the cached ones' too.
#[test]
fn the_model_of_a_request_the_auth_cache_answers_is_read_as_its_body_passes() {
    let g = gateway();
    let key = g.sidecar().create_key("cachey", "free", &[]);
    let call = || {
        post(
            &g.envoy().url("/v1/chat/completions"),
            &[("x-api-key", key.raw.as_str()), ("content-type", "application/json"), ("x-echo-llm", "openai"), ("x-echo-llm-model", "m-1")],
            r#"{"model":"gpt-4o-mini","messages":[]}"#,
        )
    };
    poll_until("the routing table in the filter", Duration::from_secs(20), || call().status == 200);
    let hits = g.envoy().counter("wasmcustom.tollgate.auth_cache.hits");
    for _ in 0..5 {
        assert_eq!(call().status, 200);
    }
    poll_until("the auth cache answered", Duration::from_secs(10), || g.envoy().counter("wasmcustom.tollgate.auth_cache.hits") > hits);
    // a body that comes after its headers went upstream: read as it passes all the same
    let body = r#"{"model":"gpt-4o-mini","messages":[]}"#;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n\
         x-api-key: {}\r\ncontent-type: application/json\r\nx-echo-llm: openai\r\nx-echo-llm-model: m-1\r\n\r\n",
        body.len(),
        key.raw
    );
    let upstream_calls = g.upstream().calls();
    let sent = tollgate_tests::raw::send_split(
        g.envoy().port,
        head.as_bytes(),
        || poll_until("the headers let through to the upstream", Duration::from_secs(20), || g.upstream().calls() > upstream_calls),
        body.as_bytes(),
    );
    assert_eq!(sent.status, 200, "{}", String::from_utf8_lossy(&sent.body));
    let count = |cond: &str| psql_i64(g.pg(), &format!("SELECT count(*) FROM usage_events WHERE tenant = 'cachey' AND {cond}"));
    poll_until("every event billed", Duration::from_secs(60), || count("path = '/v1/chat/completions'") >= 7);
    let all = count("path = '/v1/chat/completions'");
    assert_eq!(count("requested_model = 'gpt-4o-mini' AND model = 'm-1'"), all, "every request names its model");
}
