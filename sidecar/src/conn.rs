//! Serving HTTP connections with deadlines: the accept loop of the filter-facing server (TCP and
//! unix socket alike), HTTP/1.1 and HTTP/2 (h2c) told apart by their first bytes.
//!
//! Two limits keep a client from holding a connection for nothing:
//! - `header_read_timeout`: a connection must have sent a whole request head within it from
//!   accept (whatever the protocol: this also bounds the protocol sniffing and an HTTP/2 client
//!   that never opens a stream), and on HTTP/1.1 every later head too (hyper's
//!   `header_read_timeout`, which also closes an HTTP/1.1 connection idle that long between
//!   requests).
//! - `idle_timeout`: a connection on which no byte moved either way for that long is shut down
//!   (HTTP/2: a GOAWAY, then closed if the peer does not close first).

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The connection deadlines (`[server]`, crate::server::ServerConfig).
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub header_read: Duration,
    pub idle: Duration,
}

/// After a shutdown began (idle, or the server stopping), how long a peer may take to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(10);

/// Serves `listener` until `stop`, then stops accepting and waits for its connections to finish
/// (each is asked to shut down gracefully, and closed after [`CLOSE_GRACE`]).
pub async fn serve<L: axum::serve::Listener>(mut listener: L, router: Router, deadlines: Deadlines, stop: CancellationToken) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            (io, _) = listener.accept() => {
                conns.spawn(connection(io, router.clone(), deadlines, stop.clone()));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// When the connection last moved a byte, and whether it has sent a whole request head.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    headed: AtomicBool,
}

impl Activity {
    fn touch(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

async fn connection<I>(io: I, router: Router, d: Deadlines, stop: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity { start: Instant::now(), last_ms: AtomicU64::new(0), headed: AtomicBool::new(false) });
    let io = TokioIo::new(Watched { inner: io, activity: activity.clone() });
    let seen = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        seen.headed.store(true, Ordering::Relaxed);
        let mut router = router.clone();
        async move { tower::Service::call(&mut router, req.map(axum::body::Body::new)).await }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(d.header_read);
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    // Some(deadline) once a shutdown began: the connection is dropped (closed) then.
    let mut closing: Option<Instant> = None;
    loop {
        let check = match closing {
            Some(at) => at,
            None if !activity.headed.load(Ordering::Relaxed) => activity.start + d.header_read,
            None => activity.last() + d.idle,
        };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.cancelled(), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + CLOSE_GRACE);
            }
            _ = tokio::time::sleep_until(check) => {
                let now = Instant::now();
                if closing.is_some() {
                    return;
                }
                if !activity.headed.load(Ordering::Relaxed) && now >= activity.start + d.header_read {
                    tracing::debug!("closing a connection that sent no request head in time");
                    metrics::counter!(crate::metrics::CONNECTIONS_CUT, "reason" => "header_read_timeout").increment(1);
                    return;
                }
                if activity.headed.load(Ordering::Relaxed) && now >= activity.last() + d.idle {
                    tracing::debug!("shutting down an idle connection");
                    metrics::counter!(crate::metrics::CONNECTIONS_CUT, "reason" => "idle_timeout").increment(1);
                    conn.as_mut().graceful_shutdown();
                    closing = Some(now + CLOSE_GRACE);
                }
            }
        }
    }
}

/// An IO that records when a byte last moved.
struct Watched<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
