//! `sidecar/lua/alert_fire.lua`: create a budget alert once across replicas (issue 42 item 5;
//! crate::alerts). The keys share the `{alerts}` hash tag.

use super::call::Invocation;
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/alert_fire.lua")));

/// Off the request path.
const DEADLINE: Duration = Duration::from_secs(2);

/// Entries kept in a tenant's delivery log.
pub const LOG_MAX: usize = 1000;

/// The due set: alert id → when its next delivery attempt is due (ms).
pub const DUE: &str = "{alerts}:due";

pub fn alert_key(id: &str) -> String {
    format!("{{alerts}}:alert:{id}")
}

pub fn log_key(tenant: &str) -> String {
    format!("{{alerts}}:log:{tenant}")
}

/// One line of a tenant's delivery log.
pub fn log_entry(alert: &str, event: &str, at_ms: u64, detail: Option<&str>) -> String {
    serde_json::json!({ "alert": alert, "event": event, "atMs": at_ms, "detail": detail }).to_string()
}

/// An alert to create: its marker, id, tenant, creation time, the webhook body (JSON) and its
/// first log entry.
pub struct Fire<'a> {
    pub marker: &'a str,
    pub id: &'a str,
    pub tenant: &'a str,
    pub at_ms: u64,
    pub body: String,
    pub log_entry: String,
    pub ttl_ms: u64,
}

/// Creates the alert unless its marker exists: Ok(true) when this call created it.
pub async fn fire(store: &Store, f: Fire<'_>) -> Result<bool, StoreError> {
    let created: i64 = Invocation {
        script: &SCRIPT,
        op: "alert_fire",
        keys: vec![f.marker.to_string(), alert_key(f.id), DUE.to_string(), log_key(f.tenant)],
        args: vec![f.ttl_ms.to_string(), f.body, f.id.to_string(), f.tenant.to_string(), f.at_ms.to_string(), f.log_entry, LOG_MAX.to_string()],
    }
    .run(store, Some(DEADLINE))
    .await?;
    Ok(created == 1)
}
