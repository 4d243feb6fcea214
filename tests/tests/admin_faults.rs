//! Decision 179 with real processes: an admin write runs to its end whatever its client does. A
//! revocation whose client gave up while PostgreSQL was slow was cut off half-way: PostgreSQL
//! took it (its query was already sent) and Redis never did, so `keys list` said revoked and the
//! key kept working. Decisions 197 and 198: a revocation or a change Redis took and lost, or
//! would not announce, still reaches every replica.

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

/// A tenant `acme`, a plan `p` without limits and a key on them, through the admin API at `base`:
/// (key id, raw key).
fn a_key(base: &str) -> (String, String) {
    assert_eq!(admin("POST", base, "/v1/tenants", Some(json!({"id": "acme"}))).status, 201);
    assert_eq!(admin("POST", base, "/v1/plans", Some(json!({"id": "p", "limits": []}))).status, 201);
    let r = admin("POST", base, "/v1/keys", Some(json!({"tenant": "acme", "plan": "p"})));
    assert_eq!(r.status, 201, "{}", r.body);
    (r.json()["key_id"].as_str().unwrap().to_string(), r.json()["key"].as_str().unwrap().to_string())
}

/// Decision 197: a revocation Redis acknowledged and then lost (a failover to a replica it had
/// not reached; here its record is set back to active by hand and every replica told to drop
/// its cached answers) is put back from PostgreSQL at the next resync and announced: the key
/// stops working again. Before, it worked until some sidecar restarted, while `keys list`
/// (PostgreSQL) said revoked.
#[test]
fn a_revocation_redis_lost_is_put_back_from_postgresql() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).sidecar_env("TOLLGATE_SIDECAR_ADMIN__RESYNC_INTERVAL", "1s").build();
    let base = g.replica(0).admin().to_string();
    let (id, raw) = a_key(&base);
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &raw)]).status, 200);
    assert_eq!(admin("POST", &base, &format!("/v1/keys/{id}/revoke"), None).status, 200);
    poll_until("the revocation", Duration::from_secs(10), || get(&url, &[("x-api-key", &raw)]).status == 401);
    let hash: String = g.redis().cmd(&["GET", &format!("apikey-id:{id}")]);
    let record = format!("apikey:{hash}");
    let _: () = g.redis().cmd(&["HSET", &record, "status", "active"]);
    let _: () = g.redis().cmd(&["HDEL", &record, "revoked_at"]);
    let _: () = g.redis().cmd(&["PUBLISH", "config_changed:_all", "0"]);
    poll_until("the lost revocation restored in Redis", Duration::from_secs(30), || {
        g.redis().cmd::<Option<String>>(&["HGET", &record, "status"]).as_deref() == Some("revoked")
    });
    // said in the log: written just after the copy, so on a loaded machine a moment after the
    // record is seen restored
    poll_until("the restoration said in the log", Duration::from_secs(10), || g.sidecar().log_text().contains("restored"));
    poll_until("the key refused again", Duration::from_secs(10), || get(&url, &[("x-api-key", &raw)]).status == 401);
}

/// Decision 198: a change PostgreSQL committed and Redis would not announce (out of memory) is
/// announced again until Redis takes it, and the other replica loads it. Before, the version
/// never moved, so the other replica's resync saw nothing to do: it kept the old configuration
/// until another change or a restart.
#[test]
fn a_change_redis_could_not_announce_still_reaches_the_other_replica() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).replicas(2).build();
    let (a, b) = (g.replica(0).admin().to_string(), g.replica(1).admin().to_string());
    assert_eq!(admin("POST", &a, "/v1/tenants", Some(json!({"id": "acme"}))).status, 201);
    poll_until("the tenant on the other replica", Duration::from_secs(20), || admin("GET", &b, "/v1/tenants/acme", None).status == 200);
    let _: () = g.redis().cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    let _: () = g.redis().cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    let r = admin("POST", &a, "/v1/products", Some(json!({"id": "x"})));
    assert_eq!((r.status, r.json()["propagated"].as_bool()), (201, Some(false)), "{}", r.body);
    let _: () = g.redis().cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    poll_until("the change on the other replica", Duration::from_secs(30), || admin("GET", &b, "/v1/products/x", None).status == 200);
}

/// Decision 199: a revocation the admin API could not finish (PostgreSQL hung) of a key
/// PostgreSQL lacks (made in Redis alone by an older `keys create`; here its row is deleted) is
/// completed in Redis once PostgreSQL answers. Before, the background completion found no row,
/// logged a warning and stopped: the key kept working.
#[test]
fn a_revocation_of_a_key_postgresql_lacks_completes_after_an_outage() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).build();
    let base = g.replica(0).admin().to_string();
    let (id, raw) = a_key(&base);
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &raw)]).status, 200);
    tollgate_tests::billing::psql(g.pg(), &format!("DELETE FROM api_keys WHERE key_id = '{id}'")).expect("psql");
    g.pg().pause();
    let r = admin("POST", &base, &format!("/v1/keys/{id}/revoke"), None);
    g.pg().resume();
    assert_eq!(r.status, 503, "{}", r.body);
    poll_until("the revocation in force", Duration::from_secs(30), || get(&url, &[("x-api-key", &raw)]).status == 401);
}


/// Decision 209: a key Redis acknowledged and then lost (a failover to a replica it had not
/// reached; here its records are deleted by hand) is copied back from PostgreSQL at the next
/// resync, as a lost revocation is (decision 197), and works again. Before, it stayed unknown
/// (401) until some sidecar restarted, while `keys list` (PostgreSQL) said active.
#[test]
fn a_key_redis_lost_is_put_back_from_postgresql() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).sidecar_env("TOLLGATE_SIDECAR_ADMIN__RESYNC_INTERVAL", "1s").build();
    let base = g.replica(0).admin().to_string();
    let (id, raw) = a_key(&base);
    let url = g.envoy().url("/");
    assert_eq!(get(&url, &[("x-api-key", &raw)]).status, 200);
    let hash: String = g.redis().cmd(&["GET", &format!("apikey-id:{id}")]);
    let record = format!("apikey:{hash}");
    let _: () = g.redis().cmd(&["DEL", &record, &format!("apikey-id:{id}")]);
    poll_until("the lost key restored in Redis", Duration::from_secs(30), || {
        g.redis().cmd::<Option<String>>(&["HGET", &record, "status"]).as_deref() == Some("active")
    });
    poll_until("the restoration said in the log", Duration::from_secs(10), || g.sidecar().log_text().contains("restored"));
    poll_until("the key working", Duration::from_secs(10), || get(&url, &[("x-api-key", &raw)]).status == 200);
}
