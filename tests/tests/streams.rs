//! The Wasm worker's decision stream (decision 223) through a real Envoy, its sidecar and Redis:
//! each decision is one message on one long-lived gRPC stream per worker instead of an HTTP/2
//! stream of its own. It must be as exact as the calls it replaces, refund what it abandons, give
//! the failure mode when the sidecar hangs, and come back by itself after the sidecar restarts.

use serde_json::json;
use std::time::Duration;
use tollgate_tests::fixtures::{leave_before_the_answer, limit_toml, well_inside_the_hour, window_count, DecideDelay};
use tollgate_tests::{get, poll_until, Gateway};
use tollgate_wire::compact;

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
    poll_until("the sidecar serves one decision stream", Duration::from_secs(20), || {
        g.sidecar().metric("tollgate_sidecar_decision_streams") == 1
    });
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
    // the sidecar's answer head offered compact messages (decision 224): every one was compact
    assert_eq!(g.sidecar().metric("tollgate_sidecar_stream_messages_total{format=\"compact\"}"), 40);
    assert_eq!(g.sidecar().metric("tollgate_sidecar_stream_messages_total{format=\"json\"}"), 0);
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
    let counter = || window_count(g.redis(), "acme", &key.id);
    let url = g.envoy().url("/");
    delay.set(0);
    assert_eq!(get(&url, &[("x-api-key", &key.raw)]).status, 200, "the first decision, called alone");
    stream_opened(&g, 1);
    delay.set(600);
    let stayed: Vec<Option<u16>> = std::thread::scope(|s| {
        let mut handles: Vec<_> = (0..3).map(|_| s.spawn(|| Some(get(&url, &[("x-api-key", &key.raw)]).status))).collect();
        for _ in 0..3 {
            handles.push(s.spawn(|| {
                leave_before_the_answer(&url, &key.raw, Duration::from_millis(150));
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
    // stream opens by itself and carries the decisions again. Each decision that finds the stream
    // closed (or still opening) is called alone and asks for it again; when one rides the new
    // stream (the new sidecar counts it), the stream is open and the next ride it too. (When the
    // new stream opens between two of these calls is the machine's timing, so which call is the
    // first to ride it is not asserted.)
    g.sidecar_mut().restart();
    let on_new_stream = |g: &Gateway| g.sidecar().metric("tollgate_sidecar_stream_messages_total{format=\"compact\"}");
    poll_until("a decision rides a new decision stream", Duration::from_secs(20), || {
        assert_eq!(call().status, 200, "decided by a call of its own, or on the new stream");
        on_new_stream(&g) >= 1
    });
    assert!(g.envoy().counter(OPENED) >= 2, "a new stream was opened");
    let before = on_new_stream(&g);
    for _ in 0..5 {
        assert_eq!(call().status, 200);
    }
    assert_eq!(on_new_stream(&g), before + 5, "the new stream carries them");
    let streamed = 3 + before + 5;
    assert_eq!(g.envoy().counter_reaching(STREAMED, streamed), streamed, "Envoy counted each decision both sidecars read");
}

/// gRPC frames of `messages` (a flag byte 0, a big-endian length, the bytes).
fn frames(messages: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        tollgate_wire::stream::frame_into(&mut out, m);
    }
    out
}

/// The answers of a stream's body, each with whether it came compact (decision 224).
fn answers_as_sent(mut body: Vec<u8>) -> Vec<(tollgate_wire::stream::StreamAnswer, bool)> {
    let mut out = Vec::new();
    while let Some(m) = tollgate_wire::stream::take_message(&mut body).expect("well-framed answers") {
        if compact::is_compact(&m) {
            out.push((compact::decode_answer(&m).expect("a compact answer"), true));
        } else {
            out.push((serde_json::from_slice(&m).expect("a JSON answer"), false));
        }
    }
    assert!(body.is_empty(), "no bytes after the last answer");
    out
}

/// The answers of a stream's body.
fn answers(body: Vec<u8>) -> Vec<tollgate_wire::stream::StreamAnswer> {
    answers_as_sent(body).into_iter().map(|(a, _)| a).collect()
}

fn trailer<'a>(x: &'a tollgate_tests::h2c::H2Exchange, name: &str) -> Option<&'a str> {
    x.trailers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

#[test]
fn the_sidecar_answers_each_message_by_its_seq_and_ends_a_hostile_stream_with_its_status() {
    let g = Gateway::builder().sidecar_toml(&limit_toml("p", "pm", "fixed_window", 100, "window = \"1h\"")).build();
    let port = g.sidecar().port();
    let path = tollgate_wire::stream::DECIDE_STREAM_PATH;
    let grpc = [("content-type", "application/grpc+json"), ("te", "trailers")];
    let with_secret = [grpc[0], grpc[1], g.sidecar().auth()];
    let item = |seq: u64, key_hash: &str| format!(r#"{{"seq":{seq},"request":{{"keyHash":"{key_hash}","method":"GET","authority":"api.test","path":"/"}}}}"#);
    let unknown = "0".repeat(64);

    // without the filter secret: refused before a byte of the body is read
    let refused = tollgate_tests::h2c::post_to_end(port, path, &grpc, &frames(&[item(1, &unknown).as_bytes()]));
    assert_eq!(refused.status, 401);

    // pipelined: every message answered with its own seq; the stream ends OK when the filter's side does
    let ok = tollgate_tests::h2c::post_to_end(port, path, &with_secret, &frames(&[item(7, &unknown).as_bytes(), item(8, "not-a-hash").as_bytes()]));
    assert_eq!(ok.status, 200);
    assert_eq!(trailer(&ok, "grpc-status"), Some("0"), "{:?}", ok.trailers);
    let mut got = answers(ok.body);
    got.sort_by_key(|a| a.seq);
    assert_eq!(got.iter().map(|a| a.seq).collect::<Vec<_>>(), [7, 8]);
    let first = got[0].clone().into_result().expect("a decision for a well-formed request");
    assert!(matches!(first, tollgate_wire::DecideResponse::Deny { .. }), "an unknown key is denied: {first:?}");
    assert_eq!(got[1].status, 400, "a malformed request is answered 400, as /v1/decide would: {:?}", got[1]);
    let offered = ok.headers.iter().find(|(n, _)| n == compact::FORMAT_HEADER).map(|(_, v)| v.as_str());
    assert_eq!(offered, Some(compact::FORMAT_COMPACT), "the answer head offers compact messages: {:?}", ok.headers);

    // compact and JSON messages on one stream: each answered in its own format (decision 224)
    let compact_item = |seq: u64, key_hash: &str| {
        let mut m = Vec::new();
        compact::encode_item(&mut m, seq, None, &tollgate_wire::DecideRequest::new(key_hash, "GET", "api.test", "/")).unwrap();
        m
    };
    let mixed = tollgate_tests::h2c::post_to_end(port, path, &with_secret, &frames(&[&compact_item(1, &unknown), item(2, &unknown).as_bytes(), &compact_item(3, "not-a-hash")]));
    assert_eq!(trailer(&mixed, "grpc-status"), Some("0"), "{:?}", mixed.trailers);
    let mut got = answers_as_sent(mixed.body);
    got.sort_by_key(|(a, _)| a.seq);
    assert_eq!(got.iter().map(|(a, c)| (a.seq, a.status, *c)).collect::<Vec<_>>(), [(1, 200, true), (2, 200, false), (3, 400, true)]);
    assert!(matches!(got[0].0.decision, Some(tollgate_wire::DecideResponse::Deny { .. })), "{:?}", got[0]);

    // a compressed message (none was agreed), bytes that are no decision, a length past the
    // limit: what came before is answered, then the stream ends INVALID_ARGUMENT (3)
    let compressed = {
        let mut b = frames(&[item(1, &unknown).as_bytes()]);
        b.extend_from_slice(&[1, 0, 0, 0, 2, b'{', b'}']);
        b
    };
    let huge = {
        let mut b = vec![0u8];
        b.extend_from_slice(&u32::MAX.to_be_bytes());
        b
    };
    let not_json: &[u8] = b"\xff\xfe not a decision";
    let mut cut = compact_item(4, &unknown);
    cut.truncate(cut.len() - 1);
    let bad_compact = frames(&[&compact_item(5, &unknown), &cut]);
    for (what, body, answered) in [("compressed", compressed, 1), ("not JSON", frames(&[not_json]), 0), ("too long", huge, 0), ("a cut compact message", bad_compact, 1)] {
        let x = tollgate_tests::h2c::post_to_end(port, path, &with_secret, &body);
        assert_eq!(x.status, 200, "{what}");
        assert_eq!(trailer(&x, "grpc-status"), Some("3"), "{what}: {:?}", x.trailers);
        assert!(trailer(&x, "grpc-message").is_some_and(|m| !m.is_empty()), "{what}: says why");
        assert_eq!(answers(x.body).len(), answered, "{what}");
    }
    // and the sidecar serves on
    assert_eq!(get(&g.sidecar().url("/healthz"), &[]).status, 200);
}

#[test]
fn a_stopping_sidecar_ends_its_decision_streams_and_exits_cleanly() {
    if !tollgate_tests::wasm_host_only("the decision stream is the Wasm host's (decision 223)") {
        return;
    }
    let mut g = Gateway::builder().sidecar_toml(&limit_toml("p", "pm", "fixed_window", 1000, "window = \"1h\"")).build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &key.raw)]).status, 200, "the first decision, called alone");
    stream_opened(&g, 1);
    assert_eq!(get(&url, &[("x-api-key", &key.raw)]).status, 200);
    assert_eq!(g.envoy().counter_reaching(STREAMED, 1), 1);
    // SIGTERM: the open stream does not hold the sidecar's stop; it is ended, with its status
    let status = g.sidecar_mut().terminate(Duration::from_secs(20)).expect("the sidecar exits on SIGTERM");
    assert!(status.success(), "{status}");
    let log = g.sidecar().log_text();
    assert!(log.contains("a decision stream ends") && log.contains("the sidecar is stopping"), "the stream was ended by the stop:\n{log}");
}
