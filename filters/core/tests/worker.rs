#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! What a worker's root context does, through a mock host (natively and on wasm32 under
//! wasm-bindgen-test): the tick it asks for and the counters it defines, the three batch
//! flushers (completions retried, usage kept until taken and dropped when refused, responses
//! sent once), call responses reaching the job that owns them, and each request's filter:
//! authentication first, then the breaker stage.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::{cell::Cell, rc::Rc};
use std::time::Duration;
use tollgate_filter_core::breaker::{self, Phase, State};
use tollgate_filter_core::config::FilterConfig;
use tollgate_filter_core::host::{Action, CallSpec, Host, LogLevel};
use tollgate_filter_core::http::HttpFilter;
use tollgate_filter_core::key::hash_key;
use tollgate_filter_core::lease::{Batch, LeaseIdentity, LeaseRecord};
use tollgate_filter_core::mock::MockHost;
use tollgate_filter_core::shared_keys::{self, ROUTES_TABLE};
use tollgate_filter_core::stats::{FlushEvent, Metric, Stream};
use tollgate_filter_core::worker::{Seeds, Worker};
use tollgate_wire::responses::{StoreBatch, StoreItem, StoreTicket, StoredResponse};
use tollgate_wire::usage::UsageBatch;
use tollgate_wire::{CompletionBatch, DecideRequest};

const KEY: &str = "tg_worker_key";
const T: u64 = 1_000_000;
const SEEDS: Seeds = Seeds { decision_ids: [3; 32], usage_ids: 0xfeed, hints_owner: 11, routes_owner: 12, changes_owner: 13 };

/// A worker of `config`, and its root context's host at time `T`. The change poller is off
/// unless `config` names it (the tests of other jobs count the calls a tick makes).
fn worker(config: &str) -> (Worker, MockHost) {
    let mut v: serde_json::Value = serde_json::from_str(config).unwrap();
    if v.get("changes").is_none() {
        v["changes"] = serde_json::json!({"enabled": false});
    }
    worker_of(&v.to_string(), SEEDS)
}

fn worker_of(config: &str, seeds: Seeds) -> (Worker, MockHost) {
    let mut root = MockHost::new();
    root.now_ms = T;
    let w = Worker::new(&mut root, Rc::new(FilterConfig::parse(config.as_bytes()).unwrap()), seeds);
    (w, root)
}

fn flush(stream: Stream, event: FlushEvent) -> Metric {
    Metric::Flush(stream, event)
}

fn header<'a>(call: &'a CallSpec, name: &str) -> Option<&'a str> {
    call.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

fn allow_with_ticket() -> &'static [u8] {
    br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold",
        "ticket":{"tenant":"acme","requestId":"req-9","budgets":[{"limit":"tokens","subject":"k.key_7","period":202611,"reserved":1000}]}}"#
}

const ALLOW: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold"}"#;

/// One request on the worker, allowed by the sidecar with `answer` and answered 200 upstream;
/// its shared-data writes are kept in `root`.
fn request(w: &Worker, root: &mut MockHost, answer: &[u8]) {
    let mut h = MockHost::next_request(root).with_header("x-api-key", KEY);
    let mut f = w.request();
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(f.on_call_response(&mut h, 1, Some(200), answer), Action::Continue);
    h.upstream_response = vec![(":status".into(), b"200".to_vec())];
    f.on_response_headers(&mut h, true);
    f.on_log(&mut h);
    root.shared = h.shared;
    root.cas = h.cas;
}

/// Delivers a call response to the worker; returns whether the body was read.
fn answer(w: &mut Worker, root: &mut MockHost, token: u32, status: Option<u16>, body: &[u8]) -> bool {
    let read = Cell::new(false);
    w.on_call_response(root, token, status, || {
        read.set(true);
        body.to_vec()
    });
    read.get()
}

#[test]
fn the_tick_is_the_fastest_cadence_and_counters_follow_the_configuration() {
    let (w, _) = worker("{}");
    assert_eq!(w.tick_period(), Duration::from_millis(20), "leases are on: renewals wait at most 20 ms");
    let m = w.metrics();
    assert!(m.contains(&Metric::Allowed) && m.contains(&flush(Stream::Completions, FlushEvent::BatchesSent)));
    assert!(m.contains(&flush(Stream::Responses, FlushEvent::Dropped)), "the response cache is on by default");
    assert!(!m.contains(&flush(Stream::Usage, FlushEvent::Dropped)), "usage is off by default");
    assert!(w.named_metrics().is_empty());

    let (w, _) = worker(r#"{"leases":{"enabled":false},"responseCache":{"enabled":false}}"#);
    assert_eq!(w.tick_period(), Duration::from_millis(100), "completionFlushInterval");
    assert!(!w.metrics().contains(&flush(Stream::Responses, FlushEvent::Errors)));
    let (w, _) = worker(r#"{"leases":{"enabled":false},"usage":{"enabled":true,"flushInterval":"50ms"}}"#);
    assert_eq!(w.tick_period(), Duration::from_millis(50));
    assert!(w.metrics().contains(&flush(Stream::Usage, FlushEvent::BatchesSent)));
    let (w, _) = worker(r#"{"leases":{"enabled":false},"routing":{"enabled":true,"refreshInterval":"30ms"}}"#);
    assert_eq!(w.tick_period(), Duration::from_millis(30));

    let hints = r#"{"leases":{"enabled":false},"breakers":{"hints":{"pollInterval":"60ms"},
        "targets":[{"name":"a","cluster":"ca","provider":"p","model":"m"},{"name":"b","cluster":"cb"}]}}"#;
    let (w, root) = worker(hints);
    assert_eq!(w.tick_period(), Duration::from_millis(60));
    assert!(w.named_metrics().contains(&"tollgate.breaker.a.opened".to_string()));
    for t in ["a", "b"] {
        let state = root.shared.get(shared_keys::breaker(t).as_str()).expect("initialised before any traffic");
        assert_eq!(State::decode(state).map(|s| s.phase), Some(Phase::Closed));
    }
}

/// The 20 ms lease tick runs only while the worker's renewals are in use (decision 272): queued,
/// out, or sent within the last second; otherwise the other jobs' cadence (here completions').
#[test]
fn the_lease_tick_runs_only_while_renewals_are_in_use() {
    let (mut w, mut root) = worker_of(r#"{"changes":{"enabled":false}}"#, SEEDS);
    let (fast, slow) = (Duration::from_millis(20), Duration::from_millis(100));
    assert_eq!(w.tick_period(), fast, "the fastest, set first: leases are on");
    assert_eq!(w.tick_period_now(root.now_ms), slow, "no renewal: the completions' cadence");
    let renewal = serde_json::json!({"keyHash": hash_key(KEY), "method": "GET", "authority": "api.test", "path": "/"});
    w.renewals().borrow_mut().push(serde_json::from_value(renewal).unwrap(), 4);
    assert_eq!(w.tick_period_now(root.now_ms), fast, "a renewal waits for the tick");
    w.on_tick(&mut root);
    assert_eq!(root.count_of(Metric::LeaseRenewal), 1);
    let token = root.calls.len() as u32;
    assert!(answer(&mut w, &mut root, token, Some(503), b""));
    root.now_ms += 999;
    assert_eq!(w.tick_period_now(root.now_ms), fast, "sent within the second: more will come");
    root.now_ms += 1;
    assert_eq!(w.tick_period_now(root.now_ms), slow, "a second without renewals: slow again");
    let (w, root) = worker_of(r#"{"changes":{"enabled":false},"leases":{"enabled":false}}"#, SEEDS);
    assert_eq!((w.tick_period(), w.tick_period_now(root.now_ms)), (slow, slow), "leases off: never the lease tick");
}

#[test]
fn the_change_poller_is_on_by_default_and_sets_the_tick() {
    let (w, _) = worker_of(r#"{"leases":{"enabled":false}}"#, SEEDS);
    assert_eq!(w.tick_period(), Duration::from_millis(50), "changes.pollInterval");
    let (w, _) = worker_of(r#"{"leases":{"enabled":false},"changes":{"pollInterval":"30ms"}}"#, SEEDS);
    assert_eq!(w.tick_period(), Duration::from_millis(30));
    assert!(FilterConfig::parse(br#"{"changes":{"pollInterval":"1ms"}}"#).is_err());
}

/// A request of `key` on `w`: `Some(answer)` when it made a decision call (answered with it),
/// `None` when it was let through without one.
fn request_of(w: &Worker, root: &mut MockHost, key: &str, answer: &[u8]) -> bool {
    let mut h = MockHost::next_request(root).with_header("x-api-key", key);
    let mut f = w.request();
    let called = match f.on_request_headers(&mut h, true) {
        Action::Continue => false,
        Action::Hold => unreachable!("headers are never held"),
        Action::Pause => {
            let token = h.calls.len() as u32;
            assert_eq!(f.on_call_response(&mut h, token, Some(200), answer), Action::Continue);
            true
        }
    };
    h.upstream_response = vec![(":status".into(), b"200".to_vec())];
    f.on_response_headers(&mut h, true);
    f.on_log(&mut h);
    root.shared = h.shared;
    root.cas = h.cas;
    called
}

/// The elected worker's tick polls the change count; the answer `{epoch, version}` is delivered.
fn poll_changes(w: &mut Worker, root: &mut MockHost, epoch: u64, version: u64) {
    let calls = root.calls.len();
    w.on_tick(root);
    assert_eq!(root.calls.len(), calls + 1, "one poll");
    let call = root.calls.last().unwrap().clone();
    assert_eq!((header(&call, ":method"), header(&call, ":path")), (Some("GET"), Some("/v1/changes")));
    let body = format!(r#"{{"epoch":{epoch},"version":{version}}}"#);
    assert!(answer(w, root, root.calls.len() as u32, Some(200), body.as_bytes()));
}

#[test]
fn a_change_count_that_moves_drops_cached_answers_and_leases_on_every_worker() {
    const CACHED: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":60000}"#;
    let (mut w, mut root) = worker_of(r#"{"changes":{"pollInterval":"50ms"}}"#, SEEDS);
    // a second worker of the same Envoy (not elected: it only reads the generation)
    let (mut w2, _) = worker_of(r#"{"changes":{"pollInterval":"50ms"}}"#, Seeds { changes_owner: 99, ..SEEDS });
    poll_changes(&mut w, &mut root, 7, 0);
    assert!(request_of(&w, &mut root, KEY, CACHED), "the first request asks");
    assert!(!request_of(&w, &mut root, KEY, CACHED), "then the auth cache answers");
    assert!(!request_of(&w2, &mut root, KEY, CACHED), "on every worker");
    // a lease of another key, granted before the change
    let leased = "tg_worker_leased";
    let identity = LeaseIdentity { tenant: "acme".into(), key_id: "key_8".into(), plan: "gold".into(), ..LeaseIdentity::default() };
    let rec = LeaseRecord { identity, batches: vec![Batch { units: 100, until_ms: T + 400 }], obs_since_ms: T, ..LeaseRecord::default() };
    root.shared.insert(shared_keys::lease(&hash_key(leased), None).as_str().into(), rec.encode());
    assert!(!request_of(&w, &mut root, leased, ALLOW), "the lease answers");

    // the same count again changes nothing; a moved count drops both, on both workers
    root.now_ms += 50;
    poll_changes(&mut w, &mut root, 7, 0);
    assert!(!request_of(&w, &mut root, KEY, CACHED));
    root.now_ms += 50;
    poll_changes(&mut w, &mut root, 7, 1);
    assert!(request_of(&w, &mut root, KEY, CACHED), "the cached answer predates the change: asked again");
    assert!(request_of(&w, &mut root, leased, ALLOW), "the lease predates the change: asked again");
    let units = LeaseRecord::decode(&root.shared[shared_keys::lease(&hash_key(leased), None).as_str()]).unwrap().units(root.now_ms);
    assert_eq!(units, 0, "its units are dropped, never spent");
    w2.on_tick(&mut root);
    assert!(!request_of(&w2, &mut root, KEY, CACHED), "the answer made after the change is reused");
    let calls = root.calls.len();
    w2.on_tick(&mut root);
    assert_eq!(root.calls.len(), calls, "the second worker does not poll: one poller per Envoy");

    // a restarted sidecar (another epoch) is a change too
    root.now_ms += 50;
    poll_changes(&mut w, &mut root, 8, 0);
    assert!(request_of(&w, &mut root, KEY, CACHED));
}

/// The change poller sleeps while nothing a change could revoke can be cached (decision 271):
/// after the first poll (the baseline), it polls while a call was sent recently enough for its
/// answer or lease to live, and a call made while it sleeps wakes it before the answer is cached.
#[test]
fn the_change_poller_sleeps_while_nothing_revocable_can_be_cached() {
    const CACHED: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":60000}"#;
    let (mut w, mut root) = worker_of(r#"{"changes":{"pollInterval":"50ms"}}"#, SEEDS);
    poll_changes(&mut w, &mut root, 7, 0);
    let quiet = |w: &mut Worker, root: &mut MockHost, why: &str| {
        let calls = root.calls.len();
        w.on_tick(root);
        assert_eq!(root.calls.len(), calls, "{why}");
    };
    root.now_ms += 50;
    quiet(&mut w, &mut root, "no call was ever sent: nothing to revoke, no poll");
    assert!(request_of(&w, &mut root, KEY, CACHED), "the first request asks");
    root.now_ms += 50;
    poll_changes(&mut w, &mut root, 7, 1);
    assert!(request_of(&w, &mut root, KEY, CACHED), "a revocation right after the answer: asked again");
    root.now_ms += 60_000;
    quiet(&mut w, &mut root, "a minute after the last call: asleep");
    assert!(request_of(&w, &mut root, KEY, CACHED), "the answer expired: asked");
    root.now_ms += 50;
    poll_changes(&mut w, &mut root, 7, 2);
    assert!(request_of(&w, &mut root, KEY, CACHED), "awake again: the change is seen within a poll");
}

/// A worker made after a change (a new plugin configuration, a VM reloaded) starts at the Envoy's
/// generation, not at 0: an answer cached before the change is not reused by it, even before its
/// first tick.
#[test]
fn a_worker_made_after_a_change_does_not_trust_what_it_made_stale() {
    const CACHED: &[u8] = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":60000}"#;
    let config = r#"{"changes":{"pollInterval":"50ms"}}"#;
    let (mut w, mut root) = worker_of(config, SEEDS);
    poll_changes(&mut w, &mut root, 7, 0);
    assert!(request_of(&w, &mut root, KEY, CACHED), "the first request asks");
    root.now_ms += 50;
    poll_changes(&mut w, &mut root, 7, 1);
    let fresh = Worker::new(&mut root, Rc::new(FilterConfig::parse(config.as_bytes()).unwrap()), Seeds { changes_owner: 98, ..SEEDS });
    assert!(request_of(&fresh, &mut root, KEY, CACHED), "the answer cached before the change is asked again");
}

#[test]
fn completions_are_flushed_at_their_cadence_and_a_batch_not_taken_is_sent_again() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    request(&w, &mut root, allow_with_ticket());
    assert_eq!(w.completions().borrow().len(), 1, "reported when the request ended");
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 1);
    let call = root.calls[0].clone();
    assert_eq!((header(&call, ":method"), header(&call, ":path")), (Some("POST"), Some("/v1/completions")));
    assert_eq!(header(&call, "content-type"), Some("application/json"));
    assert_eq!(call.timeout, Duration::from_secs(2), "at least 2 s: off the request path");
    let batch: CompletionBatch = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(batch.completions[0].ticket.request_id, "req-9");

    root.now_ms = T + 50;
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 1, "not due yet, and one batch in flight");
    assert!(!answer(&mut w, &mut root, 1, Some(503), b""), "a flusher reads no body");
    assert_eq!(root.count_of(flush(Stream::Completions, FlushEvent::Errors)), 1);
    assert_eq!(w.completions().borrow().len(), 1, "back in the queue");
    root.now_ms = T + 60;
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 1, "the next batch waits for the interval");
    root.now_ms = T + 100;
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 2);
    assert_eq!(root.calls[1].body, call.body, "the same report, sent again");
    answer(&mut w, &mut root, 2, Some(200), b"");
    assert_eq!(root.count_of(flush(Stream::Completions, FlushEvent::BatchesSent)), 1);
    root.now_ms = T + 200;
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 2, "nothing left");
}

#[test]
fn usage_events_stay_queued_until_taken_and_a_refusal_drops_them_logged_once() {
    const START: u64 = T + 1_000;
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"usage":{"enabled":true,"flushInterval":"1s"}}"#);
    let usage_calls = |h: &MockHost| h.calls.iter().filter(|c| header(c, ":path") == Some("/v1/usage")).count();
    request(&w, &mut root, ALLOW);
    request(&w, &mut root, ALLOW);
    root.now_ms = START; // its first turn: a whole interval after the start
    w.on_tick(&mut root);
    assert_eq!(usage_calls(&root), 1);
    let call = root.calls.last().unwrap().clone();
    assert_eq!(call.timeout, Duration::from_secs(5));
    let batch: UsageBatch = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(batch.events.len(), 2);
    assert!(batch.events[0].id.starts_with("000000000000feed"), "ids carry the VM's seed");
    let token = root.calls.len() as u32;
    answer(&mut w, &mut root, token, Some(500), b"");
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::Errors)), 1);
    assert_eq!(w.meter().borrow().queue.len(), 2, "kept until the sidecar takes them");
    root.now_ms = START + 500;
    w.on_tick(&mut root);
    assert_eq!(usage_calls(&root), 1, "usage.flushInterval");

    // refused for good (404: metering off there; 400: unreadable): dropped, counted, warned once
    for (i, status) in [(1, 404), (2, 400)] {
        if i == 2 {
            request(&w, &mut root, ALLOW);
        }
        root.now_ms = START + 1_000 * i;
        w.on_tick(&mut root);
        assert_eq!(usage_calls(&root), 1 + i as usize);
        let token = root.calls.len() as u32;
        answer(&mut w, &mut root, token, Some(status), b"");
    }
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::Dropped)), 3);
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::Errors)), 3);
    assert!(w.meter().borrow().queue.is_empty());
    let warned = |h: &MockHost| h.logs.iter().filter(|(l, m)| *l == LogLevel::Warn && m.contains("refused usage events")).count();
    assert_eq!(warned(&root), 1);

    request(&w, &mut root, ALLOW);
    root.now_ms = START + 3_000;
    w.on_tick(&mut root);
    let token = root.calls.len() as u32;
    answer(&mut w, &mut root, token, Some(200), br#"{"accepted":1}"#);
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::BatchesSent)), 1);
    assert!(root.logs.iter().any(|(l, m)| *l == LogLevel::Info && m.contains("takes usage events again")));
    assert_eq!(warned(&root), 1);
}

/// A backlog leaves as fast as the sidecar takes it: a delivered batch with a whole one waiting
/// sends the next at once, not at the stream's next turn (before, a worker sent at most a batch
/// per `usage.flushInterval`, 1000 events a second by default, and dropped the rest under load).
#[test]
fn a_backlog_of_usage_events_leaves_as_fast_as_the_sidecar_takes_it() {
    const START: u64 = T + 1_000;
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false},"usage":{"enabled":true,"flushInterval":"1s"}}"#);
    let usage_calls = |h: &MockHost| h.calls.iter().filter(|c| header(c, ":path") == Some("/v1/usage")).count();
    let events = |h: &MockHost, i: usize| serde_json::from_slice::<UsageBatch>(&h.calls[i].body).unwrap().events.len();
    for _ in 0..2_500 {
        request(&w, &mut root, ALLOW);
    }
    root.now_ms = START; // its first turn: a whole interval after the start
    w.on_tick(&mut root);
    assert_eq!(usage_calls(&root), 1);
    assert_eq!(events(&root, 0), 1_000);
    // a failed batch is retried at the next turn, never at once
    answer(&mut w, &mut root, 1, Some(503), b"");
    assert_eq!(usage_calls(&root), 1, "a failing sidecar is not pressed");
    root.now_ms = START + 1_000;
    w.on_tick(&mut root);
    assert_eq!(usage_calls(&root), 2);
    // taken: 1500 wait, a whole batch of them leaves now
    answer(&mut w, &mut root, 2, Some(200), br#"{"accepted":1000}"#);
    assert_eq!(usage_calls(&root), 3, "the next whole batch leaves with the answer");
    assert_eq!(events(&root, 2), 1_000);
    // taken: 500 wait, less than a batch: they wait for the next turn
    answer(&mut w, &mut root, 3, Some(200), br#"{"accepted":1000}"#);
    assert_eq!(usage_calls(&root), 3);
    assert_eq!(w.meter().borrow().queue.len(), 500);
    root.now_ms = START + 2_000;
    w.on_tick(&mut root);
    assert_eq!(usage_calls(&root), 4);
    assert_eq!(events(&root, 3), 500);
    answer(&mut w, &mut root, 4, Some(200), br#"{"accepted":500}"#);
    assert!(w.meter().borrow().queue.is_empty());
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::BatchesSent)), 3);
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::Dropped)), 0);
}

/// Envoy drops a worker's plugin configuration (decision 156): holding nothing, its root context
/// may go at once; holding usage events or completion reports, its next ticks send them whatever
/// each stream's cadence, and it is done once they are taken. What a sidecar never takes is
/// dropped and counted once `END_GRACE` is over.
#[test]
fn an_ended_worker_sends_what_it_holds_and_drops_it_counted_only_after_its_grace() {
    let config = r#"{"leases":{"enabled":false},"usage":{"enabled":true,"flushInterval":"60s"}}"#;
    let paths = |h: &MockHost| h.calls.iter().map(|c| header(c, ":path").unwrap_or("").to_string()).collect::<Vec<_>>();
    let (mut w, mut root) = worker(config);
    assert!(w.end(&mut root), "nothing held: it may go at once");
    assert!(w.has_ended());

    let (mut w, mut root) = worker(config);
    request(&w, &mut root, allow_with_ticket());
    request(&w, &mut root, ALLOW);
    assert!(!w.end(&mut root), "two usage events and a completion report held");
    assert!(root.calls.is_empty(), "nothing is sent from on_done (Envoy may be stopping)");
    root.now_ms = T + 1;
    w.on_tick(&mut root);
    assert_eq!(paths(&root), ["/v1/completions", "/v1/usage"], "the usage events without waiting for their 60 s turn");
    answer(&mut w, &mut root, 1, Some(200), b"");
    assert!(!w.has_ended(), "the usage batch is still in flight");
    answer(&mut w, &mut root, 2, Some(200), br#"{"accepted":2}"#);
    assert!(w.has_ended());
    root.now_ms = T + 2;
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 2, "an ended worker sends nothing more");

    // a sidecar that never takes them: sent again every second (not every tick) until the
    // grace is over
    let (mut w, mut root) = worker(config);
    request(&w, &mut root, allow_with_ticket());
    request(&w, &mut root, ALLOW);
    assert!(!w.end(&mut root));
    let grace = tollgate_filter_core::worker::END_GRACE.as_millis() as u64;
    for (i, now) in [T + 1, T + 1_001, T + grace - 600].into_iter().enumerate() {
        root.now_ms = now;
        w.on_tick(&mut root);
        assert_eq!(root.calls.len(), 2 * (i + 1), "both batches sent again");
        let last = root.calls.len() as u32;
        answer(&mut w, &mut root, last - 1, Some(503), b"");
        answer(&mut w, &mut root, last, None, b"");
        assert!(!w.has_ended());
        root.now_ms = now + 500;
        w.on_tick(&mut root);
        assert_eq!(root.calls.len(), 2 * (i + 1), "a sidecar that refuses is not pressed at every tick");
    }
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::Dropped)), 0, "nothing dropped within the grace");
    root.now_ms = T + grace;
    w.on_tick(&mut root);
    assert_eq!(root.calls.len(), 6, "nothing sent once the grace is over");
    assert!(w.has_ended());
    assert_eq!(root.count_of(flush(Stream::Usage, FlushEvent::Dropped)), 2, "the events are counted as dropped");
    assert_eq!(root.count_of(flush(Stream::Completions, FlushEvent::Dropped)), 1);
    assert!(root.logs.iter().any(|(l, m)| *l == LogLevel::Warn && m.contains("could not send 3 queued items")));
}

fn store_item(hash: &str) -> StoreItem {
    StoreItem {
        ticket: StoreTicket::Cache { tenant: "t".into(), plan: "p".into(), route: "r".into(), hash: hash.into(), seal: Default::default() },
        response: Some(StoredResponse::new(200, vec![], b"{}".to_vec(), 0)),
        max_age_ms: None,
    }
}

#[test]
fn responses_to_store_are_sent_every_tick_and_only_once() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    let calls = |h: &MockHost| h.calls.iter().filter(|c| header(c, ":path") == Some("/v1/responses")).count();
    w.responses().borrow_mut().push(store_item("a"));
    w.on_tick(&mut root);
    assert_eq!(calls(&root), 1);
    let call = root.calls.last().unwrap().clone();
    assert_eq!(call.timeout, Duration::from_secs(5));
    assert_eq!(serde_json::from_slice::<StoreBatch>(&call.body).unwrap().responses.len(), 1);
    root.now_ms = T + 1;
    w.responses().borrow_mut().push(store_item("b"));
    w.on_tick(&mut root);
    assert_eq!(calls(&root), 1, "one batch in flight");
    let token = root.calls.len() as u32;
    answer(&mut w, &mut root, token, Some(503), b"");
    assert_eq!(root.count_of(flush(Stream::Responses, FlushEvent::Dropped)), 1, "a batch not taken is dropped");
    assert_eq!(root.count_of(flush(Stream::Responses, FlushEvent::Errors)), 1);
    root.now_ms = T + 2;
    w.on_tick(&mut root);
    assert_eq!(calls(&root), 2, "every tick");
    let sent: StoreBatch = serde_json::from_slice(&root.calls.last().unwrap().body).unwrap();
    assert_eq!(sent.responses.len(), 1, "only the newer item: the failed one is not sent again");
    let token = root.calls.len() as u32;
    answer(&mut w, &mut root, token, Some(200), b"");
    assert_eq!(root.count_of(flush(Stream::Responses, FlushEvent::BatchesSent)), 1);
}

#[test]
fn a_batch_that_cannot_be_dispatched_is_counted_and_kept_or_dropped_per_stream() {
    let (mut w, mut root) = worker(r#"{"leases":{"enabled":false}}"#);
    request(&w, &mut root, allow_with_ticket());
    w.responses().borrow_mut().push(store_item("a"));
    root.dispatch_error = Some("BadArgument".into());
    w.on_tick(&mut root);
    assert_eq!(root.count_of(flush(Stream::Completions, FlushEvent::Errors)), 1);
    assert_eq!(w.completions().borrow().len(), 1, "a completion report is kept");
    assert_eq!(root.count_of(flush(Stream::Responses, FlushEvent::Errors)), 1);
    assert!(w.responses().borrow().is_empty());
    root.now_ms = T + 1;
    w.on_tick(&mut root);
    assert_eq!(root.count_of(flush(Stream::Responses, FlushEvent::Dropped)), 1, "a response to store is dropped");
    assert!(root.logs.iter().any(|(l, m)| *l == LogLevel::Debug && m.contains("cannot send completions: BadArgument")));
}

#[test]
fn call_responses_reach_the_job_that_owns_them() {
    let table = r#"{"version":1,"etag":"e1","routes":[{"id":"chat","pathPrefix":"/","cluster":"llm"}]}"#;
    let (mut w, mut root) = worker(r#"{"routing":{"enabled":true}}"#);
    w.on_tick(&mut root);
    let routes_call = root.calls.iter().position(|c| header(c, ":path") == Some("/v1/routes")).unwrap() as u32 + 1;
    assert!(w.routes().borrow().table().is_none());
    assert!(answer(&mut w, &mut root, routes_call, Some(200), table.as_bytes()), "the route poller reads the body");
    assert!(root.shared.contains_key(ROUTES_TABLE.as_str()), "written to shared data");
    assert_eq!(w.routes().borrow().table().map(|t| t.etag.as_str()), Some("e1"), "and the worker's copy refreshed");

    // a lease renewal queued by a request goes out on the next tick; its grant is stored
    let renewal: DecideRequest = serde_json::from_value(serde_json::json!({
        "keyHash": hash_key(KEY), "method": "GET", "authority": "api.test", "path": "/", "route": "chat"
    }))
    .unwrap();
    w.renewals().borrow_mut().push(renewal, 4);
    w.on_tick(&mut root);
    let renewal_call = root.calls.iter().position(|c| header(c, ":path") == Some("/v1/decide")).unwrap() as u32 + 1;
    assert_eq!(root.count_of(Metric::LeaseRenewal), 1);
    let grant = br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","lease":{"units":4,"ttlMs":400}}"#;
    assert!(answer(&mut w, &mut root, renewal_call, Some(200), grant));
    let record = root.shared.get(shared_keys::lease(&hash_key(KEY), Some("chat")).as_str()).unwrap();
    assert_eq!(LeaseRecord::decode(record).unwrap().units(T), 4);

    assert!(!answer(&mut w, &mut root, 999, Some(200), b"{}"), "nobody's call: its body is not read");
    assert!(root.logs.iter().any(|(l, m)| *l == LogLevel::Debug && m.contains("unexpected token")));
}

#[test]
fn the_breaker_stage_follows_an_allow_and_only_an_allow() {
    let config = r#"{"leases":{"enabled":false},"breakers":{"consecutiveFailures":1,"openFor":"1s",
        "targets":[{"name":"a","cluster":"cluster_a"}]}}"#;
    let (w, mut root) = worker(config);
    let start = |root: &MockHost| -> (HttpFilter, MockHost) {
        let mut h = MockHost::next_request(root).with_header("x-api-key", KEY).with_property("xds.cluster_name", "cluster_a");
        let mut f = w.request();
        assert_eq!(f.on_request_headers(&mut h, true), Action::Pause, "authentication asks the sidecar first");
        (f, h)
    };

    // allowed, then admitted: its failure opens the breaker and names the target
    let (mut f, mut h) = start(&root);
    assert_eq!(f.on_call_response(&mut h, 1, Some(200), ALLOW), Action::Continue, "resume");
    h.upstream_response = vec![(":status".into(), b"502".to_vec())];
    h.properties.insert("response.code_details".into(), b"via_upstream".to_vec());
    assert_eq!(f.on_response_headers(&mut h, true), Action::Continue);
    assert!(h.response_headers.contains(&("x-tollgate-target".into(), "a".into())));
    f.on_log(&mut h);
    root.shared = h.shared.clone();
    root.cas = h.cas.clone();
    assert!(matches!(breaker::read(&root, &shared_keys::breaker("a")).phase, Phase::Open { .. }));

    // a denied request never reaches the guard (open, it would have replied 503)
    let (mut f, mut h) = start(&root);
    let revoked = br#"{"verdict":"deny","status":401,"error":"revoked_key","message":"revoked"}"#;
    assert_eq!(f.on_call_response(&mut h, 1, Some(200), revoked), Action::Pause);
    assert_eq!(h.reply.as_ref().map(|r| r.status), Some(401));
    assert_eq!(h.named("tollgate.breaker.a.rejected"), 0);

    // allowed while open: the guard replies 503 itself and the request is not resumed; a token
    // reservation it holds is settled at 0 (no upstream used any), never charged in full
    let (mut f, mut h) = start(&root);
    assert_eq!(f.on_call_response(&mut h, 1, Some(200), allow_with_ticket()), Action::Pause);
    let reply = h.reply.clone().unwrap();
    assert_eq!(reply.status, 503);
    assert!(reply.headers.contains(&("x-tollgate-breaker".into(), "open".into())));
    assert_eq!(h.named("tollgate.breaker.a.rejected"), 1);
    assert_eq!(h.count_of(Metric::Allowed), 1, "authentication allowed it");
    h.upstream_response = vec![(":status".into(), b"503".to_vec()), ("content-type".into(), b"application/json".to_vec())];
    f.on_response_headers(&mut h, false);
    h.response_chunk = reply.body.clone();
    f.on_response_body(&mut h, reply.body.len(), true);
    f.on_log(&mut h);
    let body = w.completions().borrow_mut().begin_flush(10).expect("its completion");
    let batch: CompletionBatch = serde_json::from_slice(&body).unwrap();
    assert_eq!((batch.completions[0].status, batch.completions[0].tokens), (503, Some(0)));

    // a half-open trial that ends without response headers gives its slot back
    root.now_ms = T + 2_000;
    let (mut f, mut h) = start(&root);
    assert_eq!(f.on_call_response(&mut h, 1, Some(200), ALLOW), Action::Continue, "the trial");
    assert_eq!(breaker::read(&h, &shared_keys::breaker("a")).phase, Phase::HalfOpen { since_ms: T + 2_000, in_flight: 1 });
    f.on_log(&mut h);
    assert_eq!(breaker::read(&h, &shared_keys::breaker("a")).phase, Phase::HalfOpen { since_ms: T + 2_000, in_flight: 0 });
}

#[test]
fn without_a_call_the_guard_runs_at_the_request_headers() {
    let config = r#"{"leases":{"enabled":false},"breakers":{"targets":[{"name":"a","cluster":"cluster_a"}]}}"#;
    let (w, mut root) = worker(config);
    let open = State::with_phase(Phase::Open { until_ms: T + 5_000 }).encode();
    root.shared_set(shared_keys::breaker("a").as_str(), &open);
    // an allow the auth cache answers: no call, so the guard decides at once
    // (the helper's request names no cluster: unguarded)
    request(&w, &mut root, br#"{"verdict":"allow","tenant":"acme","keyId":"key_7","plan":"gold","cacheForMs":500}"#);
    let mut h = MockHost::next_request(&root).with_header("x-api-key", KEY).with_property("xds.cluster_name", "cluster_a");
    let mut f = w.request();
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.calls.is_empty(), "answered from the auth cache");
    assert_eq!(h.count_of(Metric::AuthCacheHit), 1);
    assert_eq!(h.reply.map(|r| r.status), Some(503), "then refused by the open breaker");
}
