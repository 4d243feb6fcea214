//! The core's `Host` port over the dynamic-module ABI ([`crate::ffi`]).
//!
//! One [`NativeHost`] lives for one hook, in one of two places: a stream's hook (a worker thread;
//! header, body and reply calls reach that stream, and its calls' answers come back to it) or the
//! configuration's (Envoy's main thread: the worker's tick and its calls' answers; nothing of a
//! request is there to read). Calls into Envoy that may run the filter chain again at once — a
//! local reply, resuming a stream — are not made here but collected in [`NativeHost::after`]: the
//! plugin makes them once it released its lock (crate::plugin), so a hook Envoy runs from inside
//! them never waits on that lock.

use crate::direct::{Direct, Link};
use crate::ffi::{self, Attribute, Caller, Config, Filter, HeaderType, Level};
use std::cell::{Cell, OnceCell, RefCell};
use std::sync::Arc;
use tollgate_filter_core::host::{CallSpec, Host, LogLevel, SharedSetError};
use tollgate_filter_core::hostmap::HeaderMap;
use tollgate_filter_core::stats::{IdMap, Metric};

/// The counter ids the configuration defined with Envoy, by metric and by name.
#[derive(Default)]
pub struct Ids {
    pub metrics: IdMap<Metric, usize>,
    pub named: IdMap<String, usize>,
}

/// A call into Envoy made after the plugin's lock is released.
pub enum After {
    Reply { status: u16, headers: Vec<(String, String)>, body: Vec<u8> },
    ContinueDecoding,
    ContinueEncoding,
}

pub struct NativeHost<'a> {
    caller: Caller,
    ids: &'a Ids,
    now_ms: Cell<Option<u64>>,
    status: RefCell<Option<Option<String>>>,
    request_body: OnceCell<Vec<u8>>,
    response_body: OnceCell<Vec<u8>>,
    pub after: Vec<After>,
    /// The ids of the calls it sent (a configuration's host: whose answer is whose).
    pub sent: Vec<u64>,
    /// A stream's calls on the module's own connection (when `sidecar.address` is set), and the
    /// stream's link for their answers (made at its first call).
    direct: Option<(&'a Direct, &'a RefCell<Option<Arc<Link>>>)>,
}

impl<'a> NativeHost<'a> {
    /// The host of a stream's hook.
    pub fn stream(filter: Filter, ids: &'a Ids) -> NativeHost<'a> {
        NativeHost::new(Caller::Stream(filter), ids)
    }

    /// The host of a stream's hook whose calls go out on the module's own connection.
    pub fn stream_direct(filter: Filter, ids: &'a Ids, direct: Option<&'a Direct>, link: &'a RefCell<Option<Arc<Link>>>) -> NativeHost<'a> {
        let mut host = NativeHost::new(Caller::Stream(filter), ids);
        host.direct = direct.map(|d| (d, link));
        host
    }

    /// The host of the configuration's hook (the main thread).
    pub fn config(config: Config, ids: &'a Ids) -> NativeHost<'a> {
        NativeHost::new(Caller::Config(config), ids)
    }

    fn new(caller: Caller, ids: &'a Ids) -> NativeHost<'a> {
        NativeHost {
            caller,
            ids,
            now_ms: Cell::new(None),
            status: RefCell::new(None),
            request_body: OnceCell::new(),
            response_body: OnceCell::new(),
            after: Vec::new(),
            sent: Vec::new(),
            direct: None,
        }
    }

    fn filter(&self) -> Option<Filter> {
        match self.caller {
            Caller::Stream(f) => Some(f),
            Caller::Config(_) => None,
        }
    }

    /// The size of the body as a proxy-wasm filter sees it in this callback (not copied: most
    /// callbacks never read it).
    pub fn body_size(&self, request: bool) -> usize {
        self.filter().map_or(0, |f| ffi::body_size(f, request))
    }

    /// The body as a proxy-wasm filter sees it in this callback (read from Envoy once).
    pub fn body(&self, request: bool) -> &[u8] {
        let Some(f) = self.filter() else { return &[] };
        let cell = if request { &self.request_body } else { &self.response_body };
        cell.get_or_init(|| ffi::body(f, request))
    }
}

fn slice(bytes: &[u8], start: usize, size: usize) -> Option<Vec<u8>> {
    let end = start.saturating_add(size).min(bytes.len());
    bytes.get(start..end).map(<[u8]>::to_vec)
}

fn text(bytes: Vec<u8>) -> Option<String> {
    String::from_utf8(bytes).ok()
}

impl Host for NativeHost<'_> {
    fn request_headers(&self) -> HeaderMap {
        // one copy, into the map's own buffer (HeaderMap::from_pairs), of Envoy's borrowed pairs
        self.filter().map(|f| ffi::with_headers(f, HeaderType::Request, |pairs| HeaderMap::from_pairs(pairs))).unwrap_or_default()
    }
    /// Envoy's Wasm host clears the route cache on every change of a request header, and the
    /// core relies on it (`x-tollgate-cluster`: routing, breaker fallbacks); the ABI's setter
    /// does not, so the host does (decision 259).
    fn set_request_header(&mut self, name: &str, value: &str) {
        if let Some(f) = self.filter() {
            ffi::set_header(f, HeaderType::Request, name, Some(value));
            ffi::clear_route_cache(f);
        }
    }
    fn add_request_header(&mut self, name: &str, value: &str) {
        if let Some(f) = self.filter() {
            ffi::add_header(f, HeaderType::Request, name, value);
            ffi::clear_route_cache(f);
        }
    }
    fn remove_request_header(&mut self, name: &str) {
        if let Some(f) = self.filter() {
            ffi::set_header(f, HeaderType::Request, name, None);
            ffi::clear_route_cache(f);
        }
    }
    fn request_trailer_names(&self) -> Vec<String> {
        let Some(f) = self.filter() else { return Vec::new() };
        ffi::with_headers(f, HeaderType::RequestTrailer, |pairs| pairs.iter().map(|(n, _)| String::from_utf8_lossy(n).into_owned()).collect())
    }
    fn remove_request_trailer(&mut self, name: &str) {
        if let Some(f) = self.filter() {
            ffi::set_header(f, HeaderType::RequestTrailer, name, None);
        }
    }
    fn response_trailer(&self, name: &str) -> Option<String> {
        ffi::header(self.filter()?, HeaderType::ResponseTrailer, name).and_then(text)
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        if let Some(f) = self.filter() {
            ffi::add_header(f, HeaderType::Response, name, value);
        }
    }
    fn client_ip(&self) -> Option<String> {
        let addr = text(ffi::attribute_string(self.filter()?, Attribute::SourceAddress)?)?;
        // "ip:port" or "[v6]:port" → ip
        let ip = match addr.rsplit_once(':') {
            Some((ip, port)) if port.bytes().all(|b| b.is_ascii_digit()) => ip,
            _ => addr.as_str(),
        };
        Some(ip.trim_start_matches('[').trim_end_matches(']').to_string())
    }
    fn dispatch(&mut self, call: CallSpec) -> Result<u32, String> {
        if let (Caller::Stream(filter), Some((direct, slot))) = (self.caller, self.direct) {
            let existing = slot.borrow().clone();
            let link = match existing {
                Some(link) => link,
                None => {
                    let link = Arc::new(Link::new(filter).ok_or("Envoy gave the stream no scheduler")?);
                    *slot.borrow_mut() = Some(link.clone());
                    link
                }
            };
            let id = link.next_id();
            direct.send(call, move |answer, rode| link.answer(id, answer, rode));
            return Ok(id);
        }
        let timeout = u64::try_from(call.timeout.as_millis()).unwrap_or(u64::MAX);
        // Envoy numbers a caller's calls from 1 up: the low 32 bits are the core's token.
        let id = ffi::callout(self.caller, &call.cluster, &call.headers, &call.body, timeout)?;
        self.sent.push(id);
        Ok(id as u32)
    }
    fn send_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        self.after.push(After::Reply { status, headers, body: body.to_vec() });
    }
    fn count_by(&mut self, metric: Metric, n: u64) {
        let Some(id) = self.ids.metrics.get(&metric) else { return };
        match self.caller {
            Caller::Stream(f) => ffi::increment_counter(f, *id, n),
            Caller::Config(c) => ffi::config_increment_counter(c, *id, n),
        }
    }
    fn log(&mut self, level: LogLevel, message: &str) {
        let level = match level {
            LogLevel::Debug => Level::Debug,
            LogLevel::Info => Level::Info,
            LogLevel::Warn => Level::Warn,
        };
        ffi::log(level, message);
    }
    fn now_ms(&self) -> u64 {
        if let Some(t) = self.now_ms.get() {
            return t;
        }
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.now_ms.set(Some(t));
        t
    }
    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        crate::shared::get(key).0
    }
    fn shared_set(&mut self, key: &str, value: &[u8]) {
        // Unconditional: racing writers store equally valid answers; the last one wins.
        let _ = crate::shared::set(key, value, None);
    }
    fn shared_get_cas(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        crate::shared::get(key)
    }
    fn shared_set_cas(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        crate::shared::set(key, value, cas)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        let f = self.filter()?;
        let read = || ffi::header(f, HeaderType::Response, name).and_then(text);
        if name != ":status" {
            return read();
        }
        self.status.borrow_mut().get_or_insert_with(read).clone()
    }
    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        let Some(f) = self.filter() else { return Vec::new() };
        ffi::with_headers(f, HeaderType::Response, |pairs| pairs.iter().map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.to_vec())).collect())
    }
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        slice(self.body(false), start, size)
    }
    fn request_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        slice(self.body(true), start, size)
    }
    fn replace_request_body(&mut self, _old_len: usize, body: &[u8]) -> bool {
        self.filter().is_some_and(|f| ffi::replace_buffered_request_body(f, body))
    }
    /// The attributes the core reads, by their proxy-wasm paths; integers as proxy-wasm gives
    /// them (8 bytes, little-endian).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let f = self.filter()?;
        let int = |a| ffi::attribute_int(f, a).map(|v| v.to_le_bytes().to_vec());
        match path {
            ["xds", "cluster_name"] => ffi::attribute_string(f, Attribute::XdsClusterName),
            ["response", "code_details"] => ffi::attribute_string(f, Attribute::ResponseCodeDetails),
            ["upstream", "address"] => ffi::attribute_string(f, Attribute::UpstreamAddress).filter(|a| !a.is_empty()),
            ["request", "total_size"] => int(Attribute::RequestTotalSize),
            ["response", "total_size"] => int(Attribute::ResponseTotalSize),
            _ => None,
        }
    }
    fn count_named(&mut self, name: &str) {
        let Some(id) = self.ids.named.get(name) else { return };
        match self.caller {
            Caller::Stream(f) => ffi::increment_counter(f, *id, 1),
            Caller::Config(c) => ffi::config_increment_counter(c, *id, 1),
        }
    }
}
