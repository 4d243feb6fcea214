//! The Envoy dynamic-module ABI, the subset this module uses, and nothing else touches it.
//!
//! Written by hand from Envoy's C header `source/extensions/dynamic_modules/abi/abi.h` (the
//! `v0.1.0` header, whose signatures the `v0.2.0` ABI of Envoy 1.40 keeps: the ABI promises a
//! `v0.1.y` module works with `v0.2.x`; decision 251). Envoy checks no signature: a wrong one here
//! is undefined behaviour, so every import below is exercised through a real Envoy by the native
//! functional tier, and `./build.sh test` checks that each one is exported by the Envoy binary in
//! use (`scripts/check-native-symbols.sh`).
//!
//! Two halves: **imports** (`envoy_dynamic_module_callback_*`), wrapped in safe functions that
//! take Rust slices and never hand Envoy a dangling pointer; **exports** (`envoy_dynamic_module_on_*`,
//! the event hooks Envoy resolves when it loads the filter), each of which catches any panic
//! ([`guard`]): a panic unwinding into Envoy's C++ would abort the whole Envoy, every worker's
//! requests with it. A caught panic becomes the failure mode (crate::plugin: 503).
//!
//! C enums are `int`-sized on the platforms Envoy ships for: they are `u32` here.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The ABI version this module declares: what Envoy 1.40 expects (its binary carries `v0.2.0`).
static ABI_VERSION: &[u8] = b"v0.2.0\0";

pub type EnvoyPtr = *mut c_void;
pub type ModulePtr = *const c_void;

/// A buffer Envoy owns, valid until the end of the current hook.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    const NULL: EnvoyBuffer = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };

    /// The bytes (empty for a null buffer).
    ///
    /// # Safety
    /// Envoy must have filled it in this hook (its pointer valid for `length` bytes).
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            // SAFETY: per the caller's contract.
            unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
        }
    }
}

/// A buffer the module owns, lent to Envoy for one call (`NULL`: "remove" for a header setter).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: bytes.as_ptr(), length: bytes.len() }
    }
    const NULL: ModuleBuffer = ModuleBuffer { ptr: std::ptr::null(), length: 0 };
}

#[repr(C)]
struct ModuleHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// `envoy_dynamic_module_type_http_header_type`.
#[derive(Clone, Copy)]
pub enum HeaderType { Request = 0, RequestTrailer = 1, Response = 2, ResponseTrailer = 3 }

/// `envoy_dynamic_module_type_http_body_type`.
#[derive(Clone, Copy)]
pub enum BodyType { ReceivedRequest = 0, BufferedRequest = 1, ReceivedResponse = 2, BufferedResponse = 3 }

/// The `envoy_dynamic_module_type_attribute_id`s read here.
#[derive(Clone, Copy)]
pub enum Attribute {
    RequestTotalSize = 14,
    ResponseCodeDetails = 16,
    ResponseTotalSize = 22,
    SourceAddress = 24,
    UpstreamAddress = 41,
    XdsClusterName = 57,
}

/// `envoy_dynamic_module_type_log_level` (those used).
#[derive(Clone, Copy)]
pub enum Level { Debug = 1, Info = 2, Warn = 3, Error = 4 }

/// A filter hook's answer, the ABI's statuses: 0 `Continue`; 1 `StopIteration` (headers,
/// trailers) or `StopIterationAndBuffer` (body); 2 `StopIterationAndWatermark` (body only).
pub type Status = u32;
pub const CONTINUE: Status = 0;
pub const STOP: Status = 1;
pub const STOP_WATERMARK: Status = 2;

const CALLOUT_SUCCESS: u32 = 0;

extern "C" {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: EnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(filter: EnvoyPtr, id: usize, label_values: *mut ModuleBuffer, label_values_length: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(config: EnvoyPtr, id: usize, label_values: *mut ModuleBuffer, label_values_length: usize, value: u64) -> u32;
    fn envoy_dynamic_module_callback_http_get_header(
        filter: EnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_headers_size(filter: EnvoyPtr, header_type: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(filter: EnvoyPtr, header_type: u32, result: *mut EnvoyHeader) -> bool;
    fn envoy_dynamic_module_callback_http_add_header(filter: EnvoyPtr, header_type: u32, key: ModuleBuffer, value: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(filter: EnvoyPtr, header_type: u32, key: ModuleBuffer, value: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: EnvoyPtr,
        status_code: u32,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_get_body_size(filter: EnvoyPtr, body_type: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: EnvoyPtr, body_type: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(filter: EnvoyPtr, body_type: u32, result: *mut EnvoyBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(filter: EnvoyPtr) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(filter: EnvoyPtr, body_type: u32, number_of_bytes: usize) -> bool;
    fn envoy_dynamic_module_callback_http_append_body(filter: EnvoyPtr, body_type: u32, data: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_response_body(filter: EnvoyPtr) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(filter: EnvoyPtr, id: u32, result: *mut EnvoyBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_int(filter: EnvoyPtr, id: u32, result: *mut u64) -> bool;
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: EnvoyPtr,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: EnvoyPtr,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_clear_route_cache(filter: EnvoyPtr);
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: EnvoyPtr);
    fn envoy_dynamic_module_callback_http_filter_continue_encoding(filter: EnvoyPtr);
}

// ------------------------------------------------------------------ handles

/// A stream's `DynamicModuleHttpFilter` in Envoy, valid until `on_http_filter_destroy`.
#[derive(Clone, Copy)]
pub struct Filter(EnvoyPtr);

/// A `DynamicModuleHttpFilterConfig` in Envoy, valid until its `on_http_filter_config_destroy`,
/// which Envoy runs only once every stream of it ended. Only the hooks below make one.
#[derive(Clone, Copy)]
pub struct Config(EnvoyPtr);

impl Filter {
    /// The pointer, for the ABI's declarations in [`crate::scheduler`].
    pub(crate) fn raw(self) -> EnvoyPtr { self.0 }
}

impl Config {
    /// The pointer, for the ABI's declarations in [`crate::scheduler`].
    pub(crate) fn raw(self) -> EnvoyPtr { self.0 }
    /// An identity for maps (the address; unique while the configuration lives).
    pub fn key(self) -> usize { self.0 as usize }
}

// SAFETY: a configuration is only handed back to Envoy in calls Envoy allows from the thread
// making them (counters, the scheduler's commit from any thread; callouts from the main thread).
unsafe impl Send for Config {}
unsafe impl Sync for Config {}

// ------------------------------------------------------------------ safe imports

pub fn log(level: Level, message: &str) {
    // SAFETY: the buffer outlives the call.
    unsafe { envoy_dynamic_module_callback_log(level as u32, ModuleBuffer::of(message.as_bytes())) }
}

/// Defines a counter (configuration time only): its id.
pub fn define_counter(config: Config, name: &str) -> Option<usize> {
    let mut id = 0usize;
    // SAFETY: `config` is the configuration Envoy is creating; no labels; `id` is valid.
    let r = unsafe { envoy_dynamic_module_callback_http_filter_config_define_counter(config.0, ModuleBuffer::of(name.as_bytes()), std::ptr::null_mut(), 0, &mut id) };
    (r == 0).then_some(id)
}

pub fn increment_counter(filter: Filter, id: usize, n: u64) {
    // SAFETY: `filter` is the stream of the current hook; no labels.
    let _ = unsafe { envoy_dynamic_module_callback_http_filter_increment_counter(filter.0, id, std::ptr::null_mut(), 0, n) };
}

pub fn config_increment_counter(config: Config, id: usize, n: u64) {
    // SAFETY: `config` is alive (its hook runs); no labels.
    let _ = unsafe { envoy_dynamic_module_callback_http_filter_config_increment_counter(config.0, id, std::ptr::null_mut(), 0, n) };
}

/// A header's first value (`None`: absent).
pub fn header(filter: Filter, kind: HeaderType, name: &str) -> Option<Vec<u8>> {
    let mut out = EnvoyBuffer::NULL;
    // SAFETY: the key outlives the call; `out` is valid; Envoy's buffer is copied at once.
    unsafe {
        let found = envoy_dynamic_module_callback_http_get_header(filter.0, kind as u32, ModuleBuffer::of(name.as_bytes()), &mut out, 0, std::ptr::null_mut());
        (found && !out.ptr.is_null()).then(|| out.bytes().to_vec())
    }
}

/// Runs `f` on every header of a map, borrowed from Envoy (no copy; empty when it has none).
pub fn with_headers<R>(filter: Filter, kind: HeaderType, f: impl FnOnce(&[(&[u8], &[u8])]) -> R) -> R {
    // SAFETY: the array has the size Envoy gave; its buffers stay valid during this hook, and
    // the borrows handed to `f` do not outlive this call.
    unsafe {
        let n = envoy_dynamic_module_callback_http_get_headers_size(filter.0, kind as u32);
        if n == 0 {
            return f(&[]);
        }
        let empty = EnvoyHeader { key_ptr: std::ptr::null(), key_length: 0, value_ptr: std::ptr::null(), value_length: 0 };
        let mut raw = vec![empty; n];
        if !envoy_dynamic_module_callback_http_get_headers(filter.0, kind as u32, raw.as_mut_ptr()) {
            return f(&[]);
        }
        let pairs: Vec<(&[u8], &[u8])> = raw
            .iter()
            .map(|h| (EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }.bytes(), EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }.bytes()))
            .collect();
        f(&pairs)
    }
}

pub fn set_header(filter: Filter, kind: HeaderType, name: &str, value: Option<&str>) {
    let value = value.map_or(ModuleBuffer::NULL, |v| ModuleBuffer::of(v.as_bytes()));
    // SAFETY: the buffers outlive the call.
    let _ = unsafe { envoy_dynamic_module_callback_http_set_header(filter.0, kind as u32, ModuleBuffer::of(name.as_bytes()), value) };
}

/// Makes Envoy pick the stream's route again (after a change of a header a route matches on).
pub fn clear_route_cache(filter: Filter) {
    // SAFETY: `filter` is the stream of the current hook.
    unsafe { envoy_dynamic_module_callback_http_clear_route_cache(filter.0) }
}

pub fn add_header(filter: Filter, kind: HeaderType, name: &str, value: &str) {
    // SAFETY: the buffers outlive the call.
    let _ = unsafe { envoy_dynamic_module_callback_http_add_header(filter.0, kind as u32, ModuleBuffer::of(name.as_bytes()), ModuleBuffer::of(value.as_bytes())) };
}

fn module_headers(headers: &[(String, String)]) -> Vec<ModuleHeader> {
    headers
        .iter()
        .map(|(k, v)| ModuleHeader { key_ptr: k.as_ptr(), key_length: k.len(), value_ptr: v.as_ptr(), value_length: v.len() })
        .collect()
}

pub fn send_response(filter: Filter, status: u16, headers: &[(String, String)], body: &[u8], details: &str) {
    let mut h = module_headers(headers);
    // SAFETY: `headers`, `body` and `details` outlive the call; Envoy copies them.
    unsafe {
        envoy_dynamic_module_callback_http_send_response(filter.0, u32::from(status), h.as_mut_ptr(), h.len(), ModuleBuffer::of(body), ModuleBuffer::of(details.as_bytes()))
    }
}

fn chunks(filter: Filter, kind: BodyType, out: &mut Vec<u8>) {
    // SAFETY: the array has the size Envoy gave; the chunks are copied at once.
    unsafe {
        let n = envoy_dynamic_module_callback_http_get_body_chunks_size(filter.0, kind as u32);
        if n == 0 {
            return;
        }
        let mut raw = vec![EnvoyBuffer::NULL; n];
        if envoy_dynamic_module_callback_http_get_body_chunks(filter.0, kind as u32, raw.as_mut_ptr()) {
            for c in &raw {
                out.extend_from_slice(c.bytes());
            }
        }
    }
}

/// The body so far, as a proxy-wasm filter sees it in a body callback: what this filter's
/// earlier `StopIterationAndBuffer` kept, then the chunk just received (or only that chunk,
/// when it is the buffer an earlier filter handed on). `(buffered, received)` body types.
fn body_parts(filter: Filter, request: bool) -> (Option<BodyType>, BodyType) {
    // SAFETY: a plain query of the current stream.
    let handed_on = unsafe {
        if request {
            envoy_dynamic_module_callback_http_received_buffered_request_body(filter.0)
        } else {
            envoy_dynamic_module_callback_http_received_buffered_response_body(filter.0)
        }
    };
    let (buffered, received) = if request { (BodyType::BufferedRequest, BodyType::ReceivedRequest) } else { (BodyType::BufferedResponse, BodyType::ReceivedResponse) };
    ((!handed_on).then_some(buffered), received)
}

/// The body's bytes (copied; see `body_parts`).
pub fn body(filter: Filter, request: bool) -> Vec<u8> {
    let (buffered, received) = body_parts(filter, request);
    let mut out = Vec::new();
    if let Some(b) = buffered {
        chunks(filter, b, &mut out);
    }
    chunks(filter, received, &mut out);
    out
}

/// Replaces the request body this filter's stream holds buffered (after a body hook stopped
/// iteration: Envoy's decoding buffer) with `body`: drained whole, then appended.
pub fn replace_buffered_request_body(filter: Filter, body: &[u8]) -> bool {
    let kind = BodyType::BufferedRequest as u32;
    // SAFETY: plain calls on the current stream; `body` outlives the call and Envoy copies it.
    unsafe { envoy_dynamic_module_callback_http_drain_body(filter.0, kind, usize::MAX) && envoy_dynamic_module_callback_http_append_body(filter.0, kind, ModuleBuffer::of(body)) }
}

/// The body's size, without copying it.
pub fn body_size(filter: Filter, request: bool) -> usize {
    let (buffered, received) = body_parts(filter, request);
    // SAFETY: plain queries of the current stream.
    unsafe {
        let kept = buffered.map_or(0, |b| envoy_dynamic_module_callback_http_get_body_size(filter.0, b as u32));
        kept.saturating_add(envoy_dynamic_module_callback_http_get_body_size(filter.0, received as u32))
    }
}

pub fn attribute_string(filter: Filter, id: Attribute) -> Option<Vec<u8>> {
    let mut out = EnvoyBuffer::NULL;
    // SAFETY: `out` is valid; Envoy's buffer is copied at once.
    unsafe { envoy_dynamic_module_callback_http_filter_get_attribute_string(filter.0, id as u32, &mut out).then(|| out.bytes().to_vec()) }
}

pub fn attribute_int(filter: Filter, id: Attribute) -> Option<u64> {
    let mut out = 0u64;
    // SAFETY: `out` is valid.
    unsafe { envoy_dynamic_module_callback_http_filter_get_attribute_int(filter.0, id as u32, &mut out).then_some(out) }
}

/// Where a call goes out from: a stream (its answer comes to that stream's hook) or the
/// configuration (its answer comes to the configuration's hook, on the main thread).
#[derive(Clone, Copy)]
pub enum Caller {
    Stream(Filter),
    Config(Config),
}

/// Starts an HTTP call: its id, or why Envoy would not.
pub fn callout(from: Caller, cluster: &str, headers: &[(String, String)], body: &[u8], timeout_ms: u64) -> Result<u64, String> {
    let mut h = module_headers(headers);
    let mut id = 0u64;
    let (cluster, body) = (ModuleBuffer::of(cluster.as_bytes()), ModuleBuffer::of(body));
    // SAFETY: every buffer outlives the call (Envoy copies the request); `id` is valid.
    let r = unsafe {
        match from {
            Caller::Stream(f) => envoy_dynamic_module_callback_http_filter_http_callout(f.0, &mut id, cluster, h.as_mut_ptr(), h.len(), body, timeout_ms),
            Caller::Config(c) => envoy_dynamic_module_callback_http_filter_config_http_callout(c.0, &mut id, cluster, h.as_mut_ptr(), h.len(), body, timeout_ms),
        }
    };
    match r {
        0 => Ok(id),
        1 => Err("MissingRequiredHeaders".into()),
        2 => Err("ClusterNotFound".into()),
        3 => Err("DuplicateCalloutId".into()),
        4 => Err("CannotCreateRequest".into()),
        other => Err(format!("callout init result {other}")),
    }
}

pub fn continue_decoding(filter: Filter) {
    // SAFETY: `filter` is the stream of the current hook.
    unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(filter.0) }
}

pub fn continue_encoding(filter: Filter) {
    // SAFETY: `filter` is the stream of the current hook.
    unsafe { envoy_dynamic_module_callback_http_filter_continue_encoding(filter.0) }
}

/// A finished call's `:status` and body (both absent when the call failed: reset, overflow).
///
/// # Safety
/// The arrays are the ones Envoy passed to the current hook.
unsafe fn call_result(result: u32, headers: *const EnvoyHeader, n: usize, chunks: *const EnvoyBuffer, m: usize) -> (Option<u16>, Vec<u8>) {
    if result != CALLOUT_SUCCESS || headers.is_null() {
        return (None, Vec::new());
    }
    // SAFETY: per the caller's contract.
    let (headers, chunks) = unsafe { (std::slice::from_raw_parts(headers, n), if chunks.is_null() { &[][..] } else { std::slice::from_raw_parts(chunks, m) }) };
    let status = headers.iter().find_map(|h| {
        // SAFETY: Envoy's buffers, valid in this hook.
        let (k, v) = unsafe { (EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }.bytes(), EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }.bytes()) };
        (k == b":status").then(|| std::str::from_utf8(v).ok().and_then(|s| s.parse().ok())).flatten()
    });
    let mut body = Vec::new();
    for c in chunks {
        // SAFETY: Envoy's buffers, valid in this hook.
        body.extend_from_slice(unsafe { c.bytes() });
    }
    (status, body)
}

// ------------------------------------------------------------------ exports (event hooks)

/// Runs a hook's body, catching any panic: `fallback` is the hook's answer then.
fn guard<T>(hook: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            log(Level::Error, &format!("tollgate: a panic in {hook} was caught; failing that request closed"));
            fallback
        }
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}

/// # Safety
/// Envoy passes its configuration and two buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(config: EnvoyPtr, _name: EnvoyBuffer, bytes: EnvoyBuffer) -> ModulePtr {
    // SAFETY: Envoy's buffer, valid in this hook.
    let bytes = unsafe { bytes.bytes() };
    guard("config_new", std::ptr::null(), || crate::plugin::config_new(Config(config), bytes))
}

/// # Safety
/// `module` is a pointer `config_new` returned, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(module: ModulePtr) {
    guard("config_destroy", (), || crate::plugin::config_destroy(module))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(module: ModulePtr, filter: EnvoyPtr) -> ModulePtr {
    guard("filter_new", std::ptr::null(), || crate::plugin::filter_new(module, Filter(filter)))
}

/// Which stream callback a hook is (with its `end_of_stream`).
#[derive(Clone, Copy, Debug)]
pub enum Phase { RequestHeaders(bool), RequestBody(bool), RequestTrailers, ResponseHeaders(bool), ResponseBody(bool), ResponseTrailers }

fn phase(filter: EnvoyPtr, module: ModulePtr, p: Phase) -> Status {
    guard("a stream callback", STOP, || crate::plugin::on_phase(Filter(filter), module, p))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(filter: EnvoyPtr, module: ModulePtr, end_of_stream: bool) -> Status {
    phase(filter, module, Phase::RequestHeaders(end_of_stream))
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(filter: EnvoyPtr, module: ModulePtr, end_of_stream: bool) -> Status {
    phase(filter, module, Phase::RequestBody(end_of_stream))
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(filter: EnvoyPtr, module: ModulePtr) -> Status {
    phase(filter, module, Phase::RequestTrailers)
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(filter: EnvoyPtr, module: ModulePtr, end_of_stream: bool) -> Status {
    phase(filter, module, Phase::ResponseHeaders(end_of_stream))
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(filter: EnvoyPtr, module: ModulePtr, end_of_stream: bool) -> Status {
    phase(filter, module, Phase::ResponseBody(end_of_stream))
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(filter: EnvoyPtr, module: ModulePtr) -> Status {
    phase(filter, module, Phase::ResponseTrailers)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(filter: EnvoyPtr, module: ModulePtr) {
    guard("stream_complete", (), || crate::plugin::stream_complete(Filter(filter), module))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: ModulePtr) {
    guard("filter_destroy", (), || crate::plugin::filter_destroy(module))
}

/// # Safety
/// Envoy's arrays are valid for the hook.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter: EnvoyPtr,
    module: ModulePtr,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
) {
    // SAFETY: Envoy's arrays, valid in this hook.
    let (status, body) = unsafe { call_result(result, headers, headers_size, chunks, chunks_size) };
    guard("http_callout_done", (), || crate::plugin::stream_call_done(Filter(filter), module, callout_id, status, body))
}

/// # Safety
/// Envoy's arrays are valid for the hook.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config: EnvoyPtr,
    module: ModulePtr,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
) {
    // SAFETY: Envoy's arrays, valid in this hook.
    let (status, body) = unsafe { call_result(result, headers, headers_size, chunks, chunks_size) };
    guard("config_http_callout_done", (), || crate::plugin::config_call_done(module, callout_id, status, body))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(_config: EnvoyPtr, module: ModulePtr, _event_id: u64) {
    guard("config_scheduled", (), || crate::plugin::tick(module))
}

/// An answer the module's own connection to the sidecar brought (crate::direct) is in.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(filter: EnvoyPtr, module: ModulePtr, _event_id: u64) {
    guard("scheduled", (), || crate::plugin::stream_scheduled(Filter(filter), module))
}

// Hooks Envoy requires but this module does not use (it starts no streamed callout and is not a
// terminal filter): each does nothing.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(_f: EnvoyPtr, _m: ModulePtr, _id: u64, _h: *const EnvoyHeader, _n: usize, _end: bool) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(_f: EnvoyPtr, _m: ModulePtr, _id: u64, _d: *const EnvoyBuffer, _n: usize, _end: bool) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(_f: EnvoyPtr, _m: ModulePtr, _id: u64, _t: *const EnvoyHeader, _n: usize) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_f: EnvoyPtr, _m: ModulePtr, _id: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(_f: EnvoyPtr, _m: ModulePtr, _id: u64, _reason: u32) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_f: EnvoyPtr, _m: ModulePtr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_f: EnvoyPtr, _m: ModulePtr) {}
