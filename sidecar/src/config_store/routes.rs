//! Routes: their validation and the pure matching rule (host, exact path or prefix, method,
//! headers; lowest priority first, ties by id). The filter will run the same rule on the table
//! it keeps in shared data (issue 4's last part); the sidecar uses it for `/v1/routes/match`-style
//! diagnostics and tests.

use super::{check_id, invalid, Invalid, Route, Snapshot};

const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"];

/// Checks one route against the rest of the snapshot.
pub fn validate(id: &str, r: &Route, s: &Snapshot) -> Result<(), Invalid> {
    let f = format!("routes.{id}");
    check_id(&format!("{f}.id"), id)?;
    let m = &r.matches;
    if m.path.is_some() && m.path_prefix.is_some() {
        return Err(invalid(format!("{f}.match.path"), "give path or path_prefix, not both"));
    }
    for (name, p) in [("path", &m.path), ("path_prefix", &m.path_prefix)] {
        if p.as_ref().is_some_and(|p| !p.starts_with('/')) {
            return Err(invalid(format!("{f}.match.{name}"), "must start with '/'"));
        }
    }
    if m.host.as_ref().is_some_and(|h| h.is_empty() || h.contains(['/', ' '])) {
        return Err(invalid(format!("{f}.match.host"), "not a host name"));
    }
    if m.method.as_ref().is_some_and(|x| !METHODS.contains(&x.as_str())) {
        return Err(invalid(format!("{f}.match.method"), "an upper-case HTTP method"));
    }
    for (i, h) in m.headers.iter().enumerate() {
        if h.name.is_empty() || !h.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(invalid(format!("{f}.match.headers[{i}].name"), "not a header name"));
        }
    }
    // Envoy cluster names are free-form, but this one travels in a header: keep it plain.
    check_id(&format!("{f}.cluster"), &r.cluster)?;
    if let Some(p) = &r.product {
        if !s.products.contains_key(p) {
            return Err(invalid(format!("{f}.product"), format!("no product '{p}'")));
        }
    }
    if let Some(p) = &r.plan {
        if !s.plans.contains_key(p) {
            return Err(invalid(format!("{f}.plan"), format!("no plan '{p}'")));
        }
    }
    Ok(())
}

/// A request as routing sees it.
pub struct RequestView<'a> {
    pub host: &'a str,
    pub method: &'a str,
    /// The path, possibly with a query string.
    pub path: &'a str,
    /// Lower-case names.
    pub headers: &'a [(String, String)],
}

fn matches(r: &Route, req: &RequestView<'_>) -> bool {
    let m = &r.matches;
    let path = req.path.split('?').next().unwrap_or("");
    let host = req.host.rsplit_once(':').map_or(req.host, |(h, port)| if port.bytes().all(|b| b.is_ascii_digit()) { h } else { req.host });
    m.host.as_ref().is_none_or(|h| h.eq_ignore_ascii_case(host))
        && m.path.as_ref().is_none_or(|p| p == path)
        && m.path_prefix.as_ref().is_none_or(|p| path.starts_with(p.as_str()))
        && m.method.as_ref().is_none_or(|x| x == req.method)
        && m.headers.iter().all(|h| {
            let name = h.name.to_ascii_lowercase();
            req.headers.iter().any(|(n, v)| *n == name && h.value.as_ref().is_none_or(|want| want == v))
        })
}

/// The routes in matching order.
pub fn ordered(s: &Snapshot) -> Vec<&Route> {
    let mut v: Vec<&Route> = s.routes.values().collect();
    v.sort_by(|a, b| (a.priority, &a.id).cmp(&(b.priority, &b.id)));
    v
}

/// The first route (in [`ordered`] order) that the request matches.
pub fn find<'a>(routes: &[&'a Route], req: &RequestView<'_>) -> Option<&'a Route> {
    routes.iter().copied().find(|r| matches(r, req))
}

#[cfg(test)]
mod tests {
    use super::super::{Change, Kind};
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

    fn req<'a>(host: &'a str, method: &'a str, path: &'a str, headers: &'a [(String, String)]) -> RequestView<'a> {
        RequestView { host, method, path, headers }
    }

    #[test]
    fn first_match_by_priority_then_id() {
        let s = snapshot();
        let routes = ordered(&s);
        let none: Vec<(String, String)> = vec![];
        let beta = vec![("x-beta".to_string(), "1".to_string())];
        let id = |r: Option<&Route>| r.map(|r| r.id.clone());
        assert_eq!(id(find(&routes, &req("a", "GET", "/v1/chat/completions?x=1", &none))), Some("chat".into()));
        assert_eq!(id(find(&routes, &req("a", "POST", "/v1/embed", &none))), Some("embed".into()));
        assert_eq!(id(find(&routes, &req("a", "GET", "/v1/embed", &none))), None);
        assert_eq!(id(find(&routes, &req("a", "POST", "/v1/embed/x", &none))), None);
        assert_eq!(id(find(&routes, &req("beta.example.com:8080", "GET", "/v1/chat", &beta))), Some("beta".into()));
        assert_eq!(id(find(&routes, &req("BETA.example.com", "GET", "/v1/chat", &none))), Some("chat".into()));
    }

    #[test]
    fn bad_routes_name_the_field() {
        let s = snapshot();
        let put = |v| s.apply(&Change::Put(Kind::Routes, v)).unwrap_err().field;
        assert_eq!(put(json!({"id": "r", "match": {"path": "/a", "path_prefix": "/"}, "cluster": "c"})), "routes.r.match.path");
        assert_eq!(put(json!({"id": "r", "match": {"path_prefix": "a"}, "cluster": "c"})), "routes.r.match.path_prefix");
        assert_eq!(put(json!({"id": "r", "match": {"method": "get"}, "cluster": "c"})), "routes.r.match.method");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "product": "nope"})), "routes.r.product");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "plan": "nope"})), "routes.r.plan");
        assert_eq!(put(json!({"id": "r", "cluster": "a b"})), "routes.r.cluster");
        assert_eq!(put(json!({"id": "r"})), "cluster");
        assert_eq!(put(json!({"id": "r", "cluster": "c", "match": {"hots": "x"}})), "hots");
    }
}
