//! The Wasm worker's decision stream (decision 223) through a real Envoy, its sidecar and Redis:
//! each decision is one message on one long-lived gRPC stream per worker instead of an HTTP/2
//! stream of its own. It must be as exact as the calls it replaces, refund what it abandons, give
//! the failure mode when the sidecar hangs, and come back by itself after the sidecar restarts.

use serde_json::json;
use std::io::{Read, Write};
use std::time::Duration;
use tollgate_tests::fixtures::{limit_toml, well_inside_the_hour, DecideDelay};
use tollgate_tests::{get, poll_until, Gateway};

const STREAMED: &str = "wasmcustom.tollgate.decisions.streamed";
const OPENED: &str = "wasmcustom.tollgate.decisions.streams_opened";

/// A worker opens its stream when a decision first finds it closed (that one is called as before).
fn stream_opened(g: &Gateway, at_least: u64) {
    poll_until("the worker opened its decision stream", Duration::from_secs(20), || g.envoy().counter(OPENED) >= at_least);
}

#[test]
fn concurrent_decisions_ride_the_stream_and_the_limit_stays_exact() {
    if !tollgate_tests::wasm_host_only("the decision stream is the Wasm host's (decision 223)") {
        return;
    }
    well_inside_the_hour();
    let g = Gateway::builder()
        .sidecar_toml(&limit_toml("p", "pm", "fixed_window", 26, "window = \"1h\""))
        .plugin(json!({"sidecar": {"timeout": "5s"}, "failureMode": "closed"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &key.raw)]).status, 200, "the first decision, called alone");
    stream_opened(&g, 1);
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| (0..5).map(|_| get(&url, &[("x-api-key", &key.raw)]).status).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, limited), (25, 15), "exactly the limit admitted, the rest 429: {statuses:?}");
    assert_eq!(g.upstream().calls(), 26);
    let streamed = g.envoy().counter_reaching(STREAMED, 40);
    assert_eq!(streamed, 40, "every decision went on the stream");
    assert_eq!(g.envoy().counter("wasmcustom.tollgate.decisions.batched"), 0, "none needed a batch");
    assert_eq!(g.envoy().counter(OPENED), 1, "one stream for the (one) worker, kept open");
}

#[test]
fn clients_that_leave_while_their_decision_is_on_the_stream_are_refunded() {
    if !tollgate_tests::wasm_host_only("the decision stream is the Wasm host's (decision 223)") {
        return;
    }
    well_inside_the_hour();
    let delay = DecideDelay::new(600);
    let g = Gateway::builder()
        .sidecar_toml(&limit_toml("p", "pm", "fixed_window", 100, "window = \"1h\""))
        .sidecar_env(delay.env().0, &delay.env().1)
        .plugin(json!({"sidecar": {"timeout": "5s"}, "failureMode": "closed", "completionFlushInterval": "20ms"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let window_key = format!("rl:{{acme}}:pm:k.{}:*", key.id);
    let counter = || -> u64 {
        let keys = g.redis().keys(&window_key);
        keys.first().map_or(0, |k| g.redis().cmd::<Option<u64>>(&["GET", k]).unwrap_or(0))
    };
    let url = g.envoy().url("/");
    delay.set(0);
    assert_eq!(get(&url, &[("x-api-key", &key.raw)]).status, 200, "the first decision, called alone");
    stream_opened(&g, 1);
    delay.set(600);
    let port: u16 = url.trim_start_matches("http://").split([':', '/']).nth(1).unwrap().parse().unwrap();
    let stayed: Vec<Option<u16>> = std::thread::scope(|s| {
        let mut handles: Vec<_> = (0..3).map(|_| s.spawn(|| Some(get(&url, &[("x-api-key", &key.raw)]).status))).collect();
        for _ in 0..3 {
            handles.push(s.spawn(|| {
                let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                let req = format!("GET / HTTP/1.1\r\nhost: api.test\r\nx-api-key: {}\r\n\r\n", key.raw);
                c.write_all(req.as_bytes()).unwrap();
                c.set_read_timeout(Some(Duration::from_millis(150))).unwrap();
                let mut buf = [0u8; 64];
                assert!(c.read(&mut buf).is_err(), "a leaving client was answered before it left");
                None
            }));
        }
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(stayed.iter().flatten().copied().collect::<Vec<_>>(), [200; 3]);
    assert_eq!(g.envoy().counter_reaching(STREAMED, 6), 6, "all six decisions went on the stream");
    // each leaver's decision was taken by the sidecar, then refunded: the limit counts the stayers
    poll_until("the limit counts only the clients that stayed (and the first)", Duration::from_secs(20), || counter() == 4);
    delay.set(0);
    let queued = g.envoy().counter("wasmcustom.tollgate.refunds.queued");
    assert_eq!(queued, 3, "each leaver's decision left on the stream: each is refunded");
    poll_until("every refund queued was made", Duration::from_secs(20), || {
        g.sidecar().metric("tollgate_sidecar_refunds_total{outcome=\"refunded\"}") == queued
    });
    assert_eq!(g.upstream().calls(), 4);
    assert_eq!(counter(), 4, "and stays so");
}

#[test]
fn a_hung_sidecar_gets_the_failure_mode_and_a_restarted_one_gets_a_new_stream() {
    if !tollgate_tests::wasm_host_only("the decision stream is the Wasm host's (decision 223)") {
        return;
    }
    well_inside_the_hour();
    let mut g = Gateway::builder()
        .sidecar_toml(&limit_toml("p", "pm", "fixed_window", 1000, "window = \"1h\""))
        .plugin(json!({"sidecar": {"timeout": "400ms"}, "failureMode": "closed"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let url = g.envoy().url("/");
    let call = || get(&url, &[("x-api-key", &key.raw)]);
    assert_eq!(call().status, 200, "the first decision, called alone");
    stream_opened(&g, 1);
    assert_eq!(call().status, 200);
    assert_eq!(g.envoy().counter_reaching(STREAMED, 1), 1);

    // hung: the stream stays open and answers nothing; the tick fails the decision closed
    g.sidecar().signal("-STOP");
    let hung = call();
    g.sidecar().signal("-CONT");
    assert_eq!(hung.status, 503, "failure mode closed: {}", hung.body);
    assert!(hung.body.contains("sidecar_unavailable"), "{}", hung.body);
    assert_eq!(call().status, 200, "the same stream decides again once the sidecar runs");
    assert_eq!(g.envoy().counter(OPENED), 1);
    assert_eq!(g.envoy().counter_reaching(STREAMED, 3), 3, "the hung decision had gone on the stream too");

    // restarted (SIGKILL, then the same port): the stream ends; calls decide meanwhile; a new
    // stream opens by itself and carries the decisions again
    g.sidecar_mut().restart();
    // each decision that finds the stream closed is called alone and asks for it again
    poll_until("the worker opened a new decision stream", Duration::from_secs(20), || {
        g.envoy().counter(OPENED) >= 2 || {
            assert_eq!(call().status, 200, "decided by a call of its own meanwhile");
            false
        }
    });
    for _ in 0..5 {
        assert_eq!(call().status, 200);
    }
    assert_eq!(g.envoy().counter_reaching(STREAMED, 8), 8, "the new stream carries them");
}
