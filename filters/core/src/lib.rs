//! The Tollgate filter's logic, apart from the host.
//!
//! Everything the filter decides lives here in plain Rust: parsing and validating the plugin
//! configuration ([`config`]), finding, hashing and stripping the API key ([`key`]), and the
//! per-request state machine ([`filter`]) that talks to Envoy only through the [`filter::Host`]
//! trait. The cdylib in `filters/tollgate` implements that trait over proxy-wasm host calls and
//! does nothing else, so this crate is tested natively (through a mock host) and on wasm32 under
//! wasm-bindgen-test.
//!
//! Invariant: nothing here panics outside tests (a panic aborts the Wasm VM and every request on
//! that worker); the crate denies `unwrap`, `expect` and `panic`.

pub mod completions;
pub mod config;
pub mod filter;
/// Decision ids made by the gateway (never taken from the client).
pub mod ids;
/// Decoding raw header maps from the host (bytes, never assumed UTF-8).
pub mod hostmap;
pub mod key;
/// Leased limits: spending, sizing and renewing leases of limit units (issue 8).
pub mod lease;
/// Usage metering: event ids and the per-worker queue of usage events.
pub mod usage;

/// Routing: the sidecar's routing table in shared data, matched locally per request.
pub mod routing;

/// The response cache and Idempotency-Key replay: keys, digests, rules, the store queue.
pub mod responses;

/// A recording host for tests (native and wasm32); compiled always, unused by the cdylib.
pub mod mock;

/// Circuit breakers: the state machine ([`breaker`]), its configuration ([`breaker_config`]), the
/// per-request guard ([`breaker_guard`]) and the hint poller ([`breaker_hints`]).
pub mod breaker;
pub mod breaker_config;
pub mod breaker_guard;
pub mod breaker_hints;
