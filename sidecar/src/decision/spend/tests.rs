//! Money budgets' pure rules, and a property test that reserving, settling and refunding
//! conserve micro-units (decision 303).

use super::*;
use crate::usage::pricing::{Price, PricingConfig};
use proptest::prelude::*;

fn rt(i: u64, o: u64, c: Option<u64>) -> Rates {
    Rates { input_per_mtok: i, output_per_mtok: o, cached_input_per_mtok: c }
}

fn pricing(default: Option<Rates>) -> Pricing {
    let price = |model: &str, r: Rates, from: Option<&str>| Price {
        model: model.into(),
        provider: None,
        input_per_mtok: r.input_per_mtok,
        output_per_mtok: r.output_per_mtok,
        cached_input_per_mtok: r.cached_input_per_mtok,
        effective_from: from.map(str::to_string),
    };
    let prices = vec![price("gpt-4o-mini*", rt(150_000, 600_000, Some(75_000)), None), price("gpt-4o-mini", rt(300_000, 1_200_000, None), Some("2026-01-01"))];
    Pricing::compile(&PricingConfig { currency: "USD".into(), default, prices }).unwrap()
}

fn ask(model: Option<&str>, bytes: u64, max: Option<u64>) -> LlmAsk {
    LlmAsk { model: model.map(str::to_string), input_bytes: bytes, max_output_tokens: max, start_ms: None }
}

const JAN: u64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

#[test]
fn periods_are_calendar_months_and_days_in_the_limits_zone() {
    let dec5 = 1_796_432_400_000; // 2026-12-05T01:00:00Z
    assert_eq!(period_of(dec5, Period::Month, 0), (202612, 26 * 86_400_000 + 23 * 3_600_000));
    assert_eq!(period_of(dec5, Period::Day, 0), (20261205, 23 * 3_600_000));
    // at UTC-02:00 it is still the 4th, 23:00; at +05:30 the 5th, 06:30
    assert_eq!(period_of(dec5, Period::Day, -120), (20261204, 3_600_000));
    assert_eq!(period_of(dec5, Period::Day, 330), (20261205, 17 * 3_600_000 + 30 * 60_000));
    assert_eq!(period_of(JAN - 1, Period::Month, 0).0, 202512);
    assert_eq!(period_of(JAN - 1, Period::Month, 60).0, 202601, "a new year an hour early east of UTC");
    assert_eq!(parse_offset("+05:30", "f").unwrap(), 330);
    assert_eq!(parse_offset("-08:00", "f").unwrap(), -480);
    for bad in ["05:30", "+5:30", "+15:00", "+01:60", "", "+aa:00"] {
        assert!(parse_offset(bad, "f").is_err(), "{bad}");
    }
}

#[test]
fn a_reservation_is_the_most_a_request_can_cost() {
    let spec = SpendSpec { max_output_tokens: 1000, ..SpendSpec::default() };
    assert_eq!(counts(&spec, Some(&ask(None, 401, Some(20)))), (101, 20), "bytes / 4, rounded up");
    assert_eq!(counts(&spec, Some(&ask(None, 0, None))), (0, 1000), "no bound: the limit's default");
    assert_eq!(counts(&spec, Some(&ask(None, 0, Some(0)))), (0, 1000), "0 bounds nothing");
    assert_eq!(counts(&spec, None), (0, 1000));
    // 100 in at the dearer of input (0.15) and cached (0.075), 20 out at 0.60: 15 + 12 micro-units
    let r = rt(150_000, 600_000, Some(75_000));
    assert_eq!(reservation(&r, 100, 20), 27);
    assert_eq!(reservation(&rt(1, 1, Some(9)), 1_000_000, 0), 9, "a cached rate dearer than input is the worst case");
    assert_eq!(reservation(&rt(0, 0, None), 5, 5), 1, "at least one micro-unit");
}

#[test]
fn the_model_is_priced_by_its_own_rates_else_the_default_unless_refused() {
    let p = pricing(Some(rt(1_000_000, 2_000_000, None)));
    let spec = SpendSpec::default();
    assert_eq!(rates(&spec, Some(&ask(Some("gpt-4o-mini"), 0, None)), &p, JAN - 1), Ok(rt(150_000, 600_000, Some(75_000))));
    assert_eq!(rates(&spec, Some(&ask(Some("gpt-4o-mini"), 0, None)), &p, JAN), Ok(rt(300_000, 1_200_000, None)), "the price in force");
    assert_eq!(rates(&spec, Some(&ask(Some("llama-3"), 0, None)), &p, JAN), Ok(rt(1_000_000, 2_000_000, None)), "the default");
    assert_eq!(rates(&spec, None, &p, JAN), Ok(rt(1_000_000, 2_000_000, None)), "no model: the default");
    let refuse = SpendSpec { unpriced: Unpriced::Refuse, ..spec };
    assert_eq!(rates(&refuse, Some(&ask(Some("llama-3"), 0, None)), &p, JAN), Err(NotPriced { model: Some("llama-3".into()) }));
    assert!(rates(&refuse, Some(&ask(Some("gpt-4o-mini-2024-07-18"), 0, None)), &p, JAN).is_ok());
    assert_eq!(rates(&spec, Some(&ask(Some("llama-3"), 0, None)), &pricing(None), JAN), Err(NotPriced { model: Some("llama-3".into()) }), "no default: refused");
}

#[test]
fn a_request_is_priced_when_the_filter_took_it_within_bounds() {
    let at = |start: Option<u64>| priced_at(Some(&LlmAsk { start_ms: start, ..LlmAsk::default() }), 10_000, 5_000);
    assert_eq!(at(Some(9_000)), 9_000);
    assert_eq!(at(Some(4_000)), 10_000, "too old: now");
    assert_eq!(at(Some(10_001)), 10_000, "in the future: now");
    assert_eq!(at(None), 10_000);
}

#[test]
fn a_settlement_charges_the_real_cost_else_nothing_unsent_else_the_reservation() {
    assert_eq!(settled(50, Some(7), Some(30)), 7);
    assert_eq!(settled(50, Some(70), Some(30)), 70, "an overrun is charged");
    assert_eq!(settled(50, None, Some(0)), 0, "never went upstream");
    assert_eq!(settled(50, None, Some(12)), 50, "usage without prices: the reservation");
    assert_eq!(settled(50, None, None), 50, "usage unread: the reservation");
    let p = pricing(None);
    let used = LlmUsage { model: Some("gpt-4o-mini-2024-07-18".into()), input_tokens: Some(100), output_tokens: Some(20), cached_tokens: Some(40), ..LlmUsage::default() };
    // 60 × 0.15 + 40 × 0.075 + 20 × 0.60 = 9 + 3 + 12
    assert_eq!(real_cost(&p, Some(&used), JAN - 1), Some(24));
    assert_eq!(real_cost(&p, None, JAN), None);
}

/// The scripts' arithmetic on one budget, as their contracts state it (`decide.lua` budget:
/// admit iff used + reservation ≤ limit, then add it; `complete.lua`: add actual − reserved, or,
/// the reservation expired, the overrun only; `refund.lua`: give the reservation back, never
/// below 0) — driven by this module's reservations and settlements.
#[derive(Default)]
struct Budget {
    used: i128,
    peak: i128,
}

#[derive(Debug, Clone)]
enum End {
    Completed { input: u64, output: u64, cached: u64, expired_first: bool },
    Unread,
    NeverSent,
    Refunded,
}

fn end() -> impl Strategy<Value = End> {
    prop_oneof![
        4 => (0u64..3_000, 0u64..600, 0u64..3_000, any::<bool>()).prop_map(|(input, output, cached, e)| End::Completed { input, output, cached: cached.min(input), expired_first: e }),
        1 => Just(End::Unread),
        1 => Just(End::NeverSent),
        1 => Just(End::Refunded),
    ]
}

proptest! {
    /// Whatever the order requests start and end in, the counter holds exactly what each was
    /// charged (its real cost, its reservation when unread, 0 when refunded or never sent, and
    /// an overrun on top of an expired reservation), never goes below 0, a refund never gives
    /// back more than was reserved, and while real usage stays within what was reserved for,
    /// the counter never passes the limit.
    #[test]
    fn reserving_settling_and_refunding_conserve_micro_units(
        r in (0u64..2_000_000, 0u64..8_000_000, proptest::option::of(0u64..2_000_000)),
        limit in 1u64..5_000,
        reqs in proptest::collection::vec((0u64..12_000, proptest::option::of(0u64..800), end()), 1..60),
        order in proptest::collection::vec(any::<prop::sample::Index>(), 0..60),
    ) {
        let rates = rt(r.0, r.1, r.2);
        let spec = SpendSpec { max_output_tokens: 500, ..SpendSpec::default() };
        let mut b = Budget::default();
        let mut charged: i128 = 0;
        let mut within = true;
        // start every request, then end them in an arbitrary interleaving
        let mut open: Vec<(u64, u64, u64, End)> = Vec::new(); // (reserved, input est, output est, end)
        let mut pending = reqs.clone();
        let mut picks = order.into_iter();
        while !pending.is_empty() || !open.is_empty() {
            let start = !pending.is_empty() && (open.is_empty() || picks.next().is_some_and(|i| i.index(2) == 0));
            if start {
                let (bytes, max, end) = pending.remove(0);
                let (input, output) = counts(&spec, Some(&LlmAsk { input_bytes: bytes, max_output_tokens: max, ..LlmAsk::default() }));
                let reserved = reservation(&rates, input, output);
                if b.used + i128::from(reserved) <= i128::from(limit) {
                    b.used += i128::from(reserved);
                    open.push((reserved, input, output, end));
                }
            } else {
                let i = picks.next().map_or(0, |x| x.index(open.len()));
                let (reserved, input_est, output_est, end) = open.remove(i);
                let r = i128::from(reserved);
                match end {
                    End::Completed { input, output, cached, expired_first } => {
                        let real = rates.cost(input, output, cached);
                        if input <= input_est && output <= output_est {
                            prop_assert!(real <= reserved, "usage within its counts costs at most the reservation");
                        } else {
                            within = false;
                        }
                        let actual = i128::from(settled(reserved, Some(real), Some(input + output)));
                        prop_assert_eq!(actual, i128::from(real));
                        let delta = if expired_first { (actual - r).max(0) } else { actual - r };
                        b.used += delta;
                        charged += if expired_first { actual.max(r) } else { actual };
                    }
                    End::Unread => {
                        let actual = i128::from(settled(reserved, None, None));
                        b.used += actual - r;
                        charged += actual;
                    }
                    End::NeverSent => {
                        b.used += i128::from(settled(reserved, None, Some(0))) - r;
                    }
                    End::Refunded => {
                        let back = r.min(b.used);
                        prop_assert!(back <= r);
                        b.used -= back;
                    }
                }
            }
            prop_assert!(b.used >= 0);
            b.peak = b.peak.max(b.used);
        }
        prop_assert_eq!(b.used, charged, "the counter is the sum of the charges");
        if within {
            prop_assert!(b.peak <= i128::from(limit), "within its reservations, spend never passes the limit");
        }
    }

    /// A reservation covers any call within its counts, whatever part of the input is cached.
    #[test]
    fn a_reservation_covers_every_call_within_its_counts(
        r in (0u64..1u64 << 40, 0u64..1u64 << 40, proptest::option::of(0u64..1u64 << 40)),
        est in (0u64..1u64 << 30, 0u64..1u64 << 30),
        used in (any::<prop::sample::Index>(), any::<prop::sample::Index>(), any::<prop::sample::Index>()),
    ) {
        let rates = rt(r.0, r.1, r.2);
        let input = used.0.index(est.0 as usize + 1) as u64;
        let output = used.1.index(est.1 as usize + 1) as u64;
        let cached = used.2.index(input as usize + 1) as u64;
        prop_assert!(rates.cost(input, output, cached) <= reservation(&rates, est.0, est.1));
    }
}
