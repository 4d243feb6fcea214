//! The sidecar's usage pipeline against real servers (issue 6): the sidecar binary, tansu (a
//! Kafka-compatible broker) and Redis. `POST /v1/usage` → spool → Kafka, keyed by tenant; a
//! broker outage and a sidecar crash lose nothing; a torn spool tail is skipped with a warning; a
//! batch sent again after a crash between its fsync and its answer counts once.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;
use tollgate_tests::broker::{first_header, partitions_by_key, read_topic, Broker};
use tollgate_tests::fixtures::{usage_event as event, DAY};
use tollgate_tests::{get, poll_until, post, Redis, Sidecar};
use tollgate_wire::usage::{UsageAck, UsageBatch, UsageEvent, USAGE_PATH};

fn config(broker: &Broker, topic: &str, spool: &Path) -> String {
    format!(
        "[usage]\nenabled = true\nspool_dir = \"{}\"\nsegment_age = \"50ms\"\n\
         [usage.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\npartitions = 4\ndelivery_timeout = \"3s\"\n",
        spool.display(),
        broker.brokers()
    )
}

fn send(sidecar: &Sidecar, events: &[UsageEvent]) -> UsageAck {
    let body = serde_json::to_string(&UsageBatch { events: events.to_vec() }).unwrap();
    let r = post(&sidecar.url(USAGE_PATH), &[("content-type", "application/json"), sidecar.auth()], &body);
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

fn ids(messages: &[(String, String)]) -> Vec<String> {
    messages.iter().map(|(_, v)| serde_json::from_str::<UsageEvent>(v).unwrap().id).collect()
}

#[test]
fn events_reach_kafka_once_each_keyed_and_ordered_by_tenant() {
    let (redis, broker, spool) = (Redis::start(), Broker::start(), tempfile::tempdir().unwrap());
    let sidecar = Sidecar::start_with_config(&redis.url(), &config(&broker, "usage_a", spool.path()), &[]);
    let tenants = ["acme", "beta", "gamma"];
    let mut sent = Vec::new();
    for seq in 0..40 {
        for t in tenants {
            sent.push(event(t, seq));
        }
    }
    for chunk in sent.chunks(25) {
        assert_eq!(send(&sidecar, chunk), UsageAck { accepted: chunk.len() as u64, invalid: 0 });
    }
    let got = read_topic(&broker.brokers(), "usage_a", sent.len(), Duration::from_secs(30));
    assert_eq!(got.len(), sent.len(), "every event delivered");
    let unique: HashSet<String> = ids(&got).into_iter().collect();
    assert_eq!(unique.len(), sent.len(), "none twice");
    // keyed by tenant; one tenant's events in order (they share a partition)
    let mut last: HashMap<String, u64> = HashMap::new();
    for (key, value) in &got {
        let e: UsageEvent = serde_json::from_str(value).unwrap();
        assert_eq!(key, &e.tenant);
        let prev = last.insert(e.tenant.clone(), e.start_ms);
        assert!(prev.is_none_or(|p| p < e.start_ms), "{} out of order", e.tenant);
    }
    let schema = first_header(&broker.brokers(), "usage_a", "schema", Duration::from_secs(30));
    assert_eq!(schema.as_deref(), Some("tollgate.usage.v2"), "versioned schema header");
    let parts = partitions_by_key(&broker.brokers(), "usage_a", sent.len(), Duration::from_secs(30));
    for t in tenants {
        assert_eq!(parts[t].len(), 1, "{t} is in one partition: {parts:?}");
    }
    // the Redis meter counted the day per tenant (36 ok + 4 404s each)
    poll_until("the meter", Duration::from_secs(10), || {
        let mut c = redis.connection().unwrap();
        let m: HashMap<String, i64> = redis::cmd("HGETALL").arg("usage:{acme}:20251130").query(&mut c).unwrap();
        m.get("ok") == Some(&36) && m.get("4xx") == Some(&4)
    });
    let mut c = redis.connection().unwrap();
    let ttl: i64 = redis::cmd("PTTL").arg("usage:{beta}:20251130").query(&mut c).unwrap();
    assert!(ttl > 34 * 24 * 3600 * 1000, "35-day TTL: {ttl}");
    let metrics = get(&sidecar.url("/metrics"), &[]).body;
    assert!(metrics.contains("tollgate_sidecar_usage_events_total{outcome=\"delivered\"} 120"), "{metrics}");
    redis.assert_ttl_invariant();
}

#[test]
fn a_broker_outage_and_a_sidecar_crash_lose_nothing() {
    let (redis, mut broker, spool) = (Redis::start(), Broker::start(), tempfile::tempdir().unwrap());
    let cfg = config(&broker, "usage_b", spool.path());
    let mut sidecar = Sidecar::start_with_config(&redis.url(), &cfg, &[]);
    let before: Vec<UsageEvent> = (0..20).map(|i| event("acme", i)).collect();
    send(&sidecar, &before);
    assert_eq!(read_topic(&broker.brokers(), "usage_b", 20, Duration::from_secs(30)).len(), 20);

    // the broker goes away (tansu keeps topics in memory: it comes back empty)
    broker.kill();
    let during: Vec<UsageEvent> = (20..80u64).map(|i| event(if i.is_multiple_of(2) { "acme" } else { "beta" }, i)).collect();
    for chunk in during.chunks(10) {
        assert_eq!(send(&sidecar, chunk).accepted, 10, "acknowledged: spooled on disk");
    }
    poll_until("the events to be spooled", Duration::from_secs(10), || {
        std::fs::read_dir(spool.path()).unwrap().count() > 0
    });
    // and the sidecar crashes with a non-empty spool
    sidecar.kill();
    broker.restart();
    let sidecar = Sidecar::start_with_config(&redis.url(), &cfg, &[]);
    let got = read_topic(&broker.brokers(), "usage_b", during.len(), Duration::from_secs(60));
    let got_ids: HashSet<String> = ids(&got).into_iter().collect();
    let want: HashSet<String> = during.iter().map(|e| e.id.clone()).collect();
    assert_eq!(got_ids, want, "every event of the outage delivered after the restart");
    assert_eq!(got.len(), want.len(), "no duplicates in this run");
    poll_until("the spool to drain", Duration::from_secs(20), || {
        std::fs::read_dir(spool.path()).unwrap().filter_map(|e| e.ok()).all(|e| !e.path().to_string_lossy().ends_with(".seg"))
    });
    drop(sidecar);
}

#[test]
fn a_torn_spool_tail_is_skipped_with_a_warning() {
    let (redis, broker, spool) = (Redis::start(), Broker::start(), tempfile::tempdir().unwrap());
    // what a crash mid-write leaves: complete records, then half of one, in a segment left open
    let mut text = String::new();
    for i in 0..3 {
        text.push_str(&serde_json::to_string(&event("acme", i)).unwrap());
        text.push('\n');
    }
    text.push_str(&serde_json::to_string(&event("acme", 3)).unwrap()[..40]);
    std::fs::write(spool.path().join("00000000000000000007.open"), text).unwrap();
    let sidecar = Sidecar::start_with_config(&redis.url(), &config(&broker, "usage_c", spool.path()), &[]);
    let got = read_topic(&broker.brokers(), "usage_c", 3, Duration::from_secs(30));
    assert_eq!(ids(&got), (0..3).map(|i| event("acme", i).id).collect::<Vec<_>>());
    poll_until("the warning", Duration::from_secs(10), || sidecar.log_text().contains("skipped torn spool records"));
    // new events go to a later segment and are delivered too
    send(&sidecar, &[event("acme", 9)]);
    assert_eq!(read_topic(&broker.brokers(), "usage_c", 4, Duration::from_secs(30)).len(), 4);
}

#[test]
fn invalid_events_are_refused_and_metering_off_answers_404() {
    let (redis, broker, spool) = (Redis::start(), Broker::start(), tempfile::tempdir().unwrap());
    let sidecar = Sidecar::start_with_config(&redis.url(), &config(&broker, "usage_d", spool.path()), &[]);
    let mut bad = event("acme", 1);
    bad.tenant = "a:b".into();
    assert_eq!(send(&sidecar, &[event("acme", 0), bad]), UsageAck { accepted: 1, invalid: 1 });
    let r = post(&sidecar.url(USAGE_PATH), &[sidecar.auth()], "{not json");
    assert_eq!(r.status, 400);
    let off = Sidecar::start(&redis.url(), &[]);
    let r = post(&off.url(USAGE_PATH), &[off.auth()], r#"{"events":[]}"#);
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("usage_disabled"));
}

/// Every message of `topic` as (key, `schema` header, value), until `want` arrived.
fn read_with_schema(brokers: &str, topic: &str, want: usize, deadline: Duration) -> Vec<(String, String, String)> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "tests-schema")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut partitions = 0;
    poll_until("the topic", Duration::from_secs(30), || {
        partitions = c
            .fetch_metadata(Some(topic), Duration::from_secs(2))
            .ok()
            .and_then(|m| m.topics().first().map(|t| t.partitions().len()))
            .unwrap_or(0);
        partitions > 0
    });
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p as i32, rdkafka::Offset::Beginning).unwrap();
    }
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let start = std::time::Instant::now();
    while out.len() < want && start.elapsed() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
            let text = |b: Option<&[u8]>| String::from_utf8_lossy(b.unwrap_or_default()).into_owned();
            let schema = m.headers().and_then(|h| h.iter().find(|h| h.key == "schema").map(|h| text(h.value)));
            out.push((text(m.key()), schema.unwrap_or_default(), text(m.payload())));
        }
    }
    out
}

#[test]
fn a_tenant_above_the_rate_reaches_kafka_as_aggregates_with_their_own_schema() {
    let (redis, broker, spool) = (Redis::start(), Broker::start(), tempfile::tempdir().unwrap());
    let cfg = config(&broker, "usage_g", spool.path()).replace("[usage.kafka]", "aggregate_above_rps = 10\n[usage.kafka]");
    let sidecar = Sidecar::start_with_config(&redis.url(), &cfg, &[]);
    // one batch: 100 of acme (above 10 in this second from its 11th event on), 3 of beta
    let mut sent: Vec<UsageEvent> = (0..100).map(|i| event("acme", i)).collect();
    sent.extend((0..3).map(|i| event("beta", i)));
    send(&sidecar, &sent);
    // 10 single acme events + the aggregates of the 90 others (their startMs span one second) + 3 beta
    let got = read_with_schema(&broker.brokers(), "usage_g", 14, Duration::from_secs(30));
    assert_eq!(got.len(), 14, "{got:?}");
    let (mut single, mut aggregated) = (HashMap::<String, u64>::new(), 0);
    for (key, schema, value) in &got {
        let v: serde_json::Value = serde_json::from_str(value).unwrap();
        assert_eq!(v["tenant"].as_str(), Some(key.as_str()));
        match schema.as_str() {
            "tollgate.usage.v2" => *single.entry(key.clone()).or_default() += 1,
            "tollgate.usage.aggregate.v1" => {
                assert_eq!(key, "acme");
                let a: tollgate_shared::aggregate::UsageAggregate = serde_json::from_str(value).unwrap();
                assert_eq!(a.invalid_reason(), None);
                assert_eq!(a.second_ms, DAY);
                let k = &a.keys[0];
                // events 10..100: every 10th is a 404; tokens = seq; bytes 100/200 each
                assert_eq!((k.count, k.requests.client_error, k.tokens, k.request_bytes), (90, 9, (10..100).sum(), 9000));
                aggregated += a.count;
            }
            other => panic!("schema {other}"),
        }
    }
    assert_eq!((single["acme"], aggregated, single["beta"]), (10, 90, 3));
    poll_until("the metrics", Duration::from_secs(10), || {
        let m = get(&sidecar.url("/metrics"), &[]).body;
        m.contains("tollgate_sidecar_usage_aggregates_total 1\n")
            && m.contains("tollgate_sidecar_usage_events_total{outcome=\"aggregated\"} 90")
            && m.contains("tollgate_sidecar_usage_events_total{outcome=\"delivered\"} 103")
    });
    // the filter sends the batch again (its call timed out although the sidecar took it): taken
    // (acknowledged), but not spooled again — its events are in aggregates already
    assert_eq!(send(&sidecar, &sent).accepted, 103);
    send(&sidecar, &[event("beta", 50)]);
    poll_until("only the new event delivered", Duration::from_secs(30), || {
        let m = get(&sidecar.url("/metrics"), &[]).body;
        m.contains("tollgate_sidecar_usage_events_total{outcome=\"delivered\"} 104\n")
            && m.contains("tollgate_sidecar_usage_events_total{outcome=\"duplicate\"} 103\n")
    });
    assert_eq!(read_with_schema(&broker.brokers(), "usage_g", 16, Duration::from_secs(5)).len(), 15, "one more message, the new event");
}

#[test]
fn a_batch_sent_again_after_a_crash_between_its_fsync_and_its_answer_counts_once() {
    // An aggregated tenant's events cannot be told apart by id once in an aggregate, so the
    // sidecar drops an event id it accepted lately; at start it refills that window from the
    // spool (docs/usage-events.md). Here the sidecar acknowledged a batch (spooled and fsynced),
    // was killed before the segment shipped, and the filter — which never saw the answer — sends
    // the batch again to the new process: it is taken (acknowledged) but not spooled again, and
    // the crashed segment ships once: acme's events count 100, not 200.
    let (redis, broker, spool) = (Redis::start(), Broker::start(), tempfile::tempdir().unwrap());
    let cfg = config(&broker, "usage_h", spool.path())
        .replace("segment_age = \"50ms\"", "segment_age = \"60s\"")
        .replace("[usage.kafka]", "aggregate_above_rps = 10\n[usage.kafka]");
    let mut sidecar = Sidecar::start_with_config(&redis.url(), &cfg, &[]);
    let sent: Vec<UsageEvent> = (0..100).map(|i| event("acme", i)).collect();
    assert_eq!(send(&sidecar, &sent).accepted, 100);
    sidecar.restart(); // SIGKILL: the segment holding the batch is still open (60 s age)
    assert_eq!(send(&sidecar, &sent).accepted, 100, "the re-sent batch is acknowledged");
    poll_until("the re-sent events counted as duplicates", Duration::from_secs(10), || {
        get(&sidecar.url("/metrics"), &[]).body.contains("tollgate_sidecar_usage_events_total{outcome=\"duplicate\"} 100\n")
    });
    // the crashed segment, sealed at start, ships: 10 single events and aggregates of 90
    let got = read_with_schema(&broker.brokers(), "usage_h", 11, Duration::from_secs(30));
    let counted: u64 = got
        .iter()
        .map(|(_, schema, value)| match schema.as_str() {
            "tollgate.usage.v2" => 1,
            _ => serde_json::from_str::<tollgate_shared::aggregate::UsageAggregate>(value).unwrap().count,
        })
        .sum();
    assert_eq!(counted, 100, "{got:?}");
    assert_eq!(read_with_schema(&broker.brokers(), "usage_h", 12, Duration::from_secs(5)).len(), 11, "nothing shipped twice");
}

#[test]
fn copies_of_a_batch_sent_at_once_to_a_full_spool_are_never_acknowledged() {
    // With aggregation on, an id accepted lately is dropped as a duplicate. Before this test, ids
    // were remembered before their write's answer: a copy of a batch arriving while the first
    // copy's write was pending was answered 200 as a duplicate, and when that write then failed
    // (a full disk) the events were lost. Now such a copy is refused (503, the filter sends it
    // again) and only a write's success makes an id a duplicate.
    let (redis, spool) = (Redis::start(), tempfile::tempdir().unwrap());
    let cfg = format!(
        "[usage]\nenabled = true\nspool_dir = \"{}\"\nsegment_age = \"60s\"\nmax_spool_mb = 1\naggregate_above_rps = 10\n\
         [usage.kafka]\nbrokers = \"127.0.0.1:{}\"\ntopic = \"usage_full\"\npartitions = 1\n",
        spool.path().display(),
        tollgate_tests::free_port()
    );
    let sidecar = Sidecar::start_with_config(&redis.url(), &cfg, &[]);
    let post_batch = |events: &[UsageEvent]| {
        let body = serde_json::to_string(&UsageBatch { events: events.to_vec() }).unwrap();
        post(&sidecar.url(USAGE_PATH), &[("content-type", "application/json"), sidecar.auth()], &body)
    };
    // fill the spool (1 MiB; no broker to ship to) until it refuses a batch of 500 events, then
    // one of 20 (the size of the batch below)
    let mut seq = 0;
    for size in [500, 20] {
        loop {
            let batch: Vec<UsageEvent> = (seq..seq + size).map(|i| event("acme", i)).collect();
            seq += size;
            let r = post_batch(&batch);
            if r.status == 503 {
                assert!(r.body.contains("full"), "{}", r.body);
                break;
            }
            assert_eq!(r.status, 200, "{}", r.body);
            assert!(seq < 100_000, "the spool never filled");
        }
    }
    let batch: Vec<UsageEvent> = (0..20).map(|i| event("late", i)).collect();
    for round in 0..5 {
        let answers: Vec<(u16, String)> = std::thread::scope(|s| {
            let posts: Vec<_> = (0..16).map(|_| s.spawn(|| post_batch(&batch))).collect();
            posts.into_iter().map(|p| p.join().unwrap()).map(|r| (r.status, r.body)).collect()
        });
        for (status, body) in &answers {
            assert_eq!(*status, 503, "round {round}: a copy acknowledged while nothing was written: {body}");
        }
    }
    let metrics = get(&sidecar.url("/metrics"), &[]).body;
    assert!(!metrics.contains("outcome=\"duplicate\""), "nothing of the refused batch counted spooled: {metrics}");
    assert!(metrics.contains("tollgate_sidecar_usage_events_total{outcome=\"refused\"}"), "{metrics}");
    poll_until("the refusal logged with the spool's directory", Duration::from_secs(5), || {
        sidecar.log_text().contains("the spool refused a batch") && sidecar.log_text().contains(&spool.path().display().to_string())
    });
}
