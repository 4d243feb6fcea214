//! Plans and their limits as configured (TOML under `[[plans.<plan>.limits]]`, or the admin
//! API), validated into [`Plans`]; and the lease policy (which plans may be leased, for how long).
//! How a request's limits are checked is [`super::checks`]'s.
//!
//! Leased limits (`mode = "leased"`, fixed windows and token buckets): a decision may also take
//! a *lease* — `granted` more requests' worth of units from every limit of the plan, which the
//! filter then admits locally without a call. The grant is taken in the same atomic script as
//! the request's own check (still one round trip), is never more than `1 / LEASE_SHARE_DIVISOR`
//! of what is left after the request (so replicas share and the tail of a window is exact), and
//! lives at most `LEASE_MAX_TTL_MS`, never past the end of the window it was taken from. The
//! limit is therefore never over-admitted; leased units left unspent at expiry are under-use.

use super::spend::{parse_offset, Period, SpendSpec, Unpriced};
use crate::invalid::{invalid, Invalid};
use crate::keys::Id;
use crate::models::ModelPattern;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

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
    /// Issue 42: money (micro-units of `[usage.pricing] currency`) per calendar month or day,
    /// reserved at the request's most it can cost and reconciled to its real cost
    /// (super::spend).
    SpendBudget,
    /// Seed 000: requests in flight; `window` = how long a slot lives without a completion.
    Concurrency,
    /// A plan's per-model tokens per minute (`model_limits`, issue 42 item 4): a calendar
    /// minute's counter of tokens, reserved at the decision (the request's input estimate plus
    /// its output bound) and reconciled to the tokens it used at completion, as a token budget's
    /// month is. Made by [`Plans::compile`] from `tokens_per_minute`, never written as a limit.
    #[serde(skip)]
    TokensPerMinute,
}

/// What to do with a limit when Redis cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitFailureMode {
    /// Let the request through (seed 002's default for rate limiters).
    Open,
    /// Refuse it with 503 `limits_unavailable`.
    Closed,
    /// Enforce this sidecar's share of the limit in memory (super::local): fixed and sliding
    /// windows, sliding logs and token buckets only.
    Local,
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

/// The largest limit, cost or estimate a plan may set: Redis's Lua numbers are doubles, exact
/// up to 2^53.
pub const MAX_COUNT: u64 = 1 << 53;
/// A sliding log's largest limit and cost (one sorted-set member per unit, held for the window).
pub const MAX_SLIDING_LOG_LIMIT: u64 = 100_000;
pub const MAX_SLIDING_LOG_COST: u64 = 1_000;

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
    /// Money budgets: `month` (default) or `day`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<Period>,
    /// Money budgets: the output reserved for a request that does not say (default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// Money budgets: a model without a price of its own is priced by the `default` rates
    /// (default) or refused (`refuse`: 403 `model_not_priced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpriced: Option<Unpriced>,
    /// Money budgets: the periods' time zone, a fixed offset from UTC (default `+00:00`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utc_offset: Option<String>,
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
    /// The models the plan allows on LLM routes (names, or `prefix*`); empty: every model
    /// (issue 42 item 4).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// Names a client may ask for → the model the upstream is asked for.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_aliases: BTreeMap<String, String>,
    /// Requests and tokens per minute per model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_limits: Vec<ModelLimitConfig>,
}

impl PlanConfig {
    /// Only limits, as most plans are.
    pub fn of_limits(limits: Vec<LimitConfig>) -> PlanConfig {
        PlanConfig { limits, ..PlanConfig::default() }
    }
}

/// A plan's rate limits for the models one pattern matches (TOML `[[plans.<plan>.model_limits]]`):
/// requests and tokens per minute, as providers state them. The entry whose pattern matches the
/// request's (resolved) model most specifically applies ([`crate::models::best`]), and counts the
/// requests of every model it matches together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimitConfig {
    /// A model name or `prefix*`.
    pub model: String,
    /// The limits' names are `<name>.rpm` and `<name>.tpm` (RateLimit headers, Redis keys);
    /// default: the model with every character outside `[A-Za-z0-9_.-]` as `_` (`*` alone: `all`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// What the counts are per, as for limits (default `key`).
    #[serde(default = "default_subject")]
    pub subject: String,
    #[serde(default = "default_failure_mode")]
    pub failure_mode: LimitFailureMode,
    /// Tokens per minute: the output reserved for a request that does not say (default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
}

/// The most `model_limits` entries of one plan.
pub const MAX_MODEL_LIMITS: usize = 256;

/// A plan's model policy, validated (issue 42 item 4; `crate::models`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelPolicy {
    pub allow: Vec<ModelPattern>,
    pub aliases: BTreeMap<String, String>,
    /// Per pattern, its limits (`<name>.rpm`: a sliding window of requests; `<name>.tpm`: tokens
    /// per minute).
    pub limits: Vec<(ModelPattern, Vec<Limit>)>,
}

impl ModelPolicy {
    /// The limits of the entry that applies to `model` (none: no entry matches).
    pub fn limits_for(&self, model: &str) -> &[Limit] {
        crate::models::best(&self.limits, |x| &x.0, model).map_or(&[], |x| x.1.as_slice())
    }

    fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.aliases.is_empty() && self.limits.is_empty()
    }
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
    /// A money budget's own settings (only for [`Algorithm::SpendBudget`]).
    pub spend: Option<SpendSpec>,
}

#[cfg(test)]
impl Limit {
    /// A limit of 10 per minute, as tests need one.
    pub fn example(algorithm: Algorithm, subject: SubjectKind) -> Limit {
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
            spend: (algorithm == Algorithm::SpendBudget).then(SpendSpec::default),
        }
    }
}

/// Plans by name, validated: their limits, and the model policies of those that have one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plans {
    limits: BTreeMap<String, Vec<Limit>>,
    models: BTreeMap<String, ModelPolicy>,
}

impl Plans {
    pub fn compile(raw: &BTreeMap<String, PlanConfig>) -> Result<Plans, Invalid> {
        let mut out = BTreeMap::new();
        let mut models = BTreeMap::new();
        for (plan, cfg) in raw {
            if Id::parse(plan).is_none() {
                return Err(invalid(format!("plans.{plan}"), "not a valid plan id"));
            }
            let mut limits = Vec::new();
            for (i, l) in cfg.limits.iter().enumerate() {
                let at = format!("plans.{plan}.limits[{i}]");
                let name = Id::parse(&l.name).ok_or_else(|| invalid(format!("{at}.name"), "not a valid id"))?;
                if limits.iter().any(|x: &Limit| x.name == name) {
                    return Err(invalid(format!("{at}.name"), format!("'{name}' is used twice in this plan")));
                }
                limits.push(compile_limit(l, name, &at)?);
            }
            let policy = model_policy(plan, cfg, &limits)?;
            if !policy.is_empty() {
                models.insert(plan.clone(), policy);
            }
            out.insert(plan.clone(), limits);
        }
        Ok(Plans { limits: out, models })
    }

    /// The limits of `plan`; an unknown plan has none (see docs/decisions.md).
    pub fn limits(&self, plan: &str) -> &[Limit] {
        self.limits.get(plan).map_or(&[], Vec::as_slice)
    }

    /// The model policy of `plan` (none: it allows every model, aliases none, limits none per model).
    pub fn models(&self, plan: &str) -> Option<&ModelPolicy> {
        self.models.get(plan)
    }

    /// Every limit of every plan, per-model ones included.
    fn all(&self) -> impl Iterator<Item = &Limit> {
        self.limits.values().flatten().chain(self.models.values().flat_map(|m| m.limits.iter().flat_map(|(_, l)| l)))
    }

    /// Whether some limit fails `local` (then the sidecars count each other, super::replicas).
    pub fn any_local(&self) -> bool {
        self.all().any(|l| l.failure_mode == LimitFailureMode::Local)
    }

    /// Header names some limit counts per: the filter must forward them.
    pub fn subject_headers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .all()
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

/// One limit as configured, checked (`at`: its path, for errors); `name` is its validated name.
fn compile_limit(l: &LimitConfig, name: Id, at: &str) -> Result<Limit, Invalid> {
    let subject = match l.subject.as_str() {
        "key" => SubjectKind::Key,
        "tenant" => SubjectKind::Tenant,
        "tenant_product" => SubjectKind::TenantProduct,
        "client_ip" => SubjectKind::ClientIp,
        s => match s.strip_prefix("header:") {
            Some(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') => {
                SubjectKind::Header(h.to_ascii_lowercase())
            }
            _ => return Err(invalid(format!("{at}.subject"), format!("'{s}' is not key, tenant, tenant_product, client_ip or header:<name>"))),
        },
    };
    if l.limit == 0 {
        return Err(invalid(format!("{at}.limit"), "must be at least 1"));
    }
    if l.cost == 0 {
        return Err(invalid(format!("{at}.cost"), "must be at least 1"));
    }
    // a request holds one slot; a cost that meant "holds N" would admit N times the
    // intended load (decision 178)
    if l.algorithm == Algorithm::Concurrency && l.cost != 1 {
        return Err(invalid(format!("{at}.cost"), "a concurrency limit counts requests in flight, one slot each: cost must be 1"));
    }
    // Redis's Lua numbers are doubles: above 2^53 they are no longer exact.
    // (a token budget's month counter adds with saturation and is tested past 2^53:
    // its limit may be any u64, e.g. one no month reaches)
    if l.limit > MAX_COUNT && l.algorithm != Algorithm::TokenBudget {
        return Err(invalid(format!("{at}.limit"), format!("must be at most {MAX_COUNT} (2^53)")));
    }
    if l.estimate.is_some_and(|e| e > MAX_COUNT) {
        return Err(invalid(format!("{at}.estimate"), format!("must be at most {MAX_COUNT} (2^53)")));
    }
    if l.cost > l.limit && l.algorithm != Algorithm::TokenBudget {
        return Err(invalid(format!("{at}.cost"), format!("must be at most the limit ({}): a request costing more is never admitted", l.limit)));
    }
    // A sliding log keeps one sorted-set member per unit for the whole window: its
    // memory, and each request's work in Redis (one ZADD per unit), grow with them.
    if l.algorithm == Algorithm::SlidingLog && (l.limit > MAX_SLIDING_LOG_LIMIT || l.cost > MAX_SLIDING_LOG_COST) {
        return Err(invalid(
            format!("{at}.limit"),
            format!("a sliding_log holds at most {MAX_SLIDING_LOG_LIMIT} units with a cost of at most {MAX_SLIDING_LOG_COST} (one Redis set member each): use sliding_window for larger limits"),
        ));
    }
    let default_window = match l.algorithm {
        Algorithm::Concurrency => Duration::from_secs(300),
        _ => Duration::from_secs(60),
    };
    let window = l.window.unwrap_or(default_window);
    if window < Duration::from_millis(1) || window > Duration::from_secs(366 * 86400) {
        return Err(invalid(format!("{at}.window"), "must be between 1ms and 366 days"));
    }
    let auth_class = match (l.algorithm, l.class.as_deref()) {
        (_, None) | (Algorithm::SlidingLog, Some("api")) => false,
        (Algorithm::SlidingLog, Some("auth")) => true,
        (Algorithm::SlidingLog, Some(c)) => return Err(invalid(format!("{at}.class"), format!("'{c}' is not api or auth"))),
        (_, Some(_)) => return Err(invalid(format!("{at}.class"), "only sliding_log limits have a class")),
    };
    let spend = spend_spec(l, at)?;
    if l.failure_mode == LimitFailureMode::Local && matches!(l.algorithm, Algorithm::TokenBudget | Algorithm::SpendBudget | Algorithm::Concurrency | Algorithm::TokensPerMinute) {
        // A budget's reservation and a concurrency slot are settled by the completion
        // path in Redis: a local share of them would never be given back.
        return Err(invalid(
            format!("{at}.failure_mode"),
            format!("limit '{name}': local applies to fixed_window, sliding_window, sliding_log and token_bucket only (use open or closed)"),
        ));
    }
    if l.mode == LimitMode::Leased {
        // A lease is units taken ahead from a counter that only grows within its
        // window (fixed) or a bucket that only refills: spending them later never
        // admits more than the limit. Sliding windows and logs count each request
        // at its own time, budgets and concurrency hold per-request state.
        if !matches!(l.algorithm, Algorithm::FixedWindow | Algorithm::TokenBucket) {
            return Err(invalid(format!("{at}.mode"), "leased applies to fixed_window and token_bucket only"));
        }
        if !matches!(subject, SubjectKind::Key | SubjectKind::Tenant | SubjectKind::TenantProduct) {
            return Err(invalid(format!("{at}.mode"), "a leased limit counts per key, tenant or tenant_product (the filter keeps leases per key)"));
        }
        if l.shadow {
            return Err(invalid(format!("{at}.mode"), "a shadow limit counts each request's would-deny; it cannot be leased"));
        }
    }
    Ok(Limit {
        name,
        algorithm: l.algorithm,
        subject,
        limit: l.limit,
        // a money budget's window is its period's (what RateLimit-Policy says)
        window_ms: match spend.map(|s| s.period) {
            Some(Period::Day) => 86_400_000,
            Some(Period::Month) => 30 * 86_400_000,
            None => window.as_millis() as u64,
        },
        cost: l.cost,
        estimate: l.estimate.unwrap_or(1000).max(1),
        shadow: l.shadow,
        failure_mode: l.failure_mode,
        auth_class,
        mode: l.mode,
        spend,
    })
}

/// A plan's model policy (`models`, `model_aliases`, `model_limits`), checked; its per-model
/// limits' names are unique in the plan (`limits`: the plan's own, checked before).
fn model_policy(plan: &str, cfg: &PlanConfig, limits: &[Limit]) -> Result<ModelPolicy, Invalid> {
    let from = |e: crate::models::BadModels| invalid(e.field, e.message);
    let allow = crate::models::parse_list(&cfg.models, &format!("plans.{plan}.models")).map_err(from)?;
    let aliases = crate::models::parse_aliases(&cfg.model_aliases, &format!("plans.{plan}.model_aliases")).map_err(from)?;
    if cfg.model_limits.len() > MAX_MODEL_LIMITS {
        return Err(invalid(format!("plans.{plan}.model_limits"), format!("at most {MAX_MODEL_LIMITS} entries")));
    }
    let mut names: Vec<Id> = limits.iter().map(|l| l.name.clone()).collect();
    let mut out: Vec<(ModelPattern, Vec<Limit>)> = Vec::new();
    for (i, m) in cfg.model_limits.iter().enumerate() {
        let at = format!("plans.{plan}.model_limits[{i}]");
        let pattern = ModelPattern::parse(&m.model)
            .ok_or_else(|| invalid(format!("{at}.model"), "a model name or prefix: 1-128 of [A-Za-z0-9._:/@+-], with an optional trailing '*'"))?;
        if out.iter().any(|(p, _)| *p == pattern) {
            return Err(invalid(format!("{at}.model"), format!("'{}' has two entries in this plan", pattern.as_str())));
        }
        let base = match &m.name {
            Some(n) => n.clone(),
            None if pattern.as_str() == "*" => "all".into(),
            None => pattern.as_str().chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') { c } else { '_' }).collect(),
        };
        let named = |suffix: &str| Id::parse(&format!("{base}.{suffix}")).filter(|_| base.len() <= 60);
        if named("rpm").is_none() {
            let why = match &m.name {
                Some(_) => "1-60 of letters, digits, '_', '-', '.'",
                None => "the model is longer than 60 characters: give the entry a name (1-60 of letters, digits, '_', '-', '.')",
            };
            return Err(invalid(format!("{at}.name"), why));
        }
        let count = |n: Option<u64>, field: &str| -> Result<Option<u64>, Invalid> {
            match n {
                Some(v) if v == 0 || v > MAX_COUNT => Err(invalid(format!("{at}.{field}"), format!("must be between 1 and {MAX_COUNT} (2^53)"))),
                v => Ok(v),
            }
        };
        let (rpm, tpm) = (count(m.requests_per_minute, "requests_per_minute")?, count(m.tokens_per_minute, "tokens_per_minute")?);
        if rpm.is_none() && tpm.is_none() {
            return Err(invalid(&at, "give requests_per_minute, tokens_per_minute or both"));
        }
        if tpm.is_none() && m.max_output_tokens.is_some() {
            return Err(invalid(format!("{at}.max_output_tokens"), "only with tokens_per_minute (what a request reserves of it)"));
        }
        let output = count(Some(m.max_output_tokens.unwrap_or(super::spend::DEFAULT_MAX_OUTPUT_TOKENS)), "max_output_tokens")?;
        let mut entry = Vec::new();
        for (suffix, algorithm, limit) in [("rpm", Algorithm::SlidingWindow, rpm), ("tpm", Algorithm::TokensPerMinute, tpm)] {
            let Some(limit) = limit else { continue };
            let name = named(suffix).expect("checked above");
            if names.contains(&name) {
                return Err(invalid(format!("{at}.name"), format!("'{name}' is used twice in this plan: give the entry another name")));
            }
            names.push(name.clone());
            let config = LimitConfig {
                name: name.to_string(),
                algorithm,
                subject: m.subject.clone(),
                limit,
                window: Some(Duration::from_secs(60)),
                cost: 1,
                // tokens per minute: the output bound of a request that names none
                estimate: (algorithm == Algorithm::TokensPerMinute).then_some(output.unwrap_or(1)),
                shadow: false,
                failure_mode: m.failure_mode,
                class: None,
                mode: LimitMode::Exact,
                period: None,
                max_output_tokens: None,
                unpriced: None,
                utc_offset: None,
            };
            entry.push(compile_limit(&config, name, &at)?);
        }
        out.push((pattern, entry));
    }
    Ok(ModelPolicy { allow, aliases, limits: out })
}

/// A money budget's settings, checked; `None` for other limits (which must not set them).
fn spend_spec(l: &LimitConfig, at: &str) -> Result<Option<SpendSpec>, Invalid> {
    if l.algorithm != Algorithm::SpendBudget {
        let set = l.period.is_some() || l.max_output_tokens.is_some() || l.unpriced.is_some() || l.utc_offset.is_some();
        return match set {
            true => Err(invalid(at, "period, max_output_tokens, unpriced and utc_offset are for spend_budget limits only")),
            false => Ok(None),
        };
    }
    if l.estimate.is_some() {
        return Err(invalid(format!("{at}.estimate"), "a spend_budget reserves the most a request can cost: set max_output_tokens"));
    }
    let max_output_tokens = l.max_output_tokens.unwrap_or(super::spend::DEFAULT_MAX_OUTPUT_TOKENS);
    if max_output_tokens == 0 || max_output_tokens > MAX_COUNT {
        return Err(invalid(format!("{at}.max_output_tokens"), format!("must be between 1 and {MAX_COUNT} (2^53)")));
    }
    let offset_min = match &l.utc_offset {
        Some(o) => parse_offset(o, &format!("{at}.utc_offset"))?,
        None => 0,
    };
    Ok(Some(SpendSpec { period: l.period.unwrap_or_default(), max_output_tokens, unpriced: l.unpriced.unwrap_or_default(), offset_min }))
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

#[cfg(test)]
mod tests;
