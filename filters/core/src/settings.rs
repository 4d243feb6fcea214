//! What every section of the plugin configuration shares: the error that names the field, and
//! durations written like `"25ms"`. A leaf: each section (beside its owner: `crate::lease::config`,
//! `crate::breaker::config`, …) and the whole `crate::config` build on it.

use std::time::Duration;

/// Why a configuration was refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid tollgate plugin configuration: {}", self.0)
    }
}

/// Parses a duration like `25ms`, `2s`, `1m` (a whole number and a unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("'{s}' is not a duration like \"25ms\""))?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(format!("'{s}': unit must be ms, s or m")),
    };
    Ok(d)
}

/// A duration field within `[min, max]`; `field` names it in the error (`section.field`).
pub fn duration_within(field: &str, s: &str, min: Duration, max: Duration, range: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(s).map_err(|e| ConfigError(format!("{field}: {e}")))?;
    if d < min || d > max {
        return Err(ConfigError(format!("{field}: must be between {range}")));
    }
    Ok(d)
}

/// Reads an `Option` field of a raw section (with `#[serde(default)]`): absent is `None` — the
/// section's typed default applies, one place for it — and `null` is refused like any other
/// value of the wrong type.
pub fn given<'de, D: serde::Deserializer<'de>, T: serde::Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("25ms").unwrap(), Duration::from_millis(25));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("5h").is_err());
        let ten = Duration::from_millis(10);
        assert_eq!(duration_within("a.b", "1s", ten, Duration::from_secs(10), "10ms and 10s"), Ok(Duration::from_secs(1)));
        assert_eq!(
            duration_within("a.b", "1ms", ten, Duration::from_secs(10), "10ms and 10s"),
            Err(ConfigError("a.b: must be between 10ms and 10s".into()))
        );
    }
}
