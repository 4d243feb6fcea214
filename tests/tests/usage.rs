//! Usage metering end to end (issue 6), all real: Envoy 1.40 with the filter, the sidecar binary,
//! Redis, tansu (Kafka), the billing consumer and PostgreSQL. Requests of several tenants become
//! exactly one event each (allowed ones reported by the filter in batches, denials by the
//! sidecar), one partition per tenant, and the PostgreSQL rollup matches the traffic — also when
//! the broker goes away in the middle of it.

use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tollgate_tests::billing::{psql, psql_i64, Billing};
use tollgate_tests::broker::{partitions_by_key, read_topic, Broker};
use tollgate_tests::postgres::Postgres;
use tollgate_tests::{get, poll_until, start_echo, Envoy, EnvoyOptions, InProcess, IssuedKey, Redis, Sidecar};
use tollgate_wire::usage::UsageEvent;

const PLUGIN: &str = r#"{"sidecar":{"timeout":"2s"},"usage":{"enabled":true,"flushInterval":"100ms"}}"#;

struct Stack {
    redis: Redis,
    broker: Broker,
    pg: Postgres,
    _upstream: InProcess,
    sidecar: Sidecar,
    envoy: Envoy,
    _spool: tempfile::TempDir,
}

fn stack(topic: &str) -> Stack {
    let (redis, broker, pg, upstream) = (Redis::start(), Broker::start(), Postgres::start(), start_echo());
    let spool = tempfile::tempdir().unwrap();
    let config = format!(
        "[[plans.small.limits]]\nname = \"few\"\nalgorithm = \"sliding_log\"\nlimit = 5\nwindow = \"1h\"\n\
         [usage]\nenabled = true\nspool_dir = \"{}\"\nsegment_age = \"50ms\"\n\
         [usage.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\npartitions = 4\ndelivery_timeout = \"3s\"\n",
        spool.path().display(),
        broker.brokers()
    );
    let sidecar = Sidecar::start_with_config(&redis.url(), &config, &[]);
    let envoy = Envoy::start(EnvoyOptions::new(upstream.port, sidecar.port).plugin_config(PLUGIN).concurrency(2));
    Stack { redis, broker, pg, _upstream: upstream, sidecar, envoy, _spool: spool }
}

/// Requests summed over the rollup per tenant: (all, ok, 4xx, 5xx, denied, tokens).
fn rollup(pg: &Postgres) -> HashMap<String, [i64; 6]> {
    psql(
        pg,
        "SELECT tenant, sum(requests_ok+requests_4xx+requests_5xx+requests_denied+requests_aborted), sum(requests_ok), \
         sum(requests_4xx), sum(requests_5xx), sum(requests_denied), sum(tokens) FROM usage_daily GROUP BY tenant",
    )
    .unwrap_or_default()
    .iter()
    .map(|row| {
        let v: Vec<&str> = row.split('|').collect();
        let n: Vec<i64> = v[1..].iter().map(|x| x.parse().unwrap_or(-1)).collect();
        (v[0].to_string(), [n[0], n[1], n[2], n[3], n[4], n[5]])
    })
    .collect()
}

fn call(envoy: &Envoy, key: &IssuedKey, extra: &[(&str, &str)]) -> u16 {
    let mut h = vec![("x-api-key", key.raw.as_str())];
    h.extend_from_slice(extra);
    get(&envoy.url("/v1/items?page=2"), &h).status
}

#[test]
fn every_request_becomes_one_event_and_the_rollup_matches_the_traffic() {
    let s = stack("usage_events");
    let acme = s.sidecar.create_key("acme", "big", &[]);
    let beta = s.sidecar.create_key("beta", "big", &[]);
    let gamma = s.sidecar.create_key("gamma", "small", &[]);
    let _billing = Billing::start(&s.broker.brokers(), "usage_events", "billing", &s.pg, &[]);

    // acme: 30 ok (10 of them report 7 tokens), 5 answered 404, 5 answered 503 by the upstream
    for i in 0..30 {
        let usage = if i < 10 { vec![("x-echo-usage", "7")] } else { vec![] };
        assert_eq!(call(&s.envoy, &acme, &usage), 200);
    }
    for _ in 0..5 {
        assert_eq!(call(&s.envoy, &acme, &[("x-echo-status", "404")]), 404);
        assert_eq!(call(&s.envoy, &acme, &[("x-echo-status", "503")]), 503);
    }
    // beta: 20 ok (many from the filter's auth cache, no call to the sidecar)
    for _ in 0..20 {
        assert_eq!(call(&s.envoy, &beta, &[]), 200);
    }
    // gamma: a 5-request limit: 5 ok, then 5 denied by the sidecar
    let statuses: Vec<u16> = (0..10).map(|_| call(&s.envoy, &gamma, &[])).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 5, "{statuses:?}");
    // no key: the filter's own 401, nobody to bill
    assert_eq!(get(&s.envoy.url("/"), &[]).status, 401);

    let want: HashMap<String, [i64; 6]> = [
        ("acme".to_string(), [40, 30, 5, 5, 0, 70]),
        ("beta".to_string(), [20, 20, 0, 0, 0, 0]),
        ("gamma".to_string(), [10, 5, 0, 0, 5, 0]),
    ]
    .into();
    poll_until("the rollup to match the traffic", Duration::from_secs(60), || rollup(&s.pg) == want);
    assert_eq!(psql_i64(&s.pg, "SELECT count(*) FROM usage_events"), 70, "exactly one event per request");

    // on the topic: 70 events, each once, every tenant in one partition, in order
    let got = read_topic(&s.broker.brokers(), "usage_events", 70, Duration::from_secs(30));
    let events: Vec<UsageEvent> = got.iter().map(|(_, v)| serde_json::from_str(v).unwrap()).collect();
    assert_eq!(events.iter().map(|e| e.id.clone()).collect::<HashSet<_>>().len(), 70);
    for e in &events {
        assert_eq!(e.path, "/v1/items", "no query string in events");
        assert!(e.key_id.starts_with("key_"));
    }
    let parts = partitions_by_key(&s.broker.brokers(), "usage_events", 70, Duration::from_secs(30));
    assert!(["acme", "beta", "gamma"].iter().all(|t| parts[*t].len() == 1), "{parts:?}");
    let denied: Vec<&UsageEvent> = events.iter().filter(|e| e.denied.is_some()).collect();
    assert_eq!(denied.len(), 5);
    assert!(denied.iter().all(|e| e.tenant == "gamma" && e.status == 429 && e.denied.as_deref() == Some("rate_limited")));
    // no raw key anywhere: not in events, not in Redis
    let all = got.iter().map(|(_, v)| v.as_str()).collect::<String>();
    for k in [&acme, &beta, &gamma] {
        assert!(!all.contains(&k.raw));
    }
    s.redis.assert_no_raw_keys(&[&acme.raw, &beta.raw, &gamma.raw]);
    // the meter (Redis) saw the same day's traffic; every key carries its TTL
    let day = tollgate_wire::usage::Day::of_ms(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64,
    );
    let mut c = s.redis.connection().unwrap();
    let m: HashMap<String, i64> =
        redis::cmd("HGETALL").arg(format!("usage:{{gamma}}:{}", day.compact())).query(&mut c).unwrap();
    assert_eq!((m.get("ok"), m.get("denied")), (Some(&5), Some(&5)), "{m:?}");
    s.redis.assert_ttl_invariant();
    assert!(s.envoy.counter("wasmcustom.tollgate.usage.batches_sent") >= 1);
    assert_eq!(s.envoy.counter("wasmcustom.tollgate.usage.dropped"), 0);
}

#[test]
fn a_broker_outage_during_traffic_loses_nothing_and_counts_nothing_twice() {
    let mut s = stack("usage_events");
    let acme = s.sidecar.create_key("acme", "big", &[]);
    let beta = s.sidecar.create_key("beta", "big", &[]);
    let mut billing = Billing::start(&s.broker.brokers(), "usage_events", "billing", &s.pg, &[]);
    for _ in 0..10 {
        assert_eq!(call(&s.envoy, &acme, &[]), 200);
        assert_eq!(call(&s.envoy, &beta, &[]), 200);
    }
    poll_until("the first 20 in the rollup", Duration::from_secs(60), || {
        rollup(&s.pg).values().map(|v| v[0]).sum::<i64>() == 20
    });

    // the broker stops in the middle of the traffic; requests go on, their events wait on disk
    s.broker.kill();
    for _ in 0..15 {
        assert_eq!(call(&s.envoy, &acme, &[]), 200);
        assert_eq!(call(&s.envoy, &beta, &[]), 200);
    }
    // it comes back (tansu's memory storage: as an empty cluster, so the consumer starts again)
    s.broker.restart();
    billing.kill();
    let _billing = Billing::start(&s.broker.brokers(), "usage_events", "billing", &s.pg, &[]);
    let want: HashMap<String, [i64; 6]> =
        [("acme".to_string(), [25, 25, 0, 0, 0, 0]), ("beta".to_string(), [25, 25, 0, 0, 0, 0])].into();
    poll_until("every event delivered and counted once", Duration::from_secs(90), || rollup(&s.pg) == want);
    assert_eq!(psql_i64(&s.pg, "SELECT count(*) FROM usage_events"), 50);
    assert!(s.sidecar.log_text().contains("kafka went down"), "the outage was noticed (logged once)");
    assert_eq!(s.envoy.counter("wasmcustom.tollgate.usage.dropped"), 0);
}
