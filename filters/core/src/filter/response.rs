//! The response side of one request: the headers its decision adds, what it keeps of the
//! response body (bounded; for token usage or to store the response), and what it holds until it
//! ends (a ticket, an identity to meter). Never pauses: streaming responses flow through (the
//! auth filter holds only the end of an idempotent response until its outcome is stored).

use super::kept::Kept;
use super::MAX_USAGE_BODY;
use crate::host::Host;
use crate::responses::queue::PendingStore;
use crate::responses::{cacheable_response, freshness_ms, storable_headers};
use crate::stats::Metric;
use crate::usage::{read_tokens, usage_unparsable, Identity};
use tollgate_wire::responses::{Replay, ReplayKind, StoreItem, StoredResponse, CACHE_STATUS_HEADER, REPLAYED_HEADER, REPLAY_TRUNCATED_HEADER};
use tollgate_wire::{Header, Ticket};

/// One request's response side.
#[derive(Debug)]
pub struct ResponseSide {
    /// Headers the decision adds to the response.
    pub headers: Vec<Header>,
    /// `x-tollgate-cache` for the response (`miss`, `bypass`), on routes that cache.
    pub cache_status: Option<&'static str>,
    /// The request was answered with a stored response (nothing went upstream).
    pub replayed: bool,
    /// The allowed request was answered by the gateway itself, never sent upstream (an open
    /// breaker): it used no tokens.
    pub no_upstream: bool,
    /// Held until the request completes, then reported as a completion.
    pub ticket: Option<Ticket>,
    /// Who the request was let through as (kept when metering is on).
    pub identity: Option<Identity>,
    /// The response status, read when a ticket or metering needs it.
    pub status: u16,
    /// The response body so far, when it is kept.
    pub body: Option<Vec<u8>>,
    /// Token usage is read from the kept body.
    pub want_tokens: bool,
    /// The response says it is an event stream (`text/event-stream`): its `data:` frames are
    /// read for token usage (crate::usage::read_tokens).
    event_stream: bool,
    /// Bytes of response body kept at most.
    body_limit: usize,
    /// The response may be stored (a cache miss, an idempotency claim) once complete.
    pub pending_store: Option<PendingStore>,
    /// The kept body's bytes, taken from the worker's budget (super::kept).
    pub kept: Kept,
    /// The kept body lost its front (an event stream kept only for its usage): never stored.
    cut: bool,
    /// The response's end went by (its last body chunk, headers or trailers that end it, a
    /// replay).
    ended: bool,
    /// The response's content type can carry token usage (JSON, an event stream).
    usage_type: bool,
    /// The response came encoded (`content-encoding` other than `identity`): its bytes cannot be
    /// read for usage.
    encoded: bool,
    /// Set by [`ResponseSide::finish`]: token usage was to be read and could not be (the body
    /// not kept whole, or the response cut short), as opposed to read and absent.
    pub tokens_unread: bool,
}

impl Default for ResponseSide {
    fn default() -> Self {
        ResponseSide {
            headers: Vec::new(),
            cache_status: None,
            replayed: false,
            no_upstream: false,
            ticket: None,
            identity: None,
            status: 0,
            body: None,
            want_tokens: false,
            event_stream: false,
            body_limit: MAX_USAGE_BODY,
            pending_store: None,
            kept: Kept::default(),
            cut: false,
            ended: false,
            usage_type: false,
            encoded: false,
            tokens_unread: false,
        }
    }
}

impl ResponseSide {
    /// Takes the ticket of an allow; its token budgets are settled from the response's usage.
    pub fn hold(&mut self, ticket: Ticket, token_usage_from_response: bool) {
        if !ticket.budgets.is_empty() && token_usage_from_response {
            self.body = Some(Vec::new());
            self.want_tokens = true;
        }
        self.ticket = Some(ticket);
    }

    /// The response headers are in: qualify a pending store, add the decision's headers, and
    /// decide what to keep of the body. `key_headers`: the route's cache key headers.
    pub fn on_headers(&mut self, host: &mut impl Host, token_usage_from_response: bool, key_headers: &[String], end_of_stream: bool) {
        if self.replayed {
            // our own local reply: its headers are complete already
            return;
        }
        self.ended |= end_of_stream;
        if let Some(p) = &mut self.pending_store {
            let status = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
            // An upstream may send any byte in a header value (Latin-1, say). Such a response is
            // not cached (a replay could not carry it as sent); an idempotent outcome is still
            // stored — the operation ran — without those headers.
            let raw = host.response_headers();
            let all_utf8 = raw.iter().all(|(_, v)| std::str::from_utf8(v).is_ok());
            let headers: Vec<(String, String)> =
                raw.into_iter().filter_map(|(n, v)| String::from_utf8(v).ok().map(|v| (n, v))).collect();
            p.status = status;
            // a gRPC failure answered in the headers alone (trailers-only) is no success
            let grpc_ok = headers.iter().all(|(n, v)| n != "grpc-status" || v.trim() == "0");
            p.storable = grpc_ok
                && if p.is_idempotency() {
                    (200..=299).contains(&status)
                } else {
                    // a response stale when it arrives (its own lifetime spent) is not stored
                    p.max_age_ms = freshness_ms(&headers);
                    all_utf8 && cacheable_response(status, &headers, key_headers) && p.max_age_ms != Some(0)
                };
            p.complete = end_of_stream;
            if p.storable {
                p.headers = storable_headers(&headers);
                self.body.get_or_insert_with(Vec::new);
            }
        }
        for h in std::mem::take(&mut self.headers) {
            host.add_response_header(&h.name, &h.value);
        }
        if let Some(v) = self.cache_status {
            host.add_response_header(CACHE_STATUS_HEADER, v);
        }
        if self.ticket.is_some() || self.identity.is_some() {
            self.status = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        }
        // Metering reads token usage from LLM-style responses too (JSON or an SSE stream).
        if self.identity.is_some() && !self.want_tokens && token_usage_from_response {
            let content_type = host.response_header("content-type").unwrap_or_default();
            if content_type.contains("json") || content_type.contains("event-stream") {
                self.body.get_or_insert_with(Vec::new);
                self.want_tokens = true;
                self.usage_type = true;
                self.event_stream = is_event_stream(&content_type);
            }
        } else if self.want_tokens {
            // a token budget reads the body whatever its type; its frames only from a stream
            let content_type = host.response_header("content-type").unwrap_or_default();
            self.usage_type = content_type.contains("json") || content_type.contains("event-stream");
            self.event_stream = is_event_stream(&content_type);
        }
        if self.usage_type {
            self.encoded = host.response_header("content-encoding").is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"));
        }
        self.body_limit = match (&self.pending_store, self.want_tokens) {
            (Some(p), false) if p.storable => p.max_body,
            _ => MAX_USAGE_BODY,
        };
    }

    /// The response ended with its trailers.
    pub fn end(&mut self) {
        self.ended = true;
    }

    /// Keeps a chunk of the response body (bounded) when token usage must be read from it or the
    /// response may be stored: the `chunk_size` bytes at `offset` of the body buffer Envoy
    /// presents (after a held chunk, that buffer still starts with the held bytes, seen already).
    pub fn on_body(&mut self, host: &impl Host, offset: usize, chunk_size: usize, end_of_stream: bool) {
        if self.replayed {
            return;
        }
        self.ended |= end_of_stream;
        // An event stream read for token usage: its usage comes in its last frames, so only its
        // last SSE_TAIL bytes are kept, however long it streams (decision 170). One that may be
        // stored is kept whole up to its bound, then given up as a stored body (`cut`) and read
        // from its tail like the others.
        let tailable = self.event_stream && self.want_tokens;
        let storing = self.pending_store.as_ref().is_some_and(|p| p.storable) && !self.cut;
        if let Some(body) = &mut self.body {
            if tailable && storing && body.len() + chunk_size > self.body_limit {
                self.cut = true;
            }
            let tail = tailable && (self.cut || !storing);
            let cut = if tail { (body.len() + chunk_size).saturating_sub(SSE_TAIL).min(body.len()) } else { 0 };
            if cut > 0 {
                body.drain(..cut);
                self.kept.give_back(cut);
            }
            // over its own bound, or the worker's: not kept (as a body too large to keep)
            if body.len() + chunk_size > self.body_limit || !self.kept.take(chunk_size) {
                self.body = None;
                self.kept.release();
            } else if chunk_size > 0 {
                match host.response_body(offset, chunk_size) {
                    Some(chunk) => body.extend_from_slice(&chunk),
                    // a chunk Envoy would not give: what is kept has a hole, so nothing is kept
                    // (never a body stored or read with bytes missing)
                    None => {
                        self.body = None;
                        self.kept.release();
                    }
                }
            }
        }
        if let (Some(p), true) = (&mut self.pending_store, end_of_stream) {
            p.complete = true;
        }
    }

    /// Answers with a stored response (a cache hit, an idempotent replay): a local reply, nothing
    /// goes upstream. The request counts like any other: its limits were taken in the decision,
    /// its ticket is reported and it is metered with the stored status. `who` is kept when
    /// metering is on.
    pub fn replay(
        &mut self,
        host: &mut impl Host,
        who: Option<Identity>,
        response_headers: Vec<Header>,
        replay: Replay,
        token_usage_from_response: bool,
    ) {
        let r = replay.response;
        let body = r.body_bytes().unwrap_or_default();
        if who.is_some() {
            self.identity = who;
        }
        if token_usage_from_response && (self.want_tokens || self.identity.is_some()) {
            self.want_tokens = true;
            self.body = Some(body.clone());
            self.event_stream = r.headers.iter().any(|h| h.name.eq_ignore_ascii_case("content-type") && is_event_stream(&h.value));
        }
        self.status = r.status;
        self.replayed = true;
        self.ended = true;
        let age = (host.now_ms().saturating_sub(r.stored_at_ms) / 1000).to_string();
        let mut headers: Vec<(&str, &str)> = r.headers.iter().map(|h| (h.name.as_str(), h.value.as_str())).collect();
        headers.extend(response_headers.iter().map(|h| (h.name.as_str(), h.value.as_str())));
        match replay.kind {
            ReplayKind::Cache => {
                headers.push((CACHE_STATUS_HEADER, "hit"));
                headers.push(("age", age.as_str()));
                host.count(Metric::CacheHit);
            }
            ReplayKind::Idempotency => {
                headers.push((REPLAYED_HEADER, "true"));
                if r.truncated {
                    headers.push((REPLAY_TRUNCATED_HEADER, "true"));
                }
                host.count(Metric::IdempotentReplay);
            }
        }
        host.count(Metric::Allowed);
        host.send_reply(r.status, &headers, &body);
    }

    /// The response is complete (its end is about to go to the client): the outcome of an
    /// idempotency claim to store now, before the client can retry (the body stays kept for
    /// token usage). `None` for anything else (cache fills wait for the request's end).
    pub fn take_idempotency_outcome(&mut self, host: &mut impl Host) -> Option<StoreItem> {
        if !self.pending_store.as_ref().is_some_and(|p| p.is_idempotency() && p.complete) {
            return None;
        }
        let p = self.pending_store.take()?;
        let body = self.body.clone().filter(|_| !self.cut);
        self.settle(host, p, body)
    }

    /// What to store of `p` ([`store_item`]), unless it is an idempotency claim whose request
    /// ended without a 2xx and without knowing whether its operation ran: then nothing is sent,
    /// and the claim stays in flight until it expires (decision 166).
    fn settle(&self, host: &mut impl Host, p: PendingStore, body: Option<Vec<u8>>) -> Option<StoreItem> {
        if p.is_idempotency() && !p.storable && !self.outcome_known(host) {
            host.count(Metric::IdempotencyOutcomeUnknown);
            return None;
        }
        store_item(p, body, host.now_ms())
    }

    /// Whether a request that ended without a 2xx is known to have left its operation undone,
    /// so that a retry may run it: the gateway answered it itself (nothing went upstream), the
    /// upstream answered (its non-2xx is its word), or it never reached an upstream (no host
    /// selected, no connection, no route, a full pool). A gateway timeout, a reset after the
    /// request went out, a client gone before the answer: not known.
    fn outcome_known(&self, host: &impl Host) -> bool {
        if self.no_upstream {
            return true;
        }
        let details = host.property(&["response", "code_details"]).unwrap_or_default();
        details == b"via_upstream" || never_sent(&details) || host.property(&["upstream", "address"]).is_none()
    }

    /// The request ended: the tokens its response used (when they were to be read) and what to
    /// store of it.
    pub fn finish(&mut self, host: &mut impl Host) -> (Option<u64>, Option<StoreItem>) {
        let body = self.body.take();
        // handed on (to the queue, bounded in bytes of its own) or dropped
        self.kept.release();
        let tokens = if self.want_tokens { body.as_deref().and_then(|b| read_tokens(b, self.event_stream)) } else { None };
        if tokens.is_some_and(|t| t.clamped) {
            host.count(Metric::TokensClamped);
        }
        let tokens = tokens.map(|t| t.count);
        // nothing went upstream: a budget's reservation used none, whatever the gateway's own
        // reply says and whether or not responses are read for usage (`tokenUsage`) — also when
        // Envoy answered itself, finding no upstream to send it to (decision 175)
        let budgeted = self.ticket.as_ref().is_some_and(|t| !t.budgets.is_empty());
        let untouched = budgeted
            && (self.no_upstream
                || (tokens.is_none() && never_sent(&host.property(&["response", "code_details"]).unwrap_or_default())));
        let tokens = if untouched { Some(0) } else { tokens };
        self.tokens_unread = !untouched && self.unread(host, tokens, body.as_deref());
        let store = match self.pending_store.take() {
            Some(p) => self.settle(host, p, body.filter(|_| !self.cut)),
            None => None,
        };
        (tokens, store)
    }
}

impl ResponseSide {
    /// The response was to be read for token usage and was not (decision 183), as opposed to
    /// read and holding none (an upstream's error JSON): a body of a type that carries usage
    /// not kept whole or encoded anyway, a response cut short, or Envoy's own reply after the request went
    /// upstream (a timeout, a reset: what the upstream spent is unknown). Not for a response that
    /// never came (the client left first: `aborted` says it; the type is learnt from the
    /// headers), a replay or the gateway's own answer.
    fn unread(&self, host: &impl Host, tokens: Option<u64>, kept: Option<&[u8]>) -> bool {
        if !self.want_tokens || tokens.is_some() || !self.usage_type || self.replayed || self.no_upstream {
            return false;
        }
        let Some(body) = kept else { return true };
        // whole, but its usage could not be parsed (decision 191)
        if !self.ended || self.encoded || usage_unparsable(body, self.event_stream) {
            return true;
        }
        let details = host.property(&["response", "code_details"]).unwrap_or_default();
        !details.is_empty() && details != b"via_upstream" && !never_sent(&details)
    }
}

/// The bytes of an event stream kept to read its token usage from: its last frames (the usage
/// frame is one of the last, well under this).
pub const SSE_TAIL: usize = 64 << 10;

/// Envoy's response code details that say the request never went to an upstream: no
/// connection (failed, or timed out), no healthy host, no route or cluster, a full connection
/// pool, a stream the upstream refused before reading it (HTTP/2 `REFUSED_STREAM`).
const NEVER_SENT: [&str; 8] = [
    "connection_failure",
    "connection_timeout",
    "refused_stream_reset",
    "no_healthy_upstream",
    "overflow",
    "route_not_found",
    "cluster_not_found",
    "maintenance_mode",
];

/// Whether Envoy's response code `details` say the request never reached an upstream
/// ([`NEVER_SENT`]).
fn never_sent(details: &[u8]) -> bool {
    let details = String::from_utf8_lossy(details);
    NEVER_SENT.iter().any(|s| details.contains(s))
}

/// What to store of a finished request's response, if anything: a complete cacheable
/// response; an idempotency claim's 2xx outcome (without its body when it was too large or
/// did not complete: the operation ran, so it is not run again) or, for any other outcome, the
/// claim's release.
fn store_item(p: PendingStore, body: Option<Vec<u8>>, now_ms: u64) -> Option<StoreItem> {
    let body = body.filter(|b| b.len() <= p.max_body && p.complete);
    let idem = p.is_idempotency();
    // an idempotency claim's ticket as the worker kept it (sealed again while the request ran)
    let ticket = p.current_ticket();
    let response = match (p.storable, body) {
        (true, Some(b)) => Some(StoredResponse::new(p.status, p.headers, b, now_ms)),
        (true, None) if idem => {
            let mut r = StoredResponse::new(p.status, p.headers, Vec::new(), now_ms);
            r.truncated = true;
            Some(r)
        }
        _ if idem => None,
        _ => return None,
    };
    Some(StoreItem { ticket, response, max_age_ms: p.max_age_ms.filter(|_| !idem) })
}

/// Whether a `content-type` names an event stream (`text/event-stream`, parameters aside, in
/// any case).
fn is_event_stream(content_type: &str) -> bool {
    content_type.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
}
