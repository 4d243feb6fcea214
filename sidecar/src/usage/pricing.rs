//! Prices of LLM calls (issue 42 item 2, first part): `[usage.pricing]` of the sidecar
//! configuration, and the cost of one call in integer micro-units of one currency — never a
//! float in money (decision 296).
//!
//! A price names a model (exactly, or a prefix ending in `*`: `gpt-4o-mini*` prices the dated
//! versions an upstream answers with), its rates per million input, output and cached-input
//! tokens, and when it takes effect. The sidecar prices each LLM call's event as it takes it
//! (`POST /v1/usage`), at the price in effect at the request's arrival (`startMs`): the cost is
//! written into the event, so a later price change never re-prices past usage, and a replayed
//! spool ships the same cost. The model priced is the one that answered, else the one asked
//! for; a call neither names, or whose model has no price and no `default` is configured, is
//! left unpriced (no `costMicros`), never refused here.
//!
//! Cost = (uncached input × input rate + cached input × cached rate + output × output rate)
//! ÷ 1,000,000, rounded half up to a whole micro-unit, computed in 128 bits (no overflow for any
//! count up to 2^53 and any rate up to 2^53).

use crate::invalid::{invalid, Invalid};
use serde::{Deserialize, Serialize};
use tollgate_wire::llm::{model_name, LlmUsage};

/// The largest rate (micro-units per million tokens) and cost a configuration or an event
/// takes: 2^53, exact in a double as every count here.
pub const MAX_MICROS: u64 = 1 << 53;

/// `[usage.pricing]` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PricingConfig {
    /// The currency every price is in (ISO 4217 code, for reports): one per deployment.
    pub currency: String,
    /// Rates for a model no price names; absent: such calls are left unpriced.
    pub default: Option<Rates>,
    pub prices: Vec<Price>,
}

impl Default for PricingConfig {
    fn default() -> Self {
        PricingConfig { currency: "USD".into(), default: None, prices: Vec::new() }
    }
}

/// Micro-units of the currency per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    pub input_per_mtok: u64,
    pub output_per_mtok: u64,
    /// Cached input; absent: the input rate.
    #[serde(default)]
    pub cached_input_per_mtok: Option<u64>,
}

/// One model's rates from a moment on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// A model name, or a prefix of one ending in `*`.
    pub model: String,
    /// Informative (the provider the rates are from).
    #[serde(default)]
    pub provider: Option<String>,
    pub input_per_mtok: u64,
    pub output_per_mtok: u64,
    #[serde(default)]
    pub cached_input_per_mtok: Option<u64>,
    /// RFC 3339 (`2026-01-01T00:00:00Z`) or a date (`2026-01-01`, UTC midnight); absent: always.
    #[serde(default)]
    pub effective_from: Option<String>,
}

/// The prices, checked, ready to price calls.
#[derive(Debug, Clone, Default)]
pub struct Pricing {
    /// `(pattern, prefix?, from_ms, rates)`, latest first for one pattern.
    prices: Vec<(String, bool, u64, Rates)>,
    default: Option<Rates>,
}

impl Rates {
    fn check(&self, field: &str) -> Result<(), Invalid> {
        let ok = |n: u64| n <= MAX_MICROS;
        if !ok(self.input_per_mtok) || !ok(self.output_per_mtok) || !self.cached_input_per_mtok.is_none_or(ok) {
            return Err(invalid(field, "rates are micro-units per million tokens, at most 2^53"));
        }
        Ok(())
    }

    /// The cost of a call in micro-units (see the module's rule).
    pub fn cost(&self, input: u64, output: u64, cached: u64) -> u64 {
        let cached = cached.min(input);
        let total = u128::from(input - cached) * u128::from(self.input_per_mtok)
            + u128::from(cached) * u128::from(self.cached_input_per_mtok.unwrap_or(self.input_per_mtok))
            + u128::from(output) * u128::from(self.output_per_mtok);
        let micros = (total + 500_000) / 1_000_000;
        u64::try_from(micros).unwrap_or(u64::MAX).min(MAX_MICROS)
    }
}

/// Milliseconds since the epoch of `2026-01-01` (UTC midnight) or an RFC 3339 time.
fn parse_moment(s: &str) -> Option<u64> {
    let full = if s.len() == 10 { format!("{s}T00:00:00Z") } else { s.to_string() };
    let t = humantime::parse_rfc3339(&full).ok()?;
    u64::try_from(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()
}

impl Pricing {
    /// Checks `config`: every model a name or a prefix of one, every rate within bounds, every
    /// moment readable, no two prices of one model from the same moment.
    pub fn compile(config: &PricingConfig) -> Result<Pricing, Invalid> {
        if config.currency.len() != 3 || !config.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(invalid("usage.pricing.currency", "an ISO 4217 code such as USD"));
        }
        if let Some(d) = &config.default {
            d.check("usage.pricing.default")?;
        }
        let mut prices = Vec::with_capacity(config.prices.len());
        for (i, p) in config.prices.iter().enumerate() {
            let field = format!("usage.pricing.prices[{i}]");
            let (pattern, prefix) = match p.model.strip_suffix('*') {
                Some(stem) => (stem, true),
                None => (p.model.as_str(), false),
            };
            if model_name(pattern).is_none() {
                return Err(invalid(format!("{field}.model"), "a model name (1-128 of [A-Za-z0-9._:/@+-]), or a prefix of one ending in *"));
            }
            let rates = Rates { input_per_mtok: p.input_per_mtok, output_per_mtok: p.output_per_mtok, cached_input_per_mtok: p.cached_input_per_mtok };
            rates.check(&field)?;
            let from = match &p.effective_from {
                None => 0,
                Some(s) => parse_moment(s).ok_or_else(|| invalid(format!("{field}.effective_from"), "RFC 3339 or yyyy-MM-dd"))?,
            };
            if prices.iter().any(|(m, pre, f, _)| m == pattern && *pre == prefix && *f == from) {
                return Err(invalid(format!("{field}.effective_from"), "another price of this model takes effect at the same moment"));
            }
            prices.push((pattern.to_string(), prefix, from, rates));
        }
        // latest first: the first in effect is the price
        prices.sort_by_key(|p| std::cmp::Reverse(p.2));
        Ok(Pricing { prices, default: config.default })
    }

    /// The rates of `model` at `at_ms`: an exact name first, then the longest prefix, each the
    /// latest in effect (not the default).
    pub fn rates_of(&self, model: &str, at_ms: u64) -> Option<Rates> {
        let in_effect = || self.prices.iter().filter(|(_, _, from, _)| *from <= at_ms);
        if let Some((_, _, _, r)) = in_effect().find(|(m, prefix, _, _)| !prefix && m == model) {
            return Some(*r);
        }
        // the longest prefix; of one prefix, the latest in effect: the first (min_by_key keeps
        // the first of equals, where max_by_key would keep the last — the oldest price)
        in_effect()
            .filter(|(m, prefix, _, _)| *prefix && model.starts_with(m.as_str()))
            .min_by_key(|(m, _, _, _)| std::cmp::Reverse(m.len()))
            .map(|(_, _, _, r)| *r)
    }

    /// Prices one call (its cost in `llm.cost_micros`, replacing whatever the event said): the
    /// model that answered, else the one asked for, else the default rates, at `at_ms`.
    pub fn price(&self, llm: &mut LlmUsage, at_ms: u64) {
        llm.cost_micros = self.cost_of(llm, at_ms);
    }

    /// What [`Self::price`] writes: the call's cost, or none (no counts, or no rates).
    pub fn cost_of(&self, llm: &LlmUsage, at_ms: u64) -> Option<u64> {
        let named = [llm.model.as_deref(), llm.requested_model.as_deref()];
        let rates = named.into_iter().flatten().find_map(|m| self.rates_of(m, at_ms)).or(self.default);
        match (rates, llm.input_tokens.is_some() || llm.output_tokens.is_some()) {
            (Some(r), true) => Some(r.cost(llm.input_tokens.unwrap_or(0), llm.output_tokens.unwrap_or(0), llm.cached_tokens.unwrap_or(0))),
            _ => None,
        }
    }

    /// The rates of a model no price names, when configured.
    pub fn default_rates(&self) -> Option<Rates> {
        self.default
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rates(i: u64, o: u64, c: Option<u64>) -> Rates {
        Rates { input_per_mtok: i, output_per_mtok: o, cached_input_per_mtok: c }
    }

    fn price(model: &str, r: Rates, from: Option<&str>) -> Price {
        Price {
            model: model.into(),
            provider: None,
            input_per_mtok: r.input_per_mtok,
            output_per_mtok: r.output_per_mtok,
            cached_input_per_mtok: r.cached_input_per_mtok,
            effective_from: from.map(str::to_string),
        }
    }

    fn call(model: Option<&str>, asked: Option<&str>, input: u64, output: u64, cached: Option<u64>) -> LlmUsage {
        LlmUsage {
            requested_model: asked.map(str::to_string),
            model: model.map(str::to_string),
            input_tokens: Some(input),
            output_tokens: Some(output),
            cached_tokens: cached,
            cost_micros: Some(999_999),
        }
    }

    const JAN: u64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

    #[test]
    fn a_call_costs_its_rates_in_whole_micro_units() {
        // gpt-4o-mini: 0.15 / 0.60 / 0.075 USD per million: 4 uncached + 16 cached in, 7 out
        let r = rates(150_000, 600_000, Some(75_000));
        assert_eq!(r.cost(20, 7, 16), 6);
        assert_eq!(rates(1, 0, None).cost(499_999, 0, 0), 0, "half a micro-unit less one rounds down");
        assert_eq!(rates(1, 0, None).cost(500_000, 0, 0), 1, "half rounds up");
        assert_eq!(rates(2_000_000, 0, None).cost(3, 0, 9), 6, "cached beyond the input is input");
        assert_eq!(rates(MAX_MICROS, MAX_MICROS, None).cost(MAX_MICROS, MAX_MICROS, 0), MAX_MICROS, "no overflow, bounded");
    }

    #[test]
    fn the_price_in_effect_at_arrival_and_the_best_name() {
        let config = PricingConfig {
            currency: "EUR".into(),
            default: None,
            prices: vec![
                price("gpt-4o-mini*", rates(1_000_000, 0, None), None),
                price("gpt-4o-mini", rates(2_000_000, 0, None), None),
                price("gpt-4o-mini", rates(3_000_000, 0, None), Some("2026-01-01")),
                price("gpt-4o*", rates(9_000_000, 0, None), None),
            ],
        };
        let p = Pricing::compile(&config).unwrap();
        let cost = |model: &str, at: u64| {
            let mut c = call(Some(model), None, 1, 0, None);
            p.price(&mut c, at);
            c.cost_micros
        };
        assert_eq!(cost("gpt-4o-mini", JAN - 1), Some(2), "before the new price");
        assert_eq!(cost("gpt-4o-mini", JAN), Some(3), "from its moment on");
        assert_eq!(cost("gpt-4o-mini-2024-07-18", JAN), Some(1), "the longest prefix");
        // a prefix priced again later: the latest in effect
        let twice = Pricing::compile(&PricingConfig {
            prices: vec![price("o3*", rates(1_000_000, 0, None), None), price("o3*", rates(4_000_000, 0, None), Some("2026-01-01"))],
            ..config.clone()
        })
        .unwrap();
        let mut c = call(Some("o3-2025"), None, 1, 0, None);
        twice.price(&mut c, JAN - 1);
        assert_eq!(c.cost_micros, Some(1));
        twice.price(&mut c, JAN);
        assert_eq!(c.cost_micros, Some(4), "the later price of the same prefix");
        assert_eq!(cost("gpt-4o-2024-08-06", JAN), Some(9));
        assert_eq!(cost("claude-3-haiku", JAN), None, "no price, no default: unpriced");
        // the model asked for when the answer names none priced; the default last
        let mut c = call(Some("unknown-x"), Some("gpt-4o-mini"), 1, 0, None);
        p.price(&mut c, JAN);
        assert_eq!(c.cost_micros, Some(3));
        let with_default = Pricing::compile(&PricingConfig { default: Some(rates(5_000_000, 0, None)), ..config }).unwrap();
        let mut c = call(Some("claude-3-haiku"), None, 1, 0, None);
        with_default.price(&mut c, JAN);
        assert_eq!(c.cost_micros, Some(5));
        // no counts: nothing to price (a filter's cost is never kept)
        let mut c = LlmUsage { model: Some("gpt-4o-mini".into()), cost_micros: Some(7), ..LlmUsage::default() };
        with_default.price(&mut c, JAN);
        assert_eq!(c.cost_micros, None);
    }

    #[test]
    fn a_configuration_that_cannot_price_is_refused_naming_its_field() {
        let bad = |prices: Vec<Price>, currency: &str| Pricing::compile(&PricingConfig { currency: currency.into(), default: None, prices }).unwrap_err().to_string();
        assert!(bad(vec![], "usd").contains("usage.pricing.currency"));
        assert!(bad(vec![price("gpt 4", rates(1, 1, None), None)], "USD").contains("prices[0].model"));
        assert!(bad(vec![price("m", rates(MAX_MICROS + 1, 1, None), None)], "USD").contains("prices[0]"));
        assert!(bad(vec![price("m", rates(1, 1, None), Some("next week"))], "USD").contains("prices[0].effective_from"));
        let twice = vec![price("m", rates(1, 1, None), Some("2026-01-01")), price("m", rates(2, 2, None), Some("2026-01-01T00:00:00Z"))];
        assert!(bad(twice, "USD").contains("prices[1].effective_from"));
    }

    proptest! {
        /// A call's cost is the sum of what its parts would cost alone, within the rounding of
        /// each part (one micro-unit per part), and never more than the uncached price.
        #[test]
        fn costs_add_up_within_rounding(input in 0u64..1 << 40, output in 0u64..1 << 40, cached in 0u64..1 << 40,
                                        ri in 0u64..1 << 30, ro in 0u64..1 << 30, rc in 0u64..1 << 30) {
            let r = rates(ri, ro, Some(rc.min(ri)));
            let whole = r.cost(input, output, cached);
            let parts = rates(ri, 0, Some(rc.min(ri))).cost(input, 0, cached) + rates(0, ro, None).cost(0, output, 0);
            prop_assert!(whole.abs_diff(parts) <= 1);
            prop_assert!(whole <= rates(ri, ro, None).cost(input, output, 0));
        }
    }
}
