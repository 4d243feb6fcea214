//! Prices of LLM calls (issue 42 item 2): `[usage.pricing]` of the sidecar configuration, the
//! prices stored in PostgreSQL through the admin API (`/v1/prices`, crate::control), and the cost
//! of one call in integer micro-units of one currency — never a float in money (decision 296).
//!
//! A price names a model (exactly, or a prefix ending in `*`: `gpt-4o-mini*` prices the dated
//! versions an upstream answers with; `*` alone is the default: any model no other price names),
//! its rates per million input, output and cached-input tokens, and when it takes effect. The
//! sidecar prices each LLM call's event as it takes it (`POST /v1/usage`), at the price in
//! effect at the request's arrival (`startMs`), by the table in force when it takes the event:
//! the cost is written into the event, so a later price change never re-prices past usage, and
//! a replayed spool ships the same cost (decision 338). The model priced is the one that
//! answered, else the one asked for, else the default; a call none prices is left unpriced (no
//! `costMicros`), never refused here.
//!
//! The table in force ([`merge`], decision 337): the file's prices (its `default` is a `*` price
//! from the epoch) and the stored ones; a stored price of the same model from the same moment
//! as a file price replaces it. [`PriceTable`] holds it, swapped whole when the configuration
//! plane installs a change: usage intake and money budgets read the same table.
//!
//! Cost = (uncached input × input rate + cached input × cached rate + output × output rate)
//! ÷ 1,000,000, rounded half up to a whole micro-unit, computed in 128 bits (no overflow for any
//! count up to 2^53 and any rate up to 2^53).

use crate::invalid::{invalid, Invalid};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use tollgate_wire::llm::{model_name, LlmUsage};

/// The largest rate (micro-units per million tokens) and cost a configuration or an event
/// takes: 2^53, exact in a double as every count here.
pub const MAX_MICROS: u64 = 1 << 53;

/// The model pattern of the default price: any model no other price names.
pub const DEFAULT_MODEL: &str = "*";

/// `[usage.pricing]` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PricingConfig {
    /// The currency every price is in (ISO 4217 code, for reports): one per deployment.
    pub currency: String,
    /// Rates for a model no price names (a `*` price from the epoch); absent: such calls are
    /// left unpriced.
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
    /// A model name, a prefix of one ending in `*`, or `*` (the default).
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

/// What a model pattern matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// One model name.
    Exact(String),
    /// Every name starting with this (not empty).
    Prefix(String),
    /// `*`: any model no other price names.
    Default,
}

impl Pattern {
    /// `gpt-4o`, `gpt-4o*` or `*`; `None` when it is none of those.
    pub fn parse(model: &str) -> Option<Pattern> {
        if model == DEFAULT_MODEL {
            return Some(Pattern::Default);
        }
        match model.strip_suffix('*') {
            Some(stem) => model_name(stem).map(|s| Pattern::Prefix(s.to_string())),
            None => model_name(model).map(|s| Pattern::Exact(s.to_string())),
        }
    }

    /// As written (`gpt-4o*`).
    pub fn text(&self) -> String {
        match self {
            Pattern::Exact(m) => m.clone(),
            Pattern::Prefix(m) => format!("{m}*"),
            Pattern::Default => DEFAULT_MODEL.into(),
        }
    }
}

/// Where a price in force comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `[usage.pricing]` of the file.
    File,
    /// The configuration plane (PostgreSQL), under this id.
    Stored(String),
}

/// One price, checked: what the table in force is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub pattern: Pattern,
    pub provider: Option<String>,
    pub from_ms: u64,
    pub rates: Rates,
    pub origin: Origin,
}

impl Entry {
    /// As `GET /v1/pricing` shows it.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "model": self.pattern.text(),
            "input_per_mtok": self.rates.input_per_mtok,
            "output_per_mtok": self.rates.output_per_mtok,
            "effective_from": format_moment(self.from_ms),
            "source": match self.origin { Origin::File => "file", Origin::Stored(_) => "stored" },
        });
        if let Some(c) = self.rates.cached_input_per_mtok {
            v["cached_input_per_mtok"] = c.into();
        }
        if let Some(p) = &self.provider {
            v["provider"] = p.clone().into();
        }
        if let Origin::Stored(id) = &self.origin {
            v["id"] = id.clone().into();
        }
        v
    }
}

/// The prices, checked, ready to price calls.
#[derive(Debug, Clone, Default)]
pub struct Pricing {
    /// An exact name's prices, latest first.
    exact: HashMap<String, Vec<(u64, Rates)>>,
    /// `(prefix, from_ms, rates)`, latest first for one prefix.
    prefixes: Vec<(String, u64, Rates)>,
    /// The default's prices (`*`), latest first.
    defaults: Vec<(u64, Rates)>,
}

/// The longest provider name a price keeps (it is informative).
pub const MAX_PROVIDER: usize = 64;

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
pub fn parse_moment(s: &str) -> Option<u64> {
    let full = if s.len() == 10 { format!("{s}T00:00:00Z") } else { s.to_string() };
    let t = humantime::parse_rfc3339(&full).ok()?;
    u64::try_from(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()
}

/// A moment as RFC 3339 UTC, to the second (to the millisecond when it has them).
pub fn format_moment(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    match ms % 1000 {
        0 => humantime::format_rfc3339_seconds(t).to_string(),
        _ => humantime::format_rfc3339_millis(t).to_string(),
    }
}

impl Price {
    /// Checks one price (`field` names it in errors): a model pattern, rates within bounds, a
    /// readable moment, a short provider.
    pub fn check(&self, field: &str, origin: Origin) -> Result<Entry, Invalid> {
        let pattern = Pattern::parse(&self.model).ok_or_else(|| {
            invalid(format!("{field}.model"), "a model name (1-128 of [A-Za-z0-9._:/@+-]), a prefix of one ending in *, or * (the default)")
        })?;
        let rates = Rates { input_per_mtok: self.input_per_mtok, output_per_mtok: self.output_per_mtok, cached_input_per_mtok: self.cached_input_per_mtok };
        rates.check(field)?;
        let from_ms = match &self.effective_from {
            None => 0,
            Some(s) => parse_moment(s).ok_or_else(|| invalid(format!("{field}.effective_from"), "RFC 3339 (2026-03-01T00:00:00Z) or yyyy-MM-dd"))?,
        };
        if self.provider.as_ref().is_some_and(|p| p.len() > MAX_PROVIDER || p.chars().any(char::is_control)) {
            return Err(invalid(format!("{field}.provider"), format!("at most {MAX_PROVIDER} bytes, no control characters")));
        }
        Ok(Entry { pattern, provider: self.provider.clone(), from_ms, rates, origin })
    }
}

/// Checks the currency of `[usage.pricing]`: an ISO 4217 code.
pub fn check_currency(currency: &str) -> Result<(), Invalid> {
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(invalid("usage.pricing.currency", "an ISO 4217 code such as USD"));
    }
    Ok(())
}

/// The file's prices, checked: its `default` first (a `*` price from the epoch), then its list
/// in order. Two of one model from the same moment are refused.
pub fn file_entries(config: &PricingConfig) -> Result<Vec<Entry>, Invalid> {
    check_currency(&config.currency)?;
    let mut out = Vec::with_capacity(config.prices.len() + 1);
    if let Some(d) = &config.default {
        d.check("usage.pricing.default")?;
        out.push(Entry { pattern: Pattern::Default, provider: None, from_ms: 0, rates: *d, origin: Origin::File });
    }
    for (i, p) in config.prices.iter().enumerate() {
        let field = format!("usage.pricing.prices[{i}]");
        let e = p.check(&field, Origin::File)?;
        if out.iter().any(|o| o.pattern == e.pattern && o.from_ms == e.from_ms) {
            let why = match e.pattern {
                Pattern::Default => "the default (usage.pricing.default, or another * price) takes effect at the same moment",
                _ => "another price of this model takes effect at the same moment",
            };
            return Err(invalid(format!("{field}.effective_from"), why));
        }
        out.push(e);
    }
    Ok(out)
}

/// The table in force (decision 337): `file` (checked by [`file_entries`]) with `stored` (each
/// checked, none two of one model from one moment): a stored price of the same model from the
/// same moment as a file price replaces it. File prices first, then the stored ones, each in
/// their order.
pub fn merge(file: Vec<Entry>, stored: impl IntoIterator<Item = Entry>) -> Vec<Entry> {
    let stored: Vec<Entry> = stored.into_iter().collect();
    let mut out: Vec<Entry> = file.into_iter().filter(|f| !stored.iter().any(|s| s.pattern == f.pattern && s.from_ms == f.from_ms)).collect();
    out.extend(stored);
    out
}

impl Pricing {
    /// Checks `config`: every model a pattern, every rate within bounds, every moment readable,
    /// no two prices of one model from the same moment.
    pub fn compile(config: &PricingConfig) -> Result<Pricing, Invalid> {
        Ok(Pricing::of(&file_entries(config)?))
    }

    /// The table of checked entries (see [`merge`]).
    pub fn of(entries: &[Entry]) -> Pricing {
        let mut p = Pricing::default();
        for e in entries {
            match &e.pattern {
                Pattern::Exact(m) => p.exact.entry(m.clone()).or_default().push((e.from_ms, e.rates)),
                Pattern::Prefix(m) => p.prefixes.push((m.clone(), e.from_ms, e.rates)),
                Pattern::Default => p.defaults.push((e.from_ms, e.rates)),
            }
        }
        // latest first: the first in effect is the price
        for list in p.exact.values_mut() {
            list.sort_by_key(|(from, _)| std::cmp::Reverse(*from));
        }
        p.prefixes.sort_by_key(|(_, from, _)| std::cmp::Reverse(*from));
        p.defaults.sort_by_key(|(from, _)| std::cmp::Reverse(*from));
        p
    }

    /// The rates of `model` at `at_ms`: an exact name first, then the longest prefix, each the
    /// latest in effect (not the default).
    pub fn rates_of(&self, model: &str, at_ms: u64) -> Option<Rates> {
        if let Some((_, r)) = self.exact.get(model).and_then(|list| list.iter().find(|(from, _)| *from <= at_ms)) {
            return Some(*r);
        }
        // the longest prefix; of one prefix, the latest in effect: the first (min_by_key keeps
        // the first of equals, where max_by_key would keep the last — the oldest price)
        self.prefixes
            .iter()
            .filter(|(m, from, _)| *from <= at_ms && model.starts_with(m.as_str()))
            .min_by_key(|(m, _, _)| std::cmp::Reverse(m.len()))
            .map(|(_, _, r)| *r)
    }

    /// Prices one call (its cost in `llm.cost_micros`, replacing whatever the event said): the
    /// model that answered, else the one asked for, else the default rates, at `at_ms`.
    pub fn price(&self, llm: &mut LlmUsage, at_ms: u64) {
        llm.cost_micros = self.cost_of(llm, at_ms);
    }

    /// What [`Self::price`] writes: the call's cost, or none (no counts, or no rates).
    pub fn cost_of(&self, llm: &LlmUsage, at_ms: u64) -> Option<u64> {
        let named = [llm.model.as_deref(), llm.requested_model.as_deref()];
        let rates = named.into_iter().flatten().find_map(|m| self.rates_of(m, at_ms)).or(self.default_rates(at_ms));
        match (rates, llm.input_tokens.is_some() || llm.output_tokens.is_some()) {
            (Some(r), true) => Some(r.cost(llm.input_tokens.unwrap_or(0), llm.output_tokens.unwrap_or(0), llm.cached_tokens.unwrap_or(0))),
            _ => None,
        }
    }

    /// The rates of a model no price names at `at_ms` (the `*` price in effect then), when
    /// there is one.
    pub fn default_rates(&self, at_ms: u64) -> Option<Rates> {
        self.defaults.iter().find(|(from, _)| *from <= at_ms).map(|(_, r)| *r)
    }
}

/// The prices in force, swapped whole: what usage intake prices events by and money budgets
/// reserve and settle at (one table for both, so a call is charged what it is billed).
#[derive(Debug, Default)]
pub struct PriceTable(RwLock<Arc<Pricing>>);

impl PriceTable {
    pub fn new(p: Pricing) -> PriceTable {
        PriceTable(RwLock::new(Arc::new(p)))
    }

    /// The table in force now.
    pub fn get(&self) -> Arc<Pricing> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Puts `p` in force.
    pub fn set(&self, p: Pricing) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(p);
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

    #[test]
    fn a_star_price_is_the_default_from_its_moment_on() {
        let config = PricingConfig {
            currency: "USD".into(),
            default: Some(rates(1_000_000, 0, None)),
            prices: vec![price("*", rates(2_000_000, 0, None), Some("2026-01-01")), price("gpt-4o*", rates(9_000_000, 0, None), None)],
        };
        let p = Pricing::compile(&config).unwrap();
        assert_eq!(p.default_rates(JAN - 1), Some(rates(1_000_000, 0, None)), "the file's default before");
        assert_eq!(p.default_rates(JAN), Some(rates(2_000_000, 0, None)), "the * price from its moment");
        // the default is the last resort: a model asked for that is priced comes first
        let c = call(Some("unknown-x"), Some("gpt-4o"), 1, 0, None);
        assert_eq!(p.cost_of(&c, JAN), Some(9));
        assert_eq!(p.cost_of(&call(Some("llama"), None, 1, 0, None), JAN), Some(2));
        // `*` and `default` from the epoch are one price twice
        let twice = PricingConfig { prices: vec![price("*", rates(1, 1, None), None)], ..config };
        assert!(Pricing::compile(&twice).unwrap_err().to_string().contains("prices[0].effective_from"));
        for (model, want) in [("*", Some(Pattern::Default)), ("a*", Some(Pattern::Prefix("a".into()))), ("a", Some(Pattern::Exact("a".into()))), ("**", None), ("a b*", None), ("", None)] {
            assert_eq!(Pattern::parse(model), want, "{model:?}");
        }
    }

    #[test]
    fn a_stored_price_replaces_the_file_price_of_its_model_and_moment_only() {
        let file = file_entries(&PricingConfig {
            currency: "USD".into(),
            default: Some(rates(1_000_000, 0, None)),
            prices: vec![price("m", rates(2_000_000, 0, None), None), price("m", rates(3_000_000, 0, None), Some("2026-01-01"))],
        })
        .unwrap();
        let stored = |model: &str, r: Rates, from: Option<&str>, id: &str| price(model, r, from).check("prices.x", Origin::Stored(id.into())).unwrap();
        let merged = merge(file, [stored("m", rates(5_000_000, 0, None), Some("2026-01-01T00:00:00Z"), "m-jan"), stored("*", rates(7_000_000, 0, None), None, "any")]);
        let p = Pricing::of(&merged);
        let cost = |model: &str, at: u64| p.cost_of(&call(Some(model), None, 1, 0, None), at);
        assert_eq!(cost("m", JAN - 1), Some(2), "the file's earlier price stays");
        assert_eq!(cost("m", JAN), Some(5), "the stored one replaced the file's of the same moment");
        assert_eq!(cost("other", 0), Some(7), "a stored * from the epoch replaced the file's default");
        assert_eq!(merged.len(), 3);
        assert_eq!(merged.iter().filter(|e| e.origin == Origin::File).count(), 1);
        let shown = merged.iter().find(|e| e.origin == Origin::Stored("m-jan".into())).unwrap().to_json();
        assert_eq!(shown["effective_from"], "2026-01-01T00:00:00Z");
        assert_eq!((shown["source"].as_str(), shown["id"].as_str(), shown["model"].as_str()), (Some("stored"), Some("m-jan"), Some("m")));
        assert_eq!(format_moment(JAN + 1), "2026-01-01T00:00:00.001Z");
        assert_eq!(format_moment(0), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn the_table_in_force_is_swapped_whole() {
        let t = PriceTable::new(Pricing::default());
        let held = t.get();
        t.set(Pricing::compile(&PricingConfig { default: Some(rates(1_000_000, 0, None)), ..PricingConfig::default() }).unwrap());
        assert_eq!(held.default_rates(0), None, "a reader keeps the table it took");
        assert_eq!(t.get().default_rates(0), Some(rates(1_000_000, 0, None)));
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
