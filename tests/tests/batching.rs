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
use std::io::{Read, Write};
use std::time::Duration;
use tollgate_tests::fixtures::{limit_toml, well_inside_the_hour, DecideDelay};
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
    let window_key = format!("rl:{{acme}}:pm:k.{}:*", key.id);
    let counter = || -> u64 {
        let keys = g.redis().keys(&window_key);
        keys.first().map_or(0, |k| g.redis().cmd::<Option<u64>>(&["GET", k]).unwrap_or(0))
    };
    let url = g.envoy().url("/");
    let port: u16 = url.trim_start_matches("http://").split([':', '/']).nth(1).unwrap().parse().unwrap();
    let statuses: Vec<Option<u16>> = std::thread::scope(|s| {
        let mut handles: Vec<_> = (0..STAYING).map(|_| s.spawn(|| Some(get(&url, &[("x-api-key", &key.raw)]).status))).collect();
        for _ in 0..LEAVING {
            handles.push(s.spawn(|| {
                let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                let req = format!("GET / HTTP/1.1\r\nhost: api.test\r\nx-api-key: {}\r\n\r\n", key.raw);
                c.write_all(req.as_bytes()).unwrap();
                c.set_read_timeout(Some(Duration::from_millis(150))).unwrap();
                let mut buf = [0u8; 64];
                // an answer within its patience would be a test fault: the answers come after 600 ms
                assert!(c.read(&mut buf).is_err(), "a leaving client was answered before it left");
                None // dropped: the connection closes, the request ends
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
