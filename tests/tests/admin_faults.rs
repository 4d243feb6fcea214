//! Decision 179 with real processes: an admin write runs to its end whatever its client does. A
//! revocation whose client gave up while PostgreSQL was slow was cut off half-way: PostgreSQL
//! took it (its query was already sent) and Redis never did, so `keys list` said revoked and the
//! key kept working.

use serde_json::json;
use std::io::{Read, Write};
use std::time::Duration;
use tollgate_tests::{admin_call, get, poll_until, Gateway, Resp};

const TOKEN: &str = "test-admin-token-0123456789";

fn admin(method: &str, base: &str, path: &str, body: Option<serde_json::Value>) -> Resp {
    admin_call(method, base, TOKEN, path, body)
}

#[test]
fn a_revocation_whose_client_gave_up_still_completes() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).build();
    let base = g.replica(0).admin().to_string();
    assert_eq!(admin("POST", &base, "/v1/tenants", Some(json!({"id": "acme"}))).status, 201);
    assert_eq!(admin("POST", &base, "/v1/plans", Some(json!({"id": "p", "limits": []}))).status, 201);
    let r = admin("POST", &base, "/v1/keys", Some(json!({"tenant": "acme", "plan": "p"})));
    assert_eq!(r.status, 201, "{}", r.body);
    let (id, raw) = (r.json()["key_id"].as_str().unwrap().to_string(), r.json()["key"].as_str().unwrap().to_string());
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &raw)]).status, 200);
    // the reload the key's announcement started is done (it would hold the connection)
    poll_until("this replica's reload", Duration::from_secs(10), || {
        let v = admin("GET", &base, "/v1/version", None).json();
        v["version"] == v["loaded"]
    });

    // PostgreSQL slow (stopped for a moment); the client gives up after a second and leaves
    g.pg().pause();
    let addr = base.trim_start_matches("http://").trim_end_matches('/');
    let mut c = std::net::TcpStream::connect(addr).expect("connect to the admin API");
    let head = format!("POST /v1/keys/{id}/revoke HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {TOKEN}\r\ncontent-length: 0\r\n\r\n");
    c.write_all(head.as_bytes()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut buf = [0u8; 64];
    let read = c.read(&mut buf);
    assert!(read.is_err(), "no answer while PostgreSQL is stopped: {read:?}");
    drop(c);
    g.pg().resume();

    poll_until("the revocation in force", Duration::from_secs(30), || get(&url, &[("x-api-key", &raw)]).status == 401);
    let listed = admin("GET", &base, "/v1/keys?tenant=acme", None);
    assert_eq!(listed.json()[0]["status"].as_str(), Some("revoked"), "{}", listed.body);
}
