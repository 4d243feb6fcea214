//! The Tollgate Wasm filter: proxy-wasm glue and nothing else.
//!
//! [`Root`] parses the plugin configuration once in `on_configure` (returning `false`, so Envoy
//! refuses the config, when it is invalid) and defines the filter's stats. Each request gets an
//! [`Http`] context whose `EnvoyHost` implements `tollgate_filter_core::filter::Host` over
//! proxy-wasm host calls; every decision is taken by `AuthFilter` in the core crate.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as WasmAction, ContextType, LogLevel as WasmLogLevel, MetricType};
use std::collections::HashMap;
use std::rc::Rc;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::{Action, AuthFilter, CallSpec, Host, LogLevel, Metric};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(WasmLogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Metric ids, defined once per VM.
type Metrics = Rc<HashMap<Metric, u32>>;

#[derive(Default)]
struct Root {
    config: Option<Rc<FilterConfig>>,
    metrics: Metrics,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match FilterConfig::parse(&bytes) {
            Ok(config) => {
                self.config = Some(Rc::new(config));
            }
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        }
        let mut metrics = HashMap::new();
        for m in Metric::all() {
            match hostcalls::define_metric(MetricType::Counter, &m.name()) {
                Ok(id) => {
                    metrics.insert(m, id);
                }
                Err(e) => log::warn!("tollgate: cannot define metric {}: {e:?}", m.name()),
            }
        }
        self.metrics = Rc::new(metrics);
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let config = self.config.clone()?;
        Some(Box::new(Http { filter: AuthFilter::new(config), metrics: self.metrics.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    filter: AuthFilter,
    metrics: Metrics,
}

/// The Host trait over proxy-wasm host calls for the current HTTP context.
struct EnvoyHost<'a> {
    metrics: &'a HashMap<Metric, u32>,
}

impl Host for EnvoyHost<'_> {
    fn request_headers(&self) -> Vec<(String, String)> {
        hostcalls::get_map(proxy_wasm::types::MapType::HttpRequestHeaders).unwrap_or_default()
    }
    fn request_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(proxy_wasm::types::MapType::HttpRequestHeaders, name).ok().flatten()
    }
    fn set_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(proxy_wasm::types::MapType::HttpRequestHeaders, name, Some(value));
    }
    fn remove_request_header(&mut self, name: &str) {
        let _ = hostcalls::set_map_value(proxy_wasm::types::MapType::HttpRequestHeaders, name, None);
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(proxy_wasm::types::MapType::HttpResponseHeaders, name, value);
    }
    fn client_ip(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["source", "address"]).ok().flatten()?;
        let addr = String::from_utf8(bytes).ok()?;
        // "ip:port" or "[v6]:port" → ip
        let ip = match addr.rsplit_once(':') {
            Some((ip, port)) if port.bytes().all(|b| b.is_ascii_digit()) => ip,
            _ => addr.as_str(),
        };
        Some(ip.trim_start_matches('[').trim_end_matches(']').to_string())
    }
    fn dispatch(&mut self, call: CallSpec) -> Result<u32, String> {
        let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        hostcalls::dispatch_http_call(&call.cluster, headers, Some(&call.body), vec![], call.timeout)
            .map_err(|s| format!("{s:?}"))
    }
    fn send_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(u32::from(status), headers.to_vec(), Some(body));
    }
    fn count(&mut self, metric: Metric) {
        if let Some(id) = self.metrics.get(&metric) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }
    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64)
    }
    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        hostcalls::get_shared_data(key).ok().and_then(|(v, _)| v)
    }
    fn shared_set(&mut self, key: &str, value: &[u8]) {
        // Unconditional: racing writers store equally valid answers; the last one wins.
        let _ = hostcalls::set_shared_data(key, Some(value), None);
    }
    fn log(&mut self, level: LogLevel, message: &str) {
        let level = match level {
            LogLevel::Debug => WasmLogLevel::Debug,
            LogLevel::Info => WasmLogLevel::Info,
            LogLevel::Warn => WasmLogLevel::Warn,
        };
        let _ = hostcalls::log(level, message);
    }
}

fn to_wasm(action: Action) -> WasmAction {
    match action {
        Action::Continue => WasmAction::Continue,
        Action::Pause => WasmAction::Pause,
    }
}

impl Context for Http {
    fn on_http_call_response(&mut self, token_id: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let status = self
            .get_http_call_response_header(":status")
            .and_then(|s| s.parse::<u16>().ok());
        let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
        let mut host = EnvoyHost { metrics: &self.metrics };
        if self.filter.on_sidecar_response(&mut host, token_id, status, &body) == Action::Continue {
            self.resume_http_request();
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost { metrics: &self.metrics };
        to_wasm(self.filter.on_request_headers(&mut host))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost { metrics: &self.metrics };
        to_wasm(self.filter.on_response_headers(&mut host))
    }
}
