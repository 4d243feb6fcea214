#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Replays the fuzz targets of the filter's parsers on the stable toolchain (docs/fuzzing.md):
//! every input under `fuzz/regressions/<target>/` (each a crash the fuzzer found, now fixed) and
//! the committed, minimized corpus `fuzz/corpus/<target>/`, through the very entry functions the
//! fuzz targets call (`fuzz/src/filter.rs`, compiled in here by path). Natively only: it reads
//! files.
#![cfg(not(target_arch = "wasm32"))]

#[path = "../../../fuzz/src/filter.rs"]
mod entries;

#[macro_use]
#[path = "../../../fuzz/src/replay.rs"]
mod replay;

replay_tests!("../../fuzz": key_plan, plugin_config, route_match, wire_answers, usage_tokens, cache_key, filter_request);
