//! The Tollgate Wasm filter: proxy-wasm glue and nothing else.
//!
//! [`Root`] parses the plugin configuration once in `on_configure` (returning `false`, so Envoy
//! refuses the config, when it is invalid) and defines the filter's stats. Each request gets an
//! [`Http`] context whose `EnvoyHost` implements `tollgate_filter_core::filter::Host` over
//! proxy-wasm host calls; every decision is taken by `AuthFilter` in the core crate.
//!
//! Circuit breakers: after authentication lets a request through, `BreakerGuard` admits it,
//! sends it to a fallback, or replies 503; it records the outcome in the response headers. The
//! root context runs the core's `HintPoller` on its tick (one elected root context per Envoy).

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as WasmAction, ContextType, LogLevel as WasmLogLevel, MetricType};
use std::collections::HashMap;
use std::rc::Rc;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::{Action, AuthFilter, CallSpec, Host, LogLevel, Metric};
use tollgate_filter_core::{breaker, breaker_guard::BreakerGuard, breaker_hints::HintPoller};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(WasmLogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Metric ids, defined once per VM.
type Metrics = Rc<HashMap<Metric, u32>>;

/// Per-target breaker counter ids by name, defined once per VM.
type Named = Rc<HashMap<String, u32>>;

#[derive(Default)]
struct Root {
    config: Option<Rc<FilterConfig>>,
    metrics: Metrics,
    named: Named,
    poller: Option<HintPoller>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let status = self.get_http_call_response_header(":status").and_then(|s| s.parse::<u16>().ok());
        let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
        let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
        if let Some(p) = self.poller.as_mut() {
            p.on_call_response(&mut host, token_id, status, &body);
        }
    }
}

/// A random identity for this VM in the hint poller's lease.
fn vm_identity() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(EnvoyHost { metrics: &HashMap::new(), named: &HashMap::new() }.now_ms());
    h.finish()
}

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
        if let Some(config) = self.config.clone() {
            let mut named = HashMap::new();
            for name in config.breakers.metric_names() {
                match hostcalls::define_metric(MetricType::Counter, &name) {
                    Ok(id) => {
                        named.insert(name, id);
                    }
                    Err(e) => log::warn!("tollgate: cannot define metric {name}: {e:?}"),
                }
            }
            self.named = Rc::new(named);
            let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
            for t in &config.breakers.targets {
                breaker::init(&mut host, &breaker::shared_key(&t.name));
            }
            if config.breakers.shares_hints() {
                self.poller = Some(HintPoller::new(config.clone(), vm_identity()));
                self.set_tick_period(config.breakers.hints.poll_interval);
            }
        }
        true
    }

    fn on_tick(&mut self) {
        let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
        if let Some(p) = self.poller.as_mut() {
            p.on_tick(&mut host);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let config = self.config.clone()?;
        Some(Box::new(Http {
            filter: AuthFilter::new(config.clone()),
            guard: BreakerGuard::new(config),
            metrics: self.metrics.clone(),
            named: self.named.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    filter: AuthFilter,
    guard: BreakerGuard,
    metrics: Metrics,
    named: Named,
}

/// The Host trait over proxy-wasm host calls for the current HTTP context.
struct EnvoyHost<'a> {
    metrics: &'a HashMap<Metric, u32>,
    named: &'a HashMap<String, u32>,
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
    fn shared_get_cas(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }
    fn shared_set_cas(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), breaker::SharedSetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(proxy_wasm::types::Status::CasMismatch) => Err(breaker::SharedSetError::CasMismatch),
            Err(e) => Err(breaker::SharedSetError::Other(format!("{e:?}"))),
        }
    }
    fn response_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(proxy_wasm::types::MapType::HttpResponseHeaders, name).ok().flatten()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
    fn clear_route_cache(&mut self) {
        // Envoy's foreign function; harmless if header mutation already cleared it.
        let _ = hostcalls::call_foreign_function("clear_route_cache", None);
    }
    fn count_named(&mut self, name: &str) {
        if let Some(id) = self.named.get(name) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
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
        let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
        if self.filter.on_sidecar_response(&mut host, token_id, status, &body) == Action::Continue
            && self.guard.on_request(&mut host) == Action::Continue
        {
            self.resume_http_request();
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
        match self.filter.on_request_headers(&mut host) {
            Action::Continue => to_wasm(self.guard.on_request(&mut host)),
            Action::Pause => WasmAction::Pause,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
        self.filter.on_response_headers(&mut host);
        to_wasm(self.guard.on_response(&mut host))
    }

    fn on_log(&mut self) {
        let mut host = EnvoyHost { metrics: &self.metrics, named: &self.named };
        self.guard.on_done(&mut host);
    }
}
