//! Calls to the sidecar as HTTP/1.1 written and read by hand, for a host that makes them on its
//! own connections (the native host's `sidecar.address`, decision 219): a call as one request,
//! and one response read whole from a connection, bounded (head 64 KiB, body [`MAX_ANSWER`],
//! a chunk-size line 1 KiB). The sidecar is a local process, but its bytes are parsed as any
//! peer's: nothing here trusts a length or panics on one.

use crate::host::CallSpec;
use std::io::Read;

/// The largest answer taken from the sidecar (a decision batch is far smaller).
pub const MAX_ANSWER: usize = 16 << 20;

/// A call's answer: the `:status` and body, both absent when the call failed.
pub type Answer = (Option<u16>, Vec<u8>);

/// The call as one HTTP/1.1 request: its pseudo-headers as the request line and `host`, the
/// rest as headers. A header with a CR or LF (none the core makes) fails the call.
pub fn request(spec: &CallSpec) -> Option<Vec<u8>> {
    let pseudo = |name: &str| spec.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    let mut out = Vec::with_capacity(256 + spec.body.len());
    let line = format!(
        "{} {} HTTP/1.1\r\nhost: {}\r\ncontent-length: {}\r\n",
        pseudo(":method").unwrap_or("GET"),
        pseudo(":path").unwrap_or("/"),
        pseudo(":authority").unwrap_or("tollgate-sidecar"),
        spec.body.len()
    );
    out.extend_from_slice(line.as_bytes());
    for (name, value) in spec.headers.iter().filter(|(n, _)| !n.starts_with(':')) {
        if [name, value].iter().any(|t| t.bytes().any(|b| b == b'\r' || b == b'\n')) {
            return None;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&spec.body);
    Some(out)
}

/// Reads one response: its status and body, and whether the connection may carry another.
pub fn read_response(reader: &mut impl Read, chunk: &mut [u8]) -> Option<(Answer, bool)> {
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 64 * 1024 {
            return None;
        }
        let n = reader.read(chunk).ok().filter(|&n| n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().ok().filter(|&n| n <= MAX_ANSWER)?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        }
    }
    let mut rest = buf.split_off(head_end);
    let body = if matches!(status, 100..=199 | 204 | 304) {
        // no body by definition (and no interim answers from the sidecar: a 1xx is read as it)
        if !rest.is_empty() {
            return None;
        }
        rest
    } else if chunked {
        dechunk(reader, rest, chunk)?
    } else if let Some(n) = length {
        while rest.len() < n {
            let got = reader.read(chunk).ok().filter(|&g| g > 0)?;
            rest.extend_from_slice(&chunk[..got]);
        }
        if rest.len() > n {
            return None; // more than one answer: the connection is out of step
        }
        rest
    } else {
        // no length: the body ends with the connection
        let mut all = rest;
        reader.take((MAX_ANSWER + 1) as u64).read_to_end(&mut all).ok()?;
        if all.len() > MAX_ANSWER {
            return None;
        }
        return Some(((Some(status), all), false));
    };
    Some(((Some(status), body), !close))
}

/// A chunked body, `have` its first bytes.
fn dechunk(reader: &mut impl Read, mut have: Vec<u8>, chunk: &mut [u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    let mut more = |have: &mut Vec<u8>| -> Option<()> {
        let n = reader.read(chunk).ok().filter(|&n| n > 0)?;
        have.extend_from_slice(&chunk[..n]);
        Some(())
    };
    loop {
        let line_end = loop {
            if let Some(i) = have.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            if have.len() > 1024 {
                return None;
            }
            more(&mut have)?;
        };
        let size_text = std::str::from_utf8(&have[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        if body.len() + size > MAX_ANSWER {
            return None;
        }
        while have.len() < line_end + 2 + size + 2 {
            more(&mut have)?;
        }
        if size == 0 {
            // no trailers from the sidecar: the last chunk's CRLF ends the body
            return (have.len() == line_end + 4).then_some(body);
        }
        body.extend_from_slice(&have[line_end + 2..line_end + 2 + size]);
        have.drain(..line_end + 2 + size + 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn spec(headers: &[(&str, &str)], body: &[u8]) -> CallSpec {
        let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        CallSpec { cluster: "c".into(), headers, body: body.to_vec(), timeout: Duration::from_secs(1) }
    }

    fn read(bytes: &[u8]) -> Option<(Answer, bool)> {
        // a reader that hands out a few bytes at a time, as a socket may
        struct Trickle<'a>(&'a [u8]);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(buf.len()).min(7);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        read_response(&mut Trickle(bytes), &mut [0u8; 16])
    }

    #[test]
    fn a_call_is_one_request_with_its_length() {
        let s = spec(&[(":method", "POST"), (":path", "/v1/decide"), (":authority", "sc"), ("content-type", "application/json")], b"{}");
        assert_eq!(request(&s).unwrap(), b"POST /v1/decide HTTP/1.1\r\nhost: sc\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}");
        let injected = spec(&[(":path", "/"), ("x", "a\r\nevil: 1")], b"");
        assert_eq!(request(&injected), None, "a header with CR or LF is never written");
    }

    #[test]
    fn answers_by_length_and_by_chunks() {
        assert_eq!(read(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"), Some(((Some(200), b"hello".to_vec()), true)));
        assert_eq!(read(b"HTTP/1.1 429 X\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"), Some(((Some(429), vec![]), false)));
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(read(chunked), Some(((Some(200), b"abcde".to_vec()), true)));
        assert_eq!(read(b"HTTP/1.1 204 No Content\r\n\r\n"), Some(((Some(204), vec![]), true)));
        // no length: to the end of the connection, which is then not reused
        assert_eq!(read(b"HTTP/1.1 200 OK\r\n\r\nrest"), Some(((Some(200), b"rest".to_vec()), false)));
    }

    #[test]
    fn a_broken_or_hostile_answer_fails_the_call() {
        for bad in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhi"[..],               // cut short
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi+more",                // two answers at once
            b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999\r\n\r\n",            // over the bound
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",   // no last chunk
            b"HTTP/1.1 204 No Content\r\n\r\nbody",
            b"\xff\xfe\r\n\r\n",
            b"",
        ] {
            assert_eq!(read(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        let endless_head = [b'a'; 70 * 1024];
        assert_eq!(read(&endless_head), None);
    }
}
