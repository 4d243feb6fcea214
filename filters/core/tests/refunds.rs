#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Abandoned decisions (issue 15.2), through a worker and a mock host: a decision whose answer
//! the filter gave up on while the request was refused, or whose client went away while the call
//! was in flight, is queued with the id the call carried and sent to `POST /v1/refunds` on the
//! next flush; an answered decision, or one the failure mode let through, is not.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::rc::Rc;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::{Action, CallSpec};
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::stats::{FlushEvent, Metric, Stream};
use tollgate_filter_core::worker::{Seeds, Worker};
use tollgate_wire::refunds::{Abandoned, RefundBatch};
use tollgate_wire::DecideRequest;

const KEY: &str = "tg_refund_key";
const T: u64 = 1_000_000;
const SEEDS: Seeds = Seeds { decision_ids: [5; 32], usage_ids: 1, hints_owner: 2, routes_owner: 3, changes_owner: 4 };
const ALLOW: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold"}"#;
const DENY: &[u8] = br#"{"verdict":"deny","status":429,"error":"rate_limited","message":"no"}"#;

fn worker(config: &str) -> (Worker, MockHost) {
    let mut root = MockHost::new();
    root.now_ms = T;
    let w = Worker::new(&mut root, Rc::new(FilterConfig::parse(config.as_bytes()).unwrap()), SEEDS);
    (w, root)
}

fn path(call: &CallSpec) -> Option<&str> {
    call.headers.iter().find(|(n, _)| n == ":path").map(|(_, v)| v.as_str())
}

/// A request whose decision call is answered with `status` and `body` (`None`: never answered,
/// the client goes away); returns the decision request it sent and its host.
fn request(w: &Worker, root: &MockHost, answer: Option<(Option<u16>, &[u8])>) -> (DecideRequest, MockHost) {
    let mut h = MockHost::next_request(root).with_header("x-api-key", KEY);
    let mut f = w.request();
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    let sent: DecideRequest = serde_json::from_slice(&h.calls[0].body).unwrap();
    if let Some((status, body)) = answer {
        f.on_call_response(&mut h, 1, status, body);
    }
    f.on_log(&mut h);
    (sent, h)
}

/// The abandoned decisions the worker's next flush sends.
fn flushed(w: &mut Worker, root: &mut MockHost) -> Vec<Abandoned> {
    let before = root.calls.len();
    w.on_tick(root);
    let calls: Vec<&CallSpec> = root.calls[before..].iter().filter(|c| path(c) == Some("/v1/refunds")).collect();
    calls.iter().flat_map(|c| serde_json::from_slice::<RefundBatch>(&c.body).unwrap().abandoned).collect()
}

#[test]
fn a_lost_answer_of_a_refused_request_is_sent_for_refund_on_the_next_flush() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    assert!(w.metrics().contains(&Metric::Flush(Stream::Refunds, FlushEvent::BatchesSent)));
    let mut sent = Vec::new();
    // a timeout (Envoy's 504), an error status, an answer that cannot be read
    for answer in [(Some(504), &b""[..]), (Some(503), b"{}"), (Some(200), b"not json")] {
        let (req, h) = request(&w, &root, Some(answer));
        assert_eq!(h.reply.as_ref().map(|r| r.status), Some(503), "failing closed: sidecar_unavailable");
        assert_eq!(h.count_of(Metric::RefundQueued), 1);
        sent.push(Abandoned { decision_id: req.decision_id.clone().unwrap(), key_hash: req.key_hash });
    }
    assert_eq!(w.refunds().borrow().len(), 3);
    assert_eq!(flushed(&mut w, &mut root), sent, "each with the id its call carried");
    assert!(sent.windows(2).all(|p| p[0].decision_id != p[1].decision_id));
    let token = root.calls.len() as u32;
    w.on_call_response(&mut root, token, Some(200), Vec::new);
    assert_eq!(root.count_of(Metric::Flush(Stream::Refunds, FlushEvent::BatchesSent)), 1);
    root.now_ms = T + 100;
    assert!(flushed(&mut w, &mut root).is_empty(), "sent once when taken");
}

#[test]
fn a_refund_batch_not_taken_is_sent_again() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    request(&w, &root, Some((Some(504), b"")));
    let first = flushed(&mut w, &mut root);
    let token = root.calls.len() as u32;
    w.on_call_response(&mut root, token, Some(503), Vec::new);
    root.now_ms = T + 100;
    assert_eq!(flushed(&mut w, &mut root), first);
}

#[test]
fn a_client_gone_while_the_call_is_in_flight_is_refunded() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"failureMode":"open"}"#);
    let (req, h) = request(&w, &root, None);
    assert_eq!(h.count_of(Metric::RefundQueued), 1);
    assert_eq!(flushed(&mut w, &mut root), [Abandoned { decision_id: req.decision_id.unwrap(), key_hash: req.key_hash }]);
}

#[test]
fn answered_decisions_and_requests_let_through_are_not_refunded() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    request(&w, &root, Some((Some(200), ALLOW)));
    request(&w, &root, Some((Some(200), DENY)));
    assert!(flushed(&mut w, &mut root).is_empty());

    // failing open, the request is admitted: what its decision took stays taken
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"failureMode":"open"}"#);
    let (_, h) = request(&w, &root, Some((Some(504), b"")));
    assert!(h.reply.is_none(), "let through, degraded");
    assert_eq!(h.count_of(Metric::RefundQueued), 0);
    assert!(flushed(&mut w, &mut root).is_empty());
}
