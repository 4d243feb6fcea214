//! The answers the decision path builds from its parts: an allow for a key record, a 429 for the
//! limit that denied. Pure; used by the Redis path (`decision`) and the local fallback (`local`).

use super::checks::{self, Meta};
use crate::apikey::KeyRecord;
use crate::scripts::decide::LimitState;
use tollgate_wire::responses::{Replay, StoreTicket};
use tollgate_wire::{DecideResponse, Header};

/// An allow answer for `r`'s key.
pub fn allow(
    r: &KeyRecord,
    response_headers: Vec<Header>,
    ticket: Option<tollgate_wire::Ticket>,
    lease: Option<tollgate_wire::Lease>,
    replay: Option<Box<Replay>>,
    store: Option<Box<StoreTicket>>,
) -> DecideResponse {
    DecideResponse::Allow {
        tenant: r.tenant.to_string(),
        key_id: r.key_id.to_string(),
        plan: r.plan.to_string(),
        request_headers: vec![],
        response_headers,
        cache_for_ms: None,
        ticket,
        replay,
        store,
        lease,
        no_lease: false,
        model: None,
    }
}

/// A 429 for the limit that denied: `Retry-After` and its RateLimit headers.
pub fn too_many(meta: &Meta, state: &LimitState) -> DecideResponse {
    let mut headers = vec![Header::new("retry-after", state.reset_ms.div_ceil(1000).max(1).to_string())];
    headers.extend(checks::ratelimit_headers(meta, state));
    DecideResponse::Deny {
        status: 429,
        error: checks::deny_code(meta.algorithm).into(),
        message: format!("limit '{}' exceeded", meta.name),
        limit: Some(meta.name.clone()),
        response_headers: headers,
    }
}

/// A 403 `model_not_priced`: money budget `limit` cannot price the model asked for (decision 301).
pub fn not_priced(limit: String, why: super::spend::NotPriced) -> DecideResponse {
    let model = why.model.map_or_else(|| "a request that names no model".to_string(), |m| format!("model '{m}'"));
    DecideResponse::Deny {
        status: 403,
        error: tollgate_wire::codes::MODEL_NOT_PRICED.into(),
        message: format!("budget '{limit}' cannot price {model}: it has no price"),
        limit: Some(limit),
        response_headers: vec![],
    }
}

/// A model the policy refuses (issue 42 item 4): 403 `model_not_allowed`, or 400
/// `model_required` when an allow-list applies and the request names no model.
pub fn model_refused(why: &crate::models::Refusal) -> DecideResponse {
    let (status, code) = match why {
        crate::models::Refusal::Required => (400, tollgate_wire::codes::MODEL_REQUIRED),
        crate::models::Refusal::NotAllowed { .. } => (403, tollgate_wire::codes::MODEL_NOT_ALLOWED),
    };
    DecideResponse::Deny { status, error: code.into(), message: why.message(), limit: None, response_headers: vec![] }
}
