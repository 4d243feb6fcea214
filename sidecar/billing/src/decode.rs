//! Decoding a consumed batch: each message an event or an aggregate (by its `schema` header),
//! the first occurrence of each id kept, and what is neither kept apart with the reason.

use crate::Consumed;
use tollgate_shared::aggregate::{UsageAggregate, SCHEMA as AGGREGATE_SCHEMA};
use tollgate_wire::usage::UsageEvent;

/// A batch, decoded.
#[derive(Debug, Default)]
pub struct Decoded<'a> {
    /// Single events, the first occurrence of each id.
    pub events: Vec<UsageEvent>,
    /// Aggregates, the first occurrence of each id.
    pub aggregates: Vec<UsageAggregate>,
    /// What is neither, with the reason.
    pub rejects: Vec<(&'a Consumed, String)>,
}

/// Decodes a batch. The `schema` header says what a message is; without one (a tool that drops
/// headers), an event is tried first, then an aggregate.
pub fn decode(batch: &[Consumed]) -> Decoded<'_> {
    let mut out = Decoded { events: Vec::with_capacity(batch.len()), ..Decoded::default() };
    let mut seen = std::collections::HashSet::new();
    for m in batch {
        let aggregate = match m.schema.as_deref() {
            Some(AGGREGATE_SCHEMA) => true,
            Some(_) => false,
            None => serde_json::from_slice::<UsageEvent>(&m.payload).is_err(),
        };
        if aggregate {
            match serde_json::from_slice::<UsageAggregate>(&m.payload) {
                Ok(a) => match a.invalid_reason() {
                    Some(why) => out.rejects.push((m, format!("invalid aggregate: {why}"))),
                    None => {
                        if seen.insert(a.id.clone()) {
                            out.aggregates.push(a);
                        }
                    }
                },
                Err(err) => out.rejects.push((m, err.to_string())),
            }
            continue;
        }
        match serde_json::from_slice::<UsageEvent>(&m.payload) {
            Ok(e) => match tollgate_shared::events::invalid_reason(&e) {
                Some(why) => out.rejects.push((m, format!("invalid event: {why}"))),
                None => {
                    if seen.insert(e.id.clone()) {
                        out.events.push(e);
                    }
                }
            },
            Err(err) => out.rejects.push((m, err.to_string())),
        }
    }
    out
}
