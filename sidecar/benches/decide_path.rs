//! Criterion micro-benchmarks of the pure parts of the sidecar's decision path
//! (`./build.sh bench micro`): everything `Decider::decide` computes around its Redis calls.
//! The round trips themselves (HGETALL on a cache miss, one EVALSHA of `decide.lua` per
//! decision with limits) are measured end to end by `./build.sh bench`.
//!
//! - `wire/*`: the filter's `DecideRequest` JSON in, the `DecideResponse` JSON out.
//! - `apikey/*`: an HGETALL answer read into a key record, and the verdict at a given time.
//! - `limits/*`: one `decide.lua` call (the limits' checks, encoded into keys + args) for a plan
//!   with five limits of five algorithms, and its reply read back into the verdict, RateLimit
//!   headers and the ticket.

use criterion::{criterion_group, criterion_main, Criterion};
use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use tollgate_sidecar::apikey::{self, KeyRecord};
use tollgate_sidecar::keys::Id;
use tollgate_sidecar::decision::checks::{self, RequestCtx};
use tollgate_sidecar::decision::limits::{PlanConfig, Plans};
use tollgate_sidecar::scripts::decide::{self, DecideCall};
use tollgate_wire::{DecideRequest, DecideResponse, Header};

/// A plan with several limits (TOML as operators write it, so new optional fields need no change).
const PLAN: &str = r#"
[[pro.limits]]
name = "per-minute"
algorithm = "fixed_window"
limit = 600
window = "60s"

[[pro.limits]]
name = "per-tenant"
algorithm = "sliding_window"
subject = "tenant"
limit = 10000
window = "60s"

[[pro.limits]]
name = "per-ip"
algorithm = "token_bucket"
subject = "client_ip"
limit = 50
window = "10s"

[[pro.limits]]
name = "in-flight"
algorithm = "concurrency"
limit = 8

[[pro.limits]]
name = "tokens"
algorithm = "token_budget"
subject = "tenant"
limit = 5000000
estimate = 1000
"#;

const REQUEST: &str = r#"{"keyHash":"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","method":"POST","authority":"api.example.com","path":"/v1/chat/completions","requestId":"6b1f0c2a9d3e4f5a8b7c6d5e","clientIp":"10.1.2.3","tokenEstimate":256}"#;

fn fields() -> HashMap<String, String> {
    [
        ("key_id", "key_7f3a9c2b1d4e5f60"),
        ("tenant", "acme"),
        ("plan", "pro"),
        ("status", "active"),
        ("created_at", "1764460800"),
        ("expires_at", "1795996800"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn wire(c: &mut Criterion) {
    let mut g = c.benchmark_group("wire");
    g.bench_function("decode_request", |b| b.iter(|| serde_json::from_str::<DecideRequest>(black_box(REQUEST)).expect("request")));
    // An allow answer with the RateLimit headers of one limit (built by the sidecar's own code, so
    // fields added to the wire type later need no change here).
    let record = KeyRecord::from_fields(&fields()).expect("record").expect("present");
    let mut allow = apikey::verdict(Some(&record), 1_764_460_900);
    if let DecideResponse::Allow { response_headers, .. } = &mut allow {
        response_headers.push(Header::new("ratelimit-policy", "\"per-minute\";q=600;w=60"));
        response_headers.push(Header::new("ratelimit", "\"per-minute\";r=599;t=42"));
    }
    g.bench_function("encode_allow", |b| b.iter(|| serde_json::to_vec(black_box(&allow)).expect("response")));
    g.finish();
}

fn key_record(c: &mut Criterion) {
    let fields = fields();
    let record = KeyRecord::from_fields(&fields).expect("record").expect("present");
    let mut g = c.benchmark_group("apikey");
    g.bench_function("record_from_hgetall", |b| b.iter(|| KeyRecord::from_fields(black_box(&fields))));
    g.bench_function("verdict_allow", |b| b.iter(|| apikey::verdict(Some(black_box(&record)), black_box(1_764_460_900))));
    g.bench_function("verdict_unknown", |b| b.iter(|| apikey::verdict(None, black_box(1_764_460_900))));
    g.bench_function("hash_raw_key", |b| b.iter(|| apikey::hash_raw_key(black_box("tg_8Jq2vXbN4kLmP0sR7tYw1zC3dF5gH6jK9aQeUiOp"))));
    g.finish();
}

fn limit_path(c: &mut Criterion) {
    let raw: BTreeMap<String, PlanConfig> = toml::from_str(PLAN).expect("plan TOML");
    let plans = Plans::compile(&raw).expect("plan compiles");
    let limits = plans.limits("pro");
    assert_eq!(limits.len(), 5);
    let (tenant, key_id, request_id) = (Id::parse("acme").expect("id"), Id::parse("key_7f3a9c2b1d4e5f60").expect("id"), Id::parse("6b1f0c2a9d3e4f5a8b7c6d5e").expect("id"));
    let headers: Vec<Header> = vec![];
    let ctx = RequestCtx {
        tenant: &tenant,
        key_id: &key_id,
        product: None,
        client_ip: "10.1.2.3".parse().ok(),
        headers: &headers,
        request_id: &request_id,
        now_ms: 1_764_460_812_345,
        token_estimate: Some(256),
        llm: None,
        pricing: None,
    };
    let call = |ctx: &RequestCtx<'_>| {
        let planned = checks::checks(limits, ctx);
        let call = DecideCall { now_ms: ctx.now_ms, request_id: ctx.request_id.clone(), limits: planned.checks, lease: None, lookup: None, record: None };
        (call.encode(), planned.meta)
    };
    let (_, meta) = call(&ctx);
    let n = meta.len();
    // An allowing reply: {1, 0, (remaining, reset_ms, would_deny) per limit, granted}.
    let mut reply = vec![redis::Value::Int(1), redis::Value::Int(0)];
    for (i, l) in limits.iter().enumerate() {
        reply.extend([l.limit as i64 - 1 - i as i64, 40_000 + i as i64, 0].map(redis::Value::Int));
    }
    reply.push(redis::Value::Int(0));
    let mut g = c.benchmark_group("limits");
    g.bench_function("invocation_5_limits", |b| b.iter(|| call(black_box(&ctx))));
    g.bench_function("read_reply_5_limits", |b| b.iter(|| decide::parse(black_box(&reply), n).expect("reply")));
    // What an allowed decision builds after the reply: the nearest limit's headers and the ticket.
    g.bench_function("allow_headers_and_ticket", |b| {
        b.iter(|| {
            let v = decide::parse(black_box(&reply), n).expect("reply");
            let headers = checks::nearest(&meta, &v.states).map(|i| checks::ratelimit_headers(&meta[i], &v.states[i]));
            (headers, checks::ticket(&meta, &tenant, &request_id))
        })
    });
    g.finish();
}

criterion_group!(benches, wire, key_record, limit_path);
criterion_main!(benches);
