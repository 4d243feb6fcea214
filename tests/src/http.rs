//! The tests' HTTP client: blocking, one request at a time, never an error for a status. A
//! connection failure comes back as status 0 with the error as the body, so a test can poll for
//! a server to come up or go away with the same call it asserts with.

use crate::upstream::echo::Echoed;
use std::time::Duration;

/// A response, whatever its status.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    /// What the echo upstream saw (panics if the body is not an echo).
    pub fn echoed(&self) -> Echoed {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not an echo ({e}), status {}: {}", self.status, self.body))
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(15))).build().into()
}

/// GET `url` with `headers`; connection failures come back as status 0.
pub fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    send("GET", url, headers, None)
}

/// POST `body` to `url` with `headers`; connection failures come back as status 0.
pub fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    send("POST", url, headers, Some(body))
}

/// An admin API call: `method` on `base` + `path` with `token` as bearer, and `body` as JSON for
/// a POST or PUT (`null` when none is given; GET and DELETE carry none).
pub fn admin_call(method: &str, base: &str, token: &str, path: &str, body: Option<serde_json::Value>) -> Resp {
    let auth = format!("Bearer {token}");
    let mut headers = vec![("authorization", auth.as_str())];
    let body = matches!(method, "POST" | "PUT").then(|| body.unwrap_or_default().to_string());
    if body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    send(method, &format!("{base}{path}"), &headers, body.as_deref())
}

/// `method` (GET, POST, PUT, DELETE, …) on `url` with `headers`, and `body` if any; connection
/// failures come back as status 0.
pub fn send(method: &str, url: &str, headers: &[(&str, &str)], body: Option<&str>) -> Resp {
    let mut req = ureq::http::Request::builder().method(method).uri(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    // No body at all (not an empty one) unless given: a GET carries no `content-length`.
    let built = match body {
        None => req.body(()).map(|r| agent().run(r)),
        Some(b) => req.body(b.to_string()).map(|r| agent().run(r)),
    };
    match built {
        Err(e) => Resp { status: 0, headers: vec![], body: format!("bad request {method} {url}: {e}") },
        Ok(Ok(mut r)) => {
            let status = r.status().as_u16();
            let headers = r
                .headers()
                .iter()
                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect();
            let body = r.body_mut().read_to_string().unwrap_or_default();
            Resp { status, headers, body }
        }
        Ok(Err(e)) => Resp { status: 0, headers: vec![], body: e.to_string() },
    }
}

/// `threads` clients at once, each sending `per_thread` GETs with `x-api-key: key`, client `t`'s
/// `i`-th request to `urls[(t + i) % urls.len()]` (spreads a burst over replicas); every status,
/// in no particular order.
pub fn keyed_burst(urls: &[String], key: &str, threads: usize, per_thread: usize) -> Vec<u16> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || (0..per_thread).map(|i| get(&urls[(t + i) % urls.len()], &[("x-api-key", key)]).status).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}
