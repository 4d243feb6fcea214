//! Functional tests of issue 7 through a real Envoy: the tenant-scoped exact-match response cache
//! (miss then hit with the upstream called once, tenants apart, canonical JSON bodies, key
//! headers, no-store, oversized, limits still counted) and Idempotency-Key replay (replay with the
//! upstream called once, 409 while in flight, 422 for another body, failures released, 400 for a
//! malformed key), and both with Redis stopped (requests still served).

use std::sync::{Arc, Barrier};
use std::time::Duration;
use tollgate_tests::fixtures::{cache_plugin, cache_sidecar_toml};
use tollgate_tests::{get, poll_until, post, Gateway, Resp};

/// The raw keys of the two tenants of these tests.
struct Keys {
    acme: String,
    beta: String,
}

/// The response-cache gateway (a limit of 1000 a minute), keys of tenants `acme` and `beta`;
/// waits until the routing table reached the filter.
fn start() -> (Gateway, Keys) {
    let g = Gateway::builder().sidecar_toml(&cache_sidecar_toml(1000)).plugin(cache_plugin()).build();
    let keys = Keys { acme: g.sidecar().create_key("acme", "p", &[]).raw, beta: g.sidecar().create_key("beta", "p", &[]).raw };
    // the routing table reached the filter: a routed request goes through
    poll_until("the routing table in the filter", Duration::from_secs(20), || {
        get(&g.envoy().url("/warmup"), &[("x-api-key", &keys.acme)]).status == 200
    });
    (g, keys)
}

/// Waits until the cache holds `n` entries of `tenant`: the responses before were stored (the
/// filter's queue is sent in order, so this is also a barrier for earlier ones).
fn await_cached(g: &Gateway, tenant: &str, n: usize) {
    poll_until(&format!("{n} cached responses of {tenant}"), Duration::from_secs(20), || {
        g.redis().keys(&format!("cache:exact:{{{tenant}}}:*")).len() >= n
    });
}

fn remaining(r: &Resp) -> u64 {
    let v = r.header("ratelimit").unwrap_or_else(|| panic!("no RateLimit header: {:?}", r.headers));
    v.split("r=").nth(1).and_then(|x| x.split(';').next()).and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("bad RateLimit {v}"))
}

#[test]
fn cache_miss_then_hit_per_tenant_with_canonical_bodies_no_store_and_size_bounds() {
    let (g, k) = start();
    let url = g.envoy().url("/cached/items?b=2&a=1");
    let acme = [("x-api-key", k.acme.as_str()), ("x-user", "u1")];

    // miss: the upstream answers and the response is stored off the request path
    let before = g.upstream().calls();
    let first = get(&url, &acme);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-tollgate-cache"), Some("miss"));
    assert_eq!(g.upstream().calls(), before + 1);
    await_cached(&g, "acme", 1);

    // hit: the stored response (same echoed x-request-id), the upstream not called, the limit counted
    let hit = get(&g.envoy().url("/cached/items?a=1&b=2"), &acme);
    assert_eq!(hit.status, 200, "{}", hit.body);
    assert_eq!(hit.header("x-tollgate-cache"), Some("hit"));
    assert!(hit.header("age").is_some(), "{:?}", hit.headers);
    assert_eq!(hit.header("content-type"), Some("application/json"));
    assert_eq!(hit.body, first.body, "the stored response is replayed");
    assert_eq!(g.upstream().calls(), before + 1, "a hit does not reach the upstream");
    assert_eq!(remaining(&hit), remaining(&first) - 1, "a hit still counts against the caller's limits");
    assert!(hit.echoed().header("x-tollgate-tenant") == Some("acme"));

    // another tenant with the very same request does not share acme's entry
    let beta = get(&url, &[("x-api-key", &k.beta), ("x-user", "u1")]);
    assert_eq!((beta.status, beta.header("x-tollgate-cache")), (200, Some("miss")));
    assert_eq!(beta.echoed().header("x-tollgate-tenant"), Some("beta"));
    assert_eq!(g.upstream().calls(), before + 2);
    // a key header of the route is part of the key
    let other_user = get(&url, &[("x-api-key", &k.acme), ("x-user", "u2")]);
    assert_eq!(other_user.header("x-tollgate-cache"), Some("miss"));
    assert_eq!(g.upstream().calls(), before + 3);
    await_cached(&g, "beta", 1);
    await_cached(&g, "acme", 2);
    let beta_hit = get(&url, &[("x-api-key", &k.beta), ("x-user", "u1")]);
    assert_eq!(beta_hit.header("x-tollgate-cache"), Some("hit"));
    assert_eq!(beta_hit.echoed().header("x-tollgate-tenant"), Some("beta"), "beta gets its own response");

    // JSON bodies: key order and whitespace do not matter
    let json = [("x-api-key", k.acme.as_str()), ("content-type", "application/json")];
    let chat = g.envoy().url("/cached/chat");
    let miss = post(&chat, &json, r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
    assert_eq!((miss.status, miss.header("x-tollgate-cache")), (200, Some("miss")));
    await_cached(&g, "acme", 3);
    let calls = g.upstream().calls();
    let hit = post(&chat, &json, "{ \"messages\": [ {\"content\": \"hi\", \"role\": \"user\"} ],\n \"model\": \"m\" }");
    assert_eq!((hit.status, hit.header("x-tollgate-cache")), (200, Some("hit")), "{}", hit.body);
    let other = post(&chat, &json, r#"{"model":"m","messages":[{"role":"user","content":"bye"}]}"#);
    assert_eq!(other.header("x-tollgate-cache"), Some("miss"));
    assert_eq!(g.upstream().calls(), calls + 1);
    await_cached(&g, "acme", 4);

    // Cache-Control: no-store on the request: not looked up, not stored
    let ns = g.envoy().url("/cached/no-store-request");
    for _ in 0..2 {
        let r = get(&ns, &[("x-api-key", &k.acme), ("cache-control", "no-store")]);
        assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("bypass")));
    }
    // no-store on the response, and a response over responseCache.maxBodyBytes: never stored
    let nsr = g.envoy().url("/cached/no-store-response");
    let big = g.envoy().url("/cached/big");
    let pad = "p".repeat(6000);
    let r = get(&nsr, &[("x-api-key", &k.acme), ("x-echo-cache-control", "no-store")]);
    assert_eq!(r.header("x-tollgate-cache"), Some("miss"));
    let r = get(&big, &[("x-api-key", &k.acme), ("x-pad", &pad)]);
    assert!(r.body.len() > 4096 && r.header("x-tollgate-cache") == Some("miss"));
    // a barrier: a later response is stored, so the two above were handled (and refused)
    let cached_now = g.redis().keys("cache:exact:{acme}:*").len();
    assert_eq!(get(&g.envoy().url("/cached/barrier"), &[("x-api-key", &k.acme)]).status, 200);
    await_cached(&g, "acme", cached_now + 1);
    assert_eq!(g.redis().keys("cache:exact:{acme}:*").len(), cached_now + 1, "no-store and oversized responses are not stored");
    let calls = g.upstream().calls();
    assert_eq!(get(&nsr, &[("x-api-key", &k.acme), ("x-echo-cache-control", "no-store")]).header("x-tollgate-cache"), Some("miss"));
    assert_eq!(get(&big, &[("x-api-key", &k.acme), ("x-pad", &pad)]).header("x-tollgate-cache"), Some("miss"));
    assert_eq!(g.upstream().calls(), calls + 2);

    // a request with a credential the upstream sees (a Cookie, a Basic Authorization) may get an
    // answer that caller's alone: never served from, nor stored in, the tenant's shared cache
    let personal = g.envoy().url("/cached/personal");
    for credential in [("authorization", "Basic YWxpY2U6c2VjcmV0"), ("cookie", "session=alice")] {
        let calls = g.upstream().calls();
        for _ in 0..2 {
            let r = get(&personal, &[("x-api-key", &k.acme), credential]);
            assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("bypass")), "{credential:?}");
        }
        assert_eq!(g.upstream().calls(), calls + 2, "{credential:?}: both went upstream");
    }
    let r = get(&personal, &[("x-api-key", &k.acme)]);
    assert_eq!(r.header("x-tollgate-cache"), Some("miss"), "nothing was stored for the personal requests");

    // a route without a cache TTL says nothing about caching
    let plain = get(&g.envoy().url("/plain"), &[("x-api-key", &k.acme)]);
    assert_eq!((plain.status, plain.header("x-tollgate-cache")), (200, None));

    // every cache key carries a TTL within the route's, and nothing holds a raw key
    for k in g.redis().keys("cache:exact:*") {
        let mut c = g.redis().connection().unwrap();
        let ttl: i64 = redis::cmd("PTTL").arg(&k).query(&mut c).unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{k}: {ttl}");
    }
    g.redis().assert_ttl_invariant();
    g.redis().assert_no_raw_keys(&[&k.acme, &k.beta]);
    assert!(g.envoy().counter("wasmcustom.tollgate.cache.hits") >= 3);
}

#[test]
fn a_retry_right_after_the_answer_is_a_replay_never_a_409() {
    // Issue 15.4: the outcome is stored before the answer's end reaches the client, so a retry
    // sent the moment the answer is in finds it. 20 fresh keys, each retried at once. The echo's
    // answers carry a content-length: the client has the answer at its last byte, before the
    // stream's end (the filter holds that byte too, filter::hold).
    let (g, k) = start();
    let url = g.envoy().url("/orders");
    let mut conflicts = Vec::new();
    for i in 0..20 {
        let key = format!("\"now-{i}\"");
        let h = [("x-api-key", k.acme.as_str()), ("content-type", "application/json"), ("idempotency-key", key.as_str())];
        let body = format!(r#"{{"item":"cup","n":{i}}}"#);
        let calls = g.upstream().calls();
        let first = post(&url, &h, &body);
        assert_eq!((first.status, first.header("idempotent-replayed")), (200, None), "{i}: {}", first.body);
        let retry = post(&url, &h, &body);
        if retry.status == 409 {
            conflicts.push(i);
            continue;
        }
        assert_eq!((retry.status, retry.header("idempotent-replayed")), (200, Some("true")), "{i}: {}", retry.body);
        assert_eq!(retry.body, first.body, "{i}: the stored response, byte for byte");
        assert_eq!(g.upstream().calls(), calls + 1, "{i}: the upstream is called once");
    }
    assert!(conflicts.is_empty(), "retries answered 409 right after the answer: {conflicts:?}");
    assert!(g.envoy().counter("wasmcustom.tollgate.idempotency.replays") >= 20);

    // A body of many chunks (200 kB): it streams, its last chunk waits for the outcome, and the
    // replay is the answer byte for byte (a held chunk is presented again with the end: read once).
    for i in 0..3 {
        let key = format!("\"big-{i}\"");
        let h = [("x-api-key", k.acme.as_str()), ("idempotency-key", key.as_str()), ("x-echo-pad", "100000")];
        let first = post(&url, &h, "{}");
        assert_eq!(first.status, 200, "{i}");
        assert!(first.body.len() > 200_000, "{i}: {}", first.body.len());
        let retry = post(&url, &h, "{}");
        assert_eq!((retry.status, retry.header("idempotent-replayed")), (200, Some("true")), "{i}");
        assert!(retry.body == first.body, "{i}: the stored response, byte for byte ({} vs {} bytes)", retry.body.len(), first.body.len());
    }
}

#[test]
fn duplicates_sent_at_once_run_once_and_a_large_outcome_replays_without_running_again() {
    let mut plugin = cache_plugin();
    plugin["idempotency"]["maxBodyBytes"] = serde_json::json!(1024);
    let g = Gateway::builder().sidecar_toml(&cache_sidecar_toml(1000)).plugin(plugin).build();
    let acme = g.sidecar().create_key("acme", "p", &[]).raw;
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&g.envoy().url("/warmup"), &[("x-api-key", &acme)]).status == 200);
    let url = g.envoy().url("/orders");

    // Twelve copies of one request released together at a slow upstream: exactly one runs; each
    // other gets 409 (in flight) or, if it came after the outcome, the replay.
    for round in 0..3 {
        let key = format!("\"at-once-{round}\"");
        let calls = g.upstream().calls();
        let barrier = Arc::new(Barrier::new(12));
        let threads: Vec<_> = (0..12)
            .map(|_| {
                let (url, acme, key, barrier) = (url.clone(), acme.clone(), key.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let h = [("x-api-key", acme.as_str()), ("content-type", "application/json"), ("idempotency-key", key.as_str()), ("x-echo-delay-ms", "300")];
                    barrier.wait();
                    post(&url, &h, r#"{"item":"desk"}"#)
                })
            })
            .collect();
        let answers: Vec<Resp> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let seen: Vec<(u16, Option<&str>)> = answers.iter().map(|r| (r.status, r.header("idempotent-replayed"))).collect();
        assert_eq!(seen.iter().filter(|s| **s == (200, None)).count(), 1, "round {round}: one runs: {seen:?}");
        for r in &answers {
            let in_flight = r.status == 409 && r.json()["error"] == "idempotency_in_flight";
            assert!(in_flight || r.status == 200, "round {round}: {} {}", r.status, r.body);
        }
        assert_eq!(g.upstream().calls(), calls + 1, "round {round}: the upstream ran it once ({seen:?})");
    }

    // An outcome whose body is over idempotency.maxBodyBytes is remembered without it: the retry
    // gets the status and headers, a well-formed empty body, and the operation is not run again.
    let h = [("x-api-key", acme.as_str()), ("idempotency-key", "\"big\""), ("x-echo-pad", "5000")];
    let calls = g.upstream().calls();
    let first = post(&url, &h, "{}");
    assert!(first.status == 200 && first.body.len() > 5000, "{} {}", first.status, first.body.len());
    let retry = post(&url, &h, "{}");
    assert_eq!((retry.status, retry.header("idempotent-replayed")), (200, Some("true")), "{}", retry.body);
    assert!(retry.body.is_empty(), "{} bytes replayed", retry.body.len());
    assert_eq!(g.upstream().calls(), calls + 1, "not run again");
}

#[test]
fn idempotency_key_replays_refuses_in_flight_and_reused_keys_and_releases_failures() {
    let (g, k) = start();
    let url = g.envoy().url("/orders");
    let h = |key: &'static str| -> Vec<(&str, &str)> {
        vec![("x-api-key", k.acme.as_str()), ("content-type", "application/json"), ("idempotency-key", key)]
    };

    // first request: forwarded once
    let before = g.upstream().calls();
    let first = post(&url, &h("\"order-1\""), r#"{"item":"book","qty":1}"#);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(g.upstream().calls(), before + 1);
    // a retry right after the answer (same key, same body — whitespace and key order aside) gets
    // the stored response: the outcome was stored before the answer ended
    let retry = post(&url, &h("\"order-1\""), r#"{ "qty": 1, "item": "book" }"#);
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body, "the stored response, byte for byte");
    assert_eq!(g.upstream().calls(), before + 1, "the upstream is not called again");
    let memo = g.redis().keys("idem:api:{acme}:*");
    assert_eq!(memo.len(), 1, "{memo:?}");
    let mut c = g.redis().connection().unwrap();
    let ttl: i64 = redis::cmd("PTTL").arg(&memo[0]).query(&mut c).unwrap();
    assert!(ttl > 23 * 3_600_000 && ttl <= 24 * 3_600_000, "24 h memo, got {ttl} ms");

    // the same key with another body: 422, nothing forwarded
    let reused = post(&url, &h("\"order-1\""), r#"{"item":"pen","qty":1}"#);
    assert_eq!(reused.status, 422, "{}", reused.body);
    assert_eq!(reused.json()["error"], "idempotency_key_reused");
    assert_eq!(g.upstream().calls(), before + 1);

    // a concurrent duplicate while the first is still at the (slow) upstream: 409
    let slow_url = url.clone();
    let acme = k.acme.clone();
    let calls_before_slow = g.upstream().calls();
    let slow = std::thread::spawn(move || {
        post(
            &slow_url,
            &[("x-api-key", &acme), ("content-type", "application/json"), ("idempotency-key", "\"order-2\""), ("x-echo-delay-ms", "3000")],
            r#"{"item":"lamp"}"#,
        )
    });
    poll_until("the slow request at the upstream", Duration::from_secs(20), || g.upstream().calls() > calls_before_slow);
    let dup = post(&url, &h("\"order-2\""), r#"{"item":"lamp"}"#);
    assert_eq!(dup.status, 409, "{}", dup.body);
    assert_eq!(dup.json()["error"], "idempotency_in_flight");
    assert_eq!(slow.join().unwrap().status, 200);
    assert_eq!(g.upstream().calls(), calls_before_slow + 1);

    // a failed outcome is not memoized: the claim is released and a retry executes again
    let failing = [("x-api-key", k.acme.as_str()), ("content-type", "application/json"), ("idempotency-key", "order-3"), ("x-echo-status", "503")];
    assert_eq!(post(&url, &failing, r#"{"item":"mug"}"#).status, 503);
    let calls = g.upstream().calls();
    let again = post(&url, &h("order-3"), r#"{"item":"mug"}"#);
    assert_eq!(again.status, 200, "released before the failure's answer ended: {}", again.body);
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(g.upstream().calls(), calls + 1, "executed again");

    // a malformed key: 400 from the filter; another API key's requests never replay acme's
    let bad = post(&url, &h("\"unterminated"), "{}");
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"], "invalid_idempotency_key");
    let calls = g.upstream().calls();
    let other_key = post(&url, &[("x-api-key", &k.beta), ("content-type", "application/json"), ("idempotency-key", "\"order-1\"")], r#"{"item":"book","qty":1}"#);
    assert_eq!((other_key.status, other_key.header("idempotent-replayed")), (200, None));
    assert_eq!(g.upstream().calls(), calls + 1);
    g.redis().assert_ttl_invariant();
    g.redis().assert_no_raw_keys(&[&k.acme, &k.beta]);
}

/// Decision 166: a request whose operation may have run — here its client leaves while the
/// upstream works on it — keeps its claim: a retry gets 409 until the claim expires, never a
/// second run beside the first. (Before, the end of the request released the claim and the retry
/// ran the operation again.) An upstream's own failure still releases it (the test above).
#[test]
fn an_idempotent_request_whose_outcome_is_unknown_keeps_its_claim() {
    use std::io::Write;
    let (g, k) = start();
    let url = g.envoy().url("/orders");
    let h = [("x-api-key", k.acme.as_str()), ("content-type", "application/json"), ("idempotency-key", "\"order-9\"")];
    let before = g.upstream().calls();
    let body = r#"{"item":"kettle"}"#;
    let mut client = std::net::TcpStream::connect(("127.0.0.1", g.envoy().port)).unwrap();
    let mut request = format!("POST /orders HTTP/1.1\r\nhost: gw\r\ncontent-length: {}\r\nx-echo-delay-ms: 5000\r\n", body.len());
    for (n, v) in h {
        request.push_str(&format!("{n}: {v}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    client.write_all(request.as_bytes()).unwrap();
    poll_until("the request at the upstream", Duration::from_secs(20), || g.upstream().calls() > before);
    drop(client);
    assert_eq!(g.envoy().counter_reaching("wasmcustom.tollgate.idempotency.outcome_unknown", 1), 1);
    // a response stored after that request's end: the filter's queue is sent in order, so a
    // release queued then (what ended such a claim before) has reached Redis too
    let fill = get(&g.envoy().url("/cached/after"), &[("x-api-key", k.acme.as_str()), ("x-user", "u1")]);
    assert_eq!(fill.header("x-tollgate-cache"), Some("miss"), "{}", fill.body);
    await_cached(&g, "acme", 1);
    let calls = g.upstream().calls();
    let retry = post(&url, &h, body);
    assert_eq!(retry.status, 409, "{}", retry.body);
    assert_eq!(retry.json()["error"], "idempotency_in_flight");
    assert_eq!(g.upstream().calls(), calls, "not run a second time");
    assert_eq!(g.redis().keys("idem:api:{acme}:*").len(), 1, "the in-flight marker stays");
    g.redis().assert_ttl_invariant();
}

#[test]
fn redis_stopped_requests_are_still_served() {
    let (mut g, k) = start();
    let cached = g.envoy().url("/cached/down");
    let acme = [("x-api-key", k.acme.as_str())];
    assert_eq!(get(&cached, &acme).status, 200);
    await_cached(&g, "acme", 1);
    assert_eq!(get(&cached, &acme).header("x-tollgate-cache"), Some("hit"));

    g.redis_mut().kill();
    // the sidecar still knows the key (stale grace); the cache misses, idempotency executes
    for i in 0..3 {
        let calls = g.upstream().calls();
        let r = get(&cached, &acme);
        assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("miss")), "{}", r.body);
        assert_eq!(g.upstream().calls(), calls + 1);
        let r = post(
            &g.envoy().url("/orders"),
            &[("x-api-key", &k.acme), ("content-type", "application/json"), ("idempotency-key", "\"down-1\"")],
            r#"{"n":1}"#,
        );
        assert_eq!((r.status, r.header("idempotent-replayed")), (200, None), "attempt {i}: {}", r.body);
        assert_eq!(g.upstream().calls(), calls + 2, "executed, not recorded");
    }
}

/// An idempotency outcome that reaches the sidecar while Redis cannot take it is kept and stored
/// once Redis answers again (decision 138): a retry is a replay, not 409 `idempotency_in_flight`
/// until the claim's marker expires (5 min). Redis is snapshotted with the claim in it and killed
/// while the request is upstream, then started again from the snapshot: the outcome came while
/// it was down.
#[test]
fn an_outcome_redis_could_not_take_is_stored_once_it_answers_again() {
    let (mut g, k) = start();
    let url = g.envoy().url("/orders");
    let h = [("x-api-key", k.acme.as_str()), ("content-type", "application/json"), ("idempotency-key", "\"blip-1\"")];
    let slow = [&h[..], &[("x-echo-delay-ms", "1500")]].concat();
    let body = r#"{"item":"cup"}"#;
    let calls = g.upstream().calls();
    let first = std::thread::scope(|s| {
        let request = s.spawn(|| post(&url, &slow, body));
        poll_until("the claim in Redis", Duration::from_secs(10), || !g.redis().keys("idem:*").is_empty());
        let saved: String = g.redis().cmd(&["SAVE"]);
        assert_eq!(saved, "OK");
        g.redis_mut().kill();
        request.join().unwrap()
    });
    assert_eq!((first.status, first.header("idempotent-replayed")), (200, None), "{}", first.body);
    g.redis_mut().restart();
    assert!(!g.redis().keys("idem:*").is_empty(), "the claim came back with the snapshot");
    let mut conflicts = 0;
    poll_until("a replay of the stored outcome", Duration::from_secs(20), || {
        let r = post(&url, &h, body);
        if r.status == 409 {
            conflicts += 1;
            return false;
        }
        assert_eq!((r.status, r.header("idempotent-replayed")), (200, Some("true")), "{}", r.body);
        assert_eq!(r.body, first.body, "the stored response, byte for byte");
        true
    });
    assert_eq!(g.upstream().calls(), calls + 1, "the request ran once ({conflicts} retries found it still in flight)");
    let stored = g.sidecar().metric("tollgate_sidecar_idempotency_outcome_retries_total{outcome=\"stored\"}");
    assert_eq!(stored, 1, "the sidecar stored it on a later try");
}

/// Request bodies over Envoy's buffer limit (1 MiB by default; decision 139). A body that only
/// waits for its decision is held with flow control, however large: before, one that arrived
/// while the decision call was out was buffered against the limit, and a 1.1 MB upload got
/// Envoy's plain-text 413 whenever its decision needed a call. A body the filter reads (cache
/// key, Idempotency-Key digest) is read up to 1 MiB: one announced larger is decided at once
/// (the cache bypassed, an Idempotency-Key refused by the filter's JSON 413), and one sent
/// without a length that outgrows Envoy's buffer before the filter sees it gets Envoy's 413 in
/// the gateway's JSON.
#[test]
fn uploads_over_envoys_buffer_limit_wait_for_their_decision_or_get_a_json_413() {
    let (g, k) = start();
    let big = format!("{{\"pad\":\"{}\"}}", "a".repeat(3_000_000));
    let length = big.len().to_string();
    let h = [("x-api-key", k.acme.as_str()), ("content-type", "application/json"), ("x-echo-read-body", "1")];
    // an exact limit: the decision is a call, and the body waits for it
    for _ in 0..3 {
        let r = post(&g.envoy().url("/orders"), &h, &big);
        assert_eq!((r.status, r.header("x-echo-body-bytes")), (200, Some(length.as_str())), "{}", &r.body[..r.body.len().min(300)]);
    }
    let r = post(&g.envoy().url("/cached/upload"), &h, &big);
    assert_eq!((r.status, r.header("x-echo-body-bytes")), (200, Some(length.as_str())), "{}", &r.body[..r.body.len().min(300)]);
    assert_eq!(r.header("x-tollgate-cache"), Some("bypass"), "not read past 1 MiB: no cache key");
    let calls = g.upstream().calls();
    // answered at the headers, before the body is read: a raw client reads the answer even when
    // its write of the rest fails
    let headers = [&h[..], &[("idempotency-key", "\"upload-1\"")]].concat();
    let r = tollgate_tests::raw::request(g.envoy().port, "POST", "/orders", &headers, big.as_bytes());
    assert_eq!((r.status, r.json()["error"].as_str()), (413, Some("idempotency_body_too_large")), "{:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(g.upstream().calls(), calls, "refused before the upstream");
    // chunked, no length: the filter reads it for the cache key until Envoy's buffer is full
    let chunked = format!(
        "POST /cached/upload HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-api-key: {}\r\ncontent-type: application/json\r\nx-echo-read-body: 1\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        k.acme,
        big.len(),
        big
    );
    // Which comes first depends on how the body arrives in chunks: the filter finding it over
    // 1 MiB (decided without it, the cache bypassed) or Envoy's buffer overflowing — never a
    // plain-text answer
    let r = tollgate_tests::raw::send(g.envoy().port, chunked.as_bytes());
    let text = String::from_utf8_lossy(&r.body).chars().take(300).collect::<String>();
    match r.status {
        200 => assert_eq!(r.header("x-tollgate-cache"), Some("bypass"), "{text}"),
        _ => {
            assert_eq!((r.status, r.header("content-type")), (413, Some("application/json")), "{text}");
            assert_eq!(r.json()["error"], "request_body_too_large");
        }
    }
}

/// Decision 185: one tenant's stored responses cannot fill the Redis every tenant's limits live
/// in. With `[responses] tenant_max_mb = 1`, a tenant filling the cache's three quarters of its
/// megabyte gets misses for what no longer fits (the upstream is called again), another tenant's
/// responses are still cached, an idempotent outcome past the bound is kept without its body
/// (the retry is replayed, marked, never run again), and at the bound a new Idempotency-Key is
/// refused (429, Retry-After) before it runs. Before, every fill and outcome was stored.
#[test]
fn a_tenant_past_its_stored_bytes_gets_misses_and_another_tenant_hits() {
    // a TTL no slow run outlives: an entry expiring mid-test would give its bytes back
    let toml = cache_sidecar_toml(1000).replace("cache_ttl = \"60s\"", "cache_ttl = \"600s\"") + "\n[responses]\ntenant_max_mb = 1\n";
    let mut plugin = cache_plugin();
    plugin["responseCache"]["maxBodyBytes"] = serde_json::json!(65536);
    let g = Gateway::builder().sidecar_toml(&toml).plugin(plugin).build();
    let k = Keys { acme: g.sidecar().create_key("acme", "p", &[]).raw, beta: g.sidecar().create_key("beta", "p", &[]).raw };
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&g.envoy().url("/warmup"), &[("x-api-key", &k.acme)]).status == 200);
    let sample = |outcome: &str| g.sidecar().metric(&format!("tollgate_sidecar_responses_stored_total{{kind=\"cache\",outcome=\"{outcome}\"}}"));

    // 40 distinct responses of ~20 KB (~40 KB as stored): about 19 fit in the cache's 768 KiB
    let fill = |n: usize| get(&g.envoy().url(&format!("/cached/fill/{n}")), &[("x-api-key", &k.acme), ("x-echo-pad", "10000")]);
    for n in 0..40 {
        let r = fill(n);
        assert_eq!((r.status, r.header("x-tollgate-cache")), (200, Some("miss")), "fill {n}");
    }
    poll_until("the 40 fills handled", Duration::from_secs(30), || sample("stored") + sample("over_bound") == 40);
    let (stored, over) = (sample("stored"), sample("over_bound"));
    assert!(over >= 10 && stored >= 15, "stored {stored}, over the bound {over}");
    let held: u64 = g.redis().cmd(&["GET", "responses:bytes:{acme}"]);
    assert!(held <= 1 << 20, "within the bound: {held}");
    assert_eq!(g.redis().keys("cache:exact:{acme}:*").len() as u64, stored);

    // what was refused is a miss again (the upstream answers it), what was stored a hit
    let hits = (0..40).filter(|&n| fill(n).header("x-tollgate-cache") == Some("hit")).count() as u64;
    assert_eq!(hits, stored, "every stored fill hits, no refused one does");

    // another tenant has its own bound: its response is stored and hit
    let beta = |n| get(&g.envoy().url("/cached/fill/0"), &[("x-api-key", &k.beta), ("x-echo-pad", n)]);
    assert_eq!(beta("10000").header("x-tollgate-cache"), Some("miss"));
    poll_until("beta's fill stored", Duration::from_secs(20), || g.redis().keys("cache:exact:{beta}:*").len() == 1);
    assert_eq!(beta("10000").header("x-tollgate-cache"), Some("hit"));

    // idempotent outcomes of ~60 KB as stored: whole while they fit in acme's megabyte, then kept
    // without their bodies (replayed, marked, never run again), then, at the bound, refused
    // (with a 20 KB response header: what a header-only outcome keeps is not small either)
    let (mut whole, mut truncated, mut refused) = (0, 0, None);
    let big_header = format!("max-age=0, ext={}", "a".repeat(20_000));
    for i in 0..40 {
        let key = format!("\"pay-{i}\"");
        let h = [("x-api-key", k.acme.as_str()), ("idempotency-key", key.as_str()), ("x-echo-pad", "15000"), ("x-echo-cache-control", big_header.as_str())];
        let calls = g.upstream().calls();
        let first = post(&g.envoy().url("/orders"), &h, "{}");
        if first.status == 429 {
            refused = Some(first);
            break;
        }
        assert!(first.status == 200 && first.body.len() > 30_000, "{} {}", first.status, first.body.len());
        let retry = post(&g.envoy().url("/orders"), &h, "{}");
        assert_eq!((retry.status, retry.header("idempotent-replayed")), (200, Some("true")), "{}", retry.body);
        assert_eq!(g.upstream().calls(), calls + 1, "pay-{i} not run again");
        if retry.header("x-tollgate-replay-truncated") == Some("true") {
            assert!(retry.body.is_empty(), "kept without its body: {} bytes replayed", retry.body.len());
            truncated += 1;
        } else {
            assert_eq!(retry.body, first.body);
            whole += 1;
        }
    }
    let refused = refused.expect("a new key refused at the bound");
    assert_eq!(refused.json()["error"], "idempotency_storage_full", "{}", refused.body);
    assert!(refused.header("retry-after").is_some(), "{:?}", refused.headers);
    assert!(whole >= 1 && truncated >= 1, "whole {whole}, truncated {truncated}");
    assert_eq!(g.sidecar().metric("tollgate_sidecar_responses_stored_total{kind=\"idempotency\",outcome=\"over_bound\"}"), truncated);
    // beta is not concerned
    let h = [("x-api-key", k.beta.as_str()), ("idempotency-key", "\"pay-0\"")];
    assert_eq!(post(&g.envoy().url("/orders"), &h, "{}").status, 200);
    g.redis().assert_ttl_invariant();
}

/// Decision 186: a request that runs longer than its claim's in-flight TTL keeps its claim — its
/// worker asks the sidecar to keep it while it runs — so a retry meanwhile gets 409, never a
/// second run beside the first, and the first's outcome is stored (its ticket sealed again) and
/// replayed. Before, the claim expired under the running request: the retry ran the operation
/// again, and the first's outcome was refused (its ticket had expired with the claim).
#[test]
fn a_claim_outlives_its_in_flight_ttl_while_its_request_runs() {
    let toml = cache_sidecar_toml(1000) + "\n[responses]\nidempotency_in_flight = \"3s\"\n";
    let g = Gateway::builder().sidecar_toml(&toml).plugin(cache_plugin()).build();
    let acme = g.sidecar().create_key("acme", "p", &[]).raw;
    poll_until("the routing table in the filter", Duration::from_secs(20), || get(&g.envoy().url("/warmup"), &[("x-api-key", &acme)]).status == 200);
    let url = g.envoy().url("/orders");
    let asked = |outcome: &str| g.sidecar().metric(&format!("tollgate_sidecar_idempotency_claims_kept_total{{outcome=\"{outcome}\"}}"));
    let calls = g.upstream().calls();
    let first = {
        let (url, acme) = (url.clone(), acme.clone());
        std::thread::spawn(move || {
            let h = [("x-api-key", acme.as_str()), ("idempotency-key", "\"long-1\""), ("x-echo-delay-ms", "12000")];
            post(&url, &h, r#"{"item":"desk"}"#)
        })
    };
    // each ask comes once a third of the claim's life is gone: three of them, and the claim's
    // first TTL (3 s) is over
    poll_until("the claim asked for three times", Duration::from_secs(20), || asked("kept") + asked("gone") >= 3);
    assert_eq!(asked("gone"), 0, "kept every time");
    assert!(!first.is_finished(), "the first request still runs");
    let h = [("x-api-key", acme.as_str()), ("idempotency-key", "\"long-1\"")];
    let retry = post(&url, &h, r#"{"item":"desk"}"#);
    assert_eq!((retry.status, retry.json()["error"].as_str()), (409, Some("idempotency_in_flight")), "{}", retry.body);
    let first = first.join().unwrap();
    assert_eq!(first.status, 200, "{}", first.body);
    let replay = post(&url, &h, r#"{"item":"desk"}"#);
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (200, Some("true")), "{}", replay.body);
    assert_eq!(g.upstream().calls(), calls + 1, "the operation ran once");
}
