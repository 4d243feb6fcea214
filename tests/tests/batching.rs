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
use tollgate_tests::{get, poll_until, Gateway};

const STAYING: usize = 3;
const LEAVING: usize = 3;

#[test]
fn clients_that_leave_while_their_decisions_wait_or_ride_a_batch_are_not_charged() {
    if !tollgate_tests::wasm_host_only("decision batching is the Wasm host's (decision 257)") {
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
