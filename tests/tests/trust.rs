//! The sidecar's trust boundary (issue 14): every filter→sidecar call carries the deployment's
//! secret, a forged call without it or with another is refused and changes nothing; `/healthz`
//! and `/metrics` stay open; `listen` is loopback unless explicitly allowed; a client that holds
//! a connection without sending its request head is cut off. Real Envoy, sidecar and Redis.

use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use tollgate_tests::fixtures::key_hash;
use tollgate_tests::{get, poll_until, post, send, Gateway, Sidecar};
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
        ("POST", "/v1/decide/batch", Some(format!(r#"{{"requests":[{{"request":{decide}}}]}}"#))),
        ("POST", "/v1/completions", Some(r#"{"completions":[]}"#.into())),
        ("POST", "/v1/usage", Some(r#"{"events":[]}"#.into())),
        ("POST", "/v1/responses", Some(r#"{"entries":[]}"#.into())),
        ("POST", "/v1/responses/claims", Some(r#"{"claims":[]}"#.into())),
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
    // A batch (decision 127): each item decided on its own, in order; a hostile traceparent is
    // only not traced; more items than a batch holds is refused whole.
    let unknown = json!({"keyHash": "0".repeat(64), "method": "GET", "authority": "a", "path": "/"});
    let batch = format!(r#"{{"requests":[{{"request":{decide}}},{{"traceparent":"\u0000\"x","request":{unknown}}}]}}"#);
    let r = send("POST", &sidecar.url("/v1/decide/batch"), &auth, Some(&batch));
    assert_eq!(r.status, 200, "{}", r.body);
    let answers = r.json()["answers"].clone();
    assert_eq!((answers[0]["status"].as_u64(), answers[0]["decision"]["verdict"].as_str()), (Some(200), Some("allow")), "{}", r.body);
    assert_eq!((answers[1]["decision"]["verdict"].as_str(), answers[1]["decision"]["status"].as_u64()), (Some("deny"), Some(401)), "{}", r.body);
    let too_many = format!(r#"{{"requests":[{}]}}"#, vec![format!(r#"{{"request":{decide}}}"#); 129].join(","));
    let r = send("POST", &sidecar.url("/v1/decide/batch"), &auth, Some(&too_many));
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("bad_request")), "{}", r.body);
    assert_eq!(send("POST", &sidecar.url("/v1/decide/batch"), &auth, Some("{\"requests\":[{}]}")).status, 400);
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

/// On the filter's port and on the admin API's alike (decision 77): a client that never sends a
/// whole request head is cut off, and holds no shutdown.
#[test]
fn a_client_that_never_sends_its_request_head_is_cut_off() {
    let admin_port = tollgate_tests::free_port();
    let admin_listen = format!("127.0.0.1:{admin_port}");
    let mut s = Sidecar::start(
        "redis://127.0.0.1:1/",
        &[
            ("TOLLGATE_SIDECAR_SERVER__HEADER_READ_TIMEOUT", "1s"),
            ("TOLLGATE_SIDECAR_ADMIN__LISTEN", admin_listen.as_str()),
            ("TOLLGATE_SIDECAR_ADMIN__TOKEN", "trust-tests-admin-token-0123456789"),
        ],
    );
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
    let partial_head = |port: u16| {
        let mut partial = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        partial.write_all(b"GET /healthz HTTP/1.1\r\nhost: sidecar\r\nx-slow: ").expect("write");
        partial
    };
    for (port, side) in [(s.port, "filter port"), (admin_port, "admin API")] {
        // Silent from the start (the protocol cannot even be told).
        let silent = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        // Half a request head, never finished.
        let partial = partial_head(port);
        // HTTP/2: the preface and SETTINGS, but never a request.
        let mut h2 = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        h2.write_all(&preface).expect("write");
        for (what, c) in [("silent", silent), ("partial head", partial), ("h2 without a stream", h2)] {
            closed(c).unwrap_or_else(|e| panic!("{side}, {what}: {e}"));
        }
    }
    assert!(s.metric("tollgate_sidecar_connections_cut_total{reason=\"header_read_timeout\"}") >= 4);
    // A client that sends its request in time is served as before.
    assert_eq!(get(&s.url("/healthz"), &[]).status, 200);
    assert_eq!(get(&format!("http://{admin_listen}/openapi.json"), &[]).status, 200);
    // A half-sent head on the admin API holds no shutdown: SIGTERM exits cleanly.
    let _held = partial_head(admin_port);
    let status = s.terminate(Duration::from_secs(30)).expect("the sidecar exits on SIGTERM with a half-sent admin request open");
    assert!(status.success(), "{status:?}");
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
    // The raw client: the 413 comes before the body is read, and the server closes (ureq, which
    // reads only after writing everything, would see a broken pipe).
    let r = tollgate_tests::raw::request(s.port(), "POST", "/v1/responses", &auth, too_big.as_bytes());
    assert_eq!((r.status, r.header("content-type")), (413, Some("application/json")), "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"], "payload_too_large");
}

/// A gateway with a token budget and a concurrency cap on plan `p`, a caching route and
/// idempotency on; keys of `acme` and `beta`.
fn ticket_gateway() -> (Gateway, String, String) {
    let toml = format!(
        "{}\n[[plans.p.limits]]\nname = \"tokens\"\nalgorithm = \"token_budget\"\nlimit = 100000\nestimate = 400\n\
         [[plans.p.limits]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 50\n",
        tollgate_tests::fixtures::cache_sidecar_toml(1000)
    );
    let g = Gateway::builder().sidecar_toml(&toml).plugin(tollgate_tests::fixtures::cache_plugin()).build();
    let acme = g.sidecar().create_key("acme", "p", &[]).raw;
    let beta = g.sidecar().create_key("beta", "p", &[]).raw;
    poll_until("the routing table in the filter", Duration::from_secs(20), || {
        get(&g.envoy().url("/warmup"), &[("x-api-key", &acme)]).status == 200
    });
    (g, acme, beta)
}

#[test]
fn tickets_forged_altered_or_replayed_are_refused_and_change_nothing() {
    let (g, acme, _beta) = ticket_gateway();
    let (sidecar, redis) = (g.sidecar(), g.redis());

    // Through Envoy: the filter echoes the sealed tickets it got, and they are taken — the
    // reservation is settled, the response cached, the idempotency outcome stored.
    let r = get(&g.envoy().url("/cached/a"), &[("x-api-key", &acme)]);
    assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("miss")), "{}", r.body);
    let r = post(&g.envoy().url("/orders"), &[("x-api-key", &acme), ("idempotency-key", "order-1")], "{\"n\":1}");
    assert_eq!(r.status, 200, "{}", r.body);
    poll_until("the filter's tickets taken", Duration::from_secs(20), || {
        let reserved = redis.keys("q:reserved:{acme}:*");
        let settled = !reserved.is_empty() && reserved.iter().all(|k| redis.cmd::<Option<String>>(&["GET", k]).as_deref() == Some("settled"));
        let memo = redis.keys("idem:api:{acme}:*");
        let stored = memo.len() == 1 && redis.cmd::<Option<String>>(&["GET", &memo[0]]).is_some_and(|v| !v.starts_with("inflight:"));
        settled && stored && redis.keys("cache:exact:{acme}:p:cached.*").len() == 1
    });
    assert_eq!(sidecar.metric("tollgate_sidecar_tickets_refused_total"), 0, "no ticket of the filter was refused");

    // Direct calls with the deployment's secret: a decision hands out sealed tickets.
    let auth = [sidecar.auth(), ("content-type", "application/json")];
    let decide = |extra: serde_json::Value| {
        let mut req = json!({"keyHash": key_hash(&acme), "method": "POST", "authority": "a", "path": "/cached/b", "route": "cached",
                             "decisionId": format!("{:032x}", rand_id()), "tokenEstimate": 500});
        req.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r = send("POST", &sidecar.url("/v1/decide"), &auth, Some(&req.to_string()));
        assert_eq!((r.status, r.json()["verdict"].as_str()), (200, Some("allow")), "{}", r.body);
        r.json()
    };
    let answer = decide(json!({"cacheKey": "ab".repeat(32)}));
    let ticket = answer["ticket"].clone();
    let store = answer["store"].clone();
    assert_eq!(ticket["mac"].as_str().map(str::len), Some(64), "{ticket}");
    assert_eq!(store["mac"].as_str().map(str::len), Some(64), "{store}");
    let complete = |ticket: &serde_json::Value, tokens: u64| {
        let body = json!({"completions": [{"ticket": ticket, "status": 200, "tokens": tokens}]}).to_string();
        let r = send("POST", &sidecar.url("/v1/completions"), &auth, Some(&body));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let store_one = |ticket: &serde_json::Value, body: &str| {
        let batch = json!({"responses": [{"ticket": ticket, "response": {"status": 200, "body": body}}]}).to_string();
        let r = send("POST", &sidecar.url("/v1/responses"), &auth, Some(&batch));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let altered = |t: &serde_json::Value, field: &str, value: serde_json::Value| {
        let mut t = t.clone();
        let shown = t.to_string();
        *t.pointer_mut(field).unwrap_or_else(|| panic!("{field} in {shown}")) = value;
        t
    };

    // Altered completion tickets: another tenant, a bigger reservation (a refund), a budget
    // dropped, another slot, a longer life, no MAC, another decision. All refused; nothing moves.
    let before = state(redis);
    let forged_completions = [
        altered(&ticket, "/tenant", json!("beta")),
        altered(&ticket, "/budgets/0/reserved", json!(99_000)),
        altered(&ticket, "/budgets", json!([])),
        altered(&ticket, "/slots/0/subject", json!("t")),
        altered(&ticket, "/expiresAtMs", json!(ticket["expiresAtMs"].as_u64().unwrap() + 3_600_000)),
        altered(&ticket, "/mac", json!("")),
        altered(&ticket, "/requestId", json!(format!("{:032x}", rand_id()))),
    ];
    for t in &forged_completions {
        let a = complete(t, 0);
        assert_eq!((a["settled"].as_u64(), a["refused"].as_u64()), (Some(0), Some(1)), "{t}: {a}");
    }
    // Altered store tickets: another tenant (cache poisoning), another plan (decision 169),
    // another route, another hash, a longer life, no MAC.
    let forged_stores = [
        altered(&store, "/tenant", json!("beta")),
        altered(&store, "/plan", json!("gold")),
        altered(&store, "/route", json!("plain")),
        altered(&store, "/hash", json!("cd".repeat(32))),
        altered(&store, "/expiresAtMs", json!(store["expiresAtMs"].as_u64().unwrap() + 3_600_000)),
        altered(&store, "/mac", json!("")),
    ];
    for t in &forged_stores {
        let a = store_one(t, "poison");
        assert_eq!((a["stored"].as_u64(), a["refused"].as_u64()), (Some(0), Some(1)), "{t}: {a}");
    }
    assert_eq!(state(redis), before, "a forged or altered ticket changed Redis");
    assert!(sidecar.metric("tollgate_sidecar_tickets_refused_total{kind=\"completion\",reason=\"mac\"}") >= 7);
    assert!(sidecar.metric("tollgate_sidecar_tickets_refused_total{kind=\"cache\",reason=\"mac\"}") >= 6);

    // The real tickets are taken once; replayed after settlement they change nothing.
    assert_eq!(complete(&ticket, 100)["settled"].as_u64(), Some(1));
    assert_eq!(store_one(&store, "{\"fresh\":1}")["stored"].as_u64(), Some(1));
    let settled = state(redis);
    assert_ne!(settled, before, "the real tickets were taken");
    let duplicates = sidecar.metric("tollgate_sidecar_completions_total{outcome=\"duplicate\"}");
    complete(&ticket, 0); // a replay that would refund the whole reservation
    let a = store_one(&store, "poison");
    assert_eq!((a["stored"].as_u64(), a["refused"].as_u64()), (Some(0), Some(1)), "{a}");
    assert_eq!(state(redis), settled, "a replayed ticket changed Redis");
    assert_eq!(sidecar.metric("tollgate_sidecar_completions_total{outcome=\"duplicate\"}"), duplicates + 1);

    // Idempotency outcomes: a claim's ticket moved to another tenant or key is refused, the
    // real one stores the outcome once, its replay changes nothing.
    let claim = decide(json!({"path": "/orders", "route": "plain", "idempotency": {"key": "order-2", "digest": "0a".repeat(16)}}));
    let idem = claim["store"].clone();
    assert_eq!(idem["kind"], "idempotency", "{claim}");
    let before = state(redis);
    for t in [altered(&idem, "/tenant", json!("beta")), altered(&idem, "/keyId", json!("key_other")), altered(&idem, "/mac", json!(""))] {
        let a = store_one(&t, "poison");
        assert_eq!((a["stored"].as_u64(), a["refused"].as_u64()), (Some(0), Some(1)), "{t}: {a}");
    }
    assert_eq!(state(redis), before, "an altered idempotency ticket changed Redis");
    assert_eq!(store_one(&idem, "{\"order\":2}")["stored"].as_u64(), Some(1));
    let stored = state(redis);
    assert_eq!(store_one(&idem, "poison")["refused"].as_u64(), Some(1));
    assert_eq!(state(redis), stored, "a replayed idempotency ticket changed Redis");
    // the client's retry gets the first outcome
    let replay = decide(json!({"path": "/orders", "route": "plain", "idempotency": {"key": "order-2", "digest": "0a".repeat(16)}}));
    assert_eq!(replay["replay"]["response"]["body"], "{\"order\":2}", "{replay}");
    redis.assert_ttl_invariant();
}

#[test]
fn six_mib_of_idempotency_outcomes_in_one_tick_are_all_stored_and_replayed() {
    // one worker: one response queue takes every outcome
    let g = Gateway::builder()
        .sidecar_toml(PLANS)
        .plugin(json!({"sidecar": {"timeout": "2s"}, "failureMode": "closed", "idempotency": {"enabled": true}}))
        .concurrency(1)
        .build();
    let key = g.sidecar().create_key("acme", "p", &[]).raw;
    // 16 outcomes of ~200 KB each (100 000 quotes, escaped once in the upstream's JSON): ~400 KB
    // each once escaped again, ~6.4 MiB together, all at once (each is stored by its own call
    // before its answer ends; a failed call's outcome goes in a bounded batch)
    const N: usize = 16;
    let url = g.envoy().url("/orders");
    let headers = |i: usize| -> Vec<(String, String)> {
        vec![
            ("x-api-key".into(), key.clone()),
            ("content-type".into(), "application/json".into()),
            ("idempotency-key".into(), format!("big-{i}")),
            ("x-echo-pad".into(), "100000".into()),
        ]
    };
    let first: Vec<tollgate_tests::Resp> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..N)
            .map(|i| {
                let (url, h) = (url.clone(), headers(i));
                s.spawn(move || {
                    let h: Vec<(&str, &str)> = h.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
                    post(&url, &h, &format!("{{\"order\":{i}}}"))
                })
            })
            .collect();
        calls.into_iter().map(|c| c.join().expect("a call")).collect()
    });
    for r in &first {
        assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(200)]);
        assert!(r.body.len() > 200_000, "{}", r.body.len());
    }
    let upstream_calls = g.upstream().calls();
    poll_until("every outcome stored", Duration::from_secs(30), || {
        let memos = g.redis().keys("idem:api:{acme}:*");
        memos.len() == N && memos.iter().all(|m| g.redis().cmd::<Option<String>>(&["GET", m]).is_some_and(|v| !v.starts_with("inflight:")))
    });
    assert_eq!(g.envoy().counter("wasmcustom.tollgate.responses.dropped"), 0, "no outcome dropped");
    // every retry gets its replay, the upstream is not called again
    for (i, r) in first.iter().enumerate() {
        let h = headers(i);
        let h: Vec<(&str, &str)> = h.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let again = post(&url, &h, &format!("{{\"order\":{i}}}"));
        assert_eq!((again.status, again.header("idempotent-replayed")), (200, Some("true")), "retry {i}");
        assert_eq!(again.body, r.body, "retry {i} replays the first outcome");
    }
    assert_eq!(g.upstream().calls(), upstream_calls, "no retry reached the upstream");
}

#[test]
fn six_mib_of_cache_fills_in_one_tick_go_in_several_batches_and_are_all_stored() {
    // Cache fills go with the worker's response batch (idempotency outcomes are stored one by
    // one before their answer ends): 16 bodies of ~200 KB, ~400 KB each once escaped again in a
    // batch, ~6.4 MiB together, above the 4 MiB batch bound. One worker: one queue takes them all.
    use tollgate_tests::fixtures::{cache_plugin, cache_sidecar_toml};
    let mut plugin = cache_plugin();
    plugin["responseCache"]["maxBodyBytes"] = json!(1_048_576);
    let g = Gateway::builder().sidecar_toml(&cache_sidecar_toml(1000)).plugin(plugin).concurrency(1).build();
    let key = g.sidecar().create_key("acme", "p", &[]).raw;
    poll_until("the routing table in the filter", Duration::from_secs(20), || {
        get(&g.envoy().url("/warmup"), &[("x-api-key", &key)]).status == 200
    });
    const N: usize = 16;
    let h = [("x-api-key", key.as_str()), ("x-echo-pad", "100000")];
    let first: Vec<tollgate_tests::Resp> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..N).map(|i| s.spawn({ let g = &g; move || get(&g.envoy().url(&format!("/cached/big-{i}")), &h) })).collect();
        calls.into_iter().map(|c| c.join().expect("a call")).collect()
    });
    for r in &first {
        assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("miss")));
        assert!(r.body.len() > 200_000, "{}", r.body.len());
    }
    poll_until("every fill stored", Duration::from_secs(30), || g.redis().keys("cache:exact:{acme}:*").len() == N);
    assert_eq!(g.envoy().counter("wasmcustom.tollgate.responses.dropped"), 0, "no fill dropped");
    assert!(g.envoy().counter("wasmcustom.tollgate.responses.batches_sent") >= 2, "split below the 4 MiB bound");
    let upstream_calls = g.upstream().calls();
    for (i, r) in first.iter().enumerate() {
        let hit = get(&g.envoy().url(&format!("/cached/big-{i}")), &h);
        assert_eq!(hit.header("x-tollgate-cache"), Some("hit"), "{i}");
        assert!(hit.body == r.body, "{i}: the stored response, byte for byte");
    }
    assert_eq!(g.upstream().calls(), upstream_calls, "every repeat a hit");
}

/// Redis' content (sorted keys and their values) but the rate-limit counters: their windows end
/// on their own while a test runs, and no ticket touches them.
fn state(redis: &tollgate_tests::Redis) -> Vec<(String, Vec<String>)> {
    let mut keys = redis.keys("*");
    keys.retain(|k| !k.starts_with("rl:") && !k.starts_with("rate:"));
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let kind: String = redis.cmd(&["TYPE", &k]);
            let value: Vec<String> = match kind.as_str() {
                "string" => redis.cmd::<Option<String>>(&["GET", &k]).into_iter().collect(),
                "hash" => redis.cmd(&["HGETALL", &k]),
                "set" => redis.cmd(&["SMEMBERS", &k]),
                "zset" => redis.cmd(&["ZRANGE", &k, "0", "-1", "WITHSCORES"]),
                "list" => redis.cmd(&["LRANGE", &k, "0", "-1"]),
                other => vec![format!("<{other}>")],
            };
            (k, value)
        })
        .collect()
}

fn rand_id() -> u128 {
    use std::time::{SystemTime, UNIX_EPOCH};
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() << 16) | u128::from(n)
}

/// Decision 186: the claims endpoint reads what it is sent as hostile — a batch it cannot read or
/// of more than 500 claims is a 400, a ticket the deployment did not seal is not kept (`null`,
/// before Redis is asked: here Redis is unreachable).
#[test]
fn the_claims_endpoint_keeps_only_sealed_claims_and_refuses_what_it_cannot_read() {
    let s = Sidecar::start("redis://127.0.0.1:1/", &[]);
    let auth = [s.auth(), ("content-type", "application/json")];
    let url = s.url("/v1/responses/claims");
    for bad in ["", "{", r#"{"claims":[{"kind":"nope"}]}"#, "\u{0}"] {
        let r = send("POST", &url, &auth, Some(bad));
        assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("bad_request")), "{bad:?}: {}", r.body);
    }
    let forged = json!({"kind": "idempotency", "tenant": "acme", "keyId": "key_1", "digest": "0a".repeat(16), "key": "k", "token": "t",
        "id": "d", "expiresAtMs": u64::MAX / 2, "mac": "00".repeat(32)});
    let r = send("POST", &url, &auth, Some(&json!({"claims": [forged.clone()]}).to_string()));
    assert_eq!((r.status, r.json()["claims"].clone()), (200, json!([null])), "{}", r.body);
    let many = json!({"claims": vec![forged; 501]}).to_string();
    let r = send("POST", &url, &auth, Some(&many));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(s.metric("tollgate_sidecar_idempotency_claims_kept_total{outcome=\"refused\"}"), 1);
}
