//! The functional tests (real Envoy, filter, sidecar, Redis, broker, PostgreSQL), one file per
//! area, built as **one** test binary: each test binary of the release profile is linked with
//! fat LTO, about 30 s apiece on the 2-core machine, so eighteen binaries cost CI minutes that one
//! does not (`autotests = false` in tests/Cargo.toml). `./build.sh test` runs it area by area
//! (`-- <area>::`), as the eighteen binaries ran, so an area's tests share the machine only with
//! each other: the load-sensitive ones (leases, exactness) never run beside another area's
//! heavy one. Run one area with `cargo test --release -p tollgate-tests --test functional -- <area>::`.

mod admin_faults;
mod alerts;
mod auth;
mod batching;
mod breaker;
mod cache;
mod config;
mod console;
mod config_faults;
mod exactness;
mod faults;
mod hostile;
mod key_lifecycle;
mod key_pages;
mod key_scopes;
mod leases;
mod limits;
mod models;
mod llm;
mod observability;
mod openai_client;
mod plan_refs;
mod prices;
mod postgres_harness;
mod refunds;
mod revocation;
mod spend;
mod streams;
mod topologies;
mod transport;
mod trust;
mod usage;
