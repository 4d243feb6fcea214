//! Every error answer as JSON: `{"error": <code>, "message": <text>}` (docs/openapi.json's
//! `Error`). The handlers answer JSON themselves; this layer covers what the framework answers
//! before a handler runs (413 for a body over the limit, 404, 405, 415, a body that cannot be
//! read), which would otherwise be text/plain.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;

/// `axum::middleware::map_response(json_errors)`: a 4xx/5xx answer that is not JSON becomes one,
/// its status and headers kept.
pub async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // The framework's text (e.g. "length limit exceeded"), bounded: it is a short message.
    let text = axum::body::to_bytes(body, 4096).await.map(|b| String::from_utf8_lossy(&b).trim().to_string()).unwrap_or_default();
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_string() } else { text };
    let body = serde_json::json!({"error": code(status), "message": message}).to_string();
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}

fn code(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "bad_request",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        s if s.is_server_error() => "internal",
        _ => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    #[tokio::test]
    async fn a_text_error_becomes_json_and_the_rest_is_untouched() {
        let r = json_errors((StatusCode::PAYLOAD_TOO_LARGE, "length limit exceeded").into_response()).await;
        assert_eq!(r.status(), 413);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!((v["error"].as_str(), v["message"].as_str()), (Some("payload_too_large"), Some("length limit exceeded")));
        let ok = json_errors((StatusCode::OK, "plain").into_response()).await;
        assert_eq!(ok.headers()[header::CONTENT_TYPE], "text/plain; charset=utf-8");
        let r = json_errors(StatusCode::METHOD_NOT_ALLOWED.into_response()).await;
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        assert!(String::from_utf8_lossy(&body).contains("method_not_allowed"));
    }
}
