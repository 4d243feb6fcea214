//! Finding, hashing and stripping the API key.
//!
//! Invariants: the raw key leaves this module only inside [`RawKey`], which has no `Debug` or
//! `Display` and is consumed by [`RawKey::hash`]; and [`KeyPlan`] removes *every* configured
//! source from the request, not only the one the key was taken from, so a second copy of a key
//! never reaches the upstream either.

use crate::headers::check_header_name;
use crate::settings::ConfigError;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Where the API key may be found, tried in the configured order (plugin configuration
/// `keySources`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum KeySource {
    /// `Authorization: Bearer <key>`.
    Bearer,
    /// A request header holding the key alone.
    Header { name: String },
    /// A query parameter holding the key (percent-decoded).
    Query { name: String },
}

/// The sources when none are configured: bearer, `x-api-key`, `api_key`.
pub fn default_sources() -> Vec<KeySource> {
    vec![
        KeySource::Bearer,
        KeySource::Header { name: "x-api-key".into() },
        KeySource::Query { name: "api_key".into() },
    ]
}

/// Validates `keySources`: at least one; header names lowercased and outside our namespace.
pub fn compile_sources(raw: Vec<KeySource>) -> Result<Vec<KeySource>, ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError("keySources: at least one source is required".into()));
    }
    let mut sources = Vec::with_capacity(raw.len());
    for (i, source) in raw.into_iter().enumerate() {
        sources.push(match source {
            KeySource::Bearer => KeySource::Bearer,
            KeySource::Header { name } => {
                let name = name.to_ascii_lowercase();
                check_header_name(&name).map_err(|e| ConfigError(format!("keySources[{i}].name: {e}")))?;
                KeySource::Header { name }
            }
            KeySource::Query { name } => {
                if name.is_empty() || name.contains(['&', '=', '#', '?']) {
                    return Err(ConfigError(format!("keySources[{i}].name: not a query parameter name")));
                }
                KeySource::Query { name }
            }
        });
    }
    Ok(sources)
}

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
    let digest = Sha256::digest(key.as_bytes());
    let mut out = String::with_capacity(64);
    crate::ids::push_hex(&mut out, &digest);
    out
}

/// What to do to the request's key-bearing parts.
pub struct KeyPlan {
    /// The key, when exactly one was sent (the same value in several sources counts as one).
    pub key: Option<RawKey>,
    /// Why the request's credentials cannot be used, when they cannot (answered with 400).
    pub problem: Option<KeyProblem>,
    /// Headers to remove (lowercase names) because they carry a key.
    pub remove_headers: Vec<String>,
    /// The new `:path` when a key query parameter was removed.
    pub new_path: Option<String>,
}

/// Credentials the filter refuses to guess about (every source is stripped all the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyProblem {
    /// A key-bearing header's value is not UTF-8: no key of ours looks like that.
    NotUtf8,
    /// Two different keys (in two sources, or a header sent twice): RFC 6750 §2 allows one
    /// method per request, and picking one would let the other reach the upstream unchecked.
    Conflicting,
}

/// Looks for the key in `sources` and plans its removal from every source.
///
/// `header` returns every value of a request header by lowercase name, as raw bytes (a client
/// may send any byte); `path` is the `:path`. Every configured source is stripped whatever is
/// found; a key is used only when one value was sent.
pub fn plan<'a>(sources: &[KeySource], header: impl Fn(&str) -> Vec<&'a [u8]>, path: &str) -> KeyPlan {
    let mut found: Vec<String> = Vec::new();
    let mut problem = None;
    let mut remove_headers = Vec::new();
    let mut query_names: Vec<&str> = Vec::new();
    for source in sources {
        match source {
            KeySource::Bearer => {
                let mut strip = false;
                for value in header("authorization") {
                    match bearer_credential(value) {
                        Credential::Token(Ok(token)) => {
                            strip = true;
                            found.push(token.to_string());
                        }
                        Credential::Token(Err(())) => {
                            strip = true;
                            problem = Some(KeyProblem::NotUtf8);
                        }
                        Credential::Empty => strip = true,
                        Credential::OtherScheme => {}
                    }
                }
                if strip {
                    remove_headers.push("authorization".to_string());
                }
            }
            KeySource::Header { name } => {
                let values = header(name);
                if !values.is_empty() {
                    remove_headers.push(name.clone());
                }
                for value in values {
                    match std::str::from_utf8(value) {
                        Ok(v) => found.extend(non_empty(v.trim())),
                        Err(_) => problem = Some(KeyProblem::NotUtf8),
                    }
                }
            }
            KeySource::Query { name } => {
                query_names.push(name);
                found.extend(query_params(path, name).into_iter().filter_map(|v| non_empty(&v)));
            }
        }
    }
    let new_path = if query_names.is_empty() { None } else { remove_query_params(path, &query_names) };
    found.dedup();
    if problem.is_none() && found.iter().any(|k| *k != found[0]) {
        problem = Some(KeyProblem::Conflicting);
    }
    let key = if problem.is_none() { found.into_iter().next().map(RawKey) } else { None };
    KeyPlan { key, problem, remove_headers, new_path }
}

fn non_empty(s: &str) -> Option<String> {
    if s.is_empty() {
        None
    } else {
        Some(s.to_string())
    }
}

/// What an `Authorization` value holds for the bearer source.
#[derive(Debug, PartialEq, Eq)]
enum Credential<'a> {
    /// `Bearer <token>`, with any case of the scheme and any whitespace around and between
    /// (spaces, tabs); `Err` when the token is not UTF-8.
    Token(Result<&'a str, ()>),
    /// The bearer scheme with no token: nothing to use, but stripped all the same.
    Empty,
    /// Another scheme (e.g. `Basic`): not ours, left for the upstream.
    OtherScheme,
}

fn bearer_credential(value: &[u8]) -> Credential<'_> {
    let value = value.trim_ascii();
    let scheme_end = value.iter().position(u8::is_ascii_whitespace).unwrap_or(value.len());
    let (scheme, rest) = value.split_at(scheme_end);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return Credential::OtherScheme;
    }
    match rest.trim_ascii() {
        [] => Credential::Empty,
        token => Credential::Token(std::str::from_utf8(token).map_err(|_| ())),
    }
}

/// Whether an `Authorization` value is in the bearer scheme (which the bearer source strips,
/// token or not), rather than a credential left for the upstream (`Basic …`).
pub fn is_bearer(value: &[u8]) -> bool {
    bearer_credential(value) != Credential::OtherScheme
}

/// The token of an `Authorization: Bearer <token>` value (scheme case-insensitive, any
/// whitespace between).
pub fn bearer_token(value: &str) -> Option<&str> {
    match bearer_credential(value.as_bytes()) {
        Credential::Token(Ok(t)) => Some(t),
        _ => None,
    }
}

/// The percent-decoded value of the first query parameter `name` in `path`.
pub fn query_param(path: &str, name: &str) -> Option<String> {
    query_params(path, name).into_iter().next()
}

/// The percent-decoded values of every query parameter `name` in `path`, in order.
pub fn query_params(path: &str, name: &str) -> Vec<String> {
    let Some((_, query)) = path.split_once('?') else { return Vec::new() };
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    query
        .split('&')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k) == name).then(|| percent_decode(v))
        })
        .collect()
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
    // an empty query is still written before a fragment holding a `?`, so that the new path
    // parses to the same parts ("/p?key=k#x?key=k2" -> "/p?#x?key=k2", not "/p#x?key=k2", whose
    // first `?` would start a query holding a key: found by fuzzing, `key_plan`)
    if !kept.is_empty() || fragment.is_some_and(|f| f.contains('?')) {
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

    fn headers<'a>(h: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Vec<&'a [u8]> {
        move |name| h.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.as_bytes()).collect()
    }

    #[test]
    fn sha256_hex_of_known_vector() {
        assert_eq!(hash_key("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn one_key_in_several_sources_is_used_and_every_source_is_stripped() {
        let h = [("authorization", "Bearer k1"), ("x-api-key", "k1")];
        let p = plan(&sources(), headers(&h), "/v1/x?api_key=k1&a=1");
        assert_eq!(p.key.unwrap().hash(), hash_key("k1"));
        assert_eq!(p.problem, None);
        assert_eq!(p.remove_headers, vec!["authorization", "x-api-key"]);
        assert_eq!(p.new_path.as_deref(), Some("/v1/x?a=1"));
    }

    #[test]
    fn different_keys_in_two_sources_are_refused_and_all_stripped() {
        let cases: [(&[(&str, &str)], &str); 4] = [
            (&[("authorization", "Bearer k1"), ("x-api-key", "k2")], "/"),
            (&[("x-api-key", "k1")], "/?api_key=k2"),
            (&[("x-api-key", "k1"), ("x-api-key", "k2")], "/"),
            (&[], "/?api_key=k1&api_key=k2"),
        ];
        for (h, path) in cases {
            let p = plan(&sources(), headers(h), path);
            assert!(p.key.is_none(), "{h:?} {path}");
            assert_eq!(p.problem, Some(KeyProblem::Conflicting), "{h:?} {path}");
        }
        let p = plan(&sources(), headers(&[("authorization", "Bearer k1"), ("x-api-key", "k2")]), "/?api_key=k3");
        assert_eq!(p.remove_headers, vec!["authorization", "x-api-key"]);
        assert_eq!(p.new_path.as_deref(), Some("/"));
    }

    #[test]
    fn a_key_that_is_not_utf8_is_refused_and_stripped() {
        let raw: &[u8] = b"tg_\xff";
        for (name, value) in [("x-api-key", raw.to_vec()), ("authorization", [b"Bearer ".as_slice(), raw].concat())] {
            let h = |n: &str| if n == name { vec![value.as_slice()] } else { vec![] };
            let p = plan(&sources(), h, "/");
            assert!(p.key.is_none());
            assert_eq!(p.problem, Some(KeyProblem::NotUtf8));
            assert_eq!(p.remove_headers, vec![name.to_string()]);
        }
        // not ours (another scheme): left alone, whatever its bytes
        let basic = [b"Basic ".as_slice(), raw].concat();
        let p = plan(&sources(), |n: &str| if n == "authorization" { vec![basic.as_slice()] } else { vec![] }, "/");
        assert_eq!((p.problem, p.remove_headers.len()), (None, 0));
    }

    #[test]
    fn order_is_respected() {
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
        assert_eq!(p.problem, None);
        assert_eq!(p.remove_headers, vec!["authorization", "x-api-key"]);
        assert_eq!(p.new_path.as_deref(), Some("/a?b=2"));
    }

    #[test]
    fn bearer_in_any_whitespace_form_is_found_and_stripped() {
        for v in ["Bearer\tk1", "bearer   k1", "BEARER \t k1 ", "\tBeArEr k1\t", "Bearer\t\tk1"] {
            let h = [("authorization", v)];
            let p = plan(&sources(), headers(&h), "/");
            assert_eq!(p.key.map(|k| k.hash()), Some(hash_key("k1")), "{v:?}");
            assert_eq!(p.remove_headers, vec!["authorization"], "{v:?}");
        }
        for v in ["Bearer", "bearer\t", " BEARER  "] {
            let p = plan(&sources(), headers(&[("authorization", v)]), "/");
            assert!(p.key.is_none(), "{v:?}");
            assert_eq!(p.remove_headers, vec!["authorization"], "{v:?}: a bare scheme is stripped too");
        }
    }

    #[test]
    fn query_removal_keeps_others_and_fragment() {
        assert_eq!(remove_query_params("/a?x=1&api_key=s&y=2#f", &["api_key"]).as_deref(), Some("/a?x=1&y=2#f"));
        assert_eq!(remove_query_params("/a?api_key=s&api_key=t", &["api_key"]).as_deref(), Some("/a"));
        assert_eq!(remove_query_params("/a?x=1", &["api_key"]), None);
        assert_eq!(remove_query_params("/a", &["api_key"]), None);
        assert_eq!(remove_query_params("/a?api%5Fkey=s", &["api_key"]).as_deref(), Some("/a"));
        assert_eq!(remove_query_params("/a?api_key=s#f", &["api_key"]).as_deref(), Some("/a#f"));
        // a `?` in the fragment never becomes the start of the query (fuzz/regressions/key_plan)
        let p = remove_query_params("/a?api_key=s#x?api_key=t", &["api_key"]).unwrap();
        assert_eq!(p, "/a?#x?api_key=t");
        assert!(query_params(&p, "api_key").is_empty());
    }

    #[test]
    fn percent_decoding_is_lenient() {
        // a lone or malformed escape stays as it was written
        for (raw, decoded) in [("a%20b", "a b"), ("100%", "100%"), ("%zz", "%zz"), ("%4", "%4")] {
            assert_eq!(percent_decode(raw), decoded, "{raw}");
        }
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc "), Some("abc"));
        assert_eq!(bearer_token("Bearer\tabc"), Some("abc"));
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Token abc"), None);
        assert_eq!(bearer_token("Bearerabc"), None);
    }
}
