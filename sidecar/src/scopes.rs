//! Per-key scopes (issue 43 item 1): what a key may reach — routes, API products, methods — and
//! from where (client networks), checked by the sidecar's decision before any upstream call (403
//! `key_scope`); and the models it may ask for on LLM routes (issue 42 item 4: 403
//! `model_not_allowed`, checked with its plan's model policy, [`crate::models`]). Pure: parsing,
//! the Redis field form, the check.
//!
//! Invariant (decision 334): an answer the filter may reuse without asking (a cached allow, a
//! lease) is reused only for requests its cache key covers — the key's hash and the route. So a
//! route or product scope is safe with reuse (the product follows from the route), while a key
//! with a method or network scope gets answers that are never reused ([`KeyScopes::reusable`]);
//! nor does a key with models: its model is read from the body, which a reused answer does not
//! wait for (decision 306).

use crate::keys::Id;
use crate::models::ModelPattern;
use std::net::IpAddr;

/// The most entries of one scope list.
pub const MAX_ENTRIES: usize = 64;
/// The longest label, in characters.
pub const MAX_LABEL_CHARS: usize = 128;

const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"];

/// A client network: an address and a prefix length (`10.0.0.0/8`, `2001:db8::/32`, or one
/// address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    pub fn parse(s: &str) -> Option<Network> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) if !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()) => (a, Some(p.parse::<u8>().ok()?)),
            Some(_) => return None,
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(Network { addr, prefix })
    }

    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts as its IPv4 one).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// What a key may reach; an empty list restricts nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyScopes {
    pub routes: Vec<Id>,
    pub products: Vec<Id>,
    /// Upper-case HTTP methods.
    pub methods: Vec<String>,
    pub networks: Vec<Network>,
    /// Models (names or `prefix*`) the key may ask for on LLM routes, within its plan's.
    pub models: Vec<ModelPattern>,
}

/// A scope list that cannot be read, naming its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadScope {
    pub field: &'static str,
    pub message: String,
}

fn bad(field: &'static str, message: impl Into<String>) -> BadScope {
    BadScope { field, message: message.into() }
}

/// What a request is judged on.
pub struct Asked<'a> {
    pub route: Option<&'a str>,
    pub product: Option<&'a str>,
    pub method: &'a str,
    /// The client address the gateway trusts (Envoy's downstream address: the peer, or the
    /// `X-Forwarded-For` entry `xff_num_trusted_hops` designates).
    pub client_ip: Option<&'a str>,
}

impl KeyScopes {
    /// Reads the lists as the admin API takes them (`{"routes": [..], "products": [..],
    /// "methods": [..], "networks": [..], "models": [..]}`), each entry checked; duplicates are
    /// dropped.
    pub fn from_lists(routes: &[String], products: &[String], methods: &[String], networks: &[String], models: &[String]) -> Result<KeyScopes, BadScope> {
        for (field, list) in [("scopes.routes", routes), ("scopes.products", products), ("scopes.methods", methods), ("scopes.networks", networks)] {
            if list.len() > MAX_ENTRIES {
                return Err(bad(field, format!("at most {MAX_ENTRIES} entries")));
            }
        }
        let ids = |field: &'static str, list: &[String]| -> Result<Vec<Id>, BadScope> {
            let mut out: Vec<Id> = list.iter().map(|s| Id::parse(s).ok_or_else(|| bad(field, format!("'{}' is not an id", s.escape_debug())))).collect::<Result<_, _>>()?;
            out.sort();
            out.dedup();
            Ok(out)
        };
        let mut m: Vec<String> = Vec::new();
        for x in methods {
            if !METHODS.contains(&x.as_str()) {
                return Err(bad("scopes.methods", format!("'{}' is not an upper-case HTTP method", x.escape_debug())));
            }
            if !m.contains(x) {
                m.push(x.clone());
            }
        }
        let mut n: Vec<Network> = Vec::new();
        for x in networks {
            let net = Network::parse(x).ok_or_else(|| bad("scopes.networks", format!("'{}' is not an address or a CIDR (e.g. 10.0.0.0/8)", x.escape_debug())))?;
            if !n.contains(&net) {
                n.push(net);
            }
        }
        let models = crate::models::parse_list(models, "scopes.models").map_err(|e| bad("scopes.models", format!("{}: {}", e.field, e.message)))?;
        Ok(KeyScopes { routes: ids("scopes.routes", routes)?, products: ids("scopes.products", products)?, methods: m, networks: n, models })
    }

    pub fn is_empty(&self) -> bool {
        self.routes.is_empty() && self.products.is_empty() && self.methods.is_empty() && self.networks.is_empty() && self.models.is_empty()
    }

    /// Whether an answer for this key may be reused by the filter (cached, or spent from a
    /// lease) for other requests of the same key and route: not when a method or a network
    /// decides, which the filter's reuse does not look at (decision 334), nor a model, which it
    /// does not wait for (decision 306).
    pub fn reusable(&self) -> bool {
        self.methods.is_empty() && self.networks.is_empty() && self.models.is_empty()
    }

    /// Why the request is outside the key's scopes, or `None` when it is inside.
    pub fn refusal(&self, a: &Asked<'_>) -> Option<String> {
        if !self.routes.is_empty() && !a.route.is_some_and(|r| self.routes.iter().any(|x| x.as_str() == r)) {
            return Some(match a.route {
                Some(r) => format!("this API key may not be used on the route '{r}'"),
                None => "this API key may only be used on its routes, and this request matched none".into(),
            });
        }
        if !self.products.is_empty() && !a.product.is_some_and(|p| self.products.iter().any(|x| x.as_str() == p)) {
            return Some(match a.product {
                Some(p) => format!("this API key may not be used for the API product '{p}'"),
                None => "this API key may only be used for its API products, and this route has none".into(),
            });
        }
        if !self.methods.is_empty() && !self.methods.iter().any(|m| m == a.method) {
            return Some(format!("this API key may not be used with the method {}", a.method.escape_debug()));
        }
        if !self.networks.is_empty() {
            let ip = a.client_ip.and_then(|s| s.parse::<IpAddr>().ok());
            if !ip.is_some_and(|ip| self.networks.iter().any(|n| n.contains(ip))) {
                return Some("this API key may not be used from this client address".into());
            }
        }
        None
    }

    /// The Redis hash fields (only the lists that restrict), comma-separated.
    pub fn to_fields(&self) -> Vec<(&'static str, String)> {
        let join = |v: Vec<String>| v.join(",");
        let mut f = Vec::new();
        for (name, list) in [
            ("scope_routes", self.routes.iter().map(Id::to_string).collect::<Vec<_>>()),
            ("scope_products", self.products.iter().map(Id::to_string).collect()),
            ("scope_methods", self.methods.clone()),
            ("scope_networks", self.networks.iter().map(Network::to_string).collect()),
            ("scope_models", self.models.iter().map(|m| m.as_str().to_string()).collect()),
        ] {
            if !list.is_empty() {
                f.push((name, join(list)));
            }
        }
        f
    }

    /// Every field name [`KeyScopes::to_fields`] may write (an update removes those it does not).
    pub const FIELDS: [&'static str; 5] = ["scope_routes", "scope_products", "scope_methods", "scope_networks", "scope_models"];

    /// Reads the fields back; `None` when one cannot be read (the record is then unreadable:
    /// a scope is never dropped silently).
    pub fn from_fields(get: impl Fn(&str) -> Option<String>) -> Option<KeyScopes> {
        let list = |name: &str| -> Vec<String> { get(name).filter(|s| !s.is_empty()).map(|s| s.split(',').map(str::to_string).collect()).unwrap_or_default() };
        KeyScopes::from_lists(&list("scope_routes"), &list("scope_products"), &list("scope_methods"), &list("scope_networks"), &list("scope_models")).ok()
    }

    /// The lists as JSON (what the admin API shows and PostgreSQL stores).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "routes": self.routes.iter().map(Id::as_str).collect::<Vec<_>>(),
            "products": self.products.iter().map(Id::as_str).collect::<Vec<_>>(),
            "methods": self.methods,
            "networks": self.networks.iter().map(Network::to_string).collect::<Vec<_>>(),
            "models": self.models.iter().map(ModelPattern::as_str).collect::<Vec<_>>(),
        })
    }

    /// Reads [`KeyScopes::to_json`]'s form (absent lists are empty; unknown fields refused).
    pub fn from_json(v: &serde_json::Value) -> Result<KeyScopes, BadScope> {
        let Some(obj) = v.as_object() else { return Err(bad("scopes", "an object of lists: routes, products, methods, networks, models")) };
        if let Some(k) = obj.keys().find(|k| !matches!(k.as_str(), "routes" | "products" | "methods" | "networks" | "models")) {
            return Err(bad("scopes", format!("unknown scope '{}' (routes, products, methods, networks, models)", k.escape_debug())));
        }
        let list = |name: &'static str, field: &'static str| -> Result<Vec<String>, BadScope> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => Ok(vec![]),
                Some(serde_json::Value::Array(items)) => items.iter().map(|i| i.as_str().map(str::to_string).ok_or_else(|| bad(field, "a list of strings"))).collect(),
                Some(_) => Err(bad(field, "a list of strings")),
            }
        };
        KeyScopes::from_lists(
            &list("routes", "scopes.routes")?,
            &list("products", "scopes.products")?,
            &list("methods", "scopes.methods")?,
            &list("networks", "scopes.networks")?,
            &list("models", "scopes.models")?,
        )
    }
}

/// Checks a label: at most [`MAX_LABEL_CHARS`] characters, no control character.
pub fn check_label(label: &str) -> Result<(), BadScope> {
    if label.chars().count() > MAX_LABEL_CHARS {
        return Err(bad("label", format!("at most {MAX_LABEL_CHARS} characters")));
    }
    if label.chars().any(char::is_control) {
        return Err(bad("label", "control characters are not allowed"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn networks_match_by_prefix_in_both_families() {
        let n = |x: &str| Network::parse(x).unwrap_or_else(|| panic!("{x}"));
        let ip = |x: &str| x.parse::<IpAddr>().unwrap();
        assert!(n("10.0.0.0/8").contains(ip("10.200.3.4")));
        assert!(!n("10.0.0.0/8").contains(ip("11.0.0.1")));
        assert!(n("10.0.0.0/8").contains(ip("::ffff:10.1.1.1")), "IPv4-mapped");
        assert!(n("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(n("127.0.0.1").contains(ip("127.0.0.1")) && !n("127.0.0.1").contains(ip("127.0.0.2")));
        assert!(n("2001:db8::/32").contains(ip("2001:db8:1::5")) && !n("2001:db8::/32").contains(ip("2001:db9::1")));
        assert!(!n("2001:db8::/32").contains(ip("10.0.0.1")));
        assert!(n("::/0").contains(ip("::1")));
        for bad in ["10.0.0.0/33", "::/129", "10.0.0/8", "10.0.0.0/", "10.0.0.0/-1", "x", "", "10.0.0.0/8/8", "10.0.0.0/0008"] {
            assert_eq!(Network::parse(bad), None, "{bad}");
        }
        assert_eq!(n("10.1.2.3/8").to_string(), "10.1.2.3/8");
    }

    #[test]
    fn a_request_outside_any_scope_is_refused_and_empty_scopes_refuse_nothing() {
        let scopes = KeyScopes::from_lists(&s(&["chat"]), &s(&["llm"]), &s(&["GET", "POST"]), &s(&["10.0.0.0/8"]), &[]).unwrap();
        let ok = Asked { route: Some("chat"), product: Some("llm"), method: "POST", client_ip: Some("10.1.1.1") };
        assert_eq!(scopes.refusal(&ok), None);
        for a in [
            Asked { route: Some("embed"), ..ok },
            Asked { route: None, ..ok },
            Asked { product: Some("other"), ..ok },
            Asked { product: None, ..ok },
            Asked { method: "DELETE", ..ok },
            Asked { method: "post", ..ok },
            Asked { client_ip: Some("192.168.0.1"), ..ok },
            Asked { client_ip: None, ..ok },
            Asked { client_ip: Some("not an ip"), ..ok },
        ] {
            assert!(scopes.refusal(&a).is_some());
        }
        let none = KeyScopes::default();
        assert_eq!(none.refusal(&Asked { route: None, product: None, method: "X", client_ip: None }), None);
        assert!(none.reusable() && none.is_empty());
        assert!(!scopes.reusable(), "a method or a network is not in the filter's cache key");
        assert!(KeyScopes::from_lists(&s(&["chat"]), &s(&["llm"]), &[], &[], &[]).unwrap().reusable());
        let models = KeyScopes::from_lists(&[], &[], &[], &[], &s(&["gpt-4o*"])).unwrap();
        assert!(!models.reusable() && !models.is_empty(), "a model is read from the body, which a reused answer does not wait for");
        assert_eq!(models.refusal(&Asked { route: None, product: None, method: "X", client_ip: None }), None, "models are judged with the plan's policy");
    }

    #[test]
    fn scopes_round_trip_through_redis_fields_and_json_and_bad_ones_name_their_field() {
        let scopes = KeyScopes::from_lists(&s(&["b", "a", "a"]), &[], &s(&["GET"]), &s(&["10.0.0.0/8", "::1"]), &s(&["gpt-4o*", "claude-3-haiku", "gpt-4o*"])).unwrap();
        assert_eq!(scopes.models.len(), 2, "deduplicated");
        assert_eq!(scopes.routes.len(), 2, "deduplicated");
        let fields: std::collections::HashMap<&str, String> = scopes.to_fields().into_iter().collect();
        assert_eq!(fields.get("scope_networks").map(String::as_str), Some("10.0.0.0/8,::1/128"));
        assert_eq!(fields.get("scope_models").map(String::as_str), Some("gpt-4o*,claude-3-haiku"));
        assert!(!fields.contains_key("scope_products"));
        assert_eq!(KeyScopes::from_fields(|n| fields.get(n).cloned()), Some(scopes.clone()));
        assert_eq!(KeyScopes::from_json(&scopes.to_json()), Ok(scopes));
        assert_eq!(KeyScopes::from_fields(|n| (n == "scope_methods").then(|| "GET,get".to_string())), None, "unreadable: never dropped");
        let field = |v: serde_json::Value| KeyScopes::from_json(&v).unwrap_err().field;
        assert_eq!(field(serde_json::json!({"methods": ["get"]})), "scopes.methods");
        assert_eq!(field(serde_json::json!({"networks": ["10.0.0.0/99"]})), "scopes.networks");
        assert_eq!(field(serde_json::json!({"routes": ["a b"]})), "scopes.routes");
        assert_eq!(field(serde_json::json!({"routes": "chat"})), "scopes.routes");
        assert_eq!(field(serde_json::json!({"hosts": []})), "scopes");
        assert_eq!(field(serde_json::json!({"models": ["gpt 4"]})), "scopes.models");
        assert_eq!(field(serde_json::json!({"models": vec!["m"; 257]})), "scopes.models");
        assert!(KeyScopes::from_json(&serde_json::json!({"models": vec!["m"; 256]})).is_ok(), "256 models, one after dropping duplicates");
        assert_eq!(field(serde_json::json!({"routes": vec!["r"; 65]})), "scopes.routes");
        assert!(check_label("CI deploy key — prod").is_ok());
        assert_eq!(check_label("a\nb").unwrap_err().field, "label");
        assert_eq!(check_label(&"x".repeat(129)).unwrap_err().field, "label");
    }
}
