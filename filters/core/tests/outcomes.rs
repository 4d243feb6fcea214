#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! How a response to an idempotency claim or a cache miss ends, through a mock host: a claim is
//! released only when its operation is known undone (decision 166); trailers end a response, and
//! a gRPC failure is never stored as a success (decision 173); an event stream to store that
//! outgrows its bound is read for its usage from its tail, never stored in part (decision 170).

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use crate::responses::{host, upstream, Rig, CLAIMED, CONFIG, MISS};
use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::filter::kept::KeptBudget;
use tollgate_filter_core::filter::response::SSE_TAIL;
use tollgate_filter_core::host::Action;
use tollgate_filter_core::stats::Metric;
use tollgate_wire::responses::StoreBatch;

/// Decision 166: a claim is released only when its operation is known undone — the upstream
/// answered (a non-2xx), or the request never reached one. A gateway timeout, a reset after the
/// request went out, a client gone before any answer: the operation may have run or still be
/// running, so nothing is sent and the claim stays in flight until it expires (a retry gets 409,
/// never a second run).
#[test]
fn a_claim_is_released_only_when_its_operation_is_known_undone() {
    let upstream_address = ("upstream.address", "127.0.0.1:8080");
    // (status, code details, an upstream was chosen, released)
    let cases: [(Option<&str>, Option<&str>, bool, bool); 9] = [
        (Some("503"), Some("via_upstream"), true, true),
        (Some("503"), Some("upstream_reset_before_response_started{remote_connection_failure}"), true, true),
        (Some("503"), Some("upstream_reset_before_response_started{connection_timeout}"), true, true),
        (Some("503"), Some("upstream_reset_before_response_started{remote_refused_stream_reset}"), true, true),
        (Some("503"), Some("no_healthy_upstream"), true, true),
        (Some("503"), None, false, true),
        (Some("504"), Some("upstream_response_timeout"), true, false),
        (Some("503"), Some("upstream_reset_before_response_started{connection_termination}"), true, false),
        (None, Some("downstream_remote_disconnect"), true, false),
    ];
    for (status, details, chosen, released) in cases {
        let rig = Rig::new();
        let mut h = host("POST", "/orders").with_header("idempotency-key", "\"order-1\"");
        if let Some(d) = details {
            h = h.with_property("response.code_details", d);
        }
        if chosen {
            h = h.with_property(upstream_address.0, upstream_address.1);
        }
        let mut f = rig.request(&mut h);
        f.on_sidecar_response(&mut h, 1, Some(200), CLAIMED);
        let what = format!("{status:?} {details:?}");
        if let Some(status) = status {
            upstream(&mut h, status, &[]);
            assert_eq!(f.on_response_headers(&mut h, true), if released { Action::Pause } else { Action::Continue }, "{what}");
        }
        if released {
            assert_eq!(h.calls.len(), 2, "{what}: the release is sent at the response's end");
            let batch: StoreBatch = serde_json::from_slice(&h.calls[1].body).unwrap();
            assert!(batch.responses[0].response.is_none(), "{what}");
        }
        f.on_log(&mut h);
        let queued = rig.stored().responses;
        if released {
            assert_eq!(queued.len(), 1, "{what}: the call died with the stream, its batch sends it");
        } else {
            assert_eq!(h.calls.len(), 1, "{what}: no outcome call");
            assert!(queued.is_empty(), "{what}: nothing queued, the claim stays in flight");
            assert_eq!(h.metrics.get(&Metric::IdempotencyOutcomeUnknown), Some(&1), "{what}");
        }
    }
}

/// Decision 173: trailers (HTTP/2, gRPC) end a response as a body's end of stream does: an
/// idempotency outcome is stored before they reach the client, a cache fill is queued; a gRPC
/// status other than 0 (in the trailers, or in the headers of a trailers-only answer) is a
/// failure whatever the HTTP status says. Before, a response ending with trailers was never
/// complete: its outcome was stored at the log phase without its body, after the client had it.
#[test]
fn trailers_end_a_response_and_a_grpc_failure_is_not_a_success() {
    for (grpc_status, in_headers) in [("0", false), ("13", false), ("14", true)] {
        let failed = grpc_status != "0";
        // an idempotency claim
        let rig = Rig::new();
        let mut h = host("POST", "/orders").with_header("idempotency-key", "\"order-1\"").with_property("response.code_details", "via_upstream");
        let mut f = rig.request(&mut h);
        f.on_sidecar_response(&mut h, 1, Some(200), CLAIMED);
        let mut headers = vec![("content-type", "application/grpc")];
        if in_headers {
            headers.push(("grpc-status", grpc_status));
        }
        upstream(&mut h, "200", &headers);
        assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
        h.response_chunk = b"\x00\x00\x00\x00\x02hi".to_vec();
        assert_eq!(f.on_response_body(&mut h, 7, false), Action::Continue);
        h.response_trailers = vec![("grpc-status".into(), grpc_status.into())];
        assert_eq!(f.on_response_trailers(&mut h), Action::Pause, "{grpc_status}: the trailers wait for the outcome");
        let batch: StoreBatch = serde_json::from_slice(&h.calls[1].body).unwrap();
        let stored = batch.responses[0].response.as_ref();
        assert_eq!(stored.is_some(), !failed, "{grpc_status}: {stored:?}");
        if let Some(r) = stored {
            assert_eq!((r.status, r.truncated, r.body_bytes().unwrap().len()), (200, false, 7), "the whole body");
        }
        // a cache fill
        let rig = Rig::new();
        let mut h = host("GET", "/v1/chat");
        let mut f = rig.request(&mut h);
        f.on_sidecar_response(&mut h, 1, Some(200), MISS);
        upstream(&mut h, "200", &headers);
        f.on_response_headers(&mut h, false);
        h.response_chunk = b"{}".to_vec();
        f.on_response_body(&mut h, 2, false);
        h.response_trailers = vec![("grpc-status".into(), grpc_status.into())];
        assert_eq!(f.on_response_trailers(&mut h), Action::Continue, "nothing to wait for");
        f.on_log(&mut h);
        assert_eq!(rig.stored().responses.len(), usize::from(!failed), "{grpc_status}");
    }
}

/// Decision 170 for a response that may be stored: an idempotent event stream with a token
/// budget is kept whole up to its bound; past it, only its tail is kept (for its usage, the
/// rest given back to the worker's budget), and its outcome is stored without a body — never a
/// body with its front cut off.
#[test]
fn a_stored_event_stream_past_its_bound_keeps_only_its_tail_and_is_stored_without_its_body() {
    const CLAIMED_WITH_BUDGET: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"k1","plan":"p",
      "ticket":{"tenant":"acme","requestId":"r1","budgets":[{"limit":"tokens","subject":"k.k1","period":202611,"reserved":1000}],"expiresAtMs":1,"mac":"0f"},
      "store":{"kind":"idempotency","tenant":"acme","keyId":"k1","digest":"d","key":"order-1","token":"t"}}"#;
    let rig = Rig::new();
    let total = 4 << 20;
    let budget = KeptBudget::new(total);
    let mut h = host("POST", "/orders").with_header("idempotency-key", "\"order-1\"").with_property("response.code_details", "via_upstream");
    let completions = Rc::new(RefCell::new(CompletionQueue::new(10)));
    let config = Rc::new(FilterConfig::parse(CONFIG.as_bytes()).unwrap());
    let mut f = AuthFilter::new(config, completions.clone())
        .with_routes(rig.routes.clone())
        .with_responses(rig.queue.clone(), Default::default())
        .with_kept_budget(budget.clone());
    f.on_request_headers(&mut h, true);
    f.on_sidecar_response(&mut h, 1, Some(200), CLAIMED_WITH_BUDGET);
    upstream(&mut h, "200", &[("content-type", "text/event-stream")]);
    assert_eq!(f.on_response_headers(&mut h, false), Action::Continue);
    let frame = b"data: {\"choices\":[{\"delta\":{\"content\":\"word \"}}]}\n\n".repeat(1000);
    for _ in 0..60 {
        h.response_chunk = frame.clone(); // ~2.9 MB in all
        f.on_response_body(&mut h, frame.len(), false);
    }
    assert!(total - budget.left() <= SSE_TAIL + frame.len(), "only the tail is kept: {} bytes", total - budget.left());
    let last = b"data: {\"choices\":[],\"usage\":{\"total_tokens\":4321}}\n\ndata: [DONE]\n\n";
    h.response_chunk = last.to_vec();
    assert_eq!(f.on_response_body(&mut h, last.len(), true), Action::Pause, "the outcome is stored first");
    let batch: StoreBatch = serde_json::from_slice(&h.calls[1].body).unwrap();
    let r = batch.responses[0].response.as_ref().expect("a 2xx outcome: the operation ran");
    assert!(r.truncated && r.body.is_empty(), "never a body with its front cut off: {} bytes", r.body.len());
    f.on_sidecar_response(&mut h, 2, Some(200), br#"{"stored":1}"#);
    f.on_log(&mut h);
    let batch = completions.borrow_mut().begin_flush(100).expect("the completion report");
    let reports: tollgate_wire::CompletionBatch = serde_json::from_slice(&batch).unwrap();
    assert_eq!(reports.completions[0].tokens, Some(4321), "the usage read from the tail");
}
