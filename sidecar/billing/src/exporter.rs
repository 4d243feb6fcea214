//! The CloudEvents exporter (decision 297): sends the export outbox ([`crate::outbox`]) to
//! `export.topic` and deletes what the broker acknowledged. crate::outbox says what it promises.

use crate::cloudevents::CONTENT_TYPE;
use crate::config::Config;
use crate::db::Db;
use crate::metrics::BillingMetrics;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The export producer's librdkafka configuration: idempotent, `acks=all`, deliveries bounded
/// by `export.delivery_timeout`, then the operator's `kafka.properties` (TLS, SASL).
pub fn producer_config(c: &Config) -> Vec<(String, String)> {
    tollgate_shared::kafka::client_properties(
        &[
            ("bootstrap.servers", if c.export.brokers.is_empty() { c.kafka.brokers.clone() } else { c.export.brokers.clone() }),
            ("client.id", "tollgate-billing-export".into()),
            ("enable.idempotence", "true".into()),
            ("acks", "all".into()),
            ("linger.ms", "5".into()),
            ("message.timeout.ms", c.export.delivery_timeout.as_millis().to_string()),
            ("socket.connection.setup.timeout.ms", "5000".into()),
            ("reconnect.backoff.max.ms", "1000".into()),
        ],
        &c.kafka.properties,
    )
}

pub fn producer(c: &Config) -> Result<FutureProducer, rdkafka::error::KafkaError> {
    let mut cc = ClientConfig::new();
    for (k, v) in producer_config(c) {
        cc.set(k, v);
    }
    cc.create()
}

/// Why a round did not send everything it took.
#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("kafka: {0}")]
    Kafka(rdkafka::error::KafkaError),
}

/// Sends the outbox until `stop`: rounds of up to `export.batch_max` events, back to back while
/// there are some, every 200 ms when it is empty, with backoff (100 ms to 5 s) while the broker
/// or PostgreSQL fails.
pub async fn run(config: Config, producer: FutureProducer, stats: Arc<BillingMetrics>, stop: CancellationToken) {
    let mut db: Option<Db> = None;
    let mut backoff = Duration::from_millis(100);
    let mut failing = false;
    let mut counted = Instant::now() - Duration::from_secs(60);
    while !stop.is_cancelled() {
        if db.is_none() {
            db = Db::connect_retrying(&config.postgres.url, &stop).await;
        }
        let Some(d) = db.as_mut() else { return };
        let pause = match round(d, &producer, &config).await {
            Ok(sent) => {
                stats.export_sent.fetch_add(sent, Relaxed);
                if failing {
                    tracing::info!("billing export: sending again");
                    failing = false;
                }
                backoff = Duration::from_millis(100);
                if sent == 0 { Duration::from_millis(200) } else { Duration::ZERO }
            }
            Err(e) => {
                stats.export_errors.fetch_add(1, Relaxed);
                if !failing {
                    tracing::warn!(error = %e, topic = %config.export.topic, "billing export: cannot send; the events wait in usage_export_outbox");
                    failing = true;
                }
                if d.is_closed() {
                    db = None;
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                backoff
            }
        };
        if counted.elapsed() >= Duration::from_secs(1) {
            counted = Instant::now();
            if let Some(d) = db.as_ref() {
                if let Ok(row) = d.client().query_one("SELECT count(*) FROM usage_export_outbox", &[]).await {
                    stats.export_backlog.store(row.get::<_, i64>(0), Relaxed);
                }
            }
        }
        if !pause.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}

/// One round: takes up to `batch_max` queued events (skipping rows another consumer holds),
/// sends them, deletes the acknowledged ones, commits. Ok(events sent).
async fn round(db: &mut Db, producer: &FutureProducer, config: &Config) -> Result<u64, RoundError> {
    let tx = db.transaction().await?;
    let rows = tx
        .query(
            "SELECT seq, tenant, body FROM usage_export_outbox ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
            &[&(config.export.batch_max as i64)],
        )
        .await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let mut pending = Vec::with_capacity(rows.len());
    let mut failed = None;
    for r in &rows {
        let (tenant, body): (&str, &str) = (r.get(1), r.get(2));
        let headers = OwnedHeaders::new().insert(Header { key: "content-type", value: Some(CONTENT_TYPE) });
        let record = FutureRecord::to(&config.export.topic).key(tenant).payload(body).headers(headers);
        match producer.send_result(record) {
            Ok(delivery) => pending.push((r.get::<_, i64>(0), delivery)),
            Err((e, _)) => {
                // librdkafka's queue is full (or the producer failed): send the rest next round
                failed = Some(e);
                break;
            }
        }
    }
    let mut delivered = Vec::with_capacity(pending.len());
    for (seq, delivery) in pending {
        match delivery.await {
            Ok(Ok(_)) => delivered.push(seq),
            Ok(Err((e, _))) => failed = failed.or(Some(e)),
            Err(_) => failed = failed.or(Some(rdkafka::error::KafkaError::Canceled)),
        }
    }
    if !delivered.is_empty() {
        tx.execute("DELETE FROM usage_export_outbox WHERE seq = ANY($1)", &[&delivered]).await?;
    }
    tx.commit().await?;
    match failed {
        Some(e) => Err(RoundError::Kafka(e)),
        None => Ok(delivered.len() as u64),
    }
}
