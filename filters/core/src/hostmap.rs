//! Decoding what the host hands over as raw bytes, without trusting it.
//!
//! Envoy serializes a header map for the proxy-wasm ABI as: the pair count (u32 little-endian),
//! then for every pair its name length and value length (u32 LE each), then every name and value
//! in order, each followed by a NUL byte. Header values are whatever the client or upstream sent:
//! a byte like 0xFF is legal there, so nothing here assumes UTF-8 — the filter decides per header
//! what a value that is not UTF-8 means (`crate::headers::RequestHeaders`). A malformed buffer
//! decodes to `None`, never to a panic.

/// The pairs of a serialized header map, or `None` when the buffer is malformed.
pub fn parse_pairs(bytes: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
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
    let mut pairs = Vec::with_capacity(count);
    for i in 0..count {
        let name_len = u32_at(4 + i * 8)?;
        let value_len = u32_at(8 + i * 8)?;
        let name = bytes.get(data..data.checked_add(name_len)?)?.to_vec();
        data = data.checked_add(name_len)?.checked_add(1)?;
        let value = bytes.get(data..data.checked_add(value_len)?)?.to_vec();
        data = data.checked_add(value_len)?.checked_add(1)?;
        pairs.push((name, value));
    }
    (data <= bytes.len()).then_some(pairs)
}

/// Serializes pairs the way the host does (for tests and fuzzing seeds).
pub fn serialize_pairs(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (n, v) in pairs {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in pairs {
        out.extend_from_slice(n);
        out.push(0);
        out.extend_from_slice(v);
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
        assert_eq!(parse_pairs(&serialize_pairs(&[])), Some(vec![]));
    }

    #[test]
    fn malformed_buffers_are_refused_not_panicked_on() {
        let good = serialize_pairs(&[(b"a", b"b"), (b"cc", b"dd")]);
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
}
