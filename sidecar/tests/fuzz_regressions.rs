//! Replays the fuzz targets of the sidecar's parsers on the stable toolchain (docs/fuzzing.md):
//! every input under `fuzz/regressions/<target>/` (each a crash the fuzzer found, now fixed) and
//! the committed, minimized corpus `fuzz/corpus/<target>/`, through the very entry functions the
//! fuzz targets call (`fuzz/src/sidecar.rs`, compiled in here by path). No server is needed.

#[path = "../../fuzz/src/sidecar.rs"]
mod entries;

use std::path::Path;

/// Runs every regression and corpus input of `target` through `entry`; returns how many ran.
fn replay(target: &str, entry: fn(&[u8])) -> usize {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut ran = 0;
    for dir in ["regressions", "corpus"] {
        let Ok(files) = std::fs::read_dir(fuzz.join(dir).join(target)) else { continue };
        for file in files {
            let path = file.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| entry(&data));
            assert!(outcome.is_ok(), "{target}: {} fails again", path.display());
            ran += 1;
        }
    }
    assert!(ran > 0, "{target}: no committed corpus under fuzz/corpus/{target}");
    ran
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
