//! A tenant's invoice-ready month (issue 42 item 6, decision 299): LLM calls by model —
//! requests, input, output and cached tokens, cost — and the month's billable requests, from the
//! rollup (`usage_daily_models`, `usage_daily`), which is kept whatever the events retention.
//! Money stays integer micro-units; the decimal text is made from them (never a float).

use crate::db::Db;
use crate::report::{self, ReportError};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Line {
    /// The model billed (`(unknown)` when neither the answer nor the request named one).
    pub model: String,
    pub requests: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cached_tokens: i64,
    pub cost_micros: i64,
    /// `cost_micros` as a decimal of the currency (`1.234567`).
    pub cost: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Invoice {
    pub tenant: String,
    /// `yyyy-MM`.
    pub month: String,
    pub currency: String,
    /// Requests billed this month (answered by an upstream with < 500: ok + 4xx), LLM calls included.
    pub billable_requests: i64,
    pub lines: Vec<Line>,
    pub total_cost_micros: i64,
    pub total_cost: String,
}

/// `micros` as a decimal with six places (`-0.000001`, `12.500000`).
pub fn decimal(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    let m = micros.unsigned_abs();
    format!("{sign}{}.{:06}", m / 1_000_000, m % 1_000_000)
}

/// The invoice of `tenant` for `month` from rollup figures: `(model, [requests, input, output,
/// cached, tokens, cost])` as [`report::by_model`] reads them, and the month's billable requests.
pub fn build(tenant: &str, month: &str, currency: &str, billable_requests: i64, models: &[(String, [i64; 6])]) -> Invoice {
    let lines: Vec<Line> = models
        .iter()
        .map(|(model, n)| Line {
            model: if model.is_empty() { "(unknown)".into() } else { model.clone() },
            requests: n[0],
            input_tokens: n[1],
            output_tokens: n[2],
            cached_tokens: n[3],
            cost_micros: n[5],
            cost: decimal(n[5]),
        })
        .collect();
    let total = lines.iter().fold(0i64, |t, l| t.saturating_add(l.cost_micros));
    Invoice {
        tenant: tenant.into(),
        month: month.into(),
        currency: currency.into(),
        billable_requests,
        lines,
        total_cost_micros: total,
        total_cost: decimal(total),
    }
}

/// Reads the month's rollup and builds the invoice (`tollgate-billing invoice`).
pub async fn read(db: &Db, tenant: &str, month: &str, currency: &str) -> Result<Invoice, ReportError> {
    read_bounded(db, tenant, month, currency, None).await
}

/// [`read`], refused ([`ReportError::TooLarge`]) when the month bills more than `max_lines`
/// models: the sidecar's `GET /v1/invoices` answers a bounded body, with the same figures.
pub async fn read_at_most(db: &Db, tenant: &str, month: &str, currency: &str, max_lines: usize) -> Result<Invoice, ReportError> {
    read_bounded(db, tenant, month, currency, Some(max_lines)).await
}

async fn read_bounded(db: &Db, tenant: &str, month: &str, currency: &str, max_lines: Option<usize>) -> Result<Invoice, ReportError> {
    let (from, to) = report::month_days(month).ok_or(ReportError::Days)?;
    let days = report::usage(db, None, tenant, &from, &to).await?;
    let billable = report::month_total(&days).billable();
    let limit = max_lines.map(|m| i64::try_from(m).unwrap_or(i64::MAX).saturating_add(1));
    let models = report::by_model_at_most(db, tenant, &from, &to, limit).await?;
    if let Some(max) = max_lines.filter(|m| models.len() > *m) {
        return Err(ReportError::TooLarge(max));
    }
    Ok(build(tenant, month, currency, billable, &models))
}

/// Whether `month` is a month as invoices name them: `yyyy-MM`, exactly.
pub fn well_formed_month(month: &str) -> bool {
    let b = month.as_bytes();
    b.len() == 7 && b[4] == b'-' && b.iter().enumerate().all(|(i, c)| i == 4 || c.is_ascii_digit()) && report::month_days(month).is_some()
}

impl Invoice {
    /// A text table for a terminal.
    pub fn text(&self) -> String {
        let mut out = format!("invoice: tenant {}, {} ({})\n", self.tenant, self.month, self.currency);
        out += &format!("{:<40} {:>10} {:>14} {:>14} {:>14} {:>18}\n", "MODEL", "REQUESTS", "INPUT", "OUTPUT", "CACHED", "COST");
        for l in &self.lines {
            out += &format!("{:<40} {:>10} {:>14} {:>14} {:>14} {:>18}\n", l.model, l.requests, l.input_tokens, l.output_tokens, l.cached_tokens, l.cost);
        }
        out += &format!("{:<40} {:>10} {:>14} {:>14} {:>14} {:>18}\n", "TOTAL", "", "", "", "", self.total_cost);
        out += &format!("billable requests (ok + 4xx, LLM calls included): {}\n", self.billable_requests);
        out
    }

    /// CSV: one row per model, then a total row.
    pub fn csv(&self) -> String {
        let cell = |s: &str| crate::export::csv_cell(s);
        let mut out = String::from("tenant,month,currency,model,requests,input_tokens,output_tokens,cached_tokens,cost_micros,cost\n");
        let head = format!("{},{},{}", cell(&self.tenant), self.month, self.currency);
        for l in &self.lines {
            out += &format!(
                "{head},{},{},{},{},{},{},{}\n",
                cell(&l.model),
                l.requests,
                l.input_tokens,
                l.output_tokens,
                l.cached_tokens,
                l.cost_micros,
                l.cost
            );
        }
        out += &format!("{head},TOTAL,,,,,{},{}\n", self.total_cost_micros, self.total_cost);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_are_yyyy_mm_exactly() {
        for good in ["2026-01", "2026-12", "1999-07"] {
            assert!(well_formed_month(good), "{good}");
        }
        for bad in ["2026-1", "2026-13", "2026-00", "26-01", "2026/01", "2026-01-01", "", "２０２６-01", "+026-01"] {
            assert!(!well_formed_month(bad), "{bad}");
        }
    }

    #[test]
    fn money_is_printed_from_integer_micros() {
        assert_eq!(decimal(0), "0.000000");
        assert_eq!(decimal(1), "0.000001");
        assert_eq!(decimal(12_500_000), "12.500000");
        assert_eq!(decimal(-1), "-0.000001");
        assert_eq!(decimal(i64::MIN), "-9223372036854.775808");
    }

    #[test]
    fn lines_by_model_and_a_total_that_saturates() {
        let models = vec![("".to_string(), [1, 10, 5, 0, 15, 7]), ("gpt-4o".to_string(), [3, 300, 90, 100, 390, 1_500_000])];
        let inv = build("acme", "2026-11", "EUR", 9, &models);
        assert_eq!(inv.lines[0].model, "(unknown)");
        assert_eq!((inv.total_cost_micros, inv.total_cost.as_str()), (1_500_007, "1.500007"));
        assert!(inv.text().contains("gpt-4o") && inv.text().contains("1.500007"));
        let csv = inv.csv();
        assert!(csv.lines().nth(2).unwrap().starts_with("acme,2026-11,EUR,gpt-4o,3,300,90,100,1500000,1.500000"), "{csv}");
        assert!(csv.ends_with("acme,2026-11,EUR,TOTAL,,,,,1500007,1.500007\n"), "{csv}");
        let big = vec![("a".to_string(), [1, 0, 0, 0, 0, i64::MAX]), ("b".to_string(), [1, 0, 0, 0, 0, 5])];
        assert_eq!(build("t", "2026-11", "USD", 0, &big).total_cost_micros, i64::MAX);
        let json = serde_json::to_value(&inv).unwrap();
        assert_eq!(json["lines"][1]["costMicros"], 1_500_000);
        assert_eq!(json["totalCost"], "1.500007");
    }
}
