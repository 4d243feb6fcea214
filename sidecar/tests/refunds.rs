//! Refunds of abandoned decisions (issue 15.2) against a real redis-server, with the clock driven
//! by the test: for every algorithm (fixed, sliding, bucket, log, budget, concurrency), a leased
//! grant and an idempotency claim, an allowed decision refunded leaves Redis exactly as it was
//! before the decision; a second refund changes nothing; a refund of a denied or unknown decision
//! changes nothing; a refund after a completion gives nothing back; a late bucket refund never
//! gives back what a refill to capacity absorbed.

use crate::common::{Lab, T0};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tollgate_sidecar::apikey::KeyRecord;
use tollgate_sidecar::config::Config;
use tollgate_sidecar::decision::limits::Plans;
use tollgate_sidecar::decision::{Decider, DecisionStore};
use tollgate_sidecar::keys::{Id, KeyHash};
use tollgate_sidecar::scripts::complete::{CompleteCall, Settled};
use tollgate_sidecar::scripts::decide::{DecideCall, DecideReply};
use tollgate_sidecar::scripts::refund::Refunded;
use tollgate_sidecar::scripts::ScriptError;
use tollgate_sidecar::store::{Store, StoreError};
use tollgate_tests::fixtures::limit_toml;
use tollgate_wire::refunds::Abandoned;
use tollgate_wire::responses::IdempotencyRequest;
use tollgate_wire::{Completion, DecideRequest, DecideResponse, LeaseAsk};

/// A lab deciding by `limits` (plan `p`), its key issued.
async fn lab(limits: &str) -> Lab {
    let lab = Lab::start(limits, T0, |cfg| {
        cfg.cache.ttl = Duration::from_secs(600);
    });
    lab.key("p").await
}

impl Lab {
    /// The next request of a decision the filter named, and its id.
    fn named(&mut self, f: impl FnOnce(DecideRequest) -> DecideRequest) -> (String, DecideRequest) {
        self.n += 1;
        let id = format!("{:032x}", 0xdec0_0000u64 + u64::from(self.n));
        let req = DecideRequest { decision_id: Some(id.clone()), client_ip: Some("10.0.0.1".into()), ..DecideRequest::new(self.key_hash.clone(), "POST", "api", "/") };
        (id, f(req))
    }

    /// A decision the filter named; returns its id and the answer.
    async fn decide_with(&mut self, f: impl FnOnce(DecideRequest) -> DecideRequest) -> (String, DecideResponse) {
        let (id, req) = self.named(f);
        let answer = self.decider.decide(&req).await.unwrap();
        (id, answer)
    }

    /// A decider over the lab's Redis, clock and plans (`limits`, as the lab was started with)
    /// whose store sends every `decide.lua` call twice, and the replies it got.
    fn sent_twice(&self, limits: &str) -> (Decider<SentTwice>, Arc<Mutex<Vec<DecideReply>>>) {
        let mut cfg = Config::from_toml(limits).unwrap();
        cfg.cache.ttl = Duration::from_secs(600);
        let store = SentTwice { store: self.store.clone(), replies: Arc::default() };
        let replies = store.replies.clone();
        (Decider::new(store, &cfg.cache, Plans::compile(&cfg.plans).unwrap(), self.clock.clone()), replies)
    }

    async fn decide(&mut self) -> (String, DecideResponse) {
        self.decide_with(|r| r).await
    }

    async fn refund(&self, id: &str) -> Refunded {
        self.decider.refund(&Abandoned { decision_id: id.into(), key_hash: self.key_hash.clone() }).await.unwrap()
    }

    /// Every key but the key records, with its value (strings, hashes, zsets with scores).
    fn state(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for k in self.redis.keys("*") {
            if k.starts_with("apikey") {
                continue;
            }
            let kind: String = self.redis.cmd(&["TYPE", &k]);
            let value = match kind.as_str() {
                "string" => self.redis.cmd::<String>(&["GET", &k]),
                "hash" => format!("{:?}", self.redis.cmd::<BTreeMap<String, String>>(&["HGETALL", &k])),
                "zset" => format!("{:?}", self.redis.cmd::<Vec<String>>(&["ZRANGE", &k, "0", "-1", "WITHSCORES"])),
                other => panic!("unexpected {other} at {k}"),
            };
            out.insert(k, value);
        }
        out
    }
}

fn allowed(r: &DecideResponse) -> bool {
    matches!(r, DecideResponse::Allow { .. })
}

fn limit(name: &str, algorithm: &str, limit: u64, extra: &str) -> String {
    limit_toml("p", name, algorithm, limit, extra)
}

/// A plan with a limit of every kind (two token budgets, per key and per tenant): 7 limits.
fn every_kind() -> String {
    [
        limit("fw", "fixed_window", 5, ""),
        limit("sw", "sliding_window", 5, ""),
        limit("tb", "token_bucket", 5, ""),
        limit("log", "sliding_log", 5, ""),
        limit("bud", "token_budget", 100_000, ""),
        limit("bud2", "token_budget", 100_000, "subject = \"tenant\""),
        limit("conc", "concurrency", 5, ""),
    ]
    .concat()
}

/// Decide (allowed) → refund → Redis as before the decision; refunding again, or a denied or
/// unknown decision, changes nothing.
async fn refunded_as_if_it_never_came(limits: &str, lines: u64) {
    let mut lab = lab(limits).await;
    let (_, warm) = lab.decide().await; // a decision that stays: the state has something in it
    assert!(allowed(&warm), "{warm:?}");
    let before = lab.state();
    let (id, r) = lab.decide().await;
    assert!(allowed(&r), "{r:?}");
    let taken = lab.state();
    assert_ne!(taken, before, "the decision took something");
    assert!(taken.contains_key(&format!("dec:{{acme}}:{id}")), "its record: {taken:?}");
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines });
    assert_eq!(lab.state(), before, "{limits}: as if the decision never came");
    assert_eq!(lab.refund(&id).await, Refunded::Nothing, "a second refund is a no-op");
    assert_eq!(lab.state(), before);
    assert_eq!(lab.refund(&format!("{:032x}", 7)).await, Refunded::Nothing, "an unknown decision");
    assert_eq!(lab.state(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_is_given_back_exactly_once() {
    refunded_as_if_it_never_came(&limit("fw", "fixed_window", 5, "window = \"60s\""), 1).await;
    refunded_as_if_it_never_came(&limit("sw", "sliding_window", 5, "window = \"60s\""), 1).await;
    refunded_as_if_it_never_came(&limit("tb", "token_bucket", 5, "window = \"10s\"\ncost = 2"), 1).await;
    refunded_as_if_it_never_came(&limit("log", "sliding_log", 5, "window = \"60s\"\ncost = 2"), 1).await;
    refunded_as_if_it_never_came(&limit("bud", "token_budget", 100_000, "estimate = 700"), 1).await;
    refunded_as_if_it_never_came(&limit("conc", "concurrency", 5, ""), 1).await;
    // every kind in one decision, one record, one refund
    refunded_as_if_it_never_came(&every_kind(), 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_grant_is_given_back_with_the_request() {
    let mut lab = lab(&limit("fw", "fixed_window", 100, "mode = \"leased\"")).await;
    let before = lab.state();
    let (id, r) = lab.decide_with(|req| DecideRequest { lease: Some(LeaseAsk { want: 20, renewal: false }), ..req }).await;
    let DecideResponse::Allow { lease: Some(l), .. } = &r else { panic!("no lease: {r:?}") };
    assert!(l.units > 0);
    let counter = lab.redis.keys("rl:{acme}:fw:*");
    assert_eq!(lab.redis.cmd::<u64>(&["GET", &counter[0]]), 1 + l.units, "the request and its lease");
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 1 });
    let after = lab.state();
    assert_eq!(after.get(&counter[0]).map(String::as_str), Some("0"), "{after:?}");
    assert_eq!(after.len(), before.len() + 1, "only the emptied counter remains");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_claim_is_released_only_while_it_is_the_decisions() {
    let mut lab = lab(&limit("fw", "fixed_window", 5, "")).await;
    lab.decide().await;
    let before = lab.state();
    let idem = |key: &str| IdempotencyRequest { key: key.into(), digest: "0a".repeat(16) };
    let (id, r) = lab.decide_with(|req| DecideRequest { idempotency: Some(idem("order-1")), ..req }).await;
    assert!(allowed(&r), "{r:?}");
    assert_eq!(lab.redis.keys("idem:*").len(), 2, "owner and in-flight memo");
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 2 });
    assert_eq!(lab.state(), before, "the claim and the window unit are back");
    // the key can be claimed again right away (not 409 in flight)
    let (_, again) = lab.decide_with(|req| DecideRequest { idempotency: Some(idem("order-1")), ..req }).await;
    let DecideResponse::Allow { store: Some(_), .. } = again else { panic!("not claimed: {again:?}") };

    // a claim that is no longer the decision's (its memo replaced) is left alone
    let (id, _) = lab.decide_with(|req| DecideRequest { idempotency: Some(idem("order-2")), ..req }).await;
    let memo = lab.redis.keys("idem:api:{acme}:*:order-2").pop().unwrap();
    let _: () = lab.redis.cmd(&["SET", &memo, "{\"status\":200}"]);
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 2 });
    assert_eq!(lab.redis.cmd::<String>(&["GET", &memo]), "{\"status\":200}", "someone else's outcome stays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_decision_and_a_completed_one_are_not_refunded() {
    let mut lab = lab(&[limit("fw", "fixed_window", 1, ""), limit("bud", "token_budget", 100_000, "estimate = 500")].concat()).await;
    let (done, r) = lab.decide().await;
    let DecideResponse::Allow { ticket: Some(ticket), .. } = r else { panic!("{r:?}") };
    let (denied, r) = lab.decide().await;
    assert!(!allowed(&r), "over the limit: {r:?}");
    assert!(lab.redis.keys(&format!("dec:*{denied}")).is_empty(), "a denied decision writes no record");
    let before = lab.state();
    assert_eq!(lab.refund(&denied).await, Refunded::Nothing);
    assert_eq!(lab.state(), before);
    // the allowed one completes (served, 300 tokens): its record goes, a refund gives nothing back
    lab.decider.complete(&Completion { ticket, status: 200, tokens: Some(300), llm: None }).await.unwrap();
    assert!(lab.redis.keys(&format!("dec:*{done}")).is_empty(), "the completion deleted the record");
    let completed = lab.state();
    assert_eq!(lab.refund(&done).await, Refunded::Nothing);
    assert_eq!(lab.state(), completed, "the served request stays counted, its usage settled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_racing_a_settled_reservation_gives_nothing_back() {
    let mut lab = lab(&limit("bud", "token_budget", 100_000, "estimate = 500")).await;
    let (id, r) = lab.decide().await;
    assert!(allowed(&r));
    // as if a completion settled it but its record was not yet deleted (a report and a refund
    // of one decision: never sent by a correct filter)
    let reservation = lab.redis.keys("q:reserved:*").pop().unwrap();
    let _: () = lab.redis.cmd(&["SET", &reservation, "settled"]);
    let before = lab.state();
    assert_eq!(lab.refund(&id).await, Refunded::Completed);
    let mut after = before.clone();
    after.remove(&format!("dec:{{acme}}:{id}"));
    assert_eq!(lab.state(), after, "only the record is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_bucket_refund_never_gives_back_what_a_full_refill_absorbed() {
    let mut lab = lab(&limit("tb", "token_bucket", 10, "window = \"10s\"")).await;
    let (id, _) = lab.decide().await; // 9 left
    let bucket = lab.redis.keys("q:rps:*").pop().unwrap();
    let tokens = |lab: &Lab| lab.redis.cmd::<String>(&["HGET", &bucket, "tokens"]).parse::<f64>().unwrap();
    // 20 s later the bucket is full again either way; one request takes one
    lab.clock.advance(20_000);
    let (_, r) = lab.decide().await;
    assert!(allowed(&r));
    assert_eq!(tokens(&lab), 9.0);
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 1 });
    assert_eq!(tokens(&lab), 9.0, "without the first request the bucket would hold 9 too");

    // refunded soon after the take, the whole take comes back
    let (id, _) = lab.decide().await;
    assert_eq!(tokens(&lab), 8.0);
    lab.clock.advance(100);
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 1 });
    assert_eq!(tokens(&lab), 9.0);
}

/// A refund is background work: its key lookup runs on the off-path connection within the
/// refund's own deadline (1 s), not a decision's `redis.timeout`. A Redis paused longer than that
/// timeout delays the refund; it does not fail it (before, a lookup not in the key cache failed
/// at `redis.timeout` and the whole batch answered 503 until Redis was fast again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_waits_for_a_redis_slower_than_a_decisions_deadline() {
    let lab = Lab::start(&limit("fw", "fixed_window", 5, "window = \"60s\""), T0, |cfg| {
        cfg.cache.ttl = Duration::ZERO; // every key lookup goes to Redis
        cfg.redis.timeout = Duration::from_millis(100);
    });
    let mut lab = lab.key("p").await;
    // a decision that took (a first one may meet the 100 ms while its connection is made: the
    // limit's failure mode then admits without a record)
    let mut id = String::new();
    for _ in 0..5 {
        let (d, r) = lab.decide().await;
        assert!(allowed(&r), "{r:?}");
        if lab.state().contains_key(&format!("dec:{{acme}}:{d}")) {
            id = d;
            break;
        }
    }
    assert!(!id.is_empty(), "no decision took anything in 5 tries");
    // both connections made: a refund of a decision that never was
    assert_eq!(lab.refund(&format!("{:032x}", 7)).await, Refunded::Nothing);
    let _: () = lab.redis.cmd(&["CLIENT", "PAUSE", "400", "ALL"]);
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 1 }, "answered once Redis is, within the refund's 1 s");
}

/// A store that sends every `decide.lua` call twice — as a Redis Cluster client sends a script
/// again after a connection error, when the first run may have taken before the connection
/// dropped — and keeps both replies; everything else goes to the real store.
#[derive(Clone)]
struct SentTwice {
    store: Store,
    replies: Arc<Mutex<Vec<DecideReply>>>,
}

impl DecisionStore for SentTwice {
    fn decision_timeout(&self) -> Duration {
        DecisionStore::decision_timeout(&self.store)
    }

    async fn key_record(&self, hash: &KeyHash, left: Duration, off_path: bool) -> Result<Option<KeyRecord>, StoreError> {
        DecisionStore::key_record(&self.store, hash, left, off_path).await
    }

    async fn decide(&self, call: &DecideCall, left: Duration) -> Result<DecideReply, ScriptError> {
        let first = DecisionStore::decide(&self.store, call, left).await?;
        let second = DecisionStore::decide(&self.store, call, left).await?;
        self.replies.lock().unwrap().extend([first, second.clone()]);
        Ok(second)
    }

    async fn complete(&self, call: &CompleteCall) -> Result<(i64, Settled), StoreError> {
        DecisionStore::complete(&self.store, call).await
    }

    async fn refund(&self, tenant: &Id, decision_id: &Id, now_ms: u64) -> Result<Refunded, ScriptError> {
        DecisionStore::refund(&self.store, tenant, decision_id, now_ms).await
    }

    async fn claim_audit(&self, key_id: &Id) -> Result<bool, StoreError> {
        DecisionStore::claim_audit(&self.store, key_id).await
    }

    async fn barrier(&self) -> bool {
        DecisionStore::barrier(&self.store).await
    }

    async fn replaced_since(&self, t: std::time::Instant) -> bool {
        DecisionStore::replaced_since(&self.store, t).await
    }
}

/// Decision 164: a decision whose script runs twice (sent again after a connection error) takes
/// once and answers as its first run did — its idempotency claim is its own, not "in flight", and
/// one refund gives back everything it took. Before, the second run took every limit again (and
/// overwrote the record, so a refund left the first take behind) and answered 409 in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_whose_script_runs_twice_takes_once_and_answers_as_the_first_run() {
    let all = every_kind();
    let mut lab = lab(&all).await;
    lab.decide().await; // a decision that stays: the state has something in it
    let before = lab.state();
    let (twice, replies) = lab.sent_twice(&all);
    let idem = IdempotencyRequest { key: "order-1".into(), digest: "0a".repeat(16) };
    let (id, req) = lab.named(|req| DecideRequest { idempotency: Some(idem), ..req });
    let r = twice.decide(&req).await.unwrap();
    let DecideResponse::Allow { store: Some(_), .. } = &r else { panic!("its own claim, not in flight: {r:?}") };
    let replies = replies.lock().unwrap().clone();
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[1], replies[0], "the second run answers as the first");
    assert_eq!(lab.refund(&id).await, Refunded::Done { lines: 8 });
    assert_eq!(lab.state(), before, "taken once: one refund gives it all back");
}

/// Decision 164 recognises the same call (the same decision id at the same clock reading), not a
/// decision id used again: a later decision under a reused id is decided and takes as any other
/// (it must never be admitted for free on the strength of an earlier record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_id_used_again_later_is_a_new_decision() {
    let mut lab = lab(&limit("fw", "fixed_window", 2, "window = \"60s\"")).await;
    let (_, req) = lab.named(|r| r);
    for (i, want) in [(0, true), (1, true), (2, false)] {
        lab.clock.advance(1);
        let r = lab.decider.decide(&req).await.unwrap();
        assert_eq!(allowed(&r), want, "decision {i} under the same id: {r:?}");
    }
    let counter = lab.redis.keys("rl:{acme}:fw:*");
    assert_eq!(lab.redis.cmd::<u64>(&["GET", &counter[0]]), 2, "each took its unit");
}

/// Decision 164 for a leased grant: the second run grants what the first took, and takes nothing
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_grant_whose_script_runs_twice_is_taken_once() {
    let leased = limit("fw", "fixed_window", 100, "mode = \"leased\"");
    let mut lab = lab(&leased).await;
    let (twice, replies) = lab.sent_twice(&leased);
    let (_, req) = lab.named(|req| DecideRequest { lease: Some(LeaseAsk { want: 20, renewal: false }), ..req });
    let r = twice.decide(&req).await.unwrap();
    let DecideResponse::Allow { lease: Some(l), .. } = &r else { panic!("no lease: {r:?}") };
    let replies = replies.lock().unwrap().clone();
    assert_eq!(replies[1], replies[0]);
    assert_eq!(replies[0].granted, l.units);
    let counter = lab.redis.keys("rl:{acme}:fw:*");
    assert_eq!(lab.redis.cmd::<u64>(&["GET", &counter[0]]), 1 + l.units, "the request and its lease, once");
}
