//! The model policy of one decision (issue 42 item 4, decisions 305-309): on an LLM request — the
//! filter says what it read, or the route is marked `llm` (a request whose body was not read is
//! one too, naming no model) — the plan's alias resolves the model asked for, the plan's and the
//! key's allow-lists judge the resolved model, and the plan's per-model limits that match it join
//! the decision's limits. Runs after the scopes and before any limit, lease or lookup: a refused
//! model takes nothing and reaches nothing.

use super::answers;
use super::limits::{Limit, ModelPolicy};
use super::routing::RouteEffect;
use crate::apikey::KeyRecord;
use std::collections::BTreeMap;
use tollgate_wire::{DecideRequest, DecideResponse};

/// What the policy made of a request.
pub enum Judged<'a> {
    /// Refused: 403 `model_not_allowed` or 400 `model_required`.
    Refused(DecideResponse),
    /// Allowed, with the per-model limits that apply, and — when an alias resolved — the request
    /// as its limits and prices see it (the resolved model in `llm.model`).
    Allowed { limits: &'a [Limit], aliased: Option<DecideRequest> },
}

/// The verdict on `req` of key `r` under its plan's `policy` (none: the plan has none).
pub fn judge<'a>(req: &DecideRequest, route: Option<&RouteEffect>, policy: Option<&'a ModelPolicy>, r: &KeyRecord) -> Judged<'a> {
    let llm_request = req.llm.is_some() || route.is_some_and(|x| x.llm);
    if !llm_request || (policy.is_none() && r.scopes.models.is_empty()) {
        return Judged::Allowed { limits: &[], aliased: None };
    }
    let asked = req.llm.as_ref().and_then(|a| a.model.as_deref());
    let none = BTreeMap::new();
    let (aliases, allow) = policy.map_or((&none, &[][..]), |p| (&p.aliases, p.allow.as_slice()));
    match crate::models::judge(asked, aliases, allow, &r.scopes.models) {
        Err(refusal) => Judged::Refused(answers::model_refused(&refusal)),
        Ok(model) => {
            let limits = match (policy, model.as_deref()) {
                (Some(p), Some(m)) => p.limits_for(m),
                _ => &[],
            };
            // an alias: prices, budgets and limits see the model the upstream is asked for
            let aliased = (model.as_deref() != asked).then(|| {
                let mut aliased = req.clone();
                if let Some(ask) = &mut aliased.llm {
                    ask.model = model;
                }
                aliased
            });
            Judged::Allowed { limits, aliased }
        }
    }
}

/// The plan's limits and the per-model ones that apply (borrowed when there are none).
pub fn with_plans<'a>(plan: &'a [Limit], models: &[Limit]) -> std::borrow::Cow<'a, [Limit]> {
    match models.is_empty() {
        true => plan.into(),
        false => plan.iter().chain(models).cloned().collect::<Vec<_>>().into(),
    }
}

/// Names the real model in an allow of an aliased request (`aliased`: the request as its limits
/// saw it): the filter asks the upstream for it in place of the alias (decision 309).
pub fn name_model(aliased: Option<&DecideRequest>, answer: &mut DecideResponse) {
    if let (Some(req), DecideResponse::Allow { model, .. }) = (aliased, answer) {
        *model = req.llm.as_ref().and_then(|a| a.model.clone());
    }
}
