//! The admin API's key routes (docs/openapi.json): issue, rotate, revoke and list API keys. Split
//! from [`super::admin`], whose token check, write tracking and error shape they share; the
//! lifecycle itself is [`crate::control::keys::ops`], which the console calls as well.

use super::admin_http::{error, reply, unavailable, AdminState};
use crate::apikey::KeyRecord;
use crate::control::keys::{self, list_query, KeyError};
use crate::control::Source;
use crate::keys::Id;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The key routes, merged into the admin router (under its token check and write tracking).
pub(super) fn routes() -> Router<Arc<AdminState>> {
    Router::new()
        .route("/v1/keys", get(list_keys).post(create_key))
        .route("/v1/keys/{id}/revoke", post(revoke_key))
        .route("/v1/keys/{id}/rotate", post(rotate_key))
}

/// A key as the admin API shows it (never its hash or raw value).
pub fn key_json(r: &KeyRecord) -> Value {
    json!({
        "key_id": r.key_id.as_str(), "tenant": r.tenant.as_str(), "plan": r.plan.as_str(), "status": r.status.as_str(),
        "created_at": r.created_at, "expires_at": r.expires_at, "revoked_at": r.revoked_at,
    })
}

/// A key operation's refusal as the admin API answers it.
fn refused(e: KeyError) -> Response {
    match e {
        KeyError::Invalid { field, message } => error(StatusCode::BAD_REQUEST, "invalid", Some(field), message),
        KeyError::NotFound(m) => error(StatusCode::NOT_FOUND, "not_found", Some("key_id"), m),
        KeyError::Conflict { code, message } => error(StatusCode::CONFLICT, code, Some("key_id"), message),
        KeyError::Unavailable(m) => unavailable(m),
    }
}

/// The reply to a committed key change: `version` when announced, else `propagated: false`.
fn done(status: StatusCode, mut body: Value, version: Option<u64>) -> Response {
    match version {
        Some(v) => body["version"] = json!(v),
        None => body["propagated"] = json!(false),
    }
    reply(status, body)
}

/// An optional JSON body: empty, or `null`, is every default.
#[allow(clippy::result_large_err)] // the error is the reply itself; built once per bad request
fn body_of<T: serde::de::DeserializeOwned + Default>(body: &Bytes) -> Result<T, Response> {
    let bad = |e: serde_json::Error| {
        let m = e.to_string();
        let field = m.split('`').nth(1).filter(|_| m.contains("field")).unwrap_or("body").to_string();
        error(StatusCode::BAD_REQUEST, "invalid", Some(&field), m)
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    match serde_json::from_slice::<Value>(body).map_err(bad)? {
        Value::Null => Ok(T::default()),
        v => serde_json::from_value(v).map_err(bad),
    }
}

#[allow(clippy::result_large_err)] // as body_of
fn key_id(id: &str) -> Result<Id, Response> {
    Id::parse(id).ok_or_else(|| error(StatusCode::BAD_REQUEST, "invalid", Some("key_id"), "not a key id"))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NewKey {
    tenant: String,
    plan: String,
    /// e.g. "30d"
    #[serde(default)]
    expires_in: Option<String>,
}

async fn create_key(State(s): State<Arc<AdminState>>, body: Bytes) -> Response {
    let req: NewKey = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            let m = e.to_string();
            let field = m.split('`').nth(1).filter(|_| m.contains("field")).unwrap_or("body").to_string();
            return error(StatusCode::BAD_REQUEST, "invalid", Some(&field), m);
        }
    };
    let new = keys::ops::NewKey { tenant: req.tenant, plan: req.plan, expires_in: req.expires_in };
    match keys::create(&s.control, &new).await {
        Ok(issued) => {
            let mut body = key_json(&issued.record);
            body["key"] = json!(issued.raw);
            done(StatusCode::CREATED, body, issued.version)
        }
        Err(e) => refused(e),
    }
}

async fn revoke_key(State(s): State<Arc<AdminState>>, Path(id): Path<String>) -> Response {
    let id = match key_id(&id) {
        Ok(id) => id,
        Err(r) => return r,
    };
    match keys::revoke(&s.control, &id).await {
        Ok(c) => done(StatusCode::OK, key_json(&c.record), c.version),
        Err(e) => refused(e),
    }
}

/// `POST /v1/keys/{id}/rotate`'s body (optional).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Rotation {
    /// How long the previous key keeps working, e.g. "24h" (the default).
    #[serde(default)]
    overlap: Option<String>,
    /// The successor's lifetime; default: the one the previous key was given.
    #[serde(default)]
    expires_in: Option<String>,
}

async fn rotate_key(State(s): State<Arc<AdminState>>, Path(id): Path<String>, body: Bytes) -> Response {
    let (id, req) = match (key_id(&id), body_of::<Rotation>(&body)) {
        (Ok(id), Ok(req)) => (id, req),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    let overlap = match keys::ops::overlap(req.overlap.as_deref()) {
        Ok(o) => o,
        Err(e) => return refused(e),
    };
    match keys::rotate(&s.control, &id, overlap, req.expires_in.as_deref()).await {
        Ok(r) => {
            let mut body = key_json(&r.successor.record);
            body["key"] = json!(r.successor.raw);
            body["rotated_from"] = json!(r.previous.key_id.as_str());
            body["previous"] = key_json(&r.previous);
            done(StatusCode::CREATED, body, r.successor.version)
        }
        Err(e) => refused(e),
    }
}
/// Every key (of a tenant), by creation time; or, with `limit`, one page in key-id order, with a
/// `Link: <…>; rel="next"` header while more follow (decision 184).
async fn list_keys(State(s): State<Arc<AdminState>>, uri: Uri) -> Response {
    let q = match list_query(&uri) {
        Ok(q) => q,
        Err((field, m)) => return error(StatusCode::BAD_REQUEST, "invalid", Some(field), m),
    };
    let Some(page) = &q.page else {
        let records: Vec<KeyRecord> = match &s.control.source {
            Source::Postgres(pg) => match pg.keys(q.tenant.as_ref()).await {
                Ok(k) => k.into_iter().map(|(_, r)| r).collect(),
                Err(e) => return unavailable(e),
            },
            Source::File(_) => match s.control.store.list_keys(q.tenant.as_ref()).await {
                Ok(r) => r,
                Err(e) => return unavailable(e),
            },
        };
        return reply(StatusCode::OK, Value::Array(records.iter().map(key_json).collect()));
    };
    // the id the next page starts after, when more follow
    let (records, next): (Vec<KeyRecord>, Option<Id>) = match &s.control.source {
        Source::Postgres(pg) => match pg.keys_page(q.tenant.as_ref(), page).await {
            Ok((k, more)) => {
                let next = k.last().map(|(_, r)| r.key_id.clone()).filter(|_| more);
                (k.into_iter().map(|(_, r)| r).collect(), next)
            }
            Err(e) => return unavailable(e),
        },
        Source::File(_) => match s.control.store.list_keys_page(q.tenant.as_ref(), page).await {
            Ok(r) => r,
            Err(e) => return unavailable(e),
        },
    };
    let mut response = reply(StatusCode::OK, Value::Array(records.iter().map(key_json).collect()));
    if let Some(last) = next {
        let tenant = q.tenant.map(|t| format!("&tenant={t}")).unwrap_or_default();
        let link = format!("</v1/keys?limit={}&after={last}{tenant}>; rel=\"next\"", page.limit);
        if let Ok(v) = header::HeaderValue::from_str(&link) {
            response.headers_mut().insert(header::LINK, v);
        }
    }
    response
}

