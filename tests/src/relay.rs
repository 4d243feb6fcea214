//! A TCP relay in front of a server that can leave its connections half-open: after
//! [`Relay::stall`], every connection open at that moment stops relaying in both directions
//! without being closed or reset — what a client sees when its peer's host, a NAT entry or a
//! moved address vanishes — while connections made afterwards relay normally.
//! [`Relay::stall_those_that_sent`] stalls only the connections whose client sent a given command
//! (`PSUBSCRIBE`: a subscriber's socket frozen while the same process's other connections, and
//! every publisher, stay healthy).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often a relaying thread looks at the stall generation and the stop flag.
const TICK: Duration = Duration::from_millis(20);

pub struct Relay {
    pub port: u16,
    generation: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// What the last stall applies to: every connection (`None`) or those that sent these bytes.
    only: Arc<Mutex<Option<Vec<u8>>>>,
}

/// What one connection's two pumps share.
struct Conn {
    born: u64,
    /// Bytes its client sent that a selective stall looks for (the last 64 KiB).
    sent: Mutex<Vec<u8>>,
}

impl Relay {
    /// Relays `127.0.0.1:<port>` (a free port) to `127.0.0.1:<target>`.
    pub fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let (generation, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let only: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let (g, s, o) = (generation.clone(), stop.clone(), only.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else { continue };
                let conn = Arc::new(Conn { born: g.load(Ordering::Relaxed), sent: Mutex::default() });
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else { continue };
                for (upstream, from, to) in [(true, client, server), (false, s2, c2)] {
                    let (g, s, o, conn) = (g.clone(), s.clone(), o.clone(), conn.clone());
                    std::thread::spawn(move || pump(from, to, upstream, &conn, &g, &s, &o));
                }
            }
        });
        Relay { port, generation, stop, only }
    }

    /// Every connection open now whose client has sent `bytes` (e.g. `b"PSUBSCRIBE"`) goes
    /// silent as with [`Relay::stall`]; the others, and later ones, relay.
    pub fn stall_those_that_sent(&self, bytes: &[u8]) {
        *self.only.lock().unwrap_or_else(|p| p.into_inner()) = Some(bytes.to_vec());
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// Every connection open now goes silent (held open, nothing relayed, never closed until the
    /// relay is dropped); later ones relay.
    pub fn stall(&self) {
        *self.only.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // wakes the accepting thread so it sees the flag
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Whether `conn` is stalled now: a stall came after it was made, and applies to it.
fn stalled(conn: &Conn, generation: &AtomicU64, only: &Mutex<Option<Vec<u8>>>) -> bool {
    if generation.load(Ordering::Relaxed) == conn.born {
        return false;
    }
    match &*only.lock().unwrap_or_else(|p| p.into_inner()) {
        None => true,
        Some(bytes) => conn.sent.lock().unwrap_or_else(|p| p.into_inner()).windows(bytes.len().max(1)).any(|w| w == bytes.as_slice()),
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, upstream: bool, conn: &Conn, generation: &AtomicU64, stop: &AtomicBool, only: &Mutex<Option<Vec<u8>>>) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buf = [0u8; 16 * 1024];
    while !stop.load(Ordering::Relaxed) {
        if stalled(conn, generation, only) {
            // stalled: hold both sockets open and relay nothing (what was read is lost, as on a
            // dead path); the read paces the loop, or the tick once the peer closed its side
            if let Ok(0) = from.read(&mut buf) {
                std::thread::sleep(TICK);
            }
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            // read before the stall, arrived after it: lost like the rest
            Ok(_) if stalled(conn, generation, only) => {}
            Ok(n) => {
                if upstream {
                    let mut sent = conn.sent.lock().unwrap_or_else(|p| p.into_inner());
                    sent.extend_from_slice(&buf[..n]);
                    let excess = sent.len().saturating_sub(64 * 1024);
                    sent.drain(..excess);
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Both);
}
