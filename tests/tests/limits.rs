//! Functional tests of the limits engine through a real Envoy: 429s and their headers, exact
//! admission across two Envoy replicas (each with its own sidecar) sharing one Redis, and token
//! budgets reconciled from the response's usage through batched completion reports.

use serde_json::json;
use std::time::Duration;
use tollgate_tests::{get, keyed_burst, poll_until, post, Gateway, Upstream};

#[test]
fn a_rate_limit_answers_429_with_retry_after_and_ratelimit_headers() {
    let g = Gateway::builder()
        .sidecar_toml("[[plans.demo.limits]]\nname = \"per-minute\"\nalgorithm = \"sliding_log\"\nlimit = 3\nwindow = \"60s\"\n")
        .build();
    let (envoy, redis) = (g.envoy(), g.redis());
    let key = g.sidecar().create_key("acme", "demo", &[]);
    let h = [("x-api-key", key.raw.as_str())];
    for remaining in [2, 1, 0] {
        let r = get(&envoy.url("/"), &h);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("ratelimit-policy"), Some("\"per-minute\";q=3;w=60"));
        let rl = r.header("ratelimit").unwrap_or_default().to_string();
        assert!(rl.starts_with(&format!("\"per-minute\";r={remaining};t=")), "{rl}");
    }
    let r = get(&envoy.url("/"), &h);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"], "rate_limited");
    assert_eq!(r.json()["limit"], "per-minute");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert!(r.header("ratelimit").unwrap().starts_with("\"per-minute\";r=0;t="));
    assert_eq!(g.upstream().calls(), 3, "the denied request never reached the upstream");
    assert_eq!(envoy.counter("wasmcustom.tollgate.requests.denied.rate_limited"), 1);
    assert!(redis.assert_ttl_invariant() >= 4);
}

#[test]
fn two_replicas_admit_exactly_the_limit_under_concurrency() {
    const LIMIT: usize = 40;
    const REQUESTS: usize = 160;
    let g = Gateway::builder()
        .sidecar_toml(&format!("[[plans.p.limits]]\nname = \"total\"\nalgorithm = \"sliding_log\"\nlimit = {LIMIT}\nwindow = \"1h\"\n"))
        .replicas(2)
        .concurrency(2)
        .build();
    let (envoy_a, envoy_b) = (g.replica(0).envoy(), g.replica(1).envoy());
    let key = g.sidecar().create_key("acme", "p", &[]);

    let urls = [envoy_a.url("/"), envoy_b.url("/")];
    let statuses = keyed_burst(&urls, &key.raw, 8, REQUESTS / 8);
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, limited), (LIMIT, REQUESTS - LIMIT), "statuses: {statuses:?}");
    assert_eq!(g.upstream().calls() as usize, LIMIT);
    let allowed = |e: &tollgate_tests::Envoy| e.counter("wasmcustom.tollgate.requests.allowed");
    poll_until("both Envoys to count what they admitted", Duration::from_secs(10), || {
        allowed(envoy_a) + allowed(envoy_b) >= LIMIT as u64
    });
    let (admitted_a, admitted_b) = (allowed(envoy_a), allowed(envoy_b));
    assert_eq!((admitted_a + admitted_b) as usize, LIMIT);
    assert!(admitted_a > 0 && admitted_b > 0, "both replicas admitted some: {admitted_a} + {admitted_b}");
    g.redis().assert_ttl_invariant();
}

#[test]
fn a_token_budget_is_reconciled_with_the_usage_the_upstream_reported() {
    let g = Gateway::builder()
        .sidecar_toml(
            "[[plans.llm.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 1000\nestimate = 400\n\
             [[plans.llm.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 1\n",
        )
        .plugin(json!({"sidecar": {"timeout": "2s"}, "tokenEstimateField": "max_tokens"}))
        .build();
    let (envoy, sidecar, redis) = (g.envoy(), g.sidecar(), g.redis());
    let key = sidecar.create_key("acme", "llm", &[]);
    // The estimate comes from the request: 2000 tokens cannot fit a 1000 budget...
    let json = [("x-api-key", key.raw.as_str()), ("content-type", "application/json")];
    let r = post(&envoy.url("/v1/chat"), &json, r#"{"model":"m","max_tokens":2000}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"], "quota_exceeded");
    // ...while 1 does, but reserves the limit's estimate (400): a client cannot lower its own
    // reservation, which is the charge of a request whose usage is never read (decision 159).
    // The buffered POST goes on to the upstream after the decision.
    let r = post(&envoy.url("/v1/chat"), &json, r#"{"model":"m","max_tokens":1}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    poll_until("the 400-token reservation to be settled", Duration::from_secs(10), || {
        let mut c = redis.connection().unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg("q:tokens:*").query(&mut c).unwrap();
        // no usage in that response: the reservation (400) stands as the charge
        keys.first().map(|k| redis::cmd("GET").arg(k).query::<i64>(&mut c).unwrap()) == Some(400)
            && redis::cmd("KEYS").arg("q:reserved:*").query::<Vec<String>>(&mut c).unwrap().iter().all(|k| {
                redis::cmd("GET").arg(k).query::<String>(&mut c).unwrap() == "settled"
            })
    });
    let _: () = redis::cmd("FLUSHALL").query(&mut redis.connection().unwrap()).unwrap();
    let key = sidecar.create_key("acme", "llm", &[]);
    let counter = || -> Option<i64> {
        let mut c = redis.connection()?;
        let keys: Vec<String> = redis::cmd("KEYS").arg("q:tokens:*").query(&mut c).ok()?;
        redis::cmd("GET").arg(keys.first()?).query(&mut c).ok()
    };
    let r = get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str()), ("x-echo-usage", "120")]);
    assert_eq!(r.status, 200, "{}", r.body);
    // 400 were reserved; the completion report (batched, no call on the request path) settles
    // the charge at the 120 tokens used and frees the concurrency slot
    poll_until("the reservation to be reconciled", Duration::from_secs(10), || counter() == Some(120));
    let r = get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str()), ("x-echo-usage", "700")]);
    assert_eq!(r.status, 200, "the slot was freed by the completion report: {}", r.body);
    poll_until("the overrun to be charged", Duration::from_secs(10), || counter() == Some(820));
    // 820 used + 400 estimate > 1000
    poll_until("the slot to be free again", Duration::from_secs(10), || {
        let r = get(&envoy.url("/v1/chat"), &[("x-api-key", key.raw.as_str())]);
        assert_ne!(r.status, 200, "the budget must refuse: {}", r.body);
        r.status == 429 && r.json()["error"] == "quota_exceeded"
    });
    assert!(envoy.counter("wasmcustom.tollgate.completions.batches_sent") >= 2);
    redis.assert_no_raw_keys(&[&key.raw]);
    // counters, reservations (settled markers) and slot sets all expire; key records do not
    assert!(redis.assert_ttl_invariant() >= 6);
}

#[test]
fn a_token_budget_reads_an_event_stream_and_charges_the_reservation_for_a_body_it_cannot_read() {
    // README: token budgets count what the upstream reports in its response (`usage`, JSON or an
    // SSE stream); a body the filter cannot read (here: over 1 MiB) is charged the reservation.
    let g = Gateway::builder()
        .sidecar_toml("[[plans.llm.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 1000000\nestimate = 400\n")
        .plugin(json!({"sidecar": {"timeout": "2s"}}))
        .build();
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let url = g.envoy().url("/v1/chat");
    // the month's counter, once every reservation is settled (a reservation stands in it until)
    let counter = || -> Option<i64> {
        let settled = g.redis().keys("q:reserved:*").iter().all(|k| g.redis().cmd::<Option<String>>(&["GET", k]).as_deref() == Some("settled"));
        let keys = g.redis().keys("q:tokens:*");
        settled.then(|| keys.first().map_or(0, |k| g.redis().cmd::<Option<i64>>(&["GET", k]).unwrap_or(0)))
    };
    // an event stream whose last frame reports 123 tokens: charged 123, not the 400 reserved
    let r = get(&url, &[("x-api-key", key.raw.as_str()), ("x-echo-sse", "123")]);
    assert_eq!((r.status, r.header("content-type")), (200, Some("text/event-stream")), "{}", r.body);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "the stream reached the client whole");
    poll_until("the stream's usage charged", Duration::from_secs(10), || counter() == Some(123));
    // a stream longer than the 1 MiB a JSON body is read up to (~2.5 MB, 40 000 frames): its
    // usage is read from its tail (decision 170), not charged the reservation
    let r = get(&url, &[("x-api-key", key.raw.as_str()), ("x-echo-sse", "77"), ("x-echo-sse-events", "40000")]);
    assert!(r.status == 200 && r.body.len() > 2 << 20 && r.body.ends_with("data: [DONE]\n\n"), "{} {}", r.status, r.body.len());
    poll_until("the long stream's usage charged", Duration::from_secs(10), || counter() == Some(123 + 77));
    // a JSON body over 1 MiB that reports 50 tokens at its end: not read, the reservation stands
    let r = get(&url, &[("x-api-key", key.raw.as_str()), ("x-echo-pad", "600000"), ("x-echo-usage", "50")]);
    assert!(r.status == 200 && r.body.len() > 1 << 20 && r.body.contains("\"total_tokens\":50"), "{} {}", r.status, r.body.len());
    poll_until("the reservation charged", Duration::from_secs(10), || counter() == Some(200 + 400));
    // the same usage in a small body is read (the control)
    let r = get(&url, &[("x-api-key", key.raw.as_str()), ("x-echo-pad", "10"), ("x-echo-usage", "50")]);
    assert_eq!(r.status, 200);
    poll_until("the small body's usage charged", Duration::from_secs(10), || counter() == Some(200 + 400 + 50));
    // a total_tokens outside the response's usage object (here a tool call's input, which the
    // client's prompt chose) is not read: the reservation stands. Before decision 134 it was
    // read, and the client chose its own charge (0).
    let r = get(&url, &[("x-api-key", key.raw.as_str()), ("x-echo-tool-input", r#"{"total_tokens":0}"#)]);
    assert!(r.status == 200 && r.body.contains(r#""input":{"total_tokens":0}"#), "{} {}", r.status, r.body);
    poll_until("the reservation charged, not the tool input's count", Duration::from_secs(10), || counter() == Some(200 + 400 + 50 + 400));
}

/// Decision 175: a request Envoy answered itself because it reached no upstream (a dead port:
/// connection failures) used no tokens, and its budget's reservation is settled at 0. Before,
/// each such 503 was charged the reservation: retries against a down upstream spent the month's
/// budget with no work done (here the third would have been refused).
#[test]
fn a_request_that_reached_no_upstream_charges_its_budget_nothing() {
    let g = Gateway::builder()
        .sidecar_toml("[[plans.llm.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 1000\nestimate = 400\n")
        .plugin(json!({"sidecar": {"timeout": "2s"}}))
        .upstream(Upstream::Dead)
        .build();
    let key = g.sidecar().create_key("acme", "llm", &[]);
    let settled = || {
        let reservations = g.redis().keys("q:reserved:*");
        let all = reservations.iter().all(|k| g.redis().cmd::<Option<String>>(&["GET", k]).as_deref() == Some("settled"));
        let charged = g.redis().keys("q:tokens:*").first().map_or(0, |k| g.redis().cmd::<Option<i64>>(&["GET", k]).unwrap_or(0));
        (reservations.len(), all, charged)
    };
    for n in 1..=4 {
        let r = get(&g.envoy().url("/v1/chat"), &[("x-api-key", key.raw.as_str())]);
        assert_eq!(r.status, 503, "request {n}: {}", r.body);
        poll_until("the reservation settled at 0", Duration::from_secs(10), || settled() == (n, true, 0));
    }
}
