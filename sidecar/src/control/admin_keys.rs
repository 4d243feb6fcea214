//! The admin API's key routes (docs/openapi.json): issue, revoke and list API keys. Split from
//! [`super::admin`], whose token check, write tracking and error shape they share.

use super::admin::{announced, error, reply, unavailable, AdminState};
use crate::apikey::{self, KeyRecord};
use crate::control::keys::list_query;
use crate::control::Source;
use crate::control::source::SourceError;
use crate::decision::unix_now;
use crate::keys::{Id, KeyHash};
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
    Router::new().route("/v1/keys", get(list_keys).post(create_key)).route("/v1/keys/{id}/revoke", post(revoke_key))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewKey {
    tenant: String,
    plan: String,
    /// e.g. "30d"
    #[serde(default)]
    expires_in: Option<String>,
}

fn key_json(r: &KeyRecord) -> Value {
    json!({
        "key_id": r.key_id.as_str(), "tenant": r.tenant.as_str(), "plan": r.plan.as_str(), "status": r.status.as_str(),
        "created_at": r.created_at, "expires_at": r.expires_at, "revoked_at": r.revoked_at,
    })
}

async fn create_key(State(s): State<Arc<AdminState>>, body: Bytes) -> Response {
    let bad = |field: &str, m: String| error(StatusCode::BAD_REQUEST, "invalid", Some(field), m);
    let req: NewKey = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            let m = e.to_string();
            let field = m.split('`').nth(1).filter(|_| m.contains("field")).unwrap_or("body").to_string();
            return bad(&field, m);
        }
    };
    let Some(tenant) = Id::parse(&req.tenant) else { return bad("tenant", "use 1-64 of letters, digits, '_', '-', '.'".into()) };
    let Some(plan) = Id::parse(&req.plan) else { return bad("plan", "use 1-64 of letters, digits, '_', '-', '.'".into()) };
    let snapshot = s.control.live.get();
    if !snapshot.plans.contains_key(plan.as_str()) {
        return bad("plan", format!("no plan '{plan}'"));
    }
    let pg = match &s.control.source {
        Source::Postgres(pg) => {
            if !snapshot.tenants.contains_key(tenant.as_str()) {
                return bad("tenant", format!("no tenant '{tenant}'"));
            }
            Some(pg)
        }
        Source::File(_) => None,
    };
    let now = unix_now();
    let Ok(expires_at) = super::keys::expiry(req.expires_in.as_deref(), now) else {
        return bad("expires_in", "a duration above zero and at most 100 years, e.g. \"30d\"".into());
    };
    let issued = apikey::issue(tenant, plan, now, expires_at);
    if let Some(pg) = pg {
        match pg.create_key(&issued.hash, &issued.record).await {
            Ok(()) => {}
            // deleted since this replica's copy said it was there (decision 174)
            Err(SourceError::Missing(field, m)) => return bad(field, m),
            Err(e) => return unavailable(e),
        }
    }
    if let Err(e) = s.control.store.create_key(&issued.hash, &issued.record).await {
        // The raw key is never shown: PostgreSQL must not keep an active record of it, which
        // the next start would copy into Redis (a key listed as active that nobody holds).
        if let Some(pg) = pg {
            if let Err(undo) = pg.delete_key(&issued.record.key_id).await {
                tracing::warn!(key_id = %issued.record.key_id, error = %undo, "a key whose creation failed stays in PostgreSQL; revoke it");
            }
        }
        return unavailable(format!("the key could not be written to Redis: {e}"));
    }
    let mut body = key_json(&issued.record);
    body["key"] = json!(issued.raw);
    announced(&s, Some(&issued.record.tenant), StatusCode::CREATED, body).await
}

async fn revoke_key(State(s): State<Arc<AdminState>>, Path(id): Path<String>) -> Response {
    let Some(key_id) = Id::parse(&id) else {
        return error(StatusCode::BAD_REQUEST, "invalid", Some("key_id"), "not a key id");
    };
    let now = unix_now();
    let record = match &s.control.source {
        Source::Postgres(pg) => {
            // Not taken by both stores: this sidecar keeps at it until they do (decision 130).
            let (hash, record): (KeyHash, KeyRecord) = match pg.revoke_key(&key_id, now).await {
                Ok(Some(r)) => r,
                // A key PostgreSQL lacks (created in Redis alone by an older `keys create`) still
                // authenticates: Redis is where it lives, as `tollgate-sidecar keys revoke` does.
                Ok(None) => return revoke_in_redis(&s, &key_id, now).await,
                Err(e) => {
                    s.control.complete_revocation(key_id, now);
                    return unavailable(format!(
                        "not in force yet: {e}; this sidecar keeps trying until PostgreSQL and Redis take the revocation (retrying is safe)"
                    ));
                }
            };
            if let Err(e) = s.control.store.create_key(&hash, &record).await {
                s.control.complete_revocation(key_id, now);
                return unavailable(format!(
                    "not in force yet: revoked in PostgreSQL, but Redis did not take it ({e}); this sidecar keeps trying until it does (retrying is safe)"
                ));
            }
            record
        }
        Source::File(_) => return revoke_in_redis(&s, &key_id, now).await,
    };
    announced(&s, Some(&record.tenant), StatusCode::OK, key_json(&record)).await
}

/// Revokes a key whose record lives in Redis alone (the file source's keys, or a key PostgreSQL
/// lacks) and announces it; 404 when Redis has no such key either.
async fn revoke_in_redis(s: &Arc<AdminState>, key_id: &Id, now: u64) -> Response {
    match s.control.store.revoke_key(key_id, now).await {
        Ok(record) => announced(s, Some(&record.tenant), StatusCode::OK, key_json(&record)).await,
        Err(crate::store::StoreError::NotFound(m)) => error(StatusCode::NOT_FOUND, "not_found", Some("key_id"), m),
        Err(e) => unavailable(e),
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

