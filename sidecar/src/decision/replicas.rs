//! The replica count of `local` limits, discovered while Redis answers (issue 15.3): each sidecar
//! heartbeats in `sidecars:live` (crate::keys::SIDECARS_LIVE, a sorted set scored by Redis' own
//! clock) and remembers how many beat lately; while Redis cannot answer, the last count stays in
//! force (super::local). Off when `limits.local_replicas` is set (the configured count wins).
//!
//! Off the request path: one task, two round trips a beat (`TIME`, then one pipeline). A beat
//! Redis cannot answer changes nothing.

use super::Decider;
use crate::keys::{SIDECARS_LIVE, SIDECARS_LIVE_TTL_MS, SIDECAR_BEAT_MS, SIDECAR_LIVE_MS};
use crate::metrics as m;
use crate::store::{Store, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The deadline of one beat.
const DEADLINE: Duration = Duration::from_millis(500);

/// Beats until `stop`, then removes this sidecar from the set (best effort).
pub async fn run(store: Store, decider: Arc<Decider>, stop: CancellationToken) {
    let me = format!("{:032x}", rand::random::<u128>());
    let mut every = tokio::time::interval(Duration::from_millis(SIDECAR_BEAT_MS));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = every.tick() => {}
        }
        if !decider.plans().any_local() {
            continue;
        }
        match beat(&store, &me).await {
            Ok(n) => {
                let local = decider.local();
                local.set_discovered(n);
                metrics::gauge!(m::LOCAL_REPLICAS).set(f64::from(local.replicas()));
            }
            Err(e) => tracing::debug!(error = %e, "replica heartbeat not written"),
        }
    }
    let _ = store
        .run_with_deadline("sidecar_leave", DEADLINE, |mut c| {
            let me = me.clone();
            async move { redis::cmd("ZREM").arg(SIDECARS_LIVE).arg(me).query_async::<()>(&mut c).await }
        })
        .await;
}

/// One beat: this sidecar's score is now, older members go, the set lives on; returns how many
/// beat within [`SIDECAR_LIVE_MS`] (this one included).
async fn beat(store: &Store, me: &str) -> Result<u32, StoreError> {
    let me = me.to_string();
    store
        .run_with_deadline("sidecar_heartbeat", DEADLINE, |mut c| async move {
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut c).await?;
            let now = secs * 1000 + micros / 1000;
            let since = now.saturating_sub(SIDECAR_LIVE_MS);
            let (live,): (u32,) = redis::pipe()
                .zadd(SIDECARS_LIVE, &me, now)
                .ignore()
                .zrembyscore(SIDECARS_LIVE, "-inf", format!("({since}"))
                .ignore()
                .pexpire(SIDECARS_LIVE, SIDECARS_LIVE_TTL_MS as i64)
                .ignore()
                .zcount(SIDECARS_LIVE, since, "+inf")
                .query_async(&mut c)
                .await?;
            Ok(live.max(1))
        })
        .await
}
