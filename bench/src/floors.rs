//! The Wasm floors (issue 16): two filters that do nothing, each in the Tollgate Envoy template
//! in place of Tollgate's filter, measured beside it. `wasm-floor-sdk` is built on the proxy-wasm
//! Rust SDK like Tollgate's filter, so Envoy enters its VM as often per request (seven times);
//! `wasm-floor-minimal` is written on the ABI and exports only a context's creation and its
//! request headers (two entries). What a filter can cost at the least, with and without the
//! response and log phases (docs/benchmarks.md, "The Wasm floors").

use std::path::{Path, PathBuf};
use tollgate_tests::{get, Envoy, EnvoyOptions};

pub struct Floor {
    pub name: &'static str,
    pub what: &'static str,
    pub envoy: Envoy,
}

const FLOORS: [(&str, &str, &str); 2] = [
    ("wasm-floor-minimal", "TOLLGATE_FLOOR_MINIMAL_WASM", "a filter doing nothing, on the ABI: 2 entries into the VM per request"),
    ("wasm-floor-sdk", "TOLLGATE_FLOOR_SDK_WASM", "a filter doing nothing, on the Rust SDK: 7 entries into the VM per request"),
];

/// Starts an Envoy per floor from `base` (Tollgate's template and plugin configuration, which
/// the floors ignore), each pinned like the others. A floor whose module `./build.sh bench` did
/// not name (its variable unset) is left out, with a note.
pub fn start(base: &EnvoyOptions, selected: impl Fn(&str) -> bool) -> Vec<Floor> {
    let mut floors = Vec::new();
    for (name, var, what) in FLOORS {
        if !selected(name) {
            continue;
        }
        let Some(wasm) = std::env::var_os(var) else {
            eprintln!("{name}: not measured ({var} unset; `./build.sh bench` builds and names it)");
            continue;
        };
        let mut opts = base.clone();
        opts.vars.push(("WASM_PATH", std::fs::canonicalize(&wasm).expect("a floor's module").display().to_string()));
        let envoy = Envoy::start(opts);
        assert_eq!(get(&envoy.url("/"), &[]).status, 200, "{name}: Envoy with the floor filter is not answering");
        floors.push(Floor { name, what, envoy });
    }
    floors
}

/// The native host's floor (bench/floors/native, `TOLLGATE_FLOOR_NATIVE_MODULE`) where the
/// harness can load it: copied into `dir`/floor-native as `libtollgate_native.so`, the name
/// Envoy loads. `None`, with a note, when `./build.sh bench` did not name it.
pub fn native_module(dir: &Path) -> Option<PathBuf> {
    let Some(built) = std::env::var_os("TOLLGATE_FLOOR_NATIVE_MODULE") else {
        eprintln!("floor-native: not measured (TOLLGATE_FLOOR_NATIVE_MODULE unset; `./build.sh bench` builds and names it)");
        return None;
    };
    let copy = dir.join("floor-native-module").join("libtollgate_native.so");
    std::fs::create_dir_all(copy.parent()?).ok()?;
    std::fs::copy(&built, &copy).map_err(|e| eprintln!("floor-native: not measured (copying {}: {e})", Path::new(&built).display())).ok()?;
    Some(copy)
}
