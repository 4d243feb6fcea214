//! A TCP relay in front of a server that can leave its connections half-open: after
//! [`Relay::stall`], every connection open at that moment stops relaying in both directions
//! without being closed or reset — what a client sees when its peer's host, a NAT entry or a
//! moved address vanishes — while connections made afterwards relay normally.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a relaying thread looks at the stall generation and the stop flag.
const TICK: Duration = Duration::from_millis(20);

pub struct Relay {
    pub port: u16,
    generation: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    /// Relays `127.0.0.1:<port>` (a free port) to `127.0.0.1:<target>`.
    pub fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let (generation, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (g, s) = (generation.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else { continue };
                let born = g.load(Ordering::Relaxed);
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else { continue };
                for (from, to) in [(client, server), (s2, c2)] {
                    let (g, s) = (g.clone(), s.clone());
                    std::thread::spawn(move || pump(from, to, born, &g, &s));
                }
            }
        });
        Relay { port, generation, stop }
    }

    /// Every connection open now goes silent (held open, nothing relayed, never closed until the
    /// relay is dropped); later ones relay.
    pub fn stall(&self) {
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

fn pump(mut from: TcpStream, mut to: TcpStream, born: u64, generation: &AtomicU64, stop: &AtomicBool) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buf = [0u8; 16 * 1024];
    while !stop.load(Ordering::Relaxed) {
        if generation.load(Ordering::Relaxed) != born {
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
            Ok(_) if generation.load(Ordering::Relaxed) != born => {}
            Ok(n) => {
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
