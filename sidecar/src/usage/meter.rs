//! The Redis usage meter: per tenant and UTC day, `usage:{tenant}:{yyyyMMdd}` counts requests
//! by class (`ok`, `4xx`, `5xx`, `denied`, `aborted`) and tokens (35 days). A fast, approximate
//! view, written off the request path after events are spooled: a re-sent batch may count twice
//! and the keys may be evicted; billing reads the larger of the meter and its own rollup.

use crate::keys::{Id, UsageMeterKey, USAGE_METER_TTL_MS};
use crate::store::{Store, StoreError};
use std::collections::BTreeMap;
use std::time::Duration;
use tollgate_wire::usage::{UsageClass, UsageEvent};

/// Counters of one tenant on one day.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DayCounts {
    pub by_class: BTreeMap<UsageClass, i64>,
    pub tokens: i64,
}

/// What the Redis meter adds for `events`: per (tenant, `yyyyMMdd`).
pub fn increments(events: &[UsageEvent]) -> BTreeMap<(String, String), DayCounts> {
    let mut out: BTreeMap<(String, String), DayCounts> = BTreeMap::new();
    for e in events {
        let c = out.entry((e.tenant.clone(), e.day().compact())).or_default();
        *c.by_class.entry(e.class()).or_insert(0) += 1;
        // clamped at intake (≤ 2^53); saturating all the same: a meter never goes negative
        let tokens = i64::try_from(e.tokens.unwrap_or(0).min(tollgate_wire::usage::MAX_TOKENS)).unwrap_or(0);
        c.tokens = c.tokens.saturating_add(tokens);
    }
    out
}

/// Deadline of one meter pipeline (off the request path).
const DEADLINE: Duration = Duration::from_secs(2);

/// Adds `incs` to the per-day meters (`HINCRBY` each field, then `PEXPIRE` 35 days): one
/// pipeline per batch. Tenants or days that make no key are skipped.
pub async fn add(store: &Store, incs: BTreeMap<(String, String), DayCounts>) -> Result<(), StoreError> {
    let incs: Vec<(UsageMeterKey, Vec<(&'static str, i64)>)> = incs
        .into_iter()
        .filter_map(|((tenant, day), c)| {
            let key = UsageMeterKey::new(&Id::parse(&tenant)?, &day)?;
            let mut fields: Vec<(&'static str, i64)> = c.by_class.iter().map(|(k, v)| (k.name(), *v)).collect();
            if c.tokens > 0 {
                fields.push(("tokens", c.tokens));
            }
            Some((key, fields))
        })
        .collect();
    if incs.is_empty() {
        return Ok(());
    }
    store
        .run_with_deadline("meter_usage", DEADLINE, |mut c| async move {
            let mut pipe = redis::pipe();
            for (key, fields) in &incs {
                for (field, n) in fields {
                    pipe.hincr(key, *field, *n).ignore();
                }
                pipe.pexpire(key, USAGE_METER_TTL_MS as i64).ignore();
            }
            pipe.query_async::<()>(&mut c).await
        })
        .await
}
