//! The filter reaches the sidecar by every transport Envoy's `tollgate_sidecar` cluster can use
//! (HTTP/1.1 or HTTP/2, loopback TCP or the sidecar's unix socket; docs/configuration.md,
//! "Transport to the sidecar"), and the failure modes hold on each: a crashed sidecar fails
//! closed, a restarted one (a new connection; for HTTP/2 after a GOAWAY on SIGTERM) is used again.

use serde_json::{json, Value};
use std::time::Duration;
use tollgate_tests::relay::Relay;
use tollgate_tests::{filter_host, get, poll_until, Envoy, FilterHost, Gateway, SidecarTransport};

const ALL: [SidecarTransport; 4] =
    [SidecarTransport::Http1Tcp, SidecarTransport::Http2Tcp, SidecarTransport::Http1Unix, SidecarTransport::Http2Unix];

/// No auth cache: every request is a call to the sidecar, failing closed after `timeout`.
fn plugin(timeout: &str) -> Value {
    json!({"sidecar": {"timeout": timeout}, "failureMode": "closed", "authCacheMaxTtl": "0ms"})
}

fn status(envoy: &Envoy, key: &str) -> u16 {
    get(&envoy.url("/t"), &[("x-api-key", key)]).status
}

/// Requests from `threads` threads at once, `each` per thread; the statuses.
fn concurrent(envoy: &Envoy, key: &str, threads: usize, each: usize) -> Vec<u16> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(|| (0..each).map(|_| status(envoy, key)).collect::<Vec<_>>())).collect();
        handles.into_iter().flat_map(|h| h.join().expect("request thread")).collect()
    })
}

#[test]
fn every_transport_decides_and_survives_a_sidecar_crash_and_a_graceful_restart() {
    // Generous timeout for a noisy machine; one Envoy per transport on the one sidecar.
    let mut g = Gateway::builder().plugin(plugin("2s")).without_envoy().build();
    let key = g.sidecar().create_key("acme", "gold", &[]);
    let socket = g.sidecar().unix_path().expect("the harness sidecar listens on a unix socket");
    let envoys: Vec<(SidecarTransport, Envoy)> = ALL.iter().map(|&t| (t, g.start_envoy(|o| o.sidecar_transport(t)))).collect();
    let sidecar = g.sidecar_mut();

    for (t, envoy) in &envoys {
        let statuses = concurrent(envoy, &key.raw, 4, 10);
        assert!(statuses.iter().all(|&s| s == 200), "{t:?}: {statuses:?}");
        // The cluster really spoke the protocol it was given.
        let (h1, h2) = (envoy.counter("cluster.tollgate_sidecar.upstream_cx_http1_total"), envoy.counter("cluster.tollgate_sidecar.upstream_cx_http2_total"));
        if t.is_http2() {
            assert!(h2 >= 1 && h1 == 0, "{t:?}: http1 connections {h1}, http2 {h2}");
            // Multiplexed: 40 calls from 4 concurrent clients did not need a connection each
            // (one per Envoy thread that calls; a connection idle for the cluster's 5 s before
            // the requests, as on a loaded machine while the other Envoys start, is replaced)
            let cx = envoy.counter("cluster.tollgate_sidecar.upstream_cx_total");
            let idled = envoy.counter("cluster.tollgate_sidecar.upstream_cx_idle_timeout");
            assert!(cx - idled <= 2, "{t:?}: {cx} connections to the sidecar\n{}", envoy.stats("cluster.tollgate_sidecar.upstream_cx"));
        } else {
            assert!(h1 >= 1 && h2 == 0, "{t:?}: http1 connections {h1}, http2 {h2}");
        }
        assert_eq!(envoy.counter_reaching("wasmcustom.tollgate.requests.allowed", 40), 40, "{t:?}");
    }

    // A crash (SIGKILL): every transport fails closed, and the unix socket's file is left behind.
    sidecar.kill();
    for (t, envoy) in &envoys {
        assert_eq!(status(envoy, &key.raw), 503, "{t:?}: a dead sidecar must fail closed");
    }
    assert!(socket.exists(), "SIGKILL leaves the socket file");
    // The restarted sidecar removes the stale file, binds again, and every transport reconnects.
    sidecar.restart();
    for (t, envoy) in &envoys {
        poll_until(&format!("{t:?}: decisions after the restart"), Duration::from_secs(20), || status(envoy, &key.raw) == 200);
        let statuses = concurrent(envoy, &key.raw, 4, 5);
        assert!(statuses.iter().all(|&s| s == 200), "{t:?} after the restart: {statuses:?}");
    }

    // A graceful stop (SIGTERM): HTTP/2 connections get a GOAWAY, the socket file is removed;
    // then the same again.
    assert!(sidecar.terminate(Duration::from_secs(20)).is_some_and(|s| s.success()), "the sidecar did not stop cleanly");
    assert!(!socket.exists(), "a clean stop removes the socket file");
    for (t, envoy) in &envoys {
        assert_eq!(status(envoy, &key.raw), 503, "{t:?}: a stopped sidecar must fail closed");
    }
    sidecar.restart();
    for (t, envoy) in &envoys {
        poll_until(&format!("{t:?}: decisions after the graceful restart"), Duration::from_secs(20), || status(envoy, &key.raw) == 200);
        let failed = envoy.counter("wasmcustom.tollgate.requests.failed_closed");
        assert!(failed >= 2, "{t:?}: {failed} requests failed closed while the sidecar was down");
    }
}

/// A sidecar that answers the headers of every call and never the body: the filter's timeout
/// fires after Envoy has the response headers, so Envoy resets the call and reports it with no
/// response at all (the path an HTTP/2 answer delayed between its HEADERS and DATA frames took).
fn start_headers_only_sidecar() -> (u16, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let thread = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(8) {
            let Ok(mut s) = stream else { continue };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{");
            held.push(s);
        }
    });
    (port, thread)
}

#[test]
fn a_call_reset_after_its_response_headers_fails_that_request_only() {
    // Before the fix the filter read the missing answer's :status (BadArgument), the SDK
    // panicked, and the Wasm VM was dead: every later request failed, whatever the sidecar did.
    let (port, _thread) = start_headers_only_sidecar();
    let g = Gateway::builder().sidecar_at(port).plugin(plugin("200ms")).transport(SidecarTransport::Http1Tcp).build();
    let envoy = g.envoy();
    for i in 0..3 {
        let r = get(&envoy.url("/t"), &[("x-api-key", "tg_whatever")]);
        assert_eq!(r.status, 503, "request {i}: {}", r.body);
        assert_eq!(r.json()["error"], "sidecar_unavailable", "request {i}");
    }
    assert_eq!(envoy.counter("wasmcustom.tollgate.requests.failed_closed"), 3);
    assert!(!envoy.log_text().contains("panicked"), "the filter panicked:\n{}", envoy.log_text());
}

#[test]
fn an_http2_call_that_times_out_fails_that_request_only() {
    // A black hole accepts the connection and never answers: an HTTP/2 stream times out (Envoy
    // resets it). The filter fails that request closed and keeps working (it once read the
    // missing answer's :status, which killed the Wasm VM).
    for t in [SidecarTransport::Http2Tcp, SidecarTransport::Http1Tcp] {
        let g = Gateway::builder().black_hole_sidecar().plugin(plugin("200ms")).transport(t).build();
        let envoy = g.envoy();
        let statuses = concurrent(envoy, "tg_whatever", 3, 3);
        assert!(statuses.iter().all(|&s| s == 503), "{t:?}: {statuses:?}");
        assert_eq!(envoy.counter("wasmcustom.tollgate.requests.failed_closed"), 9, "{t:?}");
        assert!(!envoy.log_text().contains("panicked"), "{t:?}: the filter panicked:\n{}", envoy.log_text());
    }
}

/// Decision 219: the native host's calls on its own connections to the sidecar
/// (`sidecar.address`), here through a relay that can freeze them. A connection gone silent
/// without closing fails its call closed after the call's timeout and is closed; a new
/// connection decides again.
#[test]
fn the_native_hosts_own_connection_decides_and_is_replaced_when_it_goes_silent() {
    if filter_host() != FilterHost::Native {
        eprintln!("the module's own connection is the native host's (TOLLGATE_HOST=native runs this)");
        return;
    }
    let g = Gateway::builder().plugin(plugin("2s")).without_envoy().build();
    let key = g.sidecar().create_key("acme", "gold", &[]);
    let relay = Relay::start(g.sidecar().port);
    let address = format!("127.0.0.1:{}", relay.port);
    let envoy = g.start_envoy(|o| {
        o.plugin_config(json!({"sidecar": {"timeout": "1s", "address": address}, "failureMode": "closed", "authCacheMaxTtl": "0ms"}))
    });
    let statuses = concurrent(&envoy, &key.raw, 4, 10);
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(envoy.counter_reaching("wasmcustom.tollgate.requests.allowed", 40), 40);

    relay.stall();
    // the frozen connection: a call gets no answer in its second and fails closed
    let r = get(&envoy.url("/t"), &[("x-api-key", &key.raw)]);
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(envoy.counter("wasmcustom.tollgate.requests.failed_closed") >= 1);
    // that connection was closed: the next calls' connections (relayed anew) decide
    poll_until("a new connection to the sidecar", Duration::from_secs(30), || status(&envoy, &key.raw) == 200);
    assert!(!envoy.log_text().contains("panicked"), "{}", envoy.log_text());
}

/// A decision call accepts a compact answer (decision 224) on either host, and the sidecar gives
/// one; a call that does not ask for it (an older filter) gets the same decision in JSON.
#[test]
fn decision_calls_accept_compact_answers_and_an_older_filters_get_json() {
    let g = Gateway::builder()
        .plugin(json!({"sidecar": {"timeout": "2s", "decisionStream": false}, "failureMode": "closed", "authCacheMaxTtl": "0ms"}))
        .build();
    let key = g.sidecar().create_key("acme", "gold", &[]);
    for _ in 0..5 {
        assert_eq!(status(g.envoy(), &key.raw), 200);
    }
    let calls = |format: &str| g.sidecar().metric(&format!("tollgate_sidecar_decide_calls_total{{format=\"{format}\"}}"));
    assert_eq!((calls("compact"), calls("json")), (5, 0), "every decision call of the filter accepted a compact answer");

    // the same request straight to the sidecar, accepting either (over h2c, for the raw bytes)
    let body = json!({"keyHash": tollgate_tests::fixtures::key_hash(&key.raw), "method": "GET", "authority": "api.test", "path": "/t"}).to_string();
    let ask = |accept: Option<&str>| {
        let mut headers = vec![("content-type", "application/json"), g.sidecar().auth()];
        headers.extend(accept.map(|a| ("accept", a)));
        let x = tollgate_tests::h2c::post_to_end(g.sidecar().port(), "/v1/decide", &headers, body.as_bytes());
        assert_eq!(x.status, 200);
        let kind = x.headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v.clone());
        (kind, x.body)
    };
    let (kind, compact) = ask(Some("application/json;q=0.5, Application/X-Tollgate-Compact"));
    assert_eq!(kind.as_deref(), Some(tollgate_wire::compact::COMPACT_MEDIA_TYPE));
    // who was allowed (a limit's remaining count in the headers moves from call to call)
    let who = |d: tollgate_wire::DecideResponse| match d {
        tollgate_wire::DecideResponse::Allow { tenant, key_id, plan, .. } => (tenant, key_id, plan),
        deny => panic!("not allowed: {deny:?}"),
    };
    let read = who(tollgate_wire::compact::decode_answer(&compact).expect("a compact answer").into_result().expect("a decision"));
    assert_eq!((read.0.as_str(), read.1.as_str(), read.2.as_str()), ("acme", key.id.as_str(), "gold"));
    for accept in [None, Some("application/json")] {
        let (kind, json) = ask(accept);
        assert_eq!(kind.as_deref(), Some("application/json"), "{accept:?}");
        assert_eq!(who(serde_json::from_slice(&json).expect("a JSON decision")), read, "the same decision either way");
    }
}
