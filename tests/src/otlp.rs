//! An OTLP/HTTP trace receiver for tests: accepts `POST /v1/traces` with a JSON body (the
//! encoding the sidecar exports), answers 200 `{}`, and keeps every span it was sent. Stops (its
//! thread and port) when dropped.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub struct OtlpReceiver {
    pub port: u16,
    spans: Arc<Mutex<Vec<Value>>>,
    posts: Arc<Mutex<usize>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl OtlpReceiver {
    pub fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the OTLP receiver");
        let port = listener.local_addr().expect("its address").port();
        let (spans, posts, stop) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(0)), Arc::new(AtomicBool::new(false)));
        let (s, p, halt) = (spans.clone(), posts.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if halt.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(conn) = conn {
                    serve(conn, &s, &p);
                }
            }
        });
        OtlpReceiver { port, spans, posts, stop, thread: Some(thread) }
    }

    /// The URL to configure as the exporter's endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/v1/traces", self.port)
    }

    /// Every span received so far (the OTLP JSON span objects).
    pub fn spans(&self) -> Vec<Value> {
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The spans of one trace (`traceId`, hex).
    pub fn trace(&self, trace_id: &str) -> Vec<Value> {
        self.spans().into_iter().filter(|s| s["traceId"] == trace_id).collect()
    }

    /// How many posts arrived.
    pub fn posts(&self) -> usize {
        *self.posts.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port)); // wakes the accept loop
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request per connection (the answer says `connection: close`).
fn serve(conn: TcpStream, spans: &Mutex<Vec<Value>>, posts: &Mutex<usize>) {
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    let mut reader = BufReader::new(&conn);
    let mut line = String::new();
    let mut length = 0usize;
    let mut first = true;
    let mut target = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let l = line.trim_end();
        if first {
            target = l.split(' ').nth(1).unwrap_or_default().to_string();
            first = false;
            continue;
        }
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            if n.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let ok = target == "/v1/traces";
    if let (true, Ok(v)) = (ok, serde_json::from_slice::<Value>(&body)) {
        *posts.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let mut all = spans.lock().unwrap_or_else(|p| p.into_inner());
        for rs in v["resourceSpans"].as_array().into_iter().flatten() {
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                all.extend(ss["spans"].as_array().into_iter().flatten().cloned());
            }
        }
    }
    let status = if ok { "200 OK" } else { "404 Not Found" };
    let _ = (&conn).write_all(format!("HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}").as_bytes());
}
