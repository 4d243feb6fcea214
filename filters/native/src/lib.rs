//! The Tollgate filter as an Envoy dynamic module: the same core as the Wasm filter
//! (`tollgate-filter-core`), loaded by Envoy as native code
//! (`envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter`, Envoy 1.40, ABI
//! `v0.2.0`) instead of into a V8 sandbox.
//!
//! - [`ffi`]: the ABI's subset this module uses, the only unsafe boundary; every hook Envoy
//!   calls catches panics;
//! - [`plugin`]: one filter configuration — the core's `Worker` under one lock, its streams, its
//!   tick on Envoy's main thread;
//! - [`host`]: the core's `Host` port over the ABI;
//! - [`shared`]: shared data as a process-wide map in plain Rust;
//! - [`direct`]: the module's own HTTP/2 connection to the sidecar (`sidecar.address`);
//! - [`scheduler`]: the ABI's schedulers, a configuration's and a stream's.
//!
//! When to choose it over the Wasm filter: docs/architecture.md, "The native host".

mod direct;
pub mod ffi;
mod host;
mod plugin;
mod scheduler;
mod shared;
