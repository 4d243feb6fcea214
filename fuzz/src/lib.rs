//! The entry function of every fuzz target (docs/fuzzing.md). `filter` and `sidecar` are also
//! compiled, by `#[path]`, into the stable replay tests of the crates they exercise, so a
//! committed regression input runs through exactly the code the fuzzer ran.

pub mod filter;
pub mod sidecar;
