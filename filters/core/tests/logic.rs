//! The filter logic's tests (pure logic through `MockHost`, natively and on wasm32 under
//! wasm-bindgen-test), one file per area, built as **one** test binary per target: each test
//! binary of the release profile is linked with fat LTO, ~30 s natively and ~20 s for wasm32 apiece
//! on the 2-core machine, and these tests share no state but what each builds. `fuzz_regressions`
//! (native only) compiles the fuzz entry points in by path, relative to its own file. Run one area with
//! `cargo test --release -p tollgate-filter-core --test logic -- <area>::`.

mod batch;
mod breaker;
mod filter;
mod fuzz_regressions;
mod host_calls;
mod layers;
mod lease;
mod lease_burst;
mod models;
mod outcomes;
mod properties;
mod refunds;
mod responses;
mod routing;
mod usage;
mod worker;
