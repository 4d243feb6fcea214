//! A tenant's usage from the billing rollup (`usage_daily` in the billing consumer's PostgreSQL,
//! `console.usage_url`): read only, one tenant at a time, the last [`DAYS`] days. The sums and
//! the CSV are pure functions of the rows.

use crate::keys::Id;
use std::collections::BTreeMap;
use std::time::Duration;

/// How far back the portal shows usage.
pub const DAYS: i32 = 31;

/// One `usage_daily` row, summed as the portal shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `YYYY-MM-DD`.
    pub day: String,
    pub key_id: String,
    pub requests: u64,
    pub denied: u64,
    pub tokens: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("no usage store is configured (console.usage_url)")]
    NotConfigured,
    #[error("the usage store does not answer: {0}")]
    Unavailable(String),
}

/// The usage database: connected on first use, again after a failure.
pub struct UsageDb {
    url: Option<String>,
    client: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

impl UsageDb {
    pub fn new(url: Option<String>) -> UsageDb {
        UsageDb { url: url.filter(|u| !u.is_empty()), client: tokio::sync::Mutex::new(None) }
    }

    pub fn configured(&self) -> bool {
        self.url.is_some()
    }

    /// The rows of `tenant` of the last [`DAYS`] days, by day.
    pub async fn rows(&self, tenant: &Id) -> Result<Vec<Row>, UsageError> {
        let sql = "SELECT to_char(day, 'YYYY-MM-DD'), key_id, \
                   (requests_ok + requests_4xx + requests_5xx + requests_denied + requests_aborted)::bigint, \
                   requests_denied, tokens \
                   FROM usage_daily WHERE tenant = $1 AND day >= current_date - $2::int ORDER BY day, key_id";
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(self
            .query(sql, tenant)
            .await?
            .iter()
            .map(|r| Row { day: r.get(0), key_id: r.get(1), requests: n(r.get(2)), denied: n(r.get(3)), tokens: n(r.get(4)) })
            .collect())
    }

    /// The LLM calls of `tenant` of the last [`DAYS`] days by model, with their cost
    /// (`usage_daily_models`, issue 42): none before any LLM call was billed.
    pub async fn models(&self, tenant: &Id) -> Result<Vec<ModelRow>, UsageError> {
        let sum = |c: &str| format!("LEAST(sum({c}), 9223372036854775807)::bigint");
        let sql = format!(
            "SELECT model, {}, {}, {}, {}, {} FROM usage_daily_models \
             WHERE tenant = $1 AND day >= current_date - $2::int GROUP BY model ORDER BY model",
            sum("requests"),
            sum("input_tokens"),
            sum("output_tokens"),
            sum("cached_tokens"),
            sum("cost_micros")
        );
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(self
            .query(&sql, tenant)
            .await?
            .iter()
            .map(|r| ModelRow { model: r.get(0), requests: n(r.get(1)), input: n(r.get(2)), output: n(r.get(3)), cached: n(r.get(4)), cost_micros: n(r.get(5)) })
            .collect())
    }

    /// One query of `tenant` over the last [`DAYS`] days (`$1`, `$2`); a table the billing
    /// consumer has not created yet is no rows.
    async fn query(&self, sql: &str, tenant: &Id) -> Result<Vec<tokio_postgres::Row>, UsageError> {
        let Some(url) = &self.url else { return Err(UsageError::NotConfigured) };
        let mut guard = self.client.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = Some(connect(url).await?);
        }
        let Some(client) = guard.as_ref() else { return Err(UsageError::Unavailable("no connection".into())) };
        let tenant = tenant.as_str();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&tenant, &DAYS];
        match tokio::time::timeout(QUERY_TIMEOUT, client.query(sql, &params)).await {
            Err(_) => {
                *guard = None;
                Err(UsageError::Unavailable("the query timed out".into()))
            }
            Ok(Err(e)) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => Ok(Vec::new()),
            Ok(Err(e)) => {
                *guard = None;
                Err(UsageError::Unavailable(e.to_string()))
            }
            Ok(Ok(r)) => Ok(r),
        }
    }
}

/// One model's LLM calls over the portal's days.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRow {
    /// `''` when neither the answer nor the request named a model.
    pub model: String,
    pub requests: u64,
    pub input: u64,
    pub output: u64,
    pub cached: u64,
    /// Micro-units of the gateway's pricing currency.
    pub cost_micros: u64,
}

/// Micro-units as a decimal with six places (`1.500000`), made from the integer.
pub fn money(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, UsageError> {
    let connecting = tokio_postgres::connect(url, tokio_postgres::NoTls);
    let (client, connection) = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| UsageError::Unavailable("connecting timed out".into()))?
        .map_err(|e| UsageError::Unavailable(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "the console's usage connection ended");
        }
    });
    Ok(client)
}

/// Requests per day.
pub fn by_day(rows: &[Row]) -> Vec<(String, u64)> {
    let mut m: BTreeMap<&str, u64> = BTreeMap::new();
    for r in rows {
        *m.entry(&r.day).or_default() += r.requests;
    }
    m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Requests per key.
pub fn by_key(rows: &[Row]) -> Vec<(String, u64)> {
    let mut m: BTreeMap<&str, u64> = BTreeMap::new();
    for r in rows {
        *m.entry(&r.key_id).or_default() += r.requests;
    }
    m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// The rows as CSV (RFC 4180, formulas defused: tollgate_shared::csv).
pub fn csv(rows: &[Row]) -> String {
    let field = tollgate_shared::csv::cell;
    let mut out = String::from("day,key_id,requests,denied,tokens\r\n");
    for r in rows {
        out.push_str(&format!("{},{},{},{},{}\r\n", field(&r.day), field(&r.key_id), r.requests, r.denied, r.tokens));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(day: &str, key: &str, requests: u64) -> Row {
        Row { day: day.into(), key_id: key.into(), requests, denied: 1, tokens: 10 }
    }

    #[test]
    fn sums_by_day_and_by_key() {
        let rows = [row("2026-12-01", "key_a", 3), row("2026-12-01", "key_b", 4), row("2026-12-02", "key_a", 5)];
        assert_eq!(by_day(&rows), vec![("2026-12-01".to_string(), 7), ("2026-12-02".to_string(), 5)]);
        assert_eq!(by_key(&rows), vec![("key_a".to_string(), 8), ("key_b".to_string(), 4)]);
    }

    #[test]
    fn csv_is_quoted_and_defused() {
        let text = csv(&[row("2026-12-01", "key_a", 3), row("2026-12-01", "=cmd,x", 1)]);
        assert_eq!(text, "day,key_id,requests,denied,tokens\r\n2026-12-01,key_a,3,1,10\r\n2026-12-01,\"'=cmd,x\",1,1,10\r\n");
    }

    #[test]
    fn money_is_printed_from_integer_micro_units() {
        assert_eq!(money(0), "0.000000");
        assert_eq!(money(1_500_007), "1.500007");
        assert_eq!(money(u64::MAX), "18446744073709.551615");
    }

    #[tokio::test]
    async fn without_a_url_the_store_says_so() {
        let db = UsageDb::new(None);
        assert!(!db.configured());
        assert!(matches!(db.rows(&Id::parse("acme").unwrap()).await, Err(UsageError::NotConfigured)));
    }
}
