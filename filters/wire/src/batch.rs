//! Decisions of several requests of one worker in one call (decision 127).
//!
//! While a worker has a decision call out, the decisions its later requests need wait, and leave
//! together in one `POST /v1/decide/batch` as soon as no batch of that worker is out. Each item is
//! decided exactly as if it had come alone to `/v1/decide` (its own decision id, lease ask,
//! traceparent); the answer lists one outcome per item, in the items' order.

use crate::{DecideRequest, DecideResponse};
use serde::{Deserialize, Serialize};

/// Path of the batched decision endpoint on the sidecar.
pub const DECIDE_BATCH_PATH: &str = "/v1/decide/batch";
/// Most items in one batch: the filter sends at most this many, the sidecar refuses more (400).
pub const MAX_DECIDE_BATCH: usize = 128;

/// One request's decision in a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchItem {
    /// The request's well-formed W3C `traceparent` (what `/v1/decide` reads from its header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    pub request: DecideRequest,
}

/// `POST /v1/decide/batch`'s body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideBatch {
    pub requests: Vec<BatchItem>,
}

/// One item's outcome: what `/v1/decide` would have answered it — its status, and the decision
/// (200) or the error code (any other status).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchAnswer {
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecideResponse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /v1/decide/batch`'s 200 answer: one outcome per item, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideBatchAnswer {
    pub answers: Vec<BatchAnswer>,
}

impl BatchAnswer {
    /// The item's decision, or why it has none (the filter's failure mode then applies).
    pub fn into_result(self) -> Result<DecideResponse, String> {
        outcome(self.status, self.decision, self.error.as_deref(), "the batch answer")
    }
}

/// One decision's outcome as the sidecar answered it (a batch's item, a stream's answer; `what`
/// names the answer): the decision, or why there is none.
pub(crate) fn outcome(status: u16, decision: Option<DecideResponse>, error: Option<&str>, what: &str) -> Result<DecideResponse, String> {
    match (status, decision) {
        (200, Some(d)) => Ok(d),
        (200, None) => Err(format!("{what} has no decision for this request")),
        (s, _) => Err(format!("sidecar answered {s} ({})", error.unwrap_or("no error code"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_item_round_trips_and_an_answer_reads_as_the_single_call_would() {
        let item = BatchItem { traceparent: None, request: DecideRequest::new("ab", "GET", "h", "/") };
        let json = serde_json::to_string(&DecideBatch { requests: vec![item.clone()] }).unwrap();
        assert_eq!(json, r#"{"requests":[{"request":{"keyHash":"ab","method":"GET","authority":"h","path":"/"}}]}"#);
        let back: DecideBatch = serde_json::from_str(&json).unwrap();
        assert_eq!(back.requests, vec![item]);
        let ok = BatchAnswer { status: 200, decision: Some(DecideResponse::allow("t", "k", "p")), error: None };
        assert_eq!(ok.into_result(), Ok(DecideResponse::allow("t", "k", "p")));
        let unavailable = BatchAnswer { status: 503, decision: None, error: Some("store_unavailable".into()) };
        assert_eq!(unavailable.into_result(), Err("sidecar answered 503 (store_unavailable)".into()));
        let empty = BatchAnswer { status: 200, decision: None, error: None };
        assert!(empty.into_result().is_err());
    }
}
