#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_fuzz::filter::filter_request(data));
