//! Breaker hints between the filter and the sidecar (advisory, fast-open only; ADR-004).
//!
//! `POST /v1/breaker/hints` with a [`HintReport`]: the filter's elected poller reports a local
//! OPEN transition; the sidecar stores it as `cb:hint:{provider}:{model}` with a TTL (30 s).
//! `GET /v1/breaker/hints` answers a [`HintList`]: the live hints written by *other* replicas.
//! A hint may only ever open a breaker faster; it is never evidence for closing one.

use serde::{Deserialize, Serialize};

/// Path of both hint endpoints on the sidecar.
pub const HINTS_PATH: &str = "/v1/breaker/hints";

/// A local OPEN transition, reported by the filter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HintReport {
    pub provider: String,
    pub model: String,
    /// When the reporting Envoy's breaker opened (its clock, ms since the Unix epoch).
    pub opened_at_ms: u64,
}

/// One live hint as the sidecar lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hint {
    pub provider: String,
    pub model: String,
    /// The sidecar instance that wrote it (each replica's sidecar has its own).
    pub replica: String,
    pub opened_at_ms: u64,
}

/// The answer of `GET /v1/breaker/hints`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HintList {
    #[serde(default)]
    pub hints: Vec<Hint>,
}

/// Provider and model names allowed in a hint (they become part of a Redis key): 1–128 of
/// `[A-Za-z0-9_.-/]` — no `:`, no `*`, no spaces.
pub fn valid_hint_part(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let r = HintReport { provider: "openai".into(), model: "gpt-4o".into(), opened_at_ms: 5 };
        assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"provider":"openai","model":"gpt-4o","openedAtMs":5}"#);
        let l: HintList = serde_json::from_str(r#"{"hints":[{"provider":"p","model":"m","replica":"r","openedAtMs":1,"extra":1}]}"#).unwrap();
        assert_eq!(l.hints[0].replica, "r");
        assert!(valid_hint_part("meta/llama-3.1_8b"));
        assert!(!valid_hint_part("a:b") && !valid_hint_part("") && !valid_hint_part("a*") && !valid_hint_part(&"a".repeat(129)));
    }
}
