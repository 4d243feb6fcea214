//! Kafka side of usage metering: the producer's client configuration (a pure, tested function),
//! delivery-error classification, the topic, and the shipper that moves sealed spool segments to
//! the `usage_events` topic.
//!
//! Guarantees: the producer is idempotent with `acks=all`; a segment is deleted only after the
//! broker acknowledged every event in it, so an outage never loses an event (it waits on disk),
//! while a crash between the ack and the delete ships a segment twice (at-least-once; the billing
//! consumer counts each event id once — and each aggregate id, which a re-shipped segment
//! reproduces exactly: tollgate_shared::aggregate). Messages are keyed by tenant: one tenant's events stay in
//! one partition, in order (seed 003). Nothing here runs on the request path.

use tollgate_shared::aggregate::{Outgoing, SegmentPlan};
use crate::usage::spool::{read_segment, remove_segment, sealed_segments};
use crate::invalid::{invalid, Invalid};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `[usage.kafka]` of the sidecar configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap brokers, `host:port[,host:port…]`.
    pub brokers: String,
    /// The topic of usage events (seed 003: `usage_events`).
    pub topic: String,
    /// Create the topic at start when it is missing (with `partitions`, `replication_factor` and
    /// `retention`). In production, pre-create it (replication 3, `min.insync.replicas` 2).
    pub create_topic: bool,
    pub partitions: i32,
    pub replication_factor: i32,
    /// `retention.ms` of a created topic (seed 003: 7 days, for billing reprocessing).
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long the producer keeps trying one message (`message.timeout.ms`); the segment is
    /// retried after that, so this bounds a retry round, not what is kept.
    #[serde(with = "humantime_serde")]
    pub delivery_timeout: Duration,
    /// Further librdkafka properties (e.g. `security.protocol`, `compression.type`). The ones the
    /// guarantees rest on (`enable.idempotence`, `acks`, `bootstrap.servers`) cannot be set here.
    pub properties: BTreeMap<String, String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topic: "usage_events".into(),
            create_topic: true,
            partitions: 12,
            replication_factor: 1,
            retention: Duration::from_secs(7 * 24 * 3600),
            delivery_timeout: Duration::from_secs(30),
            properties: BTreeMap::new(),
        }
    }
}

/// The `schema` header of every single-event usage message (docs/usage-events.md; aggregates
/// carry tollgate_shared::aggregate::SCHEMA).
pub const SCHEMA: &str = "tollgate.usage.v2";

/// Properties the billing guarantees depend on: not overridable.
const FIXED: &[&str] = &["enable.idempotence", "acks", "bootstrap.servers", "message.timeout.ms", "delivery.timeout.ms"];

impl KafkaConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.brokers.trim().is_empty() {
            return Err(invalid("usage.kafka.brokers", "must not be empty"));
        }
        let topic_ok = !self.topic.is_empty()
            && self.topic.len() <= 249
            && self.topic.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !topic_ok {
            return Err(invalid("usage.kafka.topic", "1-249 of letters, digits, '.', '_', '-'"));
        }
        if self.partitions < 1 || self.replication_factor < 1 {
            return Err(invalid("usage.kafka.partitions and replication_factor", "at least 1"));
        }
        if self.delivery_timeout < Duration::from_millis(100) {
            return Err(invalid("usage.kafka.delivery_timeout", "at least 100ms"));
        }
        if let Some(k) = self.properties.keys().find(|k| FIXED.contains(&k.as_str())) {
            return Err(invalid(format!("usage.kafka.properties.{k}"), "fixed by Tollgate (idempotent producer, acks=all)"));
        }
        Ok(())
    }
}

/// The producer's librdkafka configuration: idempotent, `acks=all`, compressed, short linger
/// (events are batched on the wire), then the operator's extra properties.
pub fn producer_config(k: &KafkaConfig) -> Vec<(String, String)> {
    tollgate_shared::kafka::client_properties(
        &[
            ("bootstrap.servers", k.brokers.clone()),
            ("client.id", "tollgate-sidecar".into()),
            ("enable.idempotence", "true".into()),
            ("acks", "all".into()),
            ("compression.type", "lz4".into()),
            ("linger.ms", "20".into()),
            ("message.timeout.ms", k.delivery_timeout.as_millis().to_string()),
            // fail fast to the shipper's own retry loop rather than hanging in librdkafka
            ("socket.connection.setup.timeout.ms", "5000".into()),
            ("reconnect.backoff.max.ms", "1000".into()),
        ],
        &k.properties,
    )
}

/// What a failed delivery calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryFailure {
    /// librdkafka's local queue is full: wait for deliveries, then send again.
    QueueFull,
    /// The broker is away, slow or moving leaders: retry the segment after a backoff.
    Transient,
    /// The topic is missing: create it (when allowed), then retry.
    UnknownTopic,
    /// Retrying the same way will not help (authorization, message too large, a fatal producer
    /// error): surfaced loudly; the events stay in the spool.
    Fatal,
}

impl DeliveryFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryFailure::QueueFull => "queue_full",
            DeliveryFailure::Transient => "transient",
            DeliveryFailure::UnknownTopic => "unknown_topic",
            DeliveryFailure::Fatal => "fatal",
        }
    }
}

pub fn classify(code: Option<RDKafkaErrorCode>) -> DeliveryFailure {
    use RDKafkaErrorCode as C;
    match code {
        Some(C::QueueFull) => DeliveryFailure::QueueFull,
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => DeliveryFailure::UnknownTopic,
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::Fatal
            | C::InvalidArgument
            | C::InvalidRecord
            | C::UnsupportedVersion,
        ) => DeliveryFailure::Fatal,
        _ => DeliveryFailure::Transient,
    }
}

fn classify_error(e: &KafkaError) -> DeliveryFailure {
    classify(e.rdkafka_error_code())
}

/// Why the producer or the topic could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("kafka producer: {0}")]
    Producer(KafkaError),
    #[error(transparent)]
    Admin(#[from] KafkaError),
    #[error("cannot create topic {0}: {1}")]
    CreateTopic(String, RDKafkaErrorCode),
}

/// The configuration of a topic this sidecar creates: its retention, and with three replicas or
/// more, an acknowledgement (`acks=all`) only once two of them have an event — with the
/// broker's usual default of one, a spool segment acknowledged by the leader alone is deleted
/// and the events are lost with that broker (decision 172). With two replicas the broker's
/// default stays: requiring both would stop every delivery while one broker restarts.
pub fn new_topic_config(k: &KafkaConfig) -> Vec<(&'static str, String)> {
    let mut c = vec![("retention.ms", k.retention.as_millis().to_string())];
    if k.replication_factor >= 3 {
        c.push(("min.insync.replicas", "2".to_string()));
    }
    c
}

/// Creates the topic if it does not exist (an existing one is left as it is).
pub async fn ensure_topic(k: &KafkaConfig) -> Result<(), SetupError> {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &k.brokers).set("socket.connection.setup.timeout.ms", "5000").create()?;
    let config = new_topic_config(k);
    let mut topic = NewTopic::new(&k.topic, k.partitions, TopicReplication::Fixed(k.replication_factor));
    for (key, value) in &config {
        topic = topic.set(key, value);
    }
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(5)));
    let results = admin.create_topics([&topic], &opts).await?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => return Err(SetupError::CreateTopic(t, code)),
        }
    }
    Ok(())
}

/// The idempotent producer ([`producer_config`]); Kafka need not be up.
pub fn producer(k: &KafkaConfig) -> Result<FutureProducer, SetupError> {
    let mut c = ClientConfig::new();
    for (key, v) in producer_config(k) {
        c.set(key, v);
    }
    c.create().map_err(SetupError::Producer)
}

/// Moves sealed spool segments to Kafka, oldest first, until `stop`; then one last pass bounded
/// by `grace`. What is not shipped stays on disk for the next start.
pub struct Shipper {
    pub config: KafkaConfig,
    pub producer: FutureProducer,
    pub dir: PathBuf,
    pub total: Arc<AtomicU64>,
    pub sealed: Arc<tokio::sync::Notify>,
    /// Segments shipped whole whose file could not be deleted (a read-only or failing disk):
    /// only their deletion is tried again, never their shipping — else every round would send
    /// them again, filling the topic with duplicates for as long as the disk refuses.
    pub undeletable: std::sync::Mutex<std::collections::HashSet<PathBuf>>,
}

/// A deletion that found the file gone already succeeded.
fn gone(removed: std::io::Result<()>) -> std::io::Result<()> {
    match removed {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// The shipper's view of Kafka, for logging transitions once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    Up,
    Down,
}

impl Shipper {
    pub async fn run(mut self, stop: CancellationToken, grace: Duration) {
        let mut health = Health::Up;
        let mut backoff = Duration::from_millis(100);
        let mut topic_checked = false;
        loop {
            if self.config.create_topic && !topic_checked {
                match ensure_topic(&self.config).await {
                    Ok(()) => topic_checked = true,
                    Err(e) => tracing::debug!(error = %e, "usage: cannot check the topic yet"),
                }
            }
            match self.ship_all(&stop).await {
                Ok(()) => {
                    if health == Health::Down {
                        tracing::info!("usage: kafka is back; the spool is being shipped");
                        health = Health::Up;
                    }
                    backoff = Duration::from_millis(100);
                    tokio::select! {
                        _ = self.sealed.notified() => {}
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = stop.cancelled() => break,
                    }
                }
                Err(failure) => {
                    metrics::counter!(crate::metrics::USAGE_KAFKA_ERRORS, "kind" => failure.as_str()).increment(1);
                    tracing::debug!(kind = failure.as_str(), "usage: a delivery round failed; retrying");
                    if health == Health::Up {
                        if failure == DeliveryFailure::Fatal {
                            tracing::error!(kind = failure.as_str(), "usage: kafka refuses events; they stay in the spool");
                        } else {
                            tracing::warn!(kind = failure.as_str(), "usage: kafka went down; events stay in the spool");
                        }
                        health = Health::Down;
                    }
                    // A broker that came back empty (or a deleted topic) shows up as timed-out
                    // deliveries long before "unknown topic": check the topic before each retry.
                    topic_checked = false;
                    // The round's events are all still in the spool (a segment is deleted only once
                    // fully acknowledged), so dropping the producer loses nothing. Start the next
                    // round with a fresh producer: an idempotent producer keeps
                    // its producer id and sequence numbers, which a broker that lost its state
                    // (restarted empty, or a new cluster) never accepts again — found by the
                    // outage test, where the old producer timed out forever.
                    if let Some((code, why)) = self.producer.client().fatal_error() {
                        tracing::warn!(%code, why, "usage: the kafka producer failed fatally; starting a new one");
                    }
                    match producer(&self.config) {
                        Ok(p) => self.producer = p,
                        Err(e) => tracing::error!(error = %e, "usage: cannot start a new kafka producer"),
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.cancelled() => break,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        // Shutdown: one last pass (the spool was sealed before `stop`), bounded by the grace.
        let stop_now = CancellationToken::new();
        let last = tokio::time::timeout(grace, self.ship_all(&stop_now)).await;
        if !matches!(last, Ok(Ok(()))) {
            let left = sealed_segments(&self.dir).len();
            tracing::warn!(segments = left, "usage: stopping with events left in the spool; they are shipped at the next start");
        }
        let _ = self.producer.flush(Duration::from_secs(1));
    }

    async fn ship_all(&self, stop: &CancellationToken) -> Result<(), DeliveryFailure> {
        for segment in sealed_segments(&self.dir) {
            if stop.is_cancelled() {
                return Ok(());
            }
            let known = self.undeletable.lock().unwrap_or_else(|p| p.into_inner()).contains(&segment);
            if known {
                // shipped already: its deletion alone is tried again
                if gone(remove_segment(&segment, &self.total)).is_ok() {
                    self.undeletable.lock().unwrap_or_else(|p| p.into_inner()).remove(&segment);
                    tracing::info!(segment = %segment.display(), "usage: a shipped segment could be deleted at last");
                }
                continue;
            }
            let shipped = self.ship_segment(&segment).await?;
            if let Err(e) = gone(remove_segment(&segment, &self.total)) {
                tracing::error!(error = %e, segment = %segment.display(), "usage: cannot delete a shipped segment; its deletion is tried again, its events are not sent again (a restart sends them once more: the consumer drops repeated ids)");
                self.undeletable.lock().unwrap_or_else(|p| p.into_inner()).insert(segment.clone());
            }
            metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "delivered").increment(shipped.single + shipped.aggregated);
            if shipped.aggregates > 0 {
                metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "aggregated").increment(shipped.aggregated);
                metrics::counter!(crate::metrics::USAGE_AGGREGATES).increment(shipped.aggregates);
            }
            if shipped.duplicates > 0 {
                metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "duplicate").increment(shipped.duplicates);
            }
        }
        metrics::gauge!(crate::metrics::USAGE_SPOOL_BYTES).set(self.total.load(std::sync::atomic::Ordering::Relaxed) as f64);
        Ok(())
    }

    /// Sends every event of one segment (one message each, or combined in aggregates where the
    /// spool marked them: tollgate_shared::aggregate) and waits for all acknowledgements.
    async fn ship_segment(&self, segment: &std::path::Path) -> Result<SegmentPlan, DeliveryFailure> {
        let (lines, bad) = match read_segment(segment) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, segment = %segment.display(), "usage: cannot read a spool segment");
                return Err(DeliveryFailure::Transient);
            }
        };
        if bad > 0 {
            // torn lines of a crash: never acknowledged, the filter sent them again
            metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "torn").increment(bad as u64);
            tracing::warn!(segment = %segment.display(), lines = bad, "usage: skipped torn spool records (a crash mid-write; never acknowledged)");
        }
        let plan = tollgate_shared::aggregate::plan_segment(&lines);
        let mut pending = Vec::with_capacity(plan.messages.len());
        for message in &plan.messages {
            let (key, payload, schema): (&str, std::borrow::Cow<'_, [u8]>, &str) = match message {
                Outgoing::Line { index, tenant } => (tenant, std::borrow::Cow::Borrowed(lines[*index].as_slice()), SCHEMA),
                Outgoing::Aggregate(a) => {
                    let json = serde_json::to_vec(a).map_err(|_| DeliveryFailure::Fatal)?;
                    (&a.tenant, std::borrow::Cow::Owned(json), tollgate_shared::aggregate::SCHEMA)
                }
            };
            let headers = OwnedHeaders::new().insert(Header { key: "schema", value: Some(schema) });
            let mut record =
                FutureRecord::to(&self.config.topic).key(key.as_bytes()).payload(payload.as_ref()).headers(headers);
            loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => {
                        pending.push(delivery);
                        break;
                    }
                    Err((e, back)) => match classify_error(&e) {
                        DeliveryFailure::QueueFull => {
                            record = back;
                            // let librdkafka drain its queue
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        other => return Err(other),
                    },
                }
            }
        }
        let mut failure = None;
        for delivery in pending {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => failure = failure.or(Some(classify_error(&e))),
                Err(_) => failure = failure.or(Some(DeliveryFailure::Transient)),
            }
        }
        match failure {
            None => Ok(plan),
            Some(f) => Err(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_producer_is_idempotent_with_acks_all_and_takes_extra_properties() {
        let mut k = KafkaConfig { brokers: "b1:9092,b2:9092".into(), ..Default::default() };
        k.properties.insert("compression.type".into(), "zstd".into());
        k.properties.insert("security.protocol".into(), "ssl".into());
        let c: BTreeMap<String, String> = producer_config(&k).into_iter().collect();
        assert_eq!(c["bootstrap.servers"], "b1:9092,b2:9092");
        assert_eq!(c["enable.idempotence"], "true");
        assert_eq!(c["acks"], "all");
        assert_eq!(c["message.timeout.ms"], "30000");
        assert_eq!(c["compression.type"], "zstd");
        assert_eq!(c["security.protocol"], "ssl");
    }

    #[test]
    fn guarantees_cannot_be_configured_away() {
        let mut k = KafkaConfig::default();
        assert!(k.validate().is_ok());
        k.properties.insert("acks".into(), "1".into());
        assert_eq!(k.validate().unwrap_err().field, "usage.kafka.properties.acks");
        let k = KafkaConfig { topic: "bad topic".into(), ..Default::default() };
        assert_eq!(k.validate().unwrap_err().field, "usage.kafka.topic");
        let k = KafkaConfig { brokers: " ".into(), ..Default::default() };
        assert!(k.validate().is_err());
    }

    #[test]
    fn a_replicated_topic_is_created_acknowledging_only_what_two_replicas_hold() {
        let k = KafkaConfig { retention: Duration::from_secs(60), ..Default::default() };
        assert_eq!(new_topic_config(&k), [("retention.ms", "60000".to_string())], "one replica: the broker's own rule");
        let two = KafkaConfig { replication_factor: 2, ..k.clone() };
        assert_eq!(new_topic_config(&two).len(), 1, "two replicas: both required would stop delivery while one restarts");
        let k = KafkaConfig { replication_factor: 3, ..k };
        assert!(new_topic_config(&k).contains(&("min.insync.replicas", "2".to_string())));
    }

    #[test]
    fn delivery_errors_are_classified() {
        use RDKafkaErrorCode as C;
        assert_eq!(classify(Some(C::QueueFull)), DeliveryFailure::QueueFull);
        assert_eq!(classify(Some(C::MessageTimedOut)), DeliveryFailure::Transient);
        assert_eq!(classify(Some(C::AllBrokersDown)), DeliveryFailure::Transient);
        assert_eq!(classify(Some(C::BrokerTransportFailure)), DeliveryFailure::Transient);
        assert_eq!(classify(Some(C::NotLeaderForPartition)), DeliveryFailure::Transient);
        assert_eq!(classify(Some(C::UnknownTopicOrPartition)), DeliveryFailure::UnknownTopic);
        assert_eq!(classify(Some(C::MessageSizeTooLarge)), DeliveryFailure::Fatal);
        assert_eq!(classify(Some(C::TopicAuthorizationFailed)), DeliveryFailure::Fatal);
        assert_eq!(classify(None), DeliveryFailure::Transient);
    }
}
