//! The sidecar's loopback HTTP server: `POST /v1/decide` for the filter (`/v1/decide/batch`
//! for several requests' decisions at once, decision 127; and its batches:
//! `/v1/completions`, `/v1/refunds`, `/v1/usage`, `/v1/responses`), `GET /v1/routes` (the
//! routing table the filters match locally), `GET /v1/changes` (the change count the filters
//! poll to drop cached answers and leases), `GET /metrics` (Prometheus text) and `GET /healthz`.
//!
//! Every call but `/healthz` and `/metrics` must carry the deployment's filter secret in
//! [`SECRET_HEADER`](tollgate_wire::SECRET_HEADER) (`[server] secret`, the plugin's
//! `sidecar.secret`): without it, or with another, 401 `unauthorized` and nothing is read or
//! written. The secret is compared in constant time and never logged.
//!
//! Replies on `/v1/decide`: 200 with a `DecideResponse` (allow or deny), 400 when the request is
//! malformed, 503 when no decision can be made now. The filter treats anything but a 200 as a
//! sidecar failure and applies its configured failure mode.

use crate::decision::hints::{Hints, Recorded};
use crate::decision::{DecideError, Decider};
use crate::store::Store;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::routing::{get, post};
use axum::Router;
use crate::invalid::{invalid, Invalid};
use crate::secret::Secret;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tollgate_wire::batch::{BatchAnswer, DecideBatch, DecideBatchAnswer, DECIDE_BATCH_PATH, MAX_DECIDE_BATCH};
use tollgate_wire::breaker::HintReport;
use tollgate_wire::compact;
use tollgate_wire::stream::StreamAnswer;
use tollgate_wire::usage::{UsageAck, UsageBatch, USAGE_PATH};
use tollgate_wire::{DecideResponse, CompletionBatch, DecideRequest, ErrorBody, COMPLETIONS_PATH, DECIDE_PATH};

/// `[server]`: the filter-facing server's trust boundary and connection deadlines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// The deployment's filter secret (env `TOLLGATE_SIDECAR_SERVER__SECRET`): every call but
    /// `/healthz` and `/metrics` must carry it, and the plugin configuration's `sidecar.secret`
    /// is the same. 16 to 256 visible ASCII characters. Never logged. This or `secret_file` is
    /// required to serve.
    pub secret: Secret,
    /// A file holding the secret (its surrounding whitespace trimmed), instead of `secret`.
    pub secret_file: Option<PathBuf>,
    /// Optional, sidecar-only (env `TOLLGATE_SIDECAR_SERVER__TICKET_KEY`): mixed into the key
    /// that seals tickets (crate::decision::tickets), so that even a caller who read the filter
    /// secret (e.g. from Envoy's configuration) cannot make or alter a ticket. The same on every
    /// sidecar of a deployment; changing it refuses the tickets in flight once (their
    /// reservations stay charged, their slots expire). Never logged.
    pub ticket_key: Secret,
    /// A connection must send a whole request head within this from accept, and every later
    /// HTTP/1.1 head within this from the previous response (which also closes an HTTP/1.1
    /// connection idle that long). Keep the Envoy cluster's `idle_timeout` below it.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// A connection on which no byte moved for this long is shut down.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// `listen` may be a non-loopback address (the API is then reachable from other hosts:
    /// put it behind a network you trust). Off: a non-loopback `listen` is refused.
    pub allow_non_loopback: bool,
    /// After SIGTERM, serve on until the filter made no call for `shutdown_quiet` (its Envoy
    /// drained and stopped), at most this long, before stopping (crate::lifecycle). 0: stop at
    /// once. In a pod, where Envoy and the sidecar get SIGTERM together: below the pod's
    /// termination grace, above Envoy's drain.
    #[serde(with = "humantime_serde")]
    pub shutdown_wait: Duration,
    /// How long without a filter call means its Envoy is gone (the filter calls at least every
    /// change poll, 50 ms, while it runs).
    #[serde(with = "humantime_serde")]
    pub shutdown_quiet: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            secret: Secret::default(),
            secret_file: None,
            ticket_key: Secret::default(),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            allow_non_loopback: false,
            shutdown_wait: Duration::ZERO,
            shutdown_quiet: Duration::from_secs(1),
        }
    }
}

impl ServerConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if !self.secret.is_empty() && self.secret_file.is_some() {
            return Err(invalid("server.secret", "set server.secret or server.secret_file, not both"));
        }
        if !self.secret.is_empty() && !crate::secret::well_formed(self.secret.expose()) {
            return Err(invalid("server.secret", "16 to 256 visible ASCII characters"));
        }
        if !self.ticket_key.is_empty() && self.ticket_key.expose().len() < 16 {
            return Err(invalid("server.ticket_key", "at least 16 characters"));
        }
        if self.header_read_timeout.is_zero() || self.idle_timeout.is_zero() {
            return Err(invalid("server.header_read_timeout and server.idle_timeout", "must be above zero"));
        }
        if self.shutdown_quiet.is_zero() {
            return Err(invalid("server.shutdown_quiet", "must be above zero"));
        }
        Ok(())
    }

    /// The filter secret in force: `secret`, or the content of `secret_file`. Required to serve.
    pub fn resolve_secret(&self) -> Result<Secret, Invalid> {
        let secret = match &self.secret_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid("server.secret_file", format!("cannot read {}: {e}", path.display())))?;
                Secret::new(text.trim())
            }
            None => self.secret.clone(),
        };
        if secret.is_empty() {
            return Err(invalid(
                "server.secret",
                "required: set server.secret or server.secret_file (the plugin's sidecar.secret is the same)",
            ));
        }
        if !crate::secret::well_formed(secret.expose()) {
            return Err(invalid("server.secret_file", "the secret must be 16 to 256 visible ASCII characters"));
        }
        Ok(secret)
    }
}

/// The body limit of `POST /v1/responses` (the other endpoints: [`tollgate_wire::BODY_LIMIT`]).
pub const RESPONSES_BODY_LIMIT: usize = tollgate_wire::responses::RESPONSES_BODY_LIMIT;

pub struct AppState {
    /// The deployment's filter secret.
    pub secret: Secret,
    pub decider: Arc<Decider>,
    pub store: Store,
    pub prometheus: PrometheusHandle,
    /// Circuit-breaker hints (crate::decision::hints).
    pub hints: Hints,
    /// Usage metering (crate::usage), when enabled.
    pub usage: Option<Arc<crate::usage::Usage>>,
    /// One span per decision when traces are on (crate::trace).
    pub tracer: crate::trace::Tracer,
    /// Responses stored in Redis (`[responses]`).
    pub responses: crate::decision::responses::ResponsesConfig,
    /// When the filter last called: a stop waits until it is quiet (crate::lifecycle).
    pub filter_calls: Arc<crate::lifecycle::FilterCalls>,
    /// Cancelled when the server stops: what serves a long-lived stream ends it then
    /// (crate::stream).
    pub stopping: tokio_util::sync::CancellationToken,
}

/// The filter-facing API; `streams` holds the routes of long-lived streams (crate::stream, which
/// builds on this module: passed in rather than named here), behind the same secret.
pub fn router(state: Arc<AppState>, streams: Router<Arc<AppState>>) -> Router {
    let api = Router::new()
        .route(DECIDE_PATH, post(decide))
        .route(DECIDE_BATCH_PATH, post(decide_batch))
        .merge(streams)
        .route(COMPLETIONS_PATH, post(completions))
        .route(tollgate_wire::refunds::REFUNDS_PATH, post(refunds))
        .route(USAGE_PATH, post(usage))
        // Response batches carry bodies (JSON-escaped or base64): the filter bounds a batch's
        // serialized size by MAX_RESPONSE_BATCH_BYTES (4 MiB); a single item may be larger.
        .route(
            tollgate_wire::responses::RESPONSES_PATH,
            post(responses).layer(axum::extract::DefaultBodyLimit::max(RESPONSES_BODY_LIMIT)),
        )
        .route(tollgate_wire::responses::CLAIMS_PATH, post(claims))
        .route(tollgate_wire::routes::ROUTES_PATH, get(routes))
        .route(tollgate_wire::changes::CHANGES_PATH, get(changes))
        .route(tollgate_wire::breaker::HINTS_PATH, get(list_hints).post(record_hint))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_secret))
        // the filter's batches are bounded below this (filters/core: completions, usage)
        .layer(axum::extract::DefaultBodyLimit::max(tollgate_wire::BODY_LIMIT));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .merge(api)
        .layer(middleware::map_response(crate::errors::json_errors))
        .with_state(state)
}

/// Lets a call on only with the filter secret; 401 `unauthorized` otherwise (before its body is
/// read).
async fn require_secret(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let given = req.headers().get(tollgate_wire::SECRET_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
    if state.secret.matches(given) {
        state.filter_calls.touch();
        return next.run(req).await;
    }
    let known = [
        DECIDE_PATH,
        DECIDE_BATCH_PATH,
        tollgate_wire::stream::DECIDE_STREAM_PATH,
        COMPLETIONS_PATH,
        tollgate_wire::refunds::REFUNDS_PATH,
        USAGE_PATH,
        tollgate_wire::responses::RESPONSES_PATH,
        tollgate_wire::responses::CLAIMS_PATH,
        tollgate_wire::routes::ROUTES_PATH,
        tollgate_wire::changes::CHANGES_PATH,
        tollgate_wire::breaker::HINTS_PATH,
    ];
    let path: &'static str = known.into_iter().find(|p| *p == req.uri().path()).unwrap_or("other");
    metrics::counter!(crate::metrics::UNAUTHORIZED, "path" => path).increment(1);
    error(StatusCode::UNAUTHORIZED, "unauthorized", format!("the filter secret ({}) is missing or wrong", tollgate_wire::SECRET_HEADER))
}

/// Whether a decision call accepts a compact answer (decision 224): its `accept` names the
/// compact media type (any parameters, any case, among others).
fn accepts_compact(headers: &HeaderMap) -> bool {
    headers.get_all(header::ACCEPT).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(|t| {
        t.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case(compact::COMPACT_MEDIA_TYPE))
    })
}

fn json(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn error(status: StatusCode, code: &str, message: String) -> Response {
    let body = serde_json::to_vec(&ErrorBody { error: code.into(), message, limit: None }).unwrap_or_default();
    json(status, body)
}

async fn decide(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let req: DecideRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid decision request: {e}")),
    };
    let decided = decide_one(&state, &req, headers.get(tollgate_wire::TRACEPARENT_HEADER).map(|v| v.as_bytes())).await;
    crate::testing::decide_answer_delay().await;
    let compact = accepts_compact(&headers);
    metrics::counter!(crate::metrics::DECIDE_CALLS, "format" => if compact { "compact" } else { "json" }).increment(1);
    match decided {
        Ok(resp) if compact => {
            // decision 224: the filter reads it in a fraction of the JSON's cost
            match compact::encode_answer(&StreamAnswer { seq: 0, status: 200, decision: Some(resp), error: None }) {
                Ok(b) => ([(header::CONTENT_TYPE, compact::COMPACT_MEDIA_TYPE)], b).into_response(),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e),
            }
        }
        Ok(resp) => match serde_json::to_vec(&resp) {
            Ok(b) => json(StatusCode::OK, b),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
        },
        Err(DecideError::BadRequest(m)) => error(StatusCode::BAD_REQUEST, "bad_request", m),
        Err(DecideError::Unavailable(m)) => error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", m),
    }
}

/// One request's decision, timed and traced: what `/v1/decide` and each item of
/// `/v1/decide/batch` answer.
pub(crate) async fn decide_one(state: &AppState, req: &DecideRequest, traceparent: Option<&[u8]>) -> Result<DecideResponse, DecideError> {
    let started = std::time::Instant::now();
    let traced = state.tracer.begin(traceparent);
    let (decided, redis) = match traced {
        Some(_) => crate::trace::with_redis_clock(state.decider.decide(req)).await,
        None => (state.decider.decide(req).await, std::time::Duration::ZERO),
    };
    let outcome = match &decided {
        Ok(DecideResponse::Allow { .. }) => "allow",
        Ok(DecideResponse::Deny { .. }) => "deny",
        Err(_) => "unavailable",
    };
    metrics::histogram!(crate::metrics::DECISION_SECONDS, "outcome" => outcome).record(started.elapsed().as_secs_f64());
    if let Some(t) = traced {
        let tenant = match &decided {
            Ok(DecideResponse::Allow { tenant, .. }) => Some(tenant.clone()),
            Ok(DecideResponse::Deny { .. }) | Err(_) => None,
        };
        state.tracer.finish(t, tenant, outcome, redis);
    }
    decided
}

/// Decides a worker's batch (decision 127): every item as `/v1/decide` would, concurrently (the
/// items are different requests, as independent as separate calls; the multiplexed Redis
/// connection pipelines their scripts), answered in the items' order. 400 for a body that is not
/// a batch or holds more than [`MAX_DECIDE_BATCH`] items: the filter fails each item then.
async fn decide_batch(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let batch: DecideBatch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid decision batch: {e}")),
    };
    if batch.requests.len() > MAX_DECIDE_BATCH {
        let message = format!("a decision batch holds at most {MAX_DECIDE_BATCH} requests");
        return error(StatusCode::BAD_REQUEST, "bad_request", message);
    }
    let decided = futures::future::join_all(
        batch.requests.iter().map(|i| decide_one(&state, &i.request, i.traceparent.as_deref().map(str::as_bytes))),
    )
    .await;
    crate::testing::decide_answer_delay().await;
    let answers = decided
        .into_iter()
        .map(|d| match d {
            Ok(decision) => BatchAnswer { status: 200, decision: Some(decision), error: None },
            Err(DecideError::BadRequest(_)) => BatchAnswer { status: 400, decision: None, error: Some("bad_request".into()) },
            Err(DecideError::Unavailable(_)) => BatchAnswer { status: 503, decision: None, error: Some("store_unavailable".into()) },
        })
        .collect();
    match serde_json::to_vec(&DecideBatchAnswer { answers }) {
        Ok(b) => json(StatusCode::OK, b),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
    }
}

/// Settles a batch of completion reports. 200 when every report is settled (or refused, which
/// retrying cannot fix: `invalid`, a malformed ticket; `refused`, a ticket this deployment did not
/// seal, altered, or expired — each report on its own, so one bad ticket costs no good report);
/// 503 when Redis failed, so the filter retries the batch — settling is idempotent, so reports
/// already settled are not counted twice.
async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let batch: CompletionBatch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid completion batch: {e}")),
    };
    // Reports of different requests are independent: settle them concurrently, so the
    // multiplexed Redis connection pipelines them (a batch costs about one round trip per chunk).
    let (mut invalid, mut refused) = (0usize, 0usize);
    for chunk in batch.completions.chunks(64) {
        let results = futures::future::join_all(chunk.iter().map(|c| state.decider.complete(c))).await;
        for r in results {
            match r {
                Ok(()) => {}
                Err(crate::decision::complete::CompleteError::BadTicket(what)) => {
                    invalid += 1;
                    tracing::debug!(field = %what, "refused a completion with an invalid ticket");
                }
                Err(crate::decision::complete::CompleteError::Refused(why)) => {
                    refused += 1;
                    tracing::debug!(reason = why.as_str(), "refused a completion's ticket");
                }
                Err(crate::decision::complete::CompleteError::Store(e)) => {
                    return error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", e.to_string());
                }
            }
        }
    }
    let settled = batch.completions.len() - invalid - refused;
    json(StatusCode::OK, format!(r#"{{"settled":{settled},"invalid":{invalid},"refused":{refused}}}"#).into_bytes())
}

/// Refunds a batch of abandoned decisions (issue 15.2). 200 when each is settled for good
/// (given back, nothing to give back, or invalid); 503 when Redis failed, so the filter sends the
/// batch again — a refund is idempotent, so what was given back is not given back twice.
async fn refunds(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let batch: tollgate_wire::refunds::RefundBatch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid refund batch: {e}")),
    };
    for chunk in batch.abandoned.chunks(64) {
        for r in futures::future::join_all(chunk.iter().map(|a| state.decider.refund(a))).await {
            if let Err(crate::decision::refund::RefundFailed::Store(e)) = r {
                return error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", e.to_string());
            }
        }
    }
    json(StatusCode::OK, format!(r#"{{"settled":{}}}"#, batch.abandoned.len()).into_bytes())
}

/// Takes a batch of usage events: 200 [`UsageAck`] once the valid ones are durable in the spool
/// (the filter may forget the batch); invalid events are refused for good and counted. 503 when
/// the spool cannot take them now (full, disk error): the filter keeps the batch and retries.
/// 404 when metering is off here.
async fn usage(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let Some(usage) = &state.usage else {
        return error(StatusCode::NOT_FOUND, "usage_disabled", "usage metering is not enabled on this sidecar".into());
    };
    let mut batch: UsageBatch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid usage batch: {e}")),
    };
    let clamped = batch.events.iter_mut().map(crate::usage::normalize).filter(|c| *c).count();
    usage.price(&mut batch.events);
    if clamped > 0 {
        metrics::counter!(crate::metrics::TOKENS_CLAMPED, "source" => "usage").increment(clamped as u64);
    }
    let total = batch.events.len();
    let valid: Vec<_> = batch
        .events
        .into_iter()
        .filter(|e| match crate::usage::invalid_reason(e) {
            None => true,
            Some(field) => {
                tracing::debug!(field, "refused a usage event");
                false
            }
        })
        .collect();
    let invalid = (total - valid.len()) as u64;
    if invalid > 0 {
        metrics::counter!(crate::metrics::USAGE_EVENTS, "outcome" => "invalid").increment(invalid);
    }
    let accepted = valid.len() as u64;
    match usage.accept(valid).await {
        Ok(()) => {
            let ack = UsageAck { accepted, invalid };
            json(StatusCode::OK, serde_json::to_vec(&ack).unwrap_or_default())
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, "usage_unavailable", e.to_string()),
    }
}

/// Stores (or releases) a batch of finished responses: cache entries and idempotency outcomes
/// (crate::decision::responses); an item whose ticket this deployment did not seal, altered or
/// expired is refused. Always 200 with the counts once the batch is read: storing is best effort
/// and the filter does not retry (a lost entry is a later miss; a lost outcome's claim expires).
async fn responses(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let batch: tollgate_wire::responses::StoreBatch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid response batch: {e}")),
    };
    let routing = state.decider.routing();
    let (tickets, now_ms) = (state.decider.tickets(), state.decider.now_ms());
    let with = crate::decision::responses::Storing {
        route_cache: |route: &str| routing.cache(route),
        tickets,
        now_ms,
        tenant_max_bytes: state.responses.tenant_max_bytes(),
        in_flight_ms: state.responses.idempotency_in_flight.as_millis() as u64,
    };
    let ack = crate::decision::responses::store_batch(&state.store, &batch, with).await;
    json(StatusCode::OK, serde_json::to_vec(&ack).unwrap_or_default())
}

/// Keeps the idempotency claims of requests still running (decision 186): 200 with each claim's
/// ticket sealed again or `null` (not kept: stop asking), 503 when Redis did not answer (asked
/// again), 400 for a batch it cannot read or of more than `MAX_CLAIM_BATCH` claims.
async fn claims(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let batch: tollgate_wire::responses::ClaimRenewal = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", format!("invalid claim batch: {e}")),
    };
    if batch.claims.len() > tollgate_wire::responses::MAX_CLAIM_BATCH {
        return error(StatusCode::BAD_REQUEST, "bad_request", format!("at most {} claims a batch", tollgate_wire::responses::MAX_CLAIM_BATCH));
    }
    let (tickets, now_ms, in_flight) = (state.decider.tickets(), state.decider.now_ms(), state.decider.in_flight_ms());
    match crate::decision::responses::keep_claims(&state.store, &batch, tickets, now_ms, in_flight).await {
        Ok(kept) => json(StatusCode::OK, serde_json::to_vec(&kept).unwrap_or_default()),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "redis_unavailable", "claims could not be kept now: ask again".into()),
    }
}

/// The routing table for the filters. `If-None-Match` with the current etag → 304, no body: a
/// filter's periodic refresh costs a few bytes while nothing changes.
async fn routes(State(state): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    let routing = state.decider.routing();
    let etag = &routing.table.etag;
    let unchanged = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_matches('"') == etag);
    if unchanged {
        return StatusCode::NOT_MODIFIED.into_response();
    }
    match serde_json::to_vec(&routing.table) {
        Ok(b) => json(StatusCode::OK, b),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
    }
}

/// The change count (tollgate_wire::changes): one root context per Envoy polls it every
/// `changes.pollInterval` (50 ms); answered from memory, ~30 bytes.
async fn changes(State(state): State<Arc<AppState>>) -> Response {
    json(StatusCode::OK, serde_json::to_vec(&state.decider.changes()).unwrap_or_default())
}

async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    let redis = if state.store.is_up() { "up" } else { "down" };
    json(StatusCode::OK, format!(r#"{{"status":"ok","redis":"{redis}"}}"#).into_bytes())
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.prometheus.render()).into_response()
}

/// `POST /v1/breaker/hints`: 204 stored, 202 accepted but not shared (Redis trouble), 400 bad.
async fn record_hint(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let report: HintReport = match serde_json::from_slice(&body) {
        Ok(r) => r,
        // (a serde message quotes what it read: it goes through the JSON encoder)
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_request", e.to_string()),
    };
    match state.hints.record(&state.store, &report).await {
        Ok(Recorded::Shared) => StatusCode::NO_CONTENT.into_response(),
        Ok(Recorded::NotShared) => StatusCode::ACCEPTED.into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, "bad_request", e.to_string()),
    }
}

/// `GET /v1/breaker/hints`: always 200; empty while Redis is unreachable.
async fn list_hints(State(state): State<Arc<AppState>>) -> Response {
    let list = state.hints.list(&state.store).await;
    json(StatusCode::OK, serde_json::to_vec(&list).unwrap_or_default())
}
