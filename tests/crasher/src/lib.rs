//! A test fixture, never shipped: a filter that traps when a request carries `x-crash`, and
//! otherwise lets it through. The functional tests load it in place of Tollgate's filter, in the
//! same Envoy template, to measure what the shipped `failure_policy` does with a failed VM (the
//! reply a client gets, the stats, how long until requests are served again).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

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

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.get_http_request_header_bytes("x-crash").is_some() {
            // A trap, as a panic in a filter would be: the VM is failed from here on.
            std::process::abort();
        }
        Action::Continue
    }
}
