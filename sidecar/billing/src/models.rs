//! The rollup of LLM calls by model (issue 42): `usage_daily_models`, one row per
//! `(day, tenant, key_id, model)` with the requests and the tokens apart — input, output, the
//! cached part of the input, and the total budgets were charged — and what they cost (the sum
//! of the events' `costMicros`, priced by the sidecars: crate docs, decision 296). Moved in the same transaction
//! as `usage_daily`, by the same new events only, so each event counts once here too.
//!
//! The model billed is the one that answered, else the one asked for; an LLM call that named
//! neither is rolled up under the empty name (the report says `(unknown)`). Gateway denials
//! (`denied` set) are never billed and not rolled up here; requests that reached an upstream
//! are, whatever their status (their tokens are what the upstream reported).

use crate::rollup::tokens_i64;
use std::collections::BTreeMap;
use tollgate_wire::usage::UsageEvent;

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS usage_daily_models (
    day           date NOT NULL,
    tenant        text NOT NULL,
    key_id        text NOT NULL,
    model         text NOT NULL,
    requests      bigint NOT NULL DEFAULT 0,
    input_tokens  bigint NOT NULL DEFAULT 0,
    output_tokens bigint NOT NULL DEFAULT 0,
    cached_tokens bigint NOT NULL DEFAULT 0,
    tokens        bigint NOT NULL DEFAULT 0,
    cost_micros   bigint NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (day, tenant, key_id, model)
);
"#;

/// One `usage_daily_models` row's increments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelRollup {
    pub requests: i64,
    pub input: i64,
    pub output: i64,
    pub cached: i64,
    pub tokens: i64,
    /// What the calls cost (micro-units; unpriced calls add nothing).
    pub cost: i64,
}

/// The increments of `events`' LLM calls per `(yyyy-MM-dd, tenant, key_id, model)`, in key order.
pub fn rollup_models<'a>(events: impl IntoIterator<Item = &'a UsageEvent>) -> BTreeMap<(String, String, String, String), ModelRollup> {
    let mut out: BTreeMap<(String, String, String, String), ModelRollup> = BTreeMap::new();
    for e in events {
        let Some(llm) = e.llm.as_ref().filter(|_| e.denied.is_none()) else { continue };
        let model = llm.billed_model().unwrap_or("").to_string();
        let r = out.entry((e.day().iso(), e.tenant.clone(), e.key_id.clone(), model)).or_default();
        let add = |sum: i64, n: Option<u64>| sum.saturating_add(tokens_i64(n.unwrap_or(0)));
        r.requests = r.requests.saturating_add(1);
        r.input = add(r.input, llm.input_tokens);
        r.output = add(r.output, llm.output_tokens);
        r.cached = add(r.cached, llm.cached_tokens);
        r.tokens = add(r.tokens, e.tokens);
        r.cost = add(r.cost, llm.cost_micros);
    }
    out
}

/// Adds `increments` to `usage_daily_models` (saturating, as `usage_daily`).
pub async fn store(
    tx: &tokio_postgres::Transaction<'_>,
    increments: &BTreeMap<(String, String, String, String), ModelRollup>,
) -> Result<(), tokio_postgres::Error> {
    if increments.is_empty() {
        return Ok(());
    }
    let (mut d, mut t, mut k, mut m) = (vec![], vec![], vec![], vec![]);
    let mut cols: [Vec<i64>; 6] = Default::default();
    for ((day, tenant, key, model), r) in increments {
        d.push(day.clone());
        t.push(tenant.clone());
        k.push(key.clone());
        m.push(model.clone());
        for (i, n) in [r.requests, r.input, r.output, r.cached, r.tokens, r.cost].into_iter().enumerate() {
            cols[i].push(n);
        }
    }
    const SUMMED: [&str; 6] = ["requests", "input_tokens", "output_tokens", "cached_tokens", "tokens", "cost_micros"];
    tx.execute(
        &format!(
            "INSERT INTO usage_daily_models AS d (day, tenant, key_id, model, {})
             SELECT u.day::date, u.tenant, u.key_id, u.model, u.rq, u.it, u.ot, u.ct, u.tk, u.cm
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::int8[], $7::int8[], $8::int8[], $9::int8[],
                         $10::int8[]) AS u(day, tenant, key_id, model, rq, it, ot, ct, tk, cm)
             ON CONFLICT (day, tenant, key_id, model) DO UPDATE SET {}",
            SUMMED.join(", "),
            crate::rollup::saturating_sums(&SUMMED)
        ),
        &[&d, &t, &k, &m, &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5]],
    )
    .await
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_wire::llm::LlmUsage;

    fn ev(id: &str, llm: Option<LlmUsage>, tokens: Option<u64>, denied: bool) -> UsageEvent {
        UsageEvent {
            id: id.into(),
            tenant: "acme".into(),
            key_id: "k1".into(),
            plan: "p".into(),
            method: "POST".into(),
            authority: "a".into(),
            path: "/v1/chat/completions".into(),
            status: 200,
            start_ms: 1_764_460_800_000,
            tokens,
            denied: denied.then(|| "rate_limited".into()),
            llm,
            ..UsageEvent::default()
        }
    }

    fn llm(asked: Option<&str>, model: Option<&str>, input: u64, output: u64, cached: Option<u64>) -> Option<LlmUsage> {
        Some(LlmUsage {
            requested_model: asked.map(str::to_string),
            model: model.map(str::to_string),
            input_tokens: Some(input),
            output_tokens: Some(output),
            cached_tokens: cached,
            cost_micros: None,
        })
    }

    #[test]
    fn by_model_answered_else_asked_and_never_denials() {
        let events = [
            ev("a", llm(Some("fast"), Some("gpt-4o-mini"), 10, 5, Some(4)), Some(15), false),
            ev("b", llm(None, Some("gpt-4o-mini"), 1, 2, None), Some(3), false),
            ev("c", llm(Some("claude-3-haiku"), None, 7, 0, None), None, false),
            ev("d", llm(Some("gpt-4o"), None, 100, 100, None), Some(200), true),
            ev("e", None, Some(9), false),
            ev("f", Some(LlmUsage::default()), None, false),
        ];
        let r = rollup_models(&events);
        let row = |m: &str| r.get(&("2025-11-30".into(), "acme".into(), "k1".into(), m.into())).copied();
        assert_eq!(row("gpt-4o-mini"), Some(ModelRollup { requests: 2, input: 11, output: 7, cached: 4, tokens: 18, cost: 0 }));
        assert_eq!(row("claude-3-haiku"), Some(ModelRollup { requests: 1, input: 7, output: 0, cached: 0, tokens: 0, cost: 0 }));
        assert_eq!(row(""), Some(ModelRollup { requests: 1, ..ModelRollup::default() }));
        assert_eq!(row("gpt-4o"), None, "a gateway denial is not billed");
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn sums_saturate() {
        let big = 1u64 << 53;
        let events: Vec<UsageEvent> = (0..2000).map(|i| ev(&format!("id{i}"), llm(None, Some("m"), big, big, Some(big)), Some(big), false)).collect();
        let r = rollup_models(&events);
        let row = r.values().next().copied().unwrap();
        assert_eq!((row.requests, row.input, row.output, row.cached, row.tokens), (2000, i64::MAX, i64::MAX, i64::MAX, i64::MAX));
    }
}
