//! Calls to the sidecar: where they go (the `sidecar` section of the plugin configuration), how
//! one is made, and how a decision call's answer is read.

use crate::host::CallSpec;
use crate::settings::{parse_duration, ConfigError};
use serde::Deserialize;
use std::time::Duration;
use tollgate_wire::DecideResponse;

/// Where calls to the sidecar go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sidecar {
    /// The Envoy cluster that reaches the sidecar.
    pub cluster: String,
    /// `:authority` of calls to the sidecar.
    pub authority: String,
    /// How long a decision call may take before the failure mode applies.
    pub timeout: Duration,
}

impl Default for Sidecar {
    fn default() -> Self {
        Sidecar { cluster: default_cluster(), authority: default_authority(), timeout: Duration::from_millis(25) }
    }
}

/// `sidecar` as written in the plugin configuration.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawSidecar {
    #[serde(default = "default_cluster")]
    cluster: String,
    #[serde(default = "default_authority")]
    authority: String,
    #[serde(default = "default_timeout")]
    timeout: String,
}

impl Default for RawSidecar {
    fn default() -> Self {
        RawSidecar { cluster: default_cluster(), authority: default_authority(), timeout: default_timeout() }
    }
}

fn default_cluster() -> String {
    "tollgate_sidecar".into()
}
fn default_authority() -> String {
    "tollgate-sidecar".into()
}
fn default_timeout() -> String {
    "25ms".into()
}

impl Sidecar {
    pub fn compile(raw: RawSidecar) -> Result<Sidecar, ConfigError> {
        let timeout = parse_duration(&raw.timeout).map_err(|e| ConfigError(format!("sidecar.timeout: {e}")))?;
        if timeout.is_zero() || timeout > Duration::from_secs(60) {
            return Err(ConfigError("sidecar.timeout: must be between 1ms and 60s".into()));
        }
        if raw.cluster.trim().is_empty() {
            return Err(ConfigError("sidecar.cluster: must not be empty".into()));
        }
        Ok(Sidecar { cluster: raw.cluster, authority: raw.authority, timeout })
    }

    /// A call to `path`: `:method`, `:path`, `:authority`, then `extra` headers.
    pub fn call(&self, method: &str, path: &str, extra: &[(&str, &str)], body: Vec<u8>, timeout: Duration) -> CallSpec {
        let mut headers = Vec::with_capacity(3 + extra.len());
        headers.push((":method".to_string(), method.to_string()));
        headers.push((":path".to_string(), path.to_string()));
        headers.push((":authority".to_string(), self.authority.clone()));
        headers.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        CallSpec { cluster: self.cluster.clone(), headers, body, timeout }
    }

    /// A `POST` of a JSON body to `path`.
    pub fn post_json(&self, path: &str, body: Vec<u8>, timeout: Duration) -> CallSpec {
        self.call("POST", path, &[("content-type", "application/json")], body, timeout)
    }

    /// A decision call (`POST /v1/decide`) with the decision timeout.
    pub fn decide(&self, body: Vec<u8>) -> CallSpec {
        self.post_json(tollgate_wire::DECIDE_PATH, body, self.timeout)
    }
}

/// Reads a decision call's result: anything but a 200 with a decodable body is an error.
pub fn interpret(status: Option<u16>, body: &[u8]) -> Result<DecideResponse, String> {
    match status {
        Some(200) => serde_json::from_slice(body).map_err(|e| format!("undecodable decision: {e}")),
        Some(s) => Err(format!("sidecar answered {s}")),
        None => Err("sidecar response has no :status".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_decision_call_is_a_json_post_with_the_decision_timeout() {
        let s = Sidecar::default();
        let c = s.decide(b"{}".to_vec());
        assert_eq!(c.cluster, "tollgate_sidecar");
        assert_eq!(c.timeout, Duration::from_millis(25));
        let h: Vec<(&str, &str)> = c.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(
            h,
            [(":method", "POST"), (":path", "/v1/decide"), (":authority", "tollgate-sidecar"), ("content-type", "application/json")]
        );
    }

    #[test]
    fn only_a_decodable_200_is_an_answer() {
        assert!(interpret(Some(200), br#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p"}"#).is_ok());
        assert_eq!(interpret(Some(504), b""), Err("sidecar answered 504".into()));
        assert_eq!(interpret(None, b""), Err("sidecar response has no :status".into()));
        assert!(interpret(Some(200), b"{").unwrap_err().starts_with("undecodable decision"));
    }
}
