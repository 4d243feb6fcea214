//! Budget alerts (issue 42 item 5) through real Envoys: thresholds crossed by concurrent traffic
//! on two replicas make exactly one signed webhook each, and a receiver away for a while gets
//! them later, once; the delivery log says what happened.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::time::Duration;
use tollgate_tests::webhook::Receiver;
use tollgate_tests::{admin_call, keyed_burst, poll_until, Gateway};

const TOKEN: &str = "test-admin-token-0123456789";
const SECRET: &str = "acme-webhook-secret-0123456789";

/// HMAC-SHA256 written out here from RFC 2104, apart from the sidecar's, to check its signature.
fn hmac_hex(key: &[u8], msg: &[u8]) -> String {
    let block: Vec<u8> = (0..64).map(|i| key.get(i).copied().unwrap_or(0)).collect();
    let pad = |x: u8| block.iter().map(|b| b ^ x).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    let outer = Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize();
    outer.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn thresholds_crossed_on_two_replicas_make_one_signed_webhook_each_delivered_once_after_an_outage() {
    let receiver = Receiver::start();
    receiver.set_down(true);
    let toml = format!(
        "[[plans.llm.limits]]\nname = \"monthly\"\nalgorithm = \"token_budget\"\nlimit = 1000\nestimate = 100\n\
         [alerts]\nretry_base = \"100ms\"\nretry_max = \"500ms\"\n\
         [[alerts.webhooks]]\ntenant = \"acme\"\nurl = \"{}\"\nsecret = \"{SECRET}\"\n",
        receiver.url("/hooks/tollgate")
    );
    let g = Gateway::builder().sidecar_toml(&toml).replicas(2).concurrency(2).admin_api(TOKEN).build();
    let key = g.sidecar().create_key("acme", "llm", &[]);
    // 40 requests at once over both replicas: each reserves 100 of 1000 (no usage in the echo's
    // answers: the reservation is the charge), so 10 are admitted and the budget passes 50, 80
    // and 100 % on whichever replicas decided them
    let urls = [g.replica(0).envoy().url("/"), g.replica(1).envoy().url("/")];
    let statuses = keyed_burst(&urls, &key.raw, 8, 5);
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 10, "{statuses:?}");
    // the receiver is away: the alerts are tried, refused, and kept
    poll_until("deliveries refused by the receiver", Duration::from_secs(30), || receiver.refused() >= 3);
    receiver.set_down(false);
    let log = || admin_call("GET", g.replica(1).admin(), TOKEN, "/v1/alerts?tenant=acme", None).json();
    poll_until("three alerts delivered", Duration::from_secs(60), || {
        log()["entries"].as_array().is_some_and(|e| e.iter().filter(|x| x["event"] == "delivered").count() == 3)
    });
    // delivered alerts are no longer due: what the receiver has now is final
    let got = receiver.received();
    let mut by_threshold: BTreeMap<u64, usize> = BTreeMap::new();
    for r in &got {
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        *by_threshold.entry(body["threshold"].as_u64().unwrap()).or_default() += 1;
        assert_eq!((body["type"].as_str(), body["tenant"].as_str(), body["limit"].as_str()), (Some("budget.threshold"), Some("acme"), Some("monthly")));
        assert_eq!(body["budget"], 1000);
        assert!(body["used"].as_u64().unwrap() * 100 >= body["threshold"].as_u64().unwrap() * 1000, "{body}");
        assert_eq!(r.headers.get("x-tollgate-alert-id").map(String::as_str), body["id"].as_str());
        let ts = r.headers.get("x-tollgate-timestamp").expect("a timestamp");
        let mut signed = format!("{ts}.").into_bytes();
        signed.extend_from_slice(&r.body);
        assert_eq!(r.headers.get("x-tollgate-signature"), Some(&format!("v1={}", hmac_hex(SECRET.as_bytes(), &signed))), "signed with the tenant's secret");
    }
    assert_eq!(by_threshold, BTreeMap::from([(50, 1), (80, 1), (100, 1)]), "one webhook per threshold, across both replicas");
    let entries = log()["entries"].as_array().cloned().unwrap_or_default();
    assert_eq!(entries.iter().filter(|e| e["event"] == "fired").count(), 3, "each alert created once: {entries:?}");
    assert!(entries.iter().any(|e| e["event"] == "retry"), "the outage's retries are in the log");
    // another tenant's log is its own; a bad query is a 400 naming the parameter
    let other = admin_call("GET", g.replica(0).admin(), TOKEN, "/v1/alerts?tenant=beta", None).json();
    assert_eq!(other["entries"].as_array().map(Vec::len), Some(0));
    let bad = admin_call("GET", g.replica(0).admin(), TOKEN, "/v1/alerts?tenant=a%20b", None);
    assert_eq!((bad.status, bad.json()["field"].as_str()), (400, Some("tenant")));
    assert_eq!(admin_call("GET", g.replica(0).admin(), "wrong-token-0123456789", "/v1/alerts?tenant=acme", None).status, 401);
    g.redis().assert_ttl_invariant();
}
