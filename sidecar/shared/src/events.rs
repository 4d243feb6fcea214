//! What a usage event must be for the gateway to spool it and for billing to count it: the one
//! check both apply ([`invalid_reason`]), so an event the sidecar would refuse — an identity that
//! is not an id, control characters (a NUL PostgreSQL's `text` refuses), a time past year 9999
//! (beyond PostgreSQL's `date`), counts past 2^53 — never reaches the rollup from anything else
//! that writes to the topic (decision 167).

use crate::keys::Id;
use tollgate_wire::usage::{UsageEvent, MAX_PATH};

/// The latest time an event or aggregate may carry: 9999-12-31T23:59:59.999Z.
pub const MAX_TIME_MS: u64 = 253_402_300_799_999;

/// The largest count (tokens, bytes, milliseconds) an event may carry: 2^53, what the gateway
/// clamps token counts to and what a JSON reader keeps exactly.
pub const MAX_COUNT: u64 = 1 << 53;

/// Why an event was refused (never retried: the sender cannot fix it).
pub fn invalid_reason(e: &UsageEvent) -> Option<&'static str> {
    let id_ok = (8..=64).contains(&e.id.len()) && e.id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
    if !id_ok {
        return Some("id");
    }
    if Id::parse(&e.tenant).is_none() {
        return Some("tenant");
    }
    if Id::parse(&e.key_id).is_none() {
        return Some("keyId");
    }
    if Id::parse(&e.plan).is_none() {
        return Some("plan");
    }
    if e.method.is_empty() || e.method.len() > 16 || !e.method.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Some("method");
    }
    if e.authority.len() > 255 || e.authority.bytes().any(|b| b.is_ascii_control()) {
        return Some("authority");
    }
    if e.path.len() > MAX_PATH || e.path.contains(['?', '#']) || e.path.bytes().any(|b| b.is_ascii_control()) {
        return Some("path");
    }
    if e.start_ms == 0 || e.start_ms > MAX_TIME_MS || e.status > 999 {
        return Some("startMs/status");
    }
    let big = |n: Option<u64>| n.is_some_and(|n| n > MAX_COUNT);
    if e.duration_ms > MAX_COUNT || big(e.tokens) || big(e.request_bytes) || big(e.response_bytes) {
        return Some("counts");
    }
    if e.route.as_deref().is_some_and(|r| Id::parse(r).is_none()) {
        return Some("route");
    }
    if e.product.as_deref().is_some_and(|p| Id::parse(p).is_none()) {
        return Some("product");
    }
    if let Some(why) = e.llm.as_ref().and_then(|l| l.invalid_reason()) {
        return Some(why);
    }
    // a deny code: what the gateway answers is `snake_case`, never long (an unbounded one would
    // make a spool line the broker refuses, and hold back every event after it)
    let code_ok = |d: &str| (1..=64).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if e.denied.as_deref().is_some_and(|d| !code_ok(d)) {
        return Some("denied");
    }
    None
}
