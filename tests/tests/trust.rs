//! The sidecar's trust boundary (issue 14): every filter→sidecar call carries the deployment's
//! secret, a forged call without it or with another is refused and changes nothing; `/healthz`
//! and `/metrics` stay open; `listen` is loopback unless explicitly allowed; a client that holds
//! a connection without sending its request head is cut off. Real Envoy, sidecar and Redis.

use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use tollgate_tests::{get, send, Gateway, Sidecar};
use tollgate_wire::SECRET_HEADER;

const PLANS: &str = "[[plans.p.limits]]\nname = \"pm\"\nalgorithm = \"fixed_window\"\nlimit = 100\nwindow = \"60s\"\n";

#[test]
fn forged_calls_without_or_with_a_wrong_secret_are_refused_and_change_nothing() {
    let g = Gateway::builder().sidecar_toml(PLANS).build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    // The filter's own calls carry the secret: a request is decided and let through.
    assert_eq!(get(&g.envoy().url("/"), &[("x-api-key", key.raw.as_str())]).status, 200);
    let sidecar = g.sidecar();
    let secret = sidecar.secret().to_string();
    assert!(secret.len() >= 32, "the harness gives each deployment a secret");

    let decide = json!({"keyHash": key_hash(&key.raw), "method": "GET", "authority": "a", "path": "/"}).to_string();
    let hint = r#"{"provider":"acme","model":"m1","openedAtMs":1234}"#.to_string();
    let forged: Vec<(&str, &str, Option<String>)> = vec![
        ("POST", "/v1/decide", Some(decide.clone())),
        ("POST", "/v1/completions", Some(r#"{"completions":[]}"#.into())),
        ("POST", "/v1/usage", Some(r#"{"events":[]}"#.into())),
        ("POST", "/v1/responses", Some(r#"{"entries":[]}"#.into())),
        ("POST", "/v1/breaker/hints", Some(hint.clone())),
        ("GET", "/v1/breaker/hints", None),
        ("GET", "/v1/routes", None),
    ];
    let before = g.redis().dump();
    let wrong = format!("{}x", &secret[..secret.len() - 1]);
    for (method, path, body) in &forged {
        for headers in [vec![], vec![(SECRET_HEADER, wrong.as_str())], vec![(SECRET_HEADER, "")], vec![("authorization", secret.as_str())]] {
            let r = send(method, &sidecar.url(path), &headers, body.as_deref());
            assert_eq!(r.status, 401, "{method} {path} with {headers:?}: {}", r.body);
            assert_eq!(r.json()["error"], "unauthorized", "{method} {path}");
            assert!(!r.body.contains(&secret), "the answer shows the secret");
        }
    }
    assert_eq!(g.redis().dump(), before, "a refused call changed Redis");
    assert!(sidecar.metric("tollgate_sidecar_unauthorized_calls_total{path=\"/v1/breaker/hints\"}") >= 8);

    // Open: health and metrics. With the secret, the same calls are served (so the refusals
    // above were the secret's doing): a decision, and a hint that lands in Redis.
    assert_eq!(get(&sidecar.url("/healthz"), &[]).status, 200);
    assert_eq!(get(&sidecar.url("/metrics"), &[]).status, 200);
    let auth = [(SECRET_HEADER, secret.as_str()), ("content-type", "application/json")];
    let r = send("POST", &sidecar.url("/v1/decide"), &auth, Some(&decide));
    assert_eq!((r.status, r.json()["verdict"].as_str()), (200, Some("allow")), "{}", r.body);
    assert_eq!(send("POST", &sidecar.url("/v1/breaker/hints"), &auth, Some(&hint)).status, 204);
    assert!(g.redis().keys("cb:hint:*").contains(&"cb:hint:acme:m1".to_string()));

    // The secret is in no log line.
    assert!(!sidecar.log_text().contains(&secret), "the sidecar logged its secret");
    assert!(!g.envoy().log_text().contains(&secret), "Envoy logged the secret");
}

#[test]
fn an_envoy_with_a_wrong_secret_is_refused_and_fails_closed() {
    let g = Gateway::builder().sidecar_toml(PLANS).build();
    let key = g.sidecar().create_key("acme", "p", &[]);
    let envoy = g.start_envoy(|o| o.sidecar_secret(Some("not-the-deployment-secret")));
    let r = get(&envoy.url("/"), &[("x-api-key", key.raw.as_str())]);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "sidecar_unavailable");
    assert!(g.sidecar().metric("tollgate_sidecar_unauthorized_calls_total{path=\"/v1/decide\"}") >= 1);
}

/// The key hash the filter sends: the lowercase hex sha256 of the raw key.
fn key_hash(raw: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(raw.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn listen_must_be_loopback_unless_explicitly_allowed() {
    // No Redis is needed to check a configuration.
    let s = Sidecar::start("redis://127.0.0.1:1/", &[]);
    let check = |extra: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(tollgate_tests::sidecar_bin());
        cmd.arg("--check-config").env("TOLLGATE_SIDECAR_SERVER__SECRET", s.secret());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd.output().expect("run the sidecar")
    };
    let out = check(&[("TOLLGATE_SIDECAR_LISTEN", "0.0.0.0:9999")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("listen"), "{}", String::from_utf8_lossy(&out.stderr));
    let admin = [("TOLLGATE_SIDECAR_ADMIN__LISTEN", "127.0.0.1:9998"), ("TOLLGATE_SIDECAR_ADMIN__TOKEN", "admin-token-never-printed")];
    let out = check(&[("TOLLGATE_SIDECAR_LISTEN", "0.0.0.0:9999"), ("TOLLGATE_SIDECAR_SERVER__ALLOW_NON_LOOPBACK", "true"), admin[0], admin[1]]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // --check-config prints the configuration with its secrets redacted
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains("configuration OK") && printed.contains("<redacted>"), "{printed}");
    assert!(!printed.contains(s.secret()) && !printed.contains("admin-token-never-printed"), "{printed}");
    // What the harness sidecar listens on: loopback TCP only (`ss -ltnp`).
    let pid = s.pid().expect("pid").to_string();
    let ss = std::process::Command::new("ss").args(["-ltnpH"]).output().expect("ss");
    let lines: Vec<String> = String::from_utf8_lossy(&ss.stdout).lines().filter(|l| l.contains(&format!("pid={pid},"))).map(str::to_string).collect();
    assert!(!lines.is_empty(), "ss shows no listener of the sidecar (pid {pid})");
    for l in &lines {
        let local = l.split_whitespace().nth(3).unwrap_or_default();
        assert!(local.starts_with("127.0.0.1:") || local.starts_with("[::1]:"), "the sidecar listens on {local}: {l}");
    }
}

#[test]
fn a_client_that_never_sends_its_request_head_is_cut_off() {
    let s = Sidecar::start("redis://127.0.0.1:1/", &[("TOLLGATE_SIDECAR_SERVER__HEADER_READ_TIMEOUT", "1s")]);
    // Generous: the server must close well before this; a read that times out is a failure.
    let read_deadline = Duration::from_secs(30);
    let closed = |mut c: TcpStream| -> Result<(), String> {
        c.set_read_timeout(Some(read_deadline)).expect("read timeout");
        let mut buf = [0u8; 1024];
        loop {
            match c.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(_) => continue, // e.g. an HTTP/2 SETTINGS frame, a GOAWAY
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
                Err(e) => return Err(format!("not closed by the server: {e}")),
            }
        }
    };
    // Silent from the start (the protocol cannot even be told).
    let silent = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    // Half a request head, never finished.
    let mut partial = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    partial.write_all(b"GET /healthz HTTP/1.1\r\nhost: sidecar\r\nx-slow: ").expect("write");
    // HTTP/2: the preface and SETTINGS, but never a request.
    let mut h2 = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    h2.write_all(&preface).expect("write");
    for (what, c) in [("silent", silent), ("partial head", partial), ("h2 without a stream", h2)] {
        closed(c).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    assert!(s.metric("tollgate_sidecar_connections_cut_total{reason=\"header_read_timeout\"}") >= 2);
    // A client that sends its request in time is served as before.
    assert_eq!(get(&s.url("/healthz"), &[]).status, 200);
}

#[test]
fn a_response_batch_above_two_mib_is_read_and_one_above_the_limit_answers_json() {
    let s = Sidecar::start("redis://127.0.0.1:1/", &[]);
    let auth = [s.auth(), ("content-type", "application/json")];
    // 6 MiB: above axum's default 2 MiB, which dropped whole batches of stored responses
    let batch = format!("{{\"responses\":[],\"pad\":\"{}\"}}", "x".repeat(6 << 20));
    let r = send("POST", &s.url("/v1/responses"), &auth, Some(&batch));
    assert_eq!(r.status, 200, "{}", r.body);
    let too_big = format!("{{\"responses\":[],\"pad\":\"{}\"}}", "x".repeat(33 << 20));
    let r = send("POST", &s.url("/v1/responses"), &auth, Some(&too_big));
    assert_eq!((r.status, r.header("content-type")), (413, Some("application/json")), "{}", r.body);
    assert_eq!(r.json()["error"], "payload_too_large");
}
