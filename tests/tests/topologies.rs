//! The whole gateway on the other Redis topologies: two replicas (sidecar + Envoy each) on a
//! 3-master Redis Cluster, and through Sentinel (master, replica, three sentinels). Keys issued
//! by the CLI work on both replicas, an exact limit holds across them, a revocation applies.

use std::time::Duration;
use tollgate_tests::{get, poll_until, Gateway, Topology};

/// Two replicas on `topology`, plan `p` with 4 requests an hour.
fn exercise(topology: Topology) {
    let g = Gateway::builder()
        .redis(topology)
        .sidecar_toml("[[plans.p.limits]]\nname = \"total\"\nalgorithm = \"sliding_log\"\nlimit = 4\nwindow = \"1h\"\n")
        .replicas(2)
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let urls = [g.replica(0).envoy().url("/"), g.replica(1).envoy().url("/")];
    let h = [("x-api-key", key.raw.as_str())];
    let statuses: Vec<u16> = (0..6).map(|i| get(&urls[i % 2], &h).status).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429], "{topology:?}");
    assert_eq!(g.upstream().calls(), 4, "{topology:?}");
    g.replica(1).sidecar().revoke_key(&key.id);
    poll_until("the revocation on both replicas", Duration::from_secs(10), || {
        urls.iter().all(|u| get(u, &h).status == 401)
    });
}

#[test]
fn two_replicas_on_a_redis_cluster() {
    exercise(Topology::Cluster);
}

#[test]
fn two_replicas_through_sentinel() {
    exercise(Topology::Sentinel);
}
