//! `GET /v1/alerts?tenant=<id>[&limit=N]`: a tenant's budget alerts and their deliveries, newest
//! first (crate::alerts; the log keeps the last 1 000 entries, for the alerts' lifetime).

use super::admin_http::{error, reply, unavailable, AdminState};
use crate::keys::Id;
use crate::scripts::alert_fire::log_key;
use crate::store::{Store, StoreError};
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// The alert routes, merged into the admin router (under its token check).
pub(super) fn routes() -> Router<Arc<AdminState>> {
    Router::new().route("/v1/alerts", get(list))
}

async fn list(State(s): State<Arc<AdminState>>, uri: Uri) -> Response {
    match log(&s.control.store, uri.query()).await {
        Ok(body) => reply(StatusCode::OK, body),
        Err(LogError::Invalid(field, why)) => error(StatusCode::BAD_REQUEST, "invalid", Some(field), why),
        Err(LogError::Store(e)) => unavailable(e),
    }
}

/// Why a log read was refused or failed.
pub enum LogError {
    /// A bad query: the parameter and why.
    Invalid(&'static str, &'static str),
    Store(StoreError),
}

/// The query (`tenant`, `limit`) read: tenant and how many entries.
pub fn query(q: Option<&str>) -> Result<(Id, usize), LogError> {
    let (mut tenant, mut limit) = (None, 100usize);
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("tenant", v) => tenant = Some(Id::parse(v).ok_or(LogError::Invalid("tenant", "not a tenant id"))?),
            ("limit", v) => {
                limit = v.parse::<usize>().ok().filter(|n| (1..=crate::scripts::alert_fire::LOG_MAX).contains(n)).ok_or(LogError::Invalid("limit", "1 to 1000"))?
            }
            _ => return Err(LogError::Invalid("query", "unknown parameter (tenant, limit)")),
        }
    }
    Ok((tenant.ok_or(LogError::Invalid("tenant", "required"))?, limit))
}

/// The newest `limit` entries of the tenant's alert log, as the admin API answers them.
pub async fn log(store: &Store, q: Option<&str>) -> Result<Value, LogError> {
    let (tenant, limit) = query(q)?;
    let key = log_key(tenant.as_str());
    let lines = store
        .run_with_deadline("alert_log", Duration::from_secs(2), |mut c| async move {
            redis::cmd("LRANGE").arg(&key).arg(0).arg(limit as i64 - 1).query_async::<Vec<String>>(&mut c).await
        })
        .await
        .map_err(LogError::Store)?;
    let entries: Vec<Value> = lines.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
    Ok(json!({ "tenant": tenant.as_str(), "entries": entries }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_a_tenant_and_a_bounded_limit() {
        assert!(matches!(query(Some("tenant=acme")), Ok((t, 100)) if t.as_str() == "acme"));
        assert!(matches!(query(Some("tenant=acme&limit=5")), Ok((_, 5))));
        assert!(matches!(query(None), Err(LogError::Invalid("tenant", _))));
        assert!(matches!(query(Some("tenant=a%20b")), Err(LogError::Invalid("tenant", _))));
        assert!(matches!(query(Some("tenant=acme&limit=0")), Err(LogError::Invalid("limit", _))));
        assert!(matches!(query(Some("tenant=acme&limit=1001")), Err(LogError::Invalid("limit", _))));
        assert!(matches!(query(Some("tenant=acme&x=1")), Err(LogError::Invalid("query", _))));
    }
}
