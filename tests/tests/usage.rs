//! Usage metering end to end (issue 6), all real: Envoy 1.40 with the filter, the sidecar binary,
//! Redis, tansu (Kafka), the billing consumer and PostgreSQL. Requests of several tenants become
//! exactly one event each (allowed ones reported by the filter in batches, denials by the
//! sidecar), one partition per tenant, and the PostgreSQL rollup matches the traffic — also when
//! the broker goes away (or hangs) in the middle of it. With `aggregate_above_rps`, a high-rate tenant's
//! events come as per-second aggregates whose counts add up exactly, through an outage, a crash
//! with a full spool, and a replay of already-shipped segments.

use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tollgate_tests::billing::{psql, psql_i64};
use tollgate_tests::broker::{partitions_by_key, read_topic};
use tollgate_tests::postgres::Postgres;
use tollgate_tests::{get, poll_until, Envoy, Gateway, IssuedKey};
use tollgate_wire::usage::UsageEvent;

/// Every piece of the usage pipeline: Envoy (2 workers) metering, a sidecar spooling to the
/// gateway's spool and shipping to the broker's topic `usage_events`, the billing consumer
/// (group `billing`) writing to PostgreSQL. `usage` are more `[usage]` settings (lines).
fn gateway(usage: &str) -> Gateway {
    gateway_spooling_to("${SPOOL_DIR}", usage)
}

/// [`gateway`] with the spool in `spool_dir`.
fn gateway_spooling_to(spool_dir: &str, usage: &str) -> Gateway {
    Gateway::builder()
        .sidecar_toml(&format!(
            "[[plans.small.limits]]\nname = \"few\"\nalgorithm = \"sliding_log\"\nlimit = 5\nwindow = \"1h\"\n\
             [usage]\nenabled = true\nspool_dir = \"{spool_dir}\"\nsegment_age = \"50ms\"\n{usage}\
             [usage.kafka]\nbrokers = \"${{BROKERS}}\"\ntopic = \"usage_events\"\npartitions = 4\ndelivery_timeout = \"3s\"\n"
        ))
        .plugin(json!({"sidecar": {"timeout": "2s"}, "usage": {"enabled": true, "flushInterval": "100ms"}}))
        .concurrency(2)
        .billing("usage_events", "billing")
        .build()
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
    let s = gateway("");
    let acme = s.sidecar().create_key("acme", "big", &[]);
    let beta = s.sidecar().create_key("beta", "big", &[]);
    let gamma = s.sidecar().create_key("gamma", "small", &[]);

    // acme: 30 ok (10 of them report 7 tokens), 5 answered 404, 5 answered 503 by the upstream
    for i in 0..30 {
        let usage = if i < 10 { vec![("x-echo-usage", "7")] } else { vec![] };
        assert_eq!(call(s.envoy(), &acme, &usage), 200);
    }
    for _ in 0..5 {
        assert_eq!(call(s.envoy(), &acme, &[("x-echo-status", "404")]), 404);
        assert_eq!(call(s.envoy(), &acme, &[("x-echo-status", "503")]), 503);
    }
    // beta: 20 ok (many from the filter's auth cache, no call to the sidecar)
    for _ in 0..20 {
        assert_eq!(call(s.envoy(), &beta, &[]), 200);
    }
    // gamma: a 5-request limit: 5 ok, then 5 denied by the sidecar
    let statuses: Vec<u16> = (0..10).map(|_| call(s.envoy(), &gamma, &[])).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 5, "{statuses:?}");
    // no key: the filter's own 401, nobody to bill
    assert_eq!(get(&s.envoy().url("/"), &[]).status, 401);

    let want: HashMap<String, [i64; 6]> = [
        ("acme".to_string(), [40, 30, 5, 5, 0, 70]),
        ("beta".to_string(), [20, 20, 0, 0, 0, 0]),
        ("gamma".to_string(), [10, 5, 0, 0, 5, 0]),
    ]
    .into();
    poll_until("the rollup to match the traffic", Duration::from_secs(60), || rollup(s.pg()) == want);
    assert_eq!(psql_i64(s.pg(), "SELECT count(*) FROM usage_events"), 70, "exactly one event per request");

    // on the topic: 70 events, each once, every tenant in one partition, in order
    let got = read_topic(&s.broker().brokers(), "usage_events", 70, Duration::from_secs(30));
    let events: Vec<UsageEvent> = got.iter().map(|(_, v)| serde_json::from_str(v).unwrap()).collect();
    assert_eq!(events.iter().map(|e| e.id.clone()).collect::<HashSet<_>>().len(), 70);
    for e in &events {
        assert_eq!(e.path, "/v1/items", "no query string in events");
        assert!(e.key_id.starts_with("key_"));
    }
    let parts = partitions_by_key(&s.broker().brokers(), "usage_events", 70, Duration::from_secs(30));
    assert!(["acme", "beta", "gamma"].iter().all(|t| parts[*t].len() == 1), "{parts:?}");
    let denied: Vec<&UsageEvent> = events.iter().filter(|e| e.denied.is_some()).collect();
    assert_eq!(denied.len(), 5);
    assert!(denied.iter().all(|e| e.tenant == "gamma" && e.status == 429 && e.denied.as_deref() == Some("rate_limited")));
    // no raw key anywhere: not in events, not in Redis
    let all = got.iter().map(|(_, v)| v.as_str()).collect::<String>();
    for k in [&acme, &beta, &gamma] {
        assert!(!all.contains(&k.raw));
    }
    s.redis().assert_no_raw_keys(&[&acme.raw, &beta.raw, &gamma.raw]);
    // the meter (Redis) saw the same day's traffic; every key carries its TTL
    let day = tollgate_wire::usage::Day::of_ms(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64,
    );
    let mut c = s.redis().connection().unwrap();
    let m: HashMap<String, i64> =
        redis::cmd("HGETALL").arg(format!("usage:{{gamma}}:{}", day.compact())).query(&mut c).unwrap();
    assert_eq!((m.get("ok"), m.get("denied")), (Some(&5), Some(&5)), "{m:?}");
    s.redis().assert_ttl_invariant();
    assert!(s.envoy().counter("wasmcustom.tollgate.usage.batches_sent") >= 1);
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.usage.dropped"), 0);
}

/// Decision 183: a response too large to read for its usage (a 1.2 MB JSON document) is billed
/// as unread, apart from one read and holding no tokens; before, both were 0 tokens alike.
#[test]
fn a_response_whose_usage_could_not_be_read_is_billed_as_unread() {
    let s = gateway("");
    let key = s.sidecar().create_key("acme", "big", &[]);
    assert_eq!(call(s.envoy(), &key, &[("x-echo-usage", "7")]), 200);
    assert_eq!(call(s.envoy(), &key, &[("x-echo-usage", "9"), ("x-echo-pad", "600000")]), 200);
    assert_eq!(call(s.envoy(), &key, &[]), 200);
    let unread = "SELECT coalesce(sum(requests_tokens_unread), 0) FROM usage_daily WHERE tenant = 'acme'";
    poll_until("the rollup", Duration::from_secs(60), || rollup(s.pg()).get("acme").map(|r| r[0]) == Some(3));
    assert_eq!(rollup(s.pg())["acme"][5], 7);
    assert_eq!(psql_i64(s.pg(), unread), 1);
    let got = read_topic(&s.broker().brokers(), "usage_events", 3, Duration::from_secs(30));
    let mut said: Vec<(Option<u64>, bool)> =
        got.iter().map(|(_, v)| serde_json::from_str::<UsageEvent>(v).unwrap()).map(|e| (e.tokens, e.tokens_unread)).collect();
    said.sort();
    assert_eq!(said, [(None, false), (None, true), (Some(7), false)]);
}

#[test]
fn a_broker_outage_during_traffic_loses_nothing_and_counts_nothing_twice() {
    let mut s = gateway("");
    let acme = s.sidecar().create_key("acme", "big", &[]);
    let beta = s.sidecar().create_key("beta", "big", &[]);
    for _ in 0..10 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
        assert_eq!(call(s.envoy(), &beta, &[]), 200);
    }
    poll_until("the first 20 in the rollup", Duration::from_secs(60), || {
        rollup(s.pg()).values().map(|v| v[0]).sum::<i64>() == 20
    });

    // the broker stops in the middle of the traffic; requests go on, their events wait on disk
    s.broker_mut().kill();
    for _ in 0..15 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
        assert_eq!(call(s.envoy(), &beta, &[]), 200);
    }
    // it comes back (tansu's memory storage: as an empty cluster, so the consumer starts again)
    s.broker_mut().restart();
    s.billing_mut().restart();
    let want: HashMap<String, [i64; 6]> =
        [("acme".to_string(), [25, 25, 0, 0, 0, 0]), ("beta".to_string(), [25, 25, 0, 0, 0, 0])].into();
    poll_until("every event delivered and counted once", Duration::from_secs(90), || rollup(s.pg()) == want);
    assert_eq!(psql_i64(s.pg(), "SELECT count(*) FROM usage_events"), 50);
    assert!(s.sidecar().log_text().contains("kafka went down"), "the outage was noticed (logged once)");
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.usage.dropped"), 0);
}

#[test]
fn a_hung_broker_holds_no_request_and_loses_nothing() {
    // Stopped, not down (SIGSTOP): the producer's requests get no answer at all. Requests never
    // wait on Kafka (docs/operations.md): each one is answered while the broker hangs (the
    // client gives up after 15 s), and once it resumes every event is delivered and counted once.
    let s = gateway("");
    let acme = s.sidecar().create_key("acme", "big", &[]);
    assert_eq!(call(s.envoy(), &acme, &[]), 200);
    poll_until("the first event in the rollup", Duration::from_secs(60), || rollup(s.pg()).get("acme").map(|v| v[0]) == Some(1));
    s.broker().pause();
    for _ in 0..30 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
    }
    s.broker().resume();
    let want: HashMap<String, [i64; 6]> = [("acme".to_string(), [31, 31, 0, 0, 0, 0])].into();
    poll_until("every event delivered and counted once", Duration::from_secs(90), || rollup(s.pg()) == want);
    assert_eq!(psql_i64(s.pg(), "SELECT count(*) FROM usage_events"), 31);
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.usage.dropped"), 0);
}

#[test]
fn a_new_plugin_configuration_first_sends_what_the_old_one_held_and_each_request_is_billed_once() {
    // A control plane replaces the filter's plugin configuration (here: a file Envoy watches)
    // while both workers hold usage events they have not sent: a flush every 60 s, the first one
    // a whole interval after the start. The old configuration's root contexts send them before
    // they end (decision 156); before, they ended with their worker, uncounted.
    let s = Gateway::builder()
        .sidecar_toml(
            "[usage]\nenabled = true\nspool_dir = \"${SPOOL_DIR}\"\nsegment_age = \"50ms\"\n\
             [usage.kafka]\nbrokers = \"${BROKERS}\"\ntopic = \"usage_events\"\npartitions = 4\ndelivery_timeout = \"3s\"\n",
        )
        .billing("usage_events", "billing")
        .without_envoy()
        .build();
    let plugin = |every: &str| json!({"sidecar": {"timeout": "2s"}, "usage": {"enabled": true, "flushInterval": every}});
    let mut envoy = s.start_envoy(|o| o.plugin_config(plugin("60s")).concurrency(2).plugin_config_in_file());
    let acme = s.sidecar().create_key("acme", "big", &[]);
    for _ in 0..20 {
        assert_eq!(call(&envoy, &acme, &[]), 200);
    }
    let spooled = || s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"spooled\"}");
    assert_eq!(spooled(), 0, "the workers hold the 20 events (their first flush is 60 s away)");

    envoy.set_plugin_config(plugin("100ms"));
    for _ in 0..10 {
        assert_eq!(call(&envoy, &acme, &[]), 200);
    }
    let want: HashMap<String, [i64; 6]> = [("acme".to_string(), [30, 30, 0, 0, 0, 0])].into();
    poll_until("the old configuration's 20 events and the new one's 10 billed", Duration::from_secs(60), || rollup(s.pg()) == want);
    assert_eq!(psql_i64(s.pg(), "SELECT count(*) FROM usage_events"), 30, "each request billed once");
    assert_eq!(spooled(), 30);
    assert_eq!(envoy.counter("wasmcustom.tollgate.usage.dropped"), 0);

    // An ending root context that holds events does not hold Envoy's own stop.
    envoy.set_plugin_config(plugin("60s"));
    for _ in 0..5 {
        assert_eq!(call(&envoy, &acme, &[]), 200);
    }
    let status = envoy.terminate(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "Envoy stops on SIGTERM with events queued: {status:?}");
}

/// A file even root cannot delete (`chattr +i`, the immutable attribute), made deletable again at
/// drop.
struct Undeletable(std::path::PathBuf);

impl Undeletable {
    fn set(path: &std::path::Path) -> Undeletable {
        let out = std::process::Command::new("chattr").arg("+i").arg(path).output().expect("chattr");
        assert!(out.status.success(), "chattr +i (this test needs root on ext4): {}", String::from_utf8_lossy(&out.stderr));
        Undeletable(path.to_path_buf())
    }
}

impl Drop for Undeletable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

#[test]
fn a_shipped_segment_the_disk_will_not_delete_is_not_shipped_again() {
    // Decision 155: the shipper used to send such a segment again every round (about every
    // second), filling the topic with duplicates for as long as the disk refused.
    let s = gateway("");
    let acme = s.sidecar().create_key("acme", "big", &[]);
    let delivered = || s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"delivered\"}");
    s.broker().pause();
    for _ in 0..10 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
    }
    let sealed = || segments(s.spool_dir()).into_iter().find(|p| p.extension().is_some_and(|x| x == "seg"));
    poll_until("the 10 events in a sealed segment", Duration::from_secs(30), || {
        s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"spooled\"}") >= 10 && sealed().is_some()
    });
    let _stuck = Undeletable::set(&sealed().unwrap());
    s.broker().resume();
    poll_until("the stuck segment shipped", Duration::from_secs(60), || delivered() >= 10);
    poll_until("its deletion refused", Duration::from_secs(20), || s.sidecar().log_text().contains("cannot delete a shipped segment"));
    // a later segment ships after it, in order: by then a shipper that sent the stuck one
    // again would have counted its 10 events once more
    for _ in 0..5 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
    }
    poll_until("the later events shipped", Duration::from_secs(60), || delivered() >= 15);
    assert_eq!(delivered(), 15, "the stuck segment's events went to Kafka once");
    let want: HashMap<String, [i64; 6]> = [("acme".to_string(), [15, 15, 0, 0, 0, 0])].into();
    poll_until("each request billed once", Duration::from_secs(60), || rollup(s.pg()) == want);
}

/// A real small disk: a tmpfs mounted for the test (the test machine runs as root), unmounted
/// at drop.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn mount(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("mount");
        assert!(out.status.success(), "mounting a tmpfs (this test needs root): {}", String::from_utf8_lossy(&out.stderr));
        SmallDisk(dir)
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }

    /// Fills what is left of the disk with a filler file (appending to it); returns its size.
    fn fill(&self) -> u64 {
        use std::io::Write;
        let path = self.path().join("filler");
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).expect("filler");
        let chunk = vec![b'x'; 4096];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC: full
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
        // the last page may be partly free: single bytes until ENOSPC
        while let Ok(1) = f.write(b"x") {}
        std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0)
    }

    fn free(&self) {
        let _ = std::fs::remove_file(self.path().join("filler"));
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

#[test]
fn a_full_spool_disk_loses_no_request_and_bills_each_once() {
    let disk = SmallDisk::mount("1m");
    let spool = disk.path().join("spool");
    let s = gateway_spooling_to(spool.to_str().expect("utf-8 path"), "");
    let acme = s.sidecar().create_key("acme", "big", &[]);
    let flush_errors = || s.envoy().counter("wasmcustom.tollgate.usage.flush_errors");
    let total = |pg: &Postgres| rollup(pg).values().map(|v| v[0]).sum::<i64>();

    // before: 10 requests billed
    for _ in 0..10 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
    }
    poll_until("the first 10 in the rollup", Duration::from_secs(60), || total(s.pg()) == 10);

    // during: the disk is full; requests are served, their events are refused by the spool (503)
    // and kept by the filter. The filler is topped up while shipped segments free space.
    let errors_before = flush_errors();
    assert!(disk.fill() > 0, "the disk had room to fill");
    for _ in 0..20 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
        disk.fill();
    }
    poll_until("the spool to refuse a batch on the full disk", Duration::from_secs(30), || {
        disk.fill();
        flush_errors() > errors_before
    });

    // after: space comes back; 10 more requests; every request billed exactly once
    disk.free();
    for _ in 0..10 {
        assert_eq!(call(s.envoy(), &acme, &[]), 200);
    }
    poll_until("all 40 requests in the rollup", Duration::from_secs(90), || total(s.pg()) >= 40);
    // a short grace for a duplicate to show (resent batches are idempotent by event id)
    let settled = || psql_i64(s.pg(), "SELECT count(*) FROM usage_events");
    poll_until("the events table to hold 40", Duration::from_secs(30), || settled() >= 40);
    assert_eq!(total(s.pg()), 40, "exactly one count per request");
    assert_eq!(settled(), 40, "exactly one event per request");
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.usage.dropped"), 0, "the filter dropped nothing");
    assert!(s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"spooled\"}") >= 40);
}

// ---- per-second aggregation (usage.aggregate_above_rps) ----------------------------------------

/// What one traffic run sent: per key id, (requests, ok, 4xx, tokens).
type Sent = HashMap<String, [i64; 4]>;

/// `hot` keys from 3 threads as fast as they go, while `cold` sends `cold_n` requests ≥ 300 ms
/// apart (≤ 4 a second, under the threshold of 10); the hot traffic lasts as long as the cold.
fn mixed_traffic(envoy: &Envoy, hot: &[&IssuedKey], cold: &IssuedKey, cold_n: usize) -> Sent {
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut sent: Sent = HashMap::new();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..3)
            .map(|t| {
                let done = &done;
                s.spawn(move || {
                    let mut mine: Sent = HashMap::new();
                    let mut i = 0u64;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        let key = hot[(i as usize + t) % hot.len()];
                        let (want, extra): (u16, Vec<(&str, &str)>) = match i % 10 {
                            0 => (404, vec![("x-echo-status", "404")]),
                            1 | 2 => (200, vec![("x-echo-usage", "7")]),
                            _ => (200, vec![]),
                        };
                        assert_eq!(call(envoy, key, &extra), want);
                        let r = mine.entry(key.id.clone()).or_default();
                        r[0] += 1;
                        r[if want == 200 { 1 } else { 2 }] += 1;
                        r[3] += if extra.iter().any(|(h, _)| *h == "x-echo-usage") { 7 } else { 0 };
                        i += 1;
                    }
                    mine
                })
            })
            .collect();
        for i in 0..cold_n {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(300)); // pacing the traffic, not waiting for readiness
            }
            assert_eq!(call(envoy, cold, &[]), 200);
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        for w in workers {
            for (k, v) in w.join().unwrap() {
                let r = sent.entry(k).or_default();
                for i in 0..4 {
                    r[i] += v[i];
                }
            }
        }
    });
    let r = sent.entry(cold.id.clone()).or_default();
    r[0] += cold_n as i64;
    r[1] += cold_n as i64;
    sent
}

fn add(total: &mut Sent, more: &Sent) {
    for (k, v) in more {
        let r = total.entry(k.clone()).or_default();
        for i in 0..4 {
            r[i] += v[i];
        }
    }
}

/// The rollup per key: (requests, ok, 4xx, tokens).
fn rollup_by_key(pg: &Postgres) -> Sent {
    psql(
        pg,
        "SELECT key_id, sum(requests_ok+requests_4xx+requests_5xx+requests_denied+requests_aborted), sum(requests_ok), \
         sum(requests_4xx), sum(tokens) FROM usage_daily GROUP BY key_id",
    )
    .unwrap_or_default()
    .iter()
    .map(|row| {
        let v: Vec<&str> = row.split('|').collect();
        let n: Vec<i64> = v[1..].iter().map(|x| x.parse().unwrap_or(-1)).collect();
        (v[0].to_string(), [n[0], n[1], n[2], n[3]])
    })
    .collect()
}

fn segments(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "seg" || x == "open"))
        .collect()
}

#[test]
fn a_high_rate_tenant_is_aggregated_per_second_and_every_request_still_counts_once() {
    let mut s = gateway("aggregate_above_rps = 10\n");
    let (hot1, hot2) = (s.sidecar().create_key("hot", "big", &[]), s.sidecar().create_key("hot", "big", &[]));
    let cold = s.sidecar().create_key("cold", "big", &[]);

    // 1. hot (2 keys) well above 10 requests/s, cold at ≤ 4/s
    let mut want = mixed_traffic(s.envoy(), &[&hot1, &hot2], &cold, 8);
    let hot_n = want[&hot1.id][0] + want[&hot2.id][0];
    assert!(hot_n > 60, "the hot tenant must be above the threshold: {hot_n} requests in ~2 s");
    poll_until("the rollup to match the traffic, key by key", Duration::from_secs(60), || rollup_by_key(s.pg()) == want);

    // on the topic: cold as single events; hot mostly in aggregates that add up exactly
    let singles = psql_i64(s.pg(), "SELECT count(*) FROM usage_events");
    let aggregates = psql_i64(s.pg(), "SELECT count(*) FROM usage_aggregates");
    let total = (singles + aggregates) as usize;
    let got = read_topic(&s.broker().brokers(), "usage_events", total, Duration::from_secs(30));
    assert_eq!(got.len(), total);
    let (mut hot_single, mut hot_aggregated, mut hot_aggregates, mut cold_single) = (0i64, 0i64, 0i64, 0i64);
    let mut ids = HashSet::new();
    for (key, value) in &got {
        let v: serde_json::Value = serde_json::from_str(value).unwrap();
        assert_eq!(v["tenant"].as_str(), Some(key.as_str()), "keyed by tenant");
        assert!(ids.insert(v["id"].as_str().unwrap().to_string()), "no message twice in this run");
        match (key.as_str(), v.get("count")) {
            ("cold", None) => cold_single += 1,
            ("cold", Some(_)) => panic!("the cold tenant is below the threshold: {value}"),
            ("hot", None) => hot_single += 1,
            ("hot", Some(n)) => {
                hot_aggregates += 1;
                hot_aggregated += n.as_i64().unwrap();
                assert!(v["id"].as_str().unwrap().starts_with("agg_"));
                let rows: i64 = v["keys"].as_array().unwrap().iter().map(|k| k["count"].as_i64().unwrap()).sum();
                assert_eq!(rows, n.as_i64().unwrap(), "{value}");
            }
            other => panic!("unexpected message {other:?}"),
        }
    }
    eprintln!("aggregation: hot {hot_n} requests → {hot_aggregates} aggregates carrying {hot_aggregated} + {hot_single} single events; cold {cold_single} single events");
    assert_eq!(cold_single, 8, "one event per request below the threshold");
    assert_eq!(hot_single + hot_aggregated, hot_n, "the aggregates' counts and the single events add up to the requests");
    assert!(hot_aggregated * 2 >= hot_n, "most of the hot tenant is aggregated: {hot_aggregated} of {hot_n}");
    assert!(hot_aggregates + hot_single < hot_n, "fewer messages than requests: {hot_aggregates} aggregates + {hot_single} single");
    let parts = partitions_by_key(&s.broker().brokers(), "usage_events", total, Duration::from_secs(30));
    assert!(parts["hot"].len() == 1 && parts["cold"].len() == 1, "{parts:?}");
    assert_eq!(s.sidecar().metric("tollgate_sidecar_usage_aggregates_total"), hot_aggregates as u64);
    assert_eq!(s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"aggregated\"}"), hot_aggregated as u64);
    // the Redis meter counts at the gateway, before aggregation: the same requests
    let day = tollgate_wire::usage::Day::of_ms(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64,
    );
    let mut c = s.redis().connection().unwrap();
    let m: HashMap<String, i64> = redis::cmd("HGETALL").arg(format!("usage:{{hot}}:{}", day.compact())).query(&mut c).unwrap();
    assert_eq!(m.get("ok").copied().unwrap_or(0) + m.get("4xx").copied().unwrap_or(0), hot_n, "{m:?}");

    // 2. the broker goes away during traffic, then the sidecar crashes with a full spool
    poll_until("the first traffic's segments deleted", Duration::from_secs(30), || segments(s.spool_dir()).is_empty());
    let spooled_before = s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"spooled\"}");
    s.broker_mut().kill();
    let during = mixed_traffic(s.envoy(), &[&hot1, &hot2], &cold, 5);
    let during_n: i64 = during.values().map(|v| v[0]).sum();
    add(&mut want, &during);
    poll_until("the outage's events to be spooled", Duration::from_secs(30), || {
        s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"spooled\"}") == spooled_before + during_n as u64
    });
    s.sidecar_mut().kill();
    // keep a copy of the spool: shipped later, it is what a crash between Kafka's ack and the
    // segment's delete would make the sidecar send again
    let backup = tempfile::tempdir().unwrap();
    let spooled = segments(s.spool_dir());
    assert!(!spooled.is_empty());
    for p in &spooled {
        std::fs::copy(p, backup.path().join(p.with_extension("seg").file_name().unwrap())).unwrap();
    }
    s.broker_mut().restart();
    s.sidecar_mut().restart();
    s.billing_mut().restart();
    poll_until("the spooled events delivered and counted once", Duration::from_secs(90), || rollup_by_key(s.pg()) == want);
    poll_until("the spool to drain", Duration::from_secs(30), || segments(s.spool_dir()).is_empty());
    let (singles, aggregates) =
        (psql_i64(s.pg(), "SELECT count(*) FROM usage_events"), psql_i64(s.pg(), "SELECT count(*) FROM usage_aggregates"));

    // 3. the same segments shipped again (a replay): nothing counts twice
    s.sidecar_mut().kill();
    for p in segments(backup.path()) {
        std::fs::copy(&p, s.spool_dir().join(p.file_name().unwrap())).unwrap();
    }
    s.sidecar_mut().restart();
    // markers after the replay: each tenant's marker shares its partition with the replayed
    // messages and comes after them, so once the markers are counted the replay was read
    assert_eq!(call(s.envoy(), &hot1, &[]), 200);
    assert_eq!(call(s.envoy(), &cold, &[]), 200);
    for k in [&hot1.id, &cold.id] {
        let r = want.get_mut(k).unwrap();
        r[0] += 1;
        r[1] += 1;
    }
    poll_until("the markers to be counted", Duration::from_secs(90), || rollup_by_key(s.pg()) == want);
    // The sidecar counts an event delivered when the broker's ack reaches it, which can come
    // after the billing consumer has already read the message: wait for the count, then it
    // must be exactly the restored events and the markers.
    let delivered = || s.sidecar().metric("tollgate_sidecar_usage_events_total{outcome=\"delivered\"}");
    poll_until("the restored segments' and the markers' acks", Duration::from_secs(60), || delivered() >= during_n as u64 + 2);
    assert_eq!(delivered(), during_n as u64 + 2, "the restored segments were shipped again, then the markers");
    assert_eq!(psql_i64(s.pg(), "SELECT count(*) FROM usage_events"), singles + 2, "replayed single events counted once");
    assert_eq!(psql_i64(s.pg(), "SELECT count(*) FROM usage_aggregates"), aggregates, "replayed aggregates counted once");
    assert_eq!(s.envoy().counter("wasmcustom.tollgate.usage.dropped"), 0);
}
