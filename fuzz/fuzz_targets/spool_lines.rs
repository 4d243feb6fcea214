#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_fuzz::sidecar::spool_lines(data));
