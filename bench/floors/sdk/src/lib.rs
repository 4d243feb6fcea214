//! A bench reference, never shipped (`wasm-floor-sdk` in docs/benchmarks.md): a filter on the
//! proxy-wasm Rust SDK, as Tollgate's is, that does nothing. The SDK exports every callback of
//! the ABI, so Envoy calls into the VM as often per request as for Tollgate's filter (context
//! created, request headers, response headers, response body, log, done, deleted), with no host
//! call: the least any filter built on the SDK costs.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http))
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http;

impl Context for Http {}

impl HttpContext for Http {}
