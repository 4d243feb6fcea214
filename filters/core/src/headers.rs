//! The request's headers as the host gave them, and the header namespace that is Tollgate's own.

/// The namespace of headers that only Tollgate may set. Client-supplied ones are stripped.
pub use tollgate_wire::{is_internal_header as is_internal, INTERNAL_HEADER_PREFIX};

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
    pairs: Vec<(String, Vec<u8>)>,
    internal: Vec<String>,
}

impl RequestHeaders {
    pub fn new(mut pairs: Vec<(String, Vec<u8>)>) -> RequestHeaders {
        // in place: the usual request sends none, and then nothing is allocated or copied
        let internal = pairs.iter().filter(|(n, _)| is_internal(n)).map(|(n, _)| n.clone()).collect();
        pairs.retain(|(n, _)| !is_internal(n));
        RequestHeaders { pairs, internal }
    }

    /// The first value of `name` when it is UTF-8; `None` when absent or not UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs.iter().find(|(n, _)| n == name).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// Every value of `name`, as sent.
    pub fn all_raw(&self, name: &str) -> Vec<&[u8]> {
        self.pairs.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()).collect()
    }

    /// Whether some value of `name` is not UTF-8.
    pub fn has_non_utf8(&self, name: &str) -> bool {
        self.pairs.iter().any(|(n, v)| n == name && std::str::from_utf8(v).is_err())
    }

    /// Every header name outside Tollgate's namespace (repeated names repeat).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.pairs.iter().map(|(n, _)| n.as_str())
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
        let h = RequestHeaders::new(vec![
            (":path".into(), b"/".to_vec()),
            ("x-tollgate-plan".into(), b"gold".to_vec()),
            ("X-Tollgate-Tenant".into(), b"evil".to_vec()),
            ("x-tollgat".into(), b"not ours".to_vec()),
            ("x-tollgate-plan".into(), b"gold2".to_vec()),
        ]);
        assert_eq!(h.internal().collect::<Vec<_>>(), ["x-tollgate-plan", "X-Tollgate-Tenant", "x-tollgate-plan"]);
        assert_eq!(h.get("x-tollgate-plan"), None);
        assert!(h.all_raw("x-tollgate-plan").is_empty());
        assert_eq!(h.names().collect::<Vec<_>>(), [":path", "x-tollgat"]);
        assert!(is_internal("X-TOLLGATE-x") && !is_internal("x-tollgat") && !is_internal(""));
        assert!(check_header_name("X-Tollgate-Plan").is_err());
    }
}
