//! The response cache and idempotency lookups of the decision (issue 7) against a real
//! redis-server: one EVALSHA per decision with limits and a lookup, miss → store → hit per tenant
//! and route, idempotency claim / in flight / conflict / replay / release, a late report after a
//! new claim changes nothing, limits untouched by 409/422, TTLs, and Redis down.

use std::sync::Arc;
use std::time::Duration;
use tollgate_sidecar::apikey;
use tollgate_sidecar::clock::ManualClock;
use tollgate_sidecar::config::{Config, RedisConfig};
use tollgate_sidecar::control::model::{Change, Kind, Snapshot};
use tollgate_sidecar::decision::{Decider, Routing};
use tollgate_sidecar::keys::Id;
use tollgate_sidecar::decision::limits::Plans;
use tollgate_sidecar::decision::responses::{keep_claims, store_batch, ResponsesConfig, Storing};
use tollgate_sidecar::store::Store;
use tollgate_tests::redis::command_calls;
use tollgate_tests::Redis;
use tollgate_wire::responses::{ClaimRenewal, IdempotencyRequest, ReplayKind, StoreBatch, StoreItem, StoreTicket, StoredResponse};
use tollgate_wire::{DecideRequest, DecideResponse};

const T0: u64 = 1_795_953_600_000;

struct Lab {
    redis: Redis,
    decider: Decider,
    store: Store,
    keys: Vec<String>,
    clock: Arc<ManualClock>,
    /// Bytes of stored responses a tenant may hold (decision 185).
    bound: u64,
}

impl Lab {
    async fn new() -> Lab {
        Lab::bounded_mb(1 << 10).await
    }

    /// A lab whose tenants may hold `mb` MiB of stored responses each.
    async fn bounded_mb(mb: u64) -> Lab {
        let responses = ResponsesConfig { tenant_max_mb: mb, ..Default::default() };
        let bound = responses.tenant_max_bytes();
        let redis = Redis::start();
        let plan = |p: &str| format!("[[plans.{p}.limits]]\nname = \"pm\"\nalgorithm = \"fixed_window\"\nlimit = 100\nwindow = \"60s\"\n");
        let toml = plan("p") + &plan("q");
        let mut cfg = Config::from_toml(&toml).unwrap();
        cfg.redis.url = redis.url();
        cfg.redis.timeout = Duration::from_millis(500);
        // not the default 20 ms: a first call connects and loads its script, which can take
        // longer on a loaded machine, and the failure mode would answer instead of the script
        cfg.redis.decision_timeout = Duration::from_secs(2);
        cfg.cache.ttl = Duration::from_secs(600);
        let store = Store::new(&cfg.redis).unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let decider = Decider::new(store.clone(), &cfg.cache, Plans::compile(&cfg.plans).unwrap(), clock.clone()).with_responses(&responses);
        let mut s = Snapshot { plans: cfg.plans.clone(), ..Snapshot::default() };
        for change in [
            Change::Put(Kind::Routes, serde_json::json!({"id": "chat", "cluster": "a", "cache_ttl": "30s"})),
            Change::Put(Kind::Routes, serde_json::json!({"id": "nocache", "cluster": "a"})),
        ] {
            s = s.apply(&change).unwrap();
        }
        decider.set_routing(Routing::of(&s, 1));
        let admin = Store::new(&RedisConfig { url: redis.url(), ..Default::default() }).unwrap();
        let mut keys = Vec::new();
        // keys 0 and 1: acme and beta on plan p; key 2: acme on plan q
        for (tenant, plan) in [("acme", "p"), ("beta", "p"), ("acme", "q")] {
            let issued = apikey::issue(Id::parse(tenant).unwrap(), Id::parse(plan).unwrap(), 1, None);
            admin.create_key(&issued.hash, &issued.record).await.unwrap();
            keys.push(issued.hash.as_str().to_string());
        }
        Lab { redis, decider, store, keys, clock, bound }
    }

    fn req(&self, key: usize, route: &str) -> DecideRequest {
        DecideRequest {
            route: Some(route.into()),
            cache_key: Some("ab".repeat(32)),
            ..DecideRequest::new(self.keys[key].clone(), "POST", "api", "/v1/chat")
        }
    }

    fn idem(&self, key: usize, idem: &str, digest: &str) -> DecideRequest {
        DecideRequest {
            idempotency: Some(IdempotencyRequest { key: idem.into(), digest: digest.repeat(32 / digest.len()) }),
            route: None,
            cache_key: None,
            ..self.req(key, "chat")
        }
    }

    async fn store(&self, ticket: StoreTicket, response: Option<StoredResponse>) -> tollgate_wire::responses::StoreAck {
        self.store_for(ticket, response, None).await
    }

    /// As [`Lab::store`], for a response whose own freshness left is `max_age_ms` (decision 211).
    async fn store_for(&self, ticket: StoreTicket, response: Option<StoredResponse>, max_age_ms: Option<u64>) -> tollgate_wire::responses::StoreAck {
        let routing = self.decider.routing();
        let batch = StoreBatch { responses: vec![StoreItem { ticket, response, max_age_ms }] };
        let with = Storing { route_cache: |r: &str| routing.cache(r), tickets: self.decider.tickets(), now_ms: self.decider.now_ms(), tenant_max_bytes: self.bound, in_flight_ms: 300_000 };
        store_batch(&self.store, &batch, with).await
    }

    /// `t` sealed as the decider would have (so only its fields are judged).
    fn sealed(&self, mut t: StoreTicket) -> StoreTicket {
        self.decider.tickets().seal_store(&mut t, "0123456789abcdef0123456789abcdef", T0 + 60_000);
        t
    }

    fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        self.redis.cmd(args)
    }
}

/// (replay, store ticket, RateLimit remaining) of an allow.
fn allowed(r: DecideResponse) -> (Option<(ReplayKind, StoredResponse)>, Option<StoreTicket>, Option<String>) {
    match r {
        DecideResponse::Allow { replay, store, response_headers, .. } => (
            replay.map(|r| (r.kind, r.response)),
            store.map(|t| *t),
            response_headers.iter().find(|h| h.name == "ratelimit").map(|h| h.value.clone()),
        ),
        other => panic!("expected an allow, got {other:?}"),
    }
}

fn denied(r: DecideResponse) -> (u16, String) {
    match r {
        DecideResponse::Deny { status, error, .. } => (status, error),
        other => panic!("expected a denial, got {other:?}"),
    }
}

fn ok(body: &str) -> StoredResponse {
    StoredResponse::new(200, vec![tollgate_wire::Header::new("content-type", "application/json")], body.as_bytes().to_vec(), T0)
}

/// Decision 169: the upstream sees the plan a request was decided on (`x-tollgate-plan`) and may
/// answer by it; a response stored for one plan is never replayed to a key of another plan of
/// the same tenant (before, the namespace was the tenant and route: a free key got the answer
/// made for a premium one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_response_is_its_plans_own() {
    let lab = Lab::new().await;
    let (_, ticket, _) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
    let ack = lab.store(ticket.expect("a miss"), Some(ok(r#"{"for":"p"}"#))).await;
    assert_eq!(ack.stored, 1, "{ack:?}");
    let (replay, ticket, _) = allowed(lab.decider.decide(&lab.req(2, "chat")).await.unwrap());
    assert!(replay.is_none(), "plan q does not read plan p's response: {replay:?}");
    let Some(StoreTicket::Cache { plan, .. }) = ticket else { panic!("a miss of its own: {ticket:?}") };
    assert_eq!(plan, "q");
    let (replay, _, _) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
    assert!(replay.is_some(), "plan p still does");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_miss_store_hit_is_per_tenant_and_route_in_one_round_trip() {
    let lab = Lab::new().await;
    let (replay, ticket, _) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
    assert!(replay.is_none());
    let ticket = ticket.expect("a miss carries a store ticket");
    let ack = lab.store(ticket.clone(), Some(ok(r#"{"answer":42}"#))).await;
    assert_eq!(ack.stored, 1, "{ack:?}");
    let (segment, _) = lab.decider.routing().cache("chat").expect("a caching route");
    let key = format!("cache:exact:{{acme}}:p:{segment}:{}", "ab".repeat(32));
    let ttl: i64 = lab.cmd(&["PTTL", &key]);
    assert!(ttl > 29_000 && ttl <= 30_000, "the route's TTL: {ttl}");

    let _: () = lab.cmd(&["CONFIG", "RESETSTAT"]);
    let (replay, ticket2, rl) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
    let (kind, r) = replay.expect("a hit");
    assert_eq!((kind, r.body.as_str(), ticket2), (ReplayKind::Cache, r#"{"answer":42}"#, None));
    assert!(rl.is_some_and(|v| v.contains("r=98")), "a hit takes from the limits");
    for _ in 0..9 {
        allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
    }
    let stats = lab.redis.commandstats();
    let calls = |name: &str| command_calls(&stats, name);
    // one EVALSHA per decision: the lookup rides on the limits' script call
    assert_eq!(calls("evalsha"), 10, "{stats}");
    assert_eq!(calls("hgetall") + calls("eval") + calls("script"), 0, "{stats}");

    // another tenant, another route, a route without a TTL: no sharing, no lookup
    let (replay, t, _) = allowed(lab.decider.decide(&lab.req(1, "chat")).await.unwrap());
    assert!(replay.is_none() && matches!(t, Some(StoreTicket::Cache { ref tenant, .. }) if tenant == "beta"));
    let (replay, t, _) = allowed(lab.decider.decide(&lab.req(0, "nocache")).await.unwrap());
    assert!(replay.is_none() && t.is_none());

    // the store refuses what it must: unknown route, no TTL, a failure status, a forged tenant
    let bad_route = lab.sealed(StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "nocache".into(), hash: "cd".repeat(32), seal: Default::default() });
    assert_eq!(lab.store(bad_route, Some(ok("x"))).await.refused, 1);
    let status = StoredResponse::new(500, vec![], b"x".to_vec(), T0);
    assert_eq!(lab.store(ticket.clone(), Some(status)).await.refused, 1);
    let forged = lab.sealed(StoreTicket::Cache { tenant: "a}b".into(), plan: "p".into(), route: "chat".into(), hash: "cd".repeat(32), seal: Default::default() });
    assert_eq!(lab.store(forged, Some(ok("x"))).await.refused, 1);

    // tickets: an unsealed one, one moved to another tenant, and the settled one replayed with
    // another body are refused; the entry is unchanged
    let entry: String = lab.cmd(&["GET", &key]);
    let unsealed = StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "chat".into(), hash: "ab".repeat(32), seal: Default::default() };
    assert_eq!(lab.store(unsealed, Some(ok("poison"))).await.refused, 1);
    let mut moved = ticket.clone();
    if let StoreTicket::Cache { tenant, .. } = &mut moved {
        *tenant = "beta".into();
    }
    assert_eq!(lab.store(moved, Some(ok("poison"))).await.refused, 1);
    assert_eq!(lab.store(ticket.clone(), Some(ok("poison"))).await.refused, 1, "a replay writes over nothing");
    let after: String = lab.cmd(&["GET", &key]);
    assert_eq!(after, entry);
    let beta: Vec<String> = lab.cmd(&["KEYS", "cache:exact:{beta}:*"]);
    assert!(beta.is_empty(), "{beta:?}");
    // a cache ticket is taken back no longer than its route's TTL (30 s here)
    assert_eq!(ticket.seal().expires_at_ms, T0 + 30_000);
}

/// Decision 211: a response whose own `max-age` is below the route's TTL lives that long, and one
/// stale when it arrived is not stored. Before, every entry lived the route's TTL (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_own_freshness_below_the_routes_ttl_is_honoured() {
    let lab = Lab::new().await;
    let (segment, _) = lab.decider.routing().cache("chat").expect("a caching route");
    let ticket = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap()).1.expect("a miss");
    assert_eq!(lab.store_for(ticket, Some(ok("short")), Some(5_000)).await.stored, 1);
    let ttl: i64 = lab.cmd(&["PTTL", &format!("cache:exact:{{acme}}:p:{segment}:{}", "ab".repeat(32))]);
    assert!(ttl > 4_000 && ttl <= 5_000, "the response's own 5 s, not the route's 30 s: {ttl}");
    let stale = DecideRequest { cache_key: Some("cd".repeat(32)), ..lab.req(0, "chat") };
    let ticket = allowed(lab.decider.decide(&stale).await.unwrap()).1.expect("a miss");
    assert_eq!(lab.store_for(ticket, Some(ok("stale")), Some(0)).await.refused, 1);
    let longer = DecideRequest { cache_key: Some("ef".repeat(32)), ..lab.req(0, "chat") };
    let ticket = allowed(lab.decider.decide(&longer).await.unwrap()).1.expect("a miss");
    assert_eq!(lab.store_for(ticket, Some(ok("long")), Some(600_000)).await.stored, 1);
    let ttl: i64 = lab.cmd(&["PTTL", &format!("cache:exact:{{acme}}:p:{segment}:{}", "ef".repeat(32))]);
    assert!(ttl > 29_000 && ttl <= 30_000, "never past the route's TTL: {ttl}");
}

/// Decision 202: answers stored under a route are not served once its cluster or TTL changed
/// (a route moved off a bad model, a TTL set too long by mistake and lowered): the changed route
/// starts an empty cache. Before, the old entries were hits until their own TTL ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_route_does_not_serve_what_it_stored_before() {
    let lab = Lab::new().await;
    let ticket = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap()).1.expect("a miss");
    assert_eq!(lab.store(ticket, Some(ok(r#"{"model":"old"}"#))).await.stored, 1);
    assert!(allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap()).0.is_some(), "a hit");
    for (cluster, ttl) in [("a", "10s"), ("b", "10s")] {
        let mut s = Snapshot::default();
        for change in [
            Change::Put(Kind::Routes, serde_json::json!({"id": "chat", "cluster": cluster, "cache_ttl": ttl})),
            Change::Put(Kind::Routes, serde_json::json!({"id": "nocache", "cluster": "a"})),
        ] {
            s = s.apply(&change).unwrap();
        }
        lab.decider.set_routing(Routing::of(&s, 2));
        let (replay, ticket, _) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
        assert!(replay.is_none(), "cluster {cluster}, TTL {ttl}: the old answer served");
        assert_eq!(lab.store(ticket.expect("a miss"), Some(ok(r#"{"model":"new"}"#))).await.stored, 1);
        let (replay, _, _) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
        assert_eq!(replay.expect("a hit of the changed route").1.body, r#"{"model":"new"}"#);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_claim_in_flight_conflict_replay_and_release() {
    let lab = Lab::new().await;
    let (replay, ticket, first_rl) = allowed(lab.decider.decide(&lab.idem(0, "k1", "aa")).await.unwrap());
    assert!(replay.is_none());
    let ticket = ticket.expect("a claim");
    let owner: Vec<String> = lab.cmd(&["KEYS", "idem:key:{acme}:*:k1"]);
    assert_eq!(owner.len(), 1);
    let digest: String = lab.cmd(&["GET", &owner[0]]);
    assert_eq!(digest, "aa".repeat(16), "the owner key holds the digest that claimed the key");
    // in flight: 409, and no limit is taken
    assert_eq!(denied(lab.decider.decide(&lab.idem(0, "k1", "aa")).await.unwrap()), (409, "idempotency_in_flight".into()));
    // the same key for another operation: 422 (found by the owner key in the same lookup)
    assert_eq!(denied(lab.decider.decide(&lab.idem(0, "k1", "bb")).await.unwrap()), (422, "idempotency_key_reused".into()));
    // the outcome is stored: replayed from now on, for 24 h
    assert_eq!(lab.store(ticket.clone(), Some(ok(r#"{"order":1}"#))).await.stored, 1);
    let (replay, t, rl) = allowed(lab.decider.decide(&lab.idem(0, "k1", "aa")).await.unwrap());
    let (kind, r) = replay.expect("a replay");
    assert_eq!((kind, r.body.as_str(), t), (ReplayKind::Idempotency, r#"{"order":1}"#, None));
    let remaining = |v: &Option<String>| -> u64 { v.as_deref().unwrap().split("r=").nth(1).unwrap().split(';').next().unwrap().parse().unwrap() };
    assert_eq!(remaining(&rl), remaining(&first_rl) - 1, "409 and 422 took nothing; the replay took one");
    let memo: Vec<String> = lab.cmd(&["KEYS", "idem:api:{acme}:*"]);
    assert_eq!(memo.len(), 1);
    let ttl: i64 = lab.cmd(&["PTTL", &memo[0]]);
    assert!(ttl > 86_000_000, "{ttl}");
    // a second report of the same claim changes nothing
    assert_eq!(lab.store(ticket, None).await.refused, 1);
    assert!(allowed(lab.decider.decide(&lab.idem(0, "k1", "aa")).await.unwrap()).0.is_some());
    // another API key (here: another tenant) with the same idempotency key is its own operation
    assert!(allowed(lab.decider.decide(&lab.idem(1, "k1", "aa")).await.unwrap()).1.is_some());

    // a failed outcome releases the claim: the client may retry, even with another body
    let (_, t2, _) = allowed(lab.decider.decide(&lab.idem(0, "k2", "cc")).await.unwrap());
    let failed = StoredResponse::new(502, vec![], vec![], T0);
    assert_eq!(lab.store(t2.unwrap(), Some(failed)).await.released, 1);
    let keys: Vec<String> = lab.cmd(&["KEYS", "idem:*k2"]);
    assert!(keys.is_empty(), "{keys:?}");
    assert!(allowed(lab.decider.decide(&lab.idem(0, "k2", "dd")).await.unwrap()).1.is_some());

    // every idempotency key has a TTL
    lab.redis.assert_ttl_invariant();
}

/// Any 2xx outcome ran the operation: it is remembered, never released for a retry to run it
/// again — a 206, one with more headers than a stored response keeps (its first ones, no body,
/// marked truncated), and a binary body of exactly the bound (whose base64 once read as over it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_2xx_outcome_is_remembered_whatever_its_size_or_kind() {
    let lab = Lab::new().await;
    let many: Vec<tollgate_wire::Header> = (0..70).map(|i| tollgate_wire::Header::new(format!("x-h{i}"), "v")).collect();
    let mut binary = vec![0xffu8; tollgate_wire::responses::MAX_STORED_BODY];
    binary[0] = 0xfe;
    let outcomes = [
        ("partial", StoredResponse::new(206, vec![], b"part".to_vec(), T0), Some(4), false),
        ("headers", StoredResponse::new(201, many, b"made".to_vec(), T0), Some(0), true),
        ("binary", StoredResponse::new(200, vec![], binary.clone(), T0), Some(binary.len()), false),
    ];
    for (idem, outcome, body_len, truncated) in outcomes {
        let (_, ticket, _) = allowed(lab.decider.decide(&lab.idem(0, idem, "ee")).await.unwrap());
        let status = outcome.status;
        assert_eq!(lab.store(ticket.expect("a claim"), Some(outcome)).await.stored, 1, "{idem}");
        let (replay, t, _) = allowed(lab.decider.decide(&lab.idem(0, idem, "ee")).await.unwrap());
        let (kind, r) = replay.unwrap_or_else(|| panic!("{idem}: replayed, not claimed again"));
        assert_eq!((kind, r.status, t), (ReplayKind::Idempotency, status, None), "{idem}");
        assert_eq!((r.body_bytes().map(|b| b.len()), r.truncated), (body_len, truncated), "{idem}");
        if truncated {
            assert_eq!(r.headers.len(), 64, "its first headers");
        }
    }
}

/// A cache miss of key `key` for the request hash numbered `n` (its store ticket).
async fn miss(lab: &Lab, key: usize, n: u32) -> StoreTicket {
    let req = DecideRequest { cache_key: Some(format!("{n:064x}")), ..lab.req(key, "chat") };
    let (replay, ticket, _) = allowed(lab.decider.decide(&req).await.unwrap());
    assert!(replay.is_none(), "request {n}: a miss");
    ticket.expect("a miss carries a store ticket")
}

/// The tenant's ledger (responses:bytes:{tenant}), 0 when absent.
fn counted(lab: &Lab, tenant: &str) -> u64 {
    let v: Option<u64> = lab.cmd(&["GET", &format!("responses:bytes:{{{tenant}}}")]);
    v.unwrap_or(0)
}

/// Decision 185: one tenant's stored responses cannot fill the Redis every tenant's limits live
/// in. Before, each admitted request could store up to 1 MiB (24 h for an idempotency outcome)
/// without any bound per tenant; with `noeviction` a full Redis refuses every tenant's writes.
/// Cache fills take three quarters of a tenant's bound at most: past it a fill is not stored (a
/// later miss), another tenant's still is, and an entry whose TTL has passed gives its bytes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_stored_responses_stay_within_its_bound() {
    let lab = Lab::bounded_mb(1).await;
    let share = (1u64 << 20) / 4 * 3;
    let body = "x".repeat(200_000);
    for n in 0..3 {
        assert_eq!(lab.store(miss(&lab, 0, n).await, Some(ok(&body))).await.stored, 1, "entry {n}");
    }
    let held = counted(&lab, "acme");
    assert!((600_000..=share).contains(&held), "three entries counted: {held}");
    let ack = lab.store(miss(&lab, 0, 3).await, Some(ok(&body))).await;
    assert_eq!((ack.stored, ack.refused), (0, 1), "past the cache's share: {ack:?}");
    let stored: Vec<String> = lab.cmd(&["KEYS", "cache:exact:{acme}:*"]);
    assert_eq!(stored.len(), 3, "{stored:?}");
    assert_eq!(counted(&lab, "acme"), held, "a refused store counts nothing");
    let (replay, _, _) = allowed(lab.decider.decide(&DecideRequest { cache_key: Some(format!("{:064x}", 3)), ..lab.req(0, "chat") }).await.unwrap());
    assert!(replay.is_none(), "not stored: a miss again");
    // a small answer still fits
    assert_eq!(lab.store(miss(&lab, 0, 4).await, Some(ok("{}"))).await.stored, 1);
    // another tenant has its own bound
    assert_eq!(lab.store(miss(&lab, 1, 3).await, Some(ok(&body))).await.stored, 1, "beta");
    // the route's TTL (30 s) passes: the entries' bytes are given back at the next store
    lab.clock.advance(30_001);
    assert_eq!(lab.store(miss(&lab, 0, 5).await, Some(ok(&body))).await.stored, 1, "room again");
    let held = counted(&lab, "acme");
    assert!((200_000..201_000).contains(&held), "only the new entry is counted, with its key and overhead: {held}");
    let members: i64 = lab.cmd(&["ZCARD", "responses:live:{acme}"]);
    assert_eq!(members, 1);
    lab.redis.assert_ttl_invariant();
}

/// An outcome with 64 headers of 2 KB each and a body of `body` bytes.
fn heavy(body: usize) -> StoredResponse {
    let headers = (0..64).map(|i| tollgate_wire::Header::new(format!("x-h{i}"), "v".repeat(2_000))).collect();
    StoredResponse::new(200, headers, vec![b'b'; body], T0)
}

/// Decision 185, idempotency: an outcome that would take its tenant past the bound is still kept
/// without its body (status and headers, marked truncated, as a too-large one is), so the retry
/// replays it and never runs the operation again; once the tenant holds its whole bound a new
/// claim is refused (429 with Retry-After, nothing run or taken), so those header-only outcomes
/// cannot grow past it either; the bound frees as outcomes expire (swept by the claim itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_outcomes_past_the_bound_lose_their_bodies_then_new_claims_wait() {
    let lab = Lab::bounded_mb(1).await;
    let bound = 1u64 << 20;
    let mut truncated = 0;
    let mut refused = None;
    for i in 0..8 {
        let idem = format!("pay-{i}");
        let r = lab.decider.decide(&lab.idem(0, &idem, "aa")).await.unwrap();
        if let DecideResponse::Deny { status, error, response_headers, .. } = &r {
            let retry_after = response_headers.iter().find(|h| h.name == "retry-after").map(|h| h.value.clone());
            refused = Some((i, *status, error.clone(), retry_after));
            break;
        }
        let (_, ticket, _) = allowed(r);
        assert_eq!(lab.store(ticket.expect("a claim"), Some(heavy(600_000))).await.stored, 1, "{idem} kept");
        let (replay, t, _) = allowed(lab.decider.decide(&lab.idem(0, &idem, "aa")).await.unwrap());
        let (_, r) = replay.expect("replayed, never run again");
        assert!(t.is_none());
        truncated += usize::from(r.truncated);
        assert_eq!(r.body_bytes().map(|b| b.len()), Some(if r.truncated { 0 } else { 600_000 }), "{idem}");
        assert!(counted(&lab, "acme") < bound + 200_000, "past the bound by one header-only outcome at most");
    }
    assert!(truncated >= 2, "outcomes past the bound kept without their bodies: {truncated}");
    let (i, status, error, retry_after) = refused.expect("a claim refused at the bound");
    assert!(i >= 3, "after the bound was reached: {i}");
    assert_eq!((status, error.as_str()), (429, "idempotency_storage_full"));
    let secs: u64 = retry_after.expect("Retry-After").parse().unwrap();
    assert!(secs > 0 && secs <= 86_400, "room when the first outcome expires: {secs}");
    let memo: Vec<String> = lab.cmd(&["KEYS", &format!("idem:*pay-{i}")]);
    assert!(memo.is_empty(), "the refused request claimed nothing: {memo:?}");
    // another tenant is not concerned
    assert!(allowed(lab.decider.decide(&lab.idem(1, "pay-0", "aa")).await.unwrap()).1.is_some());
    // a day later the outcomes have expired: the claim sweeps them out and is taken
    lab.clock.advance(86_400_001);
    assert!(allowed(lab.decider.decide(&lab.idem(0, "pay-x", "aa")).await.unwrap()).1.is_some(), "room again");
    assert_eq!(counted(&lab, "acme"), 0);
}

/// The ledger does not drift when one of its two keys is lost (evicted, deleted): a sum whose
/// members are gone is dropped with them, and a sum made anew lives as its members do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_lost_a_key_mends_itself() {
    let lab = Lab::bounded_mb(1).await;
    let body = "x".repeat(200_000);
    for n in 0..3 {
        assert_eq!(lab.store(miss(&lab, 0, n).await, Some(ok(&body))).await.stored, 1);
    }
    let _: () = lab.cmd(&["DEL", "responses:live:{acme}"]);
    assert_eq!(lab.store(miss(&lab, 0, 3).await, Some(ok(&body))).await.stored, 1, "the lost members' bytes are not held against the tenant");
    assert!((200_000..201_000).contains(&counted(&lab, "acme")));
    let _: () = lab.cmd(&["DEL", "responses:bytes:{acme}"]);
    assert_eq!(lab.store(miss(&lab, 0, 4).await, Some(ok("{}"))).await.stored, 1);
    let ttl: i64 = lab.cmd(&["PTTL", "responses:bytes:{acme}"]);
    assert!(ttl > 0, "a sum made anew has its zset's TTL: {ttl}");
    lab.redis.assert_ttl_invariant();
}

/// Decision 186: a claim whose request still runs is kept another in-flight TTL and its ticket
/// sealed again, while it is still the request's; a settled claim, an altered ticket are not
/// (`None`: the worker stops asking).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_requests_claim_is_kept_and_its_ticket_sealed_again() {
    let lab = Lab::new().await;
    let running = allowed(lab.decider.decide(&lab.idem(0, "run", "aa")).await.unwrap()).1.expect("a claim");
    let settled = allowed(lab.decider.decide(&lab.idem(0, "done", "aa")).await.unwrap()).1.expect("a claim");
    assert_eq!(lab.store(settled.clone(), Some(ok("{}"))).await.stored, 1);
    let mut forged = running.clone();
    if let StoreTicket::Idempotency { token, .. } = &mut forged {
        *token = "other".into();
    }
    // a claim Redis cannot answer for (here its memo is of another type) does not hold back
    // the others: its ticket comes back unchanged, to be asked for again
    let broken = allowed(lab.decider.decide(&lab.idem(0, "broken", "aa")).await.unwrap()).1.expect("a claim");
    let broken_memo: Vec<String> = lab.cmd(&["KEYS", "idem:api:{acme}:*:broken"]);
    let _: () = lab.cmd(&["DEL", &broken_memo[0]]);
    let _: () = lab.cmd(&["HSET", &broken_memo[0], "f", "v"]);
    let _: () = lab.cmd(&["PEXPIRE", &broken_memo[0], "600000"]);
    let memo: Vec<String> = lab.cmd(&["KEYS", "idem:api:{acme}:*:run"]);
    let _: () = lab.cmd(&["PEXPIRE", &memo[0], "1000"]);
    let owner: Vec<String> = lab.cmd(&["KEYS", "idem:key:{acme}:*:run"]);
    let _: () = lab.cmd(&["PEXPIRE", &owner[0], "1000"]);
    lab.clock.advance(100_000);
    let batch = ClaimRenewal { claims: vec![running.clone(), settled, forged, broken.clone()] };
    let kept = keep_claims(&lab.store, &batch, lab.decider.tickets(), lab.decider.now_ms(), 300_000).await.expect("Redis answers for some");
    let [Some(again), None, None, Some(unchanged)] = kept.claims.as_slice() else { panic!("{kept:?}") };
    assert_eq!(unchanged, &broken, "asked for again");
    assert_eq!(kept.in_flight_ms, 300_000);
    assert_eq!(again.seal().expires_at_ms, T0 + 100_000 + 300_000, "sealed for another TTL from now");
    let ttl: i64 = lab.cmd(&["PTTL", &memo[0]]);
    assert!(ttl > 290_000, "the claim lives another TTL: {ttl}");
    let ttl: i64 = lab.cmd(&["PTTL", &owner[0]]);
    assert!(ttl > 290_000, "its owner key at least as long: {ttl}");
    // Redis answering for none: the batch waits
    let only_broken = ClaimRenewal { claims: vec![broken] };
    assert!(keep_claims(&lab.store, &only_broken, lab.decider.tickets(), lab.decider.now_ms(), 300_000).await.is_err());
    // the resealed ticket stores the outcome after the first ticket's life
    lab.clock.advance(250_000);
    assert_eq!(lab.store(again.clone(), Some(ok("{}"))).await.stored, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_a_miss_and_executes_idempotency_keys_unrecorded() {
    let mut lab = Lab::new().await;
    allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap()); // the key record is cached
    lab.redis.kill();
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let (replay, ticket, _) = allowed(lab.decider.decide(&lab.req(0, "chat")).await.unwrap());
        assert!(replay.is_none() && ticket.is_none(), "a miss, nothing to store");
        let (replay, ticket, _) = allowed(lab.decider.decide(&lab.idem(0, "k", "aa")).await.unwrap());
        assert!(replay.is_none() && ticket.is_none(), "executed, not recorded");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
