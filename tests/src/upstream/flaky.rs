//! An in-process upstream that fails on command: it answers `200 {"servedBy": name}` while
//! healthy, the commanded status while failing, optionally after a delay, and counts every
//! request it sees (so a test can prove that a request never reached it).

use super::InProcess;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Response;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug)]
struct Control {
    name: String,
    status: AtomicU16,
    delay_ms: AtomicU64,
    seen: AtomicU64,
}

/// The handle on a running flaky upstream; stops it on drop.
pub struct Flaky {
    pub port: u16,
    control: Arc<Control>,
    _server: InProcess,
}

impl Flaky {
    /// Answer every request with `status` from now on.
    pub fn fail_with(&self, status: u16) {
        self.control.status.store(status, Ordering::SeqCst);
    }
    /// Answer 200 again.
    pub fn heal(&self) {
        self.fail_with(200);
    }
    /// Hold every response this long before answering.
    pub fn delay(&self, d: Duration) {
        self.control.delay_ms.store(d.as_millis() as u64, Ordering::SeqCst);
    }
    /// Requests seen so far (counted on arrival, before any delay).
    pub fn seen(&self) -> u64 {
        self.control.seen.load(Ordering::SeqCst)
    }
}

async fn handle(State(c): State<Arc<Control>>) -> Response {
    c.seen.fetch_add(1, Ordering::SeqCst);
    let delay = c.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        // the slowness is what the test asked for (a slow upstream: breaker timeouts), not a wait
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let status = StatusCode::from_u16(c.status.load(Ordering::SeqCst)).unwrap_or(StatusCode::OK);
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-served-by", c.name.as_str())
        .body(Body::from(format!(r#"{{"servedBy":"{}","status":{}}}"#, c.name, status.as_u16())))
        .unwrap_or_default()
}

/// Starts a healthy flaky upstream named `name` on a free port.
pub fn start_flaky(name: &str) -> Flaky {
    let control = Arc::new(Control {
        name: name.to_string(),
        status: AtomicU16::new(200),
        delay_ms: AtomicU64::new(0),
        seen: AtomicU64::new(0),
    });
    let c = control.clone();
    let server = super::start_in_process(move |listener, stop| async move {
        let app = axum::Router::new().fallback(handle).with_state(c);
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.await;
            })
            .await;
    });
    Flaky { port: server.port, control, _server: server }
}
