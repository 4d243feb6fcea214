//! The billing consumer against real servers (issue 6): tansu, PostgreSQL and Redis. Events
//! delivered more than once (re-sent, replayed) are counted once; a PostgreSQL outage and a
//! consumer crash lose nothing and count nothing twice; a wiped Redis meter leaves the monthly
//! quota read on the rollup.

use std::collections::BTreeMap;
use std::io::Read;
use std::time::Duration;
use tollgate_billing::report::{self, DayUsage};
use tollgate_tests::billing::{psql, psql_i64, Billing};
use tollgate_tests::broker::{create_topic, produce, Broker};
use tollgate_tests::postgres::Postgres;
use tollgate_tests::{poll_until, Redis};
use tollgate_wire::usage::UsageEvent;

#[path = "billing/export.rs"]
mod export;

const DAY: u64 = 1_764_460_800_000; // 2025-11-30T00:00:00Z

fn event(tenant: &str, n: u64) -> UsageEvent {
    UsageEvent {
        id: format!("{tenant}-{n:06}-abcdef"),
        tenant: tenant.into(),
        key_id: format!("key_{}", n % 2),
        plan: "gold".into(),
        method: "POST".into(),
        authority: "api.test".into(),
        path: "/v1/chat".into(),
        status: match n % 10 {
            0 => 404,
            1 => 503,
            _ => 200,
        },
        start_ms: DAY + n * 1000,
        duration_ms: 2,
        tokens: Some(10),
        tokens_unread: false,
        request_bytes: Some(50),
        response_bytes: Some(70),
        denied: None,
        route: None,
        product: None,
        llm: None,
    }
}

fn messages(events: &[UsageEvent]) -> Vec<(String, Vec<u8>)> {
    events.iter().map(|e| (e.tenant.clone(), serde_json::to_vec(e).unwrap())).collect()
}

/// (requests, ok, 4xx, 5xx, tokens) summed over the rollup for one tenant.
fn totals(pg: &Postgres, tenant: &str) -> Option<(i64, i64, i64, i64, i64)> {
    let rows = psql(
        pg,
        &format!(
            "SELECT coalesce(sum(requests_ok+requests_4xx+requests_5xx+requests_denied+requests_aborted),0), \
             coalesce(sum(requests_ok),0), coalesce(sum(requests_4xx),0), coalesce(sum(requests_5xx),0), coalesce(sum(tokens),0) \
             FROM usage_daily WHERE tenant = '{tenant}'"
        ),
    )?;
    let v: Vec<i64> = rows.first()?.split('|').map(|x| x.parse().unwrap_or(-1)).collect();
    Some((v[0], v[1], v[2], v[3], v[4]))
}

#[test]
fn each_event_is_counted_once_through_duplicates_outages_and_crashes() {
    let (broker, mut pg) = (Broker::start(), Postgres::start());
    create_topic(&broker.brokers(), "usage_events", 4);
    let first: Vec<UsageEvent> = (0..100).map(|n| event(if n % 3 == 0 { "beta" } else { "acme" }, n)).collect();
    let mut msgs = messages(&first);
    // the gateway delivered some of them twice (a retried batch, a re-shipped segment) …
    msgs.extend(messages(&first[..30]));
    // … and something that is not an event landed on the topic
    msgs.push(("acme".into(), b"not an event".to_vec()));
    produce(&broker.brokers(), "usage_events", &msgs);
    let mut billing = Billing::start(&broker.brokers(), "usage_events", "billing-a", &pg, &[]);
    let acme = first.iter().filter(|e| e.tenant == "acme").count() as i64;
    let beta = 100 - acme;
    poll_until("the rollup to count every event once", Duration::from_secs(60), || {
        totals(&pg, "acme").map(|t| t.0) == Some(acme) && totals(&pg, "beta").map(|t| t.0) == Some(beta)
    });
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_events"), 100);
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_rejects"), 1, "kept, not dropped");
    let (_, ok, c4, c5, tokens) = totals(&pg, "acme").unwrap();
    let count = |f: &dyn Fn(&UsageEvent) -> bool| first.iter().filter(|e| e.tenant == "acme" && f(e)).count() as i64;
    assert_eq!((ok, c4, c5), (count(&|e| e.status == 200), count(&|e| e.status == 404), count(&|e| e.status == 503)));
    assert_eq!(tokens, acme * 10);

    // PostgreSQL goes away while events keep coming: the batch waits, offsets stay uncommitted
    pg.stop();
    let second: Vec<UsageEvent> = (100..150).map(|n| event("acme", n)).collect();
    produce(&broker.brokers(), "usage_events", &messages(&second));
    poll_until("the consumer to notice", Duration::from_secs(30), || billing.log_text().contains("postgres cannot take the batch"));
    pg.start_again();
    poll_until("the batch to be stored after the outage", Duration::from_secs(60), || {
        totals(&pg, "acme").map(|t| t.0) == Some(acme + 50)
    });

    // the consumer crashes; a replay of everything (e.g. a reprocessing run) changes nothing
    billing.kill();
    produce(&broker.brokers(), "usage_events", &messages(&first));
    produce(&broker.brokers(), "usage_events", &messages(&second));
    let marker = vec![event("marker", 1)];
    produce(&broker.brokers(), "usage_events", &messages(&marker));
    let _billing = Billing::start(&broker.brokers(), "usage_events", "billing-a", &pg, &[]);
    poll_until("the consumer to be past the replay", Duration::from_secs(60), || totals(&pg, "marker").map(|t| t.0) == Some(1));
    assert_eq!(totals(&pg, "acme").unwrap().0, acme + 50);
    assert_eq!(totals(&pg, "beta").unwrap().0, beta);
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_events"), 151);
}

/// Decision 167: a message PostgreSQL will never take stops nothing. Before, one such message
/// failed its whole batch at every retry, and billing stopped for every partition of the batch
/// (until the topic's retention deleted the events unread): a payload with a NUL byte (kept as a
/// reject, which `text` refused), an event with a NUL in its path, a time past PostgreSQL's
/// `date`, an aggregate with a NUL in a key id. Each is now kept in `usage_rejects`, and a value
/// PostgreSQL refuses that no check foresaw (here a trigger raising a data exception) sets only
/// its own message aside.
#[test]
fn a_message_postgres_will_not_take_never_stops_billing() {
    use tollgate_shared::aggregate::{ClassCounts, KeyUsage, UsageAggregate};
    let (broker, pg) = (Broker::start(), Postgres::start());
    create_topic(&broker.brokers(), "usage_p", 2);
    let _billing = Billing::start(&broker.brokers(), "usage_p", "billing-p", &pg, &[]);
    poll_until("the schema", Duration::from_secs(60), || {
        psql(&pg, "SELECT to_regclass('usage_events') IS NOT NULL").is_some_and(|r| r == ["t"])
    });
    let trigger = "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                   IF NEW.tenant = 'refused' THEN RAISE EXCEPTION 'not this one' USING ERRCODE = '22023'; END IF; RETURN NEW; END $$; \
                   CREATE TRIGGER refuse BEFORE INSERT ON usage_events FOR EACH ROW EXECUTE FUNCTION refuse();";
    assert!(psql(&pg, trigger).is_some(), "the trigger");

    let good: Vec<UsageEvent> = (0..10).map(|n| event("acme", n)).collect();
    let mut msgs = messages(&good[..5]);
    msgs.push(("acme".into(), b"\x00\x00not an event".to_vec()));
    let mut nul_path = event("acme", 100);
    nul_path.path = "/v1/\u{0}chat".into();
    let mut far = event("acme", 101);
    far.start_ms = u64::MAX;
    let refused = event("refused", 102);
    msgs.extend(messages(&[nul_path, far, refused]));
    let requests = ClassCounts { ok: 1, ..ClassCounts::default() };
    let key = KeyUsage { key_id: "key_\u{0}".into(), plan: "gold".into(), count: 1, requests, tokens: 0, tokens_unread: 0, request_bytes: 0, response_bytes: 0 };
    let aggregate = UsageAggregate { id: format!("agg_{}", "ab".repeat(16)), tenant: "acme".into(), second_ms: DAY, count: 1, keys: vec![key] };
    msgs.push(("acme".into(), serde_json::to_vec(&aggregate).unwrap()));
    msgs.extend(messages(&good[5..]));
    produce(&broker.brokers(), "usage_p", &msgs);

    poll_until("every good event counted, every other kept", Duration::from_secs(60), || {
        totals(&pg, "acme").map(|t| t.0) == Some(10) && psql_i64(&pg, "SELECT count(*) FROM usage_rejects") == 5
    });
    let reasons = psql(&pg, "SELECT reason FROM usage_rejects ORDER BY reason").unwrap_or_default();
    assert!(reasons.iter().any(|r| r.contains("postgres refused it") && r.contains("not this one")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("invalid event: path")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("invalid event: startMs")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("invalid aggregate: keys")), "{reasons:?}");
    assert_eq!(totals(&pg, "refused"), Some((0, 0, 0, 0, 0)));
}

/// Decision 167's other side: when PostgreSQL refuses every message of a batch on its own, the
/// cause is not in the messages (here a trigger refusing every row, as a wrong database
/// encoding or schema would): the batch waits as in an outage, nothing goes to `usage_rejects`,
/// and it is stored once the cause is gone.
#[test]
fn a_refusal_of_every_message_waits_like_an_outage() {
    let (broker, pg) = (Broker::start(), Postgres::start());
    create_topic(&broker.brokers(), "usage_r", 1);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async { tollgate_billing::db::Db::connect(&pg.url()).await.unwrap().migrate().await.unwrap() });
    let refuse = |tenant: &str| {
        format!(
            "CREATE OR REPLACE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             IF NEW.tenant LIKE '{tenant}' THEN RAISE EXCEPTION 'not now' USING ERRCODE = '22023'; END IF; RETURN NEW; END $$;"
        )
    };
    assert!(psql(&pg, &refuse("%")).is_some());
    assert!(psql(&pg, "CREATE TRIGGER refuse BEFORE INSERT ON usage_events FOR EACH ROW EXECUTE FUNCTION refuse();").is_some());
    let events: Vec<UsageEvent> = (0..3).map(|n| event("acme", n)).collect();
    produce(&broker.brokers(), "usage_r", &messages(&events));
    let billing = Billing::start(&broker.brokers(), "usage_r", "billing-r", &pg, &[]);
    poll_until("the batch refused message by message", Duration::from_secs(60), || billing.log_text().contains("storing its messages one by one"));
    poll_until("the consumer to retry it", Duration::from_secs(60), || billing.log_text().contains("postgres cannot take the batch"));
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_rejects"), 0, "nothing set aside");
    assert!(psql(&pg, &refuse("nobody")).is_some());
    poll_until("the batch stored once the cause is gone", Duration::from_secs(60), || totals(&pg, "acme").map(|t| t.0) == Some(3));
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_rejects"), 0);
}

#[test]
fn the_monthly_quota_reads_the_larger_of_meter_and_rollup_and_survives_a_wiped_redis() {
    let (broker, pg, redis) = (Broker::start(), Postgres::start(), Redis::start());
    create_topic(&broker.brokers(), "usage_q", 2);
    // 20 requests on 2025-11-30 and 10 on 2025-11-29
    let mut events: Vec<UsageEvent> = (2..22).map(|n| event("acme", n)).collect();
    for n in 0..10 {
        let mut e = event("acme", 1000 + n);
        e.start_ms = DAY - 3_600_000;
        e.status = 200;
        events.push(e);
    }
    produce(&broker.brokers(), "usage_q", &messages(&events));
    let _billing = Billing::start(&broker.brokers(), "usage_q", "billing-q", &pg, &[]);
    poll_until("the rollup", Duration::from_secs(60), || totals(&pg, "acme").map(|t| t.0) == Some(30));

    // the gateway's meter is ahead for today (requests not yet through Kafka)
    let mut c = redis.connection().unwrap();
    let _: () = redis::cmd("HSET").arg("usage:{acme}:20251130").arg("ok").arg(40).arg("4xx").arg(2).query(&mut c).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let month = |with_redis: bool| -> DayUsage {
        rt.block_on(async {
            let db = tollgate_billing::db::Db::connect(&pg.url()).await.unwrap();
            let mut conn = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
            let (from, to) = report::month_days("2025-11").unwrap();
            let days: BTreeMap<String, DayUsage> =
                report::usage(&db, with_redis.then_some(&mut conn), "acme", &from, &to).await.unwrap();
            report::month_total(&days)
        })
    };
    let rollup_only = month(false);
    // today from the rollup: 16 ok + 2×404 (the 503s, 2 of 20, are not billable); yesterday: 10 ok
    assert_eq!(rollup_only.billable(), 28);
    // with the meter: today = max(rollup 16 ok / 2 4xx, meter 40 ok / 2 4xx); yesterday has no meter key
    assert_eq!(month(true).billable(), 40 + 2 + 10);
    // Redis wiped (or the keys evicted): the quota read falls back to the rollup, not to zero
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    assert_eq!(month(true).billable(), 28);
    // the CLI view says the same
    let out = _billing.cli(&["usage", "--tenant", "acme", "--month", "2025-11", "--redis", &redis.url()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("2025-11-29") && text.contains("2025-11-30"), "{text}");
    assert!(text.contains("billable requests (ok + 4xx): 28"), "{text}");
}

/// Decision 183: requests whose token usage the gateway could not read are counted apart, from
/// events and from aggregates alike, on a database made before the count existed (the consumer
/// adds its columns), and the usage report says how many there were. Before, they were summed
/// as 0 tokens with nothing to tell them apart.
#[test]
fn requests_whose_token_usage_was_unread_are_counted_apart() {
    use tollgate_shared::aggregate::{ClassCounts, KeyUsage, UsageAggregate};
    let (broker, pg) = (Broker::start(), Postgres::start());
    create_topic(&broker.brokers(), "usage_u", 1);
    // the schema as an older consumer made it (the added columns come on top of it)
    assert!(psql(&pg, tollgate_billing::db::SCHEMA).is_some(), "the old schema");
    // the usage report before any new consumer migrated: it reads, counting none unread
    let report = std::process::Command::new(tollgate_tests::billing::billing_bin())
        .args(["usage", "--tenant", "acme", "--month", "2025-11"])
        .env("TOLLGATE_BILLING_POSTGRES__URL", pg.url())
        .env("TOLLGATE_BILLING_KAFKA__BROKERS", broker.brokers())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(report.status.success() && text.contains("TOTAL"), "{text}{}", String::from_utf8_lossy(&report.stderr));
    assert!(!text.contains("could not be read"), "{text}");
    let mut events: Vec<UsageEvent> = (0..3).map(|n| event("acme", n + 2)).collect();
    events[1].tokens = None;
    events[1].tokens_unread = true;
    let mut msgs = messages(&events);
    let requests = ClassCounts { ok: 3, ..ClassCounts::default() };
    let key = KeyUsage { key_id: "key_1".into(), plan: "gold".into(), count: 3, requests, tokens: 20, tokens_unread: 2, request_bytes: 0, response_bytes: 0 };
    let aggregate = UsageAggregate { id: format!("agg_{}", "cd".repeat(16)), tenant: "acme".into(), second_ms: DAY, count: 3, keys: vec![key] };
    msgs.push(("acme".into(), serde_json::to_vec(&aggregate).unwrap()));
    produce(&broker.brokers(), "usage_u", &msgs);
    let billing = Billing::start(&broker.brokers(), "usage_u", "billing-u", &pg, &[]);
    poll_until("the rollup", Duration::from_secs(60), || totals(&pg, "acme").map(|t| t.0) == Some(6));
    assert_eq!(totals(&pg, "acme").unwrap().4, 10 + 10 + 20, "unread ones add no tokens");
    assert_eq!(psql_i64(&pg, "SELECT sum(requests_tokens_unread) FROM usage_daily WHERE tenant = 'acme'"), 3);
    assert_eq!(psql_i64(&pg, "SELECT count(*) FROM usage_events WHERE tokens_unread"), 1);
    let out = billing.cli(&["usage", "--tenant", "acme", "--month", "2025-11"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("requests whose token usage could not be read (not in TOKENS): 3"), "{text}");
}

/// Decision 196: the consumer refuses to start on a database that is not UTF8, saying why.
/// Before, it started, and a batch whose every event carried a host a LATIN1 database cannot
/// hold (a client chooses it: `例.jp`) was refused as a whole and waited as an outage forever.
#[test]
fn a_database_that_is_not_utf8_is_refused_at_the_start() {
    let pg = Postgres::start();
    assert!(psql(&pg, "CREATE DATABASE latin ENCODING 'LATIN1' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'").is_some());
    let url = format!("{}/latin", pg.url().rsplit_once('/').unwrap().0);
    /// Killed when the test ends, however it ends (a consumer that started runs until then).
    struct Running(std::process::Child);
    impl Drop for Running {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut consumer = Running(
        std::process::Command::new(tollgate_tests::billing::billing_bin())
            .env("TOLLGATE_BILLING_POSTGRES__URL", &url)
            .env("TOLLGATE_BILLING_KAFKA__BROKERS", "127.0.0.1:9")
            .env("TOLLGATE_BILLING_LOG__FORMAT", "text")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut status = None;
    poll_until("the consumer to exit", Duration::from_secs(30), || {
        status = consumer.0.try_wait().unwrap();
        status.is_some()
    });
    let mut text = String::new();
    for pipe in [consumer.0.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read>), consumer.0.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read>)].into_iter().flatten() {
        let mut p = pipe;
        p.read_to_string(&mut text).unwrap();
    }
    assert!(!status.unwrap().success(), "started on a LATIN1 database: {text}");
    assert!(text.contains("needs a UTF8 database") && text.contains("LATIN1"), "{text}");
}
