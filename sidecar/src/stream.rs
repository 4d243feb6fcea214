//! `POST /tollgate.v1.Decisions/Decide`: a worker's decisions on one long-lived gRPC stream
//! (decision 223; the wire format is `tollgate_wire::stream`).
//!
//! Each message read is one decision, decided concurrently with the others exactly as
//! `/v1/decide` decides it; its answer is written as soon as it is ready, carrying the message's
//! `seq`. At most [`IN_FLIGHT`] decisions of one stream run at once: past that the stream is not
//! read on (HTTP/2 flow control holds the filter back). The stream ends when the filter ends its
//! side (after every answer), when it sends bytes that are no gRPC message of ours (status
//! `INVALID_ARGUMENT`), or when the sidecar stops (status `UNAVAILABLE`, after the decisions in
//! flight are answered): the filter then fails what it still waits for and opens a new stream.
//!
//! A message is compact or JSON (decision 224: `tollgate_wire::compact`); its answer is written in
//! the same format. The answer head says compact messages are read ([`compact::FORMAT_HEADER`]),
//! so a filter that knows them sends them and an older one goes on with JSON.

use crate::decision::DecideError;
use crate::server::AppState;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, Semaphore};
use tollgate_wire::compact;
use tollgate_wire::stream::{frame_into, take_message, StreamAnswer, StreamItem};

/// Most decisions of one stream decided at once.
const IN_FLIGHT: usize = 1024;

/// gRPC status codes the stream ends with.
const GRPC_OK: &str = "0";
const GRPC_INVALID_ARGUMENT: &str = "3";
const GRPC_UNAVAILABLE: &str = "14";

/// The stream's route, for the filter-facing router (crate::server::router).
pub fn routes() -> axum::Router<Arc<AppState>> {
    axum::Router::new().route(tollgate_wire::stream::DECIDE_STREAM_PATH, axum::routing::post(decide_stream))
}

pub async fn decide_stream(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let (tx, rx) = mpsc::channel::<Frame>(256);
    tokio::spawn(read(state, req.into_body(), tx));
    let mut response = Response::new(Body::new(Answers { rx }));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc+json"));
    response.headers_mut().insert(compact::FORMAT_HEADER, HeaderValue::from_static(compact::FORMAT_COMPACT));
    *response.status_mut() = StatusCode::OK;
    response
}

/// What the answer side writes: a framed message, or the trailers that end it.
enum Frame {
    Data(Bytes),
    Trailers(HeaderMap),
}

/// The response body: the frames the reader and its decisions hand over, in order of readiness.
struct Answers {
    rx: mpsc::Receiver<Frame>,
}

impl http_body::Body for Answers {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|f| {
            f.map(|f| {
                Ok(match f {
                    Frame::Data(b) => http_body::Frame::data(b),
                    Frame::Trailers(t) => http_body::Frame::trailers(t),
                })
            })
        })
    }
}

/// Reads the stream's messages until it ends, decides each, and ends the answer side with the
/// stream's status once every decision in flight is answered.
async fn read(state: Arc<AppState>, body: Body, tx: mpsc::Sender<Frame>) {
    let open = metrics::gauge!(crate::metrics::DECISION_STREAMS);
    open.increment(1.0);
    let read_compact = metrics::counter!(crate::metrics::STREAM_MESSAGES, "format" => "compact");
    let read_json = metrics::counter!(crate::metrics::STREAM_MESSAGES, "format" => "json");
    let mut data = body.into_data_stream();
    let (mut buf, permits) = (Vec::new(), Arc::new(Semaphore::new(IN_FLIGHT)));
    let mut decisions = tokio::task::JoinSet::new();
    let status = 'read: loop {
        let chunk = tokio::select! {
            _ = state.stopping.cancelled() => break 'read (GRPC_UNAVAILABLE, "the sidecar is stopping".to_string()),
            chunk = data.next() => chunk,
            Some(_) = decisions.join_next(), if !decisions.is_empty() => continue,
        };
        let bytes = match chunk {
            None => break (GRPC_OK, String::new()),
            Some(Ok(bytes)) => bytes,
            Some(Err(e)) => break (GRPC_UNAVAILABLE, format!("the stream broke: {e}")),
        };
        buf.extend_from_slice(&bytes);
        loop {
            let message = match take_message(&mut buf) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => break 'read (GRPC_INVALID_ARGUMENT, e.to_string()),
            };
            let is_compact = compact::is_compact(&message);
            let item = if is_compact { compact::decode_item(&message) } else { serde_json::from_slice::<StreamItem>(&message).map_err(|e| e.to_string()) };
            let item = match item {
                Ok(i) => i,
                Err(e) => break 'read (GRPC_INVALID_ARGUMENT, format!("invalid decision message: {e}")),
            };
            if is_compact { &read_compact } else { &read_json }.increment(1);
            state.filter_calls.touch();
            let Ok(permit) = permits.clone().acquire_owned().await else { break 'read (GRPC_UNAVAILABLE, String::new()) };
            let (state, tx) = (state.clone(), tx.clone());
            decisions.spawn(async move {
                let answer = decide(&state, item, is_compact).await;
                drop(permit);
                let _ = tx.send(Frame::Data(answer)).await;
            });
        }
    };
    while decisions.join_next().await.is_some() {}
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static(status.0));
    if let Ok(message) = HeaderValue::from_str(&status.1) {
        if !status.1.is_empty() {
            trailers.insert("grpc-message", message);
        }
    }
    if status.0 != GRPC_OK {
        tracing::debug!(status = status.0, why = %status.1, "a decision stream ends");
    }
    let _ = tx.send(Frame::Trailers(trailers)).await;
    open.decrement(1.0);
}

/// One message's decision, framed, in the message's format.
async fn decide(state: &AppState, item: StreamItem, compact: bool) -> Bytes {
    let decided = crate::server::decide_one(state, &item.request, item.traceparent.as_deref().map(str::as_bytes)).await;
    crate::testing::decide_answer_delay().await;
    let seq = item.seq;
    let answer = match decided {
        Ok(decision) => StreamAnswer { seq, status: 200, decision: Some(decision), error: None },
        Err(DecideError::BadRequest(_)) => StreamAnswer { seq, status: 400, decision: None, error: Some("bad_request".into()) },
        Err(DecideError::Unavailable(_)) => StreamAnswer { seq, status: 503, decision: None, error: Some("store_unavailable".into()) },
    };
    let encode = |a: &StreamAnswer| if compact { compact::encode_answer(a) } else { serde_json::to_vec(a).map_err(|e| e.to_string()) };
    // an answer that cannot be written still answers its seq: the filter applies its failure mode
    let encoded = encode(&answer).or_else(|_| encode(&StreamAnswer { seq, status: 500, decision: None, error: Some("internal".into()) })).unwrap_or_default();
    let mut framed = Vec::with_capacity(encoded.len() + 5);
    frame_into(&mut framed, &encoded);
    Bytes::from(framed)
}
