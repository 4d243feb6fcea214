//! The Tollgate Wasm filter: proxy-wasm glue and nothing else.
//!
//! [`Root`] parses the plugin configuration once in `on_configure` (returning `false`, so Envoy
//! refuses the config, when it is invalid), makes the worker's `tollgate_filter_core::worker::Worker`,
//! defines the counters it lists and sets the tick it asks for; then it forwards `on_tick`,
//! `on_http_call_response` and `create_http_context` to it. It also registers a shared queue of
//! its own VM: a request whose decision waits for the worker's batch enqueues to it, which wakes
//! the root (`on_queue_ready`) to send the batch; the root hands each of a batch's answers to its
//! request's context (`proxy_set_effective_context`, then `proxy_continue_stream`: decision 127). Each request's [`Http`] context
//! forwards every callback to its `HttpFilter` and returns the action it decides. `EnvoyHost`
//! implements the core's `Host` port over proxy-wasm host calls; `raw` reads what the host hands
//! over without ever panicking. Every decision — and every background job (completions, usage,
//! responses, lease renewals, the routing table, breaker hints) — is the core crate's.

mod raw;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as WasmAction, BufferType, ContextType, LogLevel as WasmLogLevel, MapType, MetricType, Status};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use tollgate_filter_core::batch::Delivery;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::{Action, CallSpec, Host, LogLevel, SharedSetError};
use tollgate_filter_core::http::HttpFilter;
use tollgate_filter_core::stats::{IdMap, Metric};
use tollgate_filter_core::stream::Head;
use tollgate_filter_core::worker::{Seeds, Worker};
use tollgate_wire::compact;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(WasmLogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, ..Root::default() }) });
}}

/// The VM's counters (a VM per worker): the ids defined once, and the counts of
/// [`Metric::BATCHED`] not yet given to Envoy — tallied here, flushed on the root context's tick
/// (decision 125), so a warm request makes no host call for them.
#[derive(Default)]
struct Counters {
    ids: IdMap<Metric, u32>,
    pending: [Cell<u64>; Metric::BATCHED.len()],
}

impl Counters {
    fn add(&self, metric: Metric, n: u64) {
        match metric.batch_slot().and_then(|i| self.pending.get(i)) {
            Some(pending) => pending.set(pending.get().saturating_add(n)),
            None => self.increment(metric, n),
        }
    }

    fn increment(&self, metric: Metric, n: u64) {
        if let Some(id) = self.ids.get(&metric) {
            let _ = hostcalls::increment_metric(*id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Gives Envoy the tallied counts, in the order of [`Metric::BATCHED`].
    fn flush(&self) {
        for (metric, pending) in Metric::BATCHED.into_iter().zip(&self.pending) {
            let n = pending.take();
            if n > 0 {
                self.increment(metric, n);
            }
        }
    }
}

type Metrics = Rc<Counters>;

/// Per-target breaker counter ids by name, defined once per VM.
type Named = Rc<IdMap<String, u32>>;

/// The worker's live HTTP contexts by id, for the answers of decision batches (crate::batch in
/// the core): the root context delivers each in its request's context.
type Streams = Rc<RefCell<HashMap<u32, Weak<RefCell<HttpFilter>>>>>;

#[derive(Default)]
struct Root {
    id: u32,
    /// Set by a valid configuration.
    worker: Option<Worker>,
    metrics: Metrics,
    named: Named,
    /// The shared queue a request enqueues to, to wake this root context when its decision waits
    /// for a batch (decision 127); `None`: batching is off.
    wake_queue: Option<u32>,
    streams: Streams,
    /// Envoy was told this root context is done (`proxy_done`, after `on_done` said not yet).
    told_done: bool,
    /// The tick period last set.
    tick: std::time::Duration,
}

impl Root {
    fn host(&self) -> EnvoyHost<'_> {
        EnvoyHost::new(&self.metrics, &self.named)
    }

    /// Gives each answer of a decision batch to its request, in the request's context, and
    /// resumes the request when the filter lets it on. A request that ended meanwhile is gone
    /// from `streams` (its filter already queued the refund).
    fn deliver(&self, deliveries: Vec<Delivery>) {
        if deliveries.is_empty() {
            return;
        }
        for delivery in deliveries {
            let ctx = delivery.ctx;
            let Some(filter) = self.streams.borrow().get(&ctx).and_then(Weak::upgrade) else { continue };
            if !raw::set_effective_context(ctx) {
                continue;
            }
            // Nothing here may make a call: the SDK would register it on the root context.
            let action = filter.borrow_mut().on_batched_answer(&mut self.host(), delivery);
            if action == Action::Continue {
                raw::resume_request();
            }
        }
        raw::set_effective_context(self.id);
    }

    /// An ending worker that sent what it held (or dropped it, counted, after its grace): Envoy
    /// may delete this root context now (`proxy_done`; decision 156).
    fn finish_if_ended(&mut self) {
        if !self.told_done && self.worker.as_ref().is_some_and(Worker::has_ended) {
            self.told_done = true;
            self.metrics.flush();
            if let Err(e) = hostcalls::done() {
                log::warn!("tollgate: cannot tell Envoy this ended configuration's worker is done: {e:?}");
            }
        }
    }
}

/// A counter per name, defined with the host (a failure is logged; that counter stays silent).
fn define<K: std::hash::Hash + Eq>(keys: impl IntoIterator<Item = (K, String)>) -> IdMap<K, u32> {
    let mut ids = IdMap::default();
    for (key, name) in keys {
        match hostcalls::define_metric(MetricType::Counter, &name) {
            Ok(id) => {
                ids.insert(key, id);
            }
            Err(e) => log::warn!("tollgate: cannot define metric {name}: {e:?}"),
        }
    }
    ids
}

impl Context for Root {
    /// Envoy dropped this configuration (a new one replaces it, or Envoy stops): its tallied
    /// counts go to Envoy now, and it may go at once unless its worker still holds usage events,
    /// completions, refunds or responses to store. Then its ticks send them and it tells Envoy
    /// when it is done ([`Root::finish_if_ended`]; decision 156).
    fn on_done(&mut self) -> bool {
        self.metrics.flush();
        match self.worker.as_mut() {
            Some(worker) => worker.end(&mut EnvoyHost::new(&self.metrics, &self.named)),
            None => true,
        }
    }

    fn on_grpc_stream_initial_metadata(&mut self, token_id: u32, _num_elements: u32) {
        let Some(worker) = self.worker.as_mut() else { return };
        let status = raw::map_value(MapType::GrpcReceiveInitialMetadata, ":status");
        let kind = raw::map_value(MapType::GrpcReceiveInitialMetadata, "content-type");
        let served = status.as_deref() == Some(b"200") && kind.is_some_and(|k| k.starts_with(b"application/grpc"));
        let head = if !served {
            Head::NotServed
        } else if raw::map_value(MapType::GrpcReceiveInitialMetadata, compact::FORMAT_HEADER).as_deref() == Some(compact::FORMAT_COMPACT.as_bytes()) {
            Head::Compact
        } else {
            Head::Json
        };
        worker.on_stream_head(&mut EnvoyHost::new(&self.metrics, &self.named), token_id, head);
    }

    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let Some(worker) = self.worker.as_mut() else { return };
        let message = raw::buffer(BufferType::GrpcReceiveBuffer, 0, message_size).unwrap_or_default();
        let deliveries = worker.on_stream_message(&mut EnvoyHost::new(&self.metrics, &self.named), token_id, &message);
        self.deliver(deliveries);
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        let Some(worker) = self.worker.as_mut() else { return };
        let deliveries = worker.on_stream_close(&mut EnvoyHost::new(&self.metrics, &self.named), token_id, status_code);
        self.deliver(deliveries);
    }

    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let Some(worker) = self.worker.as_mut() else { return };
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        let deliveries = worker.on_call_response(&mut host, token_id, || call_status(num_headers), || call_body(num_headers, body_size));
        self.deliver(deliveries);
        self.finish_if_ended();
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let config = match FilterConfig::parse(&bytes) {
            Ok(config) => Rc::new(config),
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        let seeds = Seeds {
            decision_ids: tollgate_filter_core::ids::random_seed(),
            usage_ids: vm_identity(),
            hints_owner: vm_identity(),
            routes_owner: vm_identity(),
            changes_owner: vm_identity(),
        };
        let worker = Worker::new(&mut EnvoyHost::new(&self.metrics, &self.named), config, seeds);
        self.metrics = Rc::new(Counters { ids: define(worker.metrics().into_iter().map(|m| (m, m.name()))), ..Counters::default() });
        self.named = Rc::new(define(worker.named_metrics().into_iter().map(|n| (n.clone(), n))));
        // A queue of this VM's own (its name unique per VM): enqueueing to it wakes this root
        // context on its worker's thread, so a waiting decision batch leaves at once.
        let mut worker = worker;
        self.wake_queue = raw::register_queue(&format!("tollgate.decisions.{:016x}", vm_identity()));
        if self.wake_queue.is_some() {
            worker.enable_batching();
            // decisions on one stream per worker, sent from the requests' contexts (decision 223)
            worker.enable_stream();
        }
        self.tick = worker.tick_period();
        self.set_tick_period(self.tick);
        self.worker = Some(worker);
        true
    }

    fn on_tick(&mut self) {
        if let Some(worker) = self.worker.as_mut() {
            let mut host = EnvoyHost::new(&self.metrics, &self.named);
            let deliveries = worker.on_tick(&mut host);
            // the lease tick only while leases are in use (decision 272)
            let tick = worker.tick_period_now(host.now_ms());
            if tick != self.tick {
                self.tick = tick;
                self.set_tick_period(tick);
            }
            self.deliver(deliveries);
        }
        self.metrics.flush();
        self.finish_if_ended();
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        raw::drain(queue_id);
        if let Some(worker) = self.worker.as_mut() {
            let deliveries = worker.send_decisions(&mut EnvoyHost::new(&self.metrics, &self.named));
            self.deliver(deliveries);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let worker = self.worker.as_ref()?;
        let filter = match self.wake_queue {
            Some(_) => worker.request_in(context_id),
            None => worker.request(),
        };
        Some(Box::new(Http {
            filter: Rc::new(RefCell::new(filter)),
            metrics: self.metrics.clone(),
            named: self.named.clone(),
            wake_queue: self.wake_queue,
            ctx: context_id,
            root: self.id,
            streams: self.streams.clone(),
            registered: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    /// Shared with the root's `streams` (weakly), which delivers batched decisions to it.
    filter: Rc<RefCell<HttpFilter>>,
    metrics: Metrics,
    named: Named,
    wake_queue: Option<u32>,
    ctx: u32,
    /// The root context's id: its decision stream is sent on in its name.
    root: u32,
    streams: Streams,
    /// In `streams`: only a request whose decision waits for a batch is (most never do).
    registered: bool,
}

impl Drop for Http {
    fn drop(&mut self) {
        if self.registered {
            self.streams.borrow_mut().remove(&self.ctx);
        }
    }
}

impl Http {
    fn host(&self) -> EnvoyHost<'_> {
        let mut host = EnvoyHost::new(&self.metrics, &self.named);
        host.wake_queue = self.wake_queue;
        host.contexts = Some((self.ctx, self.root));
        host
    }

    /// Runs one callback of the filter with a host for it, and gives Envoy its answer.
    fn step(&mut self, callback: impl FnOnce(&mut HttpFilter, &mut EnvoyHost) -> Action) -> WasmAction {
        let mut host = self.host();
        let action = callback(&mut self.filter.borrow_mut(), &mut host);
        if !self.registered && self.filter.borrow().waits_for_batch() {
            self.streams.borrow_mut().insert(self.ctx, Rc::downgrade(&self.filter));
            self.registered = true;
        }
        match action {
            Action::Continue => WasmAction::Continue,
            Action::Pause => WasmAction::Pause,
            Action::Hold => WasmAction::StopIterationAndWatermark,
        }
    }
}

impl Context for Http {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        // the status is read only when the body is no decision (decision 143)
        let body = call_body(num_headers, body_size);
        let mut host = self.host();
        let mut filter = self.filter.borrow_mut();
        if filter.on_call_response(&mut host, token_id, || call_status(num_headers), &body) == Action::Continue {
            self.resume_http_request();
        }
        if filter.take_resume_response() {
            self.resume_http_response();
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> WasmAction {
        self.step(|filter, host| filter.on_request_headers(host, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        self.step(|filter, host| filter.on_request_body(host, body_size, end_of_stream))
    }

    /// Not the SDK's default (`Continue`): that would let a request paused for its decision go
    /// upstream undecided when the client sends trailers (HTTP/2).
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> WasmAction {
        self.step(|filter, host| filter.on_request_trailers(host))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> WasmAction {
        self.step(|filter, host| filter.on_response_headers(host, end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        self.step(|filter, host| filter.on_response_body(host, body_size, end_of_stream))
    }

    /// Trailers end the response (HTTP/2, gRPC): not the SDK's default `Continue`, which would
    /// let the end of an idempotent response reach the client before its outcome is stored.
    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> WasmAction {
        self.step(|filter, host| filter.on_response_trailers(host))
    }

    fn on_log(&mut self) {
        let mut host = self.host();
        self.filter.borrow_mut().on_log(&mut host);
    }
}

/// The Host trait over proxy-wasm host calls. One lives for one callback from Envoy: within it,
/// the time and the response's `:status` are read from Envoy once (each read is a host call; the
/// filter and the breaker guard both ask).
struct EnvoyHost<'a> {
    metrics: &'a Counters,
    named: &'a IdMap<String, u32>,
    now_ms: Cell<Option<u64>>,
    status: RefCell<Option<Option<String>>>,
    /// The root context's wake queue (an HTTP context's host only).
    wake_queue: Option<u32>,
    /// An HTTP context's host: its context and its root context (whose stream it sends on).
    contexts: Option<(u32, u32)>,
}

impl<'a> EnvoyHost<'a> {
    fn new(metrics: &'a Counters, named: &'a IdMap<String, u32>) -> EnvoyHost<'a> {
        EnvoyHost { metrics, named, now_ms: Cell::new(None), status: RefCell::new(None), wake_queue: None, contexts: None }
    }
}

impl Host for EnvoyHost<'_> {
    fn request_headers(&self) -> tollgate_filter_core::hostmap::HeaderMap {
        raw::map(MapType::HttpRequestHeaders)
    }
    fn set_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }
    fn add_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpRequestHeaders, name, value);
    }
    fn remove_request_header(&mut self, name: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, None);
    }
    fn request_trailer_names(&self) -> Vec<String> {
        raw::map_pairs(MapType::HttpRequestTrailers).into_iter().map(|(n, _)| n).collect()
    }
    fn remove_request_trailer(&mut self, name: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestTrailers, name, None);
    }
    fn response_trailer(&self, name: &str) -> Option<String> {
        raw::map_value(MapType::HttpResponseTrailers, name).and_then(|v| String::from_utf8(v).ok())
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
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
        self.metrics.add(metric, n);
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
            Err(Status::CasMismatch) => Err(SharedSetError::CasMismatch),
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
    fn replace_request_body(&mut self, old_len: usize, body: &[u8]) -> bool {
        // from the callout's context: the body Envoy buffers for this filter (it paused at the
        // body's end with StopIterationAndBuffer), drained and replaced whole
        raw::set_buffer(BufferType::HttpRequestBody, 0, old_len, body)
    }
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        raw::buffer(BufferType::HttpResponseBody, start, size)
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        raw::property(path)
    }
    fn count_named(&mut self, name: &str) {
        if let Some(id) = self.named.get(name) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }
    fn wake_root(&mut self) -> bool {
        self.wake_queue.is_some_and(raw::enqueue)
    }
    fn open_stream(&mut self, cluster: &str, service: &str, method: &str, metadata: &[(&str, &[u8])]) -> Result<u32, String> {
        // the root context's (its tick): the SDK registers the stream's callbacks to it
        hostcalls::open_grpc_stream(cluster, service, method, metadata.to_vec()).map_err(|s| format!("{s:?}"))
    }
    fn stream_send(&mut self, token: u32, message: &[u8]) -> Result<(), String> {
        // The stream is the root context's: sent in its name, then back to this request's.
        let Some((ctx, root)) = self.contexts else { return raw::grpc_send(token, message).map_err(|s| format!("status {s}")) };
        if !raw::set_effective_context(root) {
            return Err("cannot act for the root context".into());
        }
        let sent = raw::grpc_send(token, message);
        raw::set_effective_context(ctx);
        sent.map_err(|s| format!("status {s}"))
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

/// A random 64-bit identity for this VM (a poller's election, the seed of usage event ids).
/// `RandomState` draws its keys from the host's randomness (WASI `random_get`).
fn vm_identity() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(EnvoyHost::new(&Counters::default(), &IdMap::default()).now_ms());
    h.finish()
}
