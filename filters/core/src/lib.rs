//! The Tollgate filter's logic, apart from the host.
//!
//! Everything the filter decides lives here in plain Rust, and talks to Envoy only through the
//! [`host::Host`] port. The cdylib in `filters/tollgate` implements that trait over proxy-wasm
//! host calls and does nothing else, so this crate is tested natively (through
//! [`mock::MockHost`]) and on wasm32 under wasm-bindgen-test.
//!
//! Layers, each using only those above it (no import circle; `tests/layers.rs` checks it):
//!
//! - the port and leaves: [`host`], [`stats`], [`shared_keys`], [`headers`], [`settings`],
//!   [`hostmap`], [`ids`];
//! - calls and shared-data helpers: [`sidecar`], [`reply`], [`election`];
//! - domains, each with its configuration section beside it: [`key`], [`auth_cache`], [`batch`],
//!   [`changes`], [`routing`], [`lease`], [`breaker`], [`responses`], [`completions`], [`refunds`], [`usage`];
//! - background jobs: [`jobs`] (tick, owned call tokens, call responses) and the one batch
//!   flusher [`flush`] (completions, refunds, usage, responses);
//! - the whole configuration: [`config`];
//! - the request path: [`filter`] (stages, decisions, the response side), then the breaker
//!   stage: [`http::HttpFilter`];
//! - one worker's filter as its root context holds it: [`worker::Worker`].
//!
//! Invariant: nothing here panics outside tests (a panic aborts the Wasm VM and every request on
//! that worker); the crate denies `unwrap`, `expect` and `panic`.

pub mod auth_cache;
/// A worker's decision calls in batches under concurrency (decision 127).
pub mod batch;
/// Revocations and plan changes reaching cached answers and leases: the change poller, generations.
pub mod changes;
/// Circuit breakers: the state machine, its configuration, the per-request guard, the hint poller.
pub mod breaker;
/// Decision calls on a host's own connections joined into one batch (decision 225).
pub mod call_batch;
pub mod completions;
pub mod config;
/// A decision's outcome handed from the root context to its request's context.
pub mod delivery;
pub mod election;
pub mod filter;
pub mod flush;
pub mod headers;
pub mod host;
/// Decoding raw header maps from the host (bytes, never assumed UTF-8).
pub mod hostmap;
pub mod http;
/// Decision ids made by the gateway (never taken from the client).
pub mod ids;
pub mod jobs;
pub mod key;
/// Leased limits: spending, sizing and renewing leases of limit units (issue 8).
pub mod lease;
/// LLM facts: models and tokens apart (issue 42).
pub mod llm;
/// A recording host for tests (native and wasm32); compiled always, unused by the cdylib.
pub mod mock;
/// Abandoned decisions, queued for the sidecar to refund (issue 15.2).
pub mod refunds;
pub mod reply;
/// The response cache and Idempotency-Key replay: keys, digests, rules, the store queue.
pub mod responses;
/// Routing: the sidecar's routing table in shared data, matched locally per request.
pub mod routing;
pub mod settings;
pub mod shared_keys;
pub mod sidecar;
/// Calls to the sidecar as HTTP/1.1 by hand, for a host with its own connections (decision 219).
pub mod sidecar_http1;
pub mod stats;
/// Decisions on one long-lived gRPC stream per worker (decision 223).
pub mod stream;
/// Usage metering: event ids, the per-worker queue of usage events, token usage.
pub mod usage;
pub mod worker;
