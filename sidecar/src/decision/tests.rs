//! Unit tests of the decision logic over an in-memory store ([`memory::MemoryStore`]): what the
//! decider answers for each verdict of the key, the limits and the lookup, and what it asks of
//! the store. Time is a `ManualClock`; the key cache's freshness is set by its TTL.

mod memory;
mod models;

use super::cache::CacheConfig;
use super::limits::{PlanConfig, Plans};
use super::routing::{RouteEffect, Routing};
use super::{DecideError, Decider};
use crate::apikey::{hash_raw_key, KeyRecord, KeyStatus};
use crate::clock::ManualClock;
use crate::keys::{Id, KeyHash};
use crate::scripts::decide::{Check, Lookup as ScriptLookup};
use memory::MemoryStore;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tollgate_wire::responses::{IdempotencyRequest, ReplayKind, StoreTicket, StoredResponse};
use tollgate_wire::{BudgetHold, Completion, DecideRequest, DecideResponse, LeaseAsk, SlotHold, Ticket};

/// 2025-11-30T00:00:00Z: the start of a minute (a fixed window's lease may last its maximum).
const T0: u64 = 1_764_460_800_000;

/// Plans of one fixed window each (named `pm`, but `one`'s `once`), and `free` without limits.
const PLANS: &str = r#"
two.limits = [{ name = "pm", algorithm = "fixed_window", limit = 2 }]
closed.limits = [{ name = "pm", algorithm = "fixed_window", limit = 5, failure_mode = "closed" }]
shadow-closed.limits = [{ name = "pm", algorithm = "fixed_window", limit = 5, failure_mode = "closed", shadow = true }]
leased.limits = [{ name = "pm", algorithm = "fixed_window", limit = 100, mode = "leased" }]
one.limits = [{ name = "once", algorithm = "fixed_window", limit = 1 }]
local.limits = [{ name = "pm", algorithm = "fixed_window", limit = 3, failure_mode = "local" }, { name = "big", algorithm = "sliding_window", limit = 1000 }]
local-closed.limits = [{ name = "pm", algorithm = "fixed_window", limit = 3, failure_mode = "local" }, { name = "c", algorithm = "token_bucket", limit = 1000, failure_mode = "closed" }]
leased-local.limits = [{ name = "pm", algorithm = "fixed_window", limit = 100, mode = "leased", failure_mode = "local" }]
free = {}
models.models = ["gpt-4o*", "claude-3-haiku"]
models.model_aliases = { fast = "gpt-4o-mini", big = "o1" }
models.model_limits = [{ model = "gpt-4o-mini*", requests_per_minute = 2, tokens_per_minute = 1000, max_output_tokens = 100 }]
"#;

fn id(s: &str) -> Id {
    Id::parse(s).unwrap()
}

struct Lab {
    store: MemoryStore,
    decider: Decider<MemoryStore>,
    clock: Arc<ManualClock>,
}

impl Lab {
    /// A decider over an empty memory store; the key cache keeps answers fresh for `ttl`.
    fn new(ttl: Duration) -> Lab {
        let raw: BTreeMap<String, PlanConfig> = toml::from_str(PLANS).unwrap();
        let store = MemoryStore::default();
        let cache = CacheConfig { ttl, stale_grace: Duration::from_secs(60), ..CacheConfig::default() };
        let clock = Arc::new(ManualClock::new(T0));
        let decider = Decider::new(store.clone(), &cache, Plans::compile(&raw).unwrap(), clock.clone());
        Lab { store, decider, clock }
    }

    /// Issues key `raw` to tenant `acme` on `plan`; returns its hash.
    fn key(&self, raw: &str, plan: &str, status: KeyStatus) -> KeyHash {
        let record = KeyRecord {
            key_id: id(&format!("key_{raw}")),
            tenant: id("acme"),
            plan: id(plan),
            status,
            created_at: 1,
            expires_at: None,
            revoked_at: None,
            label: None,
            scopes: Default::default(),
            last_used_at: None,
        };
        let hash = hash_raw_key(raw);
        self.store.put(&hash, record);
        hash
    }

    /// Active keys `(raw, plan)`; their hashes in order.
    fn active_keys<const N: usize>(&self, keys: [(&str, &str); N]) -> [KeyHash; N] {
        keys.map(|(raw, plan)| self.key(raw, plan, KeyStatus::Active))
    }

    async fn decide(&self, req: &DecideRequest) -> DecideResponse {
        self.decider.decide(req).await.unwrap()
    }

    /// One allowed request per key, so the decider has each key's record cached, then the
    /// store goes down.
    async fn cache_then_lose_the_store(&self, keys: &[&KeyHash]) {
        for k in keys {
            assert!(matches!(self.decide(&req(k)).await, DecideResponse::Allow { .. }), "the record is now cached");
        }
        self.store.set_down(true);
    }
}

/// A request with the key `hash` and nothing optional.
fn req(hash: &KeyHash) -> DecideRequest {
    let json = serde_json::json!({"keyHash": hash.as_str(), "method": "POST", "authority": "api.test", "path": "/v1/chat"});
    serde_json::from_value(json).unwrap()
}

/// A deny's status and code, or a panic with what came instead.
fn denied(r: &DecideResponse) -> (u16, &str) {
    match r {
        DecideResponse::Deny { status, error, .. } => (*status, error.as_str()),
        other => panic!("expected a denial, got {other:?}"),
    }
}

fn header<'a>(r: &'a DecideResponse, name: &str) -> Option<&'a str> {
    let headers = match r {
        DecideResponse::Allow { response_headers, .. } | DecideResponse::Deny { response_headers, .. } => response_headers,
    };
    headers.iter().find(|h| h.name == name).map(|h| h.value.as_str())
}

#[tokio::test]
async fn an_unknown_key_is_denied_and_a_known_one_without_limits_is_allowed_with_a_reuse_hint() {
    let lab = Lab::new(Duration::from_secs(60));
    assert_eq!(denied(&lab.decide(&req(&hash_raw_key("nobody"))).await), (401, "unknown_key"));
    let revoked = lab.key("gone", "free", KeyStatus::Revoked);
    assert_eq!(denied(&lab.decide(&req(&revoked)).await), (401, "revoked_key"));

    let free = lab.key("free", "free", KeyStatus::Active);
    let DecideResponse::Allow { tenant, plan, cache_for_ms, ticket, .. } = lab.decide(&req(&free)).await else { panic!() };
    assert_eq!((tenant.as_str(), plan.as_str(), ticket), ("acme", "free", None));
    assert!(cache_for_ms.is_some_and(|ms| ms > 0 && ms <= 60_000), "{cache_for_ms:?}: the key cache's freshness, no more");
    assert!(lab.store.last_call().is_none(), "no limits, no lookup: no script call");

    // never past the key's expiry (T0 is in seconds 1_764_460_800)
    let soon = lab.key("soon", "free", KeyStatus::Active);
    lab.store.mem().records.get_mut(soon.as_str()).unwrap().expires_at = Some(T0 / 1000 + 2);
    let DecideResponse::Allow { cache_for_ms, .. } = lab.decide(&req(&soon)).await else { panic!() };
    assert_eq!(cache_for_ms, Some(2_000));
    assert!(matches!(lab.decider.decide(&DecideRequest { key_hash: "AB".into(), ..req(&soon) }).await, Err(DecideError::BadRequest(_))));
}

#[tokio::test]
async fn limits_allow_then_deny_and_a_denial_takes_nothing() {
    let lab = Lab::new(Duration::from_secs(60));
    let k = lab.key("two", "two", KeyStatus::Active);
    let first = lab.decide(&req(&k)).await;
    assert!(matches!(first, DecideResponse::Allow { .. }), "{first:?}");
    assert_eq!(header(&first, "ratelimit"), Some("\"pm\";r=1;t=60"));
    assert_eq!(header(&first, "ratelimit-policy"), Some("\"pm\";q=2;w=60"));
    let call = lab.store.last_call().unwrap();
    assert_eq!((call.now_ms, call.limits.len(), call.lease, call.lookup), (T0, 1, None, None));
    assert_eq!(call.request_id.as_str().len(), 32, "a request without a decision id gets one");

    // the filter's decision id names the decision; the client's x-request-id never does
    let with_id = DecideRequest {
        request_id: Some("req-7".into()),
        decision_id: Some("0123456789abcdef0123456789abcdef".into()),
        ..req(&k)
    };
    assert!(matches!(lab.decide(&with_id).await, DecideResponse::Allow { .. }));
    assert_eq!(lab.store.last_call().unwrap().request_id.as_str(), "0123456789abcdef0123456789abcdef");

    let third = lab.decide(&req(&k)).await;
    assert_eq!(denied(&third), (429, "rate_limited"));
    assert_eq!(header(&third, "retry-after"), Some("60"));
    assert!(matches!(&third, DecideResponse::Deny { limit: Some(l), .. } if l == "pm"));
    let key = lab.store.last_call().unwrap();
    let Check::Fixed { key, .. } = &key.limits[0].kind else { panic!() };
    assert_eq!(lab.store.taken(key.as_str()), 2, "the denied request took nothing");
}

#[tokio::test]
async fn when_the_limits_cannot_be_checked_each_limits_failure_mode_applies() {
    let lab = Lab::new(Duration::from_secs(60));
    let [open, closed, shadow] = lab.active_keys([("open", "two"), ("closed", "closed"), ("shadow", "shadow-closed")]);
    lab.cache_then_lose_the_store(&[&open, &closed, &shadow]).await;
    let r = lab.decide(&req(&open)).await;
    assert!(matches!(&r, DecideResponse::Allow { response_headers, ticket: None, .. } if response_headers.is_empty()), "{r:?}");
    let r = lab.decide(&req(&closed)).await;
    assert_eq!(denied(&r), (503, "limits_unavailable"));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert!(matches!(lab.decide(&req(&shadow)).await, DecideResponse::Allow { .. }), "a shadow limit never blocks");
}

#[tokio::test]
async fn a_local_limit_is_enforced_at_this_sidecars_share_while_the_store_is_down() {
    let lab = Lab::new(Duration::from_secs(60));
    let [k, mixed, leased] = lab.active_keys([("loc", "local"), ("mixed", "local-closed"), ("leased", "leased-local")]);
    lab.cache_then_lose_the_store(&[&k, &mixed, &leased]).await;
    // alone (no replica count configured or discovered): the whole limit, 3 — what Redis
    // counted before the outage is not known here
    for left in [2, 1, 0] {
        let r = lab.decide(&req(&k)).await;
        assert!(matches!(&r, DecideResponse::Allow { ticket: None, lease: None, .. }), "{r:?}");
        assert_eq!(header(&r, "ratelimit"), Some(format!("\"pm\";r={left};t=60").as_str()), "the local limit's headers");
    }
    let r = lab.decide(&req(&k)).await;
    assert_eq!(denied(&r), (429, "rate_limited"));
    assert_eq!(header(&r, "retry-after"), Some("60"));
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"pm\";q=3;w=60"));
    // a fail-closed limit in the plan decides first
    assert_eq!(denied(&lab.decide(&req(&mixed)).await), (503, "limits_unavailable"));
    // a renewal gets no lease and counts nothing; the request path then decides locally
    let renewal = DecideRequest { lease: Some(LeaseAsk { want: 50, renewal: true }), ..req(&leased) };
    for _ in 0..5 {
        assert!(matches!(lab.decide(&renewal).await, DecideResponse::Allow { lease: None, .. }));
    }
    let ask = DecideRequest { lease: Some(LeaseAsk { want: 50, renewal: false }), ..req(&leased) };
    let admitted = allowed_of(&lab, &ask, 150).await;
    assert_eq!(admitted, 100, "requests asking for a lease are decided locally, with no lease");
    // a new window: the share again
    lab.clock.advance(60_000);
    assert!(matches!(lab.decide(&req(&k)).await, DecideResponse::Allow { .. }));
}

/// How many of `n` decisions of `r` are allowed (without a lease).
async fn allowed_of(lab: &Lab, r: &DecideRequest, n: usize) -> usize {
    let mut allowed = 0;
    for _ in 0..n {
        match lab.decide(r).await {
            DecideResponse::Allow { lease: None, .. } => allowed += 1,
            DecideResponse::Allow { lease: Some(l), .. } => panic!("a lease while the store is down: {l:?}"),
            DecideResponse::Deny { .. } => {}
        }
    }
    allowed
}

#[tokio::test]
async fn a_cached_key_is_used_within_the_stale_grace_while_the_store_is_down() {
    // TTL 0: every cached answer is stale at once, usable only while the store cannot answer
    let lab = Lab::new(Duration::ZERO);
    let k = lab.key("k", "free", KeyStatus::Active);
    assert!(matches!(lab.decide(&req(&k)).await, DecideResponse::Allow { .. }));
    assert!(matches!(lab.decide(&req(&k)).await, DecideResponse::Allow { .. }));
    assert_eq!(lab.store.mem().record_reads, 2, "a stale answer is not used while the store answers");

    lab.store.set_down(true);
    let r = lab.decide(&req(&k)).await;
    assert!(matches!(&r, DecideResponse::Allow { cache_for_ms: None, .. }), "stale: allowed, but not to be reused: {r:?}");
    let never_seen = lab.key("new", "free", KeyStatus::Active);
    assert!(matches!(lab.decider.decide(&req(&never_seen)).await, Err(DecideError::Unavailable(_))));

    lab.store.set_down(false);
    let broken = lab.key("broken", "free", KeyStatus::Active);
    lab.store.mem().malformed.push(broken.as_str().to_string());
    assert_eq!(denied(&lab.decide(&req(&broken)).await), (401, "unknown_key"), "an unreadable record is no key");
}

/// A routing with `chat` (caching for 60 s, product `chat`) and `cheap` (plan `one` instead of
/// the key's); `acme` subscribes to `chat` when `subscribed`.
fn routing(subscribed: bool) -> Routing {
    let routes = HashMap::from([
        ("chat".to_string(), RouteEffect { product: Some(id("chat")), plan: None, cache: Some((id("chat"), 60_000)), llm: false }),
        ("cheap".to_string(), RouteEffect { product: None, plan: Some("one".into()), cache: None, llm: false }),
    ]);
    let products = if subscribed { ["chat".to_string()].into() } else { Default::default() };
    Routing::new(Default::default(), routes, HashMap::from([("acme".to_string(), products)]))
}

#[tokio::test]
async fn a_route_needs_a_subscription_to_its_product_and_may_override_the_plan() {
    let lab = Lab::new(Duration::from_secs(60));
    let k = lab.key("k", "free", KeyStatus::Active);
    lab.decider.set_routing(routing(false));
    let on = |route: &str| DecideRequest { route: Some(route.into()), ..req(&k) };
    assert_eq!(denied(&lab.decide(&on("chat")).await), (403, "not_subscribed"));
    assert!(lab.store.last_call().is_none());
    assert!(matches!(lab.decide(&on("unknown-route")).await, DecideResponse::Allow { .. }), "an unknown route has no effect");

    assert!(matches!(lab.decide(&on("cheap")).await, DecideResponse::Allow { .. }));
    assert_eq!(denied(&lab.decide(&on("cheap")).await), (429, "rate_limited"), "the route's plan (1 per window) applies");
    assert!(matches!(lab.decide(&req(&k)).await, DecideResponse::Allow { .. }), "elsewhere, the key's plan (none)");
}

fn stored(body: &str) -> String {
    serde_json::to_string(&StoredResponse::new(200, vec![], body.as_bytes().to_vec(), T0)).unwrap()
}

#[tokio::test]
async fn a_cache_lookup_misses_then_replays_and_is_a_miss_when_the_store_is_down() {
    let lab = Lab::new(Duration::from_secs(60));
    let k = lab.key("k", "free", KeyStatus::Active);
    lab.decider.set_routing(routing(true));
    let get = DecideRequest { route: Some("chat".into()), cache_key: Some("cd".repeat(32)), ..req(&k) };
    let DecideResponse::Allow { replay: None, store: Some(ticket), .. } = lab.decide(&get).await else { panic!() };
    let StoreTicket::Cache { ref route, ref hash, .. } = *ticket else { panic!("{ticket:?}") };
    assert_eq!((route.as_str(), hash.len()), ("chat", 64));
    let call = lab.store.last_call().unwrap();
    let Some(ScriptLookup::Cache { key }) = &call.lookup else { panic!("{call:?}") };
    assert!(call.limits.is_empty(), "a lookup alone still rides one script call");

    lab.store.mem().strings.insert(key.as_str().to_string(), stored("hello"));
    let DecideResponse::Allow { replay: Some(replay), store: None, .. } = lab.decide(&get).await else { panic!() };
    assert_eq!((replay.kind, replay.response.body.as_str()), (ReplayKind::Cache, "hello"));

    lab.store.mem().strings.insert(key.as_str().to_string(), "not json".into());
    assert!(matches!(lab.decide(&get).await, DecideResponse::Allow { replay: None, store: None, .. }), "unreadable: a miss, not written over");

    lab.store.set_down(true);
    assert!(matches!(lab.decide(&get).await, DecideResponse::Allow { replay: None, store: None, .. }), "fail-open: a miss, nothing stored");
}

#[tokio::test]
async fn an_idempotency_key_is_claimed_then_in_flight_reused_or_replayed() {
    let lab = Lab::new(Duration::from_secs(60));
    let k = lab.key("k", "two", KeyStatus::Active);
    let with = |digest: &str| DecideRequest {
        idempotency: Some(IdempotencyRequest { key: "order-42".into(), digest: digest.repeat(16) }),
        ..req(&k)
    };
    let DecideResponse::Allow { store: Some(ticket), .. } = lab.decide(&with("0a")).await else { panic!() };
    assert!(matches!(*ticket, StoreTicket::Idempotency { .. }));
    assert_eq!(denied(&lab.decide(&with("0a")).await), (409, "idempotency_in_flight"));
    assert_eq!(denied(&lab.decide(&with("0b")).await), (422, "idempotency_key_reused"));
    let first = lab.store.mem().calls[0].clone();
    let Some(ScriptLookup::Idempotency { memo, .. }) = &first.lookup else { panic!() };
    let Check::Fixed { key, .. } = &first.limits[0].kind else { panic!() };
    assert_eq!(lab.store.taken(key.as_str()), 1, "409 and 422 take nothing");

    lab.store.mem().strings.insert(memo.as_str().to_string(), stored("done"));
    let DecideResponse::Allow { replay: Some(replay), .. } = lab.decide(&with("0a")).await else { panic!() };
    assert_eq!((replay.kind, replay.response.body.as_str()), (ReplayKind::Idempotency, "done"));
    assert_eq!(denied(&lab.decide(&with("0a")).await), (429, "rate_limited"), "a replay still takes from the limits");
}

#[tokio::test]
async fn leases_are_taken_with_the_request_and_renewals_admit_none() {
    let lab = Lab::new(Duration::from_secs(60));
    let k = lab.key("k", "leased", KeyStatus::Active);
    let ask = |want, renewal| DecideRequest { lease: Some(LeaseAsk { want, renewal }), ..req(&k) };
    let DecideResponse::Allow { lease: Some(lease), no_lease, .. } = lab.decide(&ask(10, false)).await else { panic!() };
    assert!(!no_lease, "a leasable plan");
    assert_eq!((lease.units, lease.ttl_ms), (10, 500));
    assert_eq!(lease.response_headers.len(), 1, "the policy only");
    let call = lab.store.last_call().unwrap();
    let Check::Fixed { key, .. } = &call.limits[0].kind else { panic!() };
    assert_eq!(lab.store.taken(key.as_str()), 11, "the request and its lease");

    let DecideResponse::Allow { lease: Some(lease), .. } = lab.decide(&ask(10, true)).await else { panic!() };
    assert_eq!(lease.units, 10);
    assert_eq!(lab.store.taken(key.as_str()), 21, "a renewal takes the lease alone");
    // at most 1/2 of what is left: (100 - 21 - 1) / 2 = 39
    let DecideResponse::Allow { lease: Some(lease), .. } = lab.decide(&ask(1_000, false)).await else { panic!() };
    assert_eq!(lease.units, 39);

    let exact = lab.key("exact", "two", KeyStatus::Active);
    let r = lab.decide(&DecideRequest { lease: Some(LeaseAsk { want: 10, renewal: false }), ..req(&exact) }).await;
    assert!(matches!(r, DecideResponse::Allow { lease: None, no_lease: true, .. }), "an exact plan is never leased, and says so");
    let r = lab.decide(&req(&exact)).await;
    assert!(matches!(r, DecideResponse::Allow { no_lease: true, .. }), "also when no lease was asked for: {r:?}");
    assert_eq!(lab.store.last_call().unwrap().lease, None);

    lab.store.mem().records.get_mut(k.as_str()).unwrap().status = KeyStatus::Revoked;
    lab.decider.evict(None);
    let calls = lab.store.mem().calls.len();
    assert_eq!(denied(&lab.decide(&ask(10, true)).await), (401, "revoked_key"), "the filter drops its lease");
    assert_eq!(lab.store.mem().calls.len(), calls, "no script call for a revoked key's renewal");
}

#[tokio::test]
async fn completions_settle_budgets_and_slots_and_refuse_bad_tickets() {
    let lab = Lab::new(Duration::from_secs(60));
    let mut ticket = Ticket::new(
        "acme",
        "req-1",
        vec![BudgetHold { limit: "tokens".into(), subject: "k.key_1".into(), period: 202511, reserved: 50, priced_at_ms: None }],
        vec![SlotHold { limit: "inflight".into(), subject: "k.key_1".into() }, SlotHold { limit: "other".into(), subject: "t".into() }],
    );
    let unsealed = lab.decider.complete(&Completion { ticket: ticket.clone(), status: 200, tokens: Some(0), llm: None }).await.unwrap_err();
    assert!(matches!(unsealed, super::complete::CompleteError::Refused(super::tickets::Refused::Mac)), "{unsealed}");
    lab.decider.tickets().seal(&mut ticket, T0, 0);
    let mut refund = ticket.clone();
    refund.budgets[0].reserved = 1_000_000;
    let altered = lab.decider.complete(&Completion { ticket: refund, status: 200, tokens: Some(0), llm: None }).await.unwrap_err();
    assert!(matches!(altered, super::complete::CompleteError::Refused(super::tickets::Refused::Mac)), "{altered}");
    assert!(lab.store.mem().completions.is_empty(), "nothing settled by a refused ticket");
    lab.decider.complete(&Completion { ticket: ticket.clone(), status: 200, tokens: Some(70), llm: None }).await.unwrap();
    let done = lab.store.mem().completions.clone();
    assert_eq!(done.len(), 2, "the budget with one slot, then the other slot");
    let (counter, reservation) = done[0].budget.clone().unwrap();
    assert_eq!((counter.as_str(), reservation.as_str()), ("q:tokens:{acme}:tokens:k.key_1:202511", "q:reserved:{acme}:tokens:k.key_1:req-1"));
    assert_eq!((done[0].actual, done[0].estimate), (70, 50));
    assert_eq!(done[0].slot.as_ref().map(|s| s.as_str()), Some("q:conc:{acme}:other:t"));
    assert_eq!((done[1].budget.is_none(), done[1].slot.as_ref().map(|s| s.as_str())), (true, Some("q:conc:{acme}:inflight:k.key_1")));

    assert!(done.iter().all(|c| c.marker_ttl_ms == super::tickets::COMPLETION_TICKET_TTL_MS), "the marker outlives the ticket");

    let mut bad = Ticket { budgets: vec![BudgetHold { period: 1, ..ticket.budgets[0].clone() }], ..ticket.clone() };
    lab.decider.tickets().seal(&mut bad, T0, 0);
    let err = lab.decider.complete(&Completion { ticket: bad, status: 200, tokens: None, llm: None }).await.unwrap_err();
    assert!(matches!(err, super::complete::CompleteError::BadTicket(f) if f == "budgets.period"));

    lab.clock.advance(super::tickets::COMPLETION_TICKET_TTL_MS + 1);
    let late = lab.decider.complete(&Completion { ticket, status: 200, tokens: Some(0), llm: None }).await.unwrap_err();
    assert!(matches!(late, super::complete::CompleteError::Refused(super::tickets::Refused::Expired)), "{late}");
    assert_eq!(lab.store.mem().completions.len(), 2, "nothing settled after the ticket expired");
}

#[tokio::test]
async fn a_revoked_keys_use_is_audited_once() {
    let lab = Lab::new(Duration::from_secs(60));
    let k = lab.key("gone", "free", KeyStatus::Revoked);
    assert_eq!(denied(&lab.decide(&req(&k)).await), (401, "revoked_key"));
    // the audit claim runs in a spawned task
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while lab.store.mem().audits.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    assert_eq!(lab.store.mem().audits, [id("key_gone")]);
    assert_eq!(denied(&lab.decide(&req(&k)).await), (401, "revoked_key"));
    tokio::task::yield_now().await;
    assert_eq!(lab.store.mem().audits.len(), 1, "audited lately: not asked again");
}

#[test]
fn a_decision_is_named_by_the_gateway_never_by_the_clients_request_id() {
    let with = |decision: Option<&str>, request: Option<&str>| DecideRequest {
        decision_id: decision.map(str::to_string),
        request_id: request.map(str::to_string),
        ..DecideRequest::default()
    };
    let filter_id = "0123456789abcdef0123456789abcdef";
    assert_eq!(super::decision_id(&with(Some(filter_id), Some("fixed-1"))).as_str(), filter_id);
    // no filter id: a fresh random one each time, never the client's
    let (a, b) = (super::decision_id(&with(None, Some("fixed-1"))), super::decision_id(&with(None, Some("fixed-1"))));
    assert_ne!(a, b);
    assert!(a.as_str().len() == 32 && a.as_str() != "fixed-1");
    // anything but 32 lowercase hex from the filter is replaced too
    for bad in ["fixed-1", "0123456789ABCDEF0123456789ABCDEF", "", "0123"] {
        let id = super::decision_id(&with(Some(bad), None));
        assert_ne!(id.as_str(), bad);
        assert_eq!(id.as_str().len(), 32);
    }
}

/// The filter's refund of a decision that left nothing (yet) is asked again behind a barrier, as
/// the sidecar's own late refunds are (decision 163): a Redis slower than the filter's patience
/// may run the decision's script after the refund, taking for a request nobody served.
#[tokio::test]
async fn a_filter_refund_that_finds_nothing_is_asked_again_after_a_barrier() {
    let lab = Lab::new(Duration::from_secs(60));
    let [hash] = lab.active_keys([("kr", "small")]);
    let abandoned = tollgate_wire::refunds::Abandoned { decision_id: "0123456789abcdef0123456789abcdef".into(), key_hash: hash.as_str().into() };
    let done = lab.decider.refund(&abandoned).await.unwrap();
    assert_eq!(done, crate::scripts::refund::Refunded::Nothing);
    assert_eq!(lab.store.mem().refunds.len(), 1);
    // the late refund's tries (0.5 s, then 1 s later): two more answers of "nothing" settle it
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while lab.store.mem().refunds.len() < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await; // the poll interval of a deadline-bounded wait
    }
    let asked = lab.store.mem().refunds.clone();
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert!(asked.iter().all(|(t, d)| t.as_str() == "acme" && d.as_str() == abandoned.decision_id));
}

/// Decision 181: when the decisions' connection was replaced since the script may have been
/// sent, two answers of "nothing" settle nothing: the replaced connection's socket may still
/// deliver the script. The refund is asked again past them (before, the third ask was the last).
#[tokio::test]
async fn a_late_refund_keeps_asking_when_the_connection_was_replaced() {
    let lab = Lab::new(Duration::from_secs(60));
    let [hash] = lab.active_keys([("kr", "small")]);
    lab.store.mem().replaced = true;
    let abandoned = tollgate_wire::refunds::Abandoned { decision_id: "0123456789abcdef0123456789abcdef".into(), key_hash: hash.as_str().into() };
    assert_eq!(lab.decider.refund(&abandoned).await.unwrap(), crate::scripts::refund::Refunded::Nothing);
    // the tries come 0.5, 1, 2 and 4 s apart: a fourth ask past two answers of "nothing"
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while lab.store.mem().refunds.len() < 4 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await; // the poll interval of a deadline-bounded wait
    }
    assert_eq!(lab.store.mem().refunds.len(), 4, "asked again past two answers of nothing");
}

/// Decision 208: plans and routing are swapped as one. Configuration A has route `cheap` naming
/// plan `one`; B has neither. Both limits are spent, so every decision is a 429 under A (the
/// route's plan) and under B (the key's plan `two`, the route unknown). A decision that read A's
/// routing with B's plans found no plan `one` — no limits — and was allowed; one allow is the
/// failure. Configurations flip on another thread while decisions run.
#[test]
fn a_decision_never_sees_a_route_with_the_plans_of_another_configuration() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let lab = Lab::new(Duration::from_secs(60));
    let decide = |r: &DecideRequest| runtime.block_on(lab.decide(r));
    let k = lab.key("k", "two", KeyStatus::Active);
    let raw: BTreeMap<String, PlanConfig> = toml::from_str(PLANS).unwrap();
    let without_one: BTreeMap<String, PlanConfig> = raw.iter().filter(|(id, _)| id.as_str() != "one").map(|(id, p)| (id.clone(), p.clone())).collect();
    let a = || (Plans::compile(&raw).unwrap(), routing(true));
    let b = || (Plans::compile(&without_one).unwrap(), Routing::new(Default::default(), HashMap::new(), HashMap::new()));
    let (plans, routes) = a();
    lab.decider.set_config(plans, routes);
    let cheap = DecideRequest { route: Some("cheap".into()), ..req(&k) };
    for r in [&cheap, &req(&k), &req(&k)] {
        assert!(matches!(decide(r), DecideResponse::Allow { .. }), "spending the limits");
    }
    assert_eq!(denied(&decide(&cheap)).0, 429);
    assert_eq!(denied(&decide(&req(&k))).0, 429);
    let done = std::sync::atomic::AtomicBool::new(false);
    let allowed = std::thread::scope(|s| {
        s.spawn(|| {
            let mut flips = 0usize;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let (plans, routes) = if flips.is_multiple_of(2) { b() } else { a() };
                lab.decider.set_config(plans, routes);
                flips += 1;
            }
        });
        let allowed = (0..20_000).filter(|_| matches!(decide(&cheap), DecideResponse::Allow { .. })).count();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        allowed
    });
    assert_eq!(allowed, 0, "decisions allowed without the limits of any one configuration");
}

/// Decisions 333-334: a request outside a key's scopes is 403 `key_scope` and takes nothing; a
/// key scoped by method or network gets no reusable answer (no cache hint, no lease), a key
/// scoped by route alone does; a use is noted for the last-use flusher.
#[tokio::test]
async fn scopes_refuse_before_the_limits_and_method_scoped_answers_are_never_reused() {
    let lab = Lab::new(Duration::from_secs(60));
    let scoped = |raw: &str, plan: &str, scopes: crate::scopes::KeyScopes| {
        let hash = lab.key(raw, plan, KeyStatus::Active);
        let mut r = lab.store.mem().records[hash.as_str()].clone();
        r.scopes = scopes;
        lab.store.put(&hash, r);
        hash
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let by_method = scoped("m", "free", crate::scopes::KeyScopes::from_lists(&[], &[], &s(&["GET"]), &[], &[]).unwrap());
    let by_route = scoped("r", "free", crate::scopes::KeyScopes::from_lists(&s(&["chat"]), &[], &[], &[], &[]).unwrap());
    let leased = scoped("l", "leased", crate::scopes::KeyScopes::from_lists(&[], &[], &[], &s(&["10.0.0.0/8"]), &[]).unwrap());
    // `req` is a POST with no route
    assert_eq!(denied(&lab.decide(&req(&by_method)).await), (403, "key_scope"));
    assert_eq!(denied(&lab.decide(&req(&by_route)).await), (403, "key_scope"));
    let get = DecideRequest { method: "GET".into(), ..req(&by_method) };
    match lab.decide(&get).await {
        DecideResponse::Allow { cache_for_ms, .. } => assert_eq!(cache_for_ms, None, "a method is not in the filter's cache key"),
        other => panic!("{other:?}"),
    }
    let on_chat = DecideRequest { route: Some("chat".into()), ..req(&by_route) };
    match lab.decide(&on_chat).await {
        DecideResponse::Allow { cache_for_ms, .. } => assert!(cache_for_ms.is_some(), "a route is: the answer may be reused"),
        other => panic!("{other:?}"),
    }
    // a network-scoped key on a leased plan: refused from elsewhere (its limit untouched), and
    // allowed from inside without a lease
    let from = |ip: &str| DecideRequest { client_ip: Some(ip.into()), lease: Some(LeaseAsk { want: 50, renewal: false }), ..req(&leased) };
    let calls = lab.store.mem().calls.len();
    assert_eq!(denied(&lab.decide(&from("192.168.1.1")).await), (403, "key_scope"));
    assert_eq!(lab.store.mem().calls.len(), calls, "a refused request reached the limits");
    match lab.decide(&from("10.1.2.3")).await {
        DecideResponse::Allow { lease, no_lease, .. } => assert!(lease.is_none() && no_lease, "a network is not in the lease's key"),
        other => panic!("{other:?}"),
    }
    let used: Vec<Id> = lab.decider.take_used().into_iter().map(|(_, id, _)| id).collect();
    assert!(used.contains(&id("key_m")) && used.contains(&id("key_l")), "{used:?}");
}
