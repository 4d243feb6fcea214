//! The sidecar's usage pipeline under load (issue 6), on the sidecar binary, tansu and Redis:
//!
//! - `usage-intake [--aggregate-above-rps N] [--batches B]`: B (200) batches of 1000 events (as
//!   the filter sends them) from 4 connections, then waits until Kafka acknowledged every event;
//!   prints events/s accepted (spooled, fsync'd) and delivered. With `N` > 0 (e.g. 100) the 4
//!   tenants are far above it, and their events (250 per tenant and second of `startMs`) go as
//!   per-second aggregates.
//! - `usage-shipping [--events E]`: fills a spool with E (400 000) events (4 tenants, 250 per
//!   tenant and second of `startMs`) as the sidecar writes them — unmarked, then all marked for
//!   aggregation — starts a sidecar on it and times the spool's drain to Kafka (acks=all): the
//!   shipper's events/s without and with aggregation, the HTTP intake left out. Alternated, twice
//!   each.

use std::time::{Duration, Instant};
use tollgate_tests::fixtures::usage_event;
use tollgate_tests::{poll_until, post, Gateway};
use tollgate_wire::usage::{UsageBatch, UsageEvent, USAGE_PATH};

const TENANTS: [&str; 4] = ["acme", "beta", "gamma", "delta"];

/// Sample event `seq` (of the four tenants in turn: 250 per tenant and second of `startMs`).
fn event(seq: u64) -> UsageEvent {
    usage_event(TENANTS[(seq % 4) as usize], seq)
}

/// A sidecar (no Envoy) spooling to `spool` (default: the gateway's spool directory) and
/// shipping to the gateway's broker; `usage` are more `[usage]` settings.
fn gateway(topic: &str, spool: Option<&std::path::Path>, usage: &str) -> Gateway {
    let spool = spool.map_or("${SPOOL_DIR}".to_string(), |p| p.display().to_string());
    Gateway::builder()
        .broker()
        .without_envoy()
        .sidecar_toml(&format!(
            "[usage]\nenabled = true\nspool_dir = \"{spool}\"\nsegment_age = \"50ms\"\n{usage}\
             [usage.kafka]\nbrokers = \"${{BROKERS}}\"\ntopic = \"{topic}\"\npartitions = 4\ndelivery_timeout = \"3s\"\n"
        ))
        .sidecar_env("TOLLGATE_SIDECAR_LOG__LEVEL", "warn")
        .build()
}

/// Polls the sidecar's metrics until `total` events were delivered; returns its aggregates count.
fn await_delivered(g: &Gateway, total: u64) -> u64 {
    let sample = "tollgate_sidecar_usage_events_total{outcome=\"delivered\"}";
    poll_until("every event delivered", Duration::from_secs(600), || g.sidecar().metric(sample) >= total);
    g.sidecar().metric("tollgate_sidecar_usage_aggregates_total")
}

/// `batches` of 1000 events (200: 200 000 events) from 4 connections.
pub fn intake(aggregate_above_rps: u64, batches: u64) {
    let g = gateway("usage_t", None, &format!("aggregate_above_rps = {aggregate_above_rps}\n"));
    const PER: u64 = 1000;
    let batches = batches.div_ceil(4) * 4;
    let bodies: Vec<Vec<String>> = (0..4u64)
        .map(|t| {
            (0..batches / 4)
                .map(|b| {
                    let events: Vec<UsageEvent> = (0..PER).map(|i| event((t * batches + b) * PER + i)).collect();
                    serde_json::to_string(&UsageBatch { events }).expect("json")
                })
                .collect()
        })
        .collect();
    let start = Instant::now();
    std::thread::scope(|s| {
        for chunk in &bodies {
            let url = g.sidecar().url(USAGE_PATH);
            let secret = g.sidecar().secret().to_string();
            s.spawn(move || {
                for body in chunk {
                    let r = post(&url, &[("content-type", "application/json"), (tollgate_wire::SECRET_HEADER, &secret)], body);
                    assert_eq!(r.status, 200, "{}", r.body);
                }
            });
        }
    });
    let accepted = start.elapsed();
    let total = batches * PER;
    let aggregates = await_delivered(&g, total);
    let delivered = start.elapsed();
    println!(
        "usage intake (aggregate_above_rps = {aggregate_above_rps}): {total} events in batches of {PER}: accepted (spooled, fsync'd) {:.0} events/s; delivered to Kafka {:.0} events/s in {aggregates} aggregates + single events",
        total as f64 / accepted.as_secs_f64(),
        total as f64 / delivered.as_secs_f64()
    );
}

/// A spool of `total` events (400 000: 25 segments), without and with aggregation, twice.
pub fn shipping(total: u64) {
    for aggregate in [false, true, false, true] {
        // the spool is written before the sidecar starts
        let spool = tempfile::tempdir().expect("tempdir");
        let mut segments = 0;
        let mut seq = 0u64;
        while seq < total {
            let mut data = Vec::with_capacity(4 << 20);
            while seq < total && data.len() < (4 << 20) - 1024 {
                tollgate_shared::aggregate::encode_line(&mut data, &event(seq), aggregate);
                seq += 1;
            }
            segments += 1;
            std::fs::write(spool.path().join(format!("{segments:020}.seg")), data).expect("write a segment");
        }
        let g = gateway("usage_s", Some(spool.path()), "");
        let start = Instant::now();
        let aggregates = await_delivered(&g, total);
        let took = start.elapsed();
        let messages = if aggregate { aggregates.to_string() } else { total.to_string() };
        println!(
            "usage shipping (aggregated: {aggregate}): {total} events from {segments} segments in {messages} messages: {:.0} events/s delivered (acks=all)",
            total as f64 / took.as_secs_f64()
        );
    }
}
