//! The canonical form of a JSON body, as it enters a response-cache key or an idempotency digest:
//! object keys sorted (by UTF-16 code units, as RFC 8785), no whitespace, integral floats within
//! ±2^53 written as integers — so that key order, whitespace and `1.0` against `1` do not make
//! two entries of one request.
//!
//! Invariant (decision 210): two bodies share a canonical form only when they say the same
//! thing. The parsed form loses what a document may still say: an integer beyond 64 bits and a
//! decimal beyond a double's precision become the nearest double (`18446744073709551616` and
//! `18446744073709551617` alike), and a key given twice keeps its last value (`{"a":1,"a":2}` is
//! `{"a":2}`). A body holding either is keyed by its bytes as they are: its own entry, never
//! another body's. (Those bytes never equal a canonical form: a canonical form holds no
//! repeated key and no number it does not keep exactly.)

use serde_json::{Number, Value};
use std::collections::BTreeSet;

/// Writes `v` in canonical form.
pub fn canonical_json(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json(&Value::String(k.clone()), out);
                out.push(b':');
                if let Some(x) = m.get(k) {
                    canonical_json(x, out);
                }
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(x, out);
            }
            out.push(b']');
        }
        Value::Number(n) => out.extend_from_slice(canonical_number(n).as_bytes()),
        other => write_json(other, out),
    }
}

/// A number as the canonical form writes it.
fn canonical_number(n: &Number) -> String {
    match n.as_f64() {
        Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 => format!("{}", f as i64),
        _ => n.to_string(),
    }
}

fn write_json(v: &Value, out: &mut Vec<u8>) {
    if let Ok(b) = serde_json::to_vec(v) {
        out.extend_from_slice(&b);
    }
}

/// The body as it enters a key or digest: the canonical JSON of a JSON body (by content type, or
/// when it parses) that the canonical form keeps whole, else the bytes as they are.
pub fn canonical_body(content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
    let looks_json = content_type.is_some_and(|c| c.contains("json")) || matches!(body.first(), Some(b'{' | b'['));
    if looks_json {
        if let Ok(v) = serde_json::from_slice::<Value>(body) {
            if kept_whole(body) {
                let mut out = Vec::with_capacity(body.len());
                canonical_json(&v, &mut out);
                return out;
            }
        }
    }
    body.to_vec()
}

/// Whether the canonical form of `json` (a document that parsed) says all it says: no object
/// repeats a key, and every number is written with its exact value.
pub fn kept_whole(json: &[u8]) -> bool {
    // one frame per open object (its keys so far, and whether a key comes next) or array
    let mut frames: Vec<Option<(BTreeSet<String>, bool)>> = Vec::new();
    let mut i = 0;
    while let Some(&b) = json.get(i) {
        match b {
            b'{' => frames.push(Some((BTreeSet::new(), true))),
            b'[' => frames.push(None),
            b'}' | b']' => drop(frames.pop()),
            b',' => {
                if let Some(Some((_, key_next))) = frames.last_mut() {
                    *key_next = true;
                }
            }
            b'"' => {
                let end = string_end(json, i + 1);
                if let Some(Some((keys, key_next))) = frames.last_mut() {
                    if *key_next {
                        *key_next = false;
                        let key = json.get(i..end).and_then(|s| serde_json::from_slice::<String>(s).ok());
                        if !key.is_some_and(|k| keys.insert(k)) {
                            return false;
                        }
                    }
                }
                i = end;
                continue;
            }
            b'-' | b'0'..=b'9' => {
                let end = i + json.get(i..).map_or(0, |s| s.iter().take_while(|c| matches!(**c, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')).count());
                if !number_kept(json.get(i..end).unwrap_or_default()) {
                    return false;
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    true
}

/// Where the string whose content starts at `from` ends (after its closing quote).
fn string_end(json: &[u8], mut from: usize) -> usize {
    while let Some(&b) = json.get(from) {
        from += 1;
        match b {
            b'\\' => from += 1,
            b'"' => return from,
            _ => {}
        }
    }
    from
}

/// Whether a number literal's canonical form has the literal's exact value.
fn number_kept(literal: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(literal) else { return false };
    let Ok(n) = serde_json::from_str::<Number>(text) else { return false };
    decimal(text).is_some_and(|d| Some(d) == decimal(&canonical_number(&n)))
}

/// A decimal literal's exact value as (negative, significant digits, exponent): the value is
/// the digits times ten to the exponent, without leading or trailing zeros (zero: no digits,
/// not negative). `None` when it is not a literal of that form.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.trim_start_matches('+').parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if !(int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())) {
        return None;
    }
    let all = format!("{int}{frac}");
    let digits = all.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    if trimmed.is_empty() {
        return Some((false, String::new(), 0));
    }
    let frac_len = i64::try_from(frac.len()).ok()?;
    let zeros = i64::try_from(digits.len() - trimmed.len()).ok()?;
    Some((negative, trimmed.to_string(), exponent.checked_sub(frac_len)?.checked_add(zeros)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn canon(s: &str) -> Vec<u8> {
        canonical_body(Some("application/json"), s.as_bytes())
    }

    #[test]
    fn decimals_are_compared_by_value() {
        assert_eq!(decimal("1.50e1"), decimal("15"));
        assert_eq!(decimal("0.0"), decimal("-0"));
        assert_eq!(decimal("100"), Some((false, "1".into(), 2)));
        assert_eq!(decimal("-0.025"), Some((true, "25".into(), -3)));
        assert_ne!(decimal("0.1"), decimal("0.10000000000000000001"));
    }

    /// Decision 210: bodies the parsed form would merge keep entries of their own.
    #[test]
    fn bodies_the_parsed_form_would_merge_stay_apart() {
        // integers beyond 64 bits
        let (a, b) = (r#"{"id":18446744073709551616}"#, r#"{"id":18446744073709551617}"#);
        assert_ne!(canon(a), canon(b));
        assert_eq!(canon(a), a.as_bytes(), "its bytes as they are");
        // a decimal beyond a double's precision
        assert_ne!(canon(r#"{"x":0.1}"#), canon(r#"{"x":0.10000000000000000001}"#));
        // a key given twice
        assert_ne!(canon(r#"{"a":1,"a":2}"#), canon(r#"{"a":2}"#));
        assert_ne!(canon(r#"{"a":1,"\u0061":2}"#), canon(r#"{"a":2}"#), "the same key, escaped");
        // what the canonical form keeps is still canonicalized
        assert_eq!(canon(r#"{"b":[{"a":1,"b":2},{"a":3}], "a": 1.0, "n": -9223372036854775808}"#), canon(r#"{"a":1,"n":-9223372036854775808,"b":[{"a":1,"b":2},{"a":3}]}"#));
        assert_eq!(canon(r#"{"x": 1.5e-7, "y": 1e300, "z": 18446744073709551615}"#), br#"{"x":1.5e-7,"y":1e+300,"z":18446744073709551615}"#);
        assert_eq!(canon(r#"{"a": "{\"a\":1,\"a\":2} 1e400"}"#), br#"{"a":"{\"a\":1,\"a\":2} 1e400"}"#, "strings are not scanned as JSON");
        assert_eq!(canon(r#"[{"a":1},{"a":2}]"#), br#"[{"a":1},{"a":2}]"#, "one key in two objects is no repeat");
    }
}
