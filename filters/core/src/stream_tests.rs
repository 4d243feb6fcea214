use super::*;
use crate::mock::MockHost;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn sidecar() -> Sidecar {
    Sidecar { secret: Some("s3cret-s3cret-s3cret".into()), ..Sidecar::default() }
}

fn request(key: &str) -> DecideRequest {
    DecideRequest::new(key, "GET", "api.test", "/")
}

fn answer(seq: u64, status: u16) -> Vec<u8> {
    let a = StreamAnswer { seq, status, decision: (status == 200).then(|| tollgate_wire::DecideResponse::allow("t", "k", "p")), error: None };
    serde_json::to_vec(&a).unwrap()
}

fn open(host: &mut MockHost) -> DecisionStream {
    open_as(host, Head::Json)
}

fn open_as(host: &mut MockHost, head: Head) -> DecisionStream {
    let mut s = DecisionStream::default();
    s.enable();
    s.keep_open(host, &sidecar());
    assert!(!s.is_open(), "not before a decision asked for it");
    assert!(s.send(host, 0, &request("first"), None, 0).is_err(), "the first decision is called as before");
    s.keep_open(host, &sidecar());
    assert!(!s.is_open(), "opening: until the sidecar's answer head");
    assert!(s.send(host, 0, &request("second"), None, 0).is_err());
    let token = 1000 + host.streams_opened.len() as u32;
    s.on_head(host, token + 1, head);
    assert!(!s.is_open(), "another stream's head");
    s.on_head(host, token, head);
    assert!(s.is_open());
    s
}

#[test]
fn a_sidecar_that_does_not_serve_the_stream_fails_no_decision() {
    let mut host = MockHost::new();
    let mut s = DecisionStream::default();
    s.enable();
    assert!(s.send(&mut host, 1, &request("a"), None, 100).is_err());
    s.keep_open(&mut host, &sidecar());
    s.on_head(&mut host, 1001, Head::NotServed); // a 404 of an older sidecar
    assert!(!s.is_open());
    assert!(s.send(&mut host, 2, &request("b"), None, 100).is_err(), "called as before");
    assert!(host.stream_sent.is_empty());
    assert!(s.on_close(&mut host, 1001, 12).is_empty(), "nothing was out on it");
    assert!(!s.is_open());
}

#[test]
fn a_disabled_stream_never_opens_and_a_closed_one_takes_nothing() {
    let mut host = MockHost::new();
    let mut s = DecisionStream::default();
    s.keep_open(&mut host, &sidecar());
    assert!(!s.is_open() && host.streams_opened.is_empty());
    assert!(s.send(&mut host, 1, &request("a"), None, 100).is_err());
    assert!(host.stream_sent.is_empty());
}

#[test]
fn the_stream_opens_with_the_secret_and_answers_find_their_request_in_any_order() {
    let mut host = MockHost::new();
    let mut s = open(&mut host);
    let (cluster, service, method, metadata) = host.streams_opened[0].clone();
    assert_eq!((cluster.as_str(), service.as_str(), method.as_str()), ("tollgate_sidecar", "tollgate.v1.Decisions", "Decide"));
    assert_eq!(metadata, vec![(SECRET_HEADER.to_string(), b"s3cret-s3cret-s3cret".to_vec())]);
    s.send(&mut host, 7, &request("a"), Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), 100).unwrap();
    s.send(&mut host, 8, &request("b"), None, 100).unwrap();
    let sent: Vec<serde_json::Value> = host.stream_sent.iter().map(|(_, m)| serde_json::from_slice(m).unwrap()).collect();
    assert_eq!((sent[0]["seq"].as_u64(), sent[1]["seq"].as_u64()), (Some(1), Some(2)));
    assert_eq!(sent[0]["request"]["keyHash"], "a");
    assert!(sent[0]["traceparent"].is_string() && sent[1].get("traceparent").is_none());
    assert_eq!(host.metrics.get(&Metric::DecisionsStreamed), Some(&2));
    // the second answers first
    let d = s.on_message(&mut host, &answer(2, 200)).unwrap();
    assert_eq!((d.ctx, d.sent), (8, true));
    assert!(d.answer.is_ok());
    let d = s.on_message(&mut host, &answer(1, 503)).unwrap();
    assert_eq!(d.ctx, 7);
    assert_eq!(d.answer, Err("sidecar answered 503 (no error code)".into()));
    // a repeated or unknown seq, or bytes that are no answer, deliver nothing
    assert!(s.on_message(&mut host, &answer(1, 200)).is_none());
    assert!(s.on_message(&mut host, &answer(99, 200)).is_none());
    assert!(s.on_message(&mut host, b"\xff{not json").is_none());
    assert_eq!(s.in_flight(), 0);
}

#[test]
fn a_decision_not_answered_in_time_fails_as_sent_and_its_late_answer_is_ignored() {
    let mut host = MockHost::new();
    let mut s = open(&mut host);
    s.send(&mut host, 1, &request("a"), None, 100).unwrap();
    s.send(&mut host, 2, &request("b"), None, 200).unwrap();
    assert!(s.expire(99).is_empty());
    let failed = s.expire(100);
    assert_eq!(failed.len(), 1);
    assert_eq!((failed[0].ctx, failed[0].sent), (1, true), "it may have been taken: refunded");
    assert!(failed[0].answer.is_err());
    assert!(s.on_message(&mut host, &answer(1, 200)).is_none());
    assert_eq!(s.in_flight(), 1);
}

#[test]
fn a_request_that_ends_leaves_the_stream_and_its_answer_is_ignored() {
    let mut host = MockHost::new();
    let mut s = open(&mut host);
    s.send(&mut host, 5, &request("a"), None, 100).unwrap();
    assert!(s.cancel(5));
    assert!(!s.cancel(5));
    assert!(s.on_message(&mut host, &answer(1, 200)).is_none());
}

#[test]
fn a_closed_stream_fails_what_is_out_and_reopens_after_its_pause() {
    let mut host = MockHost::new();
    host.now_ms = 1_000;
    let mut s = open(&mut host);
    let token = 1001;
    s.send(&mut host, 1, &request("a"), None, 5_000).unwrap();
    s.send(&mut host, 2, &request("b"), None, 5_000).unwrap();
    assert!(s.on_close(&mut host, token + 1, 14).is_empty(), "another stream's close is not this one's");
    let mut failed = s.on_close(&mut host, token, 14);
    failed.sort_by_key(|d| d.ctx);
    assert_eq!(failed.iter().map(|d| (d.ctx, d.sent)).collect::<Vec<_>>(), vec![(1, true), (2, true)]);
    assert!(!s.is_open());
    s.keep_open(&mut host, &sidecar());
    host.now_ms += REOPEN_AFTER_MS;
    s.keep_open(&mut host, &sidecar());
    assert!(!s.is_open(), "not reopened until a decision asks for it");
    host.now_ms = 1_000;
    assert!(s.send(&mut host, 3, &request("c"), None, 5_000).is_err(), "closed: the caller calls alone");
    host.now_ms = 1_000 + REOPEN_AFTER_MS - 1;
    s.keep_open(&mut host, &sidecar());
    assert!(!s.is_open());
    host.now_ms = 1_000 + REOPEN_AFTER_MS;
    s.keep_open(&mut host, &sidecar());
    s.on_head(&mut host, 1002, Head::Json);
    assert!(s.is_open());
    assert_eq!(host.streams_opened.len(), 2);
}

#[test]
fn a_stream_that_cannot_open_or_send_falls_back_and_is_retried_later() {
    let mut host = MockHost::new();
    host.open_error = Some("no such cluster".into());
    let mut s = DecisionStream::default();
    s.enable();
    assert!(s.send(&mut host, 1, &request("a"), None, 100_000).is_err());
    s.keep_open(&mut host, &sidecar());
    assert!(!s.is_open());
    host.open_error = None;
    s.keep_open(&mut host, &sidecar());
    assert!(!s.is_open(), "not before its pause");
    host.now_ms += REOPEN_AFTER_MS;
    s.keep_open(&mut host, &sidecar());
    s.on_head(&mut host, 1001, Head::Json);
    assert!(s.is_open());
    host.stream_error = Some("not found".into());
    assert!(s.send(&mut host, 1, &request("a"), None, 100_000).is_err());
    assert!(!s.is_open() && s.in_flight() == 0, "a refused send closes it; nothing is out");
    host.stream_error = None;
    assert!(s.send(&mut host, 2, &request("b"), None, 100_000).is_err(), "closed: asks for it again");
    host.now_ms += REOPEN_AFTER_MS;
    s.keep_open(&mut host, &sidecar());
    s.on_head(&mut host, 1002, Head::Json);
    assert!(s.is_open());
}

#[test]
fn a_worker_whose_stream_is_on_ticks_at_least_every_50_ms() {
    use crate::worker::{Seeds, Worker, STREAM_TICK};
    use std::time::Duration;
    let config = br#"{"leases":{"enabled":false},"changes":{"enabled":false},"responseCache":{"enabled":false},"completionFlushInterval":"1s"}"#;
    let config = std::rc::Rc::new(crate::config::FilterConfig::parse(config).unwrap());
    let seeds = Seeds { decision_ids: [3; 32], usage_ids: 1, hints_owner: 2, routes_owner: 3, changes_owner: 4 };
    let mut host = MockHost::new();
    let mut w = Worker::new(&mut host, config, seeds);
    assert_eq!(w.tick_period(), Duration::from_secs(1), "the completions' cadence");
    w.enable_stream();
    assert_eq!((w.tick_period(), w.tick_period_now(0)), (STREAM_TICK, STREAM_TICK), "a decision out waits at most one tick past its timeout");
}

#[test]
fn a_sidecar_that_reads_compact_messages_gets_them_and_either_format_of_answer_is_read() {
    let mut host = MockHost::new();
    let mut s = open_as(&mut host, Head::Compact);
    let req = DecideRequest { decision_id: Some("0".repeat(32)), ..request("a") };
    s.send(&mut host, 7, &req, Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), 100).unwrap();
    s.send(&mut host, 8, &request("b"), None, 100).unwrap();
    let sent: Vec<_> = host.stream_sent.iter().map(|(_, m)| compact::decode_item(m).unwrap()).collect();
    assert_eq!((sent[0].seq, sent[1].seq), (1, 2));
    assert_eq!(sent[0].request, req);
    assert!(sent[0].traceparent.is_some() && sent[1].traceparent.is_none());
    // a compact answer, then a JSON one: each is read in the format it came in
    let allow = StreamAnswer { seq: 1, status: 200, decision: Some(tollgate_wire::DecideResponse::allow("t", "k", "p")), error: None };
    let d = s.on_message(&mut host, &compact::encode_answer(&allow).unwrap()).unwrap();
    assert_eq!(d.ctx, 7);
    assert_eq!(d.answer, Ok(tollgate_wire::DecideResponse::allow("t", "k", "p")));
    let d = s.on_message(&mut host, &answer(2, 503)).unwrap();
    assert_eq!(d.ctx, 8);
    assert_eq!(d.answer, Err("sidecar answered 503 (no error code)".into()));
    // a garbled compact answer delivers nothing, and says so
    s.send(&mut host, 9, &request("c"), None, 100).unwrap();
    let mut garbled = compact::encode_answer(&StreamAnswer { seq: 3, ..allow }).unwrap();
    garbled.truncate(garbled.len() - 1);
    assert!(s.on_message(&mut host, &garbled).is_none());
    assert!(host.logs.iter().any(|(_, l)| l.contains("undecodable")), "{:?}", host.logs);
    assert_eq!(s.in_flight(), 1, "still out: it fails at its deadline");
}
