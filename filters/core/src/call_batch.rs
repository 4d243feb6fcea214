//! Decision calls that wait together for a host's own connection leave as one batch (decision
//! 225): the native host's connection threads (`sidecar.address`, decision 219) join the
//! `POST /v1/decide` calls queued while they were busy into one `POST /v1/decide/batch`
//! (decision 127's endpoint: each item decided as if alone, concurrently), and split its answer
//! back into one answer per call. A call that waits alone goes alone, as before.
//!
//! Nothing here changes a decision: an item's outcome comes back as the answer its lone call
//! would have had (a compact answer, decision 224, read by [`crate::sidecar::interpret`]); a batch
//! that fails, or whose answer cannot say which outcome is whose, fails every call in it, as a
//! lone call's failure does (the failure mode, and refunds of decisions that were sent).

use crate::host::CallSpec;
use crate::sidecar::traceparent;
use crate::sidecar_http1::Answer;
use std::collections::VecDeque;
use tollgate_wire::batch::{DecideBatchAnswer, DECIDE_BATCH_PATH, MAX_DECIDE_BATCH};
use tollgate_wire::stream::StreamAnswer;
use tollgate_wire::{compact, DECIDE_PATH, TRACEPARENT_HEADER};

/// Most bytes of decision bodies in one batch, far below the sidecar's body limit (the Wasm
/// host's batches, crate::batch, keep the same bound).
pub const MAX_BATCH_BYTES: usize = 1 << 20;

fn header<'a>(call: &'a CallSpec, name: &str) -> Option<&'a str> {
    call.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// Whether `call` is a decision call (`POST /v1/decide` with a JSON object for its body).
pub fn is_decision(call: &CallSpec) -> bool {
    header(call, ":method") == Some("POST") && header(call, ":path") == Some(DECIDE_PATH) && call.body.first() == Some(&b'{')
}

/// Whether decision call `other` can ride the batch of decision call `first`: the same cluster
/// and the same headers (the sidecar's secret among them), but for the request's `traceparent`,
/// which travels inside its item.
pub fn joins(first: &CallSpec, other: &CallSpec) -> bool {
    // compared in place, without copies: the module's thread checks each waiting call under
    // the queue's lock
    fn rest(c: &CallSpec) -> impl Iterator<Item = &(String, String)> {
        c.headers.iter().filter(|(n, _)| n != TRACEPARENT_HEADER)
    }
    is_decision(other) && first.cluster == other.cluster && rest(first).eq(rest(other))
}

/// Whether a batch already holding `items` calls of `bytes` body bytes can take one of `more`.
pub fn has_room(items: usize, bytes: usize, more: usize) -> bool {
    items < MAX_DECIDE_BATCH && bytes + more <= MAX_BATCH_BYTES
}

/// Takes the next calls to make from `queue` (of jobs whose call `call` reads): the first, and
/// when it is a decision call, every later decision call that [`joins`] it, in their order, up
/// to a batch's bounds. What does not join stays in place, for the next take.
pub fn take<T>(queue: &mut VecDeque<T>, call: impl Fn(&T) -> &CallSpec) -> Vec<T> {
    let Some(first) = queue.pop_front() else { return Vec::new() };
    if !is_decision(call(&first)) {
        return vec![first];
    }
    let mut bytes = call(&first).body.len();
    let mut taken = vec![first];
    let mut i = 0;
    while i < queue.len() {
        let len = call(&queue[i]).body.len();
        if !joins(call(&taken[0]), call(&queue[i])) || !has_room(taken.len(), bytes, len) {
            i += 1;
            continue;
        }
        if let Some(job) = queue.remove(i) {
            bytes += len;
            taken.push(job);
        }
    }
    taken
}

/// The batch call carrying `calls` (decision calls that [`joins`] the first), in their order:
/// the first's headers on `/v1/decide/batch` (no `traceparent`, no `accept`: a batch answers
/// JSON), the shortest timeout. `None` for fewer than two calls, or a call that does not join.
pub fn join(calls: &[&CallSpec]) -> Option<CallSpec> {
    let (first, rest) = calls.split_first()?;
    if rest.is_empty() || !is_decision(first) || !rest.iter().all(|c| joins(first, c)) {
        return None;
    }
    let mut body = b"{\"requests\":[".to_vec();
    for (i, call) in calls.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.push(b'{');
        // written as a JSON string, escaped: `traceparent` checks the W3C fields, but a later
        // version's tail (after the 55th byte) is the client's own bytes, quotes included
        if let Some(tp) = traceparent(header(call, TRACEPARENT_HEADER)).and_then(|tp| serde_json::to_vec(tp).ok()) {
            body.extend_from_slice(b"\"traceparent\":");
            body.extend_from_slice(&tp);
            body.push(b',');
        }
        body.extend_from_slice(b"\"request\":");
        body.extend_from_slice(&call.body);
        body.push(b'}');
    }
    body.extend_from_slice(b"]}");
    let headers = first
        .headers
        .iter()
        .filter(|(n, _)| n != TRACEPARENT_HEADER && n != "accept")
        .map(|(n, v)| (n.clone(), if n == ":path" { DECIDE_BATCH_PATH.to_string() } else { v.clone() }))
        .collect();
    let timeout = calls.iter().map(|c| c.timeout).min().unwrap_or(first.timeout);
    Some(CallSpec { cluster: first.cluster.clone(), headers, body, timeout })
}

/// The batch's answer as `n` answers, one per call in the batch's order: each item's outcome as a
/// compact answer (its decision, or its status and error code). A batch answered otherwise (no
/// answer, another status, a body that is not a batch answer of `n` items) gives each call that
/// answer's status and body, which [`crate::sidecar::interpret`] reads as the failure it is.
pub fn split((status, body): Answer, n: usize) -> Vec<Answer> {
    let whole = || vec![(status, body.clone()); n];
    if status != Some(200) {
        return whole();
    }
    let Ok(answer) = serde_json::from_slice::<DecideBatchAnswer>(&body) else { return whole() };
    if answer.answers.len() != n {
        // matched by position: a list of another length cannot say which outcome is whose
        return vec![(None, Vec::new()); n];
    }
    answer
        .answers
        .into_iter()
        .map(|a| {
            let status = a.status;
            let one = StreamAnswer { seq: 0, status, decision: a.decision, error: a.error };
            match compact::encode_answer(&one) {
                Ok(bytes) => (Some(status), bytes),
                // past the compact form's bounds (a list of over `MAX_HEADERS` headers): the
                // decision as JSON, which `interpret` reads as well
                Err(_) => {
                    let json = one.decision.filter(|_| status == 200).and_then(|d| serde_json::to_vec(&d).ok());
                    (Some(status), json.unwrap_or_default())
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::{interpret, Sidecar};
    use std::time::Duration;
    use tollgate_wire::batch::{BatchAnswer, DecideBatch};
    use tollgate_wire::{DecideRequest, DecideResponse};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn decision(key: &str, tp: Option<&str>) -> CallSpec {
        let body = serde_json::to_vec(&DecideRequest::new(key, "GET", "h", "/")).unwrap();
        Sidecar::default().decide(body, tp)
    }

    #[test]
    fn decision_calls_join_into_one_batch_that_the_sidecar_reads_item_by_item() {
        let (a, b, c) = (decision("aa", Some(TP)), decision("bb", None), decision("cc", Some("not-a-traceparent")));
        assert!(is_decision(&a) && joins(&a, &b) && joins(&a, &c), "a traceparent does not keep calls apart");
        let batch = join(&[&a, &b, &c]).unwrap();
        assert_eq!(header(&batch, ":path"), Some(DECIDE_BATCH_PATH));
        assert_eq!(header(&batch, "accept"), None, "a batch answers JSON");
        assert_eq!(header(&batch, TRACEPARENT_HEADER), None);
        assert_eq!(header(&batch, "content-type"), Some("application/json"));
        let read: DecideBatch = serde_json::from_slice(&batch.body).unwrap();
        let keys: Vec<_> = read.requests.iter().map(|i| i.request.key_hash.as_str()).collect();
        assert_eq!(keys, ["aa", "bb", "cc"], "in the calls' order");
        let tps: Vec<_> = read.requests.iter().map(|i| i.traceparent.as_deref()).collect();
        assert_eq!(tps, [Some(TP), None, None], "only a well-formed traceparent is carried");
        assert_eq!(join(&[&a]), None, "one call goes alone");
        assert_eq!(join(&[]), None);
    }

    #[test]
    fn a_traceparent_cannot_write_into_the_batch() {
        // a later version's tail is not checked by `traceparent`: a client's quotes and braces
        let hostile = format!("{TP}-\"}},{{\"request\":{{\"keyHash\":\"victim\"}}}},{{\"traceparent\":\"x");
        assert_eq!(traceparent(Some(&hostile)), Some(hostile.as_str()), "the form the sidecar reads");
        let batch = join(&[&decision("aa", Some(&hostile)), &decision("bb", None)]).unwrap();
        let read: DecideBatch = serde_json::from_slice(&batch.body).unwrap();
        assert_eq!(read.requests.len(), 2, "no item added");
        assert_eq!(read.requests[0].traceparent.as_deref(), Some(hostile.as_str()), "carried as the client sent it");
        assert_eq!(read.requests[0].request.key_hash, "aa");
    }

    #[test]
    fn only_decision_calls_with_the_same_headers_join() {
        let a = decision("aa", None);
        let mut secret = decision("bb", None);
        secret.headers.push(("x-tollgate-sidecar-secret".into(), "other".into()));
        let mut cluster = decision("bb", None);
        cluster.cluster = "elsewhere".into();
        let completions = Sidecar::default().post_json("/v1/completions", b"{}".to_vec(), Duration::from_secs(1));
        let mut not_json = decision("bb", None);
        not_json.body = b"\xc1\x02".to_vec();
        for other in [&secret, &cluster, &completions, &not_json] {
            assert!(!joins(&a, other), "{other:?}");
            assert_eq!(join(&[&a, other]), None);
        }
        assert!(!is_decision(&completions) && !is_decision(&not_json));
        let mut shorter = decision("bb", None);
        shorter.timeout = Duration::from_millis(5);
        assert_eq!(join(&[&a, &shorter]).unwrap().timeout, Duration::from_millis(5), "the batch keeps the shortest deadline");
    }

    #[test]
    fn a_take_is_the_first_call_and_the_decisions_that_join_it_in_order() {
        let completion = || Sidecar::default().post_json("/v1/completions", b"{}".to_vec(), Duration::from_secs(1));
        let mut elsewhere = decision("ee", None);
        elsewhere.cluster = "elsewhere".into();
        let mut queue: VecDeque<CallSpec> = [decision("aa", None), completion(), decision("bb", Some(TP)), elsewhere, decision("cc", None)].into();
        let key = |c: &CallSpec| serde_json::from_slice::<DecideRequest>(&c.body).map(|r| r.key_hash).unwrap_or_default();
        let taken: Vec<_> = take(&mut queue, |c| c).iter().map(key).collect();
        assert_eq!(taken, ["aa", "bb", "cc"]);
        assert_eq!(queue.len(), 2, "the completion and the other cluster's decision stay, in order");
        assert_eq!(take(&mut queue, |c| c), [completion()], "a call that is no decision goes alone");
        assert_eq!(take(&mut queue, |c| c).iter().map(key).collect::<Vec<_>>(), ["ee"]);
        assert!(take(&mut queue, |c| c).is_empty());
        let mut many: VecDeque<CallSpec> = (0..MAX_DECIDE_BATCH + 3).map(|i| decision(&format!("k{i}"), None)).collect();
        assert_eq!(take(&mut many, |c| c).len(), MAX_DECIDE_BATCH, "a batch stops at its bound");
        assert_eq!(take(&mut many, |c| c).len(), 3);
    }

    #[test]
    fn a_batch_holds_at_most_its_items_and_bytes() {
        assert!(has_room(MAX_DECIDE_BATCH - 1, 0, 10));
        assert!(!has_room(MAX_DECIDE_BATCH, 0, 10));
        assert!(has_room(1, MAX_BATCH_BYTES - 10, 10));
        assert!(!has_room(1, MAX_BATCH_BYTES - 10, 11));
    }

    #[test]
    fn each_call_gets_its_items_outcome_as_its_lone_call_would() {
        let allow = DecideResponse::allow("t", "k", "p");
        let answers = vec![
            BatchAnswer { status: 200, decision: Some(allow.clone()), error: None },
            BatchAnswer { status: 503, decision: None, error: Some("store_unavailable".into()) },
            BatchAnswer { status: 200, decision: None, error: None },
        ];
        let body = serde_json::to_vec(&DecideBatchAnswer { answers }).unwrap();
        let split = split((Some(200), body), 3);
        let read: Vec<_> = split.iter().map(|(s, b)| interpret(*s, b)).collect();
        assert_eq!(read[0], Ok(allow));
        assert_eq!(read[1], Err("sidecar answered 503 (store_unavailable)".into()));
        assert!(read[2].is_err(), "an item without a decision fails its call");
    }

    #[test]
    fn a_batch_that_failed_fails_every_call_in_it() {
        let failed = |answer: Answer, n: usize| split(answer, n).iter().map(|(s, b)| interpret(*s, b)).collect::<Vec<_>>();
        assert_eq!(failed((None, Vec::new()), 2), vec![Err("sidecar response has no :status".to_string()); 2]);
        let busy = br#"{"error":"store_unavailable"}"#.to_vec();
        assert_eq!(failed((Some(503), busy), 2), vec![Err("sidecar answered 503".to_string()); 2]);
        for r in failed((Some(200), b"{\"answers\":".to_vec()), 2) {
            assert!(r.unwrap_err().starts_with("undecodable decision"));
        }
        // one outcome for two calls: whose it is cannot be known, so neither gets it
        let one = serde_json::to_vec(&DecideBatchAnswer { answers: vec![BatchAnswer { status: 200, decision: Some(DecideResponse::allow("t", "k", "p")), error: None }] }).unwrap();
        assert_eq!(failed((Some(200), one), 2), vec![Err("sidecar response has no :status".to_string()); 2]);
    }
}
