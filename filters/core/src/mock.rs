//! `MockHost`: an in-memory [`Host`] that records what the filter did, for tests.

use crate::host::{CallSpec, Host, LogLevel, SharedSetError};
use crate::stats::Metric;
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A gRPC stream the filter opened: cluster, service, method, metadata.
pub type OpenedStream = (String, String, String, Vec<(String, Vec<u8>)>);

#[derive(Debug, Default)]
pub struct MockHost {
    /// Values are raw bytes, as a client may send them.
    pub request_headers: Vec<(String, Vec<u8>)>,
    pub response_headers: Vec<(String, String)>,
    pub client_ip: Option<String>,
    pub calls: Vec<CallSpec>,
    pub dispatch_error: Option<String>,
    pub reply: Option<Reply>,
    pub metrics: HashMap<Metric, u64>,
    pub logs: Vec<(LogLevel, String)>,
    pub now_ms: u64,
    pub shared: HashMap<String, Vec<u8>>,
    /// The response body chunk currently being processed.
    pub response_chunk: Vec<u8>,
    /// The buffered request body.
    pub request_body: Vec<u8>,
    /// The request's trailers.
    pub request_trailers: Vec<(String, Vec<u8>)>,
    /// The upstream response's trailers.
    pub response_trailers: Vec<(String, String)>,
    /// CAS token of each shared-data value: bumped on every write, like Envoy's.
    pub cas: HashMap<String, u32>,
    /// Writes "another worker" makes just before this host's next CAS write (each one makes that
    /// write fail with a mismatch, as a concurrent update would).
    pub interfere: Vec<(String, Vec<u8>)>,
    /// Headers of the response being filtered, as the upstream (or Envoy) sent them.
    pub upstream_response: Vec<(String, Vec<u8>)>,
    /// Envoy attributes by dotted path, e.g. `xds.cluster_name`.
    pub properties: HashMap<String, Vec<u8>>,
    pub named_metrics: HashMap<String, u64>,
    /// Times the filter asked for the root context to be woken (crate::batch).
    pub wakes: u32,
    /// gRPC streams opened (crate::stream).
    pub streams_opened: Vec<OpenedStream>,
    /// Messages sent on streams, by token.
    pub stream_sent: Vec<(u32, Vec<u8>)>,
    /// Opening a stream fails with this.
    pub open_error: Option<String>,
    /// Sending on a stream fails with this.
    pub stream_error: Option<String>,
}

impl MockHost {
    pub fn new() -> MockHost {
        MockHost::default().with_header(":method", "GET").with_header(":path", "/").with_header(":authority", "api.test")
    }
    pub fn with_header(mut self, name: &str, value: &str) -> MockHost {
        self.remove_request_header(name);
        self.request_headers.push((name.to_string(), value.as_bytes().to_vec()));
        self
    }
    /// Adds a header value of any bytes (repeating a name adds a second value).
    pub fn with_raw_header(mut self, name: &str, value: &[u8]) -> MockHost {
        self.request_headers.push((name.to_string(), value.to_vec()));
        self
    }
    /// Adds a response header (as the upstream sent it) of any bytes.
    pub fn with_upstream_header(mut self, name: &str, value: &[u8]) -> MockHost {
        self.upstream_response.push((name.to_string(), value.to_vec()));
        self
    }
    /// A host sharing `other`'s shared data and clock: the next request on the same Envoy.
    pub fn next_request(other: &MockHost) -> MockHost {
        let mut h = MockHost::new();
        h.shared = other.shared.clone();
        h.cas = other.cas.clone();
        h.now_ms = other.now_ms;
        h
    }
    pub fn with_property(mut self, path: &str, value: &str) -> MockHost {
        self.properties.insert(path.to_string(), value.as_bytes().to_vec());
        self
    }
    /// The counter named `name` (see [`Host::count_named`]).
    pub fn named(&self, name: &str) -> u64 {
        self.named_metrics.get(name).copied().unwrap_or(0)
    }
    fn bump(&mut self, key: &str) {
        *self.cas.entry(key.to_string()).or_insert(0) += 1;
    }
    /// The shared data keys that hold something about keys or requests: all of them but the
    /// change poller's call mark (crate::changes), which says only that calls are sent.
    pub fn cached_keys(&self) -> Vec<&String> {
        self.shared.keys().filter(|k| k.as_str() != crate::shared_keys::CHANGES_CALLS.as_str()).collect()
    }
    pub fn with_dispatch_error(mut self, e: &str) -> MockHost {
        self.dispatch_error = Some(e.to_string());
        self
    }
    /// A request header's value (`None` when absent or not UTF-8).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.request_headers.iter().find(|(n, _)| n == name).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
    pub fn count_of(&self, m: Metric) -> u64 {
        self.metrics.get(&m).copied().unwrap_or(0)
    }
    /// Every byte the filter let out of the host: headers, call bodies, replies and logs.
    pub fn everything_sent(&self) -> String {
        let mut s = String::new();
        for (n, v) in &self.request_headers {
            s.push_str(&format!("{n}: {}\n", String::from_utf8_lossy(v)));
        }
        for (n, v) in &self.response_headers {
            s.push_str(&format!("{n}: {v}\n"));
        }
        for c in &self.calls {
            s.push_str(&String::from_utf8_lossy(&c.body));
        }
        if let Some(r) = &self.reply {
            s.push_str(&String::from_utf8_lossy(&r.body));
        }
        for (_, l) in &self.logs {
            s.push_str(l);
        }
        for (k, v) in &self.shared {
            s.push_str(k);
            s.push_str(&String::from_utf8_lossy(v));
        }
        s
    }
}

impl Host for MockHost {
    fn request_headers(&self) -> crate::hostmap::HeaderMap {
        crate::hostmap::HeaderMap::from_pairs(&self.request_headers)
    }
    fn set_request_header(&mut self, name: &str, value: &str) {
        self.remove_request_header(name);
        self.request_headers.push((name.to_string(), value.as_bytes().to_vec()));
    }
    /// Adds as Envoy adds (a second value beside any first), after checking the filter's promise
    /// that the request does not carry the name.
    fn add_request_header(&mut self, name: &str, value: &str) {
        assert!(!self.request_headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)), "the filter added {name}, which the request carries");
        self.request_headers.push((name.to_string(), value.as_bytes().to_vec()));
    }
    fn remove_request_header(&mut self, name: &str) {
        self.request_headers.retain(|(n, _)| n != name);
    }
    fn request_trailer_names(&self) -> Vec<String> {
        self.request_trailers.iter().map(|(n, _)| n.clone()).collect()
    }
    fn remove_request_trailer(&mut self, name: &str) {
        self.request_trailers.retain(|(n, _)| n != name);
    }
    fn response_trailer(&self, name: &str) -> Option<String> {
        self.response_trailers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        self.response_headers.push((name.to_string(), value.to_string()));
    }
    fn client_ip(&self) -> Option<String> {
        self.client_ip.clone()
    }
    fn dispatch(&mut self, call: CallSpec) -> Result<u32, String> {
        if let Some(e) = &self.dispatch_error {
            return Err(e.clone());
        }
        self.calls.push(call);
        Ok(self.calls.len() as u32)
    }
    fn send_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        self.reply = Some(Reply {
            status,
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
            body: body.to_vec(),
        });
    }
    fn count_by(&mut self, metric: Metric, n: u64) {
        *self.metrics.entry(metric).or_insert(0) += n;
    }
    fn log(&mut self, level: LogLevel, message: &str) {
        self.logs.push((level, message.to_string()));
    }
    fn now_ms(&self) -> u64 {
        self.now_ms
    }
    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.get(key).cloned()
    }
    fn shared_set(&mut self, key: &str, value: &[u8]) {
        self.shared.insert(key.to_string(), value.to_vec());
        self.bump(key);
    }
    fn shared_get_cas(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.shared.get(key) {
            Some(v) => (Some(v.clone()), Some(self.cas.get(key).copied().unwrap_or(0))),
            None => (None, None),
        }
    }
    fn shared_set_cas(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        if !self.interfere.is_empty() {
            let (k, v) = self.interfere.remove(0);
            self.shared.insert(k.clone(), v);
            self.bump(&k);
        }
        // Like Envoy: a token is checked only when given and the key exists.
        if let (Some(cas), true) = (cas, self.shared.contains_key(key)) {
            if self.cas.get(key).copied().unwrap_or(0) != cas {
                return Err(SharedSetError::CasMismatch);
            }
        }
        self.shared.insert(key.to_string(), value.to_vec());
        self.bump(key);
        Ok(())
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.upstream_response.iter().find(|(n, _)| n == name).and_then(|(_, v)| String::from_utf8(v.clone()).ok())
    }
    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.upstream_response.clone()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.get(&path.join(".")).cloned()
    }
    fn count_named(&mut self, name: &str) {
        *self.named_metrics.entry(name.to_string()).or_insert(0) += 1;
    }
    fn wake_root(&mut self) -> bool {
        self.wakes += 1;
        true
    }
    fn open_stream(&mut self, cluster: &str, service: &str, method: &str, metadata: &[(&str, &[u8])]) -> Result<u32, String> {
        if let Some(e) = &self.open_error {
            return Err(e.clone());
        }
        let metadata = metadata.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect();
        self.streams_opened.push((cluster.into(), service.into(), method.into(), metadata));
        Ok(1000 + self.streams_opened.len() as u32)
    }
    fn stream_send(&mut self, token: u32, message: &[u8]) -> Result<(), String> {
        if let Some(e) = &self.stream_error {
            return Err(e.clone());
        }
        self.stream_sent.push((token, message.to_vec()));
        Ok(())
    }
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        self.response_chunk.get(start..start + size).map(<[u8]>::to_vec)
    }
    fn request_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        self.request_body.get(start..start + size).map(<[u8]>::to_vec)
    }
    fn replace_request_body(&mut self, old_len: usize, body: &[u8]) -> bool {
        if old_len != self.request_body.len() {
            return false;
        }
        self.request_body = body.to_vec();
        true
    }
}
