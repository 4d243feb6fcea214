//! A bench reference, never shipped (`wasm-floor-sdk` in docs/benchmarks.md): a filter on the
//! proxy-wasm Rust SDK, as Tollgate's is, that does nothing. The SDK exports every callback of
//! the ABI, so Envoy calls into the VM as often per request as for Tollgate's filter (context
//! created, request headers, response headers, response body, log, done, deleted), with no host
//! call: the least any filter built on the SDK costs.

use proxy_wasm::traits::{Context, HttpContext};

proxy_wasm::main! {{
    // the SDK's default root context, making one of these per request
    proxy_wasm::set_http_context(|_context_id, _root_context_id| -> Box<dyn HttpContext> { Box::new(Http) });
}}

struct Http;

impl Context for Http {}

impl HttpContext for Http {}
