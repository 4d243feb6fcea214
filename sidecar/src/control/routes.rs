//! Routes: their validation, their order (lowest priority first, ties by id) and the table the
//! filter matches requests against (`tollgate_wire::routes`: host, exact path or prefix, method,
//! headers — the one matching rule, shared by both sides).

use super::model::{FailureMode, Route, Snapshot};
use crate::decision::routing::{RouteEffect, Routing};
use crate::keys::Id;
use sha2::{Digest, Sha256};
use tollgate_wire::routes::{HeaderRule, RouteFailureMode, RouteSpec, RouteTable};

/// The routes in matching order.
pub fn ordered(s: &Snapshot) -> Vec<&Route> {
    let mut v: Vec<&Route> = s.routes.values().collect();
    v.sort_by(|a, b| (a.priority, &a.id).cmp(&(b.priority, &b.id)));
    v
}

/// The routing table the filter gets (`GET /v1/routes`): the routes in matching order, in the
/// wire form, tagged with a digest of their content.
pub fn table(s: &Snapshot, version: u64) -> RouteTable {
    let routes: Vec<RouteSpec> = ordered(s)
        .into_iter()
        .map(|r| RouteSpec {
            id: r.id.clone(),
            host: r.matches.host.clone(),
            path: r.matches.path.clone(),
            path_prefix: r.matches.path_prefix.clone(),
            method: r.matches.method.clone(),
            headers: r
                .matches
                .headers
                .iter()
                .map(|h| HeaderRule { name: h.name.to_ascii_lowercase(), value: h.value.clone() })
                .collect(),
            cluster: r.cluster.clone(),
            product: r.product.clone(),
            failure_mode: r.failure_mode.map(|m| match m {
                FailureMode::Open => RouteFailureMode::Open,
                FailureMode::Closed => RouteFailureMode::Closed,
            }),
            cache_ttl_ms: r.cache_ttl.map(|d| d.as_millis() as u64).filter(|ms| *ms > 0),
            cache_key_headers: r.cache_key_headers.iter().map(|h| h.to_ascii_lowercase()).collect(),
            breaker: r.breaker.clone(),
            llm: r.llm,
        })
        .collect();
    let digest = Sha256::digest(serde_json::to_vec(&routes).unwrap_or_default());
    let etag = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    RouteTable { version, etag, routes }
}

/// A caching route's segment of its response-cache keys (decision 202): its id (cut to 51
/// characters) and 12 hex of a digest of its id, cluster and TTL. Answers stored under a route
/// are never served after its cluster or TTL changed (a route moved off a bad model, a TTL
/// set by mistake to 30 days and then lowered): the changed route has a new, empty namespace,
/// and the old entries expire on their own TTL.
fn cache_segment(id: &str, cluster: &str, ttl_ms: u64) -> Option<Id> {
    let digest = Sha256::digest(format!("{id}\0{cluster}\0{ttl_ms}"));
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    Id::parse(&format!("{}.{hex}", id.get(..51).unwrap_or(id)))
}

impl Routing {
    /// The routing of a validated snapshot, at configuration generation `version`.
    pub fn of(snapshot: &Snapshot, version: u64) -> Routing {
        let routes = snapshot
            .routes
            .values()
            .map(|r| {
                let cache = r
                    .cache_ttl
                    .map(|d| d.as_millis() as u64)
                    .filter(|ms| *ms > 0)
                    .and_then(|ms| cache_segment(&r.id, &r.cluster, ms).map(|segment| (segment, ms)));
                (r.id.clone(), RouteEffect { product: r.product.as_deref().and_then(Id::parse), plan: r.plan.clone(), cache, llm: r.llm })
            })
            .collect();
        let subscriptions = snapshot.tenants.values().map(|t| (t.id.clone(), t.products.iter().cloned().collect())).collect();
        Routing::new(table(snapshot, version), routes, subscriptions)
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{Change, Kind};
    use super::*;
    use serde_json::json;

    fn snapshot() -> Snapshot {
        let s = Snapshot::default().apply(&Change::Put(Kind::Products, json!({"id": "chat"}))).unwrap();
        let s = s
            .apply(&Change::Put(Kind::Routes, json!({"id": "chat", "match": {"path_prefix": "/v1/chat"}, "cluster": "llm_a", "product": "chat"})))
            .unwrap();
        let s = s
            .apply(&Change::Put(Kind::Routes, json!({"id": "embed", "match": {"path": "/v1/embed", "method": "POST"}, "cluster": "llm_b"})))
            .unwrap();
        s.apply(&Change::Put(
            Kind::Routes,
            json!({"id": "beta", "priority": 1, "match": {"host": "beta.example.com", "path_prefix": "/", "headers": [{"name": "X-Beta", "value": "1"}]}, "cluster": "beta"}),
        ))
        .unwrap()
    }

    fn find(t: &RouteTable, authority: &str, method: &str, path: &str, beta: bool) -> Option<String> {
        let header = |n: &str| (beta && n == "x-beta").then_some("1");
        let req = tollgate_wire::routes::RequestView { authority, method, path, header };
        t.find(&req).map(|r| r.id.clone())
    }

    #[test]
    fn the_table_is_ordered_by_priority_then_id() {
        let s = snapshot();
        let t = table(&s, 7);
        assert_eq!(t.version, 7);
        let ids: Vec<&str> = t.routes.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["beta", "chat", "embed"]);
        assert_eq!(t.routes[0].headers[0].name, "x-beta", "header names are lowercased for the filter");
        assert_eq!(find(&t, "a", "GET", "/v1/chat/completions?x=1", false).as_deref(), Some("chat"));
        assert_eq!(find(&t, "a", "POST", "/v1/embed", false).as_deref(), Some("embed"));
        assert_eq!(find(&t, "a", "GET", "/v1/embed", false), None);
        assert_eq!(find(&t, "beta.example.com:8080", "GET", "/v1/chat", true).as_deref(), Some("beta"));
        assert_eq!(find(&t, "BETA.example.com", "GET", "/v1/chat", false).as_deref(), Some("chat"));
    }

    /// Decision 202: a caching route's key segment changes with its cluster and TTL, not with
    /// what its answers do not depend on; a long id still makes a valid, distinct segment.
    #[test]
    fn the_cache_segment_follows_the_cluster_and_ttl() {
        let seg = |id: &str, cluster: &str, ttl: u64| cache_segment(id, cluster, ttl).unwrap().to_string();
        assert!(seg("chat", "llm_a", 60_000).starts_with("chat."));
        assert_eq!(seg("chat", "llm_a", 60_000), seg("chat", "llm_a", 60_000));
        assert_ne!(seg("chat", "llm_a", 60_000), seg("chat", "llm_b", 60_000));
        assert_ne!(seg("chat", "llm_a", 60_000), seg("chat", "llm_a", 1_000));
        let (a, b) = ("a".repeat(60) + "x", "a".repeat(60) + "y");
        assert!(seg(&a, "c", 1).len() <= 64);
        assert_ne!(seg(&a, "c", 1), seg(&b, "c", 1));
        let routing = Routing::of(&snapshot().apply(&Change::Put(Kind::Routes, json!({"id": "c", "cluster": "x", "cache_ttl": "30s"}))).unwrap(), 1);
        assert_eq!(routing.cache("c"), Some((cache_segment("c", "x", 30_000).unwrap(), 30_000)));
    }

    #[test]
    fn the_etag_follows_the_content() {
        let s = snapshot();
        assert_eq!(table(&s, 1).etag, table(&s, 2).etag, "the version alone does not change the table");
        let moved = s
            .apply(&Change::Put(Kind::Routes, json!({"id": "embed", "match": {"path": "/v1/embed"}, "cluster": "llm_c"})))
            .unwrap();
        assert_ne!(table(&s, 1).etag, table(&moved, 1).etag);
        assert_eq!(table(&s, 1).etag.len(), 24);
    }

    #[test]
    fn bad_routes_name_the_field() {
        let s = snapshot();
        let put = |v| s.apply(&Change::Put(Kind::Routes, v)).unwrap_err().field;
        assert_eq!(put(json!({"id": "r", "match": {"path": "/a", "path_prefix": "/"}, "cluster": "c"})), "routes.r.match.path");
        assert_eq!(put(json!({"id": "r", "match": {"path_prefix": "a"}, "cluster": "c"})), "routes.r.match.path_prefix");
        // decision 204: a port in the host never matched (the request's is not compared)
        assert_eq!(put(json!({"id": "r", "match": {"host": "api.example.com:443"}, "cluster": "c"})), "routes.r.match.host");
        assert!(s.apply(&Change::Put(Kind::Routes, json!({"id": "r", "match": {"host": "[::1]"}, "cluster": "c"}))).is_ok());
        assert_eq!(put(json!({"id": "r", "match": {"method": "get"}, "cluster": "c"})), "routes.r.match.method");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "product": "nope"})), "routes.r.product");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "plan": "nope"})), "routes.r.plan");
        assert_eq!(put(json!({"id": "r", "cluster": "a b"})), "routes.r.cluster");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "cache_key_headers": ["a b"]})), "routes.r.cache_key_headers[0]");
        // Tollgate's own namespace: a client's are removed, so a rule on one could never hold
        assert_eq!(put(json!({"id": "r", "cluster": "c", "cache_key_headers": ["X-Tollgate-Plan"]})), "routes.r.cache_key_headers[0]");
        let rule = json!({"id": "r", "cluster": "c", "match": {"headers": [{"name": "x-tollgate-tenant", "value": "acme"}]}});
        assert_eq!(put(rule), "routes.r.match.headers[0].name");
        assert_eq!(put(json!({"id": "r"})), "cluster");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "match": {"hots": "x"}})), "hots");
    }
}
