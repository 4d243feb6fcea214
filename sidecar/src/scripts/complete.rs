//! `sidecar/lua/complete.lua`: settle one completed request's token reservation (actual vs
//! reserved) and free its concurrency slot. Idempotent: a retried report changes nothing twice.

use super::call::Invocation;
use crate::keys::{BudgetCounter, ConcurrencyKey, DecisionRecordKey, ReservationKey, RESERVATION_TTL_MS};
use crate::store::{Store, StoreError};
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/complete.lua")));

/// Off the request path: the filter's completion batch waits, not a request.
const DEADLINE: Duration = Duration::from_secs(2);

/// One `complete.lua` call: a budget reservation and/or a concurrency slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompleteCall {
    /// The period's counter (tokens or money) and the reservation of a budget the request
    /// reserved from.
    pub budget: Option<(BudgetCounter, ReservationKey)>,
    pub slot: Option<ConcurrencyKey>,
    /// Tokens used (the reservation when the response did not say).
    pub actual: u64,
    /// The tokens reserved at decide time.
    pub estimate: u64,
    /// The slot's member.
    pub request_id: String,
    /// The decision's record (`dec:…`), deleted: a completed decision is never refunded.
    pub record: Option<DecisionRecordKey>,
    /// How long the settled marker is kept: at least the reservation's TTL, and until the ticket
    /// it settles expires (a replay within the ticket's life finds the marker).
    pub marker_ttl_ms: u64,
}

/// What became of the reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Settled now: the counter moved by actual − reserved.
    Reconciled,
    /// Settled before (a retried report): nothing done.
    Duplicate,
    /// It had expired (or there was none): only an overrun was charged.
    Expired,
}

impl Settled {
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Reconciled => "reconciled",
            Settled::Duplicate => "duplicate",
            Settled::Expired => "expired",
        }
    }
}

impl CompleteCall {
    /// KEYS and ARGV, in the order of `complete.lua`'s contract.
    pub fn encode(&self) -> (Vec<String>, Vec<String>) {
        let mut keys = Vec::with_capacity(3);
        if let Some((counter, reservation)) = &self.budget {
            keys.extend([counter.as_str().to_string(), reservation.as_str().to_string()]);
        }
        if let Some(slot) = &self.slot {
            keys.push(slot.as_str().to_string());
        }
        if let Some(record) = &self.record {
            keys.push(record.as_str().to_string());
        }
        let flag = |b: bool| if b { "1" } else { "0" }.to_string();
        let args = vec![
            self.actual.to_string(),
            self.estimate.to_string(),
            self.request_id.clone(),
            self.budget.as_ref().map_or(0, |(c, _)| c.ttl_ms()).to_string(),
            flag(self.budget.is_some()),
            flag(self.slot.is_some()),
            self.marker_ttl_ms.max(RESERVATION_TTL_MS).to_string(),
            flag(self.record.is_some()),
        ];
        (keys, args)
    }
}

/// Reads `{delta charged to the counter, 1 reconciled | 2 already settled | 0 expired}`.
pub fn parse((delta, found): (i64, i64)) -> (i64, Settled) {
    let settled = match found {
        1 => Settled::Reconciled,
        2 => Settled::Duplicate,
        _ => Settled::Expired,
    };
    (delta, settled)
}

/// Runs the call; returns the tokens moved (positive: an overrun charged, negative: a refund).
pub async fn run(store: &Store, call: &CompleteCall) -> Result<(i64, Settled), StoreError> {
    let (keys, args) = call.encode();
    let reply = Invocation { script: &SCRIPT, op: "complete_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    Ok(parse(reply))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{Id, Subject, TokenBudgetKey, TOKEN_BUDGET_TTL_MS};

    #[test]
    fn a_budget_and_a_slot_in_the_contracts_order() {
        let (t, l, r) = (Id::parse("acme").unwrap(), Id::parse("l").unwrap(), Id::parse("req-1").unwrap());
        let s = Subject::tenant();
        let both = CompleteCall {
            budget: Some((TokenBudgetKey::new(&t, &l, &s, 202511).into(), ReservationKey::new(&t, &l, &s, &r))),
            slot: Some(ConcurrencyKey::new(&t, &l, &s)),
            actual: 70,
            estimate: 50,
            request_id: "req-1".into(),
            record: Some(DecisionRecordKey::new(&t, &r)),
            marker_ttl_ms: 0,
        };
        let (keys, args) = both.encode();
        assert_eq!(keys, ["q:tokens:{acme}:l:t:202511", "q:reserved:{acme}:l:t:req-1", "q:conc:{acme}:l:t", "dec:{acme}:req-1"]);
        assert_eq!(args, ["70", "50", "req-1", &TOKEN_BUDGET_TTL_MS.to_string(), "1", "1", &RESERVATION_TTL_MS.to_string(), "1"]);
        let longer = CompleteCall { marker_ttl_ms: RESERVATION_TTL_MS + 1, ..both.clone() }.encode().1;
        assert_eq!(longer[6], (RESERVATION_TTL_MS + 1).to_string(), "the marker outlives the ticket");
        let (keys, args) = CompleteCall { budget: None, actual: 0, estimate: 0, record: None, ..both }.encode();
        assert_eq!((keys.len(), &args[4..6], args[7].as_str()), (1, &["0".to_string(), "1".to_string()][..], "0"));
        assert_eq!(parse((20, 1)), (20, Settled::Reconciled));
        assert_eq!(parse((0, 2)), (0, Settled::Duplicate));
        assert_eq!(parse((5, 0)), (5, Settled::Expired));
    }
}
