#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Replays the fuzz targets of the filter's parsers on the stable toolchain (docs/fuzzing.md):
//! every input under `fuzz/regressions/<target>/` (each a crash the fuzzer found, now fixed) and
//! the committed, minimized corpus `fuzz/corpus/<target>/`, through the very entry functions the
//! fuzz targets call (`fuzz/src/filter.rs`, compiled in here by path). Natively only: it reads
//! files.
#![cfg(not(target_arch = "wasm32"))]

#[path = "../../../fuzz/src/filter.rs"]
mod entries;

#[path = "../../../fuzz/src/replay.rs"]
mod replay;

/// Runs every committed input of `target` through `entry` (fuzz/src/replay.rs).
fn replay(target: &str, entry: fn(&[u8])) -> usize {
    replay::replay(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz"), target, entry)
}

#[test]
fn key_plan() {
    replay("key_plan", entries::key_plan);
}

#[test]
fn plugin_config() {
    replay("plugin_config", entries::plugin_config);
}

#[test]
fn route_match() {
    replay("route_match", entries::route_match);
}

#[test]
fn wire_answers() {
    replay("wire_answers", entries::wire_answers);
}

#[test]
fn usage_tokens() {
    replay("usage_tokens", entries::usage_tokens);
}

#[test]
fn cache_key() {
    replay("cache_key", entries::cache_key);
}

#[test]
fn filter_request() {
    replay("filter_request", entries::filter_request);
}
