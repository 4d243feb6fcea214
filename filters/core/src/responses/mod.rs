//! The response cache and Idempotency-Key replay in the filter (issue 7): what identifies a
//! request, which requests and responses qualify, and the per-worker queue of responses to store.
//!
//! - **Cache key**: sha256 over method, path, normalized query, the route's key headers and the
//!   body — JSON bodies canonicalized (object keys sorted, no insignificant whitespace, integral
//!   numbers written as integers: RFC 8785-like; [`canonical`]), so key order and whitespace do
//!   not matter; a body the canonical form would not keep whole (a key given twice, an integer
//!   beyond 64 bits) is keyed by its bytes (decision 210). Each field is length-prefixed, so no
//!   two different requests serialize alike.
//! - **Idempotency digest** (seed 002): the first 32 hex of sha256(METHOD + " " + path + JSON(body)),
//!   path with its query (the API key already stripped), JSON(body) the same canonical form.
//! - **Idempotency-Key** (IETF httpapi draft): an sf-string (`"…"`), or, leniently, a bare token;
//!   anything else is 400.
//! - A request is looked up in the cache unless its `Cache-Control` says `no-store`, `no-cache`
//!   or `private`, its method is not GET/HEAD/POST, or it carries an idempotency key. A response is
//!   stored only when 2xx (not 206), not `no-store`/`no-cache`/`private`, without `Set-Cookie`,
//!   with a `Vary` naming only the route's key headers, and within the size bound.
//!
//! Stored responses go into the worker's queue ([`queue::ResponseQueue`]) when the request ends
//! and are sent by the root context's tick as one `POST /v1/responses` per batch; a batch is sent
//! once (no retry), and the queue is bounded in items and bytes.

pub mod canonical;
pub mod claims;
pub mod queue;

pub use canonical::{canonical_body, canonical_json};

use crate::settings::{given, ConfigError};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tollgate_wire::responses::MAX_STORED_BODY;
use tollgate_wire::Header;

/// The response cache (issue 7, plugin configuration `responseCache`): routes with a `cache_ttl`
/// are looked up in the decision call and their successful responses stored off the request path.
/// Or Idempotency-Key replay (issue 7, seed 002; plugin configuration `idempotency`). Both store
/// responses, and are configured alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// The cache: honour routes' cache TTLs (off: no lookups, no stores, no `x-tollgate-cache`).
    /// Idempotency: honour `Idempotency-Key` on POST, PATCH, PUT and DELETE.
    pub enabled: bool,
    /// The cache: larger response bodies are not stored. Idempotency: a larger 2xx body is
    /// remembered without its body (status and headers are replayed).
    pub max_body_bytes: usize,
}

/// `responseCache` of the plugin configuration.
pub type ResponseCacheConfig = StoreConfig;
/// `idempotency` of the plugin configuration.
pub type IdempotencyConfig = StoreConfig;

impl StoreConfig {
    /// `responseCache` unless configured: on, bodies up to 256 KiB.
    pub const RESPONSE_CACHE: StoreConfig = StoreConfig { enabled: true, max_body_bytes: 256 * 1024 };
    /// `idempotency` unless configured: off, bodies up to 1 MiB.
    pub const IDEMPOTENCY: StoreConfig = StoreConfig { enabled: false, max_body_bytes: 1 << 20 };

    /// `raw` over `defaults`; `section` names it in errors.
    pub fn compile(raw: RawStore, defaults: StoreConfig, section: &str) -> Result<StoreConfig, ConfigError> {
        let max_body_bytes = raw.max_body_bytes.unwrap_or(defaults.max_body_bytes);
        if max_body_bytes == 0 || max_body_bytes > MAX_STORED_BODY {
            return Err(ConfigError(format!("{section}.maxBodyBytes: must be between 1 and {MAX_STORED_BODY}")));
        }
        Ok(StoreConfig { enabled: raw.enabled.unwrap_or(defaults.enabled), max_body_bytes })
    }
}

/// `responseCache` or `idempotency` as written in the plugin configuration.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawStore {
    #[serde(default, deserialize_with = "given")]
    enabled: Option<bool>,
    #[serde(default, deserialize_with = "given")]
    max_body_bytes: Option<usize>,
}

/// Methods whose responses the cache serves (the body is part of the key).
pub const CACHEABLE_METHODS: &[&str] = &["GET", "HEAD", "POST"];
/// Methods an `Idempotency-Key` applies to (the draft's non-idempotent methods and their kin);
/// safe methods are idempotent already.
pub const IDEMPOTENT_METHODS: &[&str] = &["POST", "PATCH", "PUT", "DELETE"];

/// Upper-cases the hex digits of percent escapes, decodes escapes of unreserved characters
/// (RFC 3986 6.2.2), drops empty parameters, and sorts parameters by name (stably: the order of
/// one name's values is kept, it may matter).
pub fn normalize_query(query: &str) -> String {
    let mut params: Vec<String> = query.split('&').filter(|p| !p.is_empty()).map(normalize_escapes).collect();
    params.sort_by(|a, b| a.split('=').next().cmp(&b.split('=').next()));
    params.join("&")
}

/// Works on bytes and replaces only ASCII by ASCII, so other characters (UTF-8) pass through
/// unchanged and the result is a fixed point (`normalize_query` is idempotent).
fn normalize_escapes(s: &str) -> String {
    let b = s.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                let c = (h * 16 + l) as u8;
                if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                    out.push(c);
                } else {
                    out.extend_from_slice(format!("%{c:02X}").as_bytes());
                }
                i += 3;
                continue;
            }
        }
        if b[i] == b'%' {
            // a `%` that starts no escape stands for itself: written as its escape, so that no
            // escape can form around it in a second pass ("%%341" -> "%2541", not "%41")
            out.extend_from_slice(b"%25");
        } else {
            out.push(b[i]);
        }
        i += 1;
    }
    // only ASCII was put in place of ASCII: still UTF-8
    String::from_utf8(out).unwrap_or_default()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// The response-cache key of a request: lowercase hex sha256. `path` may carry a query string;
/// `headers` are the route's key headers with their values (absent ones as `None`), in any order;
/// `body` is [`canonical_body`]'s output.
pub fn cache_key(method: &str, path: &str, headers: &[(String, Option<String>)], body: &[u8]) -> String {
    let (p, q) = path.split_once('?').unwrap_or((path, ""));
    let p = p.split('#').next().unwrap_or(p);
    let mut h = Sha256::new();
    field(&mut h, b"tollgate-cache-v1");
    field(&mut h, method.as_bytes());
    field(&mut h, p.as_bytes());
    field(&mut h, normalize_query(q.split('#').next().unwrap_or(q)).as_bytes());
    let mut hs: Vec<&(String, Option<String>)> = headers.iter().collect();
    hs.sort();
    for (name, value) in hs {
        field(&mut h, name.to_ascii_lowercase().as_bytes());
        match value {
            Some(v) => field(&mut h, v.as_bytes()),
            None => field(&mut h, b"\0absent"),
        }
    }
    field(&mut h, body);
    hex(&h.finalize())
}

/// Seed 002's operation digest: the first 32 hex of sha256(METHOD + " " + path + JSON(body)).
pub fn request_digest(method: &str, path: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update(b" ");
    h.update(path.as_bytes());
    h.update(body);
    let mut d = hex(&h.finalize());
    d.truncate(32);
    d
}

/// The key of an `Idempotency-Key` header: an RFC 8941 string (`"…"`, with `\"` and `\\`
/// escapes), or a bare token of visible ASCII without `"`, `,`, `;` or `\`. 1–255 characters.
pub fn parse_idempotency_key(raw: &str) -> Result<String, &'static str> {
    let raw = raw.trim_matches(' ');
    let key = if let Some(rest) = raw.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = rest.chars();
        loop {
            match chars.next() {
                None => return Err("unterminated string"),
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some(c @ ('"' | '\\')) => out.push(c),
                    _ => return Err("bad escape"),
                },
                Some(c) if (' '..='~').contains(&c) => out.push(c),
                Some(_) => return Err("not printable ASCII"),
            }
        }
        if !chars.as_str().trim_matches(' ').is_empty() {
            return Err("text after the string");
        }
        out
    } else {
        if !raw.chars().all(|c| ('!'..='~').contains(&c) && !matches!(c, '"' | ',' | ';' | '\\')) {
            return Err("not a string");
        }
        raw.to_string()
    };
    match key.len() {
        0 => Err("empty"),
        1..=255 => Ok(key),
        _ => Err("longer than 255 characters"),
    }
}

/// Whether a `Cache-Control` value has one of the directives that keep a response out of a
/// shared cache (`no-store`, `no-cache`, `private`), or says it is stale at once (`max-age=0`,
/// `s-maxage=0`: decision 205 — such a response was stored and served for the route's whole TTL).
/// On a request, the same directives mean the client will not take a stored answer: bypass.
pub fn forbids_caching(cache_control: &str) -> bool {
    cache_control.split(',').any(|d| {
        let (name, value) = d.split_once('=').unwrap_or((d, ""));
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim().trim_matches('"'));
        matches!(name.as_str(), "no-store" | "no-cache" | "private")
            || (matches!(name.as_str(), "max-age" | "s-maxage") && value.parse::<u64>() == Ok(0))
    })
}

/// A response's own freshness left for a shared cache, in ms, when its `Cache-Control` says one
/// (decision 211): `s-maxage`, else `max-age` (RFC 9111 5.2.2.10: a shared cache takes
/// `s-maxage` first), less its `Age`. The entry then lives no longer than that nor than the
/// route's TTL; before, a `max-age=10` answer lived the route's whole TTL. `Some(0)`: stale
/// already, not stored. A value that is not a number is no lifetime (the route's TTL holds).
pub fn freshness_ms(headers: &[(String, String)]) -> Option<u64> {
    let directive = |wanted: &str| {
        headers.iter().filter(|(n, _)| n == "cache-control").flat_map(|(_, v)| v.split(',')).find_map(|d| {
            let (name, value) = d.split_once('=')?;
            let value = value.trim().trim_matches('"');
            (name.trim().eq_ignore_ascii_case(wanted) && !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit())).then(|| value.parse::<u64>().unwrap_or(u64::MAX))
        })
    };
    let lifetime = directive("s-maxage").or_else(|| directive("max-age"))?;
    let age = headers.iter().find(|(n, _)| n == "age").and_then(|(_, v)| v.trim().parse::<u64>().ok()).unwrap_or(0);
    Some(lifetime.saturating_sub(age).saturating_mul(1000))
}

/// Headers never stored: hop-by-hop, per-response, per-caller or the gateway's own — a request's
/// id and trace context, and an upstream's own rate-limit state for the caller it answered, are
/// not another caller's to see on a replay.
fn stored_header(name: &str) -> bool {
    !(name.starts_with(':')
        || name.starts_with("x-tollgate-")
        || name.starts_with("x-envoy-")
        || name.starts_with("proxy-")
        || name.starts_with("x-ratelimit-")
        || name.starts_with("anthropic-ratelimit-")
        || name.starts_with("x-b3-")
        || name.starts_with("x-amzn-")
        || matches!(
            name,
            "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "te"
                | "trailer"
                | "upgrade"
                | "content-length"
                | "date"
                | "server"
                | "set-cookie"
                | "age"
                | "via"
                | "ratelimit"
                | "ratelimit-policy"
                | "retry-after"
                | "idempotent-replayed"
                | "x-request-id"
                | "request-id"
                | "traceparent"
                | "tracestate"
                | "b3"
                | "ratelimit-limit"
                | "ratelimit-remaining"
                | "ratelimit-reset"
        ))
}

/// The upstream headers worth replaying.
pub fn storable_headers(headers: &[(String, String)]) -> Vec<Header> {
    headers.iter().filter(|(n, _)| stored_header(n)).map(|(n, v)| Header::new(n.as_str(), v.as_str())).collect()
}

/// Whether a response may enter the shared cache of a route keyed by `key_headers`. The request
/// of a response to store went upstream without `Accept-Encoding` (the filter removes it), so
/// `Vary: Accept-Encoding` (nginx's default) names the one variant every client takes — as long
/// as the response is not encoded anyway, which is never stored (decision 171).
pub fn cacheable_response(status: u16, headers: &[(String, String)], key_headers: &[String]) -> bool {
    if !(200..=299).contains(&status) || status == 206 {
        return false;
    }
    let varies_only_by_key = |v: &str| {
        v.split(',').map(|x| x.trim().to_ascii_lowercase()).all(|x| x.is_empty() || x == "accept-encoding" || key_headers.contains(&x))
    };
    headers.iter().all(|(n, v)| match n.as_str() {
        "cache-control" => !forbids_caching(v),
        "set-cookie" => false,
        "vary" => varies_only_by_key(v),
        "content-encoding" => v.trim().eq_ignore_ascii_case("identity"),
        _ => true,
    })
}

/// The response lookup a request asks for in its decision call, completed with the body: a
/// cache key or an idempotency digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupPlan {
    pub kind: LookupKind,
    /// The request's `content-type` (how its body is canonicalized).
    pub content_type: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupKind {
    /// The route caches: its key headers and their values.
    Cache { headers: Vec<(String, Option<String>)> },
    /// The client's idempotency key (unquoted).
    Idempotency { key: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn canon(s: &str) -> String {
        String::from_utf8(canonical_body(Some("application/json"), s.as_bytes())).unwrap()
    }

    #[test]
    fn canonical_json_ignores_key_order_and_whitespace() {
        assert_eq!(canon(r#"{ "b": 1, "a": [ {"y": true, "x": null} ] }"#), r#"{"a":[{"x":null,"y":true}],"b":1}"#);
        assert_eq!(canon(r#"{"a":[{"x":null,"y":true}],"b":1}"#), canon("{\n\t\"b\":1,\"a\":[{\"y\":true,\"x\":null}]}"));
        assert_eq!(canon(r#"{"n": 1.0, "m": 1e2, "f": 0.5, "s": "\u00e9\n"}"#), "{\"f\":0.5,\"m\":100,\"n\":1,\"s\":\"é\\n\"}");
        // RFC 8785 orders keys by UTF-16 code units
        assert_eq!(canon(r#"{"\ufb33": 2, "\ud83d\ude00": 1}"#), "{\"\u{1F600}\":1,\"\u{FB33}\":2}");
        // arrays keep their order; non-JSON bodies are the bytes as they are
        assert_ne!(canon("[1,2]"), canon("[2,1]"));
        assert_eq!(canonical_body(Some("text/plain"), b"a  b"), b"a  b");
        assert_eq!(canonical_body(Some("application/json"), b"{not json"), b"{not json");
        assert_eq!(canonical_body(None, br#"{"b":1, "a":2}"#), br#"{"a":2,"b":1}"#);
    }

    #[test]
    fn queries_are_normalized() {
        assert_eq!(normalize_query("b=2&a=1"), "a=1&b=2");
        assert_eq!(normalize_query("a=2&&b=1&a=1"), "a=2&a=1&b=1", "one name's values keep their order");
        assert_eq!(normalize_query("q=%7e%41%2f"), "q=~A%2F");
        // a `%` that starts no escape is written as one, so normalizing is idempotent
        assert_eq!(normalize_query("q=%zz%4"), "q=%25zz%254");
        assert_eq!(normalize_query("q=%%341"), "q=%2541");
        assert_eq!(normalize_query(&normalize_query("q=%%341")), "q=%2541");
        // other characters pass through as they are (not re-encoded byte by byte)
        assert_eq!(normalize_query("q=\u{e9}&p=%C3%A9"), "p=%C3%A9&q=\u{e9}");
        assert_eq!(normalize_query(""), "");
    }

    #[test]
    fn cache_keys_cover_method_path_query_headers_and_body() {
        let body = canon(r#"{"model":"m","messages":[1]}"#).into_bytes();
        let k = cache_key("POST", "/v1/chat?b=2&a=1", &[("x-user".into(), Some("u1".into()))], &body);
        assert_eq!(k.len(), 64);
        assert!(k.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        let same = cache_key("POST", "/v1/chat?a=1&b=2", &[("X-User".into(), Some("u1".into()))], &canon(r#"{ "messages":[1], "model":"m" }"#).into_bytes());
        assert_eq!(k, same);
        for other in [
            cache_key("PUT", "/v1/chat?b=2&a=1", &[("x-user".into(), Some("u1".into()))], &body),
            cache_key("POST", "/v1/chat2?b=2&a=1", &[("x-user".into(), Some("u1".into()))], &body),
            cache_key("POST", "/v1/chat?b=3&a=1", &[("x-user".into(), Some("u1".into()))], &body),
            cache_key("POST", "/v1/chat?b=2&a=1", &[("x-user".into(), Some("u2".into()))], &body),
            cache_key("POST", "/v1/chat?b=2&a=1", &[("x-user".into(), None)], &body),
            cache_key("POST", "/v1/chat?b=2&a=1", &[("x-user".into(), Some("".into()))], &body),
            cache_key("POST", "/v1/chat?b=2&a=1", &[("x-user".into(), Some("u1".into()))], b"{}"),
        ] {
            assert_ne!(k, other);
        }
        // fields are length-prefixed: moving bytes between fields changes the key
        assert_ne!(cache_key("GET", "/a", &[], b"b"), cache_key("GET", "/ab", &[], b""));
    }

    #[test]
    fn the_digest_is_seed_002s() {
        // sha256("POST /v1/orders{\"a\":1}") — computed independently with sha256sum
        assert_eq!(request_digest("POST", "/v1/orders", br#"{"a":1}"#), "b5a66a232290d59606e18a366ba779fa");
        assert_eq!(request_digest("POST", "/v1/orders", b"").len(), 32);
        assert_ne!(request_digest("POST", "/v1/orders", br#"{"a":1}"#), request_digest("POST", "/v1/orders", br#"{"a":2}"#));
    }

    #[test]
    fn idempotency_keys_follow_the_draft() {
        assert_eq!(parse_idempotency_key(r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#).unwrap(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
        assert_eq!(parse_idempotency_key(r#""a \"quoted\" \\ key""#).unwrap(), r#"a "quoted" \ key"#);
        assert_eq!(parse_idempotency_key("order-42").unwrap(), "order-42");
        for bad in ["", "\"\"", "\"open", "a b", "\"a\", \"b\"", "a,b", "\"\\x\"", "\"é\"", &"a".repeat(256)] {
            assert!(parse_idempotency_key(bad).is_err(), "{bad:?} must be refused");
        }
    }

    /// Decision 211: a response's own lifetime, `s-maxage` first, less its age.
    #[test]
    fn a_responses_own_freshness_is_read() {
        let h = |pairs: &[(&str, &str)]| pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect::<Vec<_>>();
        assert_eq!(freshness_ms(&h(&[("cache-control", "public, max-age=10")])), Some(10_000));
        assert_eq!(freshness_ms(&h(&[("cache-control", "max-age=600, s-maxage=\"5\"")])), Some(5_000));
        assert_eq!(freshness_ms(&h(&[("cache-control", "max-age=60"), ("age", "45")])), Some(15_000));
        assert_eq!(freshness_ms(&h(&[("cache-control", "max-age=60"), ("age", "90")])), Some(0), "stale already");
        assert_eq!(freshness_ms(&h(&[("cache-control", "public"), ("cache-control", "MAX-AGE=7")])), Some(7_000), "every Cache-Control line");
        assert_eq!(freshness_ms(&h(&[("cache-control", "public")])), None);
        assert_eq!(freshness_ms(&h(&[("cache-control", "max-age=soon")])), None);
        assert_eq!(freshness_ms(&h(&[("cache-control", "max-age=99999999999999999999999")])), Some(u64::MAX), "beyond u64: the route's TTL bounds it");
    }

    #[test]
    fn cache_control_and_response_rules() {
        assert!(forbids_caching("no-store"));
        assert!(forbids_caching("max-age=60, Private"));
        assert!(forbids_caching("no-cache=\"set-cookie\""));
        assert!(!forbids_caching("max-age=60, public"));
        // decision 205: stale at once
        assert!(forbids_caching("public, max-age=0"));
        assert!(forbids_caching("s-maxage=\"0\", max-age=600"));
        assert!(!forbids_caching("max-age=00x"));
        assert!(!forbids_caching("s-maxage=30"));
        let h = |pairs: &[(&str, &str)]| pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect::<Vec<_>>();
        let keys = vec!["x-user".to_string()];
        assert!(cacheable_response(200, &h(&[("content-type", "application/json")]), &keys));
        assert!(cacheable_response(201, &h(&[("vary", "X-User")]), &keys));
        assert!(!cacheable_response(206, &[], &keys));
        assert!(!cacheable_response(404, &[], &keys));
        assert!(!cacheable_response(200, &h(&[("cache-control", "no-store")]), &keys));
        assert!(!cacheable_response(200, &h(&[("set-cookie", "a=b")]), &keys));
        assert!(!cacheable_response(200, &h(&[("vary", "accept-language")]), &keys));
        assert!(!cacheable_response(200, &h(&[("vary", "*")]), &keys));
        // decision 171: the request went without Accept-Encoding, so the variant is the identity
        // one every client takes; an encoded response anyway is not stored
        assert!(cacheable_response(200, &h(&[("vary", "Accept-Encoding, x-user")]), &keys));
        assert!(!cacheable_response(200, &h(&[("vary", "Accept-Encoding"), ("content-encoding", "gzip")]), &keys));
        assert!(!cacheable_response(200, &h(&[("content-encoding", "br")]), &keys));
        let kept = storable_headers(&h(&[
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-length", "5"),
            ("date", "x"),
            ("set-cookie", "a"),
            ("x-tollgate-target", "t"),
            ("ratelimit", "r"),
            ("etag", "\"1\""),
            ("x-request-id", "another caller's"),
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ("x-ratelimit-remaining-tokens", "9"),
            ("anthropic-ratelimit-requests-remaining", "9"),
            ("x-b3-traceid", "1"),
            ("x-amzn-requestid", "1"),
        ]));
        assert_eq!(kept, vec![Header::new("content-type", "application/json"), Header::new("etag", "\"1\"")]);
    }
}
