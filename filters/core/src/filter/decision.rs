//! What a stage of the request path decides. The stages ([`super::stages`]) return these; the
//! filter applies them in one place (`AuthFilter::apply`), which is where host calls that answer
//! or forward the request happen.

use crate::responses::LookupPlan;
use crate::usage::Identity;
use std::borrow::Cow;
use tollgate_wire::responses::Replay;
use tollgate_wire::{DecideRequest, Header};

/// Where an allow came from (each has its own counter besides `tollgate.requests.allowed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The sidecar's answer to this request's decision call.
    Sidecar,
    /// A reusable answer from the auth cache.
    AuthCache,
    /// A unit of this Envoy's lease of the key.
    Lease,
}

/// Let the request go upstream as this identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub who: Identity,
    /// `x-tollgate-*` headers the decision adds for the upstream.
    pub request_headers: Vec<Header>,
    /// Headers the decision adds to the response (rate-limit headers, say).
    pub response_headers: Vec<Header>,
    pub source: Source,
}

/// Refuse the request with a JSON error (a local reply, counted as a denial).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// 400–599.
    pub status: u16,
    pub code: Cow<'static, str>,
    pub message: Cow<'static, str>,
    /// The limit that refused it, when a limit did.
    pub limit: Option<String>,
    /// Extra response headers (`retry-after`, the sidecar's rate-limit headers).
    pub headers: Vec<Header>,
}

impl Denial {
    /// A denial the filter decides by itself.
    pub fn local(status: u16, code: &'static str, message: impl Into<Cow<'static, str>>) -> Denial {
        Denial { status, code: Cow::Borrowed(code), message: message.into(), limit: None, headers: Vec::new() }
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Denial {
        self.headers.push(Header::new(name, value));
        self
    }
}

/// The outcome of a stage that ends the request path (or of the sidecar's answer).
// One decision lives per request, moved once: boxing the decision request would cost an
// allocation per call for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Decision {
    Allow(Grant),
    Deny(Denial),
    /// Ask the sidecar (the request waits for its answer).
    Call(DecideRequest),
    /// Decide once the request body is in (token estimate, cache key, idempotency digest);
    /// Envoy buffers it meanwhile.
    AwaitBody(DecideRequest, Option<LookupPlan>),
    /// Answer with a stored response (a cache hit, an idempotent replay): nothing goes upstream.
    Replay { who: Identity, response_headers: Vec<Header>, replay: Box<Replay> },
    /// The sidecar could not decide (why): the failure mode applies.
    Fail(String),
}
