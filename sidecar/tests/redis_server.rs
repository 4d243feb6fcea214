//! Sidecar integration tests against a real redis-server (started per test on a free port):
//! the key store, the decision endpoint served in-process, and behaviour across a Redis outage.

use std::time::{Duration, Instant};
use tollgate_sidecar::apikey::{self, KeyStatus};
use tollgate_sidecar::config::Config;
use tollgate_sidecar::keys::Id;
use tollgate_sidecar::store::{Store, StoreError};
use tollgate_sidecar::Sidecar;
use tollgate_tests::redis::command_calls;
use tollgate_tests::{get, poll_until, Redis, Resp};
use tollgate_wire::{DecideRequest, DecideResponse};

fn config(redis: &Redis) -> Config {
    let mut c = Config { listen: "127.0.0.1:0".parse().unwrap(), ..Config::default() };
    c.server.secret = tollgate_sidecar::secret::Secret::new(SECRET);
    c.redis.url = redis.url();
    c.redis.timeout = Duration::from_millis(300);
    c
}

/// The filter secret of these tests' sidecars.
const SECRET: &str = "redis-tests-filter-secret";

fn id(s: &str) -> Id {
    Id::parse(s).unwrap()
}

struct Running {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn start(config: &Config) -> Running {
        let sidecar = Sidecar::bind(config).await.unwrap();
        let base = format!("http://{}", sidecar.local_addr());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            sidecar
                .serve(async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        Running { base, stop: Some(tx), task }
    }

    async fn decide(&self, key_hash: &str) -> Resp {
        let body = serde_json::to_string(&DecideRequest::new(key_hash, "GET", "api", "/")).unwrap();
        self.post("/v1/decide", body).await
    }

    async fn post(&self, path: &str, body: String) -> Resp {
        let url = format!("{}{}", self.base, path);
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
            let mut r = agent.post(&url).header("content-type", "application/json").header(tollgate_wire::SECRET_HEADER, SECRET).send(body).unwrap();
            Resp { status: r.status().as_u16(), headers: vec![], body: r.body_mut().read_to_string().unwrap() }
        })
        .await
        .unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task).await.expect("drains").unwrap();
    }
}

fn verdict(r: &Resp) -> DecideResponse {
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// Every key is listed however many there are (decision 182): 30,000 keys among other keys
/// come back whole, from `SCAN` steps of 1,000 names (the listing was one `SCAN` of 10-name
/// steps under one 5 s deadline, ~6,000 round trips here, and failed at a few million keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_is_listed_in_steps_however_many_there_are() {
    const KEYS: usize = 30_000;
    let redis = Redis::start();
    let store = Store::new(&config(&redis).redis).unwrap();
    let mut conn = redis.connection().expect("a connection");
    let mut pipe = redis::pipe();
    for n in 0..KEYS {
        let key = apikey::issue(id(&format!("t{}", n % 7)), id("free"), 1_000 + n as u64, None);
        let rec: Vec<(String, String)> = key.record.to_fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        pipe.hset_multiple(format!("apikey:{}", key.hash.as_str()), &rec).ignore();
        pipe.set(format!("apikey-id:{}", key.record.key_id), key.hash.as_str()).ignore();
        pipe.sadd(format!("apikey-index:{}", key.record.tenant), key.record.key_id.as_str()).ignore();
        // other families in the same keyspace, which the scan steps over
        pipe.set(format!("rl:other:{n}"), 1).ignore();
        if n % 5_000 == 4_999 {
            pipe.query::<()>(&mut conn).unwrap();
            pipe = redis::pipe();
        }
    }
    let scans_before = command_calls(&redis.commandstats(), "scan");
    let listed = store.list_keys(None).await.unwrap();
    assert_eq!(listed.len(), KEYS);
    assert!(listed.windows(2).all(|w| w[0].created_at <= w[1].created_at), "sorted by creation");
    let ids: std::collections::BTreeSet<_> = listed.iter().map(|r| r.key_id.clone()).collect();
    assert_eq!(ids.len(), KEYS, "each once");
    let scans = command_calls(&redis.commandstats(), "scan") - scans_before;
    // 3 names per key in the keyspace, in a hash table of at most twice as many slots, 1,000
    // slots looked at per step
    assert!(scans <= (2 * 3 * KEYS / 1_000 + 10) as u64, "{scans} SCAN steps");
    // a tenant's keys, from its index
    assert_eq!(store.list_keys(Some(&id("t3"))).await.unwrap().len(), (KEYS + 7 - 1 - 3) / 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_store_round_trip_and_store_of_record_keys_have_no_ttl() {
    let redis = Redis::start();
    let store = Store::new(&config(&redis).redis).unwrap();
    let a = apikey::issue(id("acme"), id("gold"), 1_000, None);
    let b = apikey::issue(id("acme"), id("free"), 2_000, Some(9_999_999_999));
    let c = apikey::issue(id("other"), id("free"), 3_000, None);
    for k in [&a, &b, &c] {
        store.create_key(&k.hash, &k.record).await.unwrap();
    }
    assert_eq!(store.lookup(&a.hash).await.unwrap(), Some(a.record.clone()));
    assert_eq!(store.lookup(&apikey::hash_raw_key("nope")).await.unwrap(), None);

    let acme = store.list_keys(Some(&id("acme"))).await.unwrap();
    assert_eq!(acme.iter().map(|r| r.key_id.clone()).collect::<Vec<_>>(), vec![a.record.key_id.clone(), b.record.key_id.clone()]);
    assert_eq!(store.list_keys(None).await.unwrap().len(), 3);

    let revoked = store.revoke_key(&a.record.key_id, 5_000).await.unwrap();
    assert_eq!(revoked.status, KeyStatus::Revoked);
    assert_eq!(revoked.revoked_at, Some(5_000));
    assert!(matches!(store.revoke_key(&id("key_missing"), 1).await, Err(StoreError::NotFound(_))));

    // Store-of-record families carry no TTL (seed 004); the raw keys are nowhere.
    let mut conn = redis.connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 3 + 3 + 2, "{keys:?}");
    for k in &keys {
        let ttl: i64 = redis::cmd("TTL").arg(k).query(&mut conn).unwrap();
        assert_eq!(ttl, -1, "{k} has a TTL");
    }
    redis.assert_no_raw_keys(&[&a.raw, &b.raw, &c.raw]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_failure_audit_is_claimed_once_per_hour() {
    let redis = Redis::start();
    let store = Store::new(&config(&redis).redis).unwrap();
    assert!(store.claim_auth_failure_audit(&id("key_a")).await.unwrap());
    assert!(!store.claim_auth_failure_audit(&id("key_a")).await.unwrap());
    assert!(store.claim_auth_failure_audit(&id("key_b")).await.unwrap());
    let mut conn = redis.connection().unwrap();
    let ttl: i64 = redis::cmd("TTL").arg("apikey:authfail:key_a").query(&mut conn).unwrap();
    assert!((3590..=3600).contains(&ttl), "{ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decide_endpoint_answers_allow_deny_and_bad_requests() {
    let redis = Redis::start();
    let cfg = config(&redis);
    let store = Store::new(&cfg.redis).unwrap();
    let active = apikey::issue(id("acme"), id("gold"), 1, None);
    let expired = apikey::issue(id("acme"), id("gold"), 1, Some(2));
    store.create_key(&active.hash, &active.record).await.unwrap();
    store.create_key(&expired.hash, &expired.record).await.unwrap();
    let sc = Running::start(&cfg).await;

    match verdict(&sc.decide(active.hash.as_str()).await) {
        DecideResponse::Allow { tenant, key_id, plan, cache_for_ms, .. } => {
            assert_eq!((tenant.as_str(), plan.as_str()), ("acme", "gold"));
            // The filter may reuse a fresh answer for at most what is left of our cache TTL.
            let ms = cache_for_ms.expect("a fresh allow is cacheable");
            assert!(ms > 0 && ms <= cfg.cache.ttl.as_millis() as u64, "{ms}");
            assert_eq!(key_id, active.record.key_id.to_string());
        }
        other => panic!("{other:?}"),
    }
    let code = |v: DecideResponse| match v {
        DecideResponse::Deny { status, error, .. } => (status, error),
        other => panic!("{other:?}"),
    };
    assert_eq!(code(verdict(&sc.decide(expired.hash.as_str()).await)), (401, "expired_key".into()));
    assert_eq!(code(verdict(&sc.decide(apikey::hash_raw_key("x").as_str()).await)), (401, "unknown_key".into()));

    let r = sc.decide("not-a-hash").await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("keyHash"), "{}", r.body);
    let r = sc.post("/v1/decide", "{".into()).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("bad_request"));

    let base = sc.base.clone();
    let metrics = tokio::task::spawn_blocking(move || get(&format!("{base}/metrics"), &[]).body).await.unwrap();
    assert!(metrics.contains("tollgate_sidecar_redis_seconds_bucket"), "{metrics}");
    assert!(metrics.contains(r#"reason="expired_key""#), "{metrics}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_serves_cached_answers_fails_fast_otherwise_and_recovers() {
    let mut redis = Redis::start();
    let mut cfg = config(&redis);
    cfg.cache.ttl = Duration::from_millis(1); // every request goes to Redis unless it is down
    cfg.redis.timeout = Duration::from_millis(100);
    let store = Store::new(&cfg.redis).unwrap();
    let key = apikey::issue(id("acme"), id("gold"), 1, None);
    store.create_key(&key.hash, &key.record).await.unwrap();
    let sc = Running::start(&cfg).await;
    assert!(matches!(verdict(&sc.decide(key.hash.as_str()).await), DecideResponse::Allow { .. }));

    redis.kill();
    // Seen before: served stale from the cache, and not offered for reuse by the filter.
    assert!(matches!(verdict(&sc.decide(key.hash.as_str()).await), DecideResponse::Allow { cache_for_ms: None, .. }));
    // Never seen: 503 "store_unavailable", well before any client would give up.
    for _ in 0..5 {
        let started = Instant::now();
        let r = sc.decide(apikey::hash_raw_key("new").as_str()).await;
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(r.body.contains("store_unavailable"));
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    }

    // Redis comes back (empty: no persistence in tests): the sidecar reconnects by itself and the
    // key is now unknown, which proves the answer came from Redis again.
    redis.restart();
    tokio::task::block_in_place(|| poll_until("the sidecar to reach Redis again", Duration::from_secs(10), || {
        let h = key.hash.as_str().to_string();
        let base = sc.base.clone();
        let body = serde_json::json!({"keyHash": h, "method": "GET", "authority": "a", "path": "/"}).to_string();
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut r = agent.post(&format!("{base}/v1/decide")).header(tollgate_wire::SECRET_HEADER, SECRET).send(body).unwrap();
        r.body_mut().read_to_string().unwrap().contains("unknown_key")
    }));
    sc.stop().await;
}

/// An error reply to a key lookup is Redis speaking of itself (`LOADING` while a restarted Redis
/// reads its data, `BUSY`, `MASTERDOWN`; here `NOPERM`, which a test can cause on demand), not of
/// the key: a valid key is served from the stale grace or gets the failure mode's 503, never
/// 401 `unknown_key`. A record Redis holds in another type is unreadable: unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_reply_to_a_key_lookup_never_calls_a_valid_key_unknown() {
    let redis = Redis::start();
    let mut cfg = config(&redis);
    cfg.cache.ttl = Duration::from_millis(1); // every request goes to Redis
    let store = Store::new(&cfg.redis).unwrap();
    let key = apikey::issue(id("acme"), id("gold"), 1, None);
    store.create_key(&key.hash, &key.record).await.unwrap();
    let mut conn = redis.connection().unwrap();
    let garbled = apikey::hash_raw_key("garbled");
    let _: () = redis::cmd("SET").arg(format!("apikey:{}", garbled.as_str())).arg("not a hash").query(&mut conn).unwrap();
    let sc = Running::start(&cfg).await;
    assert!(matches!(verdict(&sc.decide(key.hash.as_str()).await), DecideResponse::Allow { .. }));
    let unknown = |v: DecideResponse| matches!(v, DecideResponse::Deny { status: 401, ref error, .. } if error == "unknown_key");
    assert!(unknown(verdict(&sc.decide(garbled.as_str()).await)), "a record of another type (WRONGTYPE) is unreadable: unknown");

    let _: () = redis::cmd("ACL").arg("SETUSER").arg("default").arg("-hgetall").query(&mut conn).unwrap();
    // seen before: the stale grace, not offered for reuse by the filter
    assert!(matches!(verdict(&sc.decide(key.hash.as_str()).await), DecideResponse::Allow { cache_for_ms: None, .. }));
    // never seen: Redis could not say, so 503 and the filter's failure mode
    let r = sc.decide(apikey::hash_raw_key("never seen").as_str()).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("store_unavailable"), "{}", r.body);

    // Redis answers again: the key is read from it, an unknown one is unknown
    let _: () = redis::cmd("ACL").arg("SETUSER").arg("default").arg("+hgetall").query(&mut conn).unwrap();
    assert!(matches!(verdict(&sc.decide(key.hash.as_str()).await), DecideResponse::Allow { .. }));
    assert!(unknown(verdict(&sc.decide(apikey::hash_raw_key("never seen").as_str()).await)));
    sc.stop().await;
}

/// Breaker hints are listed through their index (`cb:hints`), never by SCAN: SCAN walks the whole
/// keyspace whatever its pattern, and every Envoy's poller lists a few times a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_hints_are_listed_from_their_index_without_scanning_the_keyspace() {
    use tollgate_wire::breaker::HintList;
    let redis = Redis::start();
    let mut conn = redis.connection().unwrap();
    // a keyspace like a busy gateway's: many keys that are not hints
    let mut pipe = redis::pipe();
    for i in 0..5_000 {
        pipe.set(format!("q:reserved:{{t}}:{i}"), 1).ignore();
    }
    let _: () = pipe.query(&mut conn).unwrap();
    let replica = |name: &str| {
        let mut c = config(&redis);
        c.breaker.replica = name.into();
        c.breaker.hint_ttl = Duration::from_secs(1);
        c
    };
    let (a, b) = (Running::start(&replica("a")).await, Running::start(&replica("b")).await);
    let list = |r: &Running| {
        let url = format!("{}/v1/breaker/hints", r.base);
        async move {
            let resp = tokio::task::spawn_blocking(move || get(&url, &[(tollgate_wire::SECRET_HEADER, SECRET)])).await.unwrap();
            assert_eq!(resp.status, 200, "{}", resp.body);
            serde_json::from_str::<HintList>(&resp.body).unwrap().hints
        }
    };
    let scans = |conn: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
        command_calls(&info, "scan")
    };
    let r = a.post("/v1/breaker/hints", r#"{"provider":"openai","model":"gpt-4o","openedAtMs":1234}"#.into()).await;
    assert_eq!(r.status, 204, "{}", r.body);
    // a bad report is a 400 whose body is JSON, whatever the parser's message quotes
    let r = a.post("/v1/breaker/hints", r#"{"provider":"openai","model":"gpt-4o","openedAtMs":"soon"}"#.into()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.body));
    assert_eq!(v["error"], "bad_request");
    let before = scans(&mut conn);
    let seen = list(&b).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!((seen[0].provider.as_str(), seen[0].model.as_str(), seen[0].replica.as_str(), seen[0].opened_at_ms), ("openai", "gpt-4o", "a", 1234));
    assert!(list(&a).await.is_empty(), "a replica's own hints are left out");
    assert_eq!(scans(&mut conn), before, "listing hints must not SCAN");
    let members: Vec<String> = redis::cmd("ZRANGE").arg("cb:hints").arg(0).arg(-1).query(&mut conn).unwrap();
    assert_eq!(members, vec!["cb:hint:openai:gpt-4o".to_string()]);
    // the hint's own TTL stays the authority: once it expired, nothing is listed
    poll_until("the hint to expire", Duration::from_secs(10), || {
        let n: u64 = redis::cmd("EXISTS").arg("cb:hint:openai:gpt-4o").query(&mut conn).unwrap();
        n == 0
    });
    assert!(list(&b).await.is_empty());
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_is_failed_fast_and_probed_until_it_answers() {
    let redis = Redis::start();
    let mut cfg = config(&redis);
    cfg.redis.timeout = Duration::from_millis(100);
    cfg.redis.fail_fast = Duration::from_millis(100);
    let store = Store::new(&cfg.redis).unwrap();
    let issued = apikey::issue(id("acme"), id("gold"), 1, None);
    store.create_key(&issued.hash, &issued.record).await.unwrap();
    assert!(store.lookup(&issued.hash).await.unwrap().is_some());

    redis.pause();
    // the first command waits its deadline and gets no reply: Redis is taken as unresponsive
    // (our deadline, or the connection's response timeout of the same length: either is a timeout)
    match store.lookup(&issued.hash).await {
        Err(e) => assert!(e.is_transient() && !e.to_string().contains("failing fast"), "{e}"),
        Ok(r) => panic!("a stopped Redis answered: {r:?}"),
    }
    assert!(store.is_failing_fast() && !store.is_up());
    // the next ones do not wait on it: refused before anything is sent
    for _ in 0..3 {
        match store.lookup(&issued.hash).await {
            Err(e @ StoreError::Unreachable(_)) => assert!(e.is_transient() && e.to_string().contains("failing fast"), "{e}"),
            other => panic!("expected a fail-fast refusal, got {other:?}"),
        }
    }
    // still failing fast while the probes get no answer
    assert!(store.is_failing_fast());

    redis.resume();
    let probe = store.clone();
    tokio::task::spawn_blocking(move || poll_until("the probe to see Redis answer", Duration::from_secs(10), || !probe.is_failing_fast()))
        .await
        .unwrap();
    assert!(store.is_up());
    assert!(store.lookup(&issued.hash).await.unwrap().is_some());
}

/// An off-path command (here a refund's record read: 2 s) waits its own deadline, not the
/// request path's `redis.timeout`: in single mode it has a connection of its own (decision 141).
/// Before, the connection's response timeout (`redis.timeout`) cut every command at 50 ms here,
/// and that timeout, with no other reply meanwhile, made the sidecar fail fast on everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_off_path_command_waits_its_own_deadline_not_the_request_paths() {
    let redis = Redis::start();
    let mut cfg = config(&redis);
    cfg.redis.timeout = Duration::from_millis(50);
    cfg.redis.decision_timeout = Duration::from_millis(50);
    let store = Store::new(&cfg.redis).unwrap();
    let issued = apikey::issue(id("acme"), id("gold"), 1, None);
    store.create_key(&issued.hash, &issued.record).await.unwrap();
    let decision = id("0123456789abcdef0123456789abcdef");
    let refunded = tollgate_sidecar::scripts::refund::run(&store, &id("acme"), &decision, 1).await;
    assert!(matches!(refunded, Ok(tollgate_sidecar::scripts::refund::Refunded::Nothing)), "{refunded:?}");

    redis.pause();
    let slow = store.clone();
    let refund = tokio::spawn(async move { tollgate_sidecar::scripts::refund::run(&slow, &id("acme"), &decision, 1).await });
    // Redis hung for 300 ms, six request-path deadlines: the fault under test, not a wait
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    let refunded = refund.await.unwrap();
    assert!(matches!(refunded, Ok(tollgate_sidecar::scripts::refund::Refunded::Nothing)), "answered within its 2 s: {refunded:?}");
    assert!(!store.is_failing_fast(), "a slow off-path command is not an unresponsive Redis");
    assert!(store.lookup(&issued.hash).await.unwrap().is_some(), "the request path answers");
}

/// A command's deadline covers waiting for its connection (decision 144): with no connection yet
/// and a Redis that accepts but does not answer (SIGSTOPped: the kernel completes the handshake,
/// the connection's setup is never answered), a request-path command fails at its 50 ms, not
/// after `redis.connect_timeout` (5 s here). The attempt goes on without it and, once Redis
/// answers, serves the next commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commands_deadline_covers_waiting_for_its_connection() {
    let redis = Redis::start();
    let mut cfg = config(&redis);
    cfg.redis.timeout = Duration::from_millis(50);
    cfg.redis.decision_timeout = Duration::from_millis(50);
    cfg.redis.connect_timeout = Duration::from_secs(5);
    let issued = apikey::issue(id("acme"), id("gold"), 1, None);
    Store::new(&cfg.redis).unwrap().create_key(&issued.hash, &issued.record).await.unwrap();

    let store = Store::new(&cfg.redis).unwrap();
    redis.pause();
    let started = Instant::now();
    let lookup = store.lookup(&issued.hash).await;
    let waited = started.elapsed();
    redis.resume();
    // not sent, so not a timeout of Redis': the sidecar does not take Redis as unresponsive
    assert!(matches!(&lookup, Err(StoreError::Unreachable(why)) if why.contains("connecting")), "{lookup:?}");
    // 50 ms is the deadline; 2.5 s is half the connect timeout the caller used to wait out
    assert!(waited < Duration::from_millis(2500), "waited {waited:?} for a connection");
    let found = loop {
        match store.lookup(&issued.hash).await {
            Ok(found) => break found,
            Err(e) if started.elapsed() < Duration::from_secs(20) => eprintln!("lookup: {e}; again"),
            Err(e) => panic!("the connection never landed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(found.is_some(), "the attempt's connection serves the next commands");
}
