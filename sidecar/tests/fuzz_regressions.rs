//! Replays the fuzz targets of the sidecar's parsers on the stable toolchain (docs/fuzzing.md):
//! every input under `fuzz/regressions/<target>/` (each a crash the fuzzer found, now fixed) and
//! the committed, minimized corpus `fuzz/corpus/<target>/`, through the very entry functions the
//! fuzz targets call (`fuzz/src/sidecar.rs`, compiled in here by path). No server is needed.

#[path = "../../fuzz/src/sidecar.rs"]
mod entries;

#[macro_use]
#[path = "../../fuzz/src/replay.rs"]
mod replay;

replay_tests!("../fuzz": sidecar_bodies, spool_lines, sidecar_toml);
