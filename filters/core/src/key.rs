//! Finding, hashing and stripping the API key.
//!
//! Invariants: the raw key leaves this module only inside [`RawKey`], which has no `Debug` or
//! `Display` and is consumed by [`RawKey::hash`]; and [`KeyPlan`] removes *every* configured
//! source from the request, not only the one the key was taken from, so a second copy of a key
//! never reaches the upstream either.

use crate::config::KeySource;
use sha2::{Digest, Sha256};

/// A raw API key. Deliberately not `Debug`/`Display`: it can only be hashed.
pub struct RawKey(String);

impl RawKey {
    /// The lowercase hex sha256 of the key: the only form that leaves the filter.
    pub fn hash(&self) -> String {
        hash_key(&self.0)
    }
}

/// Lowercase hex sha256 of `key`.
pub fn hash_key(key: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(key.as_bytes());
    let mut out = String::with_capacity(64);
    for b in digest.iter() {
        out.push(HEX[(b >> 4) as usize] as char);
        out.push(HEX[(b & 0xf) as usize] as char);
    }
    out
}

/// What to do to the request's key-bearing parts.
pub struct KeyPlan {
    /// The first key found, in source order.
    pub key: Option<RawKey>,
    /// Headers to remove (lowercase names) because they carry a key.
    pub remove_headers: Vec<String>,
    /// The new `:path` when a key query parameter was removed.
    pub new_path: Option<String>,
}

/// Looks for the key in `sources` (in order) and plans its removal from every source.
///
/// `header` returns a request header's value by lowercase name; `path` is the `:path`.
pub fn plan<'a>(sources: &[KeySource], header: impl Fn(&str) -> Option<&'a str>, path: &str) -> KeyPlan {
    let mut key = None;
    let mut remove_headers = Vec::new();
    let mut query_names: Vec<&str> = Vec::new();
    for source in sources {
        let found = match source {
            KeySource::Bearer => match header("authorization").and_then(bearer_token) {
                Some(token) => {
                    remove_headers.push("authorization".to_string());
                    Some(token.to_string())
                }
                None => None,
            },
            KeySource::Header { name } => match header(name) {
                Some(v) => {
                    remove_headers.push(name.clone());
                    non_empty(v.trim())
                }
                None => None,
            },
            KeySource::Query { name } => {
                query_names.push(name);
                query_param(path, name).and_then(|v| non_empty(&v).map(|s| s.to_string()))
            }
        };
        if key.is_none() {
            key = found.map(RawKey);
        }
    }
    let new_path = if query_names.is_empty() { None } else { remove_query_params(path, &query_names) };
    KeyPlan { key, remove_headers, new_path }
}

fn non_empty(s: &str) -> Option<String> {
    if s.is_empty() {
        None
    } else {
        Some(s.to_string())
    }
}

/// The token of an `Authorization: Bearer <token>` value (scheme case-insensitive).
pub fn bearer_token(value: &str) -> Option<&str> {
    let value = value.trim();
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim();
    if token.is_empty() {
        None
    } else {
        Some(token)
    }
}

/// The percent-decoded value of the first query parameter `name` in `path`.
pub fn query_param(path: &str, name: &str) -> Option<String> {
    let query = path.split_once('?')?.1;
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if percent_decode(k) == name {
            Some(percent_decode(v))
        } else {
            None
        }
    })
}

/// `path` without the query parameters named in `names`, or `None` when none was present.
pub fn remove_query_params(path: &str, names: &[&str]) -> Option<String> {
    let (base, query) = path.split_once('?')?;
    let (query, fragment) = match query.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (query, None),
    };
    let mut removed = false;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let k = pair.split_once('=').map_or(*pair, |(k, _)| k);
            let drop = names.iter().any(|n| percent_decode(k) == *n);
            removed |= drop;
            !drop
        })
        .collect();
    if !removed {
        return None;
    }
    let mut out = base.to_string();
    let kept: Vec<&str> = kept.into_iter().filter(|p| !p.is_empty()).collect();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    Some(out)
}

/// Decodes `%XX` escapes and `+` (as space); invalid escapes are kept literally.
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match (hex_val(bytes[i + 1]), hex_val(bytes[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push(h << 4 | l);
                        i += 3;
                        continue;
                    }
                    _ => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn sources() -> Vec<KeySource> {
        vec![
            KeySource::Bearer,
            KeySource::Header { name: "x-api-key".into() },
            KeySource::Query { name: "api_key".into() },
        ]
    }

    fn headers<'a>(h: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<&'a str> {
        move |name| h.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    #[test]
    fn sha256_hex_of_known_vector() {
        assert_eq!(hash_key("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn bearer_wins_and_every_source_is_stripped() {
        let h = [("authorization", "Bearer k1"), ("x-api-key", "k2")];
        let p = plan(&sources(), headers(&h), "/v1/x?api_key=k3&a=1");
        assert_eq!(p.key.unwrap().hash(), hash_key("k1"));
        assert_eq!(p.remove_headers, vec!["authorization", "x-api-key"]);
        assert_eq!(p.new_path.as_deref(), Some("/v1/x?a=1"));
    }

    #[test]
    fn order_is_respected() {
        let h = [("x-api-key", "hk")];
        let p = plan(&sources(), headers(&h), "/?api_key=qk");
        assert_eq!(p.key.unwrap().hash(), hash_key("hk"));
        let p = plan(&sources(), headers(&[]), "/p?api_key=q%2Bk+1");
        assert_eq!(p.key.unwrap().hash(), hash_key("q+k 1"));
        assert_eq!(p.new_path.as_deref(), Some("/p"));
    }

    #[test]
    fn non_bearer_authorization_is_left_alone() {
        let h = [("authorization", "Basic dXNlcjpwYXNz")];
        let p = plan(&sources(), headers(&h), "/");
        assert!(p.key.is_none());
        assert!(p.remove_headers.is_empty());
        assert!(p.new_path.is_none());
    }

    #[test]
    fn empty_values_count_as_missing_but_are_still_stripped() {
        let h = [("authorization", "Bearer   "), ("x-api-key", " ")];
        let p = plan(&sources(), headers(&h), "/a?api_key=&b=2");
        assert!(p.key.is_none());
        assert_eq!(p.remove_headers, vec!["x-api-key"]);
        assert_eq!(p.new_path.as_deref(), Some("/a?b=2"));
    }

    #[test]
    fn query_removal_keeps_others_and_fragment() {
        assert_eq!(remove_query_params("/a?x=1&api_key=s&y=2#f", &["api_key"]).as_deref(), Some("/a?x=1&y=2#f"));
        assert_eq!(remove_query_params("/a?api_key=s&api_key=t", &["api_key"]).as_deref(), Some("/a"));
        assert_eq!(remove_query_params("/a?x=1", &["api_key"]), None);
        assert_eq!(remove_query_params("/a", &["api_key"]), None);
        assert_eq!(remove_query_params("/a?api%5Fkey=s", &["api_key"]).as_deref(), Some("/a"));
    }

    #[test]
    fn percent_decoding_is_lenient() {
        assert_eq!(percent_decode("a%20b"), "a b");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("%4"), "%4");
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc "), Some("abc"));
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Token abc"), None);
    }
}
