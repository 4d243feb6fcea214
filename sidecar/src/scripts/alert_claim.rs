//! `sidecar/lua/alert_claim.lua`: take the budget alerts due for delivery (crate::alerts::deliver).

use super::alert_fire::DUE;
use super::call::Invocation;
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/alert_claim.lua")));

/// The ids of up to `max` alerts due at `now_ms`, now held until `until_ms`.
pub async fn claim(store: &Store, now_ms: u64, until_ms: u64, max: usize) -> Result<Vec<String>, StoreError> {
    Invocation { script: &SCRIPT, op: "alert_claim", keys: vec![DUE.to_string()], args: vec![now_ms.to_string(), until_ms.to_string(), max.to_string()] }
        .run(store, Some(Duration::from_secs(2)))
        .await
}
