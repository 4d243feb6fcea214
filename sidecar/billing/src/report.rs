//! Reading a tenant's usage: per day and per month, each day the larger of the PostgreSQL rollup
//! and the gateway's Redis meter, field by field (seed 004). The meter is ahead of the rollup
//! (it counts at the gateway, before Kafka and this consumer); the rollup survives the meter's
//! eviction or a wiped Redis. So a month's quota read never drops when Redis loses its keys.

use crate::db::Db;
use std::collections::{BTreeMap, HashMap};
use tollgate_shared::keys::{Id, UsageMeterKey};
use tollgate_wire::usage::{Day, UsageClass};

/// One day's counters: requests by class (in [`UsageClass::ALL`] order) and tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DayUsage {
    pub by_class: [i64; 5],
    pub tokens: i64,
    /// Requests whose token usage could not be read (decision 183; the rollup's alone: the
    /// Redis meter does not count them).
    pub tokens_unread: i64,
}

impl DayUsage {
    /// Requests that count against a quota and on the bill: ok + 4xx (seed 004). Gateway denials,
    /// 5xx and aborted requests do not.
    pub fn billable(&self) -> i64 {
        self.by_class[0].saturating_add(self.by_class[1])
    }

    /// The larger of two readings, field by field.
    pub fn max(self, other: DayUsage) -> DayUsage {
        let mut out = self;
        for i in 0..5 {
            out.by_class[i] = out.by_class[i].max(other.by_class[i]);
        }
        out.tokens = out.tokens.max(other.tokens);
        out.tokens_unread = out.tokens_unread.max(other.tokens_unread);
        out
    }

    /// A Redis meter hash (`ok`, `4xx`, `5xx`, `denied`, `aborted`, `tokens`).
    pub fn from_meter(m: &HashMap<String, i64>) -> DayUsage {
        let mut d = DayUsage::default();
        for (i, class) in UsageClass::ALL.iter().enumerate() {
            d.by_class[i] = m.get(class.name()).copied().unwrap_or(0);
        }
        d.tokens = m.get("tokens").copied().unwrap_or(0);
        d
    }
}

/// Each day as the larger of its two readings (a day missing from one side counts as zero).
pub fn merge(rollup: &BTreeMap<String, DayUsage>, meter: &BTreeMap<String, DayUsage>) -> BTreeMap<String, DayUsage> {
    let mut out = rollup.clone();
    for (day, m) in meter {
        let e = out.entry(day.clone()).or_default();
        *e = e.max(*m);
    }
    out
}

/// A month's usage for a quota: the sum over its days of max(meter, rollup).
pub fn month_total(days: &BTreeMap<String, DayUsage>) -> DayUsage {
    let mut t = DayUsage::default();
    for d in days.values() {
        for i in 0..5 {
            t.by_class[i] = t.by_class[i].saturating_add(d.by_class[i]);
        }
        // a day saturates at i64::MAX (decision 167): so does the month, never wrapping
        t.tokens = t.tokens.saturating_add(d.tokens);
        t.tokens_unread = t.tokens_unread.saturating_add(d.tokens_unread);
    }
    t
}

fn parse_day(s: &str) -> Option<i64> {
    let mut it = s.split('-');
    let (year, month, day): (i32, u32, u32) = (it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?);
    if it.next().is_some() || !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    Some(Day { year, month, day }.days_since_epoch())
}

/// The first millisecond of a day `yyyy-MM-dd` (UTC), since the Unix epoch.
pub fn day_start_ms(day: &str) -> Option<i64> {
    parse_day(day).map(|d| d * 86_400_000)
}

/// Days from `from` to `to` (inclusive, `yyyy-MM-dd`), at most 366.
pub fn days(from: &str, to: &str) -> Option<Vec<String>> {
    let (a, b) = (parse_day(from)?, parse_day(to)?);
    if b < a || b - a > 366 || a < 0 {
        return None;
    }
    Some((a..=b).map(|d| Day::of_ms(d as u64 * 86_400_000).iso()).collect())
}

/// First and last day of a month `yyyy-MM`.
pub fn month_days(month: &str) -> Option<(String, String)> {
    let (y, m) = month.split_once('-')?;
    let (y, m): (i32, u32) = (y.parse().ok()?, m.parse().ok()?);
    if !(1..=12).contains(&m) {
        return None;
    }
    let last = Day { year: y, month: m, day: 1 }.next_month().days_since_epoch() - 1;
    Some((format!("{y:04}-{m:02}-01"), Day::of_ms(u64::try_from(last).ok()? * 86_400_000).iso()))
}

/// Why a usage report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("days must be yyyy-MM-dd, from <= to, at most 366 days")]
    Days,
    #[error("not a tenant id")]
    Tenant,
    /// More models in the month than a bounded read takes (crate::invoice::read_at_most).
    #[error("the month bills more than {0} models: too large an answer")]
    TooLarge(usize),
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// A tenant's usage per day from `from` to `to`: the rollup, merged with the Redis meter when
/// one is given.
pub async fn usage(
    db: &Db,
    redis: Option<&mut redis::aio::MultiplexedConnection>,
    tenant: &str,
    from: &str,
    to: &str,
) -> Result<BTreeMap<String, DayUsage>, ReportError> {
    let range = days(from, to).ok_or(ReportError::Days)?;
    let rollup: BTreeMap<String, DayUsage> = db
        .daily(tenant, from, to)
        .await?
        .into_iter()
        .map(|(d, c, t, u)| (d, DayUsage { by_class: c, tokens: t, tokens_unread: u }))
        .collect();
    let mut meter = BTreeMap::new();
    if let Some(conn) = redis {
        let t = Id::parse(tenant).ok_or(ReportError::Tenant)?;
        for day in range {
            let Some(key) = UsageMeterKey::new(&t, &day.replace('-', "")) else { continue };
            let m: HashMap<String, i64> =
                redis::cmd("HGETALL").arg(key.as_str()).query_async(conn).await?;
            if !m.is_empty() {
                meter.insert(day, DayUsage::from_meter(&m));
            }
        }
    }
    Ok(merge(&rollup, &meter))
}

/// A tenant's LLM calls from `from` to `to` (`yyyy-MM-dd`, inclusive) per model billed:
/// `(model, [requests, input, output, cached, tokens, cost in micro-units])`, in model order (`''`: neither model
/// was read), from `usage_daily_models` (crate::models; the Redis meter has no models). A
/// database no consumer of issue 42 has migrated: none.
pub async fn by_model(db: &Db, tenant: &str, from: &str, to: &str) -> Result<Vec<(String, [i64; 6])>, tokio_postgres::Error> {
    by_model_at_most(db, tenant, from, to, None).await
}

/// [`by_model`], at most `limit` models (the first in model order) when given.
pub async fn by_model_at_most(db: &Db, tenant: &str, from: &str, to: &str, limit: Option<i64>) -> Result<Vec<(String, [i64; 6])>, tokio_postgres::Error> {
    let c = db.client();
    let exists: bool = c.query_one("SELECT to_regclass('usage_daily_models') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let sum = |col: &str| format!("LEAST(sum({col}), 9223372036854775807)::int8");
    let rows = c
        .query(
            &format!(
                "SELECT model, {}, {}, {}, {}, {}, {} FROM usage_daily_models
                 WHERE tenant = $1 AND day BETWEEN $2::text::date AND $3::text::date GROUP BY model ORDER BY model LIMIT $4",
                sum("requests"),
                sum("input_tokens"),
                sum("output_tokens"),
                sum("cached_tokens"),
                sum("tokens"),
                sum("cost_micros")
            ),
            &[&tenant, &from, &to, &limit],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), [r.get(1), r.get(2), r.get(3), r.get(4), r.get(5), r.get(6)])).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(ok: i64, c4: i64, tokens: i64) -> DayUsage {
        DayUsage { by_class: [ok, c4, 0, 0, 0], tokens, tokens_unread: 0 }
    }

    #[test]
    fn day_ranges_and_months() {
        assert_eq!(days("2025-11-29", "2025-12-01").unwrap(), ["2025-11-29", "2025-11-30", "2025-12-01"]);
        assert_eq!(days("2024-02-28", "2024-03-01").unwrap().len(), 3);
        assert!(days("2025-12-01", "2025-11-01").is_none());
        assert!(days("2025-13-01", "2025-13-02").is_none());
        assert_eq!(month_days("2024-02").unwrap(), ("2024-02-01".into(), "2024-02-29".into()));
        assert_eq!(month_days("2025-12").unwrap(), ("2025-12-01".into(), "2025-12-31".into()));
        assert!(month_days("2025-00").is_none());
    }

    #[test]
    fn each_day_is_the_larger_reading_and_a_wiped_meter_changes_nothing() {
        let rollup: BTreeMap<String, DayUsage> =
            [("2025-11-01".to_string(), d(10, 2, 100)), ("2025-11-02".to_string(), d(5, 0, 0))].into();
        // the meter is ahead today (the rollup lags), behind yesterday (evicted, then restarted)
        let meter: BTreeMap<String, DayUsage> =
            [("2025-11-02".to_string(), d(8, 1, 7)), ("2025-11-01".to_string(), d(3, 0, 0))].into();
        let month = month_total(&merge(&rollup, &meter));
        assert_eq!(month.by_class[..2], [18, 3]);
        assert_eq!((month.billable(), month.tokens), (21, 107));
        // Redis wiped: the quota falls back to the rollup, never to zero
        assert_eq!(month_total(&merge(&rollup, &BTreeMap::new())).billable(), 17);
    }

    #[test]
    fn a_month_of_saturated_days_saturates_and_never_wraps() {
        let full = DayUsage { by_class: [i64::MAX, i64::MAX, 0, 0, 0], tokens: i64::MAX, tokens_unread: 0 };
        let days: BTreeMap<String, DayUsage> = [("2025-11-01".to_string(), full), ("2025-11-02".to_string(), d(1, 1, 1))].into();
        let month = month_total(&days);
        assert_eq!((month.by_class[0], month.tokens, month.billable()), (i64::MAX, i64::MAX, i64::MAX));
    }

    #[test]
    fn meter_hashes_are_read_by_class_name() {
        let m: HashMap<String, i64> = [("ok".into(), 4), ("5xx".into(), 1), ("tokens".into(), 9)].into();
        assert_eq!(DayUsage::from_meter(&m), DayUsage { by_class: [4, 0, 1, 0, 0], tokens: 9, tokens_unread: 0 });
    }
}
