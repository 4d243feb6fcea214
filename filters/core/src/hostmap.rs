//! Decoding what the host hands over as raw bytes, without trusting it.
//!
//! Envoy serializes a header map for the proxy-wasm ABI as: the pair count (u32 little-endian),
//! then for every pair its name length and value length (u32 LE each), then every name and value
//! in order, each followed by a NUL byte. Header values are whatever the client or upstream sent:
//! a byte like 0xFF is legal there, so nothing here assumes UTF-8 — the filter decides per header
//! what a value that is not UTF-8 means (`crate::headers::RequestHeaders`). A malformed buffer
//! decodes to `None`, never to a panic.

/// A header map as the host serialized it, decoded in place: one buffer and the spans of its
/// names and values, so reading a request's headers allocates twice (the host's copy and the
/// spans), not once per name and value (issue 16).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    bytes: Vec<u8>,
    /// Per pair: where its name starts and ends, where its value starts and ends.
    spans: Vec<[u32; 4]>,
}

impl HeaderMap {
    /// Decodes a serialized map, or `None` when the buffer is malformed.
    pub fn parse(bytes: Vec<u8>) -> Option<HeaderMap> {
        if bytes.is_empty() {
            return Some(HeaderMap::default());
        }
        // every offset fits in a u32 below (a span is stored as four): a larger buffer is refused
        u32::try_from(bytes.len()).ok()?;
        let u32_at = |at: usize| -> Option<usize> {
            let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
            usize::try_from(u32::from_le_bytes(b)).ok()
        };
        let count = u32_at(0)?;
        // every pair needs 8 bytes of sizes and 2 NULs: a count the buffer cannot hold is malformed
        // (and must not size an allocation)
        if count > bytes.len() / 10 {
            return None;
        }
        let mut data = 4usize.checked_add(count.checked_mul(8)?)?;
        let mut spans = Vec::with_capacity(count);
        for i in 0..count {
            let name_len = u32_at(4 + i * 8)?;
            let value_len = u32_at(8 + i * 8)?;
            let name_end = data.checked_add(name_len)?;
            let value_start = name_end.checked_add(1)?;
            let value_end = value_start.checked_add(value_len)?;
            if value_end > bytes.len() {
                return None;
            }
            // in range of a buffer whose length fits a u32 (checked above)
            spans.push([data as u32, name_end as u32, value_start as u32, value_end as u32]);
            data = value_end.checked_add(1)?;
        }
        (data <= bytes.len()).then_some(HeaderMap { bytes, spans })
    }

    /// A map of these pairs, as the host would hand it over (for tests and the mock host; empty
    /// if they do not fit a map, 4 GiB).
    pub fn from_pairs<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> HeaderMap {
        HeaderMap::parse(serialize_pairs(pairs)).unwrap_or_default()
    }

    /// Every pair, in the host's order: names and values as bytes.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let b = &self.bytes;
        self.spans.iter().map(move |&[ns, ne, vs, ve]| (&b[ns as usize..ne as usize], &b[vs as usize..ve as usize]))
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }
}

/// The pairs of a serialized header map, or `None` when the buffer is malformed.
pub fn parse_pairs(bytes: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let map = HeaderMap::parse(bytes.to_vec())?;
    Some(map.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect())
}

/// Serializes pairs the way the host does (for tests, the mock host and fuzzing seeds).
pub fn serialize_pairs<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> Vec<u8> {
    let data: usize = pairs.iter().map(|(n, v)| n.as_ref().len() + v.as_ref().len() + 2).sum();
    let mut out = Vec::with_capacity(4 + pairs.len() * 8 + data);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (n, v) in pairs {
        out.extend_from_slice(&(n.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (n, v) in pairs {
        out.extend_from_slice(n.as_ref());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trips_any_bytes() {
        let pairs: Vec<(&[u8], &[u8])> = vec![(b":path", b"/a"), (b"user-agent", b"curl\xff"), (b"x-empty", b"")];
        let got = parse_pairs(&serialize_pairs(&pairs)).unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = pairs.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect();
        assert_eq!(got, want);
        assert_eq!(parse_pairs(&[]), Some(vec![]));
        assert_eq!(parse_pairs(&serialize_pairs::<&[u8], &[u8]>(&[])), Some(vec![]));
    }

    #[test]
    fn malformed_buffers_are_refused_not_panicked_on() {
        let good = serialize_pairs(&[(&b"a"[..], &b"b"[..]), (b"cc", b"dd")]);
        for cut in 0..good.len() {
            let r = parse_pairs(&good[..cut]);
            assert!(cut == 0 || r.is_none(), "a buffer cut at {cut} decoded: {r:?}");
        }
        // a huge count, huge lengths
        assert_eq!(parse_pairs(&[0xff, 0xff, 0xff, 0xff]), None);
        let mut lie = good.clone();
        lie[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse_pairs(&lie), None);
    }

    #[test]
    fn a_map_reads_its_pairs_in_place() {
        let pairs: Vec<(&[u8], &[u8])> = vec![(b":path", b"/a"), (b"x", b""), (b"", b"v\xff"), (b"x", b"2")];
        let map = HeaderMap::from_pairs(&pairs);
        assert_eq!(map.iter().collect::<Vec<_>>(), pairs);
        assert_eq!(map.len(), 4);
        assert!(HeaderMap::parse(Vec::new()).is_some_and(|m| m.is_empty()));
        // a NUL missing after the last value: the buffer is one byte short
        let mut short = serialize_pairs(&pairs);
        short.pop();
        assert_eq!(HeaderMap::parse(short), None);
    }
}
