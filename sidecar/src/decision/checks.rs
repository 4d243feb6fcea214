//! A request's limits as `decide.lua` checks ([`checks`]), and what the script's reply means for
//! the answer: the deny code, the IETF RateLimit / RateLimit-Policy headers, the limit nearest
//! exhaustion, the ticket an allowed request holds until completion. Pure.
//!
//! Every limit of one decision runs in ONE script call (one Redis round trip, atomic): check all,
//! then take from all only if all pass, so a denied request consumes nothing.

use super::limits::{Algorithm, Limit, LimitFailureMode, SubjectKind, LEASE_MAX_UNITS, LEASE_SHARE_DIVISOR};
use super::spend;
use crate::keys::{
    BudgetCounter, ConcurrencyKey, SpendBudgetKey, FixedWindowKey, Id, ReservationKey, SlidingLogKey, SlidingWindowKey, Subject, TokenBucketKey,
    TokenBudgetKey, TokensPerMinuteKey, RESERVATION_TTL_MS, TOKEN_BUDGET_TTL_MS,
};
use crate::scripts::decide::{Check, Lease, LimitCheck, LimitState};
use crate::usage::pricing::{Pricing, Rates};
use std::net::IpAddr;
use tollgate_wire::llm::LlmAsk;
use tollgate_wire::usage::Day;
use tollgate_wire::{codes, BudgetHold, Header, SlotHold, Ticket};

/// The largest token budget `decide.lua` is given: a month's counter is an i64 in Redis, and a
/// limit above this (up to any u64) behaves as this one, which no month reaches (decision 177).
pub const BUDGET_LIMIT_IN_SCRIPT: u64 = 1 << 62;

/// Rates that price nothing (a money budget that cannot price refused the request before).
const NO_RATES: Rates = Rates { input_per_mtok: 0, output_per_mtok: 0, cached_input_per_mtok: None };

/// The first money budget (not shadow) of `limits` that cannot price the request: its name and
/// why — answered 403 `model_not_priced` before any limit is checked or taken (decision 301).
pub fn unpriced(limits: &[Limit], ctx: &RequestCtx<'_>) -> Option<(String, spend::NotPriced)> {
    limits.iter().filter(|l| l.algorithm == Algorithm::SpendBudget && !l.shadow).find_map(|l| {
        let spec = l.spend.unwrap_or_default();
        let at = spend::priced_at(ctx.llm, ctx.now_ms, RESERVATION_TTL_MS);
        let priced = match ctx.pricing {
            Some(p) => spend::rates(&spec, ctx.llm, p, at).map(|_| ()),
            None => Err(spend::NotPriced { model: ctx.llm.and_then(|a| a.model.clone()) }),
        };
        priced.err().map(|e| (l.name.to_string(), e))
    })
}

/// What one request is, for its limits.
#[derive(Debug, Clone)]
pub struct RequestCtx<'a> {
    pub tenant: &'a Id,
    pub key_id: &'a Id,
    pub product: Option<&'a Id>,
    pub client_ip: Option<IpAddr>,
    pub headers: &'a [Header],
    pub request_id: &'a Id,
    pub now_ms: u64,
    /// Tokens the request says it may use (e.g. `max_tokens`), for budgets.
    pub token_estimate: Option<u64>,
    /// An LLM request's model, size and output bound, for money budgets.
    pub llm: Option<&'a LlmAsk>,
    /// The prices money budgets reserve at (none: a money budget cannot price, see [`unpriced`]).
    pub pricing: Option<&'a Pricing>,
}

/// What one limit's entry in the reply is about.
#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    pub name: String,
    pub algorithm: Algorithm,
    pub limit: u64,
    pub window_ms: u64,
    /// Units one request takes (budgets: their estimate; concurrency: 1).
    pub cost: u64,
    pub shadow: bool,
    pub failure_mode: LimitFailureMode,
    pub subject: String,
    /// Budgets: the period charged, the units reserved and, for money, the moment priced at.
    pub budget: Option<(u32, u64, Option<u64>)>,
}

fn subject_of(kind: &SubjectKind, ctx: &RequestCtx<'_>) -> Subject {
    match kind {
        SubjectKind::Key => Subject::key(ctx.key_id),
        SubjectKind::Tenant => Subject::tenant(),
        SubjectKind::TenantProduct => match ctx.product {
            Some(p) => Subject::product(p),
            None => Subject::tenant(),
        },
        SubjectKind::ClientIp => match ctx.client_ip {
            Some(ip) => Subject::ip(ip),
            None => Subject::header("client-ip", None),
        },
        SubjectKind::Header(h) => {
            Subject::header(h, ctx.headers.iter().find(|x| x.name.eq_ignore_ascii_case(h)).map(|x| x.value.as_str()))
        }
    }
}

/// A request's limits in `decide.lua`'s terms, and per limit what its reply entry is about.
#[derive(Debug, Clone, PartialEq)]
pub struct Checks {
    pub checks: Vec<LimitCheck>,
    pub meta: Vec<Meta>,
}

/// The checks of all `limits` of a request (one script call). Keys carry the tenant's hash tag
/// (crate::keys), so the call touches one Cluster slot.
pub fn checks(limits: &[Limit], ctx: &RequestCtx<'_>) -> Checks {
    let mut checks = Vec::with_capacity(limits.len());
    let mut meta = Vec::with_capacity(limits.len());
    for l in limits {
        let subject = subject_of(&l.subject, ctx);
        let w = l.window_ms;
        let bucket = ctx.now_ms / w;
        let (tenant, name) = (ctx.tenant, &l.name);
        let (kind, cost, budget) = match l.algorithm {
            Algorithm::FixedWindow => (Check::Fixed { key: FixedWindowKey::new(tenant, name, &subject, bucket), window_ms: w }, l.cost, None),
            Algorithm::SlidingWindow => {
                let current = SlidingWindowKey::new(tenant, name, &subject, bucket);
                let previous = SlidingWindowKey::new(tenant, name, &subject, bucket.saturating_sub(1));
                (Check::Sliding { current, previous, window_ms: w }, l.cost, None)
            }
            Algorithm::TokenBucket => (Check::Bucket { key: TokenBucketKey::new(tenant, name, &subject, l.limit, w), refill_ms: w }, l.cost, None),
            Algorithm::SlidingLog => {
                (Check::Log { key: SlidingLogKey::new(l.auth_class, tenant, name, &subject, w), window_ms: w }, l.cost, None)
            }
            Algorithm::TokenBudget => {
                let (period, to_end) = month_of(ctx.now_ms);
                // The request's own estimate may raise the reservation, never lower it below the
                // limit's: a request whose usage is never read is charged its reservation, and a
                // client must not choose that charge (decision 159).
                let estimate = ctx.token_estimate.map_or(l.estimate, |e| e.max(l.estimate)).max(1);
                let check = Check::Budget {
                    counter: TokenBudgetKey::new(tenant, name, &subject, period).into(),
                    reservation: ReservationKey::new(tenant, name, &subject, ctx.request_id),
                    reservation_ttl_ms: RESERVATION_TTL_MS,
                    counter_ttl_ms: TOKEN_BUDGET_TTL_MS,
                    period_left_ms: to_end,
                };
                (check, estimate, Some((period, estimate, None)))
            }
            Algorithm::SpendBudget => {
                let spec = l.spend.unwrap_or_default();
                let (period, to_end) = spend::period_of(ctx.now_ms, spec.period, spec.offset_min);
                let at = spend::priced_at(ctx.llm, ctx.now_ms, RESERVATION_TTL_MS);
                // `unpriced` refused the request before any check when this cannot price it
                let rates = ctx.pricing.and_then(|p| spend::rates(&spec, ctx.llm, p, at).ok()).unwrap_or(NO_RATES);
                let (input, output) = spend::counts(&spec, ctx.llm);
                let reserved = spend::reservation(&rates, input, output);
                let counter = BudgetCounter::Spend(SpendBudgetKey::new(tenant, name, &subject, period));
                let check = Check::Budget {
                    counter_ttl_ms: counter.ttl_ms(),
                    counter,
                    reservation: ReservationKey::new(tenant, name, &subject, ctx.request_id),
                    reservation_ttl_ms: RESERVATION_TTL_MS,
                    period_left_ms: to_end,
                };
                (check, reserved, Some((period, reserved, Some(at))))
            }
            Algorithm::Concurrency => (Check::Concurrency { key: ConcurrencyKey::new(tenant, name, &subject), slot_timeout_ms: w }, 1, None),
            Algorithm::TokensPerMinute => {
                // the calendar minute's counter; the minute is the ticket's period (8 digits
                // where a month's has 6: complete() tells them apart)
                let minute = (ctx.now_ms / MINUTE_MS) as u32;
                let reserved = tokens_per_minute_reservation(l.estimate, ctx.llm);
                let counter = BudgetCounter::Minute(TokensPerMinuteKey::new(tenant, name, &subject, minute));
                let check = Check::Budget {
                    counter_ttl_ms: counter.ttl_ms(),
                    counter,
                    reservation: ReservationKey::new(tenant, name, &subject, ctx.request_id),
                    reservation_ttl_ms: RESERVATION_TTL_MS,
                    period_left_ms: MINUTE_MS - ctx.now_ms % MINUTE_MS,
                };
                (check, reserved, Some((minute, reserved, None)))
            }
        };
        // A budget's limit may be any u64 (one no month reaches); the script sees at most
        // 2^62, so that `limit - used` and the counter's INCRBY stay within Redis's i64
        // (decision 177)
        let limit = if budget.is_some() { l.limit.min(BUDGET_LIMIT_IN_SCRIPT) } else { l.limit };
        checks.push(LimitCheck { limit, cost, shadow: l.shadow, kind });
        meta.push(Meta {
            name: l.name.to_string(),
            algorithm: l.algorithm,
            limit,
            window_ms: w,
            cost,
            shadow: l.shadow,
            failure_mode: l.failure_mode,
            subject: subject.as_str().to_string(),
            budget,
        });
    }
    Checks { checks, meta }
}

const MINUTE_MS: u64 = 60_000;

/// What a request reserves of a per-model tokens-per-minute limit: its input estimated as a
/// money budget's (⌈body bytes / 4⌉) plus the output it allows (`max_tokens`…, else
/// `default_output`), at least 1 — reconciled to the tokens it used at completion.
pub fn tokens_per_minute_reservation(default_output: u64, llm: Option<&LlmAsk>) -> u64 {
    let input = llm.map_or(0, |a| a.input_bytes.div_ceil(spend::BYTES_PER_TOKEN));
    let output = llm.and_then(|a| a.max_output_tokens).filter(|n| *n > 0).unwrap_or(default_output);
    input.saturating_add(output).clamp(1, super::limits::MAX_COUNT)
}

/// A lease of `want` units (capped at [`LEASE_MAX_UNITS`]) taken with the request's own check;
/// a `renewal` admits no request itself (the limits are charged only for what is granted).
pub fn lease(want: u64, renewal: bool) -> Lease {
    Lease { want: want.min(LEASE_MAX_UNITS), renewal, share: LEASE_SHARE_DIVISOR }
}

/// The deny code of an algorithm.
pub fn deny_code(a: Algorithm) -> &'static str {
    match a {
        Algorithm::TokenBudget => codes::QUOTA_EXCEEDED,
        Algorithm::SpendBudget => codes::BUDGET_EXHAUSTED,
        Algorithm::Concurrency => codes::CONCURRENCY_LIMITED,
        _ => codes::RATE_LIMITED,
    }
}

fn secs_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The window a `RateLimit-Policy` advertises, in seconds.
fn policy_window_s(m: &Meta) -> u64 {
    match m.algorithm {
        Algorithm::TokenBudget => 30 * 86400,
        _ => secs_ceil(m.window_ms).max(1),
    }
}

/// `RateLimit-Policy` and `RateLimit` (IETF draft, structured-field form) for limit `i`.
pub fn ratelimit_headers(m: &Meta, s: &LimitState) -> [Header; 2] {
    [
        Header::new("ratelimit-policy", format!("\"{}\";q={};w={}", m.name, m.limit, policy_window_s(m))),
        Header::new("ratelimit", format!("\"{}\";r={};t={}", m.name, s.remaining, secs_ceil(s.reset_ms))),
    ]
}

/// The limit nearest exhaustion (lowest remaining share), ignoring shadow limits.
pub fn nearest(meta: &[Meta], states: &[LimitState]) -> Option<usize> {
    meta.iter()
        .zip(states)
        .enumerate()
        .filter(|(_, (m, _))| !m.shadow)
        .min_by(|(_, (ma, sa)), (_, (mb, sb))| {
            // compare remaining/limit without floats: ra*lb vs rb*la
            (u128::from(sa.remaining) * u128::from(mb.limit)).cmp(&(u128::from(sb.remaining) * u128::from(ma.limit)))
        })
        .map(|(i, _)| i)
}

/// The ticket an allowed request holds until completion (None when it holds nothing).
pub fn ticket(meta: &[Meta], tenant: &Id, request_id: &Id) -> Option<Ticket> {
    let budgets: Vec<BudgetHold> = meta
        .iter()
        .filter_map(|m| {
            m.budget.map(|(period, reserved, priced_at_ms)| BudgetHold { limit: m.name.clone(), subject: m.subject.clone(), period, reserved, priced_at_ms })
        })
        .collect();
    let slots: Vec<SlotHold> = meta
        .iter()
        .filter(|m| m.algorithm == Algorithm::Concurrency)
        .map(|m| SlotHold { limit: m.name.clone(), subject: m.subject.clone() })
        .collect();
    if budgets.is_empty() && slots.is_empty() {
        return None;
    }
    Some(Ticket::new(tenant.to_string(), request_id.to_string(), budgets, slots))
}

/// The longest a request's concurrency slots are held (their timeouts), 0 without slots: its
/// completion ticket must be taken back at least that long.
pub fn slot_hold_ms(meta: &[Meta]) -> u64 {
    meta.iter().filter(|m| m.algorithm == Algorithm::Concurrency).map(|m| m.window_ms).max().unwrap_or(0)
}

/// `(yyyyMM, ms until the month ends)` of a unix-ms instant (UTC).
pub fn month_of(now_ms: u64) -> (u32, u64) {
    let day = Day::of_ms(now_ms);
    let next = day.next_month().days_since_epoch() as u64 * 86_400_000;
    ((day.year as u32) * 100 + day.month, next.saturating_sub(now_ms))
}

/// The budgets of a decision and their usage after it (spent and reserved), for alerts.
pub fn budget_uses<'a>(meta: &'a [Meta], states: &'a [crate::scripts::decide::LimitState]) -> impl Iterator<Item = crate::alerts::BudgetUse<'a>> {
    // a minute's tokens are a rate, not a budget to warn of
    meta.iter().zip(states).filter(|(m, _)| !m.shadow && m.algorithm != Algorithm::TokensPerMinute).filter_map(|(m, s)| {
        let unit = if m.algorithm == Algorithm::SpendBudget { "micros" } else { "tokens" };
        m.budget.map(|(period, ..)| crate::alerts::BudgetUse { limit: &m.name, subject: &m.subject, period, unit, used: m.limit.saturating_sub(s.remaining), budget: m.limit })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripts::decide::DecideCall;

    #[test]
    fn a_lease_is_capped_and_shared() {
        assert_eq!(lease(1 << 40, true), Lease { want: LEASE_MAX_UNITS, renewal: true, share: LEASE_SHARE_DIVISOR });
        assert_eq!(lease(3, false).want, 3);
    }

    #[test]
    fn one_invocation_for_all_limits_with_keys_in_one_slot() {
        let t = Id::parse("acme").unwrap();
        let k = Id::parse("key_1").unwrap();
        let r = Id::parse("req-1").unwrap();
        let hdrs = [Header::new("x-user", "bob")];
        let ctx = RequestCtx {
            tenant: &t,
            key_id: &k,
            product: None,
            client_ip: Some("10.0.0.9".parse().unwrap()),
            headers: &hdrs,
            request_id: &r,
            now_ms: 1_764_374_400_000, // 2025-11-29T00:00:00Z
            token_estimate: Some(5_000),
            llm: None,
            pricing: None,
        };
        let limits = [
            Limit::example(Algorithm::FixedWindow, SubjectKind::Key),
            Limit::example(Algorithm::SlidingWindow, SubjectKind::Tenant),
            Limit::example(Algorithm::TokenBucket, SubjectKind::ClientIp),
            Limit::example(Algorithm::SlidingLog, SubjectKind::Header("x-user".into())),
            Limit::example(Algorithm::TokenBudget, SubjectKind::Key),
            Limit::example(Algorithm::Concurrency, SubjectKind::Key),
        ];
        let planned = checks(&limits, &ctx);
        let call = DecideCall { now_ms: ctx.now_ms, request_id: r.clone(), limits: planned.checks, lease: None, lookup: None, record: None };
        let (keys, args) = call.encode();
        let bucket = 1_764_374_400_000u64 / 60_000;
        assert_eq!(
            keys,
            vec![
                format!("rl:{{acme}}:l:k.key_1:{bucket}"),
                format!("rate:{{acme}}:l:t:{bucket}"),
                format!("rate:{{acme}}:l:t:{}", bucket - 1),
                "q:rps:{acme}:l:ip.10.0.0.9:10/60000".to_string(),
                "rl:api:{acme}:l:h.x-user.bob:60000".to_string(),
                "q:tokens:{acme}:l:k.key_1:202511".to_string(),
                "q:reserved:{acme}:l:k.key_1:req-1".to_string(),
                "q:conc:{acme}:l:k.key_1".to_string(),
            ]
        );
        assert!(keys.iter().all(|k| k.contains("{acme}")));
        assert_eq!(&args[..3], &["1764374400000", "req-1", "6"]);
        assert_eq!(args.len(), 3 + 6 * 6);
        // the budget takes the request's estimate (above the limit's 1000) and reserves for 5 minutes
        assert_eq!(&args[3 + 4 * 6..3 + 5 * 6], &["budget", "10", "300000", "5000", "0", &format!("{TOKEN_BUDGET_TTL_MS}:{}", 2 * 86_400_000)]);
        let t = ticket(&planned.meta, &t, &r).unwrap();
        assert_eq!(t.budgets, vec![BudgetHold { limit: "l".into(), subject: "k.key_1".into(), period: 202511, reserved: 5_000, priced_at_ms: None }]);
        // one below the limit's estimate reserves the limit's (decision 159)
        let low = checks(&limits, &RequestCtx { token_estimate: Some(50), ..ctx });
        let low = DecideCall { now_ms: ctx.now_ms, request_id: r.clone(), limits: low.checks, lease: None, lookup: None, record: None };
        assert_eq!(low.encode().1[3 + 4 * 6 + 3], "1000");
        assert_eq!(t.slots.len(), 1);
    }

    #[test]
    fn headers_and_the_nearest_limit() {
        let denied = LimitState { remaining: 0, reset_ms: 30_500, would_deny: true };
        let m = Meta {
            name: "per-min".into(),
            algorithm: Algorithm::FixedWindow,
            limit: 10,
            window_ms: 60_000,
            cost: 1,
            shadow: false,
            failure_mode: LimitFailureMode::Open,
            subject: "k.x".into(),
            budget: None,
        };
        let [p, r] = ratelimit_headers(&m, &denied);
        assert_eq!((p.name.as_str(), p.value.as_str()), ("ratelimit-policy", "\"per-min\";q=10;w=60"));
        assert_eq!((r.name.as_str(), r.value.as_str()), ("ratelimit", "\"per-min\";r=0;t=31"));
        let mut m2 = m.clone();
        m2.limit = 100;
        let states = [LimitState { remaining: 5, reset_ms: 0, would_deny: false }, LimitState { remaining: 20, reset_ms: 0, would_deny: false }];
        // 5/10 is nearer exhaustion than 20/100? no: 20/100 = 0.2 < 0.5
        assert_eq!(nearest(&[m.clone(), m2], &states), Some(1));
    }

    #[test]
    fn months() {
        assert_eq!(month_of(1_764_374_400_000), (202511, 2 * 86_400_000)); // 2025-11-29
        assert_eq!(month_of(1_767_225_599_999).0, 202512); // 2025-12-31T23:59:59.999Z
        assert_eq!(month_of(1_767_225_600_000).0, 202601);
        assert_eq!(month_of(951_782_400_000).0, 200002); // 2000-02-29
    }
}
