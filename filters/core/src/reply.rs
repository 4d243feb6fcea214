//! The filter's own replies: a JSON [`ErrorBody`] (`{"error": code, "message": …}`) with
//! `content-type: application/json`, whoever refuses the request (authentication, limits,
//! routing, a failed sidecar, an open breaker).

use crate::host::Host;
use tollgate_wire::ErrorBody;

/// Replies `status` with the JSON error `code`; `extra` headers follow `content-type`.
pub fn json_error(host: &mut impl Host, status: u16, code: &str, message: &str, limit: Option<&str>, extra: &[(&str, &str)]) {
    let error = ErrorBody { error: code.into(), message: message.into(), limit: limit.map(str::to_string) };
    let body = serde_json::to_vec(&error).unwrap_or_else(|_| br#"{"error":"internal","message":""}"#.to_vec());
    let mut headers: Vec<(&str, &str)> = Vec::with_capacity(1 + extra.len());
    headers.push(("content-type", "application/json"));
    headers.extend_from_slice(extra);
    host.send_reply(status, &headers, &body);
}
