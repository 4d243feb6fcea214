//! HTTP/1.1 over a raw socket: requests with bytes no HTTP client library would send (a header
//! value with 0xFF, a path that is not UTF-8), for the hostile-client tests.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// What came back: the status (0 when the connection closed without a response), the headers
/// (lowercase names) and the body, read until the server closed the connection.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}), status {}: {}", self.status, String::from_utf8_lossy(&self.body)))
    }
}

/// Sends `GET <path>` with `headers` (raw bytes each) and `Connection: close` to `127.0.0.1:port`.
pub fn get(port: u16, path: &[u8], headers: &[(&str, &[u8])]) -> RawResponse {
    let mut req = Vec::new();
    req.extend_from_slice(b"GET ");
    req.extend_from_slice(path);
    req.extend_from_slice(b" HTTP/1.1\r\nhost: test.local\r\nconnection: close\r\n");
    for (n, v) in headers {
        req.extend_from_slice(n.as_bytes());
        req.extend_from_slice(b": ");
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"\r\n");
    send(port, &req)
}

/// Sends `request` as is and reads the response until the server closes. A server may answer
/// before it has read the whole request (a 413 for a body over its limit) and close: the write
/// then fails with a broken pipe or a reset, and the answer already sent is still read.
pub fn send(port: u16, request: &[u8]) -> RawResponse {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    if let Err(e) = s.write_all(request) {
        assert!(
            matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset),
            "write: {e}"
        );
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse(&out)
}

/// Sends `head`, runs `between` (a wait for what the head alone makes happen), then `rest`, and
/// reads the response until the server closes: a request whose body comes after its headers
/// were already let through.
pub fn send_split(port: u16, head: &[u8], between: impl FnOnce(), rest: &[u8]) -> RawResponse {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    s.write_all(head).expect("write the head");
    between();
    s.write_all(rest).expect("write the rest");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse(&out)
}

/// Sends `method path` with `headers` and `body` (a `content-length` added) and
/// `Connection: close`; the answer is read even when the server stops reading the body early.
pub fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> RawResponse {
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    send(port, &bytes)
}

fn parse(bytes: &[u8]) -> RawResponse {
    let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return RawResponse { status: 0, headers: vec![], body: bytes.to_vec() };
    };
    let head = String::from_utf8_lossy(&bytes[..end]);
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = bytes[end + 4..].to_vec();
    if headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    RawResponse { status, headers, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || b.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[(eol + 4 + size).min(b.len())..];
    }
    out
}
