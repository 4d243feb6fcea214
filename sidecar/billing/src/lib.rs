//! Tollgate's billing consumer (issue 6): reads usage events from Kafka (`usage_events`) and
//! keeps, in PostgreSQL, every event once (`usage_events`, keyed by the event id), every
//! aggregate of a high-rate tenant's second once (`usage_aggregates`, by aggregate id), and the daily
//! rollup billing reads (`usage_daily`: per day, tenant and key — requests by class, tokens,
//! bytes). A separate service from the gateway, never on a request path (seed 003).
//!
//! Exactly once, from at-least-once: the gateway delivers an event one or more times (retries are
//! how it loses nothing). Each consumed batch is ONE PostgreSQL transaction: insert the events
//! `ON CONFLICT (event_id) DO NOTHING` and the aggregates `ON CONFLICT (aggregate_id) DO
//! NOTHING`, and add to the rollup only those actually inserted. Kafka
//! offsets are committed only after that transaction committed, so a crash re-reads a batch and
//! the event ids make the second pass a no-op. A batch PostgreSQL cannot take is retried (with
//! backoff) until it can: nothing is skipped. Messages that are not valid events or aggregates go
//! to `usage_rejects` in the same transaction (kept, never dropped); a batch PostgreSQL refuses
//! for a value in it (a data exception) is stored one message at a time, the refused ones into
//! `usage_rejects` ([`store_apart`], decision 167).
//!
//! Ordering and locks: events are keyed by tenant, so one tenant's events are in one partition
//! and only one consumer of the group writes a tenant's rollup rows (no cross-consumer deadlocks).

pub mod cloudevents;
pub mod config;
pub mod db;
pub mod decode;
pub mod export;
pub mod exporter;
pub mod invoice;
pub mod metrics;
pub mod models;
pub mod outbox;
pub mod report;
pub mod rollup;

use config::Config;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("configuration: {0}")]
    Config(#[from] config::ConfigError),
    #[error("metrics_listen {0}: {1}")]
    Metrics(std::net::SocketAddr, std::io::Error),
}

/// The consumer's librdkafka configuration: a consumer group, offsets committed by us (after the
/// PostgreSQL commit), reading from the start of a partition nobody committed yet.
pub fn consumer_config(c: &config::KafkaConfig) -> Vec<(String, String)> {
    tollgate_shared::kafka::client_properties(
        &[
            ("bootstrap.servers", c.brokers.clone()),
            ("group.id", c.group_id.clone()),
            ("client.id", "tollgate-billing".into()),
            ("enable.auto.commit", "false".into()),
            ("enable.auto.offset.store", "false".into()),
            ("auto.offset.reset", "earliest".into()),
            ("session.timeout.ms", c.session_timeout.as_millis().to_string()),
            ("heartbeat.interval.ms", (c.session_timeout.as_millis() / 3).max(100).to_string()),
            // a PostgreSQL outage can hold a batch a long time; do not leave the group meanwhile
            ("max.poll.interval.ms", "3600000".into()),
            ("enable.partition.eof", "false".into()),
            // notice a topic created (or re-created) after we subscribed within seconds, not minutes
            ("topic.metadata.refresh.interval.ms", "5000".into()),
        ],
        &c.properties,
    )
}

/// One message as read: where it was, and its payload.
#[derive(Debug, Clone)]
pub struct Consumed {
    pub partition: i32,
    pub offset: i64,
    pub payload: Vec<u8>,
    /// The `schema` header (`tollgate.usage.v2` — or `v1` from an older sidecar — or `tollgate.usage.aggregate.v1`), if any.
    pub schema: Option<String>,
}

impl Consumed {
    fn of(m: &rdkafka::message::BorrowedMessage<'_>) -> Consumed {
        use rdkafka::message::Headers;
        let schema = m.headers().and_then(|h| {
            h.iter().find(|h| h.key == "schema").and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
        });
        Consumed { partition: m.partition(), offset: m.offset(), payload: m.payload().unwrap_or_default().to_vec(), schema }
    }
}

/// Runs the consumer until `shutdown`. Returns an error only for what retrying cannot fix
/// (bad configuration); PostgreSQL and Kafka outages are waited out.
pub async fn run(config: &Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), Error> {
    config.validate()?;
    let stop = CancellationToken::new();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop.cancel();
        });
    }
    let export = config.export.enabled().then(|| config.export.origin());
    let connect = |stop: CancellationToken| {
        let (url, export) = (config.postgres.url.clone(), export.clone());
        async move {
            let mut db = db::Db::connect_retrying(&url, &stop).await?;
            db.exporting(export);
            Some(db)
        }
    };
    let mut db = connect(stop.clone()).await;
    let Some(db_ref) = db.as_mut() else { return Ok(()) };
    db_ref.migrate().await?;

    let mut cc = ClientConfig::new();
    for (k, v) in consumer_config(&config.kafka) {
        cc.set(k, v);
    }
    let stats = metrics::BillingMetrics::new();
    if let Some(addr) = config.metrics_listen {
        metrics::serve(addr, stats.clone(), stop.clone()).await.map_err(|e| Error::Metrics(addr, e))?;
    }
    if config.export.enabled() {
        let producer = exporter::producer(config)?;
        stats.export_backlog.store(0, std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(exporter::run(config.clone(), producer, stats.clone(), stop.clone()));
        tracing::info!(topic = %config.export.topic, "billing: exporting usage as CloudEvents");
    }
    let consumer: StreamConsumer = cc.create()?;
    consumer.subscribe(&[&config.kafka.topic])?;
    tracing::info!(topic = %config.kafka.topic, group = %config.kafka.group_id, "billing consumer started");

    let mut last_prune = Instant::now() - Duration::from_secs(3600);
    let mut db = db.take();
    loop {
        let batch = tokio::select! {
            b = collect(&consumer, config.batch_max, config.batch_wait) => b,
            _ = stop.cancelled() => break,
        };
        if batch.is_empty() {
            continue;
        }
        // Store the batch, however long PostgreSQL takes to come back.
        let mut backoff = Duration::from_millis(100);
        let mut logged = false;
        loop {
            if db.is_none() {
                db = connect(stop.clone()).await;
                if db.is_none() {
                    return Ok(()); // stopped while waiting
                }
            }
            let Some(d) = db.as_mut() else { continue };
            // A PostgreSQL gone mid-query fails the query within about a minute, not hours: the
            // connection's keepalives and TCP user timeout (db::Db::connect).
            let stored = match d.store(&config.kafka.topic, &batch).await {
                Err(e) if db::is_data_error(&e) => store_apart(d, &config.kafka.topic, &batch, e).await,
                other => other,
            };
            match stored {
                Ok(stored) => {
                    use std::sync::atomic::Ordering::Relaxed;
                    stats.messages.fetch_add(batch.len() as u64, Relaxed);
                    stats.events.fetch_add(stored.inserted, Relaxed);
                    stats.requests.fetch_add(stored.requests, Relaxed);
                    stats.duplicates.fetch_add(stored.duplicates, Relaxed);
                    stats.rejected.fetch_add(stored.rejected, Relaxed);
                    stats.batches.fetch_add(1, Relaxed);
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
                    stats.last_commit.store(now, Relaxed);
                    if logged {
                        tracing::info!("billing: postgres is back");
                    }
                    tracing::debug!(read = batch.len(), new = stored.inserted, aggregates = stored.aggregates, requests = stored.requests, duplicates = stored.duplicates, rejected = stored.rejected, "batch stored");
                    break;
                }
                Err(e) => {
                    stats.store_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if !logged {
                        tracing::warn!(error = %e, "billing: postgres cannot take the batch; retrying until it can");
                        logged = true;
                    }
                    if d.is_closed() {
                        db = None;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        // offsets not committed: the batch is read again at the next start
                        _ = stop.cancelled() => return Ok(()),
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        // Only now: the batch is in PostgreSQL.
        let mut tpl = TopicPartitionList::new();
        let mut next: BTreeMap<i32, i64> = BTreeMap::new();
        for m in &batch {
            let e = next.entry(m.partition).or_insert(m.offset + 1);
            *e = (*e).max(m.offset + 1);
        }
        for (p, o) in next {
            let _ = tpl.add_partition_offset(&config.kafka.topic, p, Offset::Offset(o));
        }
        if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
            // e.g. the partition moved to another consumer: it re-reads from the last commit, and
            // the event ids make that harmless
            tracing::warn!(error = %e, "billing: offset commit failed (events will be read again, counted once)");
        }
        if config.metrics_listen.is_some() {
            stats.lag.store(lag(&consumer, &config.kafka.topic), std::sync::atomic::Ordering::Relaxed);
        }
        if last_prune.elapsed() > Duration::from_secs(3600) {
            last_prune = Instant::now();
            if let Some(d) = db.as_mut() {
                match d.prune(config.events_retention).await {
                    Ok(n) if n > 0 => tracing::info!(deleted = n, "billing: pruned event ids past the retention"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "billing: prune failed"),
                }
            }
        }
    }
    tracing::info!("billing consumer stopped");
    Ok(())
}

/// Messages on `topic` after this consumer's committed offsets, over the partitions assigned to
/// it (-1 when Kafka cannot tell). Asks the broker for each partition's high watermark (blocking,
/// bounded by a 1 s timeout each): run only when metrics are served.
fn lag(consumer: &StreamConsumer, topic: &str) -> i64 {
    let Ok(assigned) = consumer.assignment() else { return -1 };
    let Ok(committed) = blocking(|| consumer.committed_offsets(assigned, Duration::from_secs(1))) else { return -1 };
    let mut total = 0i64;
    for e in committed.elements() {
        let Ok((_, high)) = blocking(|| consumer.fetch_watermarks(topic, e.partition(), Duration::from_secs(1))) else {
            return -1;
        };
        let at = match e.offset() {
            Offset::Offset(o) => o,
            _ => 0,
        };
        total += (high - at).max(0);
    }
    total
}

/// Runs a blocking librdkafka call: off the async workers where the runtime has several.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Up to `max` messages: waits for the first, then takes what arrives within `wait`.
async fn collect(consumer: &StreamConsumer, max: usize, wait: Duration) -> Vec<Consumed> {
    let mut out = Vec::new();
    let first = match consumer.recv().await {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(error = %e, "billing: consumer error");
            tokio::time::sleep(Duration::from_millis(100)).await;
            return out;
        }
    };
    out.push(Consumed::of(&first));
    drop(first);
    let until = tokio::time::Instant::now() + wait;
    while out.len() < max {
        match tokio::time::timeout_at(until, consumer.recv()).await {
            Ok(Ok(m)) => out.push(Consumed::of(&m)),
            Ok(Err(_)) => continue,
            Err(_) => break,
        }
    }
    out
}

/// Stores a batch PostgreSQL refused for a value it will never take (`refused`: a data error no
/// validation foresaw), one message at a time: a message refused on its own is kept in
/// `usage_rejects` with PostgreSQL's reason, every other one is stored. Retrying the whole batch
/// would stop billing for every partition in it, for good (decision 167).
/// When PostgreSQL refuses every message of a batch of several on its own, the cause is not in
/// the messages (a database encoding, a trigger, a schema): the batch waits as in an outage,
/// nothing is set aside.
async fn store_apart(d: &mut db::Db, topic: &str, batch: &[Consumed], refused: tokio_postgres::Error) -> Result<db::Stored, tokio_postgres::Error> {
    tracing::warn!(error = %refused, messages = batch.len(), "billing: postgres refused a value in the batch; storing its messages one by one");
    let mut total = db::Stored::default();
    let mut set_aside = Vec::new();
    for m in batch {
        match d.store(topic, std::slice::from_ref(m)).await {
            Err(e) if db::is_data_error(&e) => {
                let why = e.as_db_error().map_or_else(|| e.to_string(), |d| format!("{} {}", d.code().code(), d.message()));
                set_aside.push((m, why));
            }
            other => total += other?,
        }
    }
    if batch.len() > 1 && set_aside.len() == batch.len() {
        return Err(refused);
    }
    for (m, why) in set_aside {
        tracing::warn!(partition = m.partition, offset = m.offset, error = %why, "billing: a message postgres will not take is kept in usage_rejects");
        d.reject(topic, m, &format!("postgres refused it: {why}")).await?;
        total += db::Stored { rejected: 1, ..db::Stored::default() };
    }
    Ok(total)
}
