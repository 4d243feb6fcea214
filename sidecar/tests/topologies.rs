//! The same key store and limit scripts on a real 3-master Redis Cluster and through Sentinel
//! (master + replica + 3 sentinels), including following a Sentinel failover; the key copy of a
//! start (`copy_key.lua`) on a Cluster and a single node.

use std::sync::Arc;
use std::time::Duration;
use tollgate_sidecar::apikey::{self, KeyRecord, KeyStatus};
use tollgate_sidecar::clock::ManualClock;
use tollgate_sidecar::config::{Config, RedisConfig, RedisMode};
use tollgate_sidecar::decision::Decider;
use tollgate_sidecar::keys::Id;
use tollgate_sidecar::decision::limits::Plans;
use tollgate_sidecar::store::Store;
use tollgate_tests::{Redis, RedisCluster, RedisSentinel};
use tollgate_sidecar::scripts::copy_key::{self, Copied};
use tollgate_sidecar::scripts::refund::Refunded;
use tollgate_wire::refunds::Abandoned;
use tollgate_wire::{Completion, DecideRequest, DecideResponse};

/// Every algorithm in one plan: one script call touching 8 keys, all in the tenant's slot.
const ALL_LIMITS: &str = "\
[[plans.all.limits]]\nname = \"fw\"\nalgorithm = \"fixed_window\"\nlimit = 3\n\
[[plans.all.limits]]\nname = \"sw\"\nalgorithm = \"sliding_window\"\nlimit = 100\n\
[[plans.all.limits]]\nname = \"tb\"\nalgorithm = \"token_bucket\"\nlimit = 100\n\
[[plans.all.limits]]\nname = \"log\"\nalgorithm = \"sliding_log\"\nlimit = 100\nsubject = \"client_ip\"\n\
[[plans.all.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 100000\nestimate = 10\n\
[[plans.all.limits]]\nname = \"conc\"\nalgorithm = \"concurrency\"\nlimit = 10\n";

fn decider(redis: RedisConfig) -> (Decider, Store) {
    let mut cfg = Config::from_toml(ALL_LIMITS).unwrap();
    // a decision's Redis time too (the default is 20 ms): the first decision on a fresh Cluster
    // connects to every master and loads its script, which can take longer on a loaded machine,
    // and the limits' failure mode (open) would then answer instead of the scripts under test
    let (timeout, decision_timeout) = (Duration::from_secs(2), Duration::from_secs(2));
    cfg.redis = RedisConfig { timeout, connect_timeout: timeout, decision_timeout, ..redis };
    let store = Store::new(&cfg.redis).unwrap();
    let clock = Arc::new(ManualClock::new(1_795_953_600_000));
    (Decider::new(store.clone(), &cfg.cache, Plans::compile(&cfg.plans).unwrap(), clock), store)
}

fn request(hash: &str, n: u32) -> DecideRequest {
    DecideRequest {
        request_id: Some(format!("r-{n}")),
        decision_id: Some(format!("{n:032x}")),
        client_ip: Some("10.1.1.1".into()),
        ..DecideRequest::new(hash, "GET", "a", "/")
    }
}

/// Issues a key, makes 3 allowed decisions and a 4th denied by the fixed window, settles the
/// first request's reservation and slot, refunds the second (then a 5th decision is allowed).
async fn exercise(decider: &Decider, store: &Store) {
    let key = apikey::issue(Id::parse("acme").unwrap(), Id::parse("all").unwrap(), 1, None);
    store.create_key(&key.hash, &key.record).await.unwrap();
    let mut tickets = Vec::new();
    for n in 0..3 {
        match decider.decide(&request(key.hash.as_str(), n)).await.unwrap() {
            DecideResponse::Allow { ticket: Some(t), .. } => tickets.push(t),
            other => panic!("decision {n}: {other:?}"),
        }
    }
    match decider.decide(&request(key.hash.as_str(), 3)).await.unwrap() {
        DecideResponse::Deny { status: 429, limit: Some(l), .. } => assert_eq!(l, "fw"),
        other => panic!("expected the fixed window to deny: {other:?}"),
    }
    decider.complete(&Completion { ticket: tickets.remove(0), status: 200, tokens: Some(4), llm: None }).await.unwrap();
    // an abandoned decision is refunded (issue 15.2): the record and every key it names are in
    // the tenant's slot; the completed one has nothing left to give back
    let abandoned = |n: u32| Abandoned { decision_id: format!("{n:032x}"), key_hash: key.hash.as_str().to_string() };
    assert_eq!(decider.refund(&abandoned(1)).await.unwrap(), Refunded::Done { lines: 6 });
    assert_eq!(decider.refund(&abandoned(1)).await.unwrap(), Refunded::Nothing);
    assert_eq!(decider.refund(&abandoned(0)).await.unwrap(), Refunded::Nothing);
    match decider.decide(&request(key.hash.as_str(), 4)).await.unwrap() {
        DecideResponse::Allow { .. } => {}
        other => panic!("the refunded unit is back: {other:?}"),
    }
    let listed = store.list_keys(Some(&Id::parse("acme").unwrap())).await.unwrap();
    assert!(listed.iter().any(|r| r.key_id == key.record.key_id));
}

/// A response-cache miss, store and hit, and an idempotency claim, store and replay (issue 7):
/// the lookup keys share the limits' slot, so the one script call works on Cluster too.
async fn exercise_lookups(decider: &Decider, store: &Store) {
    use tollgate_sidecar::control::model::{Change, Kind, Snapshot};
    use tollgate_wire::responses::{IdempotencyRequest, StoreBatch, StoreItem, StoredResponse};
    let s = Snapshot::default()
        .apply(&Change::Put(Kind::Routes, serde_json::json!({"id": "chat", "cluster": "a", "cache_ttl": "30s"})))
        .unwrap();
    decider.set_routing(tollgate_sidecar::decision::Routing::of(&s, 1));
    let routing = decider.routing();
    for idem in [false, true] {
        let key = apikey::issue(Id::parse("acme").unwrap(), Id::parse("all").unwrap(), 1, None);
        store.create_key(&key.hash, &key.record).await.unwrap();
        let req = DecideRequest {
            route: Some("chat".into()),
            cache_key: (!idem).then(|| "ab".repeat(32)),
            idempotency: idem.then(|| IdempotencyRequest { key: "k-1".into(), digest: "cd".repeat(16) }),
            ..request(key.hash.as_str(), 10)
        };
        let ticket = match decider.decide(&req).await.unwrap() {
            DecideResponse::Allow { replay: None, store: Some(t), .. } => *t,
            other => panic!("expected a miss / claim: {other:?}"),
        };
        let response = StoredResponse::new(200, vec![], b"{}".to_vec(), 1);
        let batch = StoreBatch { responses: vec![StoreItem { ticket, response: Some(response), max_age_ms: None }] };
        let ack = tollgate_sidecar::decision::responses::store_batch(store, &batch, tollgate_sidecar::decision::responses::Storing { route_cache: |r: &str| routing.cache(r), tickets: decider.tickets(), now_ms: decider.now_ms(), tenant_max_bytes: 1 << 30, in_flight_ms: 300_000 }).await;
        assert_eq!(ack.stored, 1, "{ack:?}");
        match decider.decide(&DecideRequest { request_id: Some("r-11".into()), ..req }).await.unwrap() {
            DecideResponse::Allow { replay: Some(r), .. } => assert_eq!(r.response.body, "{}"),
            other => panic!("expected a hit / replay: {other:?}"),
        }
    }
}

/// `copy_key.lua` (decision 130): a copy writes a key (record, id mapping, tenant index), a
/// revoked copy revokes, and an active copy never overwrites a record Redis holds revoked.
async fn copies_never_undo_a_revocation(store: &Store) {
    let (acme, all) = (Id::parse("acme").unwrap(), Id::parse("all").unwrap());
    let key = apikey::issue(acme.clone(), all.clone(), 1, None);
    assert_eq!(copy_key::run(store, &key.hash, &key.record).await.unwrap(), Copied::Restored, "Redis had none");
    assert_eq!(copy_key::run(store, &key.hash, &key.record).await.unwrap(), Copied::Written, "the same again");
    assert_eq!(store.lookup(&key.hash).await.unwrap().map(|r| r.status), Some(KeyStatus::Active));
    assert!(store.list_keys(Some(&acme)).await.unwrap().iter().any(|r| r.key_id == key.record.key_id), "indexed");
    store.revoke_key(&key.record.key_id, 2).await.unwrap();
    // a start's snapshot read before that revocation
    assert_eq!(copy_key::run(store, &key.hash, &key.record).await.unwrap(), Copied::KeptRevoked);
    assert_eq!(store.lookup(&key.hash).await.unwrap().map(|r| r.status), Some(KeyStatus::Revoked));
    // a revoked copy over an active record is the revocation
    let other = apikey::issue(acme, all, 1, None);
    store.create_key(&other.hash, &other.record).await.unwrap();
    let revoked = KeyRecord { status: KeyStatus::Revoked, revoked_at: Some(3), ..other.record.clone() };
    assert_eq!(copy_key::run(store, &other.hash, &revoked).await.unwrap(), Copied::Restored, "a status changed");
    assert_eq!(store.lookup(&other.hash).await.unwrap().map(|r| r.status), Some(KeyStatus::Revoked));
}

/// Every key is listed, whichever node holds it (decision 182): a `SCAN` reaches one node of a
/// Cluster, so the listing scans every primary.
async fn every_key_is_listed(store: &Store) {
    let before = store.list_keys(None).await.unwrap().len();
    let mut made = std::collections::BTreeSet::new();
    for n in 0..30 {
        let key = apikey::issue(Id::parse(&format!("t{}", n % 5)).unwrap(), Id::parse("all").unwrap(), 1, None);
        store.create_key(&key.hash, &key.record).await.unwrap();
        made.insert(key.record.key_id);
    }
    let listed: std::collections::BTreeSet<_> = store.list_keys(None).await.unwrap().into_iter().map(|r| r.key_id).collect();
    assert!(made.is_subset(&listed), "{} of 30 listed", made.intersection(&listed).count());
    assert_eq!(listed.len(), before + 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripts_run_unchanged_on_a_three_master_cluster() {
    let cluster = RedisCluster::start();
    let (decider, store) = decider(RedisConfig { mode: RedisMode::Cluster, nodes: cluster.nodes(), ..Default::default() });
    exercise(&decider, &store).await;
    exercise_lookups(&decider, &store).await;
    copies_never_undo_a_revocation(&store).await;
    every_key_is_listed(&store).await;
}

/// A store of `mode` on `nodes` with a 50 ms `redis.timeout` sends an off-path command (a refund's
/// record read: 2 s) while `pause` hangs Redis for `hung`, then `resume`s it: the command is
/// answered within its own deadline, the sidecar does not fail fast, and the request path
/// answers after.
async fn an_off_path_command_outlasts_a_hang(mode: RedisMode, nodes: Vec<String>, hung: Duration, pause: impl Fn(), resume: impl Fn()) {
    let fast = Duration::from_millis(50);
    let cfg = RedisConfig { mode, nodes, timeout: fast, decision_timeout: fast, connect_timeout: Duration::from_secs(5), ..Default::default() };
    let store = Store::new(&cfg).unwrap();
    let issued = apikey::issue(Id::parse("acme").unwrap(), Id::parse("gold").unwrap(), 1, None);
    store.create_key(&issued.hash, &issued.record).await.unwrap();
    let (tenant, decision) = (Id::parse("acme").unwrap(), Id::parse("0123456789abcdef0123456789abcdef").unwrap());
    let refunded = tollgate_sidecar::scripts::refund::run(&store, &tenant, &decision, 1).await;
    assert!(matches!(refunded, Ok(Refunded::Nothing)), "{refunded:?}");

    pause();
    let slow = store.clone();
    let refund = tokio::spawn(async move { tollgate_sidecar::scripts::refund::run(&slow, &tenant, &decision, 1).await });
    // Redis hung: the fault under test, not a wait
    tokio::time::sleep(hung).await;
    resume();
    let refunded = refund.await.unwrap();
    assert!(matches!(refunded, Ok(Refunded::Nothing)), "answered within its 2 s: {refunded:?}");
    assert!(!store.is_failing_fast(), "a slow off-path command is not an unresponsive Redis");
    // the request path's connection is made by its first command, within that command's 50 ms
    // or, on a loaded machine, for the next ones: the attempt goes on without the caller
    let started = std::time::Instant::now();
    let found = loop {
        match store.lookup(&issued.hash).await {
            Ok(found) => break found,
            Err(e) if started.elapsed() < Duration::from_secs(10) => eprintln!("lookup: {e}; again"),
            Err(e) => panic!("the request path never answered: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // poll interval
    };
    assert!(found.is_some(), "the request path answers");
}

/// On a Cluster too, an off-path command waits its own deadline, not the request path's
/// `redis.timeout`, and a hung spell shorter than it neither fails the command nor makes the
/// sidecar fail fast (decision 144). Before, the cluster's one connection cut every command at
/// `redis.timeout` (50 ms here) and was dropped on each timeout. Every node hangs for 300 ms, six
/// request-path deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_an_off_path_command_waits_its_own_deadline() {
    let cluster = RedisCluster::start();
    an_off_path_command_outlasts_a_hang(RedisMode::Cluster, cluster.nodes(), Duration::from_millis(300), || cluster.pause(), || cluster.resume()).await;
}

/// Through Sentinel too (decision 147). Before, Sentinel's one connection had the library's
/// default response timeout, 500 ms, and cut every command there: the master hung for 900 ms
/// (within the refund's 2 s, and below Sentinel's 2 s `down-after-milliseconds`: no failover)
/// failed the refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_sentinel_an_off_path_command_waits_its_own_deadline() {
    let sentinel = RedisSentinel::start();
    let hung = Duration::from_millis(900);
    an_off_path_command_outlasts_a_hang(RedisMode::Sentinel, sentinel.sentinels(), hung, || sentinel.pause_master(), || sentinel.resume_master()).await;
    assert_eq!(sentinel.master(), Some(sentinel.master_port), "no failover happened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_copy_never_undoes_a_revocation_on_a_single_node() {
    let redis = Redis::start();
    let (_, store) = decider(RedisConfig { mode: RedisMode::Single, url: redis.url(), ..Default::default() });
    copies_never_undo_a_revocation(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_connects_through_sentinel_and_follows_a_failover() {
    let sentinel = RedisSentinel::start();
    let (decider, store) =
        decider(RedisConfig { mode: RedisMode::Sentinel, nodes: sentinel.sentinels(), ..Default::default() });
    exercise(&decider, &store).await;
    // A whole sidecar in sentinel mode subscribes to config changes on the master Sentinel names.
    let mut cfg = Config::from_toml("listen = \"127.0.0.1:0\"\n[server]\nsecret = \"topologies-tests-secret\"").unwrap();
    cfg.redis = RedisConfig { mode: RedisMode::Sentinel, nodes: sentinel.sentinels(), ..Default::default() };
    let sidecar = tollgate_sidecar::Sidecar::bind(&cfg).await.unwrap();
    let control = sidecar.control();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn(sidecar.serve(stop.clone().cancelled_owned()));
    let published_until_seen = |port: u16, version: u64| {
        let control = control.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            // publish until the subscriber (re)connected and took it: a message sent before the
            // subscription is not delivered, the next one is
            while control.live.version() != version {
                assert!(std::time::Instant::now() < deadline, "the change event never reached the sidecar");
                let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
                if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                    let _: Result<i64, _> = redis::cmd("PUBLISH").arg("config_changed:acme").arg(version).query_async(&mut c).await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await; // poll interval
            }
        }
    };
    published_until_seen(sentinel.master_port, 7).await;

    sentinel.failover();
    // the old master goes away: the subscription must follow Sentinel to the new one
    if let Ok(mut c) = redis::Client::open(format!("redis://127.0.0.1:{}/", sentinel.master_port)).unwrap().get_multiplexed_async_connection().await {
        let _: Result<(), _> = redis::cmd("SHUTDOWN").arg("NOSAVE").query_async(&mut c).await;
    }
    published_until_seen(sentinel.replica_port, 9).await;
    stop.cancel();
    served.await.unwrap().unwrap();
    // The old connection points at a replica now (READONLY) or was dropped; the store reconnects
    // through Sentinel to the new master. Writes succeed again within the failover's own time.
    let key = apikey::issue(Id::parse("acme").unwrap(), Id::parse("all").unwrap(), 1, None);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match store.create_key(&key.hash, &key.record).await {
            Ok(()) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                assert!(e.is_transient() || e.is_read_only(), "unexpected error: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await; // poll interval
            }
            Err(e) => panic!("no writable master after the failover: {e}"),
        }
    }
    assert!(matches!(decider.decide(&request(key.hash.as_str(), 99)).await.unwrap(), DecideResponse::Allow { .. }));
    assert_eq!(sentinel.master(), Some(sentinel.replica_port));
}
