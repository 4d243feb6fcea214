//! Prices of LLM calls as objects of the configuration plane (issue 42 item 2, decisions
//! 337–340): what a stored price is, and the rules a configuration's prices obey. The table in
//! force they make with the file's is crate::usage::pricing's.

use crate::invalid::{check_id, invalid, Invalid};
use std::collections::BTreeMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A price of LLM calls stored in the configuration plane (issue 42 item 2, decision 337): the
/// fields of a `[[usage.pricing.prices]]` entry (crate::usage::pricing::Price) under an id of the
/// operator's, and the currency it is in — the deployment's (`usage.pricing.currency`), filled in
/// by the admin API; a price in another one is refused, and a stored row in another one is not
/// used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceEntry {
    pub id: String,
    /// A model name, a prefix of one ending in `*`, or `*` (the default rates).
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    pub input_per_mtok: u64,
    pub output_per_mtok: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_per_mtok: Option<u64>,
    /// RFC 3339 or `yyyy-MM-dd` (stored as RFC 3339 UTC); absent: from the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_from: Option<String>,
    /// ISO 4217: the deployment's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
}

impl PriceEntry {
    /// The price as the file writes it, to check and price by.
    pub fn price(&self) -> crate::usage::pricing::Price {
        crate::usage::pricing::Price {
            model: self.model.clone(),
            provider: self.provider.clone(),
            input_per_mtok: self.input_per_mtok,
            output_per_mtok: self.output_per_mtok,
            cached_input_per_mtok: self.cached_input_per_mtok,
            effective_from: self.effective_from.clone(),
        }
    }

    /// Checked, as an entry of the table in force (`field` names it in errors).
    pub fn entry(&self, field: &str) -> Result<crate::usage::pricing::Entry, Invalid> {
        self.price().check(field, crate::usage::pricing::Origin::Stored(self.id.clone()))
    }
}

/// The rate fields of a price: each an integer from 0 to 2^53 when present.
const RATE_FIELDS: [&str; 3] = ["input_per_mtok", "output_per_mtok", "cached_input_per_mtok"];

/// A price's rates as written: each an integer from 0 to 2^53 when present — never a fraction,
/// an exponent, a negative number or a string (no floating point in money), named by its field.
pub(super) fn check_rates(v: Value) -> Result<Value, Invalid> {
    for f in RATE_FIELDS {
        match v.get(f) {
            None | Some(Value::Null) if f == "cached_input_per_mtok" => {}
            None => {}
            Some(n) if n.as_u64().is_some_and(|n| n <= crate::usage::pricing::MAX_MICROS) => {}
            Some(n) => {
                let got = match n {
                    Value::Number(n) => n.to_string(),
                    Value::String(_) => "a string".into(),
                    _ => "not a number".into(),
                };
                return Err(invalid(f, format!("an integer of micro-units per million tokens, 0 to 2^53 (got {got})")));
            }
        }
    }
    Ok(v)
}

/// The first price (by id) that breaks a rule: its id, a model pattern, rates within bounds,
/// a readable moment, a currency code — and no price of a smaller id for the same model from
/// the same moment (the later id is the one set aside).
pub(super) fn first_invalid(prices: &BTreeMap<String, PriceEntry>) -> Option<(String, Invalid)> {
    let mut seen = std::collections::HashMap::new();
    for (id, p) in prices {
        let f = format!("prices.{id}");
        let checked = check_id(&format!("{f}.id"), id).and_then(|_| p.entry(&f));
        let e = match checked {
            Ok(e) => e,
            Err(e) => return Some((id.clone(), e)),
        };
        if p.currency.as_ref().is_some_and(|c| crate::usage::pricing::check_currency(c).is_err()) {
            return Some((id.clone(), invalid(format!("{f}.currency"), "an ISO 4217 code such as USD")));
        }
        if let Some(other) = seen.insert((e.pattern, e.from_ms), id) {
            let why = format!("price '{other}' of model '{}' takes effect at the same moment", p.model);
            return Some((id.clone(), invalid(format!("{f}.effective_from"), why)));
        }
    }
    None
}

/// The stored prices, checked; one that breaks a rule is left out.
pub(super) fn entries(prices: &BTreeMap<String, PriceEntry>) -> Vec<crate::usage::pricing::Entry> {
    prices.iter().filter_map(|(id, p)| p.entry(&format!("prices.{id}")).ok()).collect()
}
