//! Money budgets (`spend_budget`, issue 42) through the decider against a real redis-server,
//! the clock driven by the test: a call reserves the most it can cost at the prices in force
//! when the filter took it, is settled at its real cost (once, however often reported), is
//! given back when abandoned or never sent, is refused with 429 when the budget cannot cover it
//! and with 403 when its model cannot be priced; a day's budget counts a calendar day.

use crate::common::{Lab, T0};
use std::sync::Arc;
use std::time::Duration;
use tollgate_sidecar::config::Config;
use tollgate_sidecar::decision::limits::Plans;
use tollgate_sidecar::scripts::refund::Refunded;
use tollgate_sidecar::decision::Decider;
use tollgate_sidecar::usage::pricing::{PriceTable, Pricing};
use tollgate_wire::llm::{LlmAsk, LlmUsage};
use tollgate_wire::refunds::Abandoned;
use tollgate_wire::{Completion, DecideRequest, DecideResponse, Ticket};

const PRICES: &str = "[usage.pricing]\ncurrency = \"USD\"\n\
    [[usage.pricing.prices]]\nmodel = \"gpt-4o-mini*\"\ninput_per_mtok = 150000\noutput_per_mtok = 600000\ncached_input_per_mtok = 75000\n\
    [[usage.pricing.prices]]\nmodel = \"gpt-4o-mini*\"\ninput_per_mtok = 1500000\noutput_per_mtok = 6000000\neffective_from = \"2026-11-29T12:00:01Z\"\n";

async fn lab(limits: &str) -> Lab {
    let toml = format!("{limits}{PRICES}");
    let mut lab = Lab::start(&toml, T0, |cfg| cfg.cache.ttl = Duration::from_secs(600));
    let cfg = Config::from_toml(&toml).unwrap();
    let pricing = Arc::new(PriceTable::new(Pricing::compile(&cfg.usage.pricing).unwrap()));
    lab.decider = Decider::new(lab.store.clone(), &cfg.cache, Plans::compile(&cfg.plans).unwrap(), lab.clock.clone()).with_pricing(pricing);
    lab.key("p").await
}

impl Lab {
    /// A call of `model` allowing `max` output tokens, its body 100 bytes (25 tokens), taken by
    /// the filter at `start`; its decision id and the answer.
    async fn llm_call(&mut self, model: &str, max: Option<u64>, start: u64) -> (String, DecideResponse) {
        self.n += 1;
        let id = format!("{:032x}", 0x5e0d_0000u64 + u64::from(self.n));
        let llm = LlmAsk { model: Some(model.into()), input_bytes: 100, max_output_tokens: max, start_ms: Some(start) };
        let req = DecideRequest { decision_id: Some(id.clone()), llm: Some(llm), ..DecideRequest::new(self.key_hash.clone(), "POST", "api", "/v1/chat/completions") };
        (id, self.decider.decide(&req).await.unwrap())
    }

    fn spent(&self) -> Vec<(String, i64)> {
        let mut keys = self.redis.keys("q:spend:*");
        keys.sort();
        keys.into_iter().map(|k| (k.clone(), self.redis.cmd::<i64>(&["GET", &k]))).collect()
    }
}

fn ticket(r: &DecideResponse) -> Ticket {
    match r {
        DecideResponse::Allow { ticket: Some(t), .. } => t.clone(),
        other => panic!("expected an allow with a ticket, got {other:?}"),
    }
}

/// 20 in (16 cached), 7 out, answered by a dated gpt-4o-mini: 6 micro-USD at the first price.
fn used() -> LlmUsage {
    LlmUsage { requested_model: Some("gpt-4o-mini".into()), model: Some("gpt-4o-mini-2024-07-18".into()), input_tokens: Some(20), output_tokens: Some(7), cached_tokens: Some(16), cost_micros: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_reserves_its_most_and_settles_at_its_real_cost_once() {
    let mut lab = lab("[[plans.p.limits]]\nname = \"m\"\nalgorithm = \"spend_budget\"\nlimit = 200\n").await;
    let counter = format!("q:spend:{{acme}}:m:k.{}:202611", lab.key_id());
    // taken by the filter a second before the new price: reserved 25 × 0.15 + 7 × 0.6 = 8 at the old
    let (_, r) = lab.llm_call("gpt-4o-mini", Some(7), T0 - 1_000).await;
    let t = ticket(&r);
    assert_eq!((t.budgets[0].reserved, t.budgets[0].priced_at_ms, t.budgets[0].period), (8, Some(T0 - 1_000), 202611));
    assert_eq!(lab.spent(), [(counter.clone(), 8)]);
    // settled after the price changed, at the price of its arrival (as its usage event): 6
    lab.clock.set(T0 + 5_000);
    let done = Completion { ticket: t.clone(), status: 200, tokens: Some(27), llm: Some(used()) };
    lab.decider.complete(&done).await.unwrap();
    lab.decider.complete(&done).await.unwrap();
    assert_eq!(lab.spent(), [(counter.clone(), 6)], "settled once at its real cost");
    // now at the new price: 1000 out would be 6038, over the 194 left — refused, nothing taken
    let (_, r) = lab.llm_call("gpt-4o-mini", Some(1_000), T0 + 5_000).await;
    match &r {
        DecideResponse::Deny { status: 429, error, limit, response_headers, .. } => {
            assert_eq!((error.as_str(), limit.as_deref()), ("budget_exhausted", Some("m")));
            let h = |n: &str| response_headers.iter().find(|h| h.name == n).map(|h| h.value.clone());
            assert_eq!(h("ratelimit-policy").as_deref(), Some("\"m\";q=200;w=2592000"));
            assert!(h("ratelimit").is_some_and(|v| v.starts_with("\"m\";r=194;t=")), "{response_headers:?}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    assert_eq!(lab.spent(), [(counter.clone(), 6)]);
    // usage unread: the reservation stands (68 at the new price); never sent: nothing
    let (_, r) = lab.llm_call("gpt-4o-mini", Some(5), T0 + 5_000).await;
    let t = ticket(&r);
    assert_eq!(t.budgets[0].reserved, 68, "25 × 1.5 + 5 × 6 = 67.5, rounded half up");
    lab.decider.complete(&Completion { ticket: t, status: 200, tokens: None, llm: None }).await.unwrap();
    assert_eq!(lab.spent(), [(counter.clone(), 74)]);
    let (_, r) = lab.llm_call("gpt-4o-mini", Some(1), T0 + 5_000).await;
    lab.decider.complete(&Completion { ticket: ticket(&r), status: 503, tokens: Some(0), llm: None }).await.unwrap();
    assert_eq!(lab.spent(), [(counter.clone(), 74)], "never sent upstream: nothing charged");
    // abandoned by the filter: its reservation comes back
    let (id, r) = lab.llm_call("gpt-4o-mini", Some(1), T0 + 5_000).await;
    assert!(matches!(r, DecideResponse::Allow { .. }));
    assert_eq!(lab.spent(), [(counter.clone(), 74 + 44)]);
    let back = lab.decider.refund(&Abandoned { decision_id: id, key_hash: lab.key_hash.clone() }).await.unwrap();
    assert_eq!(back, Refunded::Done { lines: 1 });
    assert_eq!(lab.spent(), [(counter.clone(), 74)]);
    // a forged pricing moment is refused (the MAC covers it)
    let (_, r) = lab.llm_call("gpt-4o-mini", Some(1), T0 + 5_000).await;
    let mut forged = ticket(&r);
    forged.budgets[0].priced_at_ms = Some(T0 - 1_000);
    assert!(lab.decider.complete(&Completion { ticket: forged, status: 200, tokens: Some(27), llm: Some(used()) }).await.is_err());
    lab.redis.assert_ttl_invariant();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpriced_model_is_refused_and_a_day_is_a_calendar_day() {
    let mut lab = lab(
        "[[plans.p.limits]]\nname = \"d\"\nalgorithm = \"spend_budget\"\nperiod = \"day\"\nutc_offset = \"+14:00\"\nlimit = 3000\nunpriced = \"refuse\"\n",
    )
    .await;
    let (_, r) = lab.llm_call("llama-3", Some(5), T0).await;
    match &r {
        DecideResponse::Deny { status: 403, error, limit, .. } => assert_eq!((error.as_str(), limit.as_deref()), ("model_not_priced", Some("d"))),
        other => panic!("expected 403, got {other:?}"),
    }
    assert!(lab.spent().is_empty(), "nothing taken");
    // 12:00 UTC on the 29th is 02:00 on the 30th at +14:00; its counter lives past the day's end
    let (_, r) = lab.llm_call("gpt-4o-mini", None, T0).await;
    assert_eq!(ticket(&r).budgets[0].reserved, 2461, "no bound: the limit's 4096 out at 0.6 and 25 in at 0.15 (2461.35)");
    let key = format!("q:spend:{{acme}}:d:k.{}:20261130", lab.key_id());
    assert_eq!(lab.spent(), [(key.clone(), 2461)]);
    let ttl: i64 = lab.redis.cmd(&["PTTL", &key]);
    assert!(ttl > 22 * 3_600_000 && ttl <= 3 * 86_400_000, "{ttl}");
    // the budget cannot cover a second: 429, its reset at the day's end (22 h)
    lab.clock.set(T0 + 1);
    let (_, r) = lab.llm_call("gpt-4o-mini", None, T0 + 1).await;
    match &r {
        DecideResponse::Deny { status: 429, response_headers, .. } => {
            let after: u64 = response_headers.iter().find(|h| h.name == "retry-after").unwrap().value.parse().unwrap();
            assert!((22 * 3600 - 1..=22 * 3600).contains(&after), "{after}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
}
