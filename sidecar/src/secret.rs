//! Secrets in the configuration (the filter secret, the admin token): a string that never shows
//! in a `Debug` print (`--check-config`, logs), and compared in constant time.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A secret setting. `Debug` prints `"<redacted>"` (or `""` when unset), never the value.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The value, for the one place that compares or sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `given` is this secret (never true for an unset one), in time independent of
    /// where they differ.
    pub fn matches(&self, given: &[u8]) -> bool {
        !self.0.is_empty() && same(given, self.0.as_bytes())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("\"\"")
        } else {
            f.write_str("\"<redacted>\"")
        }
    }
}

/// Constant-time equality of equal-length inputs (a secret must not leak through timing; the
/// length alone may).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `s` can be a secret sent in an HTTP header: 16 to 256 visible ASCII characters.
pub fn well_formed(s: &str) -> bool {
    (16..=256).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic())
}

/// The password of a URL's userinfo replaced by `<redacted>` (`redis://:pw@h/` →
/// `redis://:<redacted>@h/`); other URLs unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let (authority, tail) = match rest.find(['/', '?', '#']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let Some((userinfo, host)) = authority.rsplit_once('@') else { return url.to_string() };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:<redacted>@{host}{tail}"),
        None => url.to_string(),
    }
}

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
pub fn hmac_sha256(key: &[u8], msg: &[&[u8]]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    for m in msg {
        inner.update(m);
    }
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(H[usize::from(b >> 4)] as char);
        s.push(H[usize::from(b & 15)] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints_and_matches_only_itself() {
        let s = Secret::new("abcdefghijklmnopqrstuvwxyz");
        assert_eq!(format!("{s:?}"), "\"<redacted>\"");
        assert_eq!(format!("{:?}", Secret::default()), "\"\"");
        assert!(s.matches(b"abcdefghijklmnopqrstuvwxyz"));
        assert!(!s.matches(b"abcdefghijklmnopqrstuvwxyZ"));
        assert!(!s.matches(b"abc"));
        assert!(!Secret::default().matches(b""), "an unset secret matches nothing");
        assert!(well_formed("0123456789abcdef"));
        assert!(!well_formed("short"));
        assert!(!well_formed("0123456789abcdef with space"));
    }

    #[test]
    fn url_passwords_are_redacted() {
        assert_eq!(redact_url("redis://:pw@h:1/0"), "redis://:<redacted>@h:1/0");
        assert_eq!(redact_url("postgres://u:p@w@h:5432/db?x=1"), "postgres://u:<redacted>@h:5432/db?x=1");
        assert_eq!(redact_url("redis://h:1/"), "redis://h:1/");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // test case 2
        let mac = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(hex(&mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // test case 6: a key longer than the block is hashed first
        let mac = hmac_sha256(&[0xaa; 131], &[b"Test Using Larger Than Block-Size Key - Hash Key First"]);
        assert_eq!(hex(&mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }
}
