//! The CloudEvents export's outbox (issue 42 item 6, decision 297): each new event or aggregate
//! a batch stores is also written, as its CloudEvent ([`crate::cloudevents`]), to
//! `usage_export_outbox` — in the batch's own transaction, so an event is queued for export
//! exactly when it is counted, once. The exporter ([`crate::exporter`]) sends the queue to `export.topic` and
//! deletes what the broker acknowledged.
//!
//! - **At least once, with stable ids**: a crash between the broker's acknowledgement and the
//!   delete sends those events again, with the same CloudEvent `id` (the usage event's): a
//!   consumer deduplicating by `(source, id)` counts them once.
//! - **Billing never waits for the export**: the export topic (or its broker) down, the outbox
//!   grows and billing goes on; the exporter retries with backoff and reports its backlog.
//! - **Several consumers**: each round takes its rows `FOR UPDATE SKIP LOCKED` and holds them
//!   until they are sent and deleted, so two consumers of the group never send the same rows at once.
//! - **Order**: per round, in queue order, keyed by tenant (one partition per tenant). A round
//!   with a failed delivery deletes what was delivered and sends the rest again later: an event
//!   can arrive after a later one of its tenant (consumers order by `time`).

use crate::cloudevents::{self, Origin};
use tollgate_shared::aggregate::UsageAggregate;
use tollgate_wire::usage::UsageEvent;

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS usage_export_outbox (
    seq       bigserial PRIMARY KEY,
    tenant    text NOT NULL,
    body      text NOT NULL,
    queued_at timestamptz NOT NULL DEFAULT now()
);
"#;

/// Queues the CloudEvents of `events` and `aggregates` (the ones a batch stored now), in the
/// batch's transaction `tx`.
pub async fn enqueue<'a>(
    tx: &tokio_postgres::Transaction<'_>,
    origin: &Origin,
    events: impl Iterator<Item = &'a UsageEvent>,
    aggregates: impl Iterator<Item = &'a UsageAggregate>,
) -> Result<(), tokio_postgres::Error> {
    let (mut tenants, mut bodies) = (Vec::new(), Vec::new());
    for e in events {
        tenants.push(e.tenant.clone());
        bodies.push(cloudevents::of_event(origin, e).to_string());
    }
    for a in aggregates {
        tenants.push(a.tenant.clone());
        bodies.push(cloudevents::of_aggregate(origin, a).to_string());
    }
    if tenants.is_empty() {
        return Ok(());
    }
    tx.execute(
        "INSERT INTO usage_export_outbox (tenant, body) SELECT * FROM unnest($1::text[], $2::text[])",
        &[&tenants, &bodies],
    )
    .await
    .map(|_| ())
}

