//! `GET /v1/invoices?tenant=<id>&month=<yyyy-MM>[&format=json|csv]`: a tenant's invoice-ready
//! month (issue 42 item 6) — LLM calls by model (requests, input, output and cached tokens,
//! cost) and the month's billable requests — read from the billing consumer's PostgreSQL by the
//! billing crate's own code (`tollgate_billing::invoice`, what `tollgate-billing invoice` prints:
//! the same figures, decision 341). In the sidecar's pricing currency.
//!
//! Bounded: at most [`MAX_LINES`] models (more is refused, 413, never cut short: an invoice is
//! whole or not at all), within [`DEADLINE`] (503 after it). No billing database configured, or
//! one that does not answer: 503 `billing_unavailable`.

use super::admin_http::{error, reply, AdminState};
use crate::keys::Id;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;
use std::time::Duration;
use tollgate_billing::invoice;
use tollgate_billing::report::ReportError;

/// The most models one invoice answer lists.
pub const MAX_LINES: usize = 10_000;
/// How long reading one invoice may take, connecting included.
pub const DEADLINE: Duration = Duration::from_secs(15);

/// The invoice route, merged into the admin router (under its token check).
pub(super) fn routes() -> Router<Arc<AdminState>> {
    Router::new().route("/v1/invoices", get(one))
}

/// How an invoice is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Csv,
}

/// An invoice query, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub tenant: Id,
    pub month: String,
    pub format: Format,
}

/// Reads `tenant`, `month` and `format` (default `json`): each once, nothing else; the refused
/// parameter and why.
pub fn query(q: Option<&str>) -> Result<Query, (&'static str, String)> {
    let (mut tenant, mut month, mut format) = (None, None, None);
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match k {
            "tenant" => &mut tenant,
            "month" => &mut month,
            "format" => &mut format,
            _ => return Err(("query", "only tenant, month and format are taken".into())),
        };
        if slot.replace(v).is_some() {
            return Err(("query", format!("{k} given twice")));
        }
    }
    let tenant = tenant.and_then(Id::parse).ok_or(("tenant", "a tenant id (1-64 of letters, digits, '_', '-', '.') is required".into()))?;
    let month = month.filter(|m| invoice::well_formed_month(m)).ok_or(("month", "a month yyyy-MM (2026-03) is required".into()))?;
    let format = match format.unwrap_or("json") {
        "json" => Format::Json,
        "csv" => Format::Csv,
        _ => return Err(("format", "json or csv".into())),
    };
    Ok(Query { tenant, month: month.to_string(), format })
}

fn billing_unavailable(why: impl std::fmt::Display) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, "billing_unavailable", None, why)
}

async fn one(State(s): State<Arc<AdminState>>, uri: Uri) -> Response {
    let q = match query(uri.query()) {
        Ok(q) => q,
        Err((field, why)) => return error(StatusCode::BAD_REQUEST, "invalid", Some(field), why),
    };
    let Some(url) = s.control.billing_url.clone() else {
        return billing_unavailable("no billing database is configured (admin.billing_url, or console.usage_url)");
    };
    let currency = s.control.pricing.currency.clone();
    let read = async {
        let db = tollgate_billing::db::Db::connect(&url).await.map_err(|e| billing_unavailable(format!("the billing database does not answer: {e}")))?;
        invoice::read_at_most(&db, q.tenant.as_str(), &q.month, &currency, MAX_LINES).await.map_err(|e| match e {
            ReportError::TooLarge(max) => error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                Some("tenant"),
                format!("the month bills more than {max} models: read it with `tollgate-billing invoice`"),
            ),
            other => billing_unavailable(format!("reading the billing database: {other}")),
        })
    };
    let inv = match tokio::time::timeout(DEADLINE, read).await {
        Ok(Ok(inv)) => inv,
        Ok(Err(r)) => return r,
        Err(_) => return billing_unavailable(format!("the billing database did not answer within {DEADLINE:?}")),
    };
    match q.format {
        Format::Json => match serde_json::to_value(&inv) {
            Ok(v) => reply(StatusCode::OK, v),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", None, e),
        },
        Format::Csv => {
            let name = format!("attachment; filename=\"invoice-{}-{}.csv\"", q.tenant, q.month);
            (StatusCode::OK, [(header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()), (header::CONTENT_DISPOSITION, name)], inv.csv()).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_what_it_refuses() {
        let q = query(Some("tenant=acme&month=2026-03")).unwrap();
        assert_eq!((q.tenant.as_str(), q.month.as_str(), q.format), ("acme", "2026-03", Format::Json));
        assert_eq!(query(Some("month=2026-03&tenant=acme&format=csv")).unwrap().format, Format::Csv);
        let field = |q: &str| query(Some(q)).unwrap_err().0;
        assert_eq!(field("month=2026-03"), "tenant");
        assert_eq!(field("tenant=a%20b&month=2026-03"), "tenant");
        assert_eq!(field("tenant=acme"), "month");
        assert_eq!(field("tenant=acme&month=2026-13"), "month");
        assert_eq!(field("tenant=acme&month=2026-3"), "month");
        assert_eq!(field("tenant=acme&month=2026-03&format=pdf"), "format");
        assert_eq!(field("tenant=acme&month=2026-03&month=2026-04"), "query");
        assert_eq!(field("tenant=acme&month=2026-03&limit=5"), "query");
        assert_eq!(query(None).unwrap_err().0, "tenant");
    }
}
