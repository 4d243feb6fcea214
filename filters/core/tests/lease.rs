#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Leased limits through a mock host: spending a lease without a call, expiry per grant, CAS
//! retries between workers, sizing, renewal off the request path, revocation. The same tests run
//! natively and on wasm32 under wasm-bindgen-test.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;
use std::rc::Rc;
use tollgate_filter_core::completions::CompletionQueue;
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::filter::AuthFilter;
use tollgate_filter_core::host::Action;
use tollgate_filter_core::stats::Metric;
use tollgate_filter_core::key::hash_key;
use tollgate_filter_core::jobs::Job;
use tollgate_filter_core::lease::renewer::{LeaseRenewer, RenewalQueue};
use tollgate_filter_core::lease::{self, LeaseRecord};
use tollgate_filter_core::shared_keys;
use tollgate_filter_core::mock::MockHost;
use tollgate_wire::DecideRequest;

const KEY: &str = "tg_leased_key";
const T: u64 = 1_000_000;

/// One Envoy: its shared data and clock (in `base`), its config and one worker's renewal queue.
struct Envoy {
    base: MockHost,
    config: Rc<FilterConfig>,
    renewals: Rc<RefCell<RenewalQueue>>,
}

impl Envoy {
    fn new(config: &str) -> Envoy {
        let mut base = MockHost::new();
        base.now_ms = T;
        Envoy {
            base,
            config: Rc::new(FilterConfig::parse(config.as_bytes()).unwrap()),
            renewals: Rc::new(RefCell::new(RenewalQueue::default())),
        }
    }

    fn at(&mut self, ms: u64) -> &mut Envoy {
        self.base.now_ms = T + ms;
        self
    }

    /// Runs a request's headers phase; returns the filter (to answer its call) and its host.
    fn request(&mut self) -> (AuthFilter, MockHost, Action) {
        let mut h = MockHost::next_request(&self.base).with_header("x-api-key", KEY);
        let mut f = AuthFilter::new(self.config.clone(), Rc::new(RefCell::new(CompletionQueue::new(10))))
            .with_leases(self.renewals.clone());
        let a = f.on_request_headers(&mut h, true);
        self.sync(&h);
        (f, h, a)
    }

    /// Keeps what a request wrote to shared data.
    fn sync(&mut self, h: &MockHost) {
        self.base.shared = h.shared.clone();
        self.base.cas = h.cas.clone();
    }

    fn record(&self) -> Option<LeaseRecord> {
        LeaseRecord::decode(self.base.shared.get(shared_keys::lease(&hash_key(KEY), None).as_str())?)
    }

    fn units(&self) -> u64 {
        self.record().map_or(0, |r| r.units(self.base.now_ms))
    }

    /// A request that must be admitted from the lease.
    fn hit(&mut self) -> MockHost {
        let (_, h, a) = self.request();
        assert_eq!(a, Action::Continue, "admitted locally");
        assert!(h.calls.is_empty(), "no callout");
        assert_eq!(h.count_of(Metric::LeaseHit), 1);
        h
    }

    /// The root context's tick: a renewer sends what the renewal queue holds. Returns the
    /// renewer and the root's host, to answer the renewal.
    fn tick(&self) -> (LeaseRenewer, MockHost) {
        let mut renewer = LeaseRenewer::new(self.renewals.clone(), self.config.sidecar.clone());
        let mut root = MockHost::next_request(&self.base);
        renewer.on_tick(&mut root);
        (renewer, root)
    }

    /// A request that must call; answered with `body` (sent at its time, answered `rtt` later).
    fn call(&mut self, body: &str) -> (MockHost, DecideRequest) {
        let (mut f, mut h, a) = self.request();
        assert_eq!(a, Action::Pause, "a callout");
        assert_eq!(h.calls.len(), 1);
        let sent: DecideRequest = serde_json::from_slice(&h.calls[0].body).unwrap();
        f.on_sidecar_response(&mut h, 1, Some(200), body.as_bytes());
        self.sync(&h);
        (h, sent)
    }
}

fn grant(units: u64, ttl_ms: u64) -> String {
    format!(
        r#"{{"verdict":"allow","tenant":"acme","keyId":"key_1","plan":"gold","responseHeaders":[{{"name":"ratelimit","value":"\"l\";r=5;t=1"}}],
            "lease":{{"units":{units},"ttlMs":{ttl_ms},"responseHeaders":[{{"name":"ratelimit-policy","value":"\"l\";q=100;w=60"}}]}}}}"#
    )
}

const ALLOW: &str = r#"{"verdict":"allow","tenant":"acme","keyId":"key_1","plan":"gold"}"#;

/// An Envoy whose lease of 4 units, spent at ~20/s, is low: a renewal is queued (at +11).
fn low_lease() -> Envoy {
    let mut e = Envoy::new("{}");
    e.call(ALLOW);
    e.at(10).call(&grant(4, 400));
    e.at(11).hit();
    e
}

#[test]
fn a_lease_is_spent_without_callouts_then_the_filter_calls_again() {
    let mut e = Envoy::new("{}");
    // The first request of a key: no rate known, so no lease is asked for.
    let (_, sent) = e.call(ALLOW);
    assert_eq!(sent.lease, None);
    // The second, 10 ms later: a rate (at least 20/s over 50 ms), a first lease capped at 8.
    let (h, sent) = e.at(10).call(&grant(3, 400));
    assert_eq!(sent.lease.map(|l| (l.want, l.renewal)), Some((8, false)));
    assert_eq!(h.header("x-tollgate-tenant"), Some("acme"));
    assert_eq!(e.units(), 3);
    for i in 0..3 {
        let h = e.at(20 + i).hit();
        assert_eq!(h.header("x-tollgate-tenant"), Some("acme"));
        assert_eq!(h.header("x-tollgate-key-id"), Some("key_1"));
        assert_eq!(h.header("x-tollgate-plan"), Some("gold"));
        assert!(h.header("x-api-key").is_none(), "the key is stripped");
        assert!(!h.everything_sent().contains(KEY), "only the hash is kept");
    }
    assert_eq!(e.units(), 0);
    // Dry: the next request calls, and asks again (a queued renewal does not hold it back).
    assert_eq!(e.renewals.borrow().len(), 1);
    let (_, sent) = e.at(30).call(ALLOW);
    assert!(sent.lease.is_some_and(|l| l.want >= 1 && !l.renewal), "{sent:?}");
    let (_, sent) = e.at(31).call(ALLOW);
    assert_eq!(sent.lease, None, "an ask that brought nothing backs off");
    // and only one of concurrent misses asks
    let (_, h, _) = e.at(300).request();
    let (_, h2, _) = e.at(300).request();
    let asks = [h, h2].iter().filter(|h| String::from_utf8_lossy(&h.calls[0].body).contains("lease")).count();
    assert_eq!(asks, 1);
}

#[test]
fn admitted_requests_carry_the_policy_header_of_the_lease() {
    let mut e = Envoy::new("{}");
    e.call(ALLOW);
    e.at(10).call(&grant(2, 400));
    let (mut f, mut h, a) = e.at(11).request();
    assert_eq!(a, Action::Continue);
    f.on_response_headers(&mut h, false);
    assert_eq!(h.response_headers, vec![("ratelimit-policy".to_string(), "\"l\";q=100;w=60".to_string())]);
}

#[test]
fn units_expire_with_their_grant_counted_from_when_the_call_was_sent() {
    let mut e = Envoy::new("{}");
    e.call(ALLOW);
    // sent at +10 with ttl 100: spendable until +110, whenever the answer arrived
    e.at(10).call(&grant(50, 100));
    e.at(109).hit();
    e.at(110).call(ALLOW);
}

#[test]
fn each_grant_expires_on_its_own_and_the_oldest_is_spent_first() {
    let mut e = Envoy::new(r#"{"leases":{"renewAhead":"10ms"}}"#);
    e.call(ALLOW);
    e.at(10).call(&grant(3, 100)); // until +110 (e.g. the end of a fixed window)
    e.at(20).hit();
    // a renewal's grant arrives: a second batch, until +420
    e.renewals.borrow_mut().push(sample_request(), 10);
    let (mut renewer, mut root) = e.tick();
    let sent: DecideRequest = serde_json::from_slice(&root.calls[0].body).unwrap();
    assert_eq!(sent.token_estimate, None, "a renewal admits no request");
    assert!(renewer.apply_answer(&mut root, 1, Some(200), grant(6, 400).as_bytes()));
    e.sync(&root);
    assert_eq!(e.at(30).units(), 2 + 6);
    e.at(40).hit();
    let rec = e.record().unwrap();
    let older = rec.batches.iter().find(|b| b.until_ms == T + 110).unwrap();
    assert_eq!(older.units, 1, "the batch that expires first is spent first: {rec:?}");
    // at +110 the older batch's last unit is gone with its window; the renewal's six remain
    assert_eq!(e.at(110).units(), 6);
    e.at(110).hit();
    assert_eq!(e.units(), 5);
}

fn sample_request() -> DecideRequest {
    DecideRequest { token_estimate: Some(5), ..DecideRequest::new(hash_key(KEY), "GET", "api.test", "/") }
}

#[test]
fn a_low_lease_queues_one_renewal_that_the_root_sends_off_the_request_path() {
    let mut e = Envoy::new("{}");
    e.call(ALLOW);
    e.at(10).call(&grant(4, 400));
    // 4 units at ~20/s: the low-water mark (rate × 250 ms = 5) is reached at once
    let h = e.at(11).hit();
    assert!(h.calls.is_empty(), "the request itself never calls");
    assert_eq!(e.renewals.borrow().len(), 1);
    e.at(12).hit();
    assert_eq!(e.renewals.borrow().len(), 1, "one renewal per Envoy at a time (claimed in the record)");
    assert!(e.record().unwrap().renewing_until_ms > T + 12);

    let (mut renewer, mut root) = e.tick();
    assert!(e.renewals.borrow().is_empty());
    assert_eq!(root.calls.len(), 1);
    assert_eq!(root.count_of(Metric::LeaseRenewal), 1);
    let call = &root.calls[0];
    assert!(call.headers.contains(&(":path".into(), "/v1/decide".into())));
    let sent: DecideRequest = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(sent.key_hash, hash_key(KEY));
    let ask = sent.lease.unwrap();
    assert!(ask.renewal && ask.want >= 1, "{ask:?}");
    assert!(!String::from_utf8_lossy(&call.body).contains(KEY), "only the hash");

    // another call's answer is not the renewer's
    assert!(!renewer.apply_answer(&mut root, 77, Some(200), b"{}"));
    root.now_ms = T + 15;
    assert!(renewer.apply_answer(&mut root, 1, Some(200), grant(20, 400).as_bytes()));
    e.sync(&root);
    assert_eq!(e.at(15).units(), 2 + 20);
    assert_eq!(e.record().unwrap().renewing_until_ms, 0, "the claim is released");
    for i in 0..22 {
        e.at(16 + i).hit();
    }
}

#[test]
fn a_denied_renewal_drops_the_lease_at_once() {
    let mut e = low_lease();
    let (mut renewer, mut root) = e.tick();
    let revoked = r#"{"verdict":"deny","status":401,"error":"revoked_key","message":"revoked"}"#;
    assert!(renewer.apply_answer(&mut root, 1, Some(200), revoked.as_bytes()));
    e.sync(&root);
    assert_eq!(e.units(), 0);
    let (mut f, mut h, a) = e.at(12).request();
    assert_eq!(a, Action::Pause, "the next request is decided by the sidecar");
    f.on_sidecar_response(&mut h, 1, Some(200), revoked.as_bytes());
    assert_eq!(h.reply.unwrap().status, 401);
}

#[test]
fn a_failed_renewal_backs_off_and_the_lease_is_still_spent() {
    let mut e = low_lease();
    let (mut renewer, mut root) = e.tick();
    assert!(renewer.apply_answer(&mut root, 1, Some(503), b""));
    e.sync(&root);
    assert_eq!(e.record().unwrap().renewing_until_ms, T + 11 + lease::RENEWAL_BACKOFF_MS);
    e.at(12).hit();
    assert!(e.renewals.borrow().is_empty(), "backing off");
    e.at(200).hit();
    assert_eq!(e.renewals.borrow().len(), 1, "after the backoff, the next spend renews");
}

#[test]
fn a_401_on_the_request_path_drops_the_lease() {
    let mut e = Envoy::new("{}");
    e.call(ALLOW);
    // Y misses and asks; X misses too (no ask: Y holds it); Y's answer brings a lease; then X
    // learns that the key is revoked.
    let (mut fy, mut hy, _) = e.at(10).request();
    let (mut fx, mut hx, a) = e.at(10).request();
    assert_eq!(a, Action::Pause);
    fy.on_sidecar_response(&mut hy, 1, Some(200), grant(4, 400).as_bytes());
    e.sync(&hy);
    assert_eq!(e.units(), 4);
    hx.shared = e.base.shared.clone();
    hx.cas = e.base.cas.clone();
    fx.on_sidecar_response(&mut hx, 1, Some(200), br#"{"verdict":"deny","status":401,"error":"revoked_key","message":"m"}"#);
    e.sync(&hx);
    assert_eq!(e.units(), 0, "every worker stops spending it");
}

#[test]
fn workers_racing_on_the_lease_never_spend_a_unit_twice() {
    let mut e = Envoy::new(r#"{"leases":{"renewAhead":"10ms"}}"#);
    e.call(ALLOW);
    e.at(10).call(&grant(5, 400));
    let key = shared_keys::lease(&hash_key(KEY), None).into_string();
    // Another worker spends a unit between this request's read and its CAS write, twice.
    let mut other = e.record().unwrap();
    other.batches[0].units = 4;
    let first = other.encode();
    other.batches[0].units = 3;
    let second = other.encode();
    let mut h = MockHost::next_request(&e.base).with_header("x-api-key", KEY);
    h.now_ms = T + 11;
    h.interfere = vec![(key.clone(), first), (key.clone(), second)];
    let mut f = AuthFilter::new(e.config.clone(), Rc::new(RefCell::new(CompletionQueue::new(1)))).with_leases(e.renewals.clone());
    assert_eq!(f.on_request_headers(&mut h, true), Action::Continue);
    e.sync(&h);
    assert_eq!(e.at(11).units(), 2, "5 - 2 by the other worker - 1 by this one");
}

/// Two workers of one Envoy (their own lease state, the same shared data) spend a busy key's
/// lease of `units`, alternating, two requests per millisecond; nothing refills it. Returns the
/// Envoy (serving with the first worker again), both workers, the lease key, the requests
/// admitted, and those admitted without a shared-data write.
fn two_busy_workers(units: u64, requests: u64) -> (Envoy, [Rc<RefCell<RenewalQueue>>; 2], String, u64, u64) {
    let mut e = Envoy::new("{}");
    e.call(ALLOW);
    e.at(10).call(&grant(units, 10_000));
    let workers = [e.renewals.clone(), Rc::new(RefCell::new(RenewalQueue::default()))];
    let key = shared_keys::lease(&hash_key(KEY), None).into_string();
    let (mut admitted, mut no_write) = (0, 0);
    for i in 0..requests {
        e.renewals = workers[i as usize % 2].clone();
        let version = e.base.cas.get(&key).copied();
        e.at(20 + i / 2).hit();
        admitted += 1;
        no_write += u64::from(e.base.cas.get(&key).copied() == version);
    }
    e.renewals = workers[0].clone();
    (e, workers, key, admitted, no_write)
}

#[test]
fn a_busy_key_is_spent_from_each_workers_share_and_no_unit_is_spent_twice() {
    let (e, workers, key, admitted, no_write) = two_busy_workers(1000, 400);
    let now = e.base.now_ms;
    let held: Vec<u64> = workers.iter().map(|w| w.borrow().shares.units(&key, now)).collect();
    println!("admitted {admitted}, {no_write} without a shared-data write; record {}, shares {held:?}", e.units());
    // every granted unit is in exactly one place: spent, in the record, or in a worker's share
    assert_eq!(admitted + e.units() + held.iter().sum::<u64>(), 1000);
    // at ~2000/s a share is ~40 units (20 ms): most requests never touch shared data
    assert!(no_write >= 300, "{no_write} of {admitted} admitted from a share");
    assert!(held.iter().all(|h| *h <= 500), "a share is at most half of the batch: {held:?}");
    // the record still saw the Envoy's whole rate (the shares' requests are folded in)
    assert!(e.record().unwrap().rate(now) > 1000.0, "{:?}", e.record());
}

#[test]
fn a_denied_renewal_drops_the_workers_share_too() {
    // 300 units at ~2000/s are low (under 250 ms worth): a worker queued a renewal
    let (mut e, workers, key, _, _) = two_busy_workers(300, 100);
    let now = e.base.now_ms;
    let w = workers.iter().find(|w| w.borrow().len() == 1).expect("a renewal is queued").clone();
    assert!(w.borrow().shares.units(&key, now) > 0, "that worker holds a share");
    e.renewals = w.clone();
    // the renewal is refused: the key was revoked
    let (mut renewer, mut root) = e.tick();
    let revoked = r#"{"verdict":"deny","status":401,"error":"revoked_key","message":"revoked"}"#;
    assert!(renewer.apply_answer(&mut root, 1, Some(200), revoked.as_bytes()));
    e.sync(&root);
    assert_eq!((e.units(), w.borrow().shares.units(&key, now)), (0, 0));
    let (_, _, a) = e.request();
    assert_eq!(a, Action::Pause, "the next request of that worker is decided by the sidecar");
}

#[test]
fn without_leases_the_filter_asks_for_none_and_keeps_no_record() {
    let mut e = Envoy::new(r#"{"leases":{"enabled":false}}"#);
    e.call(ALLOW);
    let (_, sent) = e.at(10).call(&grant(5, 400));
    assert_eq!(sent.lease, None);
    assert!(e.record().is_none());
    let (_, h, a) = e.at(11).request();
    assert_eq!((a, h.calls.len()), (Action::Pause, 1));
}

#[test]
fn a_slow_key_stays_exact() {
    // one request a second: less than one per lease lifetime, so no lease is ever asked for
    let mut e = Envoy::new("{}");
    for s in 0..5 {
        let (_, sent) = e.at(s * 1000).call(ALLOW);
        assert_eq!(sent.lease, None, "request {s}");
    }
}

#[test]
fn a_key_the_sidecar_has_not_allowed_writes_nothing_to_shared_data() {
    let mut e = Envoy::new("{}");
    let deny = r#"{"verdict":"deny","status":401,"error":"unknown_key","message":"unknown"}"#;
    for i in 0..5 {
        e.at(i).call(deny);
    }
    assert!(e.base.cached_keys().is_empty(), "an unknown key leaves no record: {:?}", e.base.cached_keys());
    // a sidecar failure says nothing about the key either
    let (mut f, mut h, _) = e.at(10).request();
    f.on_sidecar_response(&mut h, 1, Some(503), b"");
    e.sync(&h);
    assert!(e.base.cached_keys().is_empty());
    // once allowed, the record starts observing (this request is its origin)
    e.at(20).call(ALLOW);
    let rec = e.record().expect("a record once the key is valid");
    assert_eq!((rec.obs_since_ms, rec.obs_spent, rec.batches.len()), (T + 20, 0, 0));
    e.at(30).call(ALLOW);
    assert_eq!(e.record().unwrap().obs_spent, 1, "later requests are samples");
}
