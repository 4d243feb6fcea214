//! The admin API, called in-process: the console builds the request an API client would send
//! (with the admin token) and hands it to the admin router itself. Same handlers, same
//! validation, same errors — and a route the API gains (key rotation) is one call away.

use crate::secret::Secret;
use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use serde_json::Value;
use tower::ServiceExt;

/// The largest API answer the console reads (a key listing page, a collection).
const MAX_ANSWER: usize = 16 * 1024 * 1024;

pub struct Api {
    router: Router,
    token: Secret,
}

/// An API answer: its status, its JSON body, and the next page's query when the API linked one.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub body: Value,
    pub next: Option<String>,
}

impl Reply {
    pub fn ok(&self) -> bool {
        self.status.is_success()
    }
    /// The API's error as a person reads it: `field: message` (or the status alone).
    pub fn error(&self) -> String {
        let message = self.body.get("message").and_then(Value::as_str).unwrap_or_else(|| self.status.canonical_reason().unwrap_or("error"));
        match self.body.get("field").and_then(Value::as_str) {
            Some(f) => format!("{f}: {message}"),
            None => message.to_string(),
        }
    }
    /// A JSON array answer's items (empty for anything else).
    pub fn items(&self) -> Vec<Value> {
        self.body.as_array().cloned().unwrap_or_default()
    }
}

impl Api {
    pub fn new(router: Router, token: Secret) -> Api {
        Api { router, token }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.call(Method::GET, path, None).await
    }

    pub async fn send(&self, method: Method, path: &str, body: &Value) -> Reply {
        self.call(method, path, Some(body.to_string())).await
    }

    async fn call(&self, method: Method, path: &str, body: Option<String>) -> Reply {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token.expose()))
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.map(Body::from).unwrap_or_else(Body::empty));
        let request = match request {
            Ok(r) => r,
            Err(e) => return failed(format!("bad request path {path:?}: {e}")),
        };
        let response = match self.router.clone().oneshot(request).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let status = response.status();
        let next = response.headers().get(header::LINK).and_then(|v| v.to_str().ok()).and_then(next_query);
        let bytes = match axum::body::to_bytes(response.into_body(), MAX_ANSWER).await {
            Ok(b) => b,
            Err(e) => return failed(format!("reading the answer: {e}")),
        };
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply { status, body, next }
    }
}

fn failed(message: String) -> Reply {
    Reply { status: StatusCode::INTERNAL_SERVER_ERROR, body: serde_json::json!({"error": "internal", "message": message}), next: None }
}

/// The `after` of a `Link: </v1/keys?limit=20&after=key_x&tenant=t>; rel="next"` header.
pub fn next_query(link: &str) -> Option<String> {
    let target = link.split(';').next()?.trim().trim_start_matches('<').trim_end_matches('>');
    let query = target.split_once('?')?.1;
    query.split('&').find_map(|p| p.strip_prefix("after=")).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_page_is_read_from_the_link_header() {
        assert_eq!(next_query("</v1/keys?limit=20&after=key_abc&tenant=acme>; rel=\"next\"").as_deref(), Some("key_abc"));
        assert_eq!(next_query("</v1/keys?limit=20>; rel=\"next\""), None);
        assert_eq!(next_query("garbage"), None);
    }

    #[test]
    fn errors_name_their_field() {
        let r = Reply { status: StatusCode::BAD_REQUEST, body: serde_json::json!({"error": "invalid", "field": "plan", "message": "no plan 'x'"}), next: None };
        assert_eq!(r.error(), "plan: no plan 'x'");
        let r = Reply { status: StatusCode::SERVICE_UNAVAILABLE, body: Value::Null, next: None };
        assert_eq!(r.error(), "Service Unavailable");
    }
}
