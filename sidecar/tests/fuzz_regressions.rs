//! Replays the fuzz targets of the sidecar's parsers on the stable toolchain (docs/fuzzing.md):
//! every input under `fuzz/regressions/<target>/` (each a crash the fuzzer found, now fixed) and
//! the committed, minimized corpus `fuzz/corpus/<target>/`, through the very entry functions the
//! fuzz targets call (`fuzz/src/sidecar.rs`, compiled in here by path). No server is needed.

#[path = "../../fuzz/src/sidecar.rs"]
mod entries;

#[path = "../../fuzz/src/replay.rs"]
mod replay;

/// Runs every committed input of `target` through `entry` (fuzz/src/replay.rs).
fn replay(target: &str, entry: fn(&[u8])) -> usize {
    replay::replay(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz"), target, entry)
}

#[test]
fn sidecar_bodies() {
    replay("sidecar_bodies", entries::sidecar_bodies);
}

#[test]
fn spool_lines() {
    replay("spool_lines", entries::spool_lines);
}

#[test]
fn sidecar_toml() {
    replay("sidecar_toml", entries::sidecar_toml);
}
