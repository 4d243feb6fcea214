//! The host port: everything the filter needs from Envoy, as one trait.
//!
//! The cdylib in `filters/tollgate` implements [`Host`] over proxy-wasm host calls and
//! [`crate::mock::MockHost`] implements it in memory for tests; nothing else in this crate knows
//! there is a proxy. Every method is one host call (or none): the request path counts them, so
//! callers read what they need once. Header names are lowercase.

use crate::stats::Metric;
use std::time::Duration;

/// What the adapter returns to Envoy from a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Stop; a body callback's data is buffered (Envoy's buffer limit applies: past it, Envoy
    /// answers 413 itself).
    Pause,
    /// A body callback only: stop, and let the body wait in Envoy with flow control (the client
    /// is slowed, no size limit) — a request body that waits for its decision, not read by the
    /// filter (decision 139).
    Hold,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
}

/// A call the filter wants dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSpec {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

/// Why a CAS write of shared data failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedSetError {
    /// Someone wrote the value since it was read: read again and retry.
    CasMismatch,
    Other(String),
}

/// Everything the filter needs from Envoy.
pub trait Host {
    /// Every request header as the client sent it: names lowercase, values raw bytes (a client
    /// may send any byte; see [`crate::headers::RequestHeaders`]), decoded in place.
    fn request_headers(&self) -> crate::hostmap::HeaderMap;
    /// Sets a request header. Envoy clears the stream's route cache on every change of a request
    /// header (set, add, remove), so a header a route matches on (`x-tollgate-cluster`) takes
    /// effect without another host call (a `clear_route_cache` call was redundant: one host call
    /// per routed request; routing and fallback are checked through Envoy in `tests/`).
    fn set_request_header(&mut self, name: &str, value: &str);
    /// Adds a request header the request does not carry: the filter calls it only for a name
    /// it knows absent (one of its own namespace, which the key stage cleared of the client's),
    /// because adding skips the search a set makes for values to replace (decision 227). A host
    /// without a cheaper add sets it.
    fn add_request_header(&mut self, name: &str, value: &str) {
        self.set_request_header(name, value);
    }
    fn remove_request_header(&mut self, name: &str);
    /// The names of the request's trailers (HTTP/2 or HTTP/3 trailers a client sent). Read only
    /// for a request that has them.
    fn request_trailer_names(&self) -> Vec<String>;
    fn remove_request_trailer(&mut self, name: &str);
    /// A response trailer's value (`None`: absent or not UTF-8). Read only for a response that
    /// ends with trailers and may be stored.
    fn response_trailer(&self, name: &str) -> Option<String>;
    fn add_response_header(&mut self, name: &str, value: &str);
    /// The downstream peer's IP address as Envoy saw it.
    fn client_ip(&self) -> Option<String>;
    /// Dispatches an HTTP call; returns its token, or an error description.
    fn dispatch(&mut self, call: CallSpec) -> Result<u32, String>;
    fn send_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]);
    /// Adds `n` to a counter of the stats catalogue ([`Metric`]).
    fn count_by(&mut self, metric: Metric, n: u64);
    /// Adds one to a counter of the stats catalogue.
    fn count(&mut self, metric: Metric) {
        self.count_by(metric, 1);
    }
    fn log(&mut self, level: LogLevel, message: &str);
    /// Wall-clock milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// VM-wide shared data (all workers of one Envoy see it); keys come from
    /// [`crate::shared_keys`].
    fn shared_get(&self, key: &str) -> Option<Vec<u8>>;
    fn shared_set(&mut self, key: &str, value: &[u8]);
    /// Shared data with its CAS token (`(None, None)` when absent).
    fn shared_get_cas(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes only if the value still has token `cas` (`None`: unconditional).
    fn shared_set_cas(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError>;
    /// A response header (lowercase name), e.g. `:status`; `None` when absent or not UTF-8.
    fn response_header(&self, name: &str) -> Option<String>;
    /// Every response header (lowercase names, raw values), for storing a response (issue 7).
    fn response_headers(&self) -> Vec<(String, Vec<u8>)>;
    /// `size` bytes of the response body chunk being processed, from `start`.
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>>;
    /// `size` bytes of the (buffered) request body, from `start`.
    fn request_body(&self, start: usize, size: usize) -> Option<Vec<u8>>;
    /// Replaces the whole request body Envoy holds buffered (`old_len` bytes: the filter paused
    /// at its end with [`Action::Pause`]) with `body`, from the decision's answer (an alias's
    /// rewrite, decision 309). `false` when the host could not.
    fn replace_request_body(&mut self, old_len: usize, body: &[u8]) -> bool;
    /// An Envoy attribute, e.g. `["xds", "cluster_name"]` or `["response", "code_details"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Increments a counter known by name only at configuration time (per-target stats).
    fn count_named(&mut self, name: &str);
    /// Asks for the worker's root context to run soon (its decision batch waits:
    /// crate::batch). `false` when it cannot be woken; the root's next tick sends then. Only
    /// called once the adapter enabled batching.
    fn wake_root(&mut self) -> bool {
        false
    }
    /// Opens a gRPC stream (root context only) to `cluster`'s `service`/`method` with
    /// `metadata`; its token, or why not. A host without streams refuses (crate::stream).
    fn open_stream(&mut self, _cluster: &str, _service: &str, _method: &str, _metadata: &[(&str, &[u8])]) -> Result<u32, String> {
        Err("this host has no gRPC streams".into())
    }
    /// Sends one message on the worker's stream `token` (from any of the worker's contexts).
    fn stream_send(&mut self, _token: u32, _message: &[u8]) -> Result<(), String> {
        Err("this host has no gRPC streams".into())
    }
}
