//! Decisions on one long-lived stream per worker (decision 223).
//!
//! A Wasm worker opens one gRPC stream to the sidecar (Envoy's async gRPC client on the sidecar
//! cluster, `POST /tollgate.v1.Decisions/Decide`, HTTP/2) and sends each request's decision on it
//! as one message, instead of a new HTTP/2 stream per decision. Each message is one decision,
//! decided exactly as if it had come alone to `/v1/decide` (its own decision id, lease ask,
//! traceparent); its answer comes back as one message carrying the same `seq`, in whatever order
//! the decisions finish. A message's payload is JSON (the gRPC content type is
//! `application/grpc+json`); gRPC frames it (a flag byte, always 0 — no compression — and a
//! four-byte big-endian length).
//!
//! The stream carries the deployment's filter secret in its initial metadata, like every call.

use crate::{DecideRequest, DecideResponse};
use serde::{Deserialize, Serialize};

/// The gRPC service and method of the decision stream (Envoy's `grpc_stream` host call names
/// them apart; the HTTP/2 path is [`DECIDE_STREAM_PATH`]).
pub const DECIDE_STREAM_SERVICE: &str = "tollgate.v1.Decisions";
pub const DECIDE_STREAM_METHOD: &str = "Decide";
pub const DECIDE_STREAM_PATH: &str = "/tollgate.v1.Decisions/Decide";

/// Most bytes of one message either way (a decision request is far smaller).
pub const MAX_STREAM_MESSAGE: usize = 256 << 10;

/// One decision on the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamItem {
    /// The worker's number for this message: its answer carries it back.
    pub seq: u64,
    /// The request's well-formed W3C `traceparent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    pub request: DecideRequest,
}

/// One decision's outcome on the stream: what `/v1/decide` would have answered it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamAnswer {
    pub seq: u64,
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<DecideResponse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl StreamAnswer {
    /// The decision, or why there is none (the filter's failure mode then applies).
    pub fn into_result(self) -> Result<DecideResponse, String> {
        crate::batch::outcome(self.status, self.decision, self.error.as_deref(), "the stream's answer")
    }
}

/// Why a gRPC byte stream cannot be read on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The flag byte says compressed (none was agreed) or is not a flag.
    Compressed(u8),
    /// A message longer than [`MAX_STREAM_MESSAGE`].
    TooLong(usize),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Compressed(b) => write!(f, "a gRPC message with flag byte {b} (no compression was agreed)"),
            FrameError::TooLong(n) => write!(f, "a gRPC message of {n} bytes (at most {MAX_STREAM_MESSAGE})"),
        }
    }
}

/// Appends one gRPC frame of `payload` to `out`.
pub fn frame_into(out: &mut Vec<u8>, payload: &[u8]) {
    out.push(0);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Takes the first whole message off the front of `buf`: `Ok(None)` while it is incomplete.
/// Bytes are removed only with a whole message; a bad header is an error at once (before its
/// body arrives), so a peer cannot make the reader buffer a declared length past the limit.
pub fn take_message(buf: &mut Vec<u8>) -> Result<Option<Vec<u8>>, FrameError> {
    let Some(head) = buf.get(..5) else { return Ok(None) };
    if head[0] != 0 {
        return Err(FrameError::Compressed(head[0]));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_STREAM_MESSAGE {
        return Err(FrameError::TooLong(len));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let message = buf[5..5 + len].to_vec();
    buf.drain(..5 + len);
    Ok(Some(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_whole_split_and_several_at_once() {
        let mut wire = Vec::new();
        frame_into(&mut wire, b"{\"a\":1}");
        frame_into(&mut wire, b"");
        frame_into(&mut wire, b"xyz");
        // byte by byte: a message comes out only once whole
        let (mut buf, mut got) = (Vec::new(), Vec::new());
        for b in &wire {
            buf.push(*b);
            while let Some(m) = take_message(&mut buf).unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, vec![b"{\"a\":1}".to_vec(), Vec::new(), b"xyz".to_vec()]);
        assert!(buf.is_empty());
        // all at once
        let mut all = wire.clone();
        assert_eq!(take_message(&mut all).unwrap(), Some(b"{\"a\":1}".to_vec()));
        assert_eq!(take_message(&mut all).unwrap(), Some(Vec::new()));
        assert_eq!(take_message(&mut all).unwrap(), Some(b"xyz".to_vec()));
        assert_eq!(take_message(&mut all).unwrap(), None);
    }

    #[test]
    fn a_compressed_or_oversized_header_is_refused_before_its_body() {
        let mut compressed = vec![1, 0, 0, 0, 3];
        assert_eq!(take_message(&mut compressed), Err(FrameError::Compressed(1)));
        let n = (MAX_STREAM_MESSAGE + 1) as u32;
        let mut huge = vec![0];
        huge.extend_from_slice(&n.to_be_bytes());
        assert_eq!(take_message(&mut huge), Err(FrameError::TooLong(n as usize)));
        let mut max = vec![0];
        max.extend_from_slice(&(MAX_STREAM_MESSAGE as u32).to_be_bytes());
        assert_eq!(take_message(&mut max), Ok(None), "at the limit: waits for the body");
        assert_eq!(take_message(&mut vec![0, 0, 0]), Ok(None));
    }

    #[test]
    fn an_item_and_an_answer_read_as_the_single_call_would() {
        let item = StreamItem { seq: 7, traceparent: None, request: DecideRequest::new("ab", "GET", "h", "/") };
        let json = serde_json::to_string(&item).unwrap();
        assert_eq!(json, r#"{"seq":7,"request":{"keyHash":"ab","method":"GET","authority":"h","path":"/"}}"#);
        assert_eq!(serde_json::from_str::<StreamItem>(&json).unwrap(), item);
        let ok = StreamAnswer { seq: 7, status: 200, decision: Some(DecideResponse::allow("t", "k", "p")), error: None };
        assert_eq!(ok.into_result(), Ok(DecideResponse::allow("t", "k", "p")));
        let down = StreamAnswer { seq: 7, status: 503, decision: None, error: Some("store_unavailable".into()) };
        assert_eq!(down.into_result(), Err("sidecar answered 503 (store_unavailable)".into()));
        assert!(StreamAnswer { seq: 1, status: 200, decision: None, error: None }.into_result().is_err());
    }
}
