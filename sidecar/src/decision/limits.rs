//! Plans and their limits: configuration, and the pure parts of enforcing them — building one
//! `decide.lua` invocation for all of a request's limits, reading its reply, and the response
//! headers (IETF RateLimit / RateLimit-Policy, Retry-After).
//!
//! Every limit of one decision runs in ONE script call (one Redis round trip, atomic): check all,
//! then take from all only if all pass, so a denied request consumes nothing. Keys carry the
//! tenant's hash tag (see `keys`), so the call touches one Cluster slot.
//!
//! Leased limits (`mode = "leased"`, fixed windows and token buckets): the same call may also
//! take a *lease* — `granted` more requests' worth of units from every limit of the plan, which
//! the filter then admits locally without a call. The grant is taken in the same atomic script as
//! the request's own check (still one round trip), is never more than `1 / LEASE_SHARE_DIVISOR`
//! of what is left after the request (so replicas share and the tail of a window is exact), and
//! lives at most `LEASE_MAX_TTL_MS`, never past the end of the window it was taken from. The
//! limit is therefore never over-admitted; leased units left unspent at expiry are under-use.

use crate::keys::{
    ConcurrencyKey, FixedWindowKey, Id, ReservationKey, SlidingLogKey, SlidingWindowKey, Subject, TokenBucketKey,
    TokenBudgetKey, RESERVATION_TTL_MS, TOKEN_BUDGET_TTL_MS,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;
use tollgate_wire::{codes, BudgetHold, Header, SlotHold, Ticket};

/// The limit algorithms (seed names in docs/redis-keys.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Seed 004: `INCR` + `EXPIRE` per window, TTL 2 × window.
    FixedWindow,
    /// Seed 003: the current bucket plus the previous one weighted by how much of it is still
    /// inside the window.
    SlidingWindow,
    /// Seed 000: refill, check and take in one script; `window` = time to refill from empty.
    TokenBucket,
    /// Seed 002: a zset of request timestamps.
    SlidingLog,
    /// Seed 000: monthly tokens, reserved at decide time and reconciled at completion.
    TokenBudget,
    /// Seed 000: requests in flight; `window` = how long a slot lives without a completion.
    Concurrency,
}

/// What to do with a limit when Redis cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitFailureMode {
    /// Let the request through (seed 002's default for rate limiters).
    Open,
    /// Refuse it with 503 `limits_unavailable`.
    Closed,
}

/// How a limit is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LimitMode {
    /// Every request is decided by the sidecar (one call, one script run).
    #[default]
    Exact,
    /// The filter spends leases of units taken from the limit in advance (fixed windows and
    /// token buckets only; see the module docs).
    Leased,
}

impl LimitMode {
    fn is_exact(&self) -> bool {
        *self == LimitMode::Exact
    }
}

/// The longest a lease may be spent (revocations and plan changes apply within it).
pub const LEASE_MAX_TTL_MS: u64 = 500;
/// A lease shorter than this is not worth its units (they would mostly expire unspent).
pub const LEASE_MIN_TTL_MS: u64 = 50;
/// A lease never takes more than 1/this of what a limit has left after the request.
pub const LEASE_SHARE_DIVISOR: u64 = 2;
/// The most units one lease may hold.
pub const LEASE_MAX_UNITS: u64 = 10_000;

/// A limit as configured (TOML under `[[plans.<plan>.limits]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitConfig {
    pub name: String,
    pub algorithm: Algorithm,
    /// `key` | `tenant` | `tenant_product` | `client_ip` | `header:<name>`.
    #[serde(default = "default_subject")]
    pub subject: String,
    /// Max per window / bucket capacity / monthly tokens / max in flight.
    pub limit: u64,
    /// Window (default 60 s; concurrency: slot timeout, default 300 s). Not used by budgets.
    #[serde(default, with = "humantime_serde")]
    pub window: Option<Duration>,
    /// Units one request takes (not budgets: they take the estimate).
    #[serde(default = "one")]
    pub cost: u64,
    /// Budgets: tokens reserved when the request does not say (default 1000).
    #[serde(default)]
    pub estimate: Option<u64>,
    /// Count would-deny (metric + log) but never block.
    #[serde(default)]
    pub shadow: bool,
    #[serde(default = "default_failure_mode")]
    pub failure_mode: LimitFailureMode,
    /// Sliding log only: `auth` for the credential-route bucket (`rl:auth:`), default `api`.
    #[serde(default)]
    pub class: Option<String>,
    /// `exact` (default) or `leased` (fixed_window / token_bucket; see [`LimitMode`]).
    #[serde(default, skip_serializing_if = "LimitMode::is_exact")]
    pub mode: LimitMode,
}

fn default_subject() -> String {
    "key".into()
}
fn one() -> u64 {
    1
}
fn default_failure_mode() -> LimitFailureMode {
    LimitFailureMode::Open
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PlanConfig {
    #[serde(default)]
    pub limits: Vec<LimitConfig>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectKind {
    Key,
    Tenant,
    TenantProduct,
    ClientIp,
    Header(String),
}

/// A validated limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    pub name: Id,
    pub algorithm: Algorithm,
    pub subject: SubjectKind,
    pub limit: u64,
    pub window_ms: u64,
    pub cost: u64,
    pub estimate: u64,
    pub shadow: bool,
    pub failure_mode: LimitFailureMode,
    pub auth_class: bool,
    pub mode: LimitMode,
}

/// Plans by name, validated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plans(BTreeMap<String, Vec<Limit>>);

impl Plans {
    pub fn compile(raw: &BTreeMap<String, PlanConfig>) -> Result<Plans, String> {
        let mut out = BTreeMap::new();
        for (plan, cfg) in raw {
            if Id::parse(plan).is_none() {
                return Err(format!("plans.{plan}: not a valid plan id"));
            }
            let mut limits = Vec::new();
            for (i, l) in cfg.limits.iter().enumerate() {
                let at = format!("plans.{plan}.limits[{i}]");
                let name = Id::parse(&l.name).ok_or_else(|| format!("{at}.name: not a valid id"))?;
                if limits.iter().any(|x: &Limit| x.name == name) {
                    return Err(format!("{at}.name: '{name}' is used twice in this plan"));
                }
                let subject = match l.subject.as_str() {
                    "key" => SubjectKind::Key,
                    "tenant" => SubjectKind::Tenant,
                    "tenant_product" => SubjectKind::TenantProduct,
                    "client_ip" => SubjectKind::ClientIp,
                    s => match s.strip_prefix("header:") {
                        Some(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') => {
                            SubjectKind::Header(h.to_ascii_lowercase())
                        }
                        _ => return Err(format!("{at}.subject: '{s}' is not key, tenant, tenant_product, client_ip or header:<name>")),
                    },
                };
                if l.limit == 0 {
                    return Err(format!("{at}.limit: must be at least 1"));
                }
                if l.cost == 0 {
                    return Err(format!("{at}.cost: must be at least 1"));
                }
                let default_window = match l.algorithm {
                    Algorithm::Concurrency => Duration::from_secs(300),
                    _ => Duration::from_secs(60),
                };
                let window = l.window.unwrap_or(default_window);
                if window < Duration::from_millis(1) || window > Duration::from_secs(366 * 86400) {
                    return Err(format!("{at}.window: must be between 1ms and 366 days"));
                }
                let auth_class = match (l.algorithm, l.class.as_deref()) {
                    (_, None) | (Algorithm::SlidingLog, Some("api")) => false,
                    (Algorithm::SlidingLog, Some("auth")) => true,
                    (Algorithm::SlidingLog, Some(c)) => return Err(format!("{at}.class: '{c}' is not api or auth")),
                    (_, Some(_)) => return Err(format!("{at}.class: only sliding_log limits have a class")),
                };
                if l.mode == LimitMode::Leased {
                    // A lease is units taken ahead from a counter that only grows within its
                    // window (fixed) or a bucket that only refills: spending them later never
                    // admits more than the limit. Sliding windows and logs count each request
                    // at its own time, budgets and concurrency hold per-request state.
                    if !matches!(l.algorithm, Algorithm::FixedWindow | Algorithm::TokenBucket) {
                        return Err(format!("{at}.mode: leased applies to fixed_window and token_bucket only"));
                    }
                    if !matches!(subject, SubjectKind::Key | SubjectKind::Tenant | SubjectKind::TenantProduct) {
                        return Err(format!("{at}.mode: a leased limit counts per key, tenant or tenant_product (the filter keeps leases per key)"));
                    }
                    if l.shadow {
                        return Err(format!("{at}.mode: a shadow limit counts each request's would-deny; it cannot be leased"));
                    }
                }
                limits.push(Limit {
                    name,
                    algorithm: l.algorithm,
                    subject,
                    limit: l.limit,
                    window_ms: window.as_millis() as u64,
                    cost: l.cost,
                    estimate: l.estimate.unwrap_or(1000).max(1),
                    shadow: l.shadow,
                    failure_mode: l.failure_mode,
                    auth_class,
                    mode: l.mode,
                });
            }
            out.insert(plan.clone(), limits);
        }
        Ok(Plans(out))
    }

    /// The limits of `plan`; an unknown plan has none (see docs/decisions.md).
    pub fn limits(&self, plan: &str) -> &[Limit] {
        self.0.get(plan).map_or(&[], Vec::as_slice)
    }

    /// Header names some limit counts per: the filter must forward them.
    pub fn subject_headers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .0
            .values()
            .flatten()
            .filter_map(|l| match &l.subject {
                SubjectKind::Header(h) => Some(h.clone()),
                _ => None,
            })
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// Whether a plan's limits can be leased: all of them are `leased` (an exact limit needs a call
/// per request anyway, and then every limit is decided exactly in it).
pub fn leasable(limits: &[Limit]) -> bool {
    !limits.is_empty() && limits.iter().all(|l| l.mode == LimitMode::Leased)
}

/// How long a lease taken at `now_ms` may be spent: at most [`LEASE_MAX_TTL_MS`], never past the
/// end of a fixed window it was taken from, nor past `key_left_ms` (the key's expiry). Zero when
/// it would be shorter than [`LEASE_MIN_TTL_MS`] (then no lease is taken).
pub fn lease_ttl_ms(limits: &[Limit], now_ms: u64, key_left_ms: u64) -> u64 {
    let mut ttl = LEASE_MAX_TTL_MS.min(key_left_ms);
    for l in limits.iter().filter(|l| l.algorithm == Algorithm::FixedWindow) {
        ttl = ttl.min(l.window_ms - now_ms % l.window_ms);
    }
    if ttl < LEASE_MIN_TTL_MS {
        0
    } else {
        ttl
    }
}

/// Adds a lease to an invocation: ask for `want` units (capped at [`LEASE_MAX_UNITS`]); a
/// `renewal` admits no request itself (the limits are charged only for what is granted).
pub fn with_lease(mut inv: Invocation, want: u64, renewal: bool) -> Invocation {
    inv.args.extend([
        want.min(LEASE_MAX_UNITS).to_string(),
        if renewal { "1" } else { "0" }.to_string(),
        LEASE_SHARE_DIVISOR.to_string(),
    ]);
    inv
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
}

/// One `decide.lua` call, ready to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Invocation {
    pub keys: Vec<String>,
    pub args: Vec<String>,
    /// Per limit, what the reply is about.
    pub meta: Vec<Meta>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    pub name: String,
    pub algorithm: Algorithm,
    pub limit: u64,
    pub window_ms: u64,
    pub shadow: bool,
    pub failure_mode: LimitFailureMode,
    pub subject: String,
    /// Budgets: the period charged and the tokens reserved.
    pub budget: Option<(u32, u64)>,
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

/// Builds the single script call for all `limits` of a request.
pub fn invocation(limits: &[Limit], ctx: &RequestCtx<'_>) -> Invocation {
    let mut keys = Vec::new();
    let mut args = vec![ctx.now_ms.to_string(), ctx.request_id.to_string(), limits.len().to_string()];
    let mut meta = Vec::with_capacity(limits.len());
    for l in limits {
        let subject = subject_of(&l.subject, ctx);
        let w = l.window_ms;
        let bucket = ctx.now_ms / w;
        let (kind, cost, window, aux, budget) = match l.algorithm {
            Algorithm::FixedWindow => {
                keys.push(FixedWindowKey::new(ctx.tenant, &l.name, &subject, bucket).as_str().to_string());
                ("fixed", l.cost, w, String::new(), None)
            }
            Algorithm::SlidingWindow => {
                keys.push(SlidingWindowKey::new(ctx.tenant, &l.name, &subject, bucket).as_str().to_string());
                keys.push(SlidingWindowKey::new(ctx.tenant, &l.name, &subject, bucket.saturating_sub(1)).as_str().to_string());
                ("sliding", l.cost, w, String::new(), None)
            }
            Algorithm::TokenBucket => {
                keys.push(TokenBucketKey::new(ctx.tenant, &l.name, &subject).as_str().to_string());
                ("bucket", l.cost, w, String::new(), None)
            }
            Algorithm::SlidingLog => {
                keys.push(SlidingLogKey::new(l.auth_class, ctx.tenant, &l.name, &subject).as_str().to_string());
                ("log", l.cost, w, String::new(), None)
            }
            Algorithm::TokenBudget => {
                let (period, to_end) = month_of(ctx.now_ms);
                let estimate = ctx.token_estimate.unwrap_or(l.estimate).max(1);
                keys.push(TokenBudgetKey::new(ctx.tenant, &l.name, &subject, period).as_str().to_string());
                keys.push(ReservationKey::new(ctx.tenant, ctx.request_id).as_str().to_string());
                ("budget", estimate, RESERVATION_TTL_MS, format!("{TOKEN_BUDGET_TTL_MS}:{to_end}"), Some((period, estimate)))
            }
            Algorithm::Concurrency => {
                keys.push(ConcurrencyKey::new(ctx.tenant, &l.name, &subject).as_str().to_string());
                ("conc", 1, w, String::new(), None)
            }
        };
        args.extend([
            kind.to_string(),
            l.limit.to_string(),
            window.to_string(),
            cost.to_string(),
            if l.shadow { "1" } else { "0" }.to_string(),
            aux,
        ]);
        meta.push(Meta {
            name: l.name.to_string(),
            algorithm: l.algorithm,
            limit: l.limit,
            window_ms: w,
            shadow: l.shadow,
            failure_mode: l.failure_mode,
            subject: subject.as_str().to_string(),
            budget,
        });
    }
    Invocation { keys, args, meta }
}

/// One limit's state after the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    pub remaining: u64,
    pub reset_ms: u64,
    pub would_deny: bool,
}

/// The script's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Index (into the limits) of the limit that denied.
    pub denied: Option<usize>,
    pub states: Vec<LimitState>,
    /// Lease units taken (beyond the request's own cost) from every limit.
    pub granted: u64,
}

/// Reads `decide.lua`'s reply: `{allowed, denied_index, (remaining, reset_ms, would_deny) * n,
/// granted}`.
pub fn read_reply(reply: &[i64], n: usize) -> Result<Verdict, String> {
    if reply.len() != 3 + 3 * n {
        return Err(format!("decide.lua returned {} values for {n} limits", reply.len()));
    }
    let granted = reply[2 + 3 * n];
    if granted < 0 || (granted > 0 && reply[0] != 1) {
        return Err(format!("decide.lua granted {granted} with allowed={}", reply[0]));
    }
    let reply = &reply[..2 + 3 * n];
    let denied = match (reply[0], reply[1]) {
        (1, 0) => None,
        (0, i) if i >= 1 && (i as usize) <= n => Some(i as usize - 1),
        (a, d) => return Err(format!("decide.lua returned allowed={a} denied={d}")),
    };
    let states = reply[2..]
        .chunks(3)
        .map(|c| LimitState { remaining: c[0].max(0) as u64, reset_ms: c[1].max(0) as u64, would_deny: c[2] == 1 })
        .collect();
    Ok(Verdict { denied, states, granted: granted as u64 })
}

/// The deny code of an algorithm.
pub fn deny_code(a: Algorithm) -> &'static str {
    match a {
        Algorithm::TokenBudget => codes::QUOTA_EXCEEDED,
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
            m.budget.map(|(period, reserved)| BudgetHold { limit: m.name.clone(), subject: m.subject.clone(), period, reserved })
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
    Some(Ticket { tenant: tenant.to_string(), request_id: request_id.to_string(), budgets, slots })
}

/// `(yyyyMM, ms until the month ends)` of a unix-ms instant (UTC).
pub fn month_of(now_ms: u64) -> (u32, u64) {
    let days = (now_ms / 86_400_000) as i64;
    let (y, m, _) = civil_from_days(days);
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    let next = days_from_civil(ny, nm, 1) as u64 * 86_400_000;
    ((y as u32) * 100 + m, next.saturating_sub(now_ms))
}

// Howard Hinnant's civil-date algorithms (proleptic Gregorian, UTC).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans(toml_text: &str) -> Result<Plans, String> {
        #[derive(Deserialize)]
        struct W {
            plans: BTreeMap<String, PlanConfig>,
        }
        let w: W = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        Plans::compile(&w.plans)
    }

    #[test]
    fn plans_compile_with_defaults_and_refuse_bad_limits() {
        let p = plans(
            r#"
            [[plans.gold.limits]]
            name = "per-min"
            algorithm = "fixed_window"
            limit = 10
            [[plans.gold.limits]]
            name = "conc"
            algorithm = "concurrency"
            limit = 2
            subject = "tenant"
            [[plans.gold.limits]]
            name = "by-user"
            algorithm = "sliding_log"
            limit = 5
            subject = "header:X-User"
            class = "auth"
            "#,
        )
        .unwrap();
        let l = p.limits("gold");
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].window_ms, 60_000);
        assert_eq!(l[1].window_ms, 300_000);
        assert_eq!(l[0].failure_mode, LimitFailureMode::Open);
        assert!(l[2].auth_class);
        assert_eq!(p.subject_headers(), vec!["x-user"]);
        assert!(p.limits("unknown").is_empty());

        for (bad, needle) in [
            ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 0", "limit"),
            ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 1\nsubject = \"nobody\"", "subject"),
            ("name = \"a b\"\nalgorithm = \"fixed_window\"\nlimit = 1", "name"),
            ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 1\nclass = \"auth\"", "class"),
            ("name = \"a\"\nalgorithm = \"leaky\"\nlimit = 1", "unknown variant"),
            ("name = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 1\nlimt = 2", "unknown field"),
        ] {
            let err = plans(&format!("[[plans.p.limits]]\n{bad}")).unwrap_err();
            assert!(err.contains(needle), "{err} should mention {needle}");
        }
        let err = plans("[[plans.p.limits]]\nname=\"a\"\nalgorithm=\"fixed_window\"\nlimit=1\n[[plans.p.limits]]\nname=\"a\"\nalgorithm=\"token_bucket\"\nlimit=1").unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }

    fn limit(algorithm: Algorithm, subject: SubjectKind) -> Limit {
        Limit {
            name: Id::parse("l").unwrap(),
            algorithm,
            subject,
            limit: 10,
            window_ms: 60_000,
            cost: 1,
            estimate: 1000,
            shadow: false,
            failure_mode: LimitFailureMode::Open,
            auth_class: false,
            mode: LimitMode::Exact,
        }
    }

    #[test]
    fn leased_mode_is_for_fixed_windows_and_buckets_per_key_tenant_or_product() {
        let p = plans(
            "[[plans.p.limits]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 9\nmode = \"leased\"\n\
             [[plans.p.limits]]\nname = \"b\"\nalgorithm = \"token_bucket\"\nlimit = 9\nmode = \"leased\"\nsubject = \"tenant\"\n\
             [[plans.q.limits]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 9\nmode = \"leased\"\n\
             [[plans.q.limits]]\nname = \"b\"\nalgorithm = \"fixed_window\"\nlimit = 9\n",
        )
        .unwrap();
        assert!(leasable(p.limits("p")));
        assert!(!leasable(p.limits("q")), "one exact limit makes every request exact");
        assert!(!leasable(&[]));
        assert_eq!(p.limits("q")[1].mode, LimitMode::Exact);
        for (bad, needle) in [
            ("algorithm = \"sliding_window\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
            ("algorithm = \"sliding_log\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
            ("algorithm = \"concurrency\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
            ("algorithm = \"token_budget\"\nlimit = 1\nmode = \"leased\"", "fixed_window and token_bucket"),
            ("algorithm = \"fixed_window\"\nlimit = 1\nmode = \"leased\"\nsubject = \"client_ip\"", "per key"),
            ("algorithm = \"fixed_window\"\nlimit = 1\nmode = \"leased\"\nshadow = true", "shadow"),
            ("algorithm = \"fixed_window\"\nlimit = 1\nmode = \"sometimes\"", "unknown variant"),
        ] {
            let err = plans(&format!("[[plans.p.limits]]\nname = \"a\"\n{bad}")).unwrap_err();
            assert!(err.contains(needle), "{err} should mention {needle}");
        }
        // exact is the default and is not written back (admin JSON stays as it was)
        let cfg = LimitConfig {
            name: "a".into(),
            algorithm: Algorithm::FixedWindow,
            subject: "key".into(),
            limit: 1,
            window: None,
            cost: 1,
            estimate: None,
            shadow: false,
            failure_mode: LimitFailureMode::Open,
            class: None,
            mode: LimitMode::Exact,
        };
        assert!(!serde_json::to_string(&cfg).unwrap().contains(r#""mode""#));
        let leased = LimitConfig { mode: LimitMode::Leased, ..cfg };
        assert!(serde_json::to_string(&leased).unwrap().contains(r#""mode":"leased""#));
    }

    #[test]
    fn lease_lifetime_is_bounded_by_the_window_the_key_and_the_maximum() {
        let mut fixed = limit(Algorithm::FixedWindow, SubjectKind::Key);
        fixed.window_ms = 1_000;
        let bucket = limit(Algorithm::TokenBucket, SubjectKind::Key);
        let t = 1_000_000u64;
        assert_eq!(lease_ttl_ms(std::slice::from_ref(&bucket), t, u64::MAX), LEASE_MAX_TTL_MS);
        assert_eq!(lease_ttl_ms(std::slice::from_ref(&bucket), t, 200), 200, "the key expires first");
        assert_eq!(lease_ttl_ms(&[bucket.clone(), fixed.clone()], t + 700, u64::MAX), 300, "the window ends first");
        assert_eq!(lease_ttl_ms(&[fixed.clone()], t + 960, u64::MAX), 0, "too short to be worth units");
        assert_eq!(lease_ttl_ms(&[fixed], t + 999, u64::MAX), 0);
        let inv = with_lease(Invocation { keys: vec![], args: vec!["x".into()], meta: vec![] }, 1 << 40, true);
        assert_eq!(inv.args, ["x", &LEASE_MAX_UNITS.to_string(), "1", &LEASE_SHARE_DIVISOR.to_string()]);
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
            token_estimate: Some(50),
        };
        let limits = [
            limit(Algorithm::FixedWindow, SubjectKind::Key),
            limit(Algorithm::SlidingWindow, SubjectKind::Tenant),
            limit(Algorithm::TokenBucket, SubjectKind::ClientIp),
            limit(Algorithm::SlidingLog, SubjectKind::Header("x-user".into())),
            limit(Algorithm::TokenBudget, SubjectKind::Key),
            limit(Algorithm::Concurrency, SubjectKind::Key),
        ];
        let inv = invocation(&limits, &ctx);
        let bucket = 1_764_374_400_000u64 / 60_000;
        assert_eq!(
            inv.keys,
            vec![
                format!("rl:{{acme}}:l:k.key_1:{bucket}"),
                format!("rate:{{acme}}:l:t:{bucket}"),
                format!("rate:{{acme}}:l:t:{}", bucket - 1),
                "q:rps:{acme}:l:ip.10.0.0.9".to_string(),
                "rl:api:{acme}:l:h.x-user.bob".to_string(),
                "q:tokens:{acme}:l:k.key_1:202511".to_string(),
                "q:reserved:{acme}:req-1".to_string(),
                "q:conc:{acme}:l:k.key_1".to_string(),
            ]
        );
        assert!(inv.keys.iter().all(|k| k.contains("{acme}")));
        assert_eq!(&inv.args[..3], &["1764374400000", "req-1", "6"]);
        assert_eq!(inv.args.len(), 3 + 6 * 6);
        // the budget takes the request's estimate and reserves for 5 minutes
        assert_eq!(&inv.args[3 + 4 * 6..3 + 5 * 6], &["budget", "10", "300000", "50", "0", &format!("{TOKEN_BUDGET_TTL_MS}:{}", 2 * 86_400_000)]);
        let t = ticket(&inv.meta, &t, &r).unwrap();
        assert_eq!(t.budgets, vec![BudgetHold { limit: "l".into(), subject: "k.key_1".into(), period: 202511, reserved: 50 }]);
        assert_eq!(t.slots.len(), 1);
    }

    #[test]
    fn replies_and_headers() {
        let v = read_reply(&[0, 2, 5, 1000, 0, 0, 30_500, 1, 0], 2).unwrap();
        assert_eq!(v.denied, Some(1));
        assert_eq!(v.states[1], LimitState { remaining: 0, reset_ms: 30_500, would_deny: true });
        assert!(read_reply(&[1, 0, 1], 1).is_err());
        assert!(read_reply(&[0, 3, 0, 0, 0, 0], 1).is_err());
        assert_eq!(read_reply(&[1, 0, 4, 100, 0, 7], 1).unwrap().granted, 7);
        assert!(read_reply(&[0, 1, 0, 100, 1, 7], 1).is_err(), "a denial grants nothing");
        assert!(read_reply(&[1, 0, 4, 100, 0, -1], 1).is_err());
        let m = Meta {
            name: "per-min".into(),
            algorithm: Algorithm::FixedWindow,
            limit: 10,
            window_ms: 60_000,
            shadow: false,
            failure_mode: LimitFailureMode::Open,
            subject: "k.x".into(),
            budget: None,
        };
        let [p, r] = ratelimit_headers(&m, &v.states[1]);
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
