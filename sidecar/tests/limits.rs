//! The limits engine against a real redis-server, with the clock driven by the test (no sleeps
//! through windows): each algorithm at its boundaries, denied-consumes-nothing, reservations and
//! reconciliation, crash-safe concurrency slots, shadow mode, failure modes, one round trip.

use crate::common::{Lab, T0};
use std::time::Duration;
use tollgate_sidecar::config::Config;
use tollgate_tests::poll_until;
use tollgate_tests::redis::command_calls;
use tollgate_wire::{Completion, DecideRequest, DecideResponse, Ticket};

/// A lab deciding by `plan_toml`; the key record stays cached: one round trip per decision.
fn lab(plan_toml: &str) -> Lab {
    Lab::start(plan_toml, T0, |cfg| cfg.cache.ttl = Duration::from_secs(600))
}

impl Lab {
    async fn call(&mut self) -> DecideResponse {
        self.call_on(None).await
    }

    async fn call_on(&mut self, route: Option<&str>) -> DecideResponse {
        self.n += 1;
        let req = DecideRequest {
            request_id: Some(format!("req-{}", self.n)),
            decision_id: None,
            client_ip: Some("10.0.0.1".into()),
            route: route.map(str::to_string),
            ..DecideRequest::new(self.key_hash.clone(), "GET", "api", "/")
        };
        self.decider.decide(&req).await.unwrap()
    }

    fn keys(&self, pattern: &str) -> Vec<String> {
        self.cmd(&["KEYS", pattern])
    }
}

fn allowed(r: &DecideResponse) -> bool {
    matches!(r, DecideResponse::Allow { .. })
}

/// (status, code, limit, retry-after) of a denial.
fn denial(r: &DecideResponse) -> (u16, String, Option<String>, Option<u64>) {
    match r {
        DecideResponse::Deny { status, error, limit, response_headers, .. } => (
            *status,
            error.clone(),
            limit.clone(),
            response_headers.iter().find(|h| h.name == "retry-after").map(|h| h.value.parse().unwrap()),
        ),
        other => panic!("expected a denial, got {other:?}"),
    }
}

fn header<'a>(r: &'a DecideResponse, name: &str) -> Option<&'a str> {
    match r {
        DecideResponse::Allow { response_headers, .. } | DecideResponse::Deny { response_headers, .. } => {
            response_headers.iter().find(|h| h.name == name).map(|h| h.value.as_str())
        }
    }
}

fn plan(limits: &str) -> String {
    format!("[[plans.p.limits]]\n{limits}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_admits_the_limit_then_resets_at_the_boundary() {
    let mut lab = lab(&plan("name = \"per-min\"\nalgorithm = \"fixed_window\"\nlimit = 3\nwindow = \"60s\"")).key("p").await;
    lab.clock.set(T0 + 45_000); // 15 s before the window ends
    for i in 0..3 {
        let r = lab.call().await;
        assert!(allowed(&r), "request {i}");
        assert_eq!(header(&r, "ratelimit"), Some(format!("\"per-min\";r={};t=15", 2 - i).as_str()));
        assert_eq!(header(&r, "ratelimit-policy"), Some("\"per-min\";q=3;w=60"));
    }
    let d = lab.call().await;
    assert_eq!(denial(&d), (429, "rate_limited".into(), Some("per-min".into()), Some(15)));
    lab.clock.set(T0 + 59_999);
    assert!(!allowed(&lab.call().await));
    lab.clock.set(T0 + 60_000);
    assert!(allowed(&lab.call().await), "a new window");
    // seed 004: TTL 120 s for a 60 s window
    let keys = lab.keys("rl:{acme}:per-min:*");
    assert_eq!(keys.len(), 2);
    for k in keys {
        let ttl: i64 = lab.cmd(&["TTL", &k]);
        assert!((110..=120).contains(&ttl), "{k} ttl {ttl}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_weights_the_previous_bucket() {
    let mut lab = lab(&plan("name = \"sw\"\nalgorithm = \"sliding_window\"\nlimit = 10\nwindow = \"60s\"")).key("p").await;
    lab.clock.set(T0 + 50_000);
    for _ in 0..10 {
        assert!(allowed(&lab.call().await));
    }
    assert!(!allowed(&lab.call().await));
    // 30 s into the next bucket the previous one weighs half: 5 estimated, 5 more fit.
    lab.clock.set(T0 + 90_000);
    for i in 0..5 {
        assert!(allowed(&lab.call().await), "request {i}");
    }
    let d = lab.call().await;
    assert_eq!(denial(&d).1, "rate_limited");
    assert!(denial(&d).3.unwrap() >= 1);
    // a full window later the old bucket is out of the estimate
    lab.clock.set(T0 + 180_000);
    assert!(allowed(&lab.call().await));
    for k in lab.keys("rate:{acme}:sw:*") {
        let ttl: i64 = lab.cmd(&["TTL", &k]);
        assert!((100..=120).contains(&ttl), "{k} ttl {ttl}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_refills_continuously() {
    // capacity 5, refilled from empty in 5 s: one token a second
    let mut lab = lab(&plan("name = \"rps\"\nalgorithm = \"token_bucket\"\nlimit = 5\nwindow = \"5s\"")).key("p").await;
    for _ in 0..5 {
        assert!(allowed(&lab.call().await));
    }
    let d = lab.call().await;
    assert_eq!(denial(&d), (429, "rate_limited".into(), Some("rps".into()), Some(1)));
    lab.clock.advance(999);
    assert!(!allowed(&lab.call().await));
    lab.clock.advance(1);
    assert!(allowed(&lab.call().await));
    assert!(!allowed(&lab.call().await));
    lab.clock.advance(60_000);
    for _ in 0..5 {
        assert!(allowed(&lab.call().await), "full again, never above capacity");
    }
    assert!(!allowed(&lab.call().await));
    let ttl: i64 = lab.cmd(&["PTTL", "q:rps:{acme}:rps:k.".to_string().as_str()]);
    assert_eq!(ttl, -2, "sanity: that key name does not exist");
    let k = &lab.keys("q:rps:{acme}:rps:*")[0];
    let ttl: i64 = lab.cmd(&["PTTL", k]);
    assert!((9_000..=10_000).contains(&ttl), "2 × the bucket's window: {ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_counts_each_request_for_exactly_one_window() {
    let mut lab = lab(&plan("name = \"log\"\nalgorithm = \"sliding_log\"\nlimit = 3\nwindow = \"10s\"")).key("p").await;
    for step in [0, 2_000, 4_000] {
        lab.clock.set(T0 + step);
        assert!(allowed(&lab.call().await));
    }
    lab.clock.set(T0 + 9_999);
    let d = lab.call().await;
    assert_eq!(denial(&d).3, Some(1), "the oldest entry leaves the window in 1 ms → Retry-After 1");
    lab.clock.set(T0 + 10_000);
    assert!(allowed(&lab.call().await), "the first request left the window");
    assert!(!allowed(&lab.call().await));
    let k = &lab.keys("rl:api:{acme}:log:*")[0];
    let n: i64 = lab.cmd(&["ZCARD", k]);
    assert_eq!(n, 3, "denied requests are not logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_request_consumes_nothing_from_any_limit() {
    let mut lab = lab(
        "[[plans.p.limits]]\nname = \"big\"\nalgorithm = \"fixed_window\"\nlimit = 100\n\
         [[plans.p.limits]]\nname = \"small\"\nalgorithm = \"fixed_window\"\nlimit = 2\n\
         [[plans.p.limits]]\nname = \"bucket\"\nalgorithm = \"token_bucket\"\nlimit = 100\nwindow = \"100s\"",
    )
    .key("p")
    .await;
    assert!(allowed(&lab.call().await));
    assert!(allowed(&lab.call().await));
    for _ in 0..5 {
        assert_eq!(denial(&lab.call().await).2, Some("small".into()));
    }
    let big: String = lab.cmd(&["GET", &lab.keys("rl:{acme}:big:*")[0]]);
    assert_eq!(big, "2", "the denied requests took nothing from 'big'");
    let tokens: String = lab.cmd(&["HGET", &lab.keys("q:rps:{acme}:bucket:*")[0], "tokens"]);
    assert_eq!(tokens, "98");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_decision_is_one_redis_round_trip() {
    let mut lab = lab(
        "[[plans.p.limits]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nlimit = 100\n\
         [[plans.p.limits]]\nname = \"b\"\nalgorithm = \"sliding_window\"\nlimit = 100\n\
         [[plans.p.limits]]\nname = \"c\"\nalgorithm = \"sliding_log\"\nlimit = 100\n\
         [[plans.p.limits]]\nname = \"d\"\nalgorithm = \"token_bucket\"\nlimit = 100",
    )
    .key("p")
    .await;
    assert!(allowed(&lab.call().await)); // warms the key cache and loads the script
    let _: () = lab.cmd(&["CONFIG", "RESETSTAT"]);
    for _ in 0..20 {
        assert!(allowed(&lab.call().await));
    }
    let stats = lab.redis.commandstats();
    let calls = |name: &str| command_calls(&stats, name);
    // commandstats also counts the commands run inside the script; the client sent exactly one
    // EVALSHA per decision and nothing else (the key record came from the sidecar's cache)
    assert_eq!(calls("evalsha"), 20, "{stats}");
    assert_eq!(calls("hgetall") + calls("eval") + calls("script"), 0, "{stats}");
}

fn ticket_of(r: &DecideResponse) -> Ticket {
    match r {
        DecideResponse::Allow { ticket: Some(t), .. } => t.clone(),
        other => panic!("expected an allow with a ticket, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budget_reserves_then_reconciles_refunds_and_overruns() {
    let mut lab = lab(&plan("name = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 1000\nestimate = 400")).key("p").await;
    let t1 = ticket_of(&lab.call().await);
    let t2 = ticket_of(&lab.call().await);
    let d = lab.call().await;
    assert_eq!(denial(&d).1, "quota_exceeded");
    let counter = lab.keys("q:tokens:{acme}:tokens:*")[0].clone();
    assert!(counter.ends_with(":202611"), "{counter}");
    let used = |lab: &Lab| -> i64 { lab.cmd(&["GET", &counter]) };
    assert_eq!(used(&lab), 800, "two reservations of 400");
    let ttl: i64 = lab.cmd(&["TTL", &counter]);
    assert!(ttl > 39 * 86400 && ttl <= 40 * 86400, "40-day TTL: {ttl}");
    let res = lab.keys(&format!("q:reserved:{{acme}}:tokens:*:{}", t1.request_id)).remove(0);
    let rttl: i64 = lab.cmd(&["TTL", &res]);
    assert!((290..=300).contains(&rttl), "5-minute reservation TTL: {rttl}");

    // refund: used 100 of 400
    lab.decider.complete(&Completion { ticket: t1.clone(), status: 200, tokens: Some(100), llm: None }).await.unwrap();
    assert_eq!(used(&lab), 500);
    // the same report again (a retried batch) changes nothing
    lab.decider.complete(&Completion { ticket: t1.clone(), status: 200, tokens: Some(100), llm: None }).await.unwrap();
    assert_eq!(used(&lab), 500);
    // overrun: used 700 of 400
    lab.decider.complete(&Completion { ticket: t2, status: 200, tokens: Some(700), llm: None }).await.unwrap();
    assert_eq!(used(&lab), 800);
    // 800 used: another 400 does not fit, and the denial reserved nothing
    assert_eq!(denial(&lab.call().await).1, "quota_exceeded");
    assert_eq!(used(&lab), 800);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_budget_of_a_request_reserves_and_settles_on_its_own() {
    // A key's monthly budget and its tenant's: one request reserves from both.
    let toml = "[[plans.p.limits]]\nname = \"per-key\"\nalgorithm = \"token_budget\"\nlimit = 100000\nestimate = 400\n\
                [[plans.p.limits]]\nname = \"per-tenant\"\nalgorithm = \"token_budget\"\nlimit = 500000\nestimate = 400\nsubject = \"tenant\"\n";
    let mut lab = lab(toml).key("p").await;
    let counter = |lab: &Lab, name: &str| -> i64 {
        let keys = lab.keys(&format!("q:tokens:{{acme}}:{name}:*"));
        assert_eq!(keys.len(), 1, "{name}: {keys:?}");
        lab.cmd(&["GET", &keys[0]])
    };
    let t1 = ticket_of(&lab.call().await);
    let t2 = ticket_of(&lab.call().await);
    assert_eq!(t1.budgets.len(), 2, "{t1:?}");
    assert_eq!((counter(&lab, "per-key"), counter(&lab, "per-tenant")), (800, 800), "two reservations of 400 in each");
    // one reservation per budget and decision
    assert_eq!(lab.keys(&format!("q:reserved:{{acme}}:*:{}", t1.request_id)).len(), 2);

    // each budget settles at the actual usage: 100 used of 400, then 700 of 400
    lab.decider.complete(&Completion { ticket: t1.clone(), status: 200, tokens: Some(100), llm: None }).await.unwrap();
    assert_eq!((counter(&lab, "per-key"), counter(&lab, "per-tenant")), (500, 500));
    lab.decider.complete(&Completion { ticket: t2.clone(), status: 200, tokens: Some(700), llm: None }).await.unwrap();
    assert_eq!((counter(&lab, "per-key"), counter(&lab, "per-tenant")), (800, 800), "both meters at 100 + 700 used");
    // idempotent: the same reports again (a retried batch) change nothing
    for t in [t1, t2] {
        lab.decider.complete(&Completion { ticket: t, status: 200, tokens: Some(100), llm: None }).await.unwrap();
    }
    assert_eq!((counter(&lab, "per-key"), counter(&lab, "per-tenant")), (800, 800));
    let settled: Vec<String> = lab.keys("q:reserved:*").iter().map(|k| lab.cmd(&["GET", k])).collect();
    assert_eq!(settled, vec!["settled"; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreconciled_reservation_stays_charged() {
    let mut lab = lab(&plan("name = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 100000\nestimate = 400")).key("p").await;
    let a = ticket_of(&lab.call().await);
    let b = ticket_of(&lab.call().await);
    let c = ticket_of(&lab.call().await);
    let counter = lab.keys("q:tokens:{acme}:tokens:*")[0].clone();
    // the reservations of a and b expire (their completion came too late)
    for t in [&a, &b] {
        let res = lab.keys(&format!("q:reserved:{{acme}}:tokens:*:{}", t.request_id)).remove(0);
        let _: i64 = lab.cmd(&["PEXPIRE", &res, "1"]);
    }
    poll_until("reservations to expire", Duration::from_secs(5), || lab.keys("q:reserved:*").len() == 1);
    // late report of a smaller use: no refund (never under-charge)
    lab.decider.complete(&Completion { ticket: a, status: 200, tokens: Some(100), llm: None }).await.unwrap();
    let used: i64 = lab.cmd(&["GET", &counter]);
    assert_eq!(used, 1200);
    // late report of a larger use: the overrun is still charged
    lab.decider.complete(&Completion { ticket: b, status: 200, tokens: Some(900), llm: None }).await.unwrap();
    let used: i64 = lab.cmd(&["GET", &counter]);
    assert_eq!(used, 1700);
    // a report without usage keeps the reservation as the charge
    lab.decider.complete(&Completion { ticket: c, status: 502, tokens: None, llm: None }).await.unwrap();
    let used: i64 = lab.cmd(&["GET", &counter]);
    assert_eq!(used, 1700);
    // every key written carries a TTL
    for k in lab.keys("q:*") {
        let ttl: i64 = lab.cmd(&["PTTL", &k]);
        assert!(ttl > 0, "{k} has no TTL");
    }
}

/// Decision 177: a token budget's limit may be any u64 (here i64::MAX, as much as TOML holds), and its counter may be pushed to Redis's
/// i64 bound by overruns. Before, `limit - used` above 2^63 came back from the script as 0 (the
/// RateLimit header said the budget was spent from the first request), and a counter near the
/// bound made the script's INCRBY fail: every decision of the plan fell to its failure mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_of_any_size_or_a_counter_at_its_bound_still_decides() {
    let limits = "name = \"pm\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"60s\"\n\
                  [[plans.p.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 9223372036854775807\nestimate = 400";
    let mut lab = lab(&plan(limits)).key("p").await;
    let r = lab.call().await;
    assert!(allowed(&r), "{r:?}");
    // the nearest limit is the window's (999 left), not a budget that reads as spent
    assert!(header(&r, "ratelimit").is_some_and(|h| h.starts_with("\"pm\";r=999")), "{:?}", header(&r, "ratelimit"));
    let counter = lab.keys("q:tokens:{acme}:tokens:*")[0].clone();
    let _: () = lab.cmd(&["SET", &counter, &(i64::MAX - 10).to_string()]);
    let r = lab.call().await;
    assert_eq!(denial(&r).1, "quota_exceeded", "a spent budget, not the failure mode");
    let window = lab.keys("rl:{acme}:pm:*")[0].clone();
    let taken: i64 = lab.cmd(&["GET", &window]);
    assert_eq!(taken, 1, "the denied request took nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_slots_free_on_completion_or_by_themselves() {
    let mut lab = lab(&plan("name = \"conc\"\nalgorithm = \"concurrency\"\nlimit = 2\nwindow = \"30s\"")).key("p").await;
    let a = ticket_of(&lab.call().await);
    let _b = ticket_of(&lab.call().await);
    assert_eq!(denial(&lab.call().await), (429, "concurrency_limited".into(), Some("conc".into()), Some(1)));
    lab.decider.complete(&Completion { ticket: a, status: 200, tokens: None, llm: None }).await.unwrap();
    let _c = ticket_of(&lab.call().await);
    assert!(!allowed(&lab.call().await));
    // b and c never complete (their Envoy crashed): 30 s later their slots are free again
    lab.clock.advance(29_999);
    assert!(!allowed(&lab.call().await));
    lab.clock.advance(2);
    assert!(allowed(&lab.call().await));
    assert!(allowed(&lab.call().await));
    assert!(!allowed(&lab.call().await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_limit_counts_but_never_blocks() {
    let mut lab = lab(&plan("name = \"trial\"\nalgorithm = \"fixed_window\"\nlimit = 2\nshadow = true")).key("p").await;
    for _ in 0..5 {
        assert!(allowed(&lab.call().await));
    }
    let n: String = lab.cmd(&["GET", &lab.keys("rl:{acme}:trial:*")[0]]);
    assert_eq!(n, "5", "shadow limits still count");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_applies_each_limits_failure_mode_within_the_timeout() {
    let cfg = "[[plans.open.limits]]\nname = \"o\"\nalgorithm = \"fixed_window\"\nlimit = 5\n\
               [[plans.closed.limits]]\nname = \"o\"\nalgorithm = \"fixed_window\"\nlimit = 5\n\
               [[plans.closed.limits]]\nname = \"c\"\nalgorithm = \"token_bucket\"\nlimit = 5\nfailure_mode = \"closed\"";
    let mut open = lab(cfg).key("open").await;
    let mut closed = lab(cfg).key("closed").await;
    assert!(allowed(&open.call().await));
    assert!(allowed(&closed.call().await));
    open.redis.kill();
    closed.redis.kill();
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let r = open.call().await;
        assert!(matches!(&r, DecideResponse::Allow { response_headers, .. } if response_headers.is_empty()), "{r:?}");
        let r = closed.call().await;
        assert_eq!(denial(&r).0, 503);
        assert_eq!(denial(&r).1, "limits_unavailable");
        assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_applies_its_plan_override_and_requires_the_products_subscription() {
    use serde_json::json;
    use tollgate_sidecar::control::model::{Change, Kind, Snapshot};
    let toml = "[[plans.p.limits]]\nname = \"roomy\"\nalgorithm = \"fixed_window\"\nlimit = 1000\nwindow = \"60s\"\n\
                [[plans.strict.limits]]\nname = \"tight\"\nalgorithm = \"fixed_window\"\nlimit = 2\nwindow = \"60s\"\n";
    let mut lab = lab(toml).key("p").await;
    let cfg = Config::from_toml(toml).unwrap();
    let mut s = Snapshot { plans: cfg.plans.clone(), ..Snapshot::default() };
    for change in [
        Change::Put(Kind::Products, json!({"id": "chat"})),
        Change::Put(Kind::Products, json!({"id": "paid"})),
        Change::Put(Kind::Tenants, json!({"id": "acme", "products": ["chat"]})),
        Change::Put(Kind::Routes, json!({"id": "r_chat", "cluster": "a", "product": "chat", "plan": "strict"})),
        Change::Put(Kind::Routes, json!({"id": "r_paid", "cluster": "a", "product": "paid"})),
    ] {
        s = s.apply(&change).unwrap();
    }
    lab.decider.set_routing(tollgate_sidecar::decision::Routing::of(&s, 1));

    // the route's plan: two, then the override's limit denies, naming it
    assert!(allowed(&lab.call_on(Some("r_chat")).await));
    assert!(allowed(&lab.call_on(Some("r_chat")).await));
    assert_eq!(denial(&lab.call_on(Some("r_chat")).await).2.as_deref(), Some("tight"));
    // the key's own plan elsewhere, and for a route this replica does not know
    assert!(allowed(&lab.call_on(None).await));
    assert!(allowed(&lab.call_on(Some("r_new")).await));
    assert_eq!(header(&lab.call_on(None).await, "ratelimit-policy").map(|p| p.contains("roomy")), Some(true));
    // a product the tenant does not subscribe to
    let d = denial(&lab.call_on(Some("r_paid")).await);
    assert_eq!((d.0, d.1.as_str()), (403, "not_subscribed"));
}

/// Decision 180: limits of one name in two plans (a key's plan and a route's override) keep
/// their own state. Before, a concurrency cap's set was pruned by the window of whichever plan
/// the request had (the 300 s plan freed the 3600 s plan's live slots: a third and a fourth
/// admitted under a cap of 2), and a token bucket refilled at whichever plan's rate came last
/// (the 3-an-hour bucket read the 1000-a-second one's tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_of_one_name_in_two_plans_keep_their_own_state() {
    use serde_json::json;
    use tollgate_sidecar::control::model::{Change, Kind, Snapshot};
    let toml = "[[plans.p.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 2\nwindow = \"300s\"\n\
                [[plans.p.limits]]\nname = \"rate\"\nalgorithm = \"token_bucket\"\nlimit = 1000\nwindow = \"1s\"\n\
                [[plans.long.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 2\nwindow = \"3600s\"\n\
                [[plans.long.limits]]\nname = \"rate\"\nalgorithm = \"token_bucket\"\nlimit = 3\nwindow = \"3600s\"\n";
    let mut lab = lab(toml).key("p").await;
    let cfg = Config::from_toml(toml).unwrap();
    let mut s = Snapshot { plans: cfg.plans.clone(), ..Snapshot::default() };
    for change in [
        Change::Put(Kind::Products, json!({"id": "jobs"})),
        Change::Put(Kind::Tenants, json!({"id": "acme", "products": ["jobs"]})),
        Change::Put(Kind::Routes, json!({"id": "r_long", "cluster": "a", "product": "jobs", "plan": "long"})),
    ] {
        s = s.apply(&change).unwrap();
    }
    lab.decider.set_routing(tollgate_sidecar::decision::Routing::of(&s, 1));

    // two long jobs start; 301 s later both still run: the key has two in flight, whichever plan
    let jobs = [ticket_of(&lab.call_on(Some("r_long")).await), ticket_of(&lab.call_on(Some("r_long")).await)];
    lab.clock.advance(301_000);
    assert_eq!(denial(&lab.call_on(None).await).1, "concurrency_limited");
    assert_eq!(denial(&lab.call_on(Some("r_long")).await).1, "concurrency_limited");
    for ticket in jobs {
        lab.decider.complete(&Completion { ticket, status: 200, tokens: None, llm: None }).await.unwrap();
    }
    // the long plan's bucket kept its own tokens (3 - 2, plus 301 s of 3 an hour): one more
    let fast = lab.call_on(None).await;
    lab.decider.complete(&Completion { ticket: ticket_of(&fast), status: 200, tokens: None, llm: None }).await.unwrap();
    let one = lab.call_on(Some("r_long")).await;
    lab.decider.complete(&Completion { ticket: ticket_of(&one), status: 200, tokens: None, llm: None }).await.unwrap();
    let d = denial(&lab.call_on(Some("r_long")).await);
    assert_eq!((d.1.as_str(), d.2.as_deref()), ("rate_limited", Some("rate")), "{d:?}");
}

/// Settings of `toml` for deciders of their own on `redis` (no sidecar process).
fn settings_on(redis: &tollgate_tests::Redis, toml: &str) -> Config {
    let mut cfg = Config::from_toml(toml).unwrap();
    cfg.redis.url = redis.url();
    cfg.redis.timeout = Duration::from_millis(500);
    cfg.redis.decision_timeout = Duration::from_secs(2); // not 20 ms: see common::Lab::start
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_count_each_other_in_redis_and_then_each_keeps_its_share_of_a_local_limit() {
    use std::sync::Arc;
    use tollgate_sidecar::clock::ManualClock;
    use tollgate_sidecar::decision::{limits::Plans, replicas, Decider};
    use tollgate_sidecar::{apikey, keys::Id, store::Store};
    use tollgate_tests::Redis;
    let toml = "[[plans.loc.limits]]\nname = \"l\"\nalgorithm = \"fixed_window\"\nlimit = 7\nwindow = \"1h\"\nfailure_mode = \"local\"";
    let redis = Redis::start();
    let mut cfg = settings_on(&redis, toml);
    cfg.cache.ttl = Duration::from_secs(600);
    let clock = Arc::new(ManualClock::new(T0));
    let stop = tokio_util::sync::CancellationToken::new();
    // two sidecars on one Redis, each with its heartbeat
    let sidecars: Vec<Arc<Decider>> = (0..2)
        .map(|_| {
            let store = Store::new(&cfg.redis).unwrap();
            let d = Arc::new(Decider::new(store.clone(), &cfg.cache, Plans::compile(&cfg.plans).unwrap(), clock.clone()));
            tokio::spawn(replicas::run(store, d.clone(), stop.clone()));
            d
        })
        .collect();
    tokio::task::block_in_place(|| {
        poll_until("both sidecars count 2", Duration::from_secs(10), || sidecars.iter().all(|d| d.local().replicas() == 2))
    });
    let members: Vec<String> = redis.cmd(&["ZRANGE", "sidecars:live", "0", "-1"]);
    assert_eq!(members.len(), 2, "{members:?}");
    let ttl: i64 = redis.cmd(&["PTTL", "sidecars:live"]);
    assert!(ttl > 0 && ttl <= 10_000, "{ttl}");

    let store = Store::new(&cfg.redis).unwrap();
    let issued = apikey::issue(Id::parse("acme").unwrap(), Id::parse("loc").unwrap(), 1, None);
    store.create_key(&issued.hash, &issued.record).await.unwrap();
    let req = DecideRequest::new(issued.hash.as_str().to_string(), "GET", "api", "/");
    for d in &sidecars {
        assert!(allowed(&d.decide(&req).await.unwrap()), "the key record is cached");
    }
    let mut redis = redis;
    redis.kill();
    let mut admitted = Vec::new();
    for d in &sidecars {
        let mut n = 0;
        for _ in 0..10 {
            match d.decide(&req).await.unwrap() {
                DecideResponse::Allow { .. } => n += 1,
                r => assert_eq!(denial(&r).0, 429),
            }
        }
        admitted.push(n);
    }
    assert_eq!(admitted, vec![3, 3], "floor(7 / 2) each, the count discovered before Redis went");
    stop.cancel();
}

/// Two sidecars whose clocks differ (here by 30 s, frozen) take turns on one token bucket: the
/// bucket's stamp never goes back, so the one behind refills nothing and the one ahead never
/// refills the same span twice. Before, each turn of the one ahead refilled the skew again: a
/// bucket of 10 a minute admitted without bound (decision 158). A minute's window: the bucket's
/// TTL (two windows of Redis' own time) outlives a slow run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bucket_shared_by_sidecars_whose_clocks_differ_never_refills_the_skew_twice() {
    use std::sync::Arc;
    use tollgate_sidecar::clock::ManualClock;
    use tollgate_sidecar::decision::{limits::Plans, Decider};
    use tollgate_sidecar::{apikey, keys::Id, store::Store};
    use tollgate_tests::Redis;
    let toml = "[[plans.b.limits]]\nname = \"b\"\nalgorithm = \"token_bucket\"\nlimit = 10\nwindow = \"60s\"";
    let redis = Redis::start();
    let cfg = settings_on(&redis, toml);
    let sidecars: Vec<Decider> = [T0 + 30_000, T0]
        .into_iter()
        .map(|t| Decider::new(Store::new(&cfg.redis).unwrap(), &cfg.cache, Plans::compile(&cfg.plans).unwrap(), Arc::new(ManualClock::new(t))))
        .collect();
    let store = Store::new(&cfg.redis).unwrap();
    let issued = apikey::issue(Id::parse("acme").unwrap(), Id::parse("b").unwrap(), 1, None);
    store.create_key(&issued.hash, &issued.record).await.unwrap();
    let req = DecideRequest::new(issued.hash.as_str().to_string(), "GET", "api", "/");
    let mut admitted = 0;
    for i in 0..100 {
        match sidecars[i % 2].decide(&req).await.unwrap() {
            DecideResponse::Allow { .. } => admitted += 1,
            r => assert_eq!(denial(&r).0, 429),
        }
    }
    // the capacity, and at most the skew's refill (5 tokens) once
    assert!((10..=15).contains(&admitted), "{admitted} admitted with frozen clocks");
}
