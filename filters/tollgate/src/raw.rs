//! Host reads that never panic, whatever the host returns.
//!
//! The SDK's readers unwrap: a header value that is not UTF-8 (`get_map`, `get_map_value`) or a
//! status they do not expect panics, and a panic kills the Wasm VM and every later request on
//! its worker. These call the proxy-wasm ABI directly, take bytes as bytes, and turn any status
//! but `Ok` into "absent". Decoding the map buffer is pure and tested in the core crate
//! (`tollgate_filter_core::hostmap`).

// The SDK declares the same imports with its own enums for arguments and status; plain
// integers here keep an unknown status from ever being read as an enum.
#![allow(clashing_extern_declarations)]

use proxy_wasm::types::{BufferType, MapType};
use std::ptr::null_mut;
use tollgate_filter_core::hostmap::HeaderMap;

const OK: u32 = 0;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(buffer_type: u32, start: usize, size: usize, buffer_data: *const u8, buffer_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_register_shared_queue(name_data: *const u8, name_size: usize, return_id: *mut u32) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(queue_id: u32, return_value_data: *mut *mut u8, return_value_size: *mut usize) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_grpc_send(token: u32, message_data: *const u8, message_size: usize, end_stream: u32) -> u32;
}

/// The ABI's `StreamType::HttpRequest`.
const HTTP_REQUEST: u32 = 0;

/// Takes ownership of a buffer the host allocated through the module's allocator
/// (`proxy_on_memory_allocate`, a `Vec<u8>` of exactly `size`).
///
/// # Safety
/// `data` must be null or a buffer of `size` bytes the host just returned from an ABI call.
unsafe fn take(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        // SAFETY: per the ABI, the host allocated `size` bytes with our allocator and hands
        // them over to us.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }
}

/// A header map, decoded in place in the buffer the host handed over. Empty on any failure.
pub fn map(map: MapType) -> HeaderMap {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: the out-pointers are valid for the call; the result is taken over by `take`.
    let bytes = unsafe {
        match proxy_get_header_map_pairs(map as u32, &mut data, &mut size) {
            OK => take(data, size),
            _ => None,
        }
    };
    bytes.and_then(HeaderMap::parse).unwrap_or_default()
}

/// Every pair of a header map: names (lossily) as text, values as bytes. Empty on any failure.
pub fn map_pairs(map_type: MapType) -> Vec<(String, Vec<u8>)> {
    map(map_type).iter().map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.to_vec())).collect()
}

/// One header's value as bytes (`None`: absent, or the host could not say).
pub fn map_value(map: MapType, name: &str) -> Option<Vec<u8>> {
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: `name` outlives the call; the result is taken over by `take`.
    unsafe {
        match proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut data, &mut size) {
            OK => Some(take(data, size).unwrap_or_default()),
            _ => None,
        }
    }
}

/// `size` bytes of a buffer from `start` (`None`: absent, or the host could not say).
pub fn buffer(kind: BufferType, start: usize, size: usize) -> Option<Vec<u8>> {
    let (mut data, mut len) = (null_mut(), 0usize);
    // SAFETY: the out-pointers are valid for the call; the result is taken over by `take`.
    unsafe {
        match proxy_get_buffer_bytes(kind as u32, start, size, &mut data, &mut len) {
            OK => take(data, len),
            _ => None,
        }
    }
}

/// Replaces `size` bytes of buffer `kind` from `start` with `value` (`false`: the host refused; the
/// SDK's `set_buffer` panics then, which a filter must not).
pub fn set_buffer(kind: BufferType, start: usize, size: usize, value: &[u8]) -> bool {
    // SAFETY: `value` is valid for the call; the host copies it.
    unsafe { proxy_set_buffer_bytes(kind as u32, start, size, value.as_ptr(), value.len()) == OK }
}

/// An Envoy attribute (`None`: absent, or the host could not say).
pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    // The ABI's path: the segments joined by NUL bytes.
    let serialized = path.join("\0").into_bytes();
    let (mut data, mut size) = (null_mut(), 0usize);
    // SAFETY: `serialized` outlives the call; the result is taken over by `take`.
    unsafe {
        match proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) {
            OK => take(data, size),
            _ => None,
        }
    }
}

/// Registers a shared queue of this VM's (`None`: the host would not).
pub fn register_queue(name: &str) -> Option<u32> {
    let mut id = 0u32;
    // SAFETY: `name` outlives the call; `id` is a valid out-pointer.
    (unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) } == OK).then_some(id)
}

/// Enqueues one byte to `queue`: whether the host took it.
pub fn enqueue(queue: u32) -> bool {
    let byte = [b'w'];
    // SAFETY: `byte` outlives the call.
    unsafe { proxy_enqueue_shared_queue(queue, byte.as_ptr(), byte.len()) == OK }
}

/// Empties `queue` (its items are wake-ups: only their arrival matters).
pub fn drain(queue: u32) {
    for _ in 0..1024 {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: the out-pointers are valid for the call; the result is taken over by `take`.
        let item = unsafe {
            match proxy_dequeue_shared_queue(queue, &mut data, &mut size) {
                OK => take(data, size),
                _ => None,
            }
        };
        if item.is_none() {
            return;
        }
    }
}

/// Makes host calls apply to context `id` from now on in this callback: whether the host did.
pub fn set_effective_context(id: u32) -> bool {
    // SAFETY: a plain value call.
    unsafe { proxy_set_effective_context(id) == OK }
}

/// Resumes the effective context's request (any status but `Ok` is ignored: the stream is gone).
pub fn resume_request() {
    // SAFETY: a plain value call.
    let _ = unsafe { proxy_continue_stream(HTTP_REQUEST) };
}

/// Sends `message` on gRPC stream `token` of the effective context; the host's status if not
/// `Ok` (the SDK's sender panics on a status it does not expect).
pub fn grpc_send(token: u32, message: &[u8]) -> Result<(), u32> {
    // SAFETY: the host reads `message` (a live slice) during the call only.
    match unsafe { proxy_grpc_send(token, message.as_ptr(), message.len(), 0) } {
        OK => Ok(()),
        status => Err(status),
    }
}
