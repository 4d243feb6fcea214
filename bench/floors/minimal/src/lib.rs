//! A bench reference, never shipped (`wasm-floor-minimal` in docs/benchmarks.md): a filter that
//! does nothing, written on the proxy-wasm ABI without the SDK, exporting only the functions
//! Envoy needs to load it and to call it once per request (the context's creation and its
//! request headers). Envoy skips every callback a module does not export, so a request enters
//! the VM twice here, against seven times for `tollgate-bench-floor-sdk` and Tollgate's
//! filter: the difference between the two floors is what those five entries cost.

/// The ABI version this module speaks (its presence is the declaration).
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Memory for what the host hands over (the plugin configuration, were it read). Leaked on
/// purpose: nothing here ever reads it, and the host only asks at configuration time.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buffer = std::mem::ManuallyDrop::new(Vec::<u8>::with_capacity(size));
    buffer.as_mut_ptr()
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(_context_id: u32, _root_context_id: u32) {}

/// 1: the VM started.
#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_context_id: u32, _configuration_size: usize) -> u32 {
    1
}

/// 1: the plugin configuration is accepted.
#[no_mangle]
pub extern "C" fn proxy_on_configure(_root_context_id: u32, _configuration_size: usize) -> u32 {
    1
}

/// 0: `Continue`.
#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_context_id: u32, _headers: usize, _end_of_stream: u32) -> u32 {
    0
}
