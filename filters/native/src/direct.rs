//! The module's own connection to the sidecar (issue 41 part 2, decision 219): a stream's calls
//! go out on one HTTP/2 connection the module holds, instead of one Envoy callout each.
//!
//! Envoy's async HTTP client costs Envoy ~140 k instructions a decision (a new HTTP/2 stream
//! through its connection pool, router and codec on the worker thread). Here a thread of the
//! module's own runs a single-threaded tokio runtime holding one HTTP/2 connection (h2c, prior
//! knowledge, as the sidecar serves it) to `sidecar.address`: each call is a stream on it,
//! multiplexed, so a slow decision holds back no other. The answer is handed to the stream through
//! its [`Link`]: stored, then the stream's scheduler wakes its worker thread
//! (`on_http_filter_scheduled`), where the core takes it as it takes a callout's.
//!
//! Failure is what a callout's is: a call that gets no whole answer within its timeout (the
//! sidecar down, hung, or the connection lost) is answered "failed" and the core applies the
//! failure mode. A connection that failed is dropped and the next call opens another; a call
//! that times out only resets its own stream.

use crate::ffi::Filter;
use crate::scheduler::StreamScheduler;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::time::Duration;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tollgate_filter_core::host::CallSpec;
use tollgate_filter_core::sidecar::SidecarAddress;

/// The largest answer taken from the sidecar (a decision batch is far smaller).
const MAX_ANSWER: usize = 16 << 20;

/// How often an idle or busy connection is pinged, and how long a ping may go unanswered.
const PING_EVERY: Duration = Duration::from_millis(500);
const PING_TIMEOUT: Duration = Duration::from_secs(1);

/// A call's answer: the `:status` and body, both absent when the call failed.
pub type Answer = (Option<u16>, Vec<u8>);

struct Job {
    call: CallSpec,
    reply: Box<dyn FnOnce(Answer) + Send>,
}

/// The connection's owner: calls are handed to its thread.
pub struct Direct {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Direct {
    /// Starts the thread; it connects at the first call.
    pub fn start(address: SidecarAddress) -> std::io::Result<Direct> {
        let (jobs, queue) = mpsc::unbounded_channel();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
        std::thread::Builder::new().name("tollgate-sidecar".into()).spawn(move || runtime.block_on(serve(address, queue)))?;
        Ok(Direct { jobs })
    }

    /// Sends `call`; `reply` gets its answer on the connection's thread.
    pub fn send(&self, call: CallSpec, reply: impl FnOnce(Answer) + Send + 'static) -> Result<(), String> {
        self.jobs.send(Job { call, reply: Box::new(reply) }).map_err(|_| "the sidecar connection's thread stopped".to_string())
    }
}

/// Takes calls until the [`Direct`] is dropped (its configuration gone); each runs as a task.
async fn serve(address: SidecarAddress, mut queue: mpsc::UnboundedReceiver<Job>) {
    let connection: Arc<tokio::sync::Mutex<Option<SendRequest<Full<Bytes>>>>> = Arc::default();
    let address = Arc::new(address);
    while let Some(job) = queue.recv().await {
        let (connection, address) = (connection.clone(), address.clone());
        tokio::spawn(async move {
            let timeout = job.call.timeout;
            let answer = match tokio::time::timeout(timeout, call(&connection, &address, job.call)).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) | Err(_) => (None, Vec::new()),
            };
            (job.reply)(answer);
        });
    }
}

/// One call on the connection (opened first if there is none or it closed).
async fn call(connection: &tokio::sync::Mutex<Option<SendRequest<Full<Bytes>>>>, address: &SidecarAddress, spec: CallSpec) -> Result<Answer, String> {
    let mut sender = {
        let mut slot = connection.lock().await;
        match slot.as_ref().filter(|s| !s.is_closed()) {
            Some(s) => s.clone(),
            None => {
                let opened = open(address).await?;
                *slot = Some(opened.clone());
                opened
            }
        }
    };
    let request = request(spec)?;
    sender.ready().await.map_err(|e| e.to_string())?;
    // a connection that failed is closed, and replaced at the next call (above)
    let response = sender.send_request(request).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = Limited::new(response.into_body(), MAX_ANSWER).collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((Some(status), body.to_vec()))
}

async fn open(address: &SidecarAddress) -> Result<SendRequest<Full<Bytes>>, String> {
    match address {
        SidecarAddress::Tcp(a) => {
            let stream = tokio::net::TcpStream::connect(a).await.map_err(|e| e.to_string())?;
            let _ = stream.set_nodelay(true);
            handshake(stream).await
        }
        SidecarAddress::Unix(path) => handshake(tokio::net::UnixStream::connect(path).await.map_err(|e| e.to_string())?).await,
    }
}

/// HTTP/2 on `stream`, pinged while it lives: a connection that goes silent without closing (a
/// frozen peer) fails its pings, is closed, and the next call opens another. A sidecar that is
/// only slow to decide (Redis hung) still answers pings, and keeps its connection.
async fn handshake<S>(stream: S) -> Result<SendRequest<Full<Bytes>>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(PING_EVERY)
        .keep_alive_timeout(PING_TIMEOUT)
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(sender)
}

/// The call as an HTTP request: its pseudo-headers as the method and URI, the rest as headers.
fn request(spec: CallSpec) -> Result<hyper::Request<Full<Bytes>>, String> {
    let pseudo = |name: &str| spec.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    let uri = format!("http://{}{}", pseudo(":authority").unwrap_or("tollgate-sidecar"), pseudo(":path").unwrap_or("/"));
    let mut builder = hyper::Request::builder().method(pseudo(":method").unwrap_or("GET")).uri(uri);
    for (name, value) in spec.headers.iter().filter(|(n, _)| !n.starts_with(':')) {
        builder = builder.header(name.as_str(), value.as_str());
    }
    builder.body(Full::new(Bytes::from(spec.body))).map_err(|e| e.to_string())
}

/// A stream's side of its direct calls: the answers in, and the scheduler that wakes the stream
/// for them. Shared by the stream and its calls in flight; the last one drops the scheduler.
pub struct Link {
    scheduler: StreamScheduler,
    answers: Mutex<Vec<(u32, Answer)>>,
    next: AtomicU32,
}

/// Direct calls are numbered from here: apart from Envoy's callout ids (1 up).
const FIRST_ID: u32 = 1 << 31;

impl Link {
    /// For the stream of the current hook.
    pub fn new(filter: Filter) -> Option<Link> {
        Some(Link { scheduler: StreamScheduler::new(filter)?, answers: Mutex::default(), next: AtomicU32::new(FIRST_ID) })
    }

    pub fn next_id(&self) -> u32 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The answer to call `id` is in: kept, and the stream woken (on its worker thread).
    pub fn answer(&self, id: u32, answer: Answer) {
        self.answers.lock().unwrap_or_else(|p| p.into_inner()).push((id, answer));
        self.scheduler.commit(0);
    }

    /// The answers in since the last take.
    pub fn take(&self) -> Vec<(u32, Answer)> {
        std::mem::take(&mut *self.answers.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
