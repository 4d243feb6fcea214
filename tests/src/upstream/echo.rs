//! An upstream that echoes what it received as JSON: `{"method", "path", "headers": [[n, v]…]}`.
//! A request header `x-echo-usage: N` adds an LLM-style `"usage": {"total_tokens": N}`;
//! `x-echo-status: N` answers with that status (usage tests); `x-echo-delay-ms: N` answers after N ms
//! and `x-echo-cache-control: V` sets `Cache-Control: V` on the response (response-cache tests);
//! `x-echo-latin1: 1` adds a response header whose value is Latin-1, not UTF-8 (`x-latin1: café`
//! with é as the byte 0xE9; hostile-input tests); `x-echo-spoof: 1` adds the headers that speak for
//! the gateway (`x-tollgate-cache: hit`, `x-tollgate-target`, `idempotent-replayed: true`,
//! `ratelimit`, `ratelimit-policy`, each with an "evil" value); `x-echo-usage-raw: TEXT` answers
//! `{"usage": {"total_tokens": TEXT}}` with TEXT as written (an upstream reporting -1 or 2^64-1);
//! `x-echo-tool-input: JSON` answers an Anthropic-style body whose tool call's input is that JSON;
//! `x-echo-read-body: 1` reads the whole request body first and answers its size in
//! `x-echo-body-bytes`; `x-echo-llm: SHAPE` answers as an LLM provider would, after reading the body
//! (saying the body's `model` in `x-echo-request-model` and the path in `x-echo-path`);
//! `x-echo-pad: N` adds `"pad"`: N double quotes (2N bytes in the body, 4N once JSON-escaped again in
//! a stored-response batch: batch-size tests), and keeps `x-echo-usage`'s `usage` after it;
//! `x-echo-sse: N` answers an LLM-style server-sent-event stream (`text/event-stream`: content
//! frames, then a frame with `"usage": {"total_tokens": N}`, then `data: [DONE]`).
//! A request header value that is not UTF-8 is echoed with its bytes above 0x7F as `\xHH`.
//! Used by the functional tests (in-process) and as the demo upstream of `./build.sh up`.

use axum::body::Body;
use axum::extract::{Request, State};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use axum::http::{header, StatusCode};
use axum::response::Response;
use std::future::Future;

/// What the echo upstream saw.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Echoed {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Echoed {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// A header value as text: as it is when UTF-8, else every byte above 0x7F as `\xHH` (so a test
/// sees which bytes arrived, where a lossy decoding would turn any of them into U+FFFD).
fn escaped(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_string(),
        Err(_) => value.iter().map(|&b| if b.is_ascii() { char::from(b).to_string() } else { format!("\\x{b:02X}") }).collect(),
    }
}

async fn echo(State(seen): State<Arc<AtomicU64>>, req: Request) -> Response {
    seen.fetch_add(1, Ordering::SeqCst);
    let echoed = Echoed {
        method: req.method().to_string(),
        path: req.uri().path_and_query().map_or("/".to_string(), |p| p.to_string()),
        headers: req
            .headers()
            .iter()
            .map(|(n, v)| (n.to_string(), escaped(v.as_bytes())))
            .collect(),
    };
    let usage: Option<u64> = req.headers().get("x-echo-usage").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let body = match usage {
        Some(n) => serde_json::to_vec(&serde_json::json!({
            "method": echoed.method, "path": echoed.path, "headers": echoed.headers,
            "usage": {"prompt_tokens": 1, "completion_tokens": n.saturating_sub(1), "total_tokens": n},
        })),
        None => serde_json::to_vec(&echoed),
    }
    .unwrap_or_default();
    // `x-echo-usage-raw: TEXT`: `"total_tokens": TEXT` as written (a hostile upstream: -1, 2^64-1)
    let body = match req.headers().get("x-echo-usage-raw").and_then(|v| v.to_str().ok()) {
        Some(raw) => format!(r#"{{"usage":{{"prompt_tokens":1,"total_tokens":{raw}}}}}"#).into_bytes(),
        None => body,
    };
    // `x-echo-tool-input: JSON`: an Anthropic-style answer whose tool call's input is the
    // client's JSON (what a model fills as a prompt asks) and whose usage has no total_tokens
    let body = match req.headers().get("x-echo-tool-input").and_then(|v| v.to_str().ok()) {
        Some(input) => format!(r#"{{"content":[{{"type":"tool_use","input":{input}}}],"usage":{{"input_tokens":9,"output_tokens":40}}}}"#).into_bytes(),
        None => body,
    };
    // `x-echo-pad: N`: a large body whose text JSON escaping inflates
    let body = match req.headers().get("x-echo-pad").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok()) {
        Some(n) => {
            let mut padded = serde_json::json!({"path": echoed.path, "pad": "\"".repeat(n.min(1 << 20))});
            if let Some(n) = usage {
                padded["usage"] = serde_json::json!({"prompt_tokens": 1, "completion_tokens": n.saturating_sub(1), "total_tokens": n});
            }
            serde_json::to_vec(&padded).unwrap_or_default()
        }
        None => body,
    };
    // `x-echo-sse: N`: a stream of events, the usage in the last one before [DONE]
    let sse: Option<u64> = req.headers().get("x-echo-sse").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let body = match sse {
        Some(n) => {
            // `x-echo-sse-events: K`: K content events before the usage (20 by default)
            let k: u64 = req.headers().get("x-echo-sse-events").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(20);
            let mut text: String = (0..k.min(1_000_000)).map(|i| format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"word{i} \"}}}}]}}\n\n")).collect();
            text.push_str(&format!("data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{},\"total_tokens\":{n}}}}}\n\n", n.saturating_sub(1)));
            text.push_str("data: [DONE]\n\n");
            text.into_bytes()
        }
        None => body,
    };
    // `x-echo-llm: SHAPE`: a provider's answer (llm_answer), its model `x-echo-llm-model`
    let llm = req.headers().get("x-echo-llm").and_then(|v| v.to_str().ok()).map(|shape| {
        let model = req.headers().get("x-echo-llm-model").and_then(|v| v.to_str().ok()).unwrap_or("echo-model-1");
        llm_answer(shape, model)
    });
    let (body, llm_stream) = match llm {
        Some((text, stream)) => (text.into_bytes(), stream),
        None => (body, false),
    };
    let delay: u64 = req.headers().get("x-echo-delay-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0);
    if delay > 0 {
        // `x-echo-delay-ms`: a slow upstream is what the test asked for (requests held in flight
        // for concurrency caps, timeouts), not a wait for readiness
        tokio::time::sleep(std::time::Duration::from_millis(delay.min(30_000))).await;
    }
    let cache_control = req.headers().get("x-echo-cache-control").and_then(|v| v.to_str().ok()).map(str::to_string);
    let status = req
        .headers()
        .get("x-echo-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    let content_type = if sse.is_some() || llm_stream { "text/event-stream" } else { "application/json" };
    let mut response = Response::builder().status(status).header(header::CONTENT_TYPE, content_type);
    if let Some(cc) = cache_control {
        response = response.header(header::CACHE_CONTROL, cc);
    }
    if req.headers().contains_key("x-echo-spoof") {
        // an upstream speaking for the gateway
        for (name, value) in [("x-tollgate-cache", "hit"), ("x-tollgate-target", "evil"), ("idempotent-replayed", "true"), ("ratelimit", "\"evil\";r=999;t=1"), ("ratelimit-policy", "\"evil\";q=999;w=1")] {
            response = response.header(name, value);
        }
    }
    if req.headers().contains_key("x-echo-latin1") {
        if let Ok(v) = axum::http::HeaderValue::from_bytes(b"caf\xe9") {
            response = response.header("x-latin1", v);
        }
    }
    if req.headers().contains_key("x-echo-read-body") {
        // `x-echo-read-body`: the whole request body is read before answering (an upload), and
        // its size answered in `x-echo-body-bytes` (-1: it did not arrive whole)
        let read = axum::body::to_bytes(req.into_body(), usize::MAX).await.map_or(-1, |b| b.len() as i64);
        response = response.header("x-echo-body-bytes", read);
    } else if req.headers().contains_key("x-echo-llm") {
        // a provider reads the prompt before it answers: an answer sent while the request's
        // body is still on its way lets Envoy end the stream before the filter saw that body
        // (and the model it names). It says which model it was asked for (the body's top-level
        // `model`, else `-`) and on what path, to show what reached it (issue 42's aliases).
        let path = req.uri().path().to_string();
        let asked = axum::body::to_bytes(req.into_body(), usize::MAX)
            .await
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string));
        let asked = asked.and_then(|m| axum::http::HeaderValue::from_str(&m).ok()).unwrap_or(axum::http::HeaderValue::from_static("-"));
        response = response.header("x-echo-request-model", asked).header("x-echo-path", path);
    }
    response.body(Body::from(body)).unwrap_or_default()
}

/// Serves the echo on `listener` until `shutdown` completes.
pub async fn serve(listener: tokio::net::TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    serve_counted(listener, shutdown, Arc::default()).await
}

/// As [`serve`], counting the requests that reached the upstream in `seen`.
pub async fn serve_counted(
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    seen: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let app = axum::Router::new().fallback(echo).with_state(seen);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// An LLM provider's answer in `shape` (`openai`, `openai-sse`, `anthropic`, `anthropic-sse`,
/// `gemini`) from `model`, and whether it is an event stream. The tokens are fixed per shape:
/// OpenAI 20 in (16 cached) + 7 out; Anthropic 5 in + 100 written to + 1000 read from its cache
/// (1105 in, 1000 cached) + 12 out (streamed: 15 out); Gemini 11 in (4 cached) + 5 + 3 thoughts out.
pub fn llm_answer(shape: &str, model: &str) -> (String, bool) {
    let content = (0..20).map(|i| format!("word{i} ")).collect::<String>();
    match shape {
        "openai" => (
            format!(
                r#"{{"id":"c1","object":"chat.completion","model":"{model}","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":20,"completion_tokens":7,"total_tokens":27,"prompt_tokens_details":{{"cached_tokens":16}}}}}}"#
            ),
            false,
        ),
        "openai-sse" => {
            let mut s: String = (0..20)
                .map(|i| format!("data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"word{i} \"}}}}]}}\n\n"))
                .collect();
            s.push_str(&format!(
                "data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"{model}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":20,\"completion_tokens\":7,\"total_tokens\":27,\"prompt_tokens_details\":{{\"cached_tokens\":16}}}}}}\n\ndata: [DONE]\n\n"
            ));
            (s, true)
        }
        "anthropic" => (
            format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","model":"{model}","content":[{{"type":"text","text":"{content}"}}],"stop_reason":"end_turn","usage":{{"input_tokens":5,"cache_creation_input_tokens":100,"cache_read_input_tokens":1000,"output_tokens":12}}}}"#
            ),
            false,
        ),
        "anthropic-sse" => {
            let mut s = format!(
                "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"{model}\",\"content\":[],\"usage\":{{\"input_tokens\":5,\"cache_creation_input_tokens\":100,\"cache_read_input_tokens\":1000,\"output_tokens\":1}}}}}}\n\n"
            );
            // enough text that the filter keeps only the stream's tail (its last 64 KiB)
            for i in 0..2000 {
                s.push_str(&format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"word{i} of a long answer \"}}}}\n\n"));
            }
            s.push_str("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n");
            s.push_str("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
            (s, true)
        }
        "gemini" => (
            format!(
                r#"{{"candidates":[{{"content":{{"parts":[{{"text":"{content}"}}],"role":"model"}}}}],"usageMetadata":{{"promptTokenCount":11,"candidatesTokenCount":5,"thoughtsTokenCount":3,"totalTokenCount":19,"cachedContentTokenCount":4}},"modelVersion":"{model}"}}"#
            ),
            false,
        ),
        other => (format!(r#"{{"error":"unknown llm shape {other}"}}"#), false),
    }
}
