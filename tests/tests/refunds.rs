//! Abandoned decisions are refunded (issue 15.2), through two real Envoys and their sidecars on
//! one Redis: a test-only delay (`TOLLGATE_TEST_DECIDE_DELAY_FILE`, sidecar/src/testing.rs) holds
//! every decision's answer back past the filter's callout timeout, so a burst is refused with 503
//! `sidecar_unavailable` although each decision was allowed and took from its limits. The filters
//! report those decisions on their next flush and the sidecars give everything back: the
//! fixed-window counter, the concurrency slots and the Idempotency-Key claim are as if the burst
//! never came — the limit then admits exactly its 10 requests, the cap its 6 in flight, and the
//! key executes its request. A rolling restart of the sidecar under traffic (SIGTERM, then a new
//! process) charges exactly the requests admitted.

use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tollgate_tests::fixtures::{limit_toml, well_inside_the_hour, DecideDelay};
use tollgate_tests::{get, poll_until, post, Gateway, Resp};

/// Ten requests an hour, six in flight.
fn plan() -> String {
    [limit_toml("p", "pm", "fixed_window", 10, "window = \"1h\""), limit_toml("p", "conc", "concurrency", 6, "")].concat()
}

/// The burst: 5 GETs and one POST with an Idempotency-Key, 6 decisions in all (the cap).
const BURST_GETS: usize = 5;

#[test]
fn decisions_whose_answers_came_too_late_are_given_back() {
    well_inside_the_hour();
    let delay = DecideDelay::new(0);
    let g = Gateway::builder()
        .sidecar_toml(&plan())
        .sidecar_env(delay.env().0, &delay.env().1)
        .plugin(json!({
            "sidecar": {"timeout": "500ms"}, "failureMode": "closed",
            "idempotency": {"enabled": true}, "completionFlushInterval": "20ms",
        }))
        .replicas(2)
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let urls = [g.replica(0).envoy().url("/"), g.replica(1).envoy().url("/orders")];
    let h = [("x-api-key", key.raw.as_str())];
    let idem = [("x-api-key", key.raw.as_str()), ("content-type", "application/json"), ("idempotency-key", "\"order-1\"")];
    let (window_key, conc_key) = (format!("rl:{{acme}}:pm:k.{}:*", key.id), format!("q:conc:{{acme}}:conc:k.{}", key.id));
    let counter = || -> u64 {
        let keys = g.redis().keys(&window_key);
        keys.first().map_or(0, |k| g.redis().cmd::<Option<u64>>(&["GET", k]).unwrap_or(0))
    };
    let slots = || g.redis().cmd::<u64>(&["ZCARD", &conc_key]);

    // every answer now comes 2 s after its decision, the filters give up after 500 ms
    delay.set(2000);
    let burst: Vec<Resp> = std::thread::scope(|s| {
        let mut handles: Vec<_> = (0..BURST_GETS).map(|i| { let (urls, h) = (&urls, &h); s.spawn(move || get(&urls[i % 2], h)) }).collect();
        handles.push(s.spawn(|| post(&urls[1], &idem, r#"{"item":"book"}"#)));
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let refused_at = Instant::now();
    for r in &burst {
        assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("sidecar_unavailable")), "{}", r.body);
    }
    assert_eq!(g.upstream().calls(), 0, "nothing of the burst was admitted");
    // the decisions ran, were allowed and took — then the filters' refunds gave it all back. Each
    // refused request reported its decision once; a decision that waited for its worker's batch
    // until its deadline was never sent (decision 127): nothing to report, nothing taken.
    let queued: u64 = (0..2).map(|i| g.replica(i).envoy().counter("wasmcustom.tollgate.refunds.queued")).sum();
    assert!((1..=1 + BURST_GETS as u64).contains(&queued), "each refused decision that was sent is reported once: {queued}");
    let settled = |outcome: &str| -> u64 {
        (0..2).map(|i| g.replica(i).sidecar().metric(&format!("tollgate_sidecar_refunds_total{{outcome=\"{outcome}\"}}"))).sum()
    };
    poll_until("every reported decision settled", Duration::from_secs(20), || {
        ["refunded", "nothing", "completed", "unknown_key", "invalid"].iter().map(|o| settled(o)).sum::<u64>() == queued
    });
    let took = refused_at.elapsed();
    let refunded = settled("refunded");
    assert!(refunded >= 1 && refunded <= queued, "refunded {refunded} of {queued} reported");
    assert_eq!(counter(), 0, "the window counter is back where it was");
    assert_eq!(slots(), 0, "no concurrency slot is held");
    assert!(g.redis().keys("idem:*{acme}*").is_empty(), "the Idempotency-Key claim is released: {:?}", g.redis().keys("idem:*"));
    assert!(g.redis().keys("dec:{acme}:*").is_empty(), "every decision record is consumed by its refund");
    assert!(g.redis().keys("q:reserved:*").is_empty());
    eprintln!("refunded {refunded} of {queued} reported decisions {took:?} after the filters refused them");
    delay.set(0);

    // as if the burst never came: the cap holds its 6 in flight (each upstream call held 1 s)...
    let slow = [("x-api-key", key.raw.as_str()), ("x-echo-delay-ms", "1000")];
    let held: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6).map(|i| { let (urls, slow) = (&urls, &slow); s.spawn(move || get(&urls[i % 2], slow).status) }).collect();
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(held, [200; 6], "the cap admits 6 in flight: no slot of the burst is left");
    poll_until("the 6 slots freed by their completions", Duration::from_secs(20), || slots() == 0);
    // ...the Idempotency-Key executes its request (not 409 in flight, not a replay)...
    let before = g.upstream().calls();
    let first = post(&urls[1], &idem, r#"{"item":"book"}"#);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(g.upstream().calls(), before + 1);
    // ...and the window admits exactly its 10: 6 + 1 so far, 3 more, then 429
    for i in 0..3 {
        poll_until("a free slot", Duration::from_secs(20), || slots() == 0);
        let r = get(&urls[i % 2], &h);
        assert_eq!(r.status, 200, "request {} of the window: {}", 8 + i, r.body);
    }
    poll_until("a free slot", Duration::from_secs(20), || slots() == 0);
    let over = get(&urls[0], &h);
    assert_eq!((over.status, over.json()["error"].as_str()), (429, Some("rate_limited")), "{}", over.body);
    assert_eq!(counter(), 10);
    assert!(g.redis().assert_ttl_invariant() > 0, "every key written has a TTL");
}

#[test]
fn a_sidecar_stopped_under_traffic_charges_exactly_the_requests_it_admitted() {
    // A rolling restart: SIGTERM to the sidecar while four clients keep sending, then the new
    // process. The sidecar finishes the decisions in flight and exits 0; requests meanwhile are
    // refused (failure mode closed). The promise kept: the limit's counter holds exactly the
    // requests that were admitted — none refused was charged, none admitted went uncounted.
    well_inside_the_hour();
    let mut g = Gateway::builder()
        .sidecar_toml(&limit_toml("p", "pm", "fixed_window", 1_000_000, "window = \"1h\""))
        .plugin(json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed", "completionFlushInterval": "20ms"}))
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let url = g.envoy().url("/");
    let window_key = format!("rl:{{acme}}:pm:k.{}:*", key.id);
    let stop = AtomicBool::new(false);
    let answers: Vec<Resp> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let (url, raw, stop) = (&url, key.raw.as_str(), &stop);
                s.spawn(move || {
                    let mut got = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        got.push(get(url, &[("x-api-key", raw)]));
                    }
                    got
                })
            })
            .collect();
        poll_until("traffic before the restart", Duration::from_secs(20), || g.upstream().calls() >= 50);
        let status = g.sidecar_mut().terminate(Duration::from_secs(10)).expect("the sidecar exits on SIGTERM");
        assert!(status.success(), "exit status {status}");
        g.sidecar_mut().restart();
        let restarted_at = g.upstream().calls();
        poll_until("traffic after the restart", Duration::from_secs(20), || g.upstream().calls() >= restarted_at + 50);
        stop.store(true, Ordering::Relaxed);
        clients.into_iter().flat_map(|t| t.join().unwrap()).collect()
    });
    let admitted = answers.iter().filter(|r| r.status == 200).count() as u64;
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.json()["error"].as_str()), (503, Some("sidecar_unavailable")), "{}", r.body);
    }
    eprintln!("{} requests: {admitted} admitted, {} refused during the restart", answers.len(), answers.len() as u64 - admitted);
    assert_eq!(g.upstream().calls(), admitted, "every admitted request reached the upstream, no other");
    let counter = || -> u64 { g.redis().keys(&window_key).iter().map(|k| g.redis().cmd::<Option<u64>>(&["GET", k]).unwrap_or(0)).sum() };
    // refunds of decisions whose answers were lost arrive with the filter's next flush
    let deadline = Instant::now() + Duration::from_secs(10);
    while counter() != admitted && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50)); // the poll interval of a wait with a deadline
    }
    assert_eq!(counter(), admitted, "the limit's counter against the requests admitted");
}
