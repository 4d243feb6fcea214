//! A month's usage as a file (issue 42 item 6, decision 298): every stored event and aggregate
//! of the month (UTC days), as CloudEvents in JSON Lines ([`crate::cloudevents`], the same
//! events the export topic carries) or as CSV (one row per event, one per key of an aggregate).
//!
//! - Read from `usage_events`/`usage_aggregates` in pages (by time, then id), never the whole
//!   month in memory; progress every 10 000 events on the caller's callback.
//! - Written beside the destination and renamed over it once complete and synced: a full disk
//!   or a failed query leaves no partial file under the name asked for.
//! - Those tables keep events `events_retention` (35 days by default) after they arrived: a month
//!   whose first day is older than that is refused (its file would miss events) unless the
//!   caller accepts a partial file. The rollup behind the invoice ([`crate::invoice`]) is kept.
//! - CSV cells that a spreadsheet would run as a formula (`=`, `+`, `-`, `@`, tab, CR first)
//!   are prefixed with `'` (hosts and paths come from clients).

use crate::cloudevents::{self, Origin};
use crate::db::Db;
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use tollgate_shared::aggregate::UsageAggregate;
use tollgate_wire::llm::LlmUsage;
use tollgate_wire::usage::UsageEvent;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Csv,
    JsonLines,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("the month must be yyyy-MM")]
    Month,
    #[error("events of {0} arrived before the events retention and may have been pruned: the file would be incomplete (pass --partial to write it anyway; the invoice is complete)")]
    Pruned(String),
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("writing {0}: {1}")]
    Io(PathBuf, std::io::Error),
}

/// The CSV columns, in order.
pub const CSV_COLUMNS: [&str; 24] = [
    "id", "time", "type", "tenant", "key_id", "plan", "method", "authority", "path", "status", "class", "denied", "requests",
    "duration_ms", "tokens", "request_bytes", "response_bytes", "requested_model", "model", "input_tokens", "output_tokens",
    "cached_tokens", "cost_micros", "currency",
];

/// What a month's export asks for.
pub struct MonthExport<'a> {
    pub month: &'a str,
    pub tenant: Option<&'a str>,
    pub format: Format,
    pub out: &'a Path,
    /// Write even when the month's first day is older than the events retention.
    pub partial: bool,
    pub retention: std::time::Duration,
}

const PAGE: i64 = 5000;

/// Writes the month's file; Ok(events written).
pub async fn month(db: &Db, origin: &Origin, job: &MonthExport<'_>, mut progress: impl FnMut(u64)) -> Result<u64, ExportError> {
    let (first, last) = crate::report::month_days(job.month).ok_or(ExportError::Month)?;
    let first_ms = crate::report::day_start_ms(&first).ok_or(ExportError::Month)?;
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    if !job.partial && first_ms < now_ms - job.retention.as_millis() as i64 {
        return Err(ExportError::Pruned(job.month.to_string()));
    }
    let aside = aside_path(job.out);
    let io = |e| ExportError::Io(aside.clone(), e);
    let file = std::fs::File::create(&aside).map_err(io)?;
    let mut w = std::io::BufWriter::new(file);
    let written = async {
        if job.format == Format::Csv {
            writeln!(w, "{}", CSV_COLUMNS.join(",")).map_err(io)?;
        }
        let mut n = 0u64;
        let mut after: (i64, String) = (i64::MIN, String::new());
        loop {
            let rows = db.client().query(EVENTS_PAGE, &[&first, &last, &job.tenant, &after.0, &after.1, &PAGE]).await?;
            for r in &rows {
                let e = event_of_row(r);
                write_one(&mut w, job.format, origin, &cloudevents::of_event(origin, &e)).map_err(io)?;
                n += 1;
                if n.is_multiple_of(10_000) {
                    progress(n);
                }
                after = (e.start_ms as i64, e.id);
            }
            if (rows.len() as i64) < PAGE {
                break;
            }
        }
        let mut after: (i64, String) = (i64::MIN, String::new());
        loop {
            let rows = db.client().query(AGGREGATES_PAGE, &[&first, &last, &job.tenant, &after.0, &after.1, &PAGE]).await?;
            for r in &rows {
                let a = UsageAggregate {
                    id: r.get(0),
                    tenant: r.get(1),
                    second_ms: r.get::<_, i64>(2).max(0) as u64,
                    count: r.get::<_, i64>(3).max(0) as u64,
                    keys: serde_json::from_str(r.get::<_, &str>(4)).unwrap_or_default(),
                };
                write_one(&mut w, job.format, origin, &cloudevents::of_aggregate(origin, &a)).map_err(io)?;
                n += 1;
                after = (a.second_ms as i64, a.id);
            }
            if (rows.len() as i64) < PAGE {
                break;
            }
        }
        w.flush().map_err(io)?;
        w.get_ref().sync_all().map_err(io)?;
        Ok::<u64, ExportError>(n)
    }
    .await;
    match written {
        Ok(n) => {
            std::fs::rename(&aside, job.out).map_err(|e| ExportError::Io(job.out.to_path_buf(), e))?;
            Ok(n)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&aside);
            Err(e)
        }
    }
}

const EVENTS_PAGE: &str = "SELECT event_id, tenant, key_id, plan, method, authority, path, status, start_ms, duration_ms, tokens,
        request_bytes, response_bytes, denied, tokens_unread, requested_model, model, input_tokens, output_tokens,
        cached_tokens, cost_micros
 FROM usage_events
 WHERE day BETWEEN $1::text::date AND $2::text::date AND ($3::text IS NULL OR tenant = $3)
   AND (start_ms, event_id) > ($4, $5)
 ORDER BY start_ms, event_id LIMIT $6";

const AGGREGATES_PAGE: &str = "SELECT aggregate_id, tenant, second_ms, events, keys::text FROM usage_aggregates
 WHERE day BETWEEN $1::text::date AND $2::text::date AND ($3::text IS NULL OR tenant = $3)
   AND (second_ms, aggregate_id) > ($4, $5)
 ORDER BY second_ms, aggregate_id LIMIT $6";

fn event_of_row(r: &tokio_postgres::Row) -> UsageEvent {
    let n = |i: usize| r.get::<_, Option<i64>>(i).map(|v| v.max(0) as u64);
    let (requested_model, model): (Option<String>, Option<String>) = (r.get(15), r.get(16));
    let llm = LlmUsage { requested_model, model, input_tokens: n(17), output_tokens: n(18), cached_tokens: n(19), cost_micros: n(20) };
    UsageEvent {
        id: r.get(0),
        tenant: r.get(1),
        key_id: r.get(2),
        plan: r.get(3),
        method: r.get(4),
        authority: r.get(5),
        path: r.get(6),
        status: u16::try_from(r.get::<_, i32>(7)).unwrap_or(0),
        start_ms: r.get::<_, i64>(8).max(0) as u64,
        duration_ms: r.get::<_, i64>(9).max(0) as u64,
        tokens: n(10),
        request_bytes: n(11),
        response_bytes: n(12),
        denied: r.get(13),
        tokens_unread: r.get(14),
        route: None,
        product: None,
        llm: (!llm.is_empty()).then_some(llm),
    }
}

fn aside_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

fn write_one(w: &mut impl Write, format: Format, origin: &Origin, ce: &Value) -> std::io::Result<()> {
    match format {
        Format::JsonLines => writeln!(w, "{ce}"),
        Format::Csv => {
            for row in csv_rows(origin, ce) {
                writeln!(w, "{}", row.iter().map(|c| csv_cell(c)).collect::<Vec<_>>().join(","))?;
            }
            Ok(())
        }
    }
}

/// The CSV rows of one CloudEvent: one for a request, one per key for an aggregate.
pub fn csv_rows(origin: &Origin, ce: &Value) -> Vec<Vec<String>> {
    let text = |v: &Value| match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let data = &ce["data"];
    let head = |id: String, key: &Value, plan: &Value| vec![id, text(&ce["time"]), text(&ce["type"]), text(&ce["subject"]), text(key), text(plan)];
    if ce["type"] == cloudevents::TYPE_AGGREGATE {
        let keys = data["keys"].as_array().cloned().unwrap_or_default();
        return keys
            .iter()
            .map(|k| {
                let mut row = head(format!("{}/{}", text(&ce["id"]), text(&k["keyId"])), &k["keyId"], &k["plan"]);
                row.extend(std::iter::repeat_n(String::new(), 6)); // method … denied
                row.push(text(&k["count"]));
                row.push(String::new());
                for f in ["tokens", "requestBytes", "responseBytes"] {
                    row.push(text(&k[f]));
                }
                row.extend(std::iter::repeat_n(String::new(), 7)); // models, tokens apart, cost, currency
                row
            })
            .collect();
    }
    let mut row = head(text(&ce["id"]), &data["keyId"], &data["plan"]);
    for f in ["method", "authority", "path", "status", "class", "denied"] {
        row.push(text(&data[f]));
    }
    row.push("1".into());
    for f in ["durationMs", "tokens", "requestBytes", "responseBytes", "requestedModel", "model", "inputTokens", "outputTokens", "cachedTokens", "costMicros"] {
        row.push(text(&data[f]));
    }
    row.push(if data.get("costMicros").is_some() { origin.currency.clone() } else { String::new() });
    vec![row]
}

/// One CSV cell: quoted, and never a formula (tollgate_shared::csv).
pub use tollgate_shared::csv::cell as csv_cell;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cells_are_quoted_and_never_formulas() {
        assert_eq!(csv_cell("plain"), "plain");
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_cell("line\nbreak"), "\"line\nbreak\"");
        assert_eq!(csv_cell("=HYPERLINK(\"x\")"), "\"'=HYPERLINK(\"\"x\"\")\"");
        assert_eq!(csv_cell("@SUM(A1)"), "'@SUM(A1)");
        assert_eq!(csv_cell("-12"), "-12", "a negative number stays a number");
    }

    #[test]
    fn a_request_is_one_row_and_an_aggregate_one_per_key_in_the_columns_order() {
        let origin = Origin { source: "tollgate".into(), currency: "USD".into() };
        let e: UsageEvent = serde_json::from_value(json!({
            "id": "ev-1", "tenant": "acme", "keyId": "k1", "plan": "gold", "method": "POST", "authority": "a.test",
            "path": "/v1/chat", "status": 200, "startMs": 1000, "durationMs": 3,
            "llm": {"model": "m1", "inputTokens": 5, "outputTokens": 6, "costMicros": 42}
        }))
        .unwrap();
        let rows = csv_rows(&origin, &cloudevents::of_event(&origin, &e));
        assert_eq!(rows.len(), 1);
        let row: std::collections::BTreeMap<&str, &str> = CSV_COLUMNS.iter().copied().zip(rows[0].iter().map(String::as_str)).collect();
        assert_eq!(rows[0].len(), CSV_COLUMNS.len());
        assert_eq!((row["id"], row["type"], row["tenant"], row["key_id"]), ("ev-1", "tollgate.llm.call", "acme", "k1"));
        assert_eq!((row["requests"], row["model"], row["input_tokens"], row["cost_micros"], row["currency"]), ("1", "m1", "5", "42", "USD"));
        let a: UsageAggregate = serde_json::from_value(json!({
            "id": "agg_0123456789", "tenant": "acme", "secondMs": 2000, "count": 5,
            "keys": [
                {"keyId": "k1", "plan": "gold", "count": 3, "requests": {"ok": 3}, "tokens": 7, "requestBytes": 1, "responseBytes": 2},
                {"keyId": "k2", "plan": "gold", "count": 2, "requests": {"ok": 2}}
            ]
        }))
        .unwrap();
        let rows = csv_rows(&origin, &cloudevents::of_aggregate(&origin, &a));
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.len() == CSV_COLUMNS.len()));
        let requests = CSV_COLUMNS.iter().position(|c| *c == "requests").unwrap();
        assert_eq!((rows[0][0].as_str(), rows[0][requests].as_str(), rows[1][requests].as_str()), ("agg_0123456789/k1", "3", "2"));
    }
}
