//! The functional-test harness: RAII guards for real processes (Redis, the sidecar, Envoy,
//! PostgreSQL, a tansu broker, the billing consumer) and in-process servers (an echo upstream, a
//! flaky one, a black hole), each on its own free port, and the [`Gateway`] that puts them
//! together the way a test needs.
//!
//! Rules: readiness is polled with a deadline, never assumed after a sleep; every guard kills its
//! process on drop; when a test panics, each guard prints its process's log so the failure
//! explains itself. Binaries come from `TOLLGATE_*` variables (set by build.sh) or default to the
//! workspace's build outputs.
//!
//! Modules: [`process`] (binaries, ports, polling, the process guards), [`redis`] (single,
//! Cluster, Sentinel), [`sidecar`], [`envoy`] (options and templating), [`http`] (the client),
//! [`upstream`] (in-process servers), [`postgres`], [`broker`], [`billing`], [`fixtures`] (values
//! shared by tests and the bench), and [`gateway`].

pub mod billing;
/// A real Kafka-compatible broker (tansu) and a topic reader (usage tests).
pub mod broker;
pub mod console;
pub mod envoy;
pub mod fixtures;
pub mod gateway;
pub mod h2c;
pub mod http;
pub mod otlp;
pub mod postgres;
pub mod process;
/// A real Prometheus with Tollgate's rules (observability tests).
pub mod prometheus;
/// HTTP/1.1 over a raw socket, for bytes no client library sends (hostile-client tests).
pub mod raw;
pub mod redis;
pub mod relay;
pub mod sidecar;
pub mod upstream;
pub mod webhook;
pub mod webdriver;

pub use envoy::{render_template, sidecar_address_yaml, sidecar_protocol_yaml, Envoy, EnvoyOptions, SidecarTransport};
pub use gateway::{default_plugin, Gateway, GatewayBuilder, Replica, Topology};
pub use http::{admin_call, get, keyed_burst, post, send, Resp};
pub use process::{envoy_bin, filter_host, free_port, native_direct, poll_for, poll_until, python_bin, redis_server_bin, root, sidecar_bin, wasm_host_only, wasm_path, FilterHost, Proc, Service};
pub use redis::{Redis, RedisCluster, RedisSentinel};
pub use sidecar::{new_secret, sidecar_secret, sidecar_socket, IssuedKey, Sidecar, SECRET_ENV};
pub use upstream::echo::{self, Echoed};
pub use upstream::flaky::{self, start_flaky, Flaky};
pub use upstream::{start_black_hole, start_counting_echo, start_echo, InProcess, RunningUpstream, Upstream};
