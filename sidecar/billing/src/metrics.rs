//! The billing consumer's own metrics (issue 17; docs/observability.md), served in Prometheus
//! text form on `metrics_listen` (off by default). A few atomics and a minimal HTTP responder:
//! the consumer does not otherwise speak HTTP, and one text page does not need a framework.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Default)]
pub struct BillingMetrics {
    /// Messages read from the topic and stored (events and aggregates, duplicates included).
    pub messages: AtomicU64,
    /// New events stored (duplicates not counted), and requests counted in the rollup.
    pub events: AtomicU64,
    pub requests: AtomicU64,
    pub duplicates: AtomicU64,
    pub rejected: AtomicU64,
    /// Batches committed to PostgreSQL, and attempts that failed.
    pub batches: AtomicU64,
    pub store_errors: AtomicU64,
    /// Unix seconds of the last committed batch (0: none yet).
    pub last_commit: AtomicU64,
    /// Messages on the topic after our committed offsets, summed over our partitions (-1: unknown).
    pub lag: AtomicI64,
    /// The CloudEvents export (crate::outbox): events the broker acknowledged, failed rounds,
    /// and events waiting in the outbox (-1: unknown or no export).
    pub export_sent: AtomicU64,
    pub export_errors: AtomicU64,
    pub export_backlog: AtomicI64,
}

impl BillingMetrics {
    pub fn new() -> Arc<BillingMetrics> {
        let m = BillingMetrics::default();
        m.lag.store(-1, Ordering::Relaxed);
        m.export_backlog.store(-1, Ordering::Relaxed);
        Arc::new(m)
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        family("tollgate_billing_messages_total", "counter", "Messages read and stored (events and aggregates, duplicates included).", g(&self.messages).to_string());
        family("tollgate_billing_events_stored_total", "counter", "New usage events stored (each event id once).", g(&self.events).to_string());
        family("tollgate_billing_requests_total", "counter", "Requests added to the daily rollup (an aggregate counts its requests).", g(&self.requests).to_string());
        family("tollgate_billing_duplicates_total", "counter", "Events already stored (a replay), not counted again.", g(&self.duplicates).to_string());
        family("tollgate_billing_rejected_total", "counter", "Messages that could not be read as events.", g(&self.rejected).to_string());
        family("tollgate_billing_batches_total", "counter", "Batches committed to PostgreSQL.", g(&self.batches).to_string());
        family("tollgate_billing_store_errors_total", "counter", "Attempts to store a batch that failed (retried).", g(&self.store_errors).to_string());
        family("tollgate_billing_last_commit_timestamp_seconds", "gauge", "When the last batch was committed (Unix seconds; 0: none yet).", g(&self.last_commit).to_string());
        let lag = self.lag.load(Ordering::Relaxed);
        if lag >= 0 {
            family("tollgate_billing_lag_messages", "gauge", "Messages on the topic after the committed offsets of this consumer's partitions.", lag.to_string());
        }
        let backlog = self.export_backlog.load(Ordering::Relaxed);
        if backlog >= 0 {
            family("tollgate_billing_export_sent_total", "counter", "CloudEvents the export topic's broker acknowledged.", g(&self.export_sent).to_string());
            family("tollgate_billing_export_errors_total", "counter", "Export rounds that could not send everything (retried).", g(&self.export_errors).to_string());
            family("tollgate_billing_export_backlog_events", "gauge", "Events waiting in the export outbox.", backlog.to_string());
        }
        out
    }
}

/// Serves `GET <anything>` with the metrics until `stop`.
pub async fn serve(addr: SocketAddr, metrics: Arc<BillingMetrics>, stop: CancellationToken) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "billing metrics listening");
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = tokio::select! {
                c = listener.accept() => match c { Ok(c) => c, Err(_) => continue },
                _ = stop.cancelled() => return,
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                // read the request head (bounded, with a deadline), answer, close
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                let read = async {
                    while n < buf.len() {
                        match conn.read(&mut buf[n..]).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => n += k,
                        }
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                };
                if tokio::time::timeout(std::time::Duration::from_secs(5), read).await.is_err() {
                    return;
                }
                let body = metrics.render();
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(body.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_and_hides_an_unknown_lag() {
        let m = BillingMetrics::new();
        m.events.store(7, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains("tollgate_billing_events_stored_total 7\n"), "{text}");
        assert!(text.contains("# TYPE tollgate_billing_last_commit_timestamp_seconds gauge"));
        assert!(!text.contains("tollgate_billing_lag_messages"), "no lag before it is known");
        m.lag.store(3, Ordering::Relaxed);
        assert!(m.render().contains("tollgate_billing_lag_messages 3\n"));
    }
}
