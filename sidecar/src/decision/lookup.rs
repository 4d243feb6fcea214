//! What a response lookup (cache or Idempotency-Key, riding on the decision's script) means for
//! the answer, and what happens when Redis cannot answer it.

use super::cache::Lookup;
use super::responses::{self, Lookup as ResponseLookup, Outcome};
use super::{Decider, DecisionStore};
use std::time::Instant;
use tollgate_wire::responses::{Replay, ReplayKind, StoreTicket};
use tollgate_wire::{codes, DecideResponse};

impl<S: DecisionStore> Decider<S> {
    /// What a lookup's outcome means for the answer: a replay, a store ticket, or a 409/422.
    #[allow(clippy::result_large_err)]
    pub(super) fn apply_outcome(&self, l: &ResponseLookup, o: Option<Outcome>) -> Result<(Option<Box<Replay>>, Option<StoreTicket>), DecideResponse> {
        let count = |name: &'static str, label: &'static str, v: &'static str| metrics::counter!(name, label => v).increment(1);
        let deny = |status: u16, error: &str, message: &str| DecideResponse::Deny {
            status,
            error: error.into(),
            message: message.into(),
            limit: None,
            response_headers: vec![],
        };
        match o {
            Some(Outcome::Hit(json)) => match responses::read_stored(&json) {
                Some(response) => {
                    count(responses::CACHE_LOOKUPS, "result", "hit");
                    Ok((Some(Box::new(Replay { kind: ReplayKind::Cache, response })), None))
                }
                // unreadable: a miss, not stored over (entries are written only where none is:
                // it goes with its TTL)
                None => Ok((None, None)),
            },
            Some(Outcome::Miss) => {
                count(responses::CACHE_LOOKUPS, "result", "miss");
                Ok((None, Some(l.ticket())))
            }
            Some(Outcome::Claimed) => {
                count(responses::IDEMPOTENCY, "outcome", "claimed");
                Ok((None, Some(l.ticket())))
            }
            Some(Outcome::Replay(json)) => match responses::read_stored(&json) {
                Some(response) => {
                    count(responses::IDEMPOTENCY, "outcome", "replayed");
                    Ok((Some(Box::new(Replay { kind: ReplayKind::Idempotency, response })), None))
                }
                None => {
                    self.lookup_unavailable(l, "an unreadable idempotency memo");
                    Ok((None, None))
                }
            },
            Some(Outcome::InFlight) => {
                count(responses::IDEMPOTENCY, "outcome", "in_flight");
                Err(deny(409, codes::IDEMPOTENCY_IN_FLIGHT, "a request with this Idempotency-Key is still being processed"))
            }
            Some(Outcome::Full(room_in_ms)) => {
                count(responses::IDEMPOTENCY, "outcome", "storage_full");
                let mut d = deny(
                    429,
                    codes::IDEMPOTENCY_STORAGE_FULL,
                    "this tenant's stored responses are at their bound: a new Idempotency-Key is not taken until some expire",
                );
                if let DecideResponse::Deny { response_headers, .. } = &mut d {
                    response_headers.push(tollgate_wire::Header::new("retry-after", room_in_ms.div_ceil(1000).max(1).to_string()));
                }
                Err(d)
            }
            Some(Outcome::Conflict) => {
                count(responses::IDEMPOTENCY, "outcome", "conflict");
                Err(deny(
                    422,
                    codes::IDEMPOTENCY_KEY_REUSED,
                    "this Idempotency-Key was used for a different request (method, path or body)",
                ))
            }
            None => {
                self.lookup_unavailable(l, "decide.lua returned no lookup outcome");
                Ok((None, None))
            }
        }
    }

    /// Redis could not answer a lookup: a cache miss, or (seed 002) an idempotency key executed
    /// without being recorded — logged at most once a minute.
    pub(super) fn lookup_unavailable(&self, l: &ResponseLookup, why: &str) {
        if !l.is_idempotency() {
            metrics::counter!(responses::CACHE_LOOKUPS, "result" => "unavailable").increment(1);
            return;
        }
        metrics::counter!(responses::IDEMPOTENCY, "outcome" => "unavailable").increment(1);
        let now = Instant::now();
        let key = "\0idempotency".to_string();
        if !matches!(self.shadow_logged.get(&key, now), Lookup::Fresh(..)) {
            self.shadow_logged.insert(key, (), now);
            tracing::warn!(error = %why, "idempotency keys are executed without being recorded: Redis cannot answer (logged at most once a minute)");
        }
    }
}
