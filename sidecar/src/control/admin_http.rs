//! What the admin API's route modules share ([`super::admin`], [`super::admin_keys`]): their
//! state, and the JSON shape of every answer (errors name their code and, for bad input, the
//! field).

use crate::control::Control;
use crate::secret::Secret;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;

/// The admin API's state: the configuration plane and the token.
pub struct AdminState {
    pub control: Arc<Control>,
    /// The bearer token every call must carry.
    pub(super) token: Secret,
}

pub fn reply(status: StatusCode, body: Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

pub fn error(status: StatusCode, code: &str, field: Option<&str>, message: impl std::fmt::Display) -> Response {
    let mut body = json!({"error": code, "message": message.to_string()});
    if let Some(f) = field {
        body["field"] = json!(f);
    }
    reply(status, body)
}

pub fn unavailable(e: impl std::fmt::Display) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", None, e)
}
