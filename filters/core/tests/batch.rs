#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Decision batches (decision 127), through a worker and mock hosts: a lone request calls alone;
//! while one is out, later decisions wait, wake the root once and leave together in one
//! `POST /v1/decide/batch` whose answers reach each request; a decision waits at most the
//! timeout for its batch, which has the whole timeout; a request that ends while waiting costs nothing, one that ends after its batch left
//! is refunded; a failed batch fails every item by the failure mode.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::rc::Rc;
use std::time::Duration;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::{Action, CallSpec};
use tollgate_filter_core::http::HttpFilter;
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::stats::Metric;
use tollgate_filter_core::worker::{Seeds, Worker};
use tollgate_wire::batch::{BatchAnswer, DecideBatch, DecideBatchAnswer};
use tollgate_wire::refunds::RefundBatch;
use tollgate_wire::DecideResponse;

const T: u64 = 1_000_000;
const SEEDS: Seeds = Seeds { decision_ids: [7; 32], usage_ids: 1, hints_owner: 2, routes_owner: 3, changes_owner: 4 };
const ALLOW: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold"}"#;

fn worker(config: &str) -> (Worker, MockHost) {
    let mut root = MockHost::new();
    root.now_ms = T;
    let mut w = Worker::new(&mut root, Rc::new(FilterConfig::parse(config.as_bytes()).unwrap()), SEEDS);
    w.enable_batching();
    (w, root)
}

fn path(call: &CallSpec) -> &str {
    call.headers.iter().find(|(n, _)| n == ":path").map(|(_, v)| v.as_str()).unwrap_or("")
}

/// Request `ctx` of key `key`, its headers in: paused for its decision.
fn start(w: &Worker, root: &MockHost, ctx: u32, key: &str) -> (HttpFilter, MockHost) {
    let mut h = MockHost::next_request(root).with_header("x-api-key", key);
    let mut f = w.request_in(ctx);
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    (f, h)
}

fn batch_calls(root: &MockHost) -> Vec<&CallSpec> {
    root.calls.iter().filter(|c| path(c) == "/v1/decide/batch").collect()
}

fn allow(tenant: &str) -> BatchAnswer {
    BatchAnswer { status: 200, decision: Some(DecideResponse::allow(tenant, "k", "gold")), error: None }
}

#[test]
fn a_lone_request_calls_alone_and_later_ones_ride_one_batch_answered_each_in_its_context() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"authCacheMaxTtl":"0ms"}"#);
    let (mut first, mut h1) = start(&w, &root, 1, "tg_a");
    assert_eq!(path(&h1.calls[0]), "/v1/decide", "nothing out: the first request calls alone");
    assert_eq!(h1.wakes, 0);
    let (mut second, mut h2) = start(&w, &root, 2, "tg_b");
    let (mut third, mut h3) = start(&w, &root, 3, "tg_c");
    assert!(h2.calls.is_empty() && h3.calls.is_empty(), "with a call out, later decisions wait");
    assert_eq!((h2.wakes, h3.wakes), (1, 0), "the first to wait wakes the root, once");
    assert!(w.send_decisions(&mut root).is_empty());
    let sent = batch_calls(&root);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].timeout, Duration::from_millis(25), "the oldest item's whole timeout is left");
    let batch: DecideBatch = serde_json::from_slice(&sent[0].body).unwrap();
    let hashes: Vec<&str> = batch.requests.iter().map(|i| i.request.key_hash.as_str()).collect();
    assert_eq!(hashes.len(), 2);
    assert_ne!(hashes[0], hashes[1]);
    assert!(batch.requests.iter().all(|i| i.request.decision_id.is_some()), "each item keeps its own decision id");
    assert_eq!((root.count_of(Metric::DecisionBatches), root.count_of(Metric::DecisionsBatched)), (1, 2));
    // nothing more is sent while the batch is out
    let (_fourth, h4) = start(&w, &root, 4, "tg_d");
    assert_eq!(h4.wakes, 0, "a batch is out: its answer sends the next");
    assert!(w.send_decisions(&mut root).is_empty());
    assert_eq!(batch_calls(&root).len(), 1);

    let answer = serde_json::to_vec(&DecideBatchAnswer { answers: vec![allow("second"), allow("third")] }).unwrap();
    let deliveries = w.on_call_response(&mut root, 1, Some(200), || answer);
    assert_eq!(batch_calls(&root).len(), 2, "the batch's answer sent the decision that waited meanwhile");
    let ctxs: Vec<(u32, bool)> = deliveries.iter().map(|d| (d.ctx, d.sent)).collect();
    assert_eq!(ctxs, [(2, true), (3, true)]);
    for (delivery, (f, h, tenant)) in deliveries.into_iter().zip([(&mut second, &mut h2, "second"), (&mut third, &mut h3, "third")]) {
        assert_eq!(f.on_batched_answer(h, delivery), Action::Continue);
        assert_eq!(h.header("x-tollgate-tenant"), Some(tenant));
    }
    assert_eq!(first.on_call_response(&mut h1, 1, Some(200), ALLOW), Action::Continue, "the lone call is answered in its own context");
}

#[test]
fn a_decision_waits_at_most_the_timeout_for_its_batch_which_has_the_whole_timeout() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"sidecar":{"timeout":"40ms"}}"#);
    let (_first, _h1) = start(&w, &root, 1, "tg_a");
    let (mut late, mut h2) = start(&w, &root, 2, "tg_b");
    root.now_ms = T + 10;
    let (_third, _h3) = start(&w, &MockHost { now_ms: T + 10, ..MockHost::new() }, 3, "tg_c");
    root.now_ms = T + 40;
    let deliveries = w.send_decisions(&mut root);
    assert_eq!(deliveries.iter().map(|d| (d.ctx, d.sent)).collect::<Vec<_>>(), [(2, false)], "past its deadline: failed unsent");
    let sent = batch_calls(&root);
    assert_eq!(sent.len(), 1, "the other one leaves");
    assert_eq!(sent[0].timeout, Duration::from_millis(40), "with the whole timeout, like a lone call");
    let delivery = deliveries.into_iter().next().unwrap();
    assert_eq!(late.on_batched_answer(&mut h2, delivery), Action::Pause);
    assert_eq!(h2.reply.as_ref().map(|r| r.status), Some(503), "failed closed");
    assert_eq!(h2.count_of(Metric::FailedClosed), 1);
    assert_eq!(h2.count_of(Metric::RefundQueued), 0, "never sent: nothing to refund");
    // while that batch is out, a decision that waits past its deadline fails at the next send
    // (a tick), not when the batch comes back
    let (_fourth, _h4) = start(&w, &root, 4, "tg_d");
    root.now_ms = T + 80;
    let deliveries = w.send_decisions(&mut root);
    assert_eq!(deliveries.iter().map(|d| (d.ctx, d.sent)).collect::<Vec<_>>(), [(4, false)]);
    assert_eq!(batch_calls(&root).len(), 1);
}

#[test]
fn a_request_that_ends_while_waiting_costs_nothing_and_one_that_ends_after_its_batch_left_is_refunded() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    let (_first, _h1) = start(&w, &root, 1, "tg_a");
    let (mut gone_early, mut h2) = start(&w, &root, 2, "tg_b");
    gone_early.on_log(&mut h2);
    assert!(w.send_decisions(&mut root).is_empty());
    assert!(batch_calls(&root).is_empty(), "its decision was dropped before it left");
    assert_eq!(h2.count_of(Metric::RefundQueued), 0);

    let (mut gone_late, mut h3) = start(&w, &root, 3, "tg_c");
    let (_stays, _h4) = start(&w, &root, 4, "tg_d");
    w.send_decisions(&mut root);
    let batch: DecideBatch = serde_json::from_slice(&batch_calls(&root)[0].body).unwrap();
    gone_late.on_log(&mut h3);
    assert_eq!(h3.count_of(Metric::RefundQueued), 1, "its decision left: what it took is refunded");
    let answer = serde_json::to_vec(&DecideBatchAnswer { answers: vec![allow("c"), allow("d")] }).unwrap();
    let deliveries = w.on_call_response(&mut root, 1, Some(200), || answer);
    assert_eq!(deliveries.iter().map(|d| d.ctx).collect::<Vec<_>>(), [4], "the ended request's answer is not delivered");
    root.now_ms = T + 60_000;
    w.on_tick(&mut root);
    let refunds: Vec<RefundBatch> =
        root.calls.iter().filter(|c| path(c) == "/v1/refunds").map(|c| serde_json::from_slice(&c.body).unwrap()).collect();
    let refunded: Vec<&str> = refunds.iter().flat_map(|b| &b.abandoned).map(|a| a.decision_id.as_str()).collect();
    assert_eq!(refunded, [batch.requests[0].request.decision_id.as_deref().unwrap()]);
}

#[test]
fn a_failed_or_short_batch_answer_fails_its_items_by_the_failure_mode() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"failureMode":"open"}"#);
    let (_first, _h1) = start(&w, &root, 1, "tg_a");
    let (mut a, mut ha) = start(&w, &root, 2, "tg_b");
    let (mut b, mut hb) = start(&w, &root, 3, "tg_c");
    w.send_decisions(&mut root);
    let deliveries = w.on_call_response(&mut root, 1, Some(504), Vec::new);
    assert_eq!(deliveries.len(), 2);
    for (delivery, (f, h)) in deliveries.into_iter().zip([(&mut a, &mut ha), (&mut b, &mut hb)]) {
        assert!(delivery.answer.is_err() && delivery.sent);
        assert_eq!(f.on_batched_answer(h, delivery), Action::Continue, "failed open");
        assert_eq!(h.header("x-tollgate-degraded"), Some("sidecar_unavailable"));
    }
    // a 200 that answers fewer items than it was sent cannot say which is whose: all fail
    let (_c, _hc) = start(&w, &root, 4, "tg_d");
    let (_d, _hd) = start(&w, &root, 5, "tg_e");
    w.send_decisions(&mut root);
    let answer = serde_json::to_vec(&DecideBatchAnswer { answers: vec![allow("d")] }).unwrap();
    let deliveries = w.on_call_response(&mut root, 2, Some(200), || answer);
    assert_eq!(deliveries.len(), 2);
    assert!(deliveries.iter().all(|d| d.answer.as_ref().is_err_and(|e| e.contains("answered 1 items for 2"))), "{deliveries:?}");
    // and so does one that answers more
    let (_e, _he) = start(&w, &root, 6, "tg_f");
    let (_f, _hf) = start(&w, &root, 7, "tg_g");
    w.send_decisions(&mut root);
    let answer = serde_json::to_vec(&DecideBatchAnswer { answers: vec![allow("f"), allow("g"), allow("h")] }).unwrap();
    let deliveries = w.on_call_response(&mut root, 3, Some(200), || answer);
    assert!(deliveries.len() == 2 && deliveries.iter().all(|d| d.answer.is_err()), "{deliveries:?}");
}

#[test]
fn batching_off_by_configuration_calls_alone_always() {
    let (w, root) = worker(r#"{"leases":{"enabled":false},"sidecar":{"batchDecisions":false}}"#);
    let (_first, h1) = start(&w, &root, 1, "tg_a");
    let (_second, h2) = start(&w, &root, 2, "tg_b");
    assert_eq!((path(&h1.calls[0]), path(&h2.calls[0])), ("/v1/decide", "/v1/decide"));
    assert_eq!(h2.wakes, 0);
}
