//! Decision batches (decision 127) through a real Envoy, its sidecar and Redis, with the clients
//! an attacker or a flaky network makes: while one decision call is out, a worker's later
//! decisions wait and leave together in one batch. Clients that give up while their decision
//! waits or rides a batch must not be charged: a decision still waiting is dropped, one that left
//! is refunded. The ones that stay are admitted, and the limit counts exactly them.
//!
//! A test-only delay (`TOLLGATE_TEST_DECIDE_DELAY_FILE`, sidecar/src/testing.rs) holds each answer
//! (of a lone call and of a batch) back 600 ms, so that every request of the burst is in flight at
//! once; the clients that leave give up after 150 ms (their read timeout: a client's patience).

use serde_json::json;
use std::time::Duration;
use tollgate_tests::fixtures::{leave_before_the_answer, limit_toml, well_inside_the_hour, window_count, DecideDelay};
use tollgate_tests::{get, native_direct, poll_until, Gateway};

const STAYING: usize = 3;
const LEAVING: usize = 3;

#[test]
fn clients_that_leave_while_their_decisions_wait_or_ride_a_batch_are_not_charged() {
    if !tollgate_tests::wasm_host_only("the native host batches on its own connections only (decision 225; tested below)") {
        return;
    }
    well_inside_the_hour();
    let delay = DecideDelay::new(600);
    let g = Gateway::builder()
        .sidecar_toml(&limit_toml("p", "pm", "fixed_window", 100, "window = \"1h\""))
        .sidecar_env(delay.env().0, &delay.env().1)
        // the decision stream off: its decisions would not batch (tests/tests/streams.rs has its own)
        .plugin(json!({"sidecar": {"timeout": "5s", "decisionStream": false}, "failureMode": "closed", "completionFlushInterval": "20ms"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let counter = || window_count(g.redis(), "acme", &key.id);
    let url = g.envoy().url("/");
    let statuses: Vec<Option<u16>> = std::thread::scope(|s| {
        let mut handles: Vec<_> = (0..STAYING).map(|_| s.spawn(|| Some(get(&url, &[("x-api-key", &key.raw)]).status))).collect();
        for _ in 0..LEAVING {
            handles.push(s.spawn(|| {
                // the answers come after 600 ms
                leave_before_the_answer(&url, &key.raw, Duration::from_millis(150));
                None
            }));
        }
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(statuses.iter().flatten().copied().collect::<Vec<_>>(), [200; STAYING], "the clients that stayed were admitted");
    let batched = g.envoy().counter("wasmcustom.tollgate.decisions.batched");
    assert!(batched >= 1, "the burst's later decisions rode a batch ({batched})");
    // what the leavers' decisions took (if theirs had left) is given back; the limit counts the stayers
    poll_until("the limit counts only the clients that stayed", Duration::from_secs(20), || counter() == STAYING as u64);
    assert_eq!(g.upstream().calls(), STAYING as u64, "only the stayers went upstream");
    delay.set(0);
    let refunded = g.sidecar().metric("tollgate_sidecar_refunds_total{outcome=\"refunded\"}");
    let queued = g.envoy().counter("wasmcustom.tollgate.refunds.queued");
    eprintln!("batched {batched}, refunds queued {queued}, refunded {refunded}: the rest were dropped before they left");
    assert_eq!(queued, refunded, "every refund queued was made");
    assert!(queued <= LEAVING as u64);
    assert_eq!(counter(), STAYING as u64, "and stays so");
}

/// The native host with its own connections (`sidecar.address`, decision 219) batches what waits
/// for them (decision 225): with every answer held 1.5 s, its 8 connection threads are all busy
/// with the burst's first decisions at most, and the rest, queued meanwhile, leave in batches
/// (a generous hold: the 14 requests need only reach the module within it). Each request still
/// gets its own decision: an exact limit of 10 admits exactly 10 of the 14, one of them with a
/// traceparent that tries to write into its batch. With `batchDecisions: false`, the same burst
/// leaves call by call, and the limit is as exact.
#[test]
fn decisions_waiting_for_the_native_hosts_connections_leave_in_one_batch() {
    if tollgate_tests::filter_host() != tollgate_tests::FilterHost::Native || !native_direct() {
        eprintln!("skipped: only the native host's own connections batch this way (decision 225)");
        return;
    }
    well_inside_the_hour();
    let (batched, batches) = native_burst(true);
    eprintln!("{batched} decisions rode {batches} batches");
    assert!(batches >= 1 && batched >= 2 * batches, "the decisions that waited rode batches ({batched} in {batches})");
    assert!(batched <= NATIVE_CLIENTS as u64);
    assert_eq!(native_burst(false), (0, 0), "batchDecisions: false sends every decision alone");
}

const NATIVE_CLIENTS: usize = 14; // more than the module's 8 connection threads
const HOSTILE_TRACEPARENT: &str = r#"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-"},{"request":{"keyHash":"x"}},{"traceparent":"x"#;
const NATIVE_LIMIT: usize = 10;

/// The burst on a gateway of its own: the limit exact, each admitted request upstream once; the
/// counters of decisions batched and batches.
fn native_burst(batch: bool) -> (u64, u64) {
    let delay = DecideDelay::new(1500);
    let g = Gateway::builder()
        .sidecar_toml(&limit_toml("p", "pm", "fixed_window", NATIVE_LIMIT as u64, "window = \"1h\""))
        .sidecar_env(delay.env().0, &delay.env().1)
        .plugin(json!({"sidecar": {"timeout": "5s", "batchDecisions": batch}, "failureMode": "closed"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let url = g.envoy().url("/");
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..NATIVE_CLIENTS)
            .map(|i| {
                // one client's traceparent tries to write into a batch (a later version's tail
                // is the client's own bytes): alone or batched, every call reads as itself
                let tp = if i == 0 { HOSTILE_TRACEPARENT } else { "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" };
                let (url, key) = (&url, &key.raw);
                s.spawn(move || get(url, &[("x-api-key", key), ("traceparent", tp)]).status)
            })
            .collect();
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), NATIVE_LIMIT, "exactly the limit was admitted: {statuses:?}");
    assert_eq!(statuses.iter().filter(|&&s| s == 429).count(), NATIVE_CLIENTS - NATIVE_LIMIT, "the rest were refused: {statuses:?}");
    assert_eq!(window_count(g.redis(), "acme", &key.id), NATIVE_LIMIT as u64, "the limit counts each admitted request once");
    assert_eq!(g.upstream().calls(), NATIVE_LIMIT as u64);
    (g.envoy().counter("wasmcustom.tollgate.decisions.batched"), g.envoy().counter("wasmcustom.tollgate.decisions.batches"))
}
