//! `sidecar/lua/refund.lua`: give back everything one abandoned decision took (issue 15.2).
//!
//! Two round trips, off the request path: `GET` the decision's record (`dec:{tenant}:<id>`, which
//! `decide.lua` wrote in the call that took), then the script with the record as read and the
//! keys its lines name — declared as KEYS, so it runs on Redis Cluster like every other script.
//! The script checks the record is unchanged, gives back each line and deletes the record, so a
//! refund delivered twice is done once. [`record_keys`] reads the keys out of a record (pure).

use super::call::{BadReply, Invocation, ScriptError};
use crate::keys::{DecisionRecordKey, Id};
use crate::store::Store;
use std::sync::LazyLock;
use std::time::Duration;

pub(super) static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("../../lua/refund.lua")));

/// Off the request path: the filter's refund batch waits, not a request.
const DEADLINE: Duration = Duration::from_secs(2);

/// What became of a refund.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refunded {
    /// Given back: what the decision took, `lines` limits or claims of it.
    Done { lines: u64 },
    /// No record: the decision was denied, never ran, was refunded already, or its record expired.
    Nothing,
    /// The decision had completed (a reservation of it was settled): nothing given back.
    Completed,
}

impl Refunded {
    /// The metric label (`tollgate_sidecar_refunds_total{outcome}`).
    pub fn as_str(self) -> &'static str {
        match self {
            Refunded::Done { .. } => "refunded",
            Refunded::Nothing => "nothing",
            Refunded::Completed => "completed",
        }
    }
}

/// The keys a record's lines name, in order (the script's KEYS after the record's own). Each key
/// must carry the record's hash tag `tag` (`{tenant}`): a record can only touch its tenant's slot.
pub fn record_keys(text: &str, tag: &str) -> Result<Vec<String>, BadReply> {
    // a record `decide.lua` wrote that does not follow its contract
    let bad = |why: String| BadReply::new("decision record", why);
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let named = match f.first().copied() {
            Some("v1") if i == 0 => 0,
            Some("fixed" | "sliding" | "bucket" | "log" | "conc") => 1,
            Some("budget" | "idem") => 2,
            other => return Err(bad(format!("has an unknown line {other:?}"))),
        };
        if f.len() < 1 + named {
            return Err(bad(format!("line {i} names fewer keys than its kind has")));
        }
        for k in &f[1..1 + named] {
            if !k.contains(tag) {
                return Err(bad(format!("names a key outside its tenant: {k}")));
            }
            keys.push((*k).to_string());
        }
    }
    if !text.starts_with("v1 ") {
        return Err(bad("does not start with its version line".into()));
    }
    Ok(keys)
}

/// Reads `{outcome, lines}`.
pub fn parse((outcome, lines): (i64, i64)) -> Refunded {
    match outcome {
        1 => Refunded::Done { lines: lines.max(0) as u64 },
        2 => Refunded::Completed,
        _ => Refunded::Nothing,
    }
}

/// Refunds the decision `decision_id` of `tenant` at `now_ms`.
pub async fn run(store: &Store, tenant: &Id, decision_id: &Id, now_ms: u64) -> Result<Refunded, ScriptError> {
    let record = DecisionRecordKey::new(tenant, decision_id);
    let key = record.as_str().to_string();
    let text: Option<String> = store
        .run_with_deadline("refund_get", DEADLINE, |mut c| async move { redis::cmd("GET").arg(key).query_async(&mut c).await })
        .await?;
    let Some(text) = text else { return Ok(Refunded::Nothing) };
    let mut keys = vec![record.as_str().to_string()];
    keys.extend(record_keys(&text, &format!("{{{tenant}}}"))?);
    let args = vec![text, now_ms.to_string(), decision_id.to_string()];
    let reply = Invocation { script: &SCRIPT, op: "refund_lua", keys, args }.run(store, Some(DEADLINE)).await?;
    Ok(parse(reply))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_records_keys_in_order_within_its_tenant() {
        let rec = "v1 1000\nfixed rl:{acme}:a:t:7 3\nbudget q:tokens:{acme}:b:t:202611 q:reserved:{acme}:b:t:x 50\n\
                   bucket q:rps:{acme}:c:t 1 10 60000 8.5\nconc q:conc:{acme}:d:t\nidem idem:key:{acme}:k:i idem:api:{acme}:k:d:i tok dd";
        assert_eq!(
            record_keys(rec, "{acme}").unwrap(),
            [
                "rl:{acme}:a:t:7",
                "q:tokens:{acme}:b:t:202611",
                "q:reserved:{acme}:b:t:x",
                "q:rps:{acme}:c:t",
                "q:conc:{acme}:d:t",
                "idem:key:{acme}:k:i",
                "idem:api:{acme}:k:d:i"
            ]
        );
        assert!(record_keys("v1 1\nfixed rl:{other}:a:t:7 3", "{acme}").is_err(), "another tenant's key");
        assert!(record_keys("v1 1\nleaky rl:{acme}:a 3", "{acme}").is_err());
        assert!(record_keys("v1 1\nbudget q:tokens:{acme}:b", "{acme}").is_err(), "a budget names two keys");
        assert!(record_keys("fixed rl:{acme}:a:t:7 3", "{acme}").is_err(), "no version line");
        assert_eq!(parse((1, 4)), Refunded::Done { lines: 4 });
        assert_eq!(parse((0, 0)), Refunded::Nothing);
        assert_eq!(parse((2, 0)), Refunded::Completed);
    }
}
