//! Calls to the sidecar: where they go (the `sidecar` section of the plugin configuration), how
//! one is made, and how a decision call's answer is read.

use crate::host::CallSpec;
use crate::settings::{parse_duration, ConfigError};
use serde::Deserialize;
use std::time::Duration;
use tollgate_wire::{DecideResponse, SECRET_HEADER};

/// Where calls to the sidecar go, and the deployment's secret every call carries.
#[derive(Clone, PartialEq, Eq)]
pub struct Sidecar {
    /// The Envoy cluster that reaches the sidecar.
    pub cluster: String,
    /// `:authority` of calls to the sidecar.
    pub authority: String,
    /// How long a decision call may take before the failure mode applies.
    pub timeout: Duration,
    /// The deployment's filter secret (the sidecar's `[server] secret`), sent in
    /// [`SECRET_HEADER`] on every call; the sidecar refuses calls without it (401).
    pub secret: Option<String>,
    /// Under concurrency, a worker's decision calls share one call (`batchDecisions`, on by
    /// default; crate::batch, decision 127).
    pub batch_decisions: bool,
    /// On a host that holds gRPC streams (the Wasm host), a worker's decisions go on one
    /// long-lived stream to the sidecar instead of a call each (`decisionStream`, on by default;
    /// crate::stream, decision 223).
    pub decision_stream: bool,
    /// Where the native host reaches the sidecar itself, on a connection of its own instead of
    /// an Envoy callout per request (`address`: `host:port` or `unix:/path`; decision 219). The
    /// Wasm host has no sockets and always calls through [`Sidecar::cluster`].
    pub address: Option<SidecarAddress>,
}

/// A sidecar's listening address, for a host that connects to it itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SidecarAddress {
    Tcp(std::net::SocketAddr),
    Unix(String),
}

impl SidecarAddress {
    /// `host:port` (an IP address and a port) or `unix:` and an absolute path.
    pub fn parse(text: &str) -> Result<SidecarAddress, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            if !path.starts_with('/') || path.len() > 107 {
                return Err("a unix socket is `unix:` and an absolute path of at most 107 bytes".into());
            }
            return Ok(SidecarAddress::Unix(path.to_string()));
        }
        text.parse().map(SidecarAddress::Tcp).map_err(|_| "must be IP:PORT or unix:/PATH".to_string())
    }
}

impl std::fmt::Debug for Sidecar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sidecar")
            .field("cluster", &self.cluster)
            .field("authority", &self.authority)
            .field("timeout", &self.timeout)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("batch_decisions", &self.batch_decisions)
            .field("decision_stream", &self.decision_stream)
            .field("address", &self.address)
            .finish()
    }
}

impl Default for Sidecar {
    fn default() -> Self {
        Sidecar {
            cluster: default_cluster(),
            authority: default_authority(),
            timeout: Duration::from_millis(25),
            secret: None,
            batch_decisions: true,
            decision_stream: true,
            address: None,
        }
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
    #[serde(default)]
    secret: Option<String>,
    #[serde(default = "default_batch_decisions")]
    batch_decisions: bool,
    #[serde(default = "default_batch_decisions")]
    decision_stream: bool,
    #[serde(default)]
    address: Option<String>,
}

impl Default for RawSidecar {
    fn default() -> Self {
        RawSidecar {
            cluster: default_cluster(),
            authority: default_authority(),
            timeout: default_timeout(),
            secret: None,
            batch_decisions: default_batch_decisions(),
            decision_stream: default_batch_decisions(),
            address: None,
        }
    }
}

fn default_batch_decisions() -> bool {
    true
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
        // What the sidecar accepts as `[server] secret`; never echoed in the error.
        if let Some(secret) = &raw.secret {
            if !(16..=256).contains(&secret.len()) || !secret.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ConfigError("sidecar.secret: must be 16 to 256 visible ASCII characters".into()));
            }
        }
        let address = match &raw.address {
            Some(a) => Some(SidecarAddress::parse(a).map_err(|e| ConfigError(format!("sidecar.address: {e}")))?),
            None => None,
        };
        Ok(Sidecar { cluster: raw.cluster, authority: raw.authority, timeout, secret: raw.secret, batch_decisions: raw.batch_decisions, decision_stream: raw.decision_stream, address })
    }

    /// A call to `path`: `:method`, `:path`, `:authority`, the secret, then `extra` headers.
    pub fn call(&self, method: &str, path: &str, extra: &[(&str, &str)], body: Vec<u8>, timeout: Duration) -> CallSpec {
        let mut headers = Vec::with_capacity(4 + extra.len());
        headers.push((":method".to_string(), method.to_string()));
        headers.push((":path".to_string(), path.to_string()));
        headers.push((":authority".to_string(), self.authority.clone()));
        if let Some(secret) = &self.secret {
            headers.push((SECRET_HEADER.to_string(), secret.clone()));
        }
        headers.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        CallSpec { cluster: self.cluster.clone(), headers, body, timeout }
    }

    /// A `POST` of a JSON body to `path`.
    pub fn post_json(&self, path: &str, body: Vec<u8>, timeout: Duration) -> CallSpec {
        self.call("POST", path, &[("content-type", "application/json")], body, timeout)
    }

    /// A decision call (`POST /v1/decide`) with the decision timeout, carrying the request's
    /// `traceparent` when it is well formed ([`traceparent`]). It accepts a compact answer
    /// (decision 224): a sidecar that writes them answers an allow so, an older one in JSON;
    /// [`interpret`] reads either.
    pub fn decide(&self, body: Vec<u8>, traceparent: Option<&str>) -> CallSpec {
        let mut extra = vec![("content-type", "application/json"), ("accept", tollgate_wire::compact::COMPACT_MEDIA_TYPE)];
        if let Some(tp) = traceparent {
            extra.push((tollgate_wire::TRACEPARENT_HEADER, tp));
        }
        self.call("POST", tollgate_wire::DECIDE_PATH, &extra, body, self.timeout)
    }
}

/// The request's W3C `traceparent`, when it has the form the sidecar reads
/// (`vv-<32 hex>-<16 hex>-<2 hex>`, lower case, at most 256 bytes with a later version's
/// fields); anything else is not forwarded.
pub fn traceparent(value: Option<&str>) -> Option<&str> {
    let v = value?.trim();
    let b = v.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    let shaped = b.len() >= 55
        && b.len() <= 256
        && (b.len() == 55 || b[55] == b'-')
        && b[2] == b'-'
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(0..2)
        && hex(3..35)
        && hex(36..52)
        && hex(53..55);
    shaped.then_some(v)
}

/// A call response's `:status`, given (`Option<u16>`) or read only when asked for (a closure:
/// the adapter's read is a host call).
pub trait CallStatus {
    fn read(self) -> Option<u16>;
}

impl CallStatus for Option<u16> {
    fn read(self) -> Option<u16> {
        self
    }
}

impl<F: FnOnce() -> Option<u16>> CallStatus for F {
    fn read(self) -> Option<u16> {
        self()
    }
}

/// Reads a decision call's result (decision 143). Only the sidecar answers these calls, and it
/// writes a decision only in a 200: its errors are `{"error", "message"}`, and what Envoy answers
/// for a sidecar unreachable or late is text or nothing. So a body that decodes as a decision is
/// the answer, and the status is read (a host call per call out, in Envoy) only to say why
/// anything else is an error.
pub fn interpret(status: impl CallStatus, body: &[u8]) -> Result<DecideResponse, String> {
    if tollgate_wire::compact::is_compact(body) {
        // only the sidecar writes one, in a 200 (no JSON text, nor what Envoy writes, starts so)
        return tollgate_wire::compact::decode_answer(body).map_err(|e| format!("undecodable decision: {e}")).and_then(|a| a.into_result());
    }
    let err = match serde_json::from_slice(body) {
        Ok(answer) => return Ok(answer),
        Err(e) => e,
    };
    match status.read() {
        Some(200) => Err(format!("undecodable decision: {err}")),
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
        let c = s.decide(b"{}".to_vec(), None);
        assert_eq!(c.cluster, "tollgate_sidecar");
        assert_eq!(c.timeout, Duration::from_millis(25));
        let h: Vec<(&str, &str)> = c.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(
            h,
            [
                (":method", "POST"),
                (":path", "/v1/decide"),
                (":authority", "tollgate-sidecar"),
                ("content-type", "application/json"),
                ("accept", "application/x-tollgate-compact")
            ]
        );
    }

    #[test]
    fn the_decision_call_carries_a_well_formed_traceparent_only() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traceparent(Some(TP)), Some(TP));
        assert_eq!(traceparent(Some(&format!(" {TP} "))), Some(TP));
        assert_eq!(traceparent(Some(&format!("01{}-more", &TP[2..]))).map(str::len), Some(60));
        for bad in [TP.to_uppercase(), TP[..54].to_string(), format!("{TP}x"), TP.replace('-', "."), "x".repeat(300), String::new()] {
            assert_eq!(traceparent(Some(&bad)), None, "{bad}");
        }
        assert_eq!(traceparent(None), None);
        let c = Sidecar::default().decide(b"{}".to_vec(), Some(TP));
        assert!(c.headers.iter().any(|(n, v)| n == "traceparent" && v == TP), "{:?}", c.headers);
    }

    #[test]
    fn every_call_carries_the_secret_when_configured_and_it_never_prints() {
        let raw: RawSidecar = serde_json::from_str(r#"{"secret":"0123456789abcdef-xyz"}"#).unwrap();
        let s = Sidecar::compile(raw).unwrap();
        for c in [s.decide(b"{}".to_vec(), None), s.call("GET", "/v1/routes", &[], Vec::new(), Duration::from_secs(1))] {
            assert!(c.headers.iter().any(|(n, v)| n == SECRET_HEADER && v == "0123456789abcdef-xyz"), "{:?}", c.headers);
        }
        assert!(!format!("{s:?}").contains("0123456789abcdef"), "{s:?}");
        for bad in [r#"{"secret":"short"}"#, r#"{"secret":"0123456789abcdef with space"}"#] {
            let raw: RawSidecar = serde_json::from_str(bad).unwrap();
            let err = Sidecar::compile(raw).unwrap_err().0;
            assert!(err.starts_with("sidecar.secret") && !err.contains("0123456789"), "{err}");
        }
    }

    #[test]
    fn only_a_decodable_200_is_an_answer() {
        assert!(interpret(Some(200), br#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p"}"#).is_ok());
        assert_eq!(interpret(Some(504), b""), Err("sidecar answered 504".into()));
        assert_eq!(interpret(None, b""), Err("sidecar response has no :status".into()));
        assert!(interpret(Some(200), b"{").unwrap_err().starts_with("undecodable decision"));
        // the sidecar's own errors are JSON, but no decision
        let error = br#"{"error":"unauthorized","message":"no filter secret"}"#;
        assert_eq!(interpret(Some(401), error), Err("sidecar answered 401".into()));
        assert_eq!(interpret(None, b"upstream connect error or disconnect/reset before headers"), Err("sidecar response has no :status".into()));
    }

    #[test]
    fn a_decision_is_read_without_asking_for_the_status() {
        let decision = br#"{"verdict":"allow","tenant":"t","keyId":"k","plan":"p"}"#;
        let read = std::cell::Cell::new(0);
        let status = |s: Option<u16>| {
            let read = &read;
            move || {
                read.set(read.get() + 1);
                s
            }
        };
        assert!(interpret(status(Some(200)), decision).is_ok());
        assert_eq!(read.get(), 0, "a decision: the status is not read");
        // a compact answer (decision 224) is read as the JSON one, the status unread as well
        use tollgate_wire::{compact, stream::StreamAnswer};
        let allow = DecideResponse::allow("t", "k", "p");
        let bytes = compact::encode_answer(&StreamAnswer { seq: 0, status: 200, decision: Some(allow.clone()), error: None }).unwrap();
        assert_eq!(interpret(status(Some(200)), &bytes), Ok(allow));
        assert_eq!(read.get(), 0);
        let cut = &bytes[..bytes.len() - 1];
        assert!(interpret(status(Some(200)), cut).unwrap_err().starts_with("undecodable decision"));
        assert_eq!(interpret(status(Some(503)), br#"{"error":"internal","message":"x"}"#), Err("sidecar answered 503".into()));
        assert_eq!(read.get(), 1, "an error: read once, to name it");
    }
}
