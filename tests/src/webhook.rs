//! A webhook receiver for tests: records every POST it answers (headers, body), and answers 503
//! while set down (counting those attempts apart), as a receiver that is away for a while.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One delivery the receiver took (answered 200).
#[derive(Debug, Clone)]
pub struct Received {
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

#[derive(Default)]
struct Shared {
    received: Mutex<Vec<Received>>,
    down: AtomicBool,
    refused: AtomicU64,
}

pub struct Receiver {
    port: u16,
    shared: Arc<Shared>,
}

impl Receiver {
    /// Listens on a free loopback port (a thread per connection; the test process ends them).
    pub fn start() -> Receiver {
        let listener = TcpListener::bind(("127.0.0.1", crate::free_port())).expect("bind the webhook receiver");
        let port = listener.local_addr().expect("its address").port();
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        Receiver { port, shared }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// While down, every POST is answered 503 and not recorded.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
    }

    /// Deliveries answered 503 while down.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn serve(conn: TcpStream, s: &Shared) {
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    let mut reader = BufReader::new(conn);
    let mut headers = HashMap::new();
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.trim_end().split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0; len.min(1 << 20)];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let status = if s.down.load(Ordering::SeqCst) {
        s.refused.fetch_add(1, Ordering::SeqCst);
        "503 Service Unavailable"
    } else {
        s.received.lock().unwrap_or_else(|p| p.into_inner()).push(Received { headers, body });
        "200 OK"
    };
    let mut conn = reader.into_inner();
    let _ = conn.write_all(format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes());
}
