//! The native host's floor (bench reference, never shipped): an Envoy dynamic module whose HTTP
//! filter does nothing. Every hook returns at once (`Continue` where a status is asked for);
//! nothing is called back into Envoy. Measured in Tollgate's template (`floor-native`), it is
//! what the native host costs Envoy before the filter does any work: the dynamic-module filter's
//! own machinery (a per-request filter object, a call per hook) on top of the template.
//!
//! The signatures are those of `filters/native/src/ffi.rs` (Envoy 1.40's `abi.h`, ABI v0.2.0);
//! no argument is read, so every one is an opaque pointer or a plain value here.

use std::ffi::{c_char, c_void};

type Ptr = *const c_void;

/// A buffer Envoy passes by value (`envoy_dynamic_module_type_envoy_buffer`); never read.
#[repr(C)]
pub struct Buffer {
    ptr: *const u8,
    length: usize,
}

static ABI_VERSION: &[u8] = b"v0.2.0\0";
/// What the configuration and each filter hand back to Envoy: any pointer but null (null is a
/// failure to Envoy); never read.
static MODULE: u8 = 0;

fn module() -> Ptr {
    std::ptr::addr_of!(MODULE).cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(_config: Ptr, _name: Buffer, _bytes: Buffer) -> Ptr {
    module()
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(_module: Ptr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(_module: Ptr, _filter: Ptr) -> Ptr {
    module()
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(_filter: Ptr, _module: Ptr, _end: bool) -> u32 {
    0
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(_filter: Ptr, _module: Ptr, _end: bool) -> u32 {
    0
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_filter: Ptr, _module: Ptr) -> u32 {
    0
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(_filter: Ptr, _module: Ptr, _end: bool) -> u32 {
    0
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(_filter: Ptr, _module: Ptr, _end: bool) -> u32 {
    0
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(_filter: Ptr, _module: Ptr) -> u32 {
    0
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_filter: Ptr, _module: Ptr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_module: Ptr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(_f: Ptr, _m: Ptr, _id: u64, _result: u32, _h: Ptr, _hn: usize, _c: Ptr, _cn: usize) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(_cfg: Ptr, _m: Ptr, _id: u64, _result: u32, _h: Ptr, _hn: usize, _c: Ptr, _cn: usize) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(_cfg: Ptr, _m: Ptr, _event_id: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_f: Ptr, _m: Ptr, _event_id: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(_f: Ptr, _m: Ptr, _id: u64, _h: Ptr, _n: usize, _end: bool) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(_f: Ptr, _m: Ptr, _id: u64, _d: Ptr, _n: usize, _end: bool) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(_f: Ptr, _m: Ptr, _id: u64, _t: Ptr, _n: usize) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_f: Ptr, _m: Ptr, _id: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(_f: Ptr, _m: Ptr, _id: u64, _reason: u32) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_f: Ptr, _m: Ptr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_f: Ptr, _m: Ptr) {}
