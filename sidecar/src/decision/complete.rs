//! The completion path: a finished request's ticket settles what its decision held — token
//! reservations (actual vs reserved) and concurrency slots — through `complete.lua`.

use super::{DecisionStore, Decider};
use super::spend;
use crate::keys::{BudgetCounter, ConcurrencyKey, DecisionRecordKey, Id, ReservationKey, SpendBudgetKey, Subject, TokenBudgetKey, TokensPerMinuteKey};
use crate::metrics as m;
use crate::scripts::complete::CompleteCall;
use crate::store::StoreError;
use tollgate_wire::Completion;

#[derive(Debug, thiserror::Error)]
pub enum CompleteError {
    #[error("invalid ticket field {0}")]
    BadTicket(String),
    /// Not a ticket this deployment sealed (forged or altered), or past its expiry.
    #[error("ticket refused: {}", .0.as_str())]
    Refused(super::tickets::Refused),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<S: DecisionStore> Decider<S> {
    /// Settles one completed request: its token reservations (actual vs reserved) and its
    /// concurrency slots. Only with a ticket this deployment sealed, unaltered and unexpired.
    /// Idempotent (a retried or replayed report changes nothing twice).
    pub async fn complete(&self, c: &Completion) -> Result<(), CompleteError> {
        let t = &c.ticket;
        let now_ms = self.now_ms();
        self.tickets().verify(t, now_ms).map_err(CompleteError::Refused)?;
        let marker_ttl_ms = t.expires_at_ms.saturating_sub(now_ms);
        // An upstream's count beyond 2^53 (the filter clamps it too): exact in Lua's doubles, and
        // an INCRBY of it cannot fail, so a bad number never makes the batch fail and be resent.
        let c = &Completion { tokens: c.tokens.map(|n| m::clamp_tokens(n, "completion")), ..c.clone() };
        let bad = |what: &str| CompleteError::BadTicket(what.to_string());
        let tenant = Id::parse(&t.tenant).ok_or_else(|| bad("tenant"))?;
        let request_id = Id::parse(&t.request_id).ok_or_else(|| bad("requestId"))?;
        let mut slots = Vec::new();
        for s in &t.slots {
            let limit = Id::parse(&s.limit).ok_or_else(|| bad("slots.limit"))?;
            let subject = Subject::parse(&s.subject).ok_or_else(|| bad("slots.subject"))?;
            slots.push(ConcurrencyKey::new(&tenant, &limit, &subject));
        }
        let mut calls = Vec::new();
        for b in &t.budgets {
            let limit = Id::parse(&b.limit).ok_or_else(|| bad("budgets.limit"))?;
            let subject = Subject::parse(&b.subject).ok_or_else(|| bad("budgets.subject"))?;
            let month = (190_001..=999_912).contains(&b.period);
            // a calendar minute (ms / 60 000: 8 digits since 1989) of a per-model tokens-per-minute limit
            let minute = b.period >= 10_000_000;
            let (counter, actual) = match b.priced_at_ms {
                // No usage reported: the reservation stands as the charge.
                None if month => (TokenBudgetKey::new(&tenant, &limit, &subject, b.period).into(), c.tokens.unwrap_or(b.reserved)),
                None if minute => (BudgetCounter::Minute(TokensPerMinuteKey::new(&tenant, &limit, &subject, b.period)), c.tokens.unwrap_or(b.reserved)),
                // A money budget (month or day): the real cost at the prices it was reserved at,
                // which its usage event is billed at too (decision 302).
                Some(at) if month || (19_000_101..=99_991_231).contains(&b.period) => {
                    let real = self.pricing.as_ref().and_then(|t| spend::real_cost(&t.get(), c.llm.as_ref(), at));
                    (BudgetCounter::Spend(SpendBudgetKey::new(&tenant, &limit, &subject, b.period)), spend::settled(b.reserved, real, c.tokens))
                }
                _ => return Err(bad("budgets.period")),
            };
            calls.push(CompleteCall {
                budget: Some((counter, ReservationKey::new(&tenant, &limit, &subject, &request_id))),
                slot: slots.pop(),
                actual,
                estimate: b.reserved,
                request_id: request_id.to_string(),
                record: None,
                marker_ttl_ms,
            });
        }
        for slot in slots {
            calls.push(CompleteCall { budget: None, slot: Some(slot), actual: 0, estimate: 0, request_id: request_id.to_string(), record: None, marker_ttl_ms });
        }
        // A completed decision is never refunded (issue 15.2): its record goes with the first call.
        if let Some(first) = calls.first_mut() {
            first.record = Some(DecisionRecordKey::new(&tenant, &request_id));
        }
        for call in calls {
            let (delta, settled) = self.store.complete(&call).await?;
            metrics::counter!(m::COMPLETIONS, "outcome" => settled.as_str()).increment(1);
            // tokens only: a money budget's delta is micro-units
            if matches!(call.budget, Some((BudgetCounter::Spend(_), _))) {
                continue;
            }
            if delta > 0 {
                metrics::counter!(m::BUDGET_DELTA, "direction" => "overrun").increment(delta as u64);
            } else if delta < 0 {
                metrics::counter!(m::BUDGET_DELTA, "direction" => "refund").increment(delta.unsigned_abs());
            }
        }
        Ok(())
    }
}
