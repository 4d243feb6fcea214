//! The sidecar's integration tests against real servers (redis-server, Redis Cluster and
//! Sentinel, tansu) and the replay of its fuzz inputs, one file per area, built as **one** test binary: every test binary of the
//! release profile is compiled and linked with fat LTO, about 85 s apiece on the 2-core machine,
//! so nine binaries cost CI minutes that one does not (`autotests = false` in
//! sidecar/Cargo.toml). `./build.sh test` runs it area by area (`-- <area>::`), as the nine
//! binaries ran. Run one area with
//! `cargo test --release -p tollgate-sidecar --test integration -- <area>::`.
//! `fuzz_regressions` compiles the fuzz entry points in by path (relative to its own file).
#![recursion_limit = "256"]

mod common;

mod fuzz_regressions;
mod leases;
mod limits;
mod redis_server;
mod refunds;
mod responses;
mod spend;
mod topologies;
mod unix_socket;
mod usage;
