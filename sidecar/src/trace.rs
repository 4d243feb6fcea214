//! Traces (issue 17.6): one span per decision, in the request's own trace, exported over
//! OTLP/HTTP (JSON) when `[telemetry.traces] endpoint` is set — off by default.
//!
//! The filter forwards the request's W3C `traceparent` on its decision call (a malformed one is
//! not forwarded). A decision joins that trace when its `sampled` flag is set; a decision without
//! a sampled parent starts a trace of its own with probability `sample_ratio` (0 by default: the
//! caller decides). The span (`tollgate.decide`, kind SERVER) carries the tenant, the outcome and
//! the Redis time of the decision (`tollgate.redis_time_ns`, the time spent awaiting Redis: the
//! key lookup and the limits script).
//!
//! Export never slows a decision: spans go to a bounded queue (`max_queued`; full → dropped and
//! counted), one task posts them in batches every `export_interval` (or 512 spans), with a 2 s
//! deadline per post; a failed post is counted and its spans dropped (traces are best effort).

use std::cell::Cell;
use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::invalid::{invalid, Invalid};

/// Spans by outcome: `exported`, `failed` (the post failed), `dropped` (the queue was full).
pub const SPANS_TOTAL: &str = "tollgate_sidecar_spans_total";
/// Spans per post at most.
const MAX_BATCH: usize = 512;
const POST_TIMEOUT: Duration = Duration::from_secs(2);

/// `[telemetry.traces]` of the sidecar configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracesConfig {
    /// The OTLP/HTTP traces URL (e.g. `http://127.0.0.1:4318/v1/traces`); none = no traces.
    pub endpoint: Option<String>,
    /// `service.name` of the exported resource.
    pub service_name: String,
    /// The share of decisions without a sampled `traceparent` that start a trace of their own.
    pub sample_ratio: f64,
    /// How often queued spans are posted.
    #[serde(with = "humantime_serde")]
    pub export_interval: Duration,
    /// Spans waiting for export at most; more are dropped (and counted).
    pub max_queued: usize,
}

impl Default for TracesConfig {
    fn default() -> Self {
        TracesConfig {
            endpoint: None,
            service_name: "tollgate-sidecar".into(),
            sample_ratio: 0.0,
            export_interval: Duration::from_secs(1),
            max_queued: 8192,
        }
    }
}

impl TracesConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if let Some(e) = &self.endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(invalid("telemetry.traces.endpoint", "an http:// or https:// URL (the OTLP/HTTP traces path)"));
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid("telemetry.traces.sample_ratio", "a fraction in [0, 1]"));
        }
        if self.export_interval.is_zero() {
            return Err(invalid("telemetry.traces.export_interval", "must be positive"));
        }
        if self.max_queued == 0 || self.max_queued > 1_000_000 {
            return Err(invalid("telemetry.traces.max_queued", "1 to 1000000"));
        }
        Ok(())
    }
}

/// A parsed W3C `traceparent` (version 00 layout: `00-<32 hex>-<16 hex>-<2 hex>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub sampled: bool,
}

impl TraceParent {
    /// Parses a `traceparent` value; `None` for anything the W3C rules refuse (upper-case hex,
    /// version `ff`, all-zero ids, a version-00 value of another length).
    pub fn parse(v: &[u8]) -> Option<TraceParent> {
        if v.len() < 55 || (v.len() > 55 && v[55] != b'-') || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return None;
        }
        let version = hex::<1>(&v[0..2])?[0];
        if version == 0xff || (version == 0 && v.len() != 55) {
            return None;
        }
        let trace_id = hex::<16>(&v[3..35])?;
        let parent_id = hex::<8>(&v[36..52])?;
        let flags = hex::<1>(&v[53..55])?[0];
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceParent { trace_id, parent_id, sampled: flags & 1 == 1 })
    }
}

/// Lower-case hex of exactly `2 * N` digits.
fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in s.chunks(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One decision's span.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_id: Option<[u8; 8]>,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub tenant: Option<String>,
    pub outcome: &'static str,
    pub redis: Duration,
}

/// Where a decision's span goes: the trace it joins (and its parent) when traced.
#[derive(Debug, Clone, Copy)]
pub struct Traced {
    trace_id: [u8; 16],
    parent_id: Option<[u8; 8]>,
    start_unix_ns: u64,
}

/// The span recorder the request path holds; inert without an endpoint.
#[derive(Clone, Default)]
pub struct Tracer {
    tx: Option<mpsc::Sender<Span>>,
    sample_ratio: f64,
}

impl Tracer {
    /// Starts the exporter task when an endpoint is configured (inside a tokio runtime).
    pub fn start(cfg: &TracesConfig) -> Tracer {
        let Some(endpoint) = cfg.endpoint.clone() else { return Tracer::default() };
        let (tx, rx) = mpsc::channel(cfg.max_queued);
        tokio::spawn(export(rx, endpoint, cfg.service_name.clone(), cfg.export_interval));
        Tracer { tx: Some(tx), sample_ratio: cfg.sample_ratio }
    }

    /// Whether the decision with this `traceparent` header is traced, and in which trace.
    pub fn begin(&self, traceparent: Option<&[u8]>) -> Option<Traced> {
        self.tx.as_ref()?;
        let parent = traceparent.and_then(TraceParent::parse);
        let (trace_id, parent_id) = match parent {
            Some(p) if p.sampled => (p.trace_id, Some(p.parent_id)),
            _ if self.sample_ratio > 0.0 && rand::random::<f64>() < self.sample_ratio => (rand::random(), None),
            _ => return None,
        };
        Some(Traced { trace_id, parent_id, start_unix_ns: unix_ns() })
    }

    /// Queues the span of a traced decision; never waits.
    pub fn finish(&self, t: Traced, tenant: Option<String>, outcome: &'static str, redis: Duration) {
        let Some(tx) = &self.tx else { return };
        let span = Span {
            trace_id: t.trace_id,
            span_id: loop {
                let id: [u8; 8] = rand::random();
                if id != [0; 8] {
                    break id;
                }
            },
            parent_id: t.parent_id,
            start_unix_ns: t.start_unix_ns,
            end_unix_ns: unix_ns().max(t.start_unix_ns),
            tenant,
            outcome,
            redis,
        };
        if tx.try_send(span).is_err() {
            metrics::counter!(SPANS_TOTAL, "outcome" => "dropped").increment(1);
        }
    }
}

fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

tokio::task_local! {
    static REDIS_TIME: Cell<Duration>;
}

/// Awaits a Redis call, adding its time to the decision's Redis clock when one is running
/// ([`with_redis_clock`]); costs one `Instant` pair otherwise.
pub async fn redis_call<F: Future>(f: F) -> F::Output {
    let started = Instant::now();
    let out = f.await;
    let _ = REDIS_TIME.try_with(|c| c.set(c.get() + started.elapsed()));
    out
}

/// Runs `f` with a Redis clock: its output and the time its [`redis_call`]s waited.
pub async fn with_redis_clock<F: Future>(f: F) -> (F::Output, Duration) {
    REDIS_TIME
        .scope(Cell::new(Duration::ZERO), async {
            let out = f.await;
            (out, REDIS_TIME.with(Cell::get))
        })
        .await
}

/// The OTLP/HTTP JSON body of `spans` (trace and span ids in hex, times as decimal strings).
pub fn otlp_json(service_name: &str, spans: &[Span]) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut attributes = vec![
                json!({"key": "tollgate.outcome", "value": {"stringValue": s.outcome}}),
                json!({"key": "tollgate.redis_time_ns", "value": {"intValue": s.redis.as_nanos().to_string()}}),
            ];
            if let Some(t) = &s.tenant {
                attributes.push(json!({"key": "tollgate.tenant", "value": {"stringValue": t}}));
            }
            let mut span = json!({
                "traceId": to_hex(&s.trace_id),
                "spanId": to_hex(&s.span_id),
                "name": "tollgate.decide",
                "kind": 2,
                "startTimeUnixNano": s.start_unix_ns.to_string(),
                "endTimeUnixNano": s.end_unix_ns.to_string(),
                "attributes": attributes,
                "status": {"code": if s.outcome == "unavailable" { 2 } else { 1 }},
            });
            if let Some(p) = s.parent_id {
                span["parentSpanId"] = json!(to_hex(&p));
            }
            span
        })
        .collect();
    json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service_name}}]},
        "scopeSpans": [{"scope": {"name": "tollgate-sidecar", "version": env!("CARGO_PKG_VERSION")}, "spans": spans}],
    }]})
}

async fn export(mut rx: mpsc::Receiver<Span>, endpoint: String, service_name: String, every: Duration) {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(POST_TIMEOUT)).build().into();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batch = Vec::new();
    loop {
        let (closed, ticked) = tokio::select! {
            span = rx.recv() => match span {
                Some(s) => {
                    batch.push(s);
                    (false, false)
                }
                None => (true, false),
            },
            _ = tick.tick() => (false, true),
        };
        let due = closed || ticked || batch.len() >= MAX_BATCH;
        if due && !batch.is_empty() {
            let spans = std::mem::take(&mut batch);
            let body = otlp_json(&service_name, &spans).to_string();
            let (agent, url, n) = (agent.clone(), endpoint.clone(), spans.len() as u64);
            let posted = tokio::task::spawn_blocking(move || {
                agent.post(&url).header("content-type", "application/json").send(body).map(|r| r.status().as_u16())
            })
            .await;
            let outcome = match posted {
                Ok(Ok(s)) if (200..300).contains(&s) => "exported",
                Ok(Ok(s)) => {
                    tracing::warn!(status = s, "the trace endpoint refused a batch of spans");
                    "failed"
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "could not post spans to the trace endpoint");
                    "failed"
                }
                Err(_) => "failed",
            };
            metrics::counter!(SPANS_TOTAL, "outcome" => outcome).increment(n);
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparent_parses_by_the_w3c_rules() {
        let p = TraceParent::parse(TP.as_bytes()).unwrap();
        assert_eq!(to_hex(&p.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(to_hex(&p.parent_id), "00f067aa0ba902b7");
        assert!(p.sampled);
        assert!(!TraceParent::parse(TP.replace("-01", "-00").as_bytes()).unwrap().sampled);
        // a later version may append fields
        assert!(TraceParent::parse(format!("01{}-extra", &TP[2..]).as_bytes()).is_some());
        for bad in [
            TP.to_uppercase(),
            format!("ff{}", &TP[2..]),
            format!("{TP}-extra"),
            TP.replace("4bf92f3577b34da6a3ce929d0e0e4736", "00000000000000000000000000000000"),
            TP.replace("00f067aa0ba902b7", "0000000000000000"),
            TP[..54].to_string(),
            TP.replace('-', "_"),
            TP.replace("4b", "4\u{e9}"),
        ] {
            assert_eq!(TraceParent::parse(bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(TraceParent::parse(b"\xff\xfe"), None);
    }

    #[test]
    fn an_inert_tracer_traces_nothing() {
        let t = Tracer::default();
        assert!(t.begin(Some(TP.as_bytes())).is_none());
    }

    #[test]
    fn otlp_json_has_hex_ids_and_the_parent() {
        let s = Span {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_id: Some([3; 8]),
            start_unix_ns: 10,
            end_unix_ns: 20,
            tenant: Some("acme".into()),
            outcome: "allow",
            redis: Duration::from_micros(7),
        };
        let v = otlp_json("svc", &[s]);
        let span = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], "01010101010101010101010101010101");
        assert_eq!(span["spanId"], "0202020202020202");
        assert_eq!(span["parentSpanId"], "0303030303030303");
        assert_eq!(span["startTimeUnixNano"], "10");
        let attrs = span["attributes"].as_array().unwrap();
        assert!(attrs.contains(&json!({"key": "tollgate.redis_time_ns", "value": {"intValue": "7000"}})));
        assert!(attrs.contains(&json!({"key": "tollgate.tenant", "value": {"stringValue": "acme"}})));
        assert_eq!(v["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"], "svc");
    }

    #[tokio::test]
    async fn the_redis_clock_sums_redis_calls_inside_it_only() {
        let (out, t) = with_redis_clock(async {
            redis_call(tokio::time::sleep(Duration::from_millis(5))).await;
            redis_call(async { 3 }).await
        })
        .await;
        assert_eq!(out, 3);
        assert!(t >= Duration::from_millis(5), "{t:?}");
        // outside a clock: no panic, nothing to add to
        redis_call(async {}).await;
    }
}
