//! Money budgets (`spend_budget`, issue 42 item 3) end to end, all real: Envoy with the filter,
//! the sidecar, Redis, tansu, the billing consumer and PostgreSQL, an upstream answering as
//! OpenAI. A call reserves the most it can cost (its body's bytes / 4 in, its `max_tokens`
//! out, at its model's price), is settled at its real cost when its usage is read, and is
//! refused with 429 `budget_exhausted` when the budget cannot cover its reservation; a model
//! without a price is refused with 403 `model_not_priced` where the budget says so.
//!
//! The echo upstream answers every OpenAI call with 20 input tokens (16 of them cached) and 7
//! output tokens: at gpt-4o-mini's prices (0.15 / 0.075 / 0.60 USD per million) a call costs
//! 4 × 0.15 + 16 × 0.075 + 7 × 0.6 = 6 micro-USD.

use std::time::Duration;
use tollgate_tests::billing::psql_i64;
use tollgate_tests::{poll_until, post, Gateway, Resp};

const ROUTES: &str = "[[routes]]\nid = \"llm\"\ncluster = \"upstream\"\nllm = true\n[routes.match]\npath_prefix = \"/v1\"\n";
const PRICES: &str = "[usage.pricing]\ncurrency = \"USD\"\n\
    [usage.pricing.default]\ninput_per_mtok = 1000000\noutput_per_mtok = 1000000\n\
    [[usage.pricing.prices]]\nmodel = \"gpt-4o-mini*\"\ninput_per_mtok = 150000\noutput_per_mtok = 600000\ncached_input_per_mtok = 75000\n";
/// What one call costs (see the module's docs).
const REAL: i64 = 6;

fn gateway(plans: &str, replicas: usize) -> Gateway {
    crate::llm::metered(&format!("{ROUTES}{plans}"), PRICES).replicas(replicas).build()
}

/// A chat completion of `model` allowing `max_tokens`, its body padded to 100 bytes: reserved
/// for 25 input tokens.
fn chat(url: &str, key: &str, model: &str, max_tokens: u64) -> Resp {
    let head = format!(r#"{{"model":"{model}","max_tokens":{max_tokens},"messages":[],"pad":""#);
    let body = format!("{head}{}\"}}", "x".repeat(100 - head.len() - 2));
    assert_eq!(body.len(), 100);
    post(url, &[("x-api-key", key), ("content-type", "application/json"), ("x-echo-llm", "openai"), ("x-echo-llm-model", "gpt-4o-mini-2024-07-18")], &body)
}

/// The micro-units `tenant`'s money budgets hold in Redis (every period's counter).
fn spent(g: &Gateway, tenant: &str) -> i64 {
    let redis = g.redis();
    redis.keys(&format!("q:spend:{{{tenant}}}:*")).iter().map(|k| redis.cmd::<i64>(&["GET", k])).sum()
}

#[test]
fn a_spend_budget_reserves_the_most_a_call_can_cost_and_settles_at_its_real_cost() {
    let plans = "[[plans.llm.limits]]\nname = \"month\"\nalgorithm = \"spend_budget\"\nsubject = \"tenant\"\nlimit = 100\nmax_output_tokens = 50\n\
                 [[plans.strict.limits]]\nname = \"day\"\nalgorithm = \"spend_budget\"\nperiod = \"day\"\nlimit = 1000000\nunpriced = \"refuse\"\n";
    let g = gateway(plans, 1);
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let strict = g.sidecar().create_key("strict", "strict", &[]);
    let url = g.envoy().url("/v1/chat/completions");
    poll_until("the routing table in the filter", Duration::from_secs(20), || chat(&url, &strict.raw, "gpt-4o-mini", 7).status == 200);

    // reserved 25 × 0.15 + 7 × 0.6 = 8, settled at 6
    let r = chat(&url, &key.raw, "gpt-4o-mini", 7);
    assert_eq!(r.status, 200, "{}", r.body);
    poll_until("the call settled at its real cost", Duration::from_secs(20), || spent(&g, "acme") == REAL);
    // 1000 out would cost 604: more than the 94 left, refused before the upstream
    let calls = g.upstream().calls();
    let r = chat(&url, &key.raw, "gpt-4o-mini", 1000);
    assert_eq!((r.status, r.json()["error"].as_str()), (429, Some("budget_exhausted")), "{}", r.body);
    assert_eq!(r.header("ratelimit-policy"), Some("\"month\";q=100;w=2592000"));
    assert_eq!(r.header("ratelimit").map(|h| h.split(";t=").next().unwrap_or("")), Some("\"month\";r=94"));
    assert!(r.header("retry-after").and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s > 0), "{:?}", r.headers);
    assert_eq!(g.upstream().calls(), calls, "a refused call never reaches the upstream");
    // a model without a price of its own is reserved at the default rates (25 + 50 = 75 of the
    // 94 left) and settled at the price of the model that answered
    let r = chat(&url, &key.raw, "llama-3", 50);
    assert_eq!(r.status, 200, "the default rates price it: {}", r.body);
    // a budget that refuses unpriced models: 403 before any limit or the upstream
    let r = chat(&url, &strict.raw, "llama-3", 5);
    assert_eq!((r.status, r.json()["error"].as_str()), (403, Some("model_not_priced")), "{}", r.body);
    assert_eq!(r.json()["limit"].as_str(), Some("day"));
    // each call settled at its real cost — the answered model's price, whatever was asked — and
    // billed at the same cost
    poll_until("both calls settled", Duration::from_secs(20), || spent(&g, "acme") == 2 * REAL);
    let billed = |cond: &str| psql_i64(g.pg(), &format!("SELECT coalesce(sum(cost_micros), 0) FROM usage_events WHERE tenant = 'acme' AND {cond}"));
    poll_until("the calls billed", Duration::from_secs(60), || billed("status = 200") == 2 * REAL);
    // the strict plan's budget counts per key and calendar day: `…:yyyyMMdd`
    let day = g.redis().keys("q:spend:{strict}:day:k.*");
    assert!(day.len() == 1 && day[0].rsplit(':').next().is_some_and(|p| p.len() == 8), "a day's counter: {day:?}");
    g.redis().assert_ttl_invariant();
}

/// Issue 42's concurrency check: two replicas (each Envoy with its own sidecar) on one Redis,
/// 300 concurrent calls against a budget of 600 micro-USD (100 calls at their real cost).
///
/// The bound: a call is admitted only when its reservation fits (atomically, in one script
/// call on Redis), and settling moves the counter by real − reserved. So the spend never
/// exceeds the budget by more than Σ max(0, real − reserved) over admitted calls; here every
/// call's real cost (6) is below its reservation (8), so the bound is the budget itself, held
/// at every instant. Between 75 (600 / 8, nothing settled before the last admission) and 100
/// calls are admitted, and each admitted call is billed at its real cost exactly once.
#[test]
fn concurrent_calls_on_two_replicas_never_spend_past_the_budget_and_each_is_billed_once() {
    const BUDGET: i64 = 600;
    const CALLS: usize = 300;
    const THREADS: usize = 30;
    let plans = format!("[[plans.llm.limits]]\nname = \"month\"\nalgorithm = \"spend_budget\"\nsubject = \"tenant\"\nlimit = {BUDGET}\n");
    let g = gateway(&plans, 2);
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let warm = g.sidecar().create_key("warm", "free", &[]);
    let urls = [g.replica(0).envoy().url("/v1/chat/completions"), g.replica(1).envoy().url("/v1/chat/completions")];
    for url in &urls {
        poll_until("the routing table in the filter", Duration::from_secs(20), || chat(url, &warm.raw, "gpt-4o-mini", 7).status == 200);
    }
    let calls_before = g.upstream().calls() as usize;
    let answers: Vec<Resp> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (urls, key) = (&urls, key.raw.as_str());
                s.spawn(move || (0..CALLS / THREADS).map(|i| chat(&urls[(t + i) % 2], key, "gpt-4o-mini", 7)).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let ok = answers.iter().filter(|r| r.status == 200).count();
    let refused = answers.iter().filter(|r| r.status == 429 && r.body.contains("budget_exhausted")).count();
    eprintln!("admitted {ok}, refused {refused}, other {}", CALLS - ok - refused);
    assert_eq!(ok + refused, CALLS, "every call admitted or refused for the budget");
    assert_eq!(g.upstream().calls() as usize - calls_before, ok, "the upstream saw what was admitted");
    assert!((75..=100).contains(&ok), "admitted {ok}: at least the budget / reservation, at most the budget / real cost");
    assert!(spent(&g, "acme") <= BUDGET, "never past the budget, even before every call settled");
    // every admitted call settled once at its real cost: the counter is their sum, within the budget
    poll_until("every call settled", Duration::from_secs(30), || spent(&g, "acme") == REAL * ok as i64);
    let count = |cond: &str| psql_i64(g.pg(), &format!("SELECT count(*) FROM usage_events WHERE tenant = 'acme' AND {cond}"));
    poll_until("every call billed", Duration::from_secs(60), || count("status = 200") == ok as i64);
    assert_eq!(count(&format!("status = 200 AND cost_micros = {REAL}")), ok as i64, "each billed at its real cost");
    assert_eq!(psql_i64(g.pg(), "SELECT coalesce(sum(cost_micros), 0) FROM usage_daily_models WHERE tenant = 'acme'"), REAL * ok as i64, "once");
    assert_eq!(spent(&g, "acme"), REAL * ok as i64, "the budget holds what was billed");
    g.redis().assert_ttl_invariant();
}
