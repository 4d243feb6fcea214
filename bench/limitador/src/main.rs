//! A bench reference, never shipped (`envoy+limitador-*` in docs/benchmarks.md): Envoy's rate
//! limit service (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, gRPC) on
//! Kuadrant's Limitador library, which Envoy's C++ `envoy.filters.http.ratelimit` filter calls on
//! every request. Issue 16 compares Tollgate's exact limit with it.
//!
//! Limitador's server (`limitador-server`) is not published on crates.io; its library is. This
//! is the thin part of that server the comparison exercises, the way it does it: the request's
//! `domain` is the namespace, its descriptors are bound as the CEL list `descriptors`, and each
//! request is one `check_rate_limited_and_update` of `hits_addend` (1 when absent) against the
//! namespace's limits, on Limitador's Redis storage (`--storage redis`: a Redis round trip per
//! request) or its cached Redis storage (`--storage redis_cached`: counted in memory, flushed to
//! Redis in the background).
//!
//! Usage: `tollgate-bench-limitador --listen 127.0.0.1:PORT --redis redis://… --storage
//! redis|redis_cached --namespace NS --limit N --seconds S --variable EXPR`: one limit of `N` per
//! `S` seconds in namespace `NS`, counted per value of the CEL expression `EXPR` (e.g.
//! `descriptors[0].key`). It prints `ready` once it listens.

use limitador::limit::{Context, Expression, Limit, Namespace};
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorageBuilder};
use limitador::storage::{AsyncCounterStorage, AsyncStorage};
use limitador::{AsyncRateLimiter, AsyncRateLimiterBuilder};
use std::collections::HashMap;
use std::sync::Arc;
use tonic::{Request, Response, Status};

mod rls {
    tonic::include_proto!("envoy.service.ratelimit.v3");
}

use rls::rate_limit_response::Code;
use rls::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use rls::{RateLimitRequest, RateLimitResponse};

struct Service {
    limiter: Arc<AsyncRateLimiter>,
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(&self, request: Request<RateLimitRequest>) -> Result<Response<RateLimitResponse>, Status> {
        let request = request.into_inner();
        if request.domain.is_empty() {
            return Err(Status::invalid_argument("the domain is empty"));
        }
        let namespace = Namespace::from(request.domain);
        let mut ctx = Context::default();
        let descriptors = request
            .descriptors
            .into_iter()
            .map(|d| d.entries.into_iter().map(|e| (e.key, e.value)).collect::<HashMap<_, _>>())
            .collect();
        ctx.list_binding("descriptors".to_string(), descriptors);
        let hits = u64::from(request.hits_addend.max(1));
        let result = self
            .limiter
            .check_rate_limited_and_update(&namespace, &ctx, hits)
            .await
            .map_err(|e| Status::unavailable(format!("limitador: {e}")))?;
        let code = if result.limited { Code::OverLimit } else { Code::Ok };
        Ok(Response::new(RateLimitResponse { overall_code: code.into() }))
    }
}

/// The value following `name` on the command line.
fn arg(name: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)) {
        Some(v) => v.clone(),
        None => {
            eprintln!("tollgate-bench-limitador: {name} is missing");
            std::process::exit(2)
        }
    }
}

fn number(name: &str) -> u64 {
    arg(name).parse().unwrap_or_else(|e| {
        eprintln!("tollgate-bench-limitador: {name}: {e}");
        std::process::exit(2)
    })
}

#[tokio::main]
async fn main() {
    let listen: std::net::SocketAddr = arg("--listen").parse().expect("--listen: not an address");
    let redis = arg("--redis");
    let counters: Box<dyn AsyncCounterStorage> = match arg("--storage").as_str() {
        "redis" => Box::new(AsyncRedisStorage::new(&redis).await.expect("Redis (redis storage)")),
        "redis_cached" => Box::new(CachedRedisStorageBuilder::new(&redis).build().await.expect("Redis (redis_cached storage)")),
        other => {
            eprintln!("tollgate-bench-limitador: --storage {other}: redis or redis_cached");
            std::process::exit(2)
        }
    };
    let variable = Expression::parse(arg("--variable")).expect("--variable: not a CEL expression");
    let limit = Limit::new(arg("--namespace").as_str(), number("--limit"), number("--seconds"), [], [variable]);
    let limiter = AsyncRateLimiterBuilder::new(AsyncStorage::with_counter_storage(counters)).build();
    limiter.add_limit(limit);
    // TCP_NODELAY on each accepted connection, like Envoy's side of the call: without it a
    // response's HEADERS, DATA and trailers frames wait on Nagle and delayed ACKs (milliseconds).
    let incoming = tonic::transport::server::TcpIncoming::new(listen, true, None).expect("--listen: cannot bind");
    println!("ready");
    let service = RateLimitServiceServer::new(Service { limiter: Arc::new(limiter) });
    tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await.expect("the gRPC server stopped");
}
