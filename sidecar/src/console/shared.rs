//! What every console handler shares: the [`Console`] state, the stylesheet, the security
//! headers of every answer, and small answers.

use super::config::ConsoleConfig;
use super::{api, usage};
use crate::control::Control;
use crate::secret::Secret;
use crate::server::AppState;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Rows per page of a listing.
pub const PAGE: usize = 20;

/// What every console handler shares.
pub struct Console {
    pub config: ConsoleConfig,
    pub api: api::Api,
    pub token: Secret,
    pub control: Arc<Control>,
    pub app: Arc<AppState>,
    pub usage: usage::UsageDb,
}

pub type Shared = Arc<Console>;

/// The stylesheet, embedded (the only asset).
pub const CSS: &str = include_str!("assets/console.css");

pub async fn css() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8"), (header::CACHE_CONTROL, "max-age=3600")], CSS).into_response()
}

/// The Content-Security-Policy of every console answer: nothing but this origin's stylesheet and
/// forms; no script at all.
pub const CSP: &str = "default-src 'self'; script-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

pub async fn security_headers(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // an invite link carries its token: never sent on to another site
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    r
}

/// A redirect after a form (303: the browser follows with GET).
pub fn see_other(to: &str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to.to_string())]).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_allows_no_script() {
        assert!(CSP.contains("script-src 'none'") && CSP.starts_with("default-src 'self'"));
        assert!(!CSS.contains("url(http"), "no asset from elsewhere");
    }
}
