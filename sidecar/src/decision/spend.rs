//! Money budgets (`spend_budget`, issue 42 item 3): what a request reserves, what it is settled
//! at, and the calendar period it is counted in. Pure; the Redis side is `decide.lua`'s and
//! `complete.lua`'s `budget` kind, the same as token budgets' (a counter per period, a
//! reservation per decision, reconciled at completion, given back by `refund.lua`).
//!
//! Invariants (decision 300–303; property tests below):
//! - A reservation is the most the request can cost: its input estimated at one token per
//!   4 bytes of body (rounded up), all of it at the dearer of the input and cached-input rates,
//!   plus the output it allows (`max_tokens`…, else the limit's `max_output_tokens`) at the
//!   output rate, at the prices in force when the filter took the request — never less than
//!   1 micro-unit. A call whose real input and output are within those counts costs at most
//!   its reservation.
//! - A settlement charges the real cost (the same prices, the same moment as its usage event
//!   is billed at), else — its usage unread — the reservation; a request that never went
//!   upstream costs 0.
//! - Conservation: with every request settled once (completed, refunded, or its reservation
//!   expired), the counter holds exactly the sum of what each was charged, never below 0.

use crate::invalid::{invalid, Invalid};
use crate::usage::pricing::{Pricing, Rates};
use serde::{Deserialize, Serialize};
use tollgate_wire::llm::{LlmAsk, LlmUsage};
use tollgate_wire::usage::{Day, MAX_TOKENS as MAX_COUNT};

/// The calendar period a money budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    #[default]
    Month,
    Day,
}

/// What a money budget does with a model the price table does not name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Unpriced {
    /// Price it by the default rates (`[usage.pricing] default`, or a `*` price; refused when
    /// there is none).
    #[default]
    Default,
    /// Refuse it: 403 `model_not_priced`.
    Refuse,
}

/// The output a request is reserved for when it does not say (`max_output_tokens`).
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;
/// Bytes of request body per input token, as estimated.
pub const BYTES_PER_TOKEN: u64 = 4;

/// A money budget's own settings, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpendSpec {
    pub period: Period,
    pub max_output_tokens: u64,
    pub unpriced: Unpriced,
    /// The time zone's offset from UTC, in minutes (`utc_offset = "+05:30"`).
    pub offset_min: i32,
}

impl Default for SpendSpec {
    fn default() -> Self {
        SpendSpec { period: Period::Month, max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS, unpriced: Unpriced::Default, offset_min: 0 }
    }
}

/// `+HH:MM` / `-HH:MM` (within ±14:00) as minutes east of UTC.
pub fn parse_offset(s: &str, field: &str) -> Result<i32, Invalid> {
    let bad = || invalid(field, "a fixed offset from UTC such as +00:00, +05:30 or -08:00");
    let (sign, rest) = match s.as_bytes().first() {
        Some(b'+') => (1, &s[1..]),
        Some(b'-') => (-1, &s[1..]),
        _ => return Err(bad()),
    };
    let (h, m) = rest.split_once(':').ok_or_else(bad)?;
    if h.len() != 2 || m.len() != 2 {
        return Err(bad());
    }
    let (h, m): (i32, i32) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
    if m >= 60 || h * 60 + m > 14 * 60 {
        return Err(bad());
    }
    Ok(sign * (h * 60 + m))
}

/// `(period, ms until it ends)` of `now_ms`: `yyyyMM` of a month, `yyyyMMdd` of a day, in the
/// time zone `offset_min` minutes east of UTC.
pub fn period_of(now_ms: u64, period: Period, offset_min: i32) -> (u32, u64) {
    let local = now_ms.saturating_add_signed(i64::from(offset_min) * 60_000);
    let day = Day::of_ms(local);
    let (id, end) = match period {
        Period::Month => ((day.year as u32) * 100 + day.month, day.next_month().days_since_epoch() as u64 * 86_400_000),
        Period::Day => (((day.year as u32) * 100 + day.month) * 100 + day.day, (local / 86_400_000 + 1) * 86_400_000),
    };
    (id, end.saturating_sub(local))
}

/// The moment a request is priced at: when the filter took it (its usage event's `startMs`), if
/// that is at most `window_ms` before now and not after; else now.
pub fn priced_at(ask: Option<&LlmAsk>, now_ms: u64, window_ms: u64) -> u64 {
    ask.and_then(|a| a.start_ms).filter(|s| *s <= now_ms && now_ms - s <= window_ms).unwrap_or(now_ms)
}

/// Why a request cannot be priced by a money budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotPriced {
    pub model: Option<String>,
}

/// The rates a request is reserved at: its model's at `at_ms`; else, unless the budget
/// refuses unpriced models, the default rates; else none.
pub fn rates(spec: &SpendSpec, ask: Option<&LlmAsk>, pricing: &Pricing, at_ms: u64) -> Result<Rates, NotPriced> {
    let model = ask.and_then(|a| a.model.as_deref());
    let named = model.and_then(|m| pricing.rates_of(m, at_ms));
    let rates = match spec.unpriced {
        Unpriced::Refuse => named,
        Unpriced::Default => named.or(pricing.default_rates(at_ms)),
    };
    rates.ok_or_else(|| NotPriced { model: model.map(str::to_string) })
}

/// The input and output a request is reserved for.
pub fn counts(spec: &SpendSpec, ask: Option<&LlmAsk>) -> (u64, u64) {
    let input = ask.map_or(0, |a| a.input_bytes.div_ceil(BYTES_PER_TOKEN)).min(MAX_COUNT);
    // 0 says nothing (some APIs read it as "no bound"): the limit's default applies
    let output = ask.and_then(|a| a.max_output_tokens).filter(|n| *n > 0).unwrap_or(spec.max_output_tokens).min(MAX_COUNT);
    (input, output)
}

/// The most a call of `input` and `output` tokens can cost at `rates`, whatever part of its
/// input is cached: at least 1 micro-unit (an exhausted budget admits nothing).
pub fn reservation(rates: &Rates, input: u64, output: u64) -> u64 {
    let dearer = rates.input_per_mtok.max(rates.cached_input_per_mtok.unwrap_or(rates.input_per_mtok));
    let worst = Rates { input_per_mtok: dearer, output_per_mtok: rates.output_per_mtok, cached_input_per_mtok: None };
    worst.cost(input, output, 0).max(1)
}

/// What a completed request is charged: the cost of the usage it reported, priced as its usage
/// event is (`real`); else 0 when it never went upstream (`tokens == Some(0)` and no usage);
/// else its reservation (its usage unread: never an under-charge).
pub fn settled(reserved: u64, real: Option<u64>, tokens: Option<u64>) -> u64 {
    match (real, tokens) {
        (Some(cost), _) => cost,
        (None, Some(0)) => 0,
        (None, _) => reserved,
    }
}

/// The real cost of a completed request's usage, at `at_ms` ([`Pricing::cost_of`]: the model
/// that answered, else the one asked for, else the default).
pub fn real_cost(pricing: &Pricing, llm: Option<&LlmUsage>, at_ms: u64) -> Option<u64> {
    llm.and_then(|u| pricing.cost_of(u, at_ms))
}

#[cfg(test)]
mod tests;
