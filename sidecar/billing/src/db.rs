//! PostgreSQL side of billing: the schema, storing a batch in one transaction (events counted
//! once by id, the rollup moved only by new ones), pruning.
//!
//! Tables (created if missing, `migrate`):
//! - `usage_events` — one row per event id (primary key): the deduplication set and the audit
//!   trail, pruned after `events_retention`.
//! - `usage_daily` — `(day, tenant, key_id)` → `requests_ok`, `requests_4xx`, `requests_5xx`,
//!   `requests_denied`, `requests_aborted`, `tokens`, `request_bytes`, `response_bytes`,
//!   `requests_tokens_unread` (decision 183: added to an older table by `migrate`). Billing
//!   reads this (seed 004's `usage_daily`; billable requests are ok + 4xx).
//! - `usage_aggregates` — one row per aggregate id (`tollgate.usage.aggregate.v1`: a high-rate
//!   tenant's events of one second combined by the gateway): the deduplication set of aggregates,
//!   with their per-key rows as the audit trail; pruned like `usage_events`. An aggregate moves
//!   the rollup by its per-key sums exactly as its events would have one by one.
//! - `usage_rejects` — messages that were neither valid events nor valid aggregates
//!   (`tollgate_shared::events`), or that PostgreSQL refused on their own, with where they were
//!   read and why (their text with NUL and bytes that are not UTF-8 replaced).

use crate::Consumed;
pub use crate::rollup::{rollup, rollup_aggregates, tokens_i64, Rollup};
use std::time::Duration;
use tokio_postgres::{Client, NoTls};
use tokio_util::sync::CancellationToken;
pub use crate::decode::{decode, Decoded};

pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS usage_events (
    event_id       text PRIMARY KEY,
    day            date NOT NULL,
    tenant         text NOT NULL,
    key_id         text NOT NULL,
    plan           text NOT NULL,
    class          text NOT NULL,
    status         integer NOT NULL,
    denied         text,
    method         text NOT NULL,
    authority      text NOT NULL,
    path           text NOT NULL,
    start_ms       bigint NOT NULL,
    duration_ms    bigint NOT NULL,
    tokens         bigint,
    request_bytes  bigint,
    response_bytes bigint,
    received_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS usage_events_received ON usage_events (received_at);
CREATE TABLE IF NOT EXISTS usage_daily (
    day              date NOT NULL,
    tenant           text NOT NULL,
    key_id           text NOT NULL,
    requests_ok      bigint NOT NULL DEFAULT 0,
    requests_4xx     bigint NOT NULL DEFAULT 0,
    requests_5xx     bigint NOT NULL DEFAULT 0,
    requests_denied  bigint NOT NULL DEFAULT 0,
    requests_aborted bigint NOT NULL DEFAULT 0,
    tokens           bigint NOT NULL DEFAULT 0,
    request_bytes    bigint NOT NULL DEFAULT 0,
    response_bytes   bigint NOT NULL DEFAULT 0,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (day, tenant, key_id)
);
CREATE TABLE IF NOT EXISTS usage_aggregates (
    aggregate_id text PRIMARY KEY,
    day          date NOT NULL,
    tenant       text NOT NULL,
    second_ms    bigint NOT NULL,
    events       bigint NOT NULL,
    keys         jsonb NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS usage_aggregates_received ON usage_aggregates (received_at);
CREATE TABLE IF NOT EXISTS usage_rejects (
    topic       text NOT NULL,
    "partition" integer NOT NULL,
    "offset"    bigint NOT NULL,
    payload     text NOT NULL,
    reason      text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, "partition", "offset")
);
"#;

/// Columns added since the first schema (decision 183), by [`Db::migrate`] where missing after a
/// look in `information_schema`: an `ALTER TABLE` takes its table's exclusive lock even when the
/// column is there, and would queue every insert behind a long reader at each start.
const ADDED_COLUMNS: [(&str, &str, &str); 8] = [
    ("usage_events", "tokens_unread", "boolean NOT NULL DEFAULT false"),
    ("usage_daily", "requests_tokens_unread", "bigint NOT NULL DEFAULT 0"),
    // an LLM call's facts (issue 42, event schema v2)
    ("usage_events", "requested_model", "text"),
    ("usage_events", "model", "text"),
    ("usage_events", "input_tokens", "bigint"),
    ("usage_events", "output_tokens", "bigint"),
    ("usage_events", "cached_tokens", "bigint"),
    ("usage_events", "cost_micros", "bigint"),
];

async fn insert_reject(c: &impl tokio_postgres::GenericClient, topic: &str, m: &Consumed, reason: &str) -> Result<(), tokio_postgres::Error> {
    c.execute(
        "INSERT INTO usage_rejects (topic, \"partition\", \"offset\", payload, reason) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT DO NOTHING",
        &[&topic, &m.partition, &m.offset, &storable_text(&m.payload), &storable_text(reason.as_bytes())],
    )
    .await
    .map(|_| ())
}

/// Whether PostgreSQL refused a statement for a value it will never take (SQLSTATE class 22,
/// data exception; 54, a program limit), not for being unreachable or busy.
pub fn is_data_error(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("54"))
}

/// Text PostgreSQL takes whatever a message held: not UTF-8 replaced (U+FFFD), NUL too (`text`
/// refuses it), so a rejected message is always kept.
pub fn storable_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).replace('\0', "\u{FFFD}")
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stored {
    /// Events and aggregates stored now (not seen before).
    pub inserted: u64,
    /// Of those, aggregates.
    pub aggregates: u64,
    /// Requests the rollup moved by (a new event: 1; a new aggregate: its count).
    pub requests: u64,
    pub duplicates: u64,
    pub rejected: u64,
}

impl std::ops::AddAssign for Stored {
    fn add_assign(&mut self, o: Stored) {
        self.inserted += o.inserted;
        self.aggregates += o.aggregates;
        self.requests += o.requests;
        self.duplicates += o.duplicates;
        self.rejected += o.rejected;
    }
}

pub struct Db {
    client: Client,
    /// Set when the CloudEvents export is on: each batch's new events go to the outbox too.
    export: Option<crate::cloudevents::Origin>,
}

impl Db {
    pub async fn connect(url: &str) -> Result<Db, tokio_postgres::Error> {
        // A PostgreSQL host that vanishes mid-query (a failover whose old host is gone, no RST)
        // must not hold a query — a batch's, the schema's, a prune — until the kernel's default
        // keepalive (~2 h): probes after 30 s idle, every 10 s, 3 missed → closed, and data
        // unacknowledged for 60 s → closed. The query then fails and the batch is stored again
        // on a new connection (a transaction that did commit makes its events duplicates,
        // skipped by id). The URL's own settings win where it names them.
        let mut config: tokio_postgres::Config = url.parse()?;
        if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
            config.keepalives_idle(Duration::from_secs(30));
        }
        if config.get_keepalives_interval().is_none() {
            config.keepalives_interval(Duration::from_secs(10));
        }
        if config.get_keepalives_retries().is_none() {
            config.keepalives_retries(3);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(Duration::from_secs(60));
        }
        let (client, conn) = config.connect(NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
        });
        // Kafka offsets are committed once our transaction commits: it must be durable by then,
        // even on a server whose default is `synchronous_commit = off` (found by the outage test:
        // an immediate shutdown lost the last commits).
        client.batch_execute("SET synchronous_commit = on").await?;
        Ok(Db { client, export: None })
    }

    /// Connects, retrying with backoff until it works or `stop` (then `None`). Logs once.
    pub async fn connect_retrying(url: &str, stop: &CancellationToken) -> Option<Db> {
        let mut backoff = Duration::from_millis(100);
        let mut logged = false;
        loop {
            match Db::connect(url).await {
                Ok(db) => {
                    if logged {
                        tracing::info!("billing: postgres is reachable again");
                    }
                    return Some(db);
                }
                Err(e) => {
                    if !logged {
                        tracing::warn!(error = %e, "billing: cannot reach postgres; retrying");
                        logged = true;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.cancelled() => return None,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Puts every new event and aggregate in the export outbox too, in the batch's transaction.
    pub fn exporting(&mut self, origin: Option<crate::cloudevents::Origin>) {
        self.export = origin;
    }

    /// A transaction on this connection (the export's rounds take theirs).
    pub(crate) async fn transaction(&mut self) -> Result<tokio_postgres::Transaction<'_>, tokio_postgres::Error> {
        self.client.transaction().await
    }

    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    pub async fn migrate(&self) -> Result<(), tokio_postgres::Error> {
        // An event's host, path and ids may hold any character a client sent (decision 196): a
        // database of another encoding refuses those rows, and a batch of them only would wait
        // as an outage forever. Refused here, at the start, with the reason.
        self.client
            .batch_execute(
                "DO $$ BEGIN IF current_setting('server_encoding') <> 'UTF8' THEN
                   RAISE EXCEPTION 'tollgate-billing needs a UTF8 database; this one is %: create it with ENCODING ''UTF8''',
                     current_setting('server_encoding');
                 END IF; END $$",
            )
            .await?;
        self.client.batch_execute(SCHEMA).await?;
        self.client.batch_execute(crate::models::SCHEMA).await?;
        self.client.batch_execute(crate::outbox::SCHEMA).await?;
        for (table, column, definition) in ADDED_COLUMNS {
            if !self.has_column(table, column).await? {
                self.client.batch_execute(&format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {definition}")).await?;
            }
        }
        Ok(())
    }

    async fn has_column(&self, table: &str, column: &str) -> Result<bool, tokio_postgres::Error> {
        let row = self
            .client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                                WHERE table_schema = current_schema() AND table_name = $1 AND column_name = $2)",
                &[&table, &column],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Stores one consumed batch in one transaction. Events and aggregates already stored (same
    /// id) change nothing; the rollup moves only by the events and aggregates inserted now.
    pub async fn store(&mut self, topic: &str, batch: &[Consumed]) -> Result<Stored, tokio_postgres::Error> {
        let Decoded { events, aggregates, rejects } = decode(batch);
        let tx = self.client.transaction().await?;
        let mut ids = Vec::with_capacity(events.len());
        let (mut day, mut tenant, mut key_id, mut plan, mut class) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut status, mut denied, mut method, mut authority, mut path) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut start, mut duration, mut tokens, mut req_b, mut resp_b) = (vec![], vec![], vec![], vec![], vec![]);
        let mut unread = vec![];
        let (mut asked, mut model, mut input, mut output, mut cached, mut cost) = (vec![], vec![], vec![], vec![], vec![], vec![]);
        for e in &events {
            let llm = e.llm.clone().unwrap_or_default();
            asked.push(llm.requested_model);
            model.push(llm.model);
            input.push(llm.input_tokens.map(tokens_i64));
            output.push(llm.output_tokens.map(tokens_i64));
            cached.push(llm.cached_tokens.map(tokens_i64));
            cost.push(llm.cost_micros.map(tokens_i64));
            ids.push(e.id.clone());
            day.push(e.day().iso());
            tenant.push(e.tenant.clone());
            key_id.push(e.key_id.clone());
            plan.push(e.plan.clone());
            class.push(e.class().name().to_string());
            status.push(i32::from(e.status));
            denied.push(e.denied.clone());
            method.push(e.method.clone());
            authority.push(e.authority.clone());
            path.push(e.path.clone());
            start.push(e.start_ms as i64);
            duration.push(e.duration_ms as i64);
            tokens.push(e.tokens.map(tokens_i64));
            unread.push(e.tokens_unread);
            req_b.push(e.request_bytes.map(|n| n as i64));
            resp_b.push(e.response_bytes.map(|n| n as i64));
        }
        let rows = tx
            .query(
                "INSERT INTO usage_events (event_id, day, tenant, key_id, plan, class, status, denied, method, authority, path,
                                           start_ms, duration_ms, tokens, request_bytes, response_bytes, tokens_unread,
                                           requested_model, model, input_tokens, output_tokens, cached_tokens, cost_micros)
                 SELECT u.id, u.day::date, u.tenant, u.key_id, u.plan, u.class, u.status, u.denied, u.method, u.authority,
                        u.path, u.start_ms, u.duration_ms, u.tokens, u.req_b, u.resp_b, u.unread, u.asked, u.model, u.it, u.ot, u.ct, u.cm
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int4[], $8::text[],
                             $9::text[], $10::text[], $11::text[], $12::int8[], $13::int8[], $14::int8[], $15::int8[], $16::int8[],
                             $17::bool[], $18::text[], $19::text[], $20::int8[], $21::int8[], $22::int8[], $23::int8[])
                      AS u(id, day, tenant, key_id, plan, class, status, denied, method, authority, path,
                           start_ms, duration_ms, tokens, req_b, resp_b, unread, asked, model, it, ot, ct, cm)
                 ON CONFLICT (event_id) DO NOTHING
                 RETURNING event_id",
                &[
                    &ids, &day, &tenant, &key_id, &plan, &class, &status, &denied, &method, &authority, &path, &start,
                    &duration, &tokens, &req_b, &resp_b, &unread, &asked, &model, &input, &output, &cached, &cost,
                ],
            )
            .await?;
        let inserted: std::collections::HashSet<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
        let new_events = events.iter().filter(|e| inserted.contains(&e.id));
        let mut increments = rollup(new_events);
        let by_model = crate::models::rollup_models(events.iter().filter(|e| inserted.contains(&e.id)));
        let mut new_aggregates: std::collections::HashSet<String> = std::collections::HashSet::new();
        if !aggregates.is_empty() {
            let (mut ids, mut day, mut tenant, mut second, mut count, mut keys) = (vec![], vec![], vec![], vec![], vec![], vec![]);
            for a in &aggregates {
                ids.push(a.id.clone());
                day.push(a.day().iso());
                tenant.push(a.tenant.clone());
                second.push(a.second_ms as i64);
                count.push(a.count as i64);
                keys.push(serde_json::to_string(&a.keys).unwrap_or_else(|_| "[]".into()));
            }
            let rows = tx
                .query(
                    "INSERT INTO usage_aggregates (aggregate_id, day, tenant, second_ms, events, keys)
                     SELECT u.id, u.day::date, u.tenant, u.second_ms, u.events, u.keys::jsonb
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::text[])
                          AS u(id, day, tenant, second_ms, events, keys)
                     ON CONFLICT (aggregate_id) DO NOTHING
                     RETURNING aggregate_id",
                    &[&ids, &day, &tenant, &second, &count, &keys],
                )
                .await?;
            new_aggregates = rows.iter().map(|r| r.get::<_, String>(0)).collect();
            rollup_aggregates(&mut increments, aggregates.iter().filter(|a| new_aggregates.contains(&a.id)));
        }
        if !increments.is_empty() {
            let (mut d, mut t, mut k) = (vec![], vec![], vec![]);
            let mut cols: [Vec<i64>; 9] = Default::default();
            for ((day, tenant, key), r) in &increments {
                d.push(day.clone());
                t.push(tenant.clone());
                k.push(key.clone());
                for (i, n) in r.by_class.iter().enumerate() {
                    cols[i].push(*n);
                }
                cols[5].push(r.tokens);
                cols[6].push(r.request_bytes);
                cols[7].push(r.response_bytes);
                cols[8].push(r.tokens_unread);
            }
            const SUMMED: [&str; 9] = [
                "requests_ok", "requests_4xx", "requests_5xx", "requests_denied", "requests_aborted", "tokens", "request_bytes",
                "response_bytes", "requests_tokens_unread",
            ];
            tx.execute(
                &format!(
                    "INSERT INTO usage_daily AS d (day, tenant, key_id, {})
                     SELECT u.day::date, u.tenant, u.key_id, u.ok, u.c4, u.c5, u.dn, u.ab, u.tk, u.rq, u.rs, u.tu
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::int8[], $7::int8[], $8::int8[],
                                 $9::int8[], $10::int8[], $11::int8[], $12::int8[]) AS u(day, tenant, key_id, ok, c4, c5, dn, ab, tk, rq, rs, tu)
                     ON CONFLICT (day, tenant, key_id) DO UPDATE SET {}",
                    SUMMED.join(", "),
                    crate::rollup::saturating_sums(&SUMMED)
                ),
                &[&d, &t, &k, &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5], &cols[6], &cols[7], &cols[8]],
            )
            .await?;
        }
        crate::models::store(&tx, &by_model).await?;
        if let Some(origin) = &self.export {
            let new_events = events.iter().filter(|e| inserted.contains(&e.id));
            crate::outbox::enqueue(&tx, origin, new_events, aggregates.iter().filter(|a| new_aggregates.contains(&a.id))).await?;
        }
        for (m, reason) in &rejects {
            insert_reject(&tx, topic, m, reason).await?;
        }
        tx.commit().await?;
        let requests = inserted.len() as u64
            + aggregates.iter().filter(|a| new_aggregates.contains(&a.id)).map(|a| a.count).sum::<u64>();
        let inserted = (inserted.len() + new_aggregates.len()) as u64;
        Ok(Stored {
            inserted,
            aggregates: new_aggregates.len() as u64,
            requests,
            duplicates: (batch.len() as u64).saturating_sub(inserted + rejects.len() as u64),
            rejected: rejects.len() as u64,
        })
    }

    /// Keeps one message PostgreSQL refused on its own in `usage_rejects`, with `reason`.
    pub async fn reject(&self, topic: &str, m: &Consumed, reason: &str) -> Result<(), tokio_postgres::Error> {
        insert_reject(&self.client, topic, m, reason).await
    }

    /// Deletes event and aggregate ids stored longer ago than `retention` (the rollup keeps their counts).
    /// By when they were *received*, not their day: a message can come again only within the
    /// topic's retention after it was produced, whatever the event's own timestamp says.
    pub async fn prune(&self, retention: Duration) -> Result<u64, tokio_postgres::Error> {
        let secs = retention.as_secs() as f64;
        let events = self
            .client
            .execute("DELETE FROM usage_events WHERE received_at < now() - make_interval(secs => $1::float8)", &[&secs])
            .await?;
        let aggregates = self
            .client
            .execute("DELETE FROM usage_aggregates WHERE received_at < now() - make_interval(secs => $1::float8)", &[&secs])
            .await?;
        Ok(events + aggregates)
    }

    /// The rollup of one tenant, per day (summed over keys), from `from` to `to` (`yyyy-MM-dd`,
    /// inclusive): `(day, [ok, 4xx, 5xx, denied, aborted], tokens, requests whose tokens were unread)`.
    /// The PostgreSQL client (crate::models reads its own table through it).
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    pub async fn daily(&self, tenant: &str, from: &str, to: &str) -> Result<Vec<(String, [i64; 5], i64, i64)>, tokio_postgres::Error> {
        // a database no consumer of decision 183 has migrated yet: none counted
        let unread = if self.has_column("usage_daily", "requests_tokens_unread").await? { "requests_tokens_unread" } else { "0" };
        let rows = self
            .client
            .query(
                // each key's day saturates at int8's bound (decision 167): so does their sum
                &format!("SELECT day::text, LEAST(sum(requests_ok), 9223372036854775807)::int8, LEAST(sum(requests_4xx), 9223372036854775807)::int8,
                        LEAST(sum(requests_5xx), 9223372036854775807)::int8, LEAST(sum(requests_denied), 9223372036854775807)::int8,
                        LEAST(sum(requests_aborted), 9223372036854775807)::int8, LEAST(sum(tokens), 9223372036854775807)::int8,
                        LEAST(sum({unread}), 9223372036854775807)::int8
                 FROM usage_daily WHERE tenant = $1 AND day BETWEEN $2::text::date AND $3::text::date
                 GROUP BY day ORDER BY day"),
                &[&tenant, &from, &to],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), [r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)], r.get(6), r.get(7)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_shared::aggregate::{UsageAggregate, SCHEMA as AGGREGATE_SCHEMA};
    use tollgate_wire::usage::UsageEvent;

    fn ev(id: &str, key: &str, status: u16, ms: u64, tokens: Option<u64>) -> UsageEvent {
        UsageEvent {
            id: id.into(),
            tenant: "acme".into(),
            key_id: key.into(),
            plan: "p".into(),
            method: "GET".into(),
            authority: "a".into(),
            path: "/".into(),
            status,
            start_ms: ms,
            duration_ms: 0,
            tokens,
            tokens_unread: false,
            request_bytes: Some(10),
            response_bytes: None,
            denied: None,
            route: None,
            product: None,
            llm: None,
        }
    }

    #[test]
    fn impossible_token_counts_never_wrap_negative() {
        let day = 1_764_460_800_000;
        let events = [ev("a", "k1", 200, day, Some(u64::MAX)), ev("b", "k1", 200, day, Some(u64::MAX)), ev("c", "k1", 200, day, Some(1))];
        let r = rollup(&events);
        let k1 = r[&("2025-11-30".into(), "acme".into(), "k1".into())];
        assert_eq!(k1.tokens, 2 * (1 << 53) + 1, "each clamped to 2^53");
        assert_eq!(tokens_i64(u64::MAX), 1 << 53);
        let many: Vec<UsageEvent> = (0..2_000).map(|i| ev(&format!("e{i}"), "k1", 200, day, Some(u64::MAX))).collect();
        assert_eq!(rollup(&many)[&("2025-11-30".into(), "acme".into(), "k1".into())].tokens, i64::MAX, "sums saturate");
    }

    #[test]
    fn rollup_rows_per_day_tenant_and_key() {
        let day = 1_764_460_800_000;
        let events = [ev("a", "k1", 200, day, Some(5)), ev("b", "k1", 500, day + 1, None), ev("c", "k2", 200, day - 1, Some(1))];
        let r = rollup(&events);
        let k1 = r[&("2025-11-30".into(), "acme".into(), "k1".into())];
        assert_eq!(k1.by_class, [1, 0, 1, 0, 0]);
        assert_eq!((k1.tokens, k1.request_bytes), (5, 20));
        assert_eq!(r[&("2025-11-29".into(), "acme".into(), "k2".into())].by_class[0], 1);
    }

    #[test]
    fn decoding_keeps_the_first_of_an_id_and_rejects_what_is_not_an_event() {
        let e = serde_json::to_vec(&ev("0123456789abcdef", "k", 200, 1, None)).unwrap();
        let batch = vec![
            Consumed { partition: 0, offset: 0, payload: e.clone(), schema: None },
            Consumed { partition: 0, offset: 1, payload: e, schema: Some("tollgate.usage.v2".into()) },
            Consumed { partition: 0, offset: 2, payload: b"garbage".to_vec(), schema: None },
        ];
        let d = decode(&batch);
        assert_eq!(d.events.len(), 1);
        assert_eq!(d.rejects.len(), 1);
        assert_eq!(d.rejects[0].0.offset, 2);
    }

    fn aggregate(events: &[UsageEvent]) -> UsageAggregate {
        let mut lines = Vec::new();
        for e in events {
            let mut l = Vec::new();
            tollgate_shared::aggregate::encode_line(&mut l, e, true);
            l.pop();
            lines.push(l);
        }
        match tollgate_shared::aggregate::plan_segment(&lines).messages.remove(0) {
            tollgate_shared::aggregate::Outgoing::Aggregate(a) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_aggregate_moves_the_rollup_as_its_events_would_one_by_one() {
        let day = 1_764_460_800_000;
        let mut events: Vec<UsageEvent> = (0..30)
            .map(|i| ev(&format!("e{i:07}"), ["k1", "k2"][i % 2], [200, 200, 404, 503][i % 4], day + 100, Some(i as u64)))
            .collect();
        events[7].denied = Some("rate_limited".into());
        events[9].status = 0;
        let a = aggregate(&events);
        let mut from_aggregate = std::collections::BTreeMap::new();
        rollup_aggregates(&mut from_aggregate, [&a]);
        assert_eq!(from_aggregate, rollup(&events));
        assert_eq!(a.count, 30);
    }

    /// Decision 189: two events of one key in one second, each with an upstream's clamped 2^53
    /// tokens, are billed in their aggregate as they would be alone (2^54). Before, the row's sum
    /// was held to one event's bound: the whole aggregate (every key of that tenant-second) was
    /// rejected, and its rollup clamped the sum to 2^53.
    #[test]
    fn an_aggregate_of_clamped_token_counts_is_billed_whole() {
        let max = tollgate_wire::usage::MAX_TOKENS;
        let day = 1_764_460_800_000;
        let events: Vec<UsageEvent> = (0..3).map(|i| ev(&format!("e{i:07}"), "k1", 200, day + 100, Some([max, max, 5][i]))).collect();
        let a = aggregate(&events);
        assert_eq!(a.invalid_reason(), None);
        let mut from_aggregate = std::collections::BTreeMap::new();
        rollup_aggregates(&mut from_aggregate, [&a]);
        assert_eq!(from_aggregate, rollup(&events));
        assert_eq!(from_aggregate.values().next().unwrap().tokens, 2 * max as i64 + 5);
    }

    #[test]
    fn aggregates_are_decoded_by_their_header_or_their_shape_and_checked() {
        let day = 1_764_460_800_000;
        let a = aggregate(&[ev("e0000001", "k1", 200, day, None), ev("e0000002", "k1", 200, day, None)]);
        let json = serde_json::to_vec(&a).unwrap();
        let mut bad = a.clone();
        bad.count = 3;
        let batch = vec![
            Consumed { partition: 0, offset: 0, payload: json.clone(), schema: Some(AGGREGATE_SCHEMA.into()) },
            Consumed { partition: 0, offset: 1, payload: json, schema: None },
            Consumed { partition: 0, offset: 2, payload: serde_json::to_vec(&bad).unwrap(), schema: Some(AGGREGATE_SCHEMA.into()) },
            Consumed { partition: 0, offset: 3, payload: serde_json::to_vec(&ev("e0000003", "k", 200, day, None)).unwrap(), schema: None },
        ];
        let d = decode(&batch);
        assert_eq!((d.aggregates.len(), d.events.len(), d.rejects.len()), (1, 1, 1), "the repeated aggregate counts once");
        assert_eq!(d.aggregates[0], a);
        assert!(d.rejects[0].1.contains("count"), "{}", d.rejects[0].1);
    }
}
