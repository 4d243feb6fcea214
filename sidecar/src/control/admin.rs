//! The admin HTTP API (docs/openapi.json): CRUD for tenants, products, plans and routes; issue,
//! revoke and list API keys. Its own loopback listener, a bearer token on every `/v1` call.
//!
//! Every write: validate against a copy of the configuration in force (bad input → 400 naming
//! the field, nothing changes), commit to the store of record, install locally, then
//! `INCR cfg:routing:version` + `PUBLISH config_changed:{tenant}` (crate::control::propagation). The token
//! is compared in constant time and never logged.

use crate::control::model::{self, Change, Kind, Snapshot};
use crate::control::salvage::salvage;
use crate::control::{Control, Source};
pub use super::admin_http::AdminState;
use super::admin_http::{error, reply, unavailable};
use crate::control::source::postgres::Row;
use crate::control::source::SourceError;
use crate::invalid::{invalid, Invalid};
use crate::keys::Id;
use crate::secret::Secret;
use tokio_util::task::TaskTracker;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `[admin]`: the admin HTTP API (off unless `listen` is set).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Loopback address of the admin API, e.g. `127.0.0.1:9091`. Empty: no admin API.
    pub listen: Option<std::net::SocketAddr>,
    /// Bearer token every admin request must carry (env `TOLLGATE_SIDECAR_ADMIN__TOKEN`). At
    /// least 16 characters. Never logged.
    pub token: crate::secret::Secret,
    /// A file holding the token (its surrounding whitespace trimmed), instead of `token`: a
    /// mounted Kubernetes Secret (deploy/, decision 233).
    pub token_file: Option<std::path::PathBuf>,
    /// How often each replica compares `cfg:routing:version` with what it loaded, in case a
    /// change event was missed while its pub/sub connection was up but silent. Reconnects always
    /// resynchronise at once.
    #[serde(with = "humantime_serde")]
    pub resync_interval: Duration,
    /// How often the change subscriber pings its pub/sub connection; one that does not answer
    /// within twice this is replaced and the replica resynchronises (decision 207): a connection
    /// that stopped delivering without closing no longer holds changes back until the resync.
    #[serde(with = "humantime_serde")]
    pub subscriber_ping: Duration,
    /// The billing consumer's PostgreSQL (`postgres://…`), read by `GET /v1/invoices`; unset:
    /// `console.usage_url` (the same database), and without either that call answers 503.
    pub billing_url: Option<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig { listen: None, token: Default::default(), token_file: None, resync_interval: Duration::from_secs(5), subscriber_ping: Duration::from_millis(50), billing_url: None }
    }
}

impl AdminConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        if let Some(addr) = self.listen {
            if !addr.ip().is_loopback() {
                return Err(invalid("admin.listen", "must be a loopback address"));
            }
            if self.token_file.is_some() {
                if !self.token.is_empty() {
                    return Err(invalid("admin.token", "set admin.token or admin.token_file, not both"));
                }
            // visible ASCII only (decision 200): a token read from a file with its newline would
            // start, then refuse every call with 401 (a header value cannot carry it)
            } else if !crate::secret::well_formed(self.token.expose()) {
                return Err(invalid("admin.token", "16 to 256 visible ASCII characters (no spaces, no newline) are required when admin.listen is set"));
            }
        }
        if self.resync_interval.is_zero() {
            return Err(invalid("admin.resync_interval", "must be above zero"));
        }
        if self.subscriber_ping < Duration::from_millis(10) {
            return Err(invalid("admin.subscriber_ping", "must be at least 10ms"));
        }
        if self.billing_url.as_ref().is_some_and(|u| u.parse::<tokio_postgres::Config>().is_err()) {
            return Err(invalid("admin.billing_url", "not a PostgreSQL URL (postgres://user@host:port/db)"));
        }
        Ok(())
    }

    /// The token in force: `token`, or the content of `token_file` (read when the sidecar
    /// starts), well formed.
    pub fn resolve_token(&self) -> Result<Secret, Invalid> {
        let token = match &self.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid("admin.token_file", format!("cannot read {}: {e}", path.display())))?;
                Secret::new(text.trim())
            }
            None => self.token.clone(),
        };
        if !crate::secret::well_formed(token.expose()) {
            return Err(invalid("admin.token_file", "the token must be 16 to 256 visible ASCII characters"));
        }
        Ok(token)
    }
}

/// The OpenAPI document, served at `GET /openapi.json` and kept in docs/.
pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");


/// The admin API's routes, and the writes under way in tasks of their own (`detached`), which
/// [`run`] waits for before it returns.
pub fn router(control: Arc<Control>, token: Secret) -> (Router, TaskTracker) {
    let writes = TaskTracker::new();
    let state = Arc::new(AdminState { control, token });
    let api = Router::new()
        .route("/v1/version", get(version))
        .merge(super::admin_alerts::routes())
        .merge(super::admin_keys::routes())
        .merge(super::admin_invoices::routes())
        .route("/v1/pricing", get(pricing))
        .route("/v1/{kind}", get(list).post(create))
        .route("/v1/{kind}/{id}", get(get_one).put(put).delete(delete))
        .route_layer(middleware::from_fn_with_state(writes.clone(), detached))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state);
    // Every error answer JSON, the framework's own included (413 over the body limit, 404, 405).
    let router = Router::new().route("/openapi.json", get(openapi)).merge(api).layer(middleware::map_response(crate::errors::json_errors));
    (router, writes)
}

/// How long a stopping sidecar waits for admin writes under way (each is bounded by its own
/// deadlines: PostgreSQL's 10 s twice, Redis's).
const WRITES_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves the admin API until `shutdown`, then drains, with the filter port's connection
/// deadlines (crate::conn): a client that sends nothing, or half a request head, is cut off and
/// never holds a shutdown (`axum::serve` sets no deadline).
pub async fn run(listener: tokio::net::TcpListener, (router, writes): (Router, TaskTracker), deadlines: crate::conn::Deadlines, shutdown: CancellationToken) {
    tracing::info!(addr = ?listener.local_addr().ok(), "admin API listening");
    crate::conn::serve(listener, router, deadlines, shutdown).await;
    // a write whose client left goes on in its task: it ends before the sidecar does
    writes.close();
    if tokio::time::timeout(WRITES_GRACE, writes.wait()).await.is_err() {
        tracing::warn!(left = writes.len(), "admin writes still under way at shutdown were cut off");
    }
}

/// Runs a write to its end whatever its client does: a write's steps (PostgreSQL, then Redis,
/// then the announcement, or a revocation's completion on failure) must not stop half-way
/// because the client gave up and the connection's handler was dropped — PostgreSQL would hold
/// a revocation Redis never took (decision 179). Reads stay on the connection.
async fn detached(State(writes): State<TaskTracker>, req: axum::extract::Request, next: middleware::Next) -> Response {
    if req.method() == axum::http::Method::GET {
        return next.run(req).await;
    }
    match writes.spawn(next.run(req)).await {
        Ok(r) => r,
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", None, format!("the write's task ended: {e}")),
    }
}


/// Whether the headers carry `Authorization: Bearer <token>` (the scheme in any case, RFC 7235),
/// compared in constant time.
pub fn authorized(headers: &HeaderMap, token: &Secret) -> bool {
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, credentials) = v.trim_start().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then_some(credentials)
    });
    given.is_some_and(|g| token.matches(g.trim().as_bytes()))
}

async fn require_token(State(state): State<Arc<AdminState>>, req: Request, next: Next) -> Response {
    if authorized(req.headers(), &state.token) {
        next.run(req).await
    } else {
        let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized", None, "a valid bearer token is required");
        r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        r
    }
}

async fn openapi() -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn version(State(s): State<Arc<AdminState>>) -> Response {
    match s.control.routing_version().await {
        Ok(v) => {
            let unusable: Vec<Value> = s.control.live.unusable().iter().map(|u| u.to_json()).collect();
            reply(StatusCode::OK, json!({"version": v, "loaded": s.control.live.version(), "unusable": unusable}))
        }
        Err(e) => unavailable(e),
    }
}

/// `GET /v1/pricing`: the prices in force — the file's merged with the stored ones (decision
/// 337) — and their currency.
async fn pricing(State(s): State<Arc<AdminState>>) -> Response {
    let prices: Vec<Value> = s.control.prices_of(&s.control.live.get()).iter().map(|e| e.to_json()).collect();
    reply(StatusCode::OK, json!({"currency": s.control.pricing.currency, "prices": prices}))
}

/// A price as it is stored: in the deployment's currency, filled in when not given; a price in
/// another one is refused (one currency per deployment, decision 339).
#[allow(clippy::result_large_err)] // as kind_of
fn in_currency(mut v: Value, currency: &str) -> Result<Value, Response> {
    match v.get("currency") {
        None | Some(Value::Null) => v["currency"] = json!(currency),
        Some(Value::String(c)) if c == currency => {}
        Some(other) => {
            let shown = other.as_str().filter(|c| c.len() <= 8).map_or_else(|| "another currency".to_string(), |c| c.escape_debug().to_string());
            let why = format!("this deployment prices in {currency} (usage.pricing.currency); a price in {shown} is refused");
            return Err(error(StatusCode::BAD_REQUEST, "invalid", Some("currency"), why));
        }
    }
    Ok(v)
}

#[allow(clippy::result_large_err)] // the error is the reply itself; built once per bad request
fn kind_of(kind: &str) -> Result<Kind, Response> {
    Kind::parse(kind).ok_or_else(|| error(StatusCode::NOT_FOUND, "not_found", None, format!("no collection '{kind}'")))
}

async fn list(State(s): State<Arc<AdminState>>, Path(kind): Path<String>) -> Response {
    match kind_of(&kind) {
        Ok(k) => reply(StatusCode::OK, Value::Array(s.control.live.get().list(k))),
        Err(r) => r,
    }
}

async fn get_one(State(s): State<Arc<AdminState>>, Path((kind, id)): Path<(String, String)>) -> Response {
    let k = match kind_of(&kind) {
        Ok(k) => k,
        Err(r) => return r,
    };
    match s.control.live.get().get(k, &id) {
        Some(v) => reply(StatusCode::OK, v),
        None => error(StatusCode::NOT_FOUND, "not_found", Some("id"), format!("no {kind} '{id}'")),
    }
}

#[allow(clippy::result_large_err)] // as kind_of
fn parse_body(body: &Bytes) -> Result<Value, Response> {
    // decision 208: no object needs more, and every replica reads every row at every change
    if body.len() > model::MAX_OBJECT_BYTES {
        let max = model::MAX_OBJECT_BYTES;
        let message = format!("an object is at most {max} bytes of JSON (this one: {})", body.len());
        return Err(reply(StatusCode::PAYLOAD_TOO_LARGE, json!({"error": "payload_too_large", "message": message, "field": "body", "limit": max})));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| error(StatusCode::BAD_REQUEST, "invalid", Some("body"), format!("not JSON: {e}")))?;
    if !v.is_object() {
        return Err(error(StatusCode::BAD_REQUEST, "invalid", Some("body"), "a JSON object is required"));
    }
    Ok(v)
}

async fn create(State(s): State<Arc<AdminState>>, Path(kind): Path<String>, body: Bytes) -> Response {
    let (k, v) = match (kind_of(&kind), parse_body(&body)) {
        (Ok(k), Ok(v)) => (k, v),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    let v = match k {
        Kind::Prices => match in_currency(v, &s.control.pricing.currency) {
            Ok(v) => v,
            Err(r) => return r,
        },
        _ => v,
    };
    write(&s, Change::Put(k, v), Expect::Absent, StatusCode::CREATED).await
}

async fn put(State(s): State<Arc<AdminState>>, Path((kind, id)): Path<(String, String)>, body: Bytes) -> Response {
    let (k, mut v) = match (kind_of(&kind), parse_body(&body)) {
        (Ok(k), Ok(v)) => (k, v),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    match v.get("id").and_then(Value::as_str) {
        None => v["id"] = json!(id),
        Some(b) if b != id => return error(StatusCode::BAD_REQUEST, "invalid", Some("id"), "differs from the id in the path"),
        Some(_) => {}
    }
    if k == Kind::Prices {
        v = match in_currency(v, &s.control.pricing.currency) {
            Ok(v) => v,
            Err(r) => return r,
        };
    }
    write(&s, Change::Put(k, v), Expect::Any, StatusCode::OK).await
}

async fn delete(State(s): State<Arc<AdminState>>, Path((kind, id)): Path<(String, String)>) -> Response {
    let k = match kind_of(&kind) {
        Ok(k) => k,
        Err(r) => return r,
    };
    write(&s, Change::Delete(k, id), Expect::Present, StatusCode::OK).await
}

/// Whether the object a write names must exist already (a write of this replica's checks it in
/// the same snapshot it validates against, under the same lock: two POSTs of one id at once get
/// one 201 and one 409, never two 201s with the second replacing the first).
enum Expect {
    Absent,
    Present,
    Any,
}

/// Check → validate → commit → install → announce. The check and the validation run against the
/// configuration as stored, inside the write's transaction under a lock every replica's writes
/// take (`PgSource::write`; decision 157): this replica's copy may lack another's change.
#[allow(clippy::result_large_err)] // a refusal is the reply itself, as kind_of's
async fn write(s: &AdminState, change: Change, expect: Expect, ok: StatusCode) -> Response {
    let Source::Postgres(pg) = &s.control.source else {
        return error(StatusCode::CONFLICT, "read_only_source", None, SourceError::ReadOnly);
    };
    // no reload may install between this write's commit and its install
    let serial = s.control.installing.lock().await;
    let (kind, id) = match &change {
        Change::Put(k, v) => (*k, v.get("id").and_then(Value::as_str).unwrap_or_default().to_string()),
        Change::Delete(k, id) => (*k, id.clone()),
    };
    if let Change::Put(_, v) = &change {
        if let Some(field) = model::control_character_at(v, &format!("{}.{}", kind.name(), id.escape_debug())) {
            return error(StatusCode::BAD_REQUEST, "invalid", Some(&field), "control characters are not allowed");
        }
    }
    let last_good = s.control.live.get();
    let written = pg
        .write(|read: Snapshot, unread| {
            // rows this sidecar cannot use are set aside as a reload does: they refuse no write,
            // and one of them can be deleted or replaced (decision 206)
            let (stored, unusable) = salvage(read, unread, &last_good);
            let set_aside = unusable.iter().any(|u| u.kind == kind && u.id == id);
            let exists = !id.is_empty() && (stored.get(kind, &id).is_some() || set_aside);
            match expect {
                Expect::Absent if exists => {
                    let what = kind.name();
                    return Err(error(StatusCode::CONFLICT, "exists", Some("id"), format!("{what} '{id}' exists; use PUT to replace it")));
                }
                Expect::Present if !exists => {
                    return Err(error(StatusCode::NOT_FOUND, "not_found", Some("id"), format!("no {} '{id}'", kind.name())))
                }
                _ => {}
            }
            let next = match (&change, stored.get(kind, &id)) {
                // left out already: deleting its row changes nothing else
                (Change::Delete(..), None) if set_aside => stored.clone(),
                _ => stored.apply(&change).map_err(|e| error(StatusCode::BAD_REQUEST, "invalid", Some(&e.field), &e))?,
            };
            let unusable: Vec<_> = unusable.into_iter().filter(|u| !(u.kind == kind && u.id == id)).collect();
            let (row, body) = match &change {
                Change::Put(..) => {
                    // store the normalised object (defaults filled in)
                    let doc = next.get(kind, &id).unwrap_or_else(|| json!({}));
                    (Row::Put(kind, id.clone(), doc.clone()), doc)
                }
                Change::Delete(..) => (Row::Delete(kind, id.clone()), json!({"deleted": id})),
            };
            Ok((row, (next, body, unusable)))
        })
        .await;
    let (next, body, unusable) = match written {
        Ok(Ok(done)) => done,
        Ok(Err(refused)) => return refused,
        Err(e @ SourceError::InUse(_)) => return error(StatusCode::CONFLICT, "in_use", Some("id"), e),
        Err(e) => return unavailable(e),
    };
    s.control.install(next);
    s.control.report(unusable);
    drop(serial);
    let tenant = model::tenant_of(&change);
    announced(s, tenant.as_ref(), ok, body).await
}

/// Announces a committed change; the reply says whether replicas were told.
async fn announced(s: &AdminState, tenant: Option<&Id>, ok: StatusCode, mut body: Value) -> Response {
    match s.control.publish(tenant).await {
        Some(v) => body["version"] = json!(v),
        None => body["propagated"] = json!(false),
    }
    reply(ok, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_checked_exactly_and_the_scheme_in_any_case() {
        let t = |s: &str| Secret::new(s);
        let mut h = HeaderMap::new();
        assert!(!authorized(&h, &t("secret-secret-secret")));
        h.insert(header::AUTHORIZATION, "Bearer secret-secret-secret".parse().unwrap());
        assert!(authorized(&h, &t("secret-secret-secret")));
        assert!(!authorized(&h, &t("secret-secret-secreT")));
        assert!(!authorized(&h, &t("")));
        for scheme in ["bearer", "BEARER", "bEaReR"] {
            h.insert(header::AUTHORIZATION, format!("{scheme} secret-secret-secret").parse().unwrap());
            assert!(authorized(&h, &t("secret-secret-secret")), "{scheme}");
        }
        h.insert(header::AUTHORIZATION, "Basic secret-secret-secret".parse().unwrap());
        assert!(!authorized(&h, &t("secret-secret-secret")));
        h.insert(header::AUTHORIZATION, "Bearersecret-secret-secret".parse().unwrap());
        assert!(!authorized(&h, &t("secret-secret-secret")));
    }

    #[test]
    fn the_openapi_document_is_json_and_lists_every_path() {
        let doc: Value = serde_json::from_str(OPENAPI).unwrap();
        for p in [
            "/v1/{kind}",
            "/v1/{kind}/{id}",
            "/v1/keys",
            "/v1/keys/{id}/revoke",
            "/v1/keys/{id}/rotate",
            "/v1/keys/{id}",
            "/v1/version",
            "/v1/alerts",
            "/v1/pricing",
            "/v1/invoices",
        ] {
            assert!(doc["paths"].get(p).is_some(), "{p} missing from docs/openapi.json");
        }
    }

    #[test]
    fn admin_config_is_checked() {
        let mut a = AdminConfig { listen: Some("0.0.0.0:1".parse().unwrap()), token: Secret::new("x".repeat(16)), ..AdminConfig::default() };
        assert_eq!(a.validate().unwrap_err().field, "admin.listen");
        a.listen = Some("127.0.0.1:1".parse().unwrap());
        a.token = Secret::new("short");
        assert_eq!(a.validate().unwrap_err().field, "admin.token");
        a.token = Secret::new("admin-token-0123456789\n");
        assert_eq!(a.validate().unwrap_err().field, "admin.token", "a token with its file's newline");
        a.token = Secret::new("admin-token-0123456789");
        assert!(a.validate().is_ok());
    }
}
