//! Model policy (issue 42 item 4) end to end, all real: Envoy with the filter (both hosts), the
//! sidecar, Redis, tansu, the billing consumer and PostgreSQL, an upstream answering as OpenAI.
//! A model outside a plan's or a key's allow-list is refused with 403 `model_not_allowed` before
//! any upstream call — every time, on a plan whose answers would otherwise be cached by the
//! filter; a request naming no model the gateway can read is 400 `model_required`; per-model
//! requests per minute are exact under concurrency across two replicas, and tokens per minute
//! are reserved and reconciled to the tokens used; an alias reaches the upstream as its real
//! model, rewritten in the body or a Gemini path, and its event names both (decisions 305-310).

use std::time::Duration;
use tollgate_tests::billing::psql_i64;
use tollgate_tests::{poll_until, post, Gateway, Resp};

const ROUTES: &str = "[[routes]]\nid = \"llm\"\ncluster = \"upstream\"\nllm = true\n[routes.match]\npath_prefix = \"/v1\"\n";
const PRICES: &str = "[usage.pricing]\ncurrency = \"USD\"\n[usage.pricing.default]\ninput_per_mtok = 1000000\noutput_per_mtok = 1000000\n";

fn gateway(plans: &str, replicas: usize) -> Gateway {
    crate::llm::metered(&format!("{ROUTES}{plans}"), PRICES).replicas(replicas).build()
}

/// A chat completion asking for `model` (none: the body names no model) allowing `max_tokens`,
/// its body padded to 100 bytes (a reservation of 25 input tokens).
fn chat(url: &str, key: &str, model: Option<&str>, max_tokens: u64) -> Resp {
    let named = model.map(|m| format!(r#""model":"{m}","#)).unwrap_or_default();
    let head = format!(r#"{{{named}"max_tokens":{max_tokens},"messages":[],"pad":""#);
    let body = format!("{head}{}\"}}", "x".repeat(100 - head.len() - 2));
    post(url, &[("x-api-key", key), ("content-type", "application/json"), ("x-echo-llm", "openai"), ("x-echo-llm-model", "gpt-4o-mini-2024-07-18")], &body)
}

/// The status and the error code of an answer (none for a 200).
fn outcome(r: &Resp) -> (u16, Option<String>) {
    (r.status, (r.status != 200).then(|| r.json()["error"].as_str().unwrap_or_default().to_string()))
}

fn refused(code: &str) -> (u16, Option<String>) {
    let status = if code == "model_required" { 400 } else { 403 };
    (status, Some(code.to_string()))
}

#[test]
fn models_outside_the_plans_or_the_keys_list_are_refused_before_the_upstream_every_time() {
    // no limits: without the policy the filter would reuse the first allow for every request
    let g = gateway("[plans.llm]\nmodels = [\"gpt-4o-mini*\", \"claude-3-haiku\"]\n", 1);
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let narrowed = g.sidecar().create_key("acme", "llm", &["--model", "claude*"]);
    let url = g.envoy().url("/v1/chat/completions");
    poll_until("the routing table in the filter", Duration::from_secs(20), || chat(&url, &key.raw, Some("gpt-4o-mini"), 5).status == 200);

    let upstream = || g.upstream().calls();
    for round in 0..5 {
        let before = upstream();
        assert_eq!(outcome(&chat(&url, &key.raw, Some("gpt-4o-mini-2024-07-18"), 5)), (200, None), "round {round}");
        let r = chat(&url, &key.raw, Some("gpt-4o"), 5);
        assert_eq!(outcome(&r), refused("model_not_allowed"), "round {round}: {}", r.body);
        assert!(r.json()["message"].as_str().is_some_and(|m| m.contains("'gpt-4o'")), "the error names the model: {}", r.body);
        assert_eq!(outcome(&chat(&url, &key.raw, None, 5)), refused("model_required"), "round {round}");
        assert_eq!(upstream(), before + 1, "round {round}: only the allowed model reached the upstream");
    }
    // a model the gateway cannot read is none: another content type, a body naming it twice
    let before = upstream();
    let plain = post(&url, &[("x-api-key", &key.raw), ("content-type", "text/plain"), ("x-echo-llm", "openai")], r#"{"model":"gpt-4o-mini"}"#);
    assert_eq!(outcome(&plain), refused("model_required"), "{}", plain.body);
    let twice = post(&url, &[("x-api-key", &key.raw), ("content-type", "application/json"), ("x-echo-llm", "openai")], r#"{"model":"gpt-4o-mini","model":"gpt-4o"}"#);
    assert_eq!(outcome(&twice), refused("model_required"), "{}", twice.body);
    // a Gemini path names its model; a body naming another makes two, which is none
    let gemini = g.envoy().url("/v1/models/claude-3-haiku:generateContent");
    let body = |b: &str| post(&gemini, &[("x-api-key", &key.raw), ("content-type", "application/json"), ("x-echo-llm", "gemini")], b);
    assert_eq!(outcome(&body(r#"{"contents":[]}"#)), (200, None));
    assert_eq!(outcome(&body(r#"{"model":"gpt-4o","contents":[]}"#)), refused("model_required"));
    assert_eq!(upstream(), before + 1);
    // the key narrows its plan: both must allow
    for _ in 0..3 {
        assert_eq!(outcome(&chat(&url, &narrowed.raw, Some("gpt-4o-mini"), 5)), refused("model_not_allowed"));
        assert_eq!(outcome(&chat(&url, &narrowed.raw, Some("claude-3-haiku"), 5)), (200, None));
        assert_eq!(outcome(&chat(&url, &narrowed.raw, Some("claude-3-opus"), 5)), refused("model_not_allowed"), "outside the plan's list");
    }
    assert_eq!(upstream(), before + 4);
}

/// Issue 42 item 4's concurrency check: 40 concurrent calls on two replicas against 10 requests
/// per minute of one model — exactly 10 reach the upstream (one script call decides each, on
/// one Redis); another model of the plan is not counted with it.
#[test]
fn per_model_requests_per_minute_are_exact_across_replicas() {
    const CALLS: usize = 40;
    let plans = "[[plans.llm.model_limits]]\nmodel = \"gpt-4o-mini*\"\nrequests_per_minute = 10\n\
                 [[plans.llm.model_limits]]\nmodel = \"claude*\"\nrequests_per_minute = 1000\n";
    let g = gateway(plans, 2);
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let warm = g.sidecar().create_key("warm", "free", &[]);
    let urls = [g.replica(0).envoy().url("/v1/chat/completions"), g.replica(1).envoy().url("/v1/chat/completions")];
    for url in &urls {
        poll_until("the routing table in the filter", Duration::from_secs(20), || chat(url, &warm.raw, Some("gpt-4o-mini"), 5).status == 200);
    }
    let before = g.upstream().calls() as usize;
    let answers: Vec<Resp> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..CALLS)
            .map(|i| {
                let (url, key) = (&urls[i % 2], key.raw.as_str());
                s.spawn(move || chat(url, key, Some("gpt-4o-mini"), 5))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = answers.iter().filter(|r| r.status == 200).count();
    let limited: Vec<&Resp> = answers.iter().filter(|r| r.status == 429).collect();
    assert_eq!((ok, limited.len()), (10, CALLS - 10), "exactly the model's requests per minute");
    assert_eq!(g.upstream().calls() as usize - before, 10, "the upstream saw only those");
    let r = limited[0];
    assert_eq!((r.json()["error"].as_str(), r.json()["limit"].as_str()), (Some("rate_limited"), Some("gpt-4o-mini_.rpm")), "{}", r.body);
    assert_eq!(r.header("ratelimit-policy"), Some("\"gpt-4o-mini_.rpm\";q=10;w=60"));
    assert!(r.header("retry-after").and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| (1..=60).contains(&s)), "{:?}", r.headers);
    // another model has its own count
    assert_eq!(outcome(&chat(&urls[0], &key.raw, Some("claude-3-haiku"), 5)), (200, None));
    g.redis().assert_ttl_invariant();
}

/// Tokens per minute: a call reserves its input estimate (100 bytes / 4) and its `max_tokens`,
/// is reconciled to the 27 tokens the upstream reports, and one whose reservation does not fit
/// what the minute has left is refused before the upstream.
#[test]
fn per_model_tokens_per_minute_reserve_then_reconcile_to_the_tokens_used() {
    let plans = "[[plans.llm.model_limits]]\nmodel = \"gpt-4o-mini*\"\ntokens_per_minute = 1000\n";
    let g = gateway(plans, 1);
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let warm = g.sidecar().create_key("warm", "free", &[]);
    let url = g.envoy().url("/v1/chat/completions");
    poll_until("the routing table in the filter", Duration::from_secs(20), || chat(&url, &warm.raw, Some("gpt-4o-mini"), 5).status == 200);
    // a minute's counter: the sum of this minute's counters (a test crossing a minute sees two)
    let used = || -> i64 {
        let redis = g.redis();
        redis.keys("q:tpm:{acme}:gpt-4o-mini_.tpm:k.*").iter().map(|k| redis.cmd::<i64>(&["GET", k])).sum()
    };
    // wait for a minute with room for the test (about 10 s of it)
    poll_until("a fresh minute", Duration::from_secs(61), || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() % 60 < 45);
    for n in 1..=3 {
        assert_eq!(outcome(&chat(&url, &key.raw, Some("gpt-4o-mini"), 300)), (200, None));
        poll_until("the call reconciled to the tokens it used", Duration::from_secs(20), || used() == 27 * n);
    }
    // 25 + 950 reserved on top of 81: past 1000, refused before the upstream
    let before = g.upstream().calls();
    let r = chat(&url, &key.raw, Some("gpt-4o-mini"), 950);
    assert_eq!(outcome(&r), (429, Some("rate_limited".into())), "{}", r.body);
    assert_eq!(r.json()["limit"].as_str(), Some("gpt-4o-mini_.tpm"));
    assert_eq!(g.upstream().calls(), before);
    assert_eq!(outcome(&chat(&url, &key.raw, Some("gpt-4o-mini"), 800)), (200, None), "25 + 800 fit");
    poll_until("reconciled", Duration::from_secs(20), || used() == 27 * 4);
    g.redis().assert_ttl_invariant();
}

/// Aliases (decision 309): a client asks for `fast`, the upstream is asked for `gpt-4o-mini` —
/// the body rewritten in place, its `content-length` with it — and the allow-list and the
/// per-model limits judge the real model; a Gemini path's alias is rewritten in the path; the
/// usage event names the alias as asked and the model that answered.
#[test]
fn an_alias_reaches_the_upstream_as_its_real_model_and_the_event_names_both() {
    let plans = "[plans.llm]\nmodels = [\"gpt-4o-mini*\", \"gemini-2.5-flash\"]\n\
                 model_aliases = { fast = \"gpt-4o-mini\", quick = \"gemini-2.5-flash\", big = \"gpt-4o\" }\n\
                 [[plans.llm.model_limits]]\nmodel = \"gpt-4o-mini*\"\nrequests_per_minute = 3\n";
    let g = gateway(plans, 1);
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let warm = g.sidecar().create_key("warm", "free", &[]);
    let url = g.envoy().url("/v1/chat/completions");
    poll_until("the routing table in the filter", Duration::from_secs(20), || chat(&url, &warm.raw, Some("gpt-4o-mini"), 5).status == 200);
    // wait for a minute with room for the test: its limit counts per minute
    poll_until("a fresh minute", Duration::from_secs(61), || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() % 60 < 45);

    let r = chat(&url, &key.raw, Some("fast"), 5);
    assert_eq!(outcome(&r), (200, None), "{}", r.body);
    assert_eq!(r.header("x-echo-request-model"), Some("gpt-4o-mini"), "the upstream was asked for the real model");
    // the real model's limit counts the alias and the model alike: the fourth is refused
    assert_eq!(outcome(&chat(&url, &key.raw, Some("gpt-4o-mini"), 5)), (200, None));
    assert_eq!(outcome(&chat(&url, &key.raw, Some("fast"), 5)), (200, None));
    let before = g.upstream().calls();
    let r = chat(&url, &key.raw, Some("fast"), 5);
    assert_eq!((outcome(&r), r.json()["limit"].as_str()), ((429, Some("rate_limited".into())), Some("gpt-4o-mini_.rpm")), "{}", r.body);
    // an alias of a model outside the list is refused, naming both
    let r = chat(&url, &key.raw, Some("big"), 5);
    assert_eq!(outcome(&r), refused("model_not_allowed"));
    assert!(r.json()["message"].as_str().is_some_and(|m| m.contains("'big'") && m.contains("'gpt-4o'")), "{}", r.body);
    assert_eq!(g.upstream().calls(), before);
    // a Gemini path's alias: the path rewritten, its query kept
    let gemini = g.envoy().url("/v1/models/quick:generateContent?alt=json");
    let headers = [("x-api-key", key.raw.as_str()), ("content-type", "application/json"), ("x-echo-llm", "gemini"), ("x-echo-llm-model", "gemini-2.5-flash-001")];
    let r = post(&gemini, &headers, r#"{"contents":[]}"#);
    assert_eq!(outcome(&r), (200, None), "{}", r.body);
    assert_eq!(r.header("x-echo-path"), Some("/v1/models/gemini-2.5-flash:generateContent"));
    // the events: the alias as asked, the model that answered
    let events = |cond: &str| psql_i64(g.pg(), &format!("SELECT count(*) FROM usage_events WHERE tenant = 'acme' AND status = 200 AND {cond}"));
    poll_until("the calls billed", Duration::from_secs(60), || events("true") == 4);
    assert_eq!(events("requested_model = 'fast' AND model = 'gpt-4o-mini-2024-07-18'"), 2);
    assert_eq!(events("requested_model = 'gpt-4o-mini' AND model = 'gpt-4o-mini-2024-07-18'"), 1);
    assert_eq!(events("requested_model = 'quick' AND model = 'gemini-2.5-flash-001'"), 1);
}
