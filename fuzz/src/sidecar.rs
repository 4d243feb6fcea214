//! Fuzz entries over the sidecar's readers of untrusted bytes (sidecar/, sidecar/shared).
//!
//! One function per fuzz target. The same file is compiled into the stable replay test
//! `sidecar/tests/fuzz_regressions.rs` (by `#[path]`), which runs every committed
//! `fuzz/regressions/<target>/*` through the same function: uses only `tollgate_sidecar`,
//! `tollgate_shared`, `tollgate_wire` and `serde_json`.

use std::collections::BTreeMap;
use tollgate_sidecar::control::model::{Change, Kind, Snapshot};
use tollgate_wire::breaker::{valid_hint_part, HintReport};
use tollgate_wire::responses::{ClaimRenewal, StoreBatch};
use tollgate_wire::usage::UsageBatch;
use tollgate_wire::{CompletionBatch, DecideRequest};

/// `sidecar_bodies`: the body of every sidecar endpoint as the sidecar decodes it, then the pure
/// checks each handler applies before touching Redis: the decision stream's gRPC frames and
/// messages (JSON and compact), `POST /v1/decide`, `/v1/completions`,
/// `/v1/usage` (with `usage::invalid_reason`), `/v1/responses`, `/v1/responses/claims` (with
/// `responses::idempotency_target`), `/v1/breaker/hints`, and the
/// admin API's object bodies (`Snapshot::apply` of a put, for every kind). The first byte picks
/// the admin kind; the whole input is offered to every decoder.
/// A compact decision message (decision 224) the sidecar reads writes back as one that reads the
/// same.
fn compact_item_round_trips(m: &[u8]) {
    use tollgate_wire::compact::{decode_item, encode_item};
    if let Ok(item) = decode_item(m) {
        let mut again = Vec::new();
        let written = encode_item(&mut again, item.seq, item.traceparent.as_deref(), &item.request);
        assert_eq!(written.and_then(|_| decode_item(&again)).ok(), Some(item), "a compact decision message does not round-trip");
    }
}

pub fn sidecar_bodies(data: &[u8]) {
    // the decision stream's bytes (decision 223): whole messages come off the front, never more
    // than the bound, and a bad header is refused before its body
    let mut buf = data.to_vec();
    while let Ok(Some(m)) = tollgate_wire::stream::take_message(&mut buf) {
        assert!(m.len() <= tollgate_wire::stream::MAX_STREAM_MESSAGE);
        let _ = serde_json::from_slice::<tollgate_wire::stream::StreamItem>(&m);
        compact_item_round_trips(&m);
    }
    compact_item_round_trips(data);
    if let Ok(r) = serde_json::from_slice::<DecideRequest>(data) {
        let again: DecideRequest = serde_json::from_slice(&serde_json::to_vec(&r).unwrap_or_default()).unwrap_or_else(|_| r.clone());
        assert_eq!(again, r, "a decision request does not round-trip");
    }
    let _ = serde_json::from_slice::<CompletionBatch>(data);
    if let Ok(b) = serde_json::from_slice::<UsageBatch>(data) {
        for e in &b.events {
            if tollgate_sidecar::usage::invalid_reason(e).is_none() {
                // a valid event encodes to one spool line that decodes back to it
                let lines = tollgate_sidecar::usage::encode_lines(std::slice::from_ref(e), &[true]);
                let (decoded, bad) = tollgate_sidecar::usage::spool::decode_segment(&lines);
                assert_eq!((decoded.len(), bad), (1, 0), "a valid event is not one spool line");
            }
        }
    }
    let _ = serde_json::from_slice::<StoreBatch>(data);
    if let Ok(c) = serde_json::from_slice::<ClaimRenewal>(data) {
        for t in &c.claims {
            let _ = tollgate_sidecar::decision::responses::idempotency_target(t);
        }
    }
    if let Ok(h) = serde_json::from_slice::<HintReport>(data) {
        let _ = valid_hint_part(&h.provider) && valid_hint_part(&h.model);
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data.get(1..).unwrap_or_default()) {
        if v.is_object() {
            let kind = Kind::ALL[data.first().copied().unwrap_or(0) as usize % Kind::ALL.len()];
            if let Ok(empty) = Snapshot::from_file(&[], &[], &BTreeMap::new(), &[]) {
                if let Ok(next) = empty.apply(&Change::Put(kind, v)) {
                    assert!(next.validate().is_ok(), "an applied change leaves an invalid snapshot");
                }
            }
        }
    }
}

/// `spool_lines`: the spool line decoder (`usage::spool::decode_segment`, what the shipper reads
/// back from disk after a crash), the aggregation plan over the lines
/// (`tollgate_shared::aggregate::plan_segment`) and the recent-id scan of a restart.
pub fn spool_lines(data: &[u8]) {
    let (lines, bad) = tollgate_sidecar::usage::spool::decode_segment(data);
    let non_empty = data.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count();
    assert_eq!(lines.len() + bad, non_empty, "lines lost by the decoder");
    let plan = tollgate_shared::aggregate::plan_segment(&lines);
    let _ = format!("{plan:?}");
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct IdOnly<'a> {
        #[serde(borrow)]
        id: std::borrow::Cow<'a, str>,
    }
    for l in &lines {
        let _ = serde_json::from_slice::<IdOnly<'_>>(l);
    }
}

/// `sidecar_toml`: the sidecar's TOML configuration (`Config::from_toml`: parse and validate).
pub fn sidecar_toml(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = tollgate_sidecar::config::Config::from_toml(text);
    }
}
