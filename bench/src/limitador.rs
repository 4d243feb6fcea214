//! The peer (issue 16): Envoy's own C++ global rate limit filter (`envoy.filters.http.ratelimit`)
//! calling Kuadrant's Limitador over gRPC on every request, the placement the issue compares
//! Tollgate's exact limit with. `bench/limitador` is Envoy's rate limit service on Limitador's
//! library (its server is not published); `envoy/ratelimit_service.yaml.tmpl` sends it one
//! descriptor per request, the API key, and it counts one limit per key that is never reached:
//! `envoy+limitador-redis` on Limitador's Redis storage (a Redis round trip per request),
//! `envoy+limitador-redis-cached` on its cached Redis storage (counted in memory, flushed to
//! Redis in the background). Each service floats like the sidecars; its Envoy is pinned like
//! the others.

use std::process::Command;
use std::time::Duration;
use tollgate_tests::{free_port, get, poll_until, Envoy, EnvoyOptions, Proc, Redis};

pub struct Peer {
    pub name: &'static str,
    pub what: &'static str,
    pub envoy: Envoy,
    pub service: Proc,
    _dir: tempfile::TempDir,
}

const PEERS: [(&str, &str, &str); 2] = [
    ("envoy+limitador-redis", "redis", "Envoy's C++ ratelimit filter → Limitador (gRPC), Redis storage: one limit per key"),
    ("envoy+limitador-redis-cached", "redis_cached", "Envoy's C++ ratelimit filter → Limitador (gRPC), cached Redis storage"),
];

/// Limitador's namespace (the filter's `domain`).
const DOMAIN: &str = "bench";

/// Starts each selected peer: its rate limit service on `redis` and an Envoy in front of
/// `upstream_port` calling it. Checked before it is measured: a request with `key` passes, Envoy
/// counts the call's OK answer, and a new key's own counter reaches Redis (the service really
/// counts).
/// Left out, with a note, when `./build.sh bench` did not name the service's binary.
pub fn start(upstream_port: u16, redis: &Redis, key: &str, selected: impl Fn(&str) -> bool) -> Vec<Peer> {
    let mut peers = Vec::new();
    for (name, storage, what) in PEERS {
        if !selected(name) {
            continue;
        }
        let Some(bin) = std::env::var_os("TOLLGATE_BENCH_LIMITADOR_BIN") else {
            eprintln!("{name}: not measured (TOLLGATE_BENCH_LIMITADOR_BIN unset; `./build.sh bench` builds and names it)");
            continue;
        };
        let port = free_port();
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cmd = Command::new(bin);
        cmd.args(["--listen", &format!("127.0.0.1:{port}"), "--redis", &redis.url(), "--storage", storage]);
        cmd.args(["--namespace", DOMAIN, "--limit", "1000000000", "--seconds", "60", "--variable", "descriptors[0].key"]);
        let service = Proc::spawn(name, cmd, dir.path().join(format!("{name}.log")));
        // a whole line: "ready" is also in a bind error's "Address already in use"
        poll_until(&format!("{name}: its rate limit service"), Duration::from_secs(20), || service.log_text().lines().any(|l| l == "ready"));
        let envoy = Envoy::start(EnvoyOptions {
            cpu: Some(0),
            template: "envoy/ratelimit_service.yaml.tmpl",
            vars: vec![("RLS_PORT", port.to_string())],
            ..EnvoyOptions::new(upstream_port, 0)
        });
        // Polled: the first call (a new HTTP/2 connection, Limitador's first check) can miss the
        // 25 ms deadline, and the filter then answers 500 (failing closed).
        poll_until(&format!("{name}: Envoy and Limitador answering"), Duration::from_secs(20), || {
            get(&envoy.url("/"), &[("x-api-key", key)]).status == 200
        });
        assert!(envoy.counter("cluster.upstream.ratelimit.ok") >= 1, "{name}: Envoy's ratelimit filter did not call the service");
        // A new key's own counter reaches Redis: at once (redis) or with the next flush
        // (redis_cached). Limitador's key names hold the descriptor's value.
        let fresh = format!("{key}-{name}");
        assert_eq!(get(&envoy.url("/"), &[("x-api-key", &fresh)]).status, 200, "{name}: a second key is refused");
        let pattern = format!("namespace:{{{DOMAIN}}},counter:*{fresh}*");
        let found = || redis.connection().is_some_and(|mut c| !redis::cmd("KEYS").arg(&pattern).query::<Vec<String>>(&mut c).unwrap_or_default().is_empty());
        poll_until(&format!("{name}: the new key's counter in Redis"), Duration::from_secs(20), found);
        peers.push(Peer { name, what, envoy, service, _dir: dir });
    }
    peers
}

/// A process beside Envoy whose CPU a configuration also costs: a sidecar, a rate limit service.
pub trait Beside {
    fn pid(&self) -> Option<u32>;
}

impl Beside for tollgate_tests::Sidecar {
    fn pid(&self) -> Option<u32> {
        let service: &tollgate_tests::Service = self;
        service.pid()
    }
}

impl Beside for Proc {
    fn pid(&self) -> Option<u32> {
        Proc::pid(self)
    }
}
