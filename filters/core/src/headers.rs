//! The request's headers as the host gave them, and the header namespace that is Tollgate's own.

/// The namespace of headers that only Tollgate may set. Client-supplied ones are stripped.
pub use tollgate_wire::{is_internal_header as is_internal, is_internal_header_bytes as is_internal_bytes, INTERNAL_HEADER_PREFIX};

use crate::hostmap::HeaderMap;

/// The request's headers as the host gave them: names lowercase, values raw bytes. A value that
/// is not UTF-8 reads as absent through [`RequestHeaders::get`] — the filter never guesses at
/// bytes — and the places where absence is not safe (the key, the path, an Idempotency-Key)
/// ask [`RequestHeaders::has_non_utf8`] or read the bytes and refuse the request.
///
/// A client's headers in Tollgate's namespace ([`INTERNAL_HEADER_PREFIX`]) are set apart when
/// the headers are read: nothing reads them (not a route's header match, not a cache key), and
/// [`RequestHeaders::internal`] names them for the filter to remove from the request.
#[derive(Debug, Clone, Default)]
pub struct RequestHeaders {
    map: HeaderMap,
    internal: Vec<String>,
}

impl RequestHeaders {
    pub fn new(map: HeaderMap) -> RequestHeaders {
        // the usual request sends none, and then nothing is allocated
        let internal = map.iter().filter(|(n, _)| is_internal_bytes(n)).map(|(n, _)| String::from_utf8_lossy(n).into_owned()).collect();
        RequestHeaders { map, internal }
    }

    /// Every value of `name` as sent, outside Tollgate's namespace.
    fn values<'s, 'n>(&'s self, name: &'n str) -> impl Iterator<Item = &'s [u8]> + use<'s, 'n> {
        let ours = is_internal(name);
        self.map.iter().filter(move |(n, _)| !ours && *n == name.as_bytes()).map(|(_, v)| v)
    }

    /// The first value of `name` when it is UTF-8; `None` when absent or not UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values(name).next().and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Every value of `name`, as sent.
    pub fn all_raw(&self, name: &str) -> Vec<&[u8]> {
        self.values(name).collect()
    }

    /// Whether some value of `name` is not UTF-8.
    pub fn has_non_utf8(&self, name: &str) -> bool {
        self.values(name).any(|v| std::str::from_utf8(v).is_err())
    }

    /// The names the client sent in Tollgate's namespace ([`INTERNAL_HEADER_PREFIX`]): a client
    /// must never speak in it, so the filter removes them first.
    pub fn internal(&self) -> impl Iterator<Item = &str> {
        self.internal.iter().map(String::as_str)
    }
}

/// Checks a configured header name (`forwardHeaders`, a key source's header): a lowercase token,
/// outside Tollgate's namespace, not `authorization` (the bearer source reads that one).
pub fn check_header_name(name: &str) -> Result<(), String> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(format!("'{name}' is not a header name"));
    }
    if is_internal(name) {
        return Err(format!("'{name}' is in the internal {INTERNAL_HEADER_PREFIX}* namespace"));
    }
    if name == "authorization" {
        return Err("use the bearer source for the authorization header".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_clients_internal_headers_are_named_for_removal_and_never_read() {
        let h = RequestHeaders::new(HeaderMap::from_pairs(&[
            (":path", "/"),
            ("x-tollgate-plan", "gold"),
            ("X-Tollgate-Tenant", "evil"),
            ("x-tollgat", "not ours"),
            ("x-tollgate-plan", "gold2"),
        ]));
        assert_eq!(h.internal().collect::<Vec<_>>(), ["x-tollgate-plan", "X-Tollgate-Tenant", "x-tollgate-plan"]);
        assert_eq!(h.get("x-tollgate-plan"), None);
        assert!(h.all_raw("x-tollgate-plan").is_empty());
        assert_eq!((h.get(":path"), h.get("x-tollgat")), (Some("/"), Some("not ours")));
        assert!(!h.has_non_utf8("x-tollgate-plan"));
        let odd = RequestHeaders::new(HeaderMap::from_pairs(&[(&b"x-a"[..], &b"\xff"[..]), (&b"x-a"[..], &b"ok"[..])]));
        assert_eq!((odd.get("x-a"), odd.has_non_utf8("x-a"), odd.all_raw("x-a").len()), (None, true, 2));
        assert!(is_internal("X-TOLLGATE-x") && !is_internal("x-tollgat") && !is_internal(""));
        assert!(check_header_name("X-Tollgate-Plan").is_err());
    }
}
