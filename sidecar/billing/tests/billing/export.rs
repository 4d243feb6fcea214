//! The billing export (issue 42 item 6) against real servers: usage as CloudEvents to a Kafka
//! topic (through the outbox: billing goes on while the topic is missing, and every event is
//! sent once it exists), a month's file in JSON Lines and CSV, and the invoice by model. Every
//! CloudEvent is validated against the CloudEvents 1.0 JSON schema (billing/cloudevents-1.0.schema.json)
//! by `jsonschema` with its format checkers (billing/validate_cloudevents.py).

use super::{event, messages, totals};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tollgate_tests::billing::{psql_i64, Billing};
use tollgate_tests::broker::{create_topic, first_header, produce, read_topic, Broker};
use tollgate_tests::postgres::Postgres;
use tollgate_tests::{free_port, get, poll_until};
use tollgate_wire::llm::LlmUsage;
use tollgate_wire::usage::UsageEvent;

const EXPORT_TOPIC: &str = "usage_cloudevents";

/// 40 events of two tenants on 2025-11-30; every other one an LLM call with a cost.
fn month_events() -> Vec<UsageEvent> {
    (0..40)
        .map(|n| {
            let mut e = event(if n % 4 == 0 { "beta" } else { "acme" }, 500 + n);
            if n % 2 == 0 {
                e.llm = Some(LlmUsage {
                    requested_model: Some("fast".into()),
                    model: Some(if n % 3 == 0 { "gpt-4o" } else { "claude-sonnet" }.into()),
                    input_tokens: Some(100 + n),
                    output_tokens: Some(10 + n),
                    cached_tokens: Some(n),
                    cost_micros: Some(1_000 + n),
                });
            }
            e
        })
        .collect()
}

fn schema_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/billing")
}

/// Validates JSON documents (one per line) against the CloudEvents 1.0 schema; panics with the
/// validator's errors.
fn assert_cloudevents(lines: &[String]) {
    let python = std::env::var("TOLLGATE_PYTHON").unwrap_or_else(|_| format!("{}/../../.tollgate/tools/venv/bin/python", env!("CARGO_MANIFEST_DIR")));
    let mut child = Command::new(&python)
        .arg(schema_dir().join("validate_cloudevents.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e} (./build.sh installs the venv)"));
    child.stdin.take().unwrap().write_all(lines.join("\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "not valid CloudEvents 1.0:\n{text}");
    assert_eq!(text.trim(), lines.len().to_string(), "the validator read every event");
}

fn metric(port: u16, name: &str) -> i64 {
    let body = get(&format!("http://127.0.0.1:{port}/metrics"), &[]).body;
    body.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.trim().parse().ok()).unwrap_or(-1)
}

#[test]
fn usage_goes_out_as_cloudevents_once_each_and_billing_never_waits_for_a_hung_export_broker() {
    let (broker, pg) = (Broker::start(), Postgres::start());
    // the export goes to its own cluster (the metering system's), hung from the start
    let metering = Broker::start();
    create_topic(&metering.brokers(), EXPORT_TOPIC, 2);
    metering.pause();
    create_topic(&broker.brokers(), "usage_events", 2);
    let events = month_events();
    let mut msgs = messages(&events);
    msgs.extend(messages(&events[..10])); // delivered twice by the gateway
    produce(&broker.brokers(), "usage_events", &msgs);
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let _billing = Billing::start(
        &broker.brokers(),
        "usage_events",
        "billing-export",
        &pg,
        &[
            ("TOLLGATE_BILLING_EXPORT__TOPIC", EXPORT_TOPIC),
            ("TOLLGATE_BILLING_EXPORT__BROKERS", &metering.brokers()),
            ("TOLLGATE_BILLING_EXPORT__SOURCE", "tollgate/test-eu"),
            ("TOLLGATE_BILLING_EXPORT__CURRENCY", "EUR"),
            ("TOLLGATE_BILLING_EXPORT__DELIVERY_TIMEOUT", "2s"),
            ("TOLLGATE_BILLING_METRICS_LISTEN", &listen),
        ],
    );
    // billing counts every event all the same …
    poll_until("the rollup to count every event once", Duration::from_secs(60), || {
        totals(&pg, "acme").map(|t| t.0) == Some(30) && totals(&pg, "beta").map(|t| t.0) == Some(10)
    });
    // … and the export keeps them, once each, trying again
    poll_until("an export round to fail on the hung broker", Duration::from_secs(60), || metric(metrics_port, "tollgate_billing_export_errors_total") >= 1);
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_export_outbox"), 40, "each new event queued once, duplicates not");
    metering.resume();
    poll_until("the outbox to drain", Duration::from_secs(90), || psql_i64(&pg, "SELECT count(*) FROM usage_export_outbox") == 0);
    let got = read_topic(&metering.brokers(), EXPORT_TOPIC, 40, Duration::from_secs(60));
    assert_eq!(got.len(), 40, "every event sent, none twice");
    let ids: BTreeSet<String> = got.iter().map(|(_, v)| serde_json::from_str::<serde_json::Value>(v).unwrap()["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, events.iter().map(|e| e.id.clone()).collect::<BTreeSet<_>>(), "one CloudEvent per usage event, named by its id");
    for (key, value) in &got {
        let ce: serde_json::Value = serde_json::from_str(value).unwrap();
        assert_eq!(ce["subject"].as_str(), Some(key.as_str()), "keyed by tenant, the subject");
        assert_eq!(ce["source"], "tollgate/test-eu");
        let original = events.iter().find(|e| ce["id"] == e.id.as_str()).unwrap();
        match &original.llm {
            Some(llm) => {
                assert_eq!(ce["type"], "tollgate.llm.call");
                assert_eq!(ce["data"]["costMicros"].as_u64(), llm.cost_micros);
                assert_eq!(ce["data"]["currency"], "EUR");
                assert_eq!(ce["data"]["inputTokens"].as_u64(), llm.input_tokens);
                assert_eq!(ce["data"]["model"].as_str(), llm.model.as_deref());
            }
            None => assert_eq!(ce["type"], "tollgate.request"),
        }
    }
    assert_cloudevents(&got.into_iter().map(|(_, v)| v).collect::<Vec<_>>());
    assert_eq!(
        first_header(&metering.brokers(), EXPORT_TOPIC, "content-type", Duration::from_secs(30)).as_deref(),
        Some("application/cloudevents+json; charset=UTF-8"),
        "structured mode"
    );
    poll_until("the backlog gauge to show the drained outbox", Duration::from_secs(30), || metric(metrics_port, "tollgate_billing_export_backlog_events") == 0);
    assert_eq!(metric(metrics_port, "tollgate_billing_export_sent_total"), 40);
}

#[test]
fn a_months_file_and_invoice_hold_every_event_and_a_file_is_never_left_half_written() {
    let (broker, pg) = (Broker::start(), Postgres::start());
    create_topic(&broker.brokers(), "usage_events", 2);
    let events = month_events();
    produce(&broker.brokers(), "usage_events", &messages(&events));
    let billing = Billing::start(&broker.brokers(), "usage_events", "billing-file", &pg, &[("TOLLGATE_BILLING_EXPORT__CURRENCY", "EUR")]);
    poll_until("the rollup to count every event", Duration::from_secs(60), || {
        totals(&pg, "acme").map(|t| t.0) == Some(30) && totals(&pg, "beta").map(|t| t.0) == Some(10)
    });
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = billing.cli(args);
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // 2025-11 is older than the events retention: refused unless a partial file is accepted
    let jsonl = dir.path().join("2025-11.jsonl");
    let (ok, _, err) = run(&["export", "--month", "2025-11", "--format", "jsonl", "--out", jsonl.to_str().unwrap()]);
    assert!(!ok && err.contains("--partial"), "{err}");
    assert!(!jsonl.exists());
    let (ok, _, err) = run(&["export", "--month", "2025-11", "--format", "jsonl", "--out", jsonl.to_str().unwrap(), "--partial"]);
    assert!(ok, "{err}");
    let lines: Vec<String> = std::fs::read_to_string(&jsonl).unwrap().lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 40);
    assert_cloudevents(&lines);
    // one tenant, as CSV: a header and one row per event, the columns the docs name
    let csv = dir.path().join("acme.csv");
    let (ok, _, err) = run(&["export", "--month", "2025-11", "--tenant", "acme", "--format", "csv", "--out", csv.to_str().unwrap(), "--partial"]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut rows = text.lines();
    assert_eq!(rows.next(), Some(tollgate_billing::export::CSV_COLUMNS.join(",").as_str()));
    assert_eq!(rows.clone().count(), 30);
    assert!(rows.all(|r| r.split(',').nth(3) == Some("acme")));
    // a destination that cannot be written: a clear error, nothing left behind
    let missing = dir.path().join("no-such-dir/out.csv");
    let (ok, _, err) = run(&["export", "--month", "2025-11", "--format", "csv", "--out", missing.to_str().unwrap(), "--partial"]);
    assert!(!ok && err.contains("no-such-dir"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "only the two complete files");
    // the invoice: by model, costs summed from the events, the total their sum
    let (ok, out, err) = run(&["invoice", "--tenant", "acme", "--month", "2025-11", "--format", "json"]);
    assert!(ok, "{err}");
    let inv: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(inv["currency"], "EUR");
    let acme_llm: Vec<&UsageEvent> = events.iter().filter(|e| e.tenant == "acme" && e.llm.is_some()).collect();
    let want_total: u64 = acme_llm.iter().map(|e| e.llm.as_ref().unwrap().cost_micros.unwrap()).sum();
    assert_eq!(inv["totalCostMicros"].as_u64(), Some(want_total));
    for line in inv["lines"].as_array().unwrap() {
        let of_model: Vec<&&UsageEvent> = acme_llm.iter().filter(|e| e.llm.as_ref().unwrap().model.as_deref() == line["model"].as_str()).collect();
        assert_eq!(line["requests"].as_u64(), Some(of_model.len() as u64), "{line}");
        let input: u64 = of_model.iter().map(|e| e.llm.as_ref().unwrap().input_tokens.unwrap()).sum();
        assert_eq!(line["inputTokens"].as_u64(), Some(input), "{line}");
    }
    let billable = events.iter().filter(|e| e.tenant == "acme" && e.status < 500).count();
    assert_eq!(inv["billableRequests"].as_u64(), Some(billable as u64));
    let (ok, out, _) = run(&["invoice", "--tenant", "acme", "--month", "2025-11", "--format", "csv"]);
    assert!(ok && out.lines().last().unwrap().ends_with(&format!(",TOTAL,,,,,{want_total},{}", tollgate_billing::invoice::decimal(want_total as i64))), "{out}");
    let (ok, _, err) = run(&["invoice", "--tenant", "acme", "--month", "2025-13"]);
    assert!(!ok && err.contains("yyyy-MM"), "{err}");
}
