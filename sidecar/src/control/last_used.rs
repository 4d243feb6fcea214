//! The last-use flusher (decision 336): every `cache.last_used_interval` it takes the keys the
//! decisions noted ([`crate::decision::last_used`]) and writes when each was last used — into its
//! Redis record (`touch_key.lua`, one call per key, never back in time) and, with the PostgreSQL
//! source, into `api_keys.last_used_at` (one statement for the batch). Off the request path: a
//! failed flush is logged and its batch dropped (the next use notes the key again).

use crate::control::{Control, Source};
use crate::scripts::touch_key;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Flushes every `every` until `stop`, then once more.
pub async fn run(control: Arc<Control>, every: Duration, stop: CancellationToken) {
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(every) => false,
            _ = stop.cancelled() => true,
        };
        flush(&control).await;
        if stopping {
            return;
        }
    }
}

/// Writes the uses noted since the last flush; how many keys.
pub async fn flush(control: &Control) -> usize {
    let used = control.decider.take_used();
    if used.is_empty() {
        return 0;
    }
    let mut failed = 0usize;
    for (hash, _, at) in &used {
        if touch_key::run(&control.store, hash, *at).await.is_err() {
            failed += 1;
        }
    }
    if let Source::Postgres(pg) = &control.source {
        let batch: Vec<_> = used.iter().map(|(_, id, at)| (id.clone(), *at)).collect();
        if let Err(e) = pg.touch_keys(&batch).await {
            tracing::debug!(error = %e, keys = batch.len(), "keys' last use could not be written to PostgreSQL");
        }
    }
    if failed > 0 {
        tracing::debug!(failed, keys = used.len(), "keys' last use could not all be written to Redis");
    }
    used.len()
}
