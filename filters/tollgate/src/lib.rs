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
//!
//! Completions: requests holding a ticket (token reservation, concurrency slot) push a report to
//! the worker's `CompletionQueue`; the root context flushes it on every tick as one batch.
//!
//! Leased limits: requests spend their key's lease from shared data (`tollgate_filter_core::lease`);
//! a request that leaves it low queues a renewal in the worker's `RenewalQueue`, which the root
//! context's tick sends (`LeaseRenewer`), off the request path.
//!
//! Usage (when `usage.enabled`): every request with an identity pushes a usage event to the
//! worker's `Meter`; the root context sends it as `POST /v1/usage` every `usage.flushInterval`.

mod raw;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as WasmAction, BufferType, ContextType, LogLevel as WasmLogLevel, MapType, MetricType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::auth_cache::LocalAllows;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::host::{Action, CallSpec, Host, LogLevel, SharedSetError};
use tollgate_filter_core::stats::Metric;
use tollgate_filter_core::ids::DecisionIds;
use tollgate_filter_core::responses::queue::ResponseQueue;
use tollgate_filter_core::routing::{RouteTablePoller, WorkerRoutes};
use tollgate_filter_core::lease::renewer::{LeaseRenewer, RenewalQueue};
use tollgate_filter_core::usage::{self, Meter};
use tollgate_filter_core::breaker::{self, guard::BreakerGuard, hints::HintPoller};
use tollgate_filter_core::shared_keys;
use tollgate_wire::usage::USAGE_PATH;
use tollgate_wire::COMPLETIONS_PATH;

/// Completion reports a worker keeps while the sidecar is unreachable.
const MAX_QUEUED_COMPLETIONS: usize = 10_000;
/// The longest a queued lease renewal waits for its root context's tick.
const LEASE_TICK: std::time::Duration = std::time::Duration::from_millis(20);
/// Completion reports per `POST /v1/completions`.
const MAX_BATCH: usize = 500;
/// Responses to store a worker keeps at most (items, bytes), and bytes per `POST /v1/responses`.
const MAX_QUEUED_RESPONSES: usize = 1_000;
const MAX_QUEUED_RESPONSE_BYTES: usize = 32 << 20;
const MAX_RESPONSE_BATCH_BYTES: usize = 4 << 20;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(WasmLogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Metric ids, defined once per VM.
type Metrics = Rc<HashMap<Metric, u32>>;

/// Per-target breaker counter ids by name, defined once per VM.
type Named = Rc<HashMap<String, u32>>;

/// Counters of the completion flusher (not request outcomes, so not in `Metric`).
#[derive(Default, Clone, Copy)]
struct FlushMetrics {
    sent: Option<u32>,
    dropped: Option<u32>,
    errors: Option<u32>,
}

fn bump(id: Option<u32>, n: u64) {
    if let (Some(id), true) = (id, n > 0) {
        let _ = hostcalls::increment_metric(id, n as i64);
    }
}

struct Root {
    config: Option<Rc<FilterConfig>>,
    metrics: Metrics,
    named: Named,
    poller: Option<HintPoller>,
    /// When the hint poller last ran (it runs every `poll_interval`; the tick is faster when
    /// completions need flushing).
    last_poll_ms: u64,
    /// This worker's completion reports; HTTP contexts push, the tick flushes.
    completions: Rc<RefCell<CompletionQueue>>,
    flush_metrics: FlushMetrics,
    reported_dropped: u64,
    /// The token of the completion batch in flight.
    flush_token: Option<u32>,
    /// This worker's usage events (metering on): HTTP contexts record, the tick sends.
    meter: Rc<RefCell<Meter>>,
    usage_metrics: FlushMetrics,
    usage_reported_dropped: u64,
    /// The token of the usage batch in flight.
    usage_token: Option<u32>,
    last_usage_flush_ms: u64,
    /// Set while the sidecar refuses usage for good (404: metering off there), to log once.
    usage_refused: bool,
    /// This worker's parsed routing table, shared with its HTTP contexts.
    routes: Rc<RefCell<WorkerRoutes>>,
    /// Refreshes shared data's routing table (the lease holder only).
    route_poller: Option<RouteTablePoller>,
    /// This worker's responses to store (issue 7); HTTP contexts push, the tick sends.
    responses: Rc<RefCell<ResponseQueue>>,
    response_metrics: FlushMetrics,
    responses_reported_dropped: u64,
    /// The token and size of the response batch in flight.
    responses_token: Option<(u32, usize)>,
    /// This worker's lease renewals: HTTP contexts queue, the tick sends.
    renewals: Rc<RefCell<RenewalQueue>>,
    renewer: Option<LeaseRenewer>,
    last_completion_flush_ms: u64,
    /// This worker's copy of the auth cache entries it has seen.
    local_allows: Rc<RefCell<LocalAllows>>,
    /// This worker's decision ids (a secret random seed per VM).
    decision_ids: Rc<RefCell<DecisionIds>>,
}

impl Default for Root {
    fn default() -> Self {
        let renewals = Rc::new(RefCell::new(RenewalQueue::default()));
        Root {
            config: None,
            metrics: Rc::default(),
            named: Rc::default(),
            poller: None,
            last_poll_ms: 0,
            completions: Rc::new(RefCell::new(CompletionQueue::new(MAX_QUEUED_COMPLETIONS))),
            flush_metrics: FlushMetrics::default(),
            reported_dropped: 0,
            flush_token: None,
            meter: Rc::new(RefCell::new(Meter::new(1, 0))),
            usage_metrics: FlushMetrics::default(),
            usage_reported_dropped: 0,
            usage_token: None,
            last_usage_flush_ms: 0,
            usage_refused: false,
            routes: Rc::default(),
            route_poller: None,
            renewals: renewals.clone(),
            renewer: None,
            last_completion_flush_ms: 0,
            responses: Rc::new(RefCell::new(ResponseQueue::new(MAX_QUEUED_RESPONSES, MAX_QUEUED_RESPONSE_BYTES))),
            response_metrics: FlushMetrics::default(),
            responses_reported_dropped: 0,
            responses_token: None,
            local_allows: Rc::default(),
            decision_ids: Rc::new(RefCell::new(DecisionIds::new(random_seed()))),
        }
    }
}

impl Root {
    /// Sends this worker's finished responses to store as one batch (one in flight at a time,
    /// sent once: a failed batch is counted as dropped, not retried).
    fn flush_responses(&mut self) {
        let Some(config) = self.config.clone() else { return };
        let mut queue = self.responses.borrow_mut();
        bump(self.response_metrics.dropped, queue.dropped - self.responses_reported_dropped);
        self.responses_reported_dropped = queue.dropped;
        let Some((body, n)) = queue.begin_flush(MAX_RESPONSE_BATCH_BYTES) else { return };
        let headers = vec![
            (":method", "POST"),
            (":path", tollgate_wire::responses::RESPONSES_PATH),
            (":authority", config.sidecar.authority.as_str()),
            ("content-type", "application/json"),
        ];
        let timeout = std::time::Duration::from_secs(5);
        match hostcalls::dispatch_http_call(&config.sidecar.cluster, headers, Some(&body), vec![], timeout) {
            Ok(token) => self.responses_token = Some((token, n)),
            Err(e) => {
                queue.end_flush(n);
                bump(self.response_metrics.errors, 1);
                log::debug!("tollgate: cannot send responses to store: {e:?}");
            }
        }
    }
}

impl Root {
    /// Sends this worker's waiting completion reports as one batch (one in flight at a time).
    fn flush(&mut self) {
        let Some(config) = self.config.clone() else { return };
        let mut queue = self.completions.borrow_mut();
        bump(self.flush_metrics.dropped, queue.dropped - self.reported_dropped);
        self.reported_dropped = queue.dropped;
        let Some(body) = queue.begin_flush(MAX_BATCH) else { return };
        let headers = vec![
            (":method", "POST"),
            (":path", COMPLETIONS_PATH),
            (":authority", config.sidecar.authority.as_str()),
            ("content-type", "application/json"),
        ];
        // A batch may wait longer than a decision: it is off the request path.
        let timeout = config.sidecar.timeout.max(std::time::Duration::from_secs(2));
        match hostcalls::dispatch_http_call(&config.sidecar.cluster, headers, Some(&body), vec![], timeout) {
            Ok(token) => self.flush_token = Some(token),
            Err(e) => {
                queue.end_flush(false);
                bump(self.flush_metrics.errors, 1);
                log::debug!("tollgate: cannot flush completions: {e:?}");
            }
        }
    }
}

impl Root {
    /// Sends this worker's usage events as one batch (one in flight at a time). The events stay
    /// queued until the sidecar answers 200 (spooled): a failed or timed-out batch is sent again,
    /// and the billing consumer counts each event id once.
    fn flush_usage(&mut self) {
        let Some(config) = self.config.clone() else { return };
        let mut meter = self.meter.borrow_mut();
        bump(self.usage_metrics.dropped, meter.queue.dropped - self.usage_reported_dropped);
        self.usage_reported_dropped = meter.queue.dropped;
        let Some(body) = meter.queue.begin_flush(usage::MAX_BATCH) else { return };
        let headers = vec![
            (":method", "POST"),
            (":path", USAGE_PATH),
            (":authority", config.sidecar.authority.as_str()),
            ("content-type", "application/json"),
        ];
        // The sidecar answers once the batch is on disk (an fsync): allow it a few seconds.
        let timeout = std::time::Duration::from_secs(5);
        match hostcalls::dispatch_http_call(&config.sidecar.cluster, headers, Some(&body), vec![], timeout) {
            Ok(token) => self.usage_token = Some(token),
            Err(e) => {
                meter.queue.end_flush(false);
                bump(self.usage_metrics.errors, 1);
                log::debug!("tollgate: cannot send usage: {e:?}");
            }
        }
    }

    fn on_usage_response(&mut self, status: Option<u16>) {
        self.usage_token = None;
        let mut meter = self.meter.borrow_mut();
        match status {
            Some(200) => {
                bump(self.usage_metrics.sent, 1);
                meter.queue.end_flush(true);
                if self.usage_refused {
                    self.usage_refused = false;
                    log::info!("tollgate: the sidecar takes usage events again");
                }
            }
            // Not metering there, or a batch it can never read: retrying cannot help.
            Some(400) | Some(404) => {
                meter.queue.discard_in_flight();
                bump(self.usage_metrics.errors, 1);
                if !self.usage_refused {
                    self.usage_refused = true;
                    log::warn!("tollgate: the sidecar refused usage events ({status:?}); they are dropped and counted");
                }
            }
            _ => {
                bump(self.usage_metrics.errors, 1);
                meter.queue.end_flush(false);
            }
        }
        let dropped = meter.queue.dropped;
        drop(meter);
        bump(self.usage_metrics.dropped, dropped - self.usage_reported_dropped);
        self.usage_reported_dropped = dropped;
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let status = call_status(num_headers);
        if self.usage_token == Some(token_id) {
            self.on_usage_response(status);
            return;
        }
        if let Some((_, n)) = self.responses_token.filter(|(t, _)| *t == token_id) {
            self.responses_token = None;
            let ok = status == Some(200);
            bump(if ok { self.response_metrics.sent } else { self.response_metrics.errors }, 1);
            self.responses.borrow_mut().end_flush(if ok { 0 } else { n });
            return;
        }
        if self.flush_token == Some(token_id) {
            self.flush_token = None;
            let ok = status == Some(200);
            bump(if ok { self.flush_metrics.sent } else { self.flush_metrics.errors }, 1);
            self.completions.borrow_mut().end_flush(ok);
            return;
        }
        let body = call_body(num_headers, body_size);
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        if let Some(p) = self.route_poller.as_mut().filter(|p| p.owns(token_id)) {
            p.on_call_response(&mut host, token_id, status, &body);
            self.routes.borrow_mut().refresh(&host);
            return;
        }
        if let Some(r) = self.renewer.as_mut() {
            if r.on_call_response(&mut host, token_id, status, &body) {
                return;
            }
        }
        if let Some(p) = self.poller.as_mut() {
            p.on_call_response(&mut host, token_id, status, &body);
        }
    }
}

/// The `:status` of a finished `dispatch_http_call`; `None` when the call ended without a
/// response. Envoy then calls back with no headers (a stream reset, e.g. an HTTP/2 stream reset
/// by a timeout racing the answer), and reading a header would return `BadArgument`, which the
/// SDK's `get_map_value` turns into a panic — a dead VM failing every later request.
fn call_status(num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        return None;
    }
    let status = raw::map_value(MapType::HttpCallResponseHeaders, ":status")?;
    std::str::from_utf8(&status).ok()?.parse().ok()
}

/// The body of a finished `dispatch_http_call` (empty when the call ended without a response).
fn call_body(num_headers: usize, body_size: usize) -> Vec<u8> {
    if num_headers == 0 || body_size == 0 {
        return Vec::new();
    }
    raw::buffer(BufferType::HttpCallResponseBody, 0, body_size).unwrap_or_default()
}

/// 32 secret random bytes for this VM's decision ids: four keyed hashes whose keys `RandomState`
/// draws from the host's randomness (WASI `random_get`).
fn random_seed() -> [u8; 32] {
    use std::hash::BuildHasher;
    let mut seed = [0u8; 32];
    for (i, chunk) in seed.chunks_mut(8).enumerate() {
        let v = std::collections::hash_map::RandomState::new().hash_one(i as u64);
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    seed
}

/// A random identity for this VM in the hint poller's lease, and the seed of its usage event
/// ids. `RandomState` draws its keys from the host's randomness (WASI `random_get`).
fn vm_identity() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(EnvoyHost::new(&HashMap::new(), &HashMap::new()).now_ms());
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
        for m in Metric::requests() {
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
            let mut host = EnvoyHost::new(&self.metrics, &self.named);
            for t in &config.breakers.targets {
                breaker::init(&mut host, &shared_keys::breaker(&t.name));
            }
            if config.breakers.shares_hints() {
                self.poller = Some(HintPoller::new(config.breakers.clone(), config.sidecar.clone(), vm_identity()));
            }
            let define = |name: &str| hostcalls::define_metric(MetricType::Counter, name).ok();
            self.flush_metrics = FlushMetrics {
                sent: define("tollgate.completions.batches_sent"),
                dropped: define("tollgate.completions.dropped"),
                errors: define("tollgate.completions.flush_errors"),
            };
            if config.response_cache.enabled || config.idempotency.enabled {
                self.response_metrics = FlushMetrics {
                    sent: define("tollgate.responses.batches_sent"),
                    dropped: define("tollgate.responses.dropped"),
                    errors: define("tollgate.responses.flush_errors"),
                };
            }
            if config.usage.enabled {
                self.meter = Rc::new(RefCell::new(Meter::new(config.usage.max_queued, vm_identity())));
                self.usage_metrics = FlushMetrics {
                    sent: define("tollgate.usage.batches_sent"),
                    dropped: define("tollgate.usage.dropped"),
                    errors: define("tollgate.usage.flush_errors"),
                };
            }
            // One tick drives all: completion flushes every tick, hint polls every poll_interval,
            // usage every usage.flush_interval.
            let mut tick = config.completion_flush_interval;
            if self.poller.is_some() {
                tick = tick.min(config.breakers.hints.poll_interval);
            }
            if config.usage.enabled {
                tick = tick.min(config.usage.flush_interval);
            }
            if config.routing.enabled {
                self.route_poller = Some(RouteTablePoller::new(config.routing.clone(), config.sidecar.clone(), vm_identity()));
                tick = tick.min(config.routing.refresh_interval);
            }
            if config.leases.enabled {
                // lease renewals wait for the tick: keep it well under `renewAhead`
                tick = tick.min(LEASE_TICK);
            }
            self.renewer = Some(LeaseRenewer::new(self.renewals.clone(), config.sidecar.clone()));
            self.set_tick_period(tick);
        }
        true
    }

    fn on_tick(&mut self) {
        if let Some(config) = self.config.clone() {
            let mut host = EnvoyHost::new(&self.metrics, &self.named);
            if let Some(r) = self.renewer.as_mut() {
                r.on_tick(&mut host);
            }
            // the tick may be faster than the completion flushes (lease renewals)
            let now = host.now_ms();
            if now.saturating_sub(self.last_completion_flush_ms) + 5 >= config.completion_flush_interval.as_millis() as u64 {
                self.last_completion_flush_ms = now;
                self.flush();
            }
        }
        self.flush_responses();
        if let Some(config) = self.config.clone().filter(|c| c.usage.enabled) {
            let now = EnvoyHost::new(&self.metrics, &self.named).now_ms();
            if now.saturating_sub(self.last_usage_flush_ms) + 5 >= config.usage.flush_interval.as_millis() as u64 {
                self.last_usage_flush_ms = now;
                self.flush_usage();
            }
        }
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        if let Some(p) = self.route_poller.as_mut() {
            p.on_tick(&mut host);
            self.routes.borrow_mut().refresh(&host);
        }
        if let (Some(p), Some(config)) = (self.poller.as_mut(), self.config.as_ref()) {
            let now = host.now_ms();
            if now.saturating_sub(self.last_poll_ms) + 5 >= config.breakers.hints.poll_interval.as_millis() as u64 {
                self.last_poll_ms = now;
                p.on_tick(&mut host);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let config = self.config.clone()?;
        Some(Box::new(Http {
            filter: AuthFilter::new(config.clone(), self.completions.clone())
                .with_meter(self.meter.clone())
                .with_routes(self.routes.clone())
                .with_responses(self.responses.clone())
                .with_leases(self.renewals.clone())
                .with_local_allows(self.local_allows.clone())
                .with_decision_ids(self.decision_ids.clone()),
            guard: BreakerGuard::new(config.breakers.clone()),
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

/// The Host trait over proxy-wasm host calls for the current HTTP context. One lives for one
/// callback from Envoy: within it, the time and the response's `:status` are read from Envoy once
/// (each read is a host call; the filter and the breaker guard both ask).
struct EnvoyHost<'a> {
    metrics: &'a HashMap<Metric, u32>,
    named: &'a HashMap<String, u32>,
    now_ms: std::cell::Cell<Option<u64>>,
    status: RefCell<Option<Option<String>>>,
}

impl<'a> EnvoyHost<'a> {
    fn new(metrics: &'a HashMap<Metric, u32>, named: &'a HashMap<String, u32>) -> EnvoyHost<'a> {
        EnvoyHost { metrics, named, now_ms: std::cell::Cell::new(None), status: RefCell::new(None) }
    }
}

impl Host for EnvoyHost<'_> {
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        raw::map_pairs(MapType::HttpRequestHeaders)
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
        let bytes = raw::property(&["source", "address"])?;
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
    fn count_by(&mut self, metric: Metric, n: u64) {
        if let Some(id) = self.metrics.get(&metric) {
            let _ = hostcalls::increment_metric(*id, n as i64);
        }
    }
    fn now_ms(&self) -> u64 {
        if let Some(t) = self.now_ms.get() {
            return t;
        }
        let t = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        self.now_ms.set(Some(t));
        t
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
    fn shared_set_cas(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(proxy_wasm::types::Status::CasMismatch) => Err(SharedSetError::CasMismatch),
            Err(e) => Err(SharedSetError::Other(format!("{e:?}"))),
        }
    }
    fn response_header(&self, name: &str) -> Option<String> {
        let read = || raw::map_value(MapType::HttpResponseHeaders, name).and_then(|v| String::from_utf8(v).ok());
        if name != ":status" {
            return read();
        }
        self.status.borrow_mut().get_or_insert_with(read).clone()
    }
    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        raw::map_pairs(MapType::HttpResponseHeaders)
    }
    fn request_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        raw::buffer(BufferType::HttpRequestBody, start, size)
    }
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        raw::buffer(BufferType::HttpResponseBody, start, size)
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        raw::property(path)
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
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let status = call_status(num_headers);
        let body = call_body(num_headers, body_size);
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        if self.filter.on_sidecar_response(&mut host, token_id, status, &body) == Action::Continue
            && self.guard.on_request_routed(&mut host, self.filter.route()) == Action::Continue
        {
            self.resume_http_request();
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        match self.filter.on_request_headers(&mut host, end_of_stream) {
            Action::Continue => to_wasm(self.guard.on_request_routed(&mut host, self.filter.route())),
            Action::Pause => WasmAction::Pause,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        match self.filter.on_request_body(&mut host, body_size, end_of_stream) {
            // The guard runs once (it ignores later calls), when authentication lets the request on.
            Action::Continue => to_wasm(self.guard.on_request_routed(&mut host, self.filter.route())),
            Action::Pause => WasmAction::Pause,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        self.filter.on_response_headers(&mut host, end_of_stream);
        to_wasm(self.guard.on_response(&mut host))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        to_wasm(self.filter.on_response_body(&mut host, body_size, end_of_stream))
    }

    fn on_log(&mut self) {
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        self.guard.on_done(&mut host);
        self.filter.on_log(&host);
    }
}
