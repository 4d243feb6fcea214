//! What an operator sees (issue 17), all real: Envoy with the filter, the sidecar, Redis, tansu
//! (the usage stream the per-tenant series come from) and Debian's Prometheus scraping Envoy and
//! the sidecar with Tollgate's rule file loaded. Traffic of three tenants — allowed, denied by an
//! exact limit, and admitted from leases without a call — shows up in Prometheus per tenant and
//! outcome, equal to what the clients saw; every panel of the shipped Grafana dashboard returns
//! series with the labels it groups by.

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;
use tollgate_tests::billing::Billing;
use tollgate_tests::prometheus::{Job, Prometheus};
use tollgate_tests::{free_port, get, poll_for, poll_until, root, Gateway, IssuedKey};

fn gateway() -> Gateway {
    Gateway::builder()
        .sidecar_toml(
            "[[plans.small.limits]]\nname = \"per_minute\"\nalgorithm = \"sliding_log\"\nlimit = 4\nwindow = \"1m\"\n\
             [[plans.big.limits]]\nname = \"per_hour\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"1h\"\n\
             [[plans.leased.limits]]\nname = \"leased_hour\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"1h\"\nmode = \"leased\"\n\
             [telemetry]\nmax_tenants = 50\nnear_limit = 0.5\n\
             [usage]\nenabled = true\nspool_dir = \"${SPOOL_DIR}\"\nsegment_age = \"50ms\"\n\
             [usage.kafka]\nbrokers = \"${BROKERS}\"\ntopic = \"usage_events\"\npartitions = 2\ndelivery_timeout = \"3s\"\n",
        )
        .plugin(json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed", "usage": {"enabled": true, "flushInterval": "100ms"}}))
        .broker()
        .postgres()
        .build()
}

fn call(g: &Gateway, key: &IssuedKey) -> u16 {
    get(&g.envoy().url("/v1/items"), &[("x-api-key", key.raw.as_str())]).status
}

/// `sum by (labels) (metric)` as `("value/value…" in the order of `labels`, sample)` pairs, sorted.
fn by(p: &Prometheus, labels: &[&str], metric: &str) -> Vec<(String, f64)> {
    let expr = format!("sum by ({}) ({metric})", labels.join(", "));
    let mut out: Vec<(String, f64)> = p
        .query(&expr)
        .iter()
        .map(|s| {
            let names = labels.iter().map(|l| s["metric"][*l].as_str().unwrap_or("-")).collect::<Vec<_>>().join("/");
            (names, s["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn pairs(v: &[(&str, f64)]) -> Vec<(String, f64)> {
    v.iter().map(|(l, n)| (l.to_string(), *n)).collect()
}

#[test]
fn prometheus_counts_every_tenants_requests_by_outcome_and_every_dashboard_panel_has_data() {
    let g = gateway();
    let billing_metrics = format!("127.0.0.1:{}", free_port());
    let _billing = Billing::start(&g.broker().brokers(), "usage_events", "billing", g.pg(), &[("TOLLGATE_BILLING_METRICS_LISTEN", &billing_metrics)]);
    let prom = Prometheus::start(&[
        Job::new("envoy", "/stats/prometheus", [format!("127.0.0.1:{}", g.envoy().admin_port)]),
        Job::new("tollgate-sidecar", "/metrics", [format!("127.0.0.1:{}", g.sidecar().port)]),
        Job::new("tollgate-billing", "/metrics", [billing_metrics.clone()]),
    ]);
    prom.wait_targets_up(3);

    let small = g.sidecar().create_key("acme", "small", &[]);
    let big = g.sidecar().create_key("beta", "big", &[]);
    let leased = g.sidecar().create_key("gamma", "leased", &[]);
    // acme: 4 allowed, then 3 denied by its sliding log; beta: 5 allowed; gamma: 30 allowed,
    // most of them from leases (no call)
    let acme: Vec<u16> = (0..7).map(|_| call(&g, &small)).collect();
    assert_eq!(acme, [200, 200, 200, 200, 429, 429, 429]);
    for _ in 0..5 {
        assert_eq!(call(&g, &big), 200);
    }
    for _ in 0..30 {
        assert_eq!(call(&g, &leased), 200);
    }

    // Prometheus sees exactly that traffic, per tenant and outcome (the usage stream is batched
    // and scraped every 500 ms: poll until it settles on the expected counts)
    let expected = pairs(&[("acme/allowed", 4.0), ("acme/rate_limited", 3.0), ("beta/allowed", 5.0), ("gamma/allowed", 30.0)]);
    let mut seen = vec![];
    poll_until("Prometheus to count every request per tenant and outcome", Duration::from_secs(60), || {
        seen = by(&prom, &["tenant", "outcome"], "tollgate_requests_total");
        seen == expected
    });
    assert_eq!(seen, expected);
    // ... and per plan and status class
    assert_eq!(
        by(&prom, &["plan", "status_class"], "tollgate_requests_total"),
        pairs(&[("big/2xx", 5.0), ("leased/2xx", 30.0), ("small/2xx", 4.0), ("small/4xx", 3.0)])
    );
    // the exact limits' series: acme's 7 decisions ran its sliding log, 3 were over it, and from
    // the 2nd on (2 of 4 used) each one was at or past the near-limit mark (0.5); beta's 5 ran
    // its fixed window, far from the mark
    let limit = |m: &str| by(&prom, &["tenant", "limit", "kind"], m);
    poll_until("the limit series to be scraped", Duration::from_secs(30), || !limit("tollgate_limit_over_limit_total").is_empty());
    let hits = limit("tollgate_limit_hits_total");
    assert!(hits.contains(&("acme/per_minute/sliding_log".to_string(), 7.0)), "{hits:?}");
    assert!(hits.contains(&("beta/per_hour/fixed_window".to_string(), 5.0)), "{hits:?}");
    assert_eq!(limit("tollgate_limit_over_limit_total"), pairs(&[("acme/per_minute/sliding_log", 3.0)]));
    assert_eq!(limit("tollgate_limit_near_limit_total"), pairs(&[("acme/per_minute/sliding_log", 6.0)]));
    assert_eq!(prom.value("max(tollgate_limit_used_ratio{tenant=\"acme\"})"), Some(1.0));
    // Envoy's own counters: every request passed through the filter, gamma's mostly from leases
    poll_until("Envoy's counters to be scraped", Duration::from_secs(30), || {
        prom.value("sum(tollgate_requests_allowed)") == Some(39.0)
    });
    let lease_hits = prom.value("sum(tollgate_leases_hits)").unwrap_or(0.0);
    assert!(lease_hits >= 1.0, "gamma's requests were admitted from leases: {lease_hits}");

    // the billing consumer stored every request once (denials included), and says so
    poll_until("the billing consumer to store every request", Duration::from_secs(60), || {
        prom.value("sum(tollgate_billing_requests_total)") == Some(42.0)
    });
    poll_until("the billing lag to be measured", Duration::from_secs(30), || prom.value("sum(tollgate_billing_lag_messages)").is_some());

    // every panel of the shipped dashboard returns series carrying the labels it groups by
    let text = std::fs::read_to_string(root().join("observability/grafana/tollgate-overview.json")).expect("dashboard");
    let dash: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10);
    let mut exprs = vec![];
    for panel in panels {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr").replace("$__rate_interval", "2m").replace("$tenant", ".*");
            if expr.contains("tollgate_breaker_") {
                continue; // no breaker in this gateway (tests/tests/breaker.rs has them)
            }
            exprs.push((panel["title"].clone(), expr));
        }
    }
    // a `rate()` needs two scrapes of a series: the counters above may have been seen in their
    // first scrape only, so wait (bounded) for every panel to have data
    let mut empty = vec![];
    poll_for(Duration::from_secs(30), || {
        empty = exprs.iter().filter(|(_, e)| prom.query(e).is_empty()).map(|(_, e)| e.clone()).collect::<Vec<_>>();
        empty.is_empty()
    });
    assert!(empty.is_empty(), "dashboard queries without data: {empty:#?}\n{}", prom.log_text());
    for (title, expr) in &exprs {
        let series = prom.query(expr);
        let grouped: BTreeSet<&str> = expr
            .split("by (")
            .skip(1)
            .filter_map(|s| s.split(')').next())
            .flat_map(|s| s.split(',').map(str::trim))
            .filter(|l| *l != "le")
            .collect();
        for s in &series {
            for l in &grouped {
                assert!(s["metric"].get(*l).is_some(), "panel {title:?}: {expr} returned a series without `{l}`: {s}");
            }
        }
    }
}

/// Traces (issue 17.6): a request carrying a sampled W3C `traceparent` gets exactly one decision
/// span in its own trace, parented by the caller's span, with the tenant and the Redis time; a
/// request without one, or with the sampled flag off, gets none (`sample_ratio` is 0 by default).
#[test]
fn one_traced_request_gives_one_decision_span_in_its_own_trace() {
    let receiver = tollgate_tests::otlp::OtlpReceiver::start();
    let g = Gateway::builder()
        .sidecar_toml(&format!(
            "[[plans.p.limits]]\nname = \"per_minute\"\nalgorithm = \"fixed_window\"\nlimit = 100\nwindow = \"1m\"\n\
             [telemetry.traces]\nendpoint = \"{}\"\nexport_interval = \"100ms\"\n",
            receiver.endpoint()
        ))
        .plugin(json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let traced = |tp: Option<&str>| {
        let mut h = vec![("x-api-key", key.raw.as_str())];
        h.extend(tp.map(|tp| ("traceparent", tp)));
        assert_eq!(get(&g.envoy().url("/v1/items"), &h).status, 200);
    };
    let (ta, pa) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let (tc, td) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331b7ad6b7169203331");
    traced(Some(&format!("00-{ta}-{pa}-01")));
    poll_until("the first request's span", Duration::from_secs(20), || !receiver.trace(ta).is_empty());
    traced(None);
    traced(Some(&format!("00-{tc}-{pa}-00"))); // not sampled by the caller
    traced(Some(&format!("00-{td}-{pa}-01")));
    // spans are posted in order: once the last one is in, any of the two before it would be too
    poll_until("the last request's span", Duration::from_secs(20), || !receiver.trace(td).is_empty());
    let spans = receiver.trace(ta);
    assert_eq!(spans.len(), 1, "{spans:?}");
    let s = &spans[0];
    assert_eq!((s["name"].as_str(), s["parentSpanId"].as_str(), s["kind"].as_i64()), (Some("tollgate.decide"), Some(pa), Some(2)), "{s}");
    assert_ne!(s["spanId"].as_str(), Some(pa));
    let attr = |name: &str| s["attributes"].as_array().unwrap().iter().find(|a| a["key"] == name).map(|a| a["value"].clone());
    assert_eq!(attr("tollgate.tenant"), Some(json!({"stringValue": "acme"})), "{s}");
    assert_eq!(attr("tollgate.outcome"), Some(json!({"stringValue": "allow"})), "{s}");
    let redis_ns: u64 = attr("tollgate.redis_time_ns").and_then(|v| v["intValue"].as_str()?.parse().ok()).expect("the Redis time");
    let (start, end): (u64, u64) = (s["startTimeUnixNano"].as_str().unwrap().parse().unwrap(), s["endTimeUnixNano"].as_str().unwrap().parse().unwrap());
    assert!(redis_ns > 0 && redis_ns <= end - start, "redis {redis_ns} ns within the span's {} ns", end - start);
    assert!(receiver.trace(tc).is_empty(), "a trace the caller did not sample");
    assert_eq!(receiver.spans().len(), 2, "only the two sampled requests: {:?}", receiver.spans());
    assert_eq!(g.sidecar().metric("tollgate_sidecar_spans_total{outcome=\"exported\"}"), 2);
}
