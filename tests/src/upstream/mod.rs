//! In-process servers on their own runtime threads, each on a free port and stopped on drop: the
//! echo upstream (counting what reaches it), the flaky upstream that fails on command, and a
//! black hole (accepts, never answers: a hung sidecar). [`Upstream`] names one for a
//! [`crate::Gateway`] to start; [`RunningUpstream`] is what it started.

pub mod echo;
pub mod flaky;

use flaky::Flaky;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// An in-process server on its own runtime thread, stopped on drop.
pub struct InProcess {
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The echo upstream (see [`echo`]).
pub fn start_echo() -> InProcess {
    start_counting_echo().0
}

/// The echo upstream and the count of requests that reached it.
pub fn start_counting_echo() -> (InProcess, Arc<AtomicU64>) {
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let server = start_in_process(move |listener, stop| async move {
        let _ = echo::serve_counted(
            listener,
            async move {
                let _ = stop.await;
            },
            counter,
        )
        .await;
    });
    (server, seen)
}

/// A server that accepts connections and never answers: a hung sidecar.
pub fn start_black_hole() -> InProcess {
    start_in_process(|listener, stop| async move {
        let mut held = Vec::new();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Ok((s, _)) = listener.accept() => held.push(s),
            }
        }
    })
}

pub(crate) fn start_in_process<F, Fut>(f: F) -> InProcess
where
    F: FnOnce(tokio::net::TcpListener, tokio::sync::oneshot::Receiver<()>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let std_listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let port = std_listener.local_addr().expect("addr").port();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
            f(listener, rx).await;
        });
    });
    InProcess { port, stop: Some(tx), thread: Some(thread) }
}

/// An upstream for a gateway to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// The echo upstream, counting the requests that reach it.
    Echo,
    /// A flaky upstream with this name (healthy until told otherwise; see [`flaky`]).
    Flaky(String),
    /// A free port nothing listens on: Envoy's connection failures.
    Dead,
}

impl Upstream {
    pub fn flaky(name: &str) -> Upstream {
        Upstream::Flaky(name.to_string())
    }

    pub fn start(&self) -> RunningUpstream {
        match self {
            Upstream::Echo => {
                let (server, seen) = start_counting_echo();
                RunningUpstream::Echo { server, seen }
            }
            Upstream::Flaky(name) => RunningUpstream::Flaky(flaky::start_flaky(name)),
            Upstream::Dead => RunningUpstream::Dead(crate::process::free_port()),
        }
    }
}

/// A started [`Upstream`]; stopped on drop.
pub enum RunningUpstream {
    Echo { server: InProcess, seen: Arc<AtomicU64> },
    Flaky(Flaky),
    Dead(u16),
}

impl RunningUpstream {
    pub fn port(&self) -> u16 {
        match self {
            RunningUpstream::Echo { server, .. } => server.port,
            RunningUpstream::Flaky(f) => f.port,
            RunningUpstream::Dead(port) => *port,
        }
    }

    /// Requests that reached it so far (0 for a dead port).
    pub fn calls(&self) -> u64 {
        match self {
            RunningUpstream::Echo { seen, .. } => seen.load(Ordering::SeqCst),
            RunningUpstream::Flaky(f) => f.seen(),
            RunningUpstream::Dead(_) => 0,
        }
    }

    /// The flaky upstream's controls (panics for another kind).
    pub fn flaky(&self) -> &Flaky {
        match self {
            RunningUpstream::Flaky(f) => f,
            _ => panic!("this upstream is not a flaky one"),
        }
    }
}
