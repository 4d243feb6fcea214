//! The routing table the sidecar serves to the filter (`GET /v1/routes`) and the one matching
//! rule both sides use.
//!
//! The filter keeps the table in Envoy shared data and matches every request against it locally
//! (no callout); the sidecar builds it from the configuration in force. A route matches on host,
//! exact path or path prefix, method and headers; the first route in table order that matches
//! wins (the sidecar orders by priority, then id). Invariant: the table is self-describing — a
//! filter needs nothing else to route.

use serde::{Deserialize, Serialize};

/// Path of the routing table on the sidecar. `If-None-Match: <etag>` → 304 when unchanged.
pub const ROUTES_PATH: &str = "/v1/routes";

/// A header a route requires: present (no `value`) or equal to `value`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRule {
    /// Lowercase header name.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// What the filter does when the sidecar cannot answer for a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteFailureMode {
    Open,
    Closed,
}

/// One route as the filter sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    pub id: String,
    /// Exact `:authority` without port, case-insensitive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Exact path (query string ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Path prefix (segment-unaware, like Envoy's `prefix`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Upper-case HTTP method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderRule>,
    /// The Envoy cluster the request is steered to.
    pub cluster: String,
    /// The API product the request counts as (usage events, subscriptions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// Overrides the filter's failure mode on this route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<RouteFailureMode>,
    /// Response-cache TTL in milliseconds (none: no caching on this route).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_ttl_ms: Option<u64>,
    /// Request headers that are part of the response-cache key (lowercase).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cache_key_headers: Vec<String>,
    /// The circuit-breaker target guarding this route (default: the target of its cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<String>,
    /// An LLM route (issue 42): the filter reads the model its requests ask for and its
    /// responses' models and tokens apart into their usage events.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub llm: bool,
}

/// The body of `GET /v1/routes`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteTable {
    /// The configuration generation (`cfg:routing:version`) the table was built at.
    #[serde(default)]
    pub version: u64,
    /// A digest of `routes`: equal tags, equal tables.
    #[serde(default)]
    pub etag: String,
    /// In matching order.
    #[serde(default)]
    pub routes: Vec<RouteSpec>,
}

/// A request as routing sees it.
pub struct RequestView<'a, H: Fn(&str) -> Option<&'a str>> {
    pub authority: &'a str,
    pub method: &'a str,
    /// The path, possibly with a query string.
    pub path: &'a str,
    /// A request header by lowercase name.
    pub header: H,
}

impl RouteSpec {
    /// Whether `req` takes this route.
    pub fn matches<'a, H: Fn(&str) -> Option<&'a str>>(&self, req: &RequestView<'a, H>) -> bool {
        self.matches_request_line(req)
            && self.headers.iter().all(|h| match (req.header)(&h.name) {
                Some(v) => h.value.as_ref().is_none_or(|want| want == v),
                None => false,
            })
    }

    /// Whether `req`'s host, path and method fit this route (its header rules aside).
    pub fn matches_request_line<'a, H: Fn(&str) -> Option<&'a str>>(&self, req: &RequestView<'a, H>) -> bool {
        let path = req.path.split(['?', '#']).next().unwrap_or("");
        let host = match req.authority.rsplit_once(':') {
            Some((h, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => req.authority,
        };
        self.host.as_ref().is_none_or(|h| h.eq_ignore_ascii_case(host))
            && self.path.as_ref().is_none_or(|p| p == path)
            && self.path_prefix.as_ref().is_none_or(|p| path.starts_with(p.as_str()))
            && self.method.as_ref().is_none_or(|m| m == req.method)
    }
}

impl RouteTable {
    /// The first route `req` matches.
    pub fn find<'a, H: Fn(&str) -> Option<&'a str>>(&self, req: &RequestView<'a, H>) -> Option<&RouteSpec> {
        self.routes.iter().find(|r| r.matches(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(id: &str) -> RouteSpec {
        RouteSpec {
            id: id.into(),
            host: None,
            path: None,
            path_prefix: None,
            method: None,
            headers: vec![],
            cluster: "c".into(),
            product: None,
            failure_mode: None,
            cache_ttl_ms: None,
            cache_key_headers: vec![],
            breaker: None,
            llm: false,
        }
    }

    fn find<'a>(t: &'a RouteTable, authority: &'a str, method: &'a str, path: &'a str, headers: &'a [(&'a str, &'a str)]) -> Option<&'a str> {
        let req = RequestView { authority, method, path, header: |n: &str| headers.iter().find(|(k, _)| *k == n).map(|(_, v)| *v) };
        t.find(&req).map(|r| r.id.as_str())
    }

    #[test]
    fn first_match_in_table_order() {
        let t = RouteTable {
            version: 3,
            etag: "x".into(),
            routes: vec![
                RouteSpec {
                    host: Some("beta.example.com".into()),
                    headers: vec![HeaderRule { name: "x-beta".into(), value: Some("1".into()) }],
                    ..route("beta")
                },
                RouteSpec { path_prefix: Some("/v1/chat".into()), ..route("chat") },
                RouteSpec { path: Some("/v1/embed".into()), method: Some("POST".into()), ..route("embed") },
                RouteSpec { headers: vec![HeaderRule { name: "x-any".into(), value: None }], ..route("any") },
            ],
        };
        assert_eq!(find(&t, "a", "GET", "/v1/chat/completions?x=1", &[]), Some("chat"));
        assert_eq!(find(&t, "a", "POST", "/v1/embed", &[]), Some("embed"));
        assert_eq!(find(&t, "a", "POST", "/v1/embed?q", &[]), Some("embed"));
        assert_eq!(find(&t, "a", "GET", "/v1/embed", &[]), None);
        assert_eq!(find(&t, "a", "POST", "/v1/embed/x", &[]), None);
        assert_eq!(find(&t, "BETA.example.com:8080", "GET", "/v1/chat", &[("x-beta", "1")]), Some("beta"));
        assert_eq!(find(&t, "beta.example.com", "GET", "/v1/chat", &[("x-beta", "2")]), Some("chat"));
        assert_eq!(find(&t, "a", "GET", "/other", &[("x-any", "")]), Some("any"));
        assert_eq!(find(&t, "a", "GET", "/other", &[]), None);
    }

    #[test]
    fn table_round_trips_and_tolerates_unknown_fields() {
        let t = RouteTable { version: 1, etag: "e".into(), routes: vec![RouteSpec { cache_ttl_ms: Some(5), ..route("r") }] };
        let s = serde_json::to_string(&t).unwrap();
        assert!(s.contains(r#""cacheTtlMs":5"#), "{s}");
        assert_eq!(serde_json::from_str::<RouteTable>(&s).unwrap(), t);
        let later = r#"{"version":2,"etag":"e","routes":[{"id":"r","cluster":"c","future":true}],"more":1}"#;
        assert_eq!(serde_json::from_str::<RouteTable>(later).unwrap().routes[0].id, "r");
    }
}
