//! The stable-toolchain replay of committed fuzz inputs, shared by the filter's and the sidecar's
//! `tests/fuzz_regressions.rs` (compiled into each by path; docs/fuzzing.md).

use std::path::Path;

/// Runs every input under `<fuzz>/regressions/<target>/` (each a crash the fuzzer found, now
/// fixed) and `<fuzz>/corpus/<target>/` through `entry`; returns how many ran. Fails when an input
/// panics again, or when the target has no committed input at all.
pub fn replay(fuzz: &Path, target: &str, entry: fn(&[u8])) -> usize {
    let mut ran = 0;
    for dir in ["regressions", "corpus"] {
        let Ok(files) = std::fs::read_dir(fuzz.join(dir).join(target)) else { continue };
        for file in files {
            let path = file.unwrap().path();
            // A fuzzer running on this corpus meanwhile replaces the inputs it reduces: one listed
            // a moment ago may be gone (skipped; anything else that cannot be read fails).
            let data = match std::fs::read(&path) {
                Ok(d) => d,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => panic!("{}: {e}", path.display()),
            };
            let outcome = std::panic::catch_unwind(|| entry(&data));
            assert!(outcome.is_ok(), "{target}: {} fails again", path.display());
            ran += 1;
        }
    }
    assert!(ran > 0, "{target}: no committed corpus under fuzz/corpus/{target}");
    ran
}

/// One `#[test]` per fuzz target named: each replays that target's committed inputs through the
/// entry function of the same name in the including crate's `entries` module. `$fuzz`: the fuzz
/// folder, relative to the including crate's manifest.
macro_rules! replay_tests {
    ($fuzz:literal: $($target:ident),+ $(,)?) => {$(
        #[test]
        fn $target() {
            let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join($fuzz);
            replay::replay(&fuzz, stringify!($target), entries::$target);
        }
    )+};
}
