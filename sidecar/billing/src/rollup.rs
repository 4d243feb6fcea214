//! The rollup's increments (`usage_daily`: day, tenant, key), made from events and aggregates
//! in memory before one statement adds them: pure, and saturating everywhere (a sum never wraps
//! and never fails a batch).

use std::collections::BTreeMap;
use tollgate_shared::aggregate::UsageAggregate;
use tollgate_wire::usage::{UsageClass, UsageEvent};

/// One rollup row's increments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rollup {
    pub by_class: [i64; 5],
    pub tokens: i64,
    /// Requests whose token usage could not be read (decision 183): not in `tokens`.
    pub tokens_unread: i64,
    pub request_bytes: i64,
    pub response_bytes: i64,
}

/// A token count as PostgreSQL keeps it: at most 2^53 per event (an upstream's impossible number
/// is clamped, never wrapped negative). Sums saturate, in Rust and in SQL (`LEAST(…)`), so a
/// batch never fails on an overflow and is never retried forever.
pub fn tokens_i64(n: u64) -> i64 {
    i64::try_from(n.min(tollgate_wire::usage::MAX_TOKENS)).unwrap_or(i64::MAX)
}

/// The `SET` list of an upsert into a rollup table aliased `d` that adds each of `columns`,
/// saturating at `int8`'s bound (a sum never wraps and never fails a batch), then stamps
/// `updated_at`.
pub fn saturating_sums(columns: &[&str]) -> String {
    let mut set: String = columns.iter().map(|c| format!("{c} = LEAST(d.{c}::numeric + EXCLUDED.{c}, 9223372036854775807)::int8, ")).collect();
    set.push_str("updated_at = now()");
    set
}

/// A count as PostgreSQL's `int8`, saturated (a message's counts are bounded, their sums may not be).
fn count_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn class_index(c: UsageClass) -> usize {
    UsageClass::ALL.iter().position(|x| *x == c).unwrap_or(0)
}

/// The rollup increments of `events`, per `(yyyy-MM-dd, tenant, key_id)`, in key order (the
/// order rows are locked in).
pub fn rollup<'a>(events: impl IntoIterator<Item = &'a UsageEvent>) -> BTreeMap<(String, String, String), Rollup> {
    let mut out: BTreeMap<(String, String, String), Rollup> = BTreeMap::new();
    for e in events {
        let r = out.entry((e.day().iso(), e.tenant.clone(), e.key_id.clone())).or_default();
        r.by_class[class_index(e.class())] += 1;
        r.tokens = r.tokens.saturating_add(tokens_i64(e.tokens.unwrap_or(0)));
        r.tokens_unread += i64::from(e.tokens_unread);
        r.request_bytes = r.request_bytes.saturating_add(count_i64(e.request_bytes.unwrap_or(0)));
        r.response_bytes = r.response_bytes.saturating_add(count_i64(e.response_bytes.unwrap_or(0)));
    }
    out
}

/// Adds the per-key sums of `aggregates` to `out` (the same rows [`rollup`] makes).
pub fn rollup_aggregates<'a>(out: &mut BTreeMap<(String, String, String), Rollup>, aggregates: impl IntoIterator<Item = &'a UsageAggregate>) {
    for a in aggregates {
        let day = a.day().iso();
        for k in &a.keys {
            let r = out.entry((day.clone(), a.tenant.clone(), k.key_id.clone())).or_default();
            for (i, class) in UsageClass::ALL.iter().enumerate() {
                r.by_class[i] = r.by_class[i].saturating_add(count_i64(k.requests.get(*class)));
            }
            // a sum of events' tokens (each clamped to 2^53 already): saturated, not clamped again
            r.tokens = r.tokens.saturating_add(count_i64(k.tokens));
            r.tokens_unread = r.tokens_unread.saturating_add(count_i64(k.tokens_unread));
            r.request_bytes = r.request_bytes.saturating_add(count_i64(k.request_bytes));
            r.response_bytes = r.response_bytes.saturating_add(count_i64(k.response_bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_saturate_in_sql_too() {
        assert_eq!(
            saturating_sums(&["tokens", "requests"]),
            "tokens = LEAST(d.tokens::numeric + EXCLUDED.tokens, 9223372036854775807)::int8, \
             requests = LEAST(d.requests::numeric + EXCLUDED.requests, 9223372036854775807)::int8, updated_at = now()"
        );
    }
}
