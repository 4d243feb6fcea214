//! The official `openai` Python client (PyPI; build.sh installs it into the project's venv) as
//! the caller through a real Envoy with the filter (issue 42): chat completions, a stream with
//! its usage, `RateLimitError` on our 429 with `Retry-After` honoured by its retries, and a
//! money budget's refusal that it does not retry (its `Retry-After`, the month's end, is past the
//! client's two minutes). The checks are asserts in tests/python/openai_client.py; this test
//! starts the gateway, runs the script, and checks what the gateway counted and billed.

use std::process::Command;
use std::time::Duration;
use tollgate_tests::billing::psql_i64;
use tollgate_tests::{poll_until, post, python_bin, root};

const ROUTES: &str = "[[routes]]\nid = \"llm\"\ncluster = \"upstream\"\nllm = true\n[routes.match]\npath_prefix = \"/v1\"\n";
const PLANS: &str = "[[plans.main.limits]]\nname = \"month\"\nalgorithm = \"spend_budget\"\nlimit = 1000000\n\
    [[plans.tight.limits]]\nname = \"per-8s\"\nalgorithm = \"sliding_log\"\nlimit = 1\nwindow = \"8s\"\n\
    [[plans.broke.limits]]\nname = \"month\"\nalgorithm = \"spend_budget\"\nlimit = 5\n";
const PRICES: &str = "[usage.pricing]\ncurrency = \"USD\"\n\
    [[usage.pricing.prices]]\nmodel = \"gpt-4o-mini*\"\ninput_per_mtok = 150000\noutput_per_mtok = 600000\ncached_input_per_mtok = 75000\n";

#[test]
fn the_official_openai_client_calls_through_the_gateway() {
    let g = crate::llm::metered(&format!("{ROUTES}{PLANS}"), PRICES).build();
    let (main, tight, broke) = (g.sidecar().create_key("acme", "main", &[]), g.sidecar().create_key("tight", "tight", &[]), g.sidecar().create_key("broke", "broke", &[]));
    let warm = g.sidecar().create_key("warm", "free", &[]);
    poll_until("the routing table in the filter", Duration::from_secs(20), || {
        post(&g.envoy().url("/v1/chat/completions"), &[("x-api-key", warm.raw.as_str()), ("content-type", "application/json"), ("x-echo-llm", "openai")], "{}").status == 200
    });
    let calls = g.upstream().calls();
    let script = root().join("tests/python/openai_client.py");
    let out = Command::new(python_bin())
        .arg(&script)
        .args([g.envoy().url(""), main.raw.clone(), tight.raw.clone(), broke.raw.clone()])
        .output()
        .unwrap_or_else(|e| panic!("{} (build.sh installs the venv and openai): {e}", python_bin().display()));
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client's checks failed:\n{stdout}\n{stderr}");
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    eprintln!("{seen}");
    // the upstream saw the admitted calls only: chat, stream, the tight key's first and its retry
    assert_eq!(g.upstream().calls() - calls, 4, "{seen}");
    assert!(seen["retries"].as_u64().is_some_and(|n| n >= 1), "{seen}");
    // the main key's two calls billed at their real cost (6 micro-USD each), by the money budget too
    let billed = || psql_i64(g.pg(), "SELECT coalesce(sum(cost_micros), 0) FROM usage_events WHERE tenant = 'acme' AND status = 200");
    poll_until("the calls billed", Duration::from_secs(60), || billed() == 12);
    poll_until("the budget settled", Duration::from_secs(20), || {
        g.redis().keys("q:spend:{acme}:*").iter().map(|k| g.redis().cmd::<i64>(&["GET", k])).sum::<i64>() == 12
    });
}
