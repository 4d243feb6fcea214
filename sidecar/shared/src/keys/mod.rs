//! Every Redis key the sidecar reads or writes, built here and nowhere else.
//!
//! Keys are newtypes with a private field; constructors take typed ids, so a raw API key can
//! never become part of a key name (only [`KeyHash`], its sha256, can). docs/redis-keys.md lists
//! each family with its type, TTL and writer; the golden tests below pin every format.
//!
//! Families (all TTL-less store-of-record keys are marked so):
//! - `apikey:{sha256}` — hash, the API-key record (store of record, no TTL; seed 003/004).
//! - `apikey-id:{keyId}` — string, the record's key hash, to find it by id (store of record).
//! - `apikey-index:{tenant}` — set of key ids of one tenant (store of record; seed 004).
//! - `apikey:authfail:{keyId}` — string `1`, audit throttle, `SET … EX 3600 NX` (seed 002).
//!
//! Limit families (sidecar/lua/decide.lua, complete.lua). Every key of one decision carries the
//! same hash tag, the tenant (`{acme}`), so one script touches one Cluster slot: the seeds'
//! `{keyId}`-style placeholders become `{tenant}:…` here (docs/redis-keys.md says so per row).
//! - `rl:{tenant}:{limit}:{subject}:{bucket}` — fixed window counter, TTL 2 × window (seed 004).
//! - `rate:{tenant}:{limit}:{subject}:{bucket}` — sliding-window counter, TTL 2 × window (seed 003).
//! - `q:rps:{tenant}:{limit}:{subject}:{capacity}/{refill_ms}` — token bucket hash (tokens, ts), TTL
//!   2 × refill time (seed 000, with the bucket's definition after it: decision 180).
//! - `rl:api|auth:{tenant}:{limit}:{subject}:{window_ms}` — sliding log zset, PEXPIRE window (seed
//!   002, with the window after it: decision 180).
//! - `q:tokens:{tenant}:{limit}:{subject}:{yyyyMM}` — monthly token counter, 40 days (seed 000).
//! - `q:spend:{tenant}:{limit}:{subject}:{yyyyMM|yyyyMMdd}` — a money budget's counter of
//!   micro-units per calendar month or day (issue 42), 40 days (month) or 3 days (day).
//! - `q:reserved:{tenant}:{limit}:{subject}:{decisionId}` — one budget's reservation (tokens, or
//!   micro-units) by one decision, 5 minutes (seed 000). Per budget: each settles on its own.
//! - `q:conc:{tenant}:{limit}:{subject}` — in-flight zset scored by the ms each slot frees itself
//!   (start + its slot timeout; decision 180), PEXPIRE the longest slot timeout (seed 000 has a
//!   Set; a scored zset lets the script prune slots whose completion never came).
//! - `dec:{tenant}:{decisionId}` — string, what one allowed decision took (decide.lua writes it in
//!   the same call), so a decision the filter abandoned can be refunded (refund.lua); 60 s.
//!
//! The console's keys (`console:user:`, `console:users:`, `console:session:`, `console:invite:`,
//! `console:failures:`) are in [`console`]'s module.

use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};
use std::fmt;

/// A validated lowercase-hex sha256 of an API key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyHash(String);

impl KeyHash {
    /// Accepts exactly 64 lowercase hex characters.
    pub fn parse(s: &str) -> Option<KeyHash> {
        (s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then(|| KeyHash(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An identifier of ours (tenant, plan, key id): 1–64 of `[A-Za-z0-9_.-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(String);

impl Id {
    pub fn parse(s: &str) -> Option<Id> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        ok.then(|| Id(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! redis_key {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl ToRedisArgs for $name {
            fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
                out.write_arg(self.0.as_bytes())
            }
        }

        impl ToSingleRedisArg for $name {}
    };
}

redis_key!(
    /// `apikey:{sha256}` — hash: the API-key record. Store of record: no TTL.
    ApiKeyRecordKey
);
redis_key!(
    /// `apikey-id:{keyId}` — string: the key hash of a key id. Store of record: no TTL.
    ApiKeyIdKey
);
redis_key!(
    /// `apikey-index:{tenant}` — set: the key ids of a tenant. Store of record: no TTL.
    ApiKeyIndexKey
);
redis_key!(
    /// `apikey:authfail:{keyId}` — string `1`, TTL [`AUTH_FAIL_TTL_SECS`]: audit throttle.
    AuthFailKey
);

redis_key!(
    /// `rl:{tenant}:{limit}:{subject}:{bucket}` — fixed-window counter.
    FixedWindowKey
);
redis_key!(
    /// `rate:{tenant}:{limit}:{subject}:{bucket}` — sliding-window counter bucket.
    SlidingWindowKey
);
redis_key!(
    /// `q:rps:{tenant}:{limit}:{subject}:{capacity}/{refill_ms}` — token bucket hash, one per
    /// definition: two plans' buckets of one name never share their tokens (decision 180).
    TokenBucketKey
);
redis_key!(
    /// `rl:api:{tenant}:{limit}:{subject}:{window_ms}` or `rl:auth:…` — sliding log zset, one per
    /// window: a shorter window never prunes a longer one's entries (decision 180).
    SlidingLogKey
);
redis_key!(
    /// `q:tokens:{tenant}:{limit}:{subject}:{yyyyMM}` — monthly token counter.
    TokenBudgetKey
);
redis_key!(
    /// `q:spend:{tenant}:{limit}:{subject}:{yyyyMM|yyyyMMdd}` — a money budget's counter of
    /// micro-units for one calendar month or day (issue 42 item 3).
    SpendBudgetKey
);
redis_key!(
    /// `q:tpm:{tenant}:{limit}:{subject}:{minute}` — a plan's per-model tokens per minute
    /// (issue 42 item 4): the tokens reserved and then used by the calls of one calendar minute
    /// (`minute`: ms since the epoch / 60 000). TTL [`TOKENS_PER_MINUTE_TTL_MS`].
    TokensPerMinuteKey
);
redis_key!(
    /// `q:reserved:{tenant}:{limit}:{subject}:{decisionId}` — what one decision reserved from one
    /// budget (the budget's counter is `q:tokens:{tenant}:{limit}:{subject}:…`).
    ReservationKey
);
redis_key!(
    /// `q:conc:{tenant}:{limit}:{subject}` — in-flight request ids scored by when each frees itself
    /// (its start + its limit's window): limits of one name with two windows share the set and
    /// neither frees the other's slots (decision 180).
    ConcurrencyKey
);

redis_key!(
    /// `dec:{tenant}:{decisionId}` — what one allowed decision took, for its refund if the filter
    /// abandons it (issue 15.2). TTL [`DECISION_RECORD_TTL_MS`].
    DecisionRecordKey
);

/// What a limit counts per: a key, the tenant, a product, a client IP, a header value.
/// Always a safe key segment (no spaces, braces or colons-free guarantees are not needed after
/// the hash tag, but length and charset are bounded).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subject(String);

impl Subject {
    pub fn key(key_id: &Id) -> Subject {
        Subject(format!("k.{key_id}"))
    }
    pub fn tenant() -> Subject {
        Subject("t".into())
    }
    pub fn product(product: &Id) -> Subject {
        Subject(format!("p.{product}"))
    }
    pub fn ip(ip: std::net::IpAddr) -> Subject {
        Subject(format!("ip.{ip}"))
    }
    /// A header's value; long or unusual values are replaced by their sha256 prefix.
    pub fn header(name: &str, value: Option<&str>) -> Subject {
        let v = match value {
            None => "-".to_string(),
            Some(v) if v.len() <= 64 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b)) => v.to_string(),
            Some(v) => {
                use sha2::{Digest, Sha256};
                let d = Sha256::digest(v.as_bytes());
                format!("x{}", d.iter().take(12).map(|b| format!("{b:02x}")).collect::<String>())
            }
        };
        Subject(format!("h.{}.{v}", name.to_ascii_lowercase()))
    }
    /// A subject echoed back by the filter in a completion ticket (validated, not trusted).
    pub fn parse(s: &str) -> Option<Subject> {
        let ok = !s.is_empty()
            && s.len() <= 160
            && s.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b'{' | b'}'));
        ok.then(|| Subject(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The tenant's hash tag: every limit key of one decision shares it (one Cluster slot).
fn tag(tenant: &Id) -> String {
    format!("{{{tenant}}}")
}

impl FixedWindowKey {
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, bucket: u64) -> Self {
        Self(format!("rl:{}:{limit}:{}:{bucket}", tag(tenant), subject.as_str()))
    }
}

impl SlidingWindowKey {
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, bucket: u64) -> Self {
        Self(format!("rate:{}:{limit}:{}:{bucket}", tag(tenant), subject.as_str()))
    }
}

impl TokenBucketKey {
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, capacity: u64, refill_ms: u64) -> Self {
        Self(format!("q:rps:{}:{limit}:{}:{capacity}/{refill_ms}", tag(tenant), subject.as_str()))
    }
}

impl SlidingLogKey {
    /// `auth_class`: the credential-route bucket (`rl:auth:`) instead of `rl:api:`.
    pub fn new(auth_class: bool, tenant: &Id, limit: &Id, subject: &Subject, window_ms: u64) -> Self {
        let class = if auth_class { "auth" } else { "api" };
        Self(format!("rl:{class}:{}:{limit}:{}:{window_ms}", tag(tenant), subject.as_str()))
    }
}

impl TokenBudgetKey {
    /// `period` is `yyyyMM`.
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, period: u32) -> Self {
        Self(format!("q:tokens:{}:{limit}:{}:{period:06}", tag(tenant), subject.as_str()))
    }
}

impl SpendBudgetKey {
    /// `period` is `yyyyMM` (a month) or `yyyyMMdd` (a day), in the limit's time zone.
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, period: u32) -> Self {
        Self(format!("q:spend:{}:{limit}:{}:{period:06}", tag(tenant), subject.as_str()))
    }
}

impl TokensPerMinuteKey {
    /// `minute` is ms since the epoch / 60 000.
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, minute: u32) -> Self {
        Self(format!("q:tpm:{}:{limit}:{}:{minute}", tag(tenant), subject.as_str()))
    }
}

/// The counter a budget reserves from: tokens or money (`decide.lua`'s `budget` kind and
/// `complete.lua` treat both alike: integer units, reserved then reconciled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetCounter {
    Tokens(TokenBudgetKey),
    Spend(SpendBudgetKey),
    /// A minute's tokens (per-model tokens per minute): reserved and reconciled as a month's.
    Minute(TokensPerMinuteKey),
}

impl BudgetCounter {
    pub fn as_str(&self) -> &str {
        match self {
            BudgetCounter::Tokens(k) => k.as_str(),
            BudgetCounter::Spend(k) => k.as_str(),
            BudgetCounter::Minute(k) => k.as_str(),
        }
    }

    /// The counter's TTL, set on every write: past its period's end by at least the longest
    /// a reservation lives (a late settlement still finds it).
    pub fn ttl_ms(&self) -> u64 {
        match self {
            BudgetCounter::Tokens(_) => TOKEN_BUDGET_TTL_MS,
            // the key ends with its period: `yyyyMMdd` is a day's
            BudgetCounter::Spend(k) if k.0.rsplit(':').next().is_some_and(|p| p.len() == 8) => SPEND_DAY_TTL_MS,
            BudgetCounter::Spend(_) => TOKEN_BUDGET_TTL_MS,
            BudgetCounter::Minute(_) => TOKENS_PER_MINUTE_TTL_MS,
        }
    }
}

impl From<TokenBudgetKey> for BudgetCounter {
    fn from(k: TokenBudgetKey) -> Self {
        BudgetCounter::Tokens(k)
    }
}

impl ReservationKey {
    /// One per budget and decision: a request with two budgets holds two reservations, settled
    /// one by one (a single key for both let the first settle mark the second settled too).
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject, decision_id: &Id) -> Self {
        Self(format!("q:reserved:{}:{limit}:{}:{decision_id}", tag(tenant), subject.as_str()))
    }
}

impl ConcurrencyKey {
    pub fn new(tenant: &Id, limit: &Id, subject: &Subject) -> Self {
        Self(format!("q:conc:{}:{limit}:{}", tag(tenant), subject.as_str()))
    }
}

impl DecisionRecordKey {
    /// In the tenant's hash tag: `decide.lua` writes it with the decision's limit keys, and
    /// `refund.lua` reads it with them (one Cluster slot).
    pub fn new(tenant: &Id, decision_id: &Id) -> Self {
        Self(format!("dec:{}:{decision_id}", tag(tenant)))
    }
}

/// TTL of [`DecisionRecordKey`]: 60 s — the filter reports an abandoned decision on its next
/// completion flush (100 ms by default), retried every flush while the sidecar cannot take it; a
/// refund later than this finds nothing (what the decision took stays taken, as before refunds).
pub const DECISION_RECORD_TTL_MS: u64 = 60_000;

/// TTL of [`TokenBudgetKey`]: 40 days (seed 000).
pub const TOKEN_BUDGET_TTL_MS: u64 = 40 * 24 * 3600 * 1000;
/// TTL of a day's [`SpendBudgetKey`] (set on every write): 3 days, past the day's end in any
/// time zone by far more than a reservation lives. A month's lives as a token budget's.
pub const SPEND_DAY_TTL_MS: u64 = 3 * 24 * 3600 * 1000;
/// TTL of [`TokensPerMinuteKey`] (set on every write): its minute, plus the longest a reservation
/// lives, plus a minute — a call settled late still finds the counter it reserved from.
pub const TOKENS_PER_MINUTE_TTL_MS: u64 = 60_000 + RESERVATION_TTL_MS + 60_000;
/// TTL of [`ReservationKey`]: 5 minutes, set on every write (seed 000).
pub const RESERVATION_TTL_MS: u64 = 5 * 60 * 1000;

/// TTL of [`AuthFailKey`]: one audit line per key per hour (seed 002).
pub const AUTH_FAIL_TTL_SECS: u64 = 3600;

/// Pattern matching every [`ApiKeyIdKey`] (for listing all keys with SCAN).
pub const API_KEY_ID_PATTERN: &str = "apikey-id:*";

impl ApiKeyRecordKey {
    pub fn new(hash: &KeyHash) -> Self {
        Self(format!("apikey:{}", hash.as_str()))
    }
}

impl ApiKeyIdKey {
    pub fn new(key_id: &Id) -> Self {
        Self(format!("apikey-id:{key_id}"))
    }
    /// The key id back from a key name found by SCAN.
    pub fn key_id_of(name: &str) -> Option<Id> {
        name.strip_prefix("apikey-id:").and_then(Id::parse)
    }
}

impl ApiKeyIndexKey {
    pub fn new(tenant: &Id) -> Self {
        Self(format!("apikey-index:{tenant}"))
    }
}

impl AuthFailKey {
    pub fn new(key_id: &Id) -> Self {
        Self(format!("apikey:authfail:{key_id}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_formats() {
        let h = KeyHash::parse(&"ab".repeat(32)).unwrap();
        let id = Id::parse("key_0123").unwrap();
        let t = Id::parse("acme").unwrap();
        assert_eq!(ApiKeyRecordKey::new(&h).as_str(), format!("apikey:{}", "ab".repeat(32)));
        assert_eq!(ApiKeyIdKey::new(&id).as_str(), "apikey-id:key_0123");
        assert_eq!(ApiKeyIndexKey::new(&t).as_str(), "apikey-index:acme");
        assert_eq!(AuthFailKey::new(&id).as_str(), "apikey:authfail:key_0123");
        assert_eq!(ApiKeyIdKey::key_id_of("apikey-id:key_0123"), Some(id));
    }

    #[test]
    fn golden_limit_formats_share_the_tenant_tag() {
        let t = Id::parse("acme").unwrap();
        let l = Id::parse("per-min").unwrap();
        let k = Subject::key(&Id::parse("key_1").unwrap());
        assert_eq!(FixedWindowKey::new(&t, &l, &k, 29_000_000).as_str(), "rl:{acme}:per-min:k.key_1:29000000");
        assert_eq!(SlidingWindowKey::new(&t, &l, &Subject::tenant(), 7).as_str(), "rate:{acme}:per-min:t:7");
        assert_eq!(TokenBucketKey::new(&t, &l, &k, 10, 60_000).as_str(), "q:rps:{acme}:per-min:k.key_1:10/60000");
        assert_eq!(SlidingLogKey::new(false, &t, &l, &Subject::ip("10.0.0.1".parse().unwrap()), 60_000).as_str(), "rl:api:{acme}:per-min:ip.10.0.0.1:60000");
        assert_eq!(SlidingLogKey::new(true, &t, &l, &k, 60_000).as_str(), "rl:auth:{acme}:per-min:k.key_1:60000");
        assert_eq!(TokenBudgetKey::new(&t, &l, &k, 202611).as_str(), "q:tokens:{acme}:per-min:k.key_1:202611");
        assert_eq!(ReservationKey::new(&t, &l, &k, &Id::parse("req-1").unwrap()).as_str(), "q:reserved:{acme}:per-min:k.key_1:req-1");
        let month = SpendBudgetKey::new(&t, &l, &k, 202612);
        let day = SpendBudgetKey::new(&t, &l, &Subject::tenant(), 20261205);
        assert_eq!((month.as_str(), day.as_str()), ("q:spend:{acme}:per-min:k.key_1:202612", "q:spend:{acme}:per-min:t:20261205"));
        assert_eq!(BudgetCounter::Spend(month).ttl_ms(), TOKEN_BUDGET_TTL_MS);
        assert_eq!(BudgetCounter::Spend(day).ttl_ms(), SPEND_DAY_TTL_MS);
        assert_eq!(BudgetCounter::from(TokenBudgetKey::new(&t, &l, &k, 202611)).ttl_ms(), TOKEN_BUDGET_TTL_MS);
        assert_eq!(ConcurrencyKey::new(&t, &l, &k).as_str(), "q:conc:{acme}:per-min:k.key_1");
        let minute = TokensPerMinuteKey::new(&t, &Id::parse("gpt-4o_.tpm").unwrap(), &k, 29_500_000);
        assert_eq!(minute.as_str(), "q:tpm:{acme}:gpt-4o_.tpm:k.key_1:29500000");
        assert_eq!(BudgetCounter::Minute(minute).ttl_ms(), 7 * 60_000);
        assert_eq!(DecisionRecordKey::new(&t, &Id::parse(&"ab".repeat(16)).unwrap()).as_str(), format!("dec:{{acme}}:{}", "ab".repeat(16)));
        assert_eq!(Subject::product(&Id::parse("chat").unwrap()).as_str(), "p.chat");
    }

    #[test]
    fn header_subjects_are_bounded() {
        assert_eq!(Subject::header("X-User", Some("u-1")).as_str(), "h.x-user.u-1");
        assert_eq!(Subject::header("x-user", None).as_str(), "h.x-user.-");
        let long = Subject::header("x-user", Some(&"a b{".repeat(100)));
        assert!(long.as_str().len() < 40 && !long.as_str().contains('{'), "{}", long.as_str());
        assert!(Subject::parse("k.key_1").is_some());
        assert!(Subject::parse("a{b}").is_none());
        assert!(Subject::parse("a b").is_none());
    }

    #[test]
    fn ids_and_hashes_are_validated() {
        assert!(KeyHash::parse(&"AB".repeat(32)).is_none());
        assert!(KeyHash::parse("abc").is_none());
        assert!(Id::parse("").is_none());
        assert!(Id::parse("a:b").is_none());
        assert!(Id::parse("a b").is_none());
        assert!(Id::parse(&"a".repeat(65)).is_none());
        assert!(Id::parse("tenant-1.prod_x").is_some());
    }
}

mod breaker;
pub use breaker::*;

// ---- usage meter (issue 6; seed 004's `usage:<subject>:<day>`) ----

redis_key!(
    /// `usage:{tenant}:{yyyyMMdd}` — hash of counters (`ok`, `4xx`, `5xx`, `denied`, `aborted`,
    /// `tokens`), TTL [`USAGE_METER_TTL_MS`] (35 days, seed 004), refreshed on every write. A fast,
    /// approximate per-day view of a tenant's usage (a batch the filter re-sends may count twice;
    /// the key may be evicted): billing reads the PostgreSQL rollup, and readers of a day take the
    /// larger of the two (seed 004). The tenant is the hash tag, like the limit keys, so a script
    /// may read a tenant's days together with its limits on Cluster.
    UsageMeterKey
);

/// TTL of [`UsageMeterKey`]: 35 days (seed 004).
pub const USAGE_METER_TTL_MS: u64 = 35 * 24 * 3600 * 1000;

impl UsageMeterKey {
    /// `day` is `yyyyMMdd` (8 digits), else `None`.
    pub fn new(tenant: &Id, day: &str) -> Option<Self> {
        (day.len() == 8 && day.bytes().all(|b| b.is_ascii_digit())).then(|| Self(format!("usage:{}:{day}", tag(tenant))))
    }
}

#[cfg(test)]
mod usage_meter_key_tests {
    use super::*;

    #[test]
    fn golden_format() {
        let t = Id::parse("acme").unwrap();
        assert_eq!(UsageMeterKey::new(&t, "20261129").unwrap().as_str(), "usage:{acme}:20261129");
        assert!(UsageMeterKey::new(&t, "2026-11-29").is_none());
        assert_eq!(USAGE_METER_TTL_MS, 3_024_000_000);
    }
}

// ---- configuration generations and change events (issue 4; seeds 000 and 003) ----

redis_key!(
    /// `cfg:routing:version` — string counter, no TTL: the configuration generation. Every admin
    /// write INCRs it after the store of record (PostgreSQL) committed; a replica whose
    /// pub/sub connection dropped compares it with the generation it last loaded to know whether
    /// it missed a change (seed 000). Not a store of record: losing it only forces a reload.
    RoutingVersionKey
);

impl RoutingVersionKey {
    pub fn new() -> Self {
        Self("cfg:routing:version".into())
    }
}

impl Default for RoutingVersionKey {
    fn default() -> Self {
        Self::new()
    }
}

/// The tenant segment of a change that concerns every tenant (plans, products, routes):
/// `config_changed:_all`. Tenant ids may not start with `_` (the sidecar's control::model validates it),
/// so it cannot collide with a tenant.
pub const ALL_TENANTS: &str = "_all";

redis_key!(
    /// `config_changed:{tenant}` — pub/sub channel (not a key: nothing is stored). Published after
    /// every admin write that concerns `tenant` (or [`ALL_TENANTS`]); the message is the new
    /// `cfg:routing:version`. Every sidecar PSUBSCRIBEs [`CONFIG_CHANGED_PATTERN`] (seed 003).
    ConfigChangedChannel
);

/// The pattern every sidecar subscribes to.
pub const CONFIG_CHANGED_PATTERN: &str = "config_changed:*";

impl ConfigChangedChannel {
    pub fn tenant(tenant: &Id) -> Self {
        Self(format!("config_changed:{tenant}"))
    }
    pub fn all() -> Self {
        Self(format!("config_changed:{ALL_TENANTS}"))
    }
    /// The tenant a channel name is about: `Some(None)` for every tenant, `None` if the name is
    /// not a change channel.
    pub fn tenant_of(name: &str) -> Option<Option<Id>> {
        let t = name.strip_prefix("config_changed:")?;
        if t == ALL_TENANTS {
            return Some(None);
        }
        Id::parse(t).map(Some)
    }
}

#[cfg(test)]
mod config_key_tests {
    use super::*;

    #[test]
    fn golden_config_formats() {
        let t = Id::parse("acme").unwrap();
        assert_eq!(RoutingVersionKey::new().as_str(), "cfg:routing:version");
        assert_eq!(ConfigChangedChannel::tenant(&t).as_str(), "config_changed:acme");
        assert_eq!(ConfigChangedChannel::all().as_str(), "config_changed:_all");
        assert_eq!(CONFIG_CHANGED_PATTERN, "config_changed:*");
        assert_eq!(ConfigChangedChannel::tenant_of("config_changed:acme"), Some(Some(t)));
        assert_eq!(ConfigChangedChannel::tenant_of("config_changed:_all"), Some(None));
        assert_eq!(ConfigChangedChannel::tenant_of("other:acme"), None);
        assert_eq!(ConfigChangedChannel::tenant_of("config_changed:a b"), None);
    }
}

mod responses;
pub use responses::{
    CacheHash, IdemKey, IdempotencyMemoKey, IdempotencyOwnerKey, RequestDigest, ResponseCacheKey, ResponsesBytesKey, ResponsesLiveKey,
    IDEMPOTENCY_IN_FLIGHT_TTL_MS, IDEMPOTENCY_TTL_MS,
};

mod console;
pub use console::{ConsoleFailuresKey, ConsoleInviteKey, ConsoleSessionKey, ConsoleUserKey, ConsoleUsersKey, Login, SecretHash};
