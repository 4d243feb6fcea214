//! Decision 174 with real processes: a plan or tenant that active keys name cannot be deleted
//! (an unknown plan has no limits, decision 12: its keys would go unlimited), and a key is made
//! only for a plan and tenant that exist — checked against what PostgreSQL holds under the admin
//! writes' lock, so a replica whose copy still has a deleted plan cannot issue a key on it; the
//! offline CLI checks the file's plans the same way.

use serde_json::json;
use tollgate_tests::{admin_call, get, Gateway, GatewayBuilder, Resp};

const TOKEN: &str = "test-admin-token-0123456789";

fn pg_gateway() -> GatewayBuilder {
    Gateway::builder().config_in_postgres().admin_api(TOKEN)
}

fn admin(method: &str, base: &str, path: &str, body: Option<serde_json::Value>) -> Resp {
    admin_call(method, base, TOKEN, path, body)
}

/// Tenant `acme` and plan `p` (a token bucket of 2 an hour: no window boundary to cross
/// mid-test), stored through `base`.
fn seed(base: &str) {
    assert_eq!(admin("POST", base, "/v1/tenants", Some(json!({"id": "acme"}))).status, 201);
    let plan = json!({"id": "p", "limits": [{"name": "ph", "algorithm": "token_bucket", "limit": 2, "window": "1h"}]});
    assert_eq!(admin("POST", base, "/v1/plans", Some(plan)).status, 201);
}

fn new_key(base: &str, tenant: &str, plan: &str) -> Resp {
    admin("POST", base, "/v1/keys", Some(json!({"tenant": tenant, "plan": plan})))
}

/// Deleting the plan (or tenant) of an active key: 409 `in_use`, and the key keeps its limit.
/// Before, the delete went through and the key's requests were never limited again.
#[test]
fn a_plan_or_tenant_an_active_key_names_cannot_be_deleted() {
    let g = pg_gateway().build();
    let base = g.replica(0).admin().to_string();
    seed(&base);
    let r = new_key(&base, "acme", "p");
    assert_eq!(r.status, 201, "{}", r.body);
    let (id, raw) = (r.json()["key_id"].as_str().unwrap().to_string(), r.json()["key"].as_str().unwrap().to_string());

    for path in ["/v1/plans/p", "/v1/tenants/acme"] {
        let r = admin("DELETE", &base, path, None);
        assert_eq!((r.status, r.json()["error"].as_str()), (409, Some("in_use")), "{path}: {}", r.body);
        assert!(r.body.contains("1 active key"), "{path}: {}", r.body);
        assert_eq!(admin("GET", &base, path, None).status, 200, "{path} is still stored");
    }
    let statuses: Vec<u16> = (0..3).map(|_| get(&g.envoy().url("/"), &[("x-api-key", &raw)]).status).collect();
    assert_eq!(statuses, [200, 200, 429], "the key still has its plan's limit");

    // a key for what does not exist is refused, naming the field
    for (tenant, plan, field) in [("acme", "nope", "plan"), ("nobody", "p", "tenant")] {
        let r = new_key(&base, tenant, plan);
        assert_eq!((r.status, r.json()["field"].as_str()), (400, Some(field)), "{}", r.body);
    }
    // revoked, the key holds nothing: both deletes go through
    assert_eq!(admin("POST", &base, &format!("/v1/keys/{id}/revoke"), None).status, 200);
    assert_eq!(admin("DELETE", &base, "/v1/plans/p", None).status, 200);
    assert_eq!(admin("DELETE", &base, "/v1/tenants/acme", None).status, 200);
}

/// A replica whose copy still has a plan another replica deleted (its change feed cut, its resync
/// an hour away) refuses a key on it: the check reads what PostgreSQL holds, under the lock the
/// delete took. Before, it issued a key on the deleted plan: a key with no limits.
#[test]
fn a_replica_with_a_stale_copy_cannot_issue_a_key_on_a_deleted_plan() {
    let mut g = pg_gateway().sidecar_env("TOLLGATE_SIDECAR_ADMIN__RESYNC_INTERVAL", "1h").build();
    let base_a = g.replica(0).admin().to_string();
    seed(&base_a);
    let gone = json!({"id": "gone", "limits": [{"name": "pm", "algorithm": "fixed_window", "limit": 5, "window": "60s"}]});
    assert_eq!(admin("POST", &base_a, "/v1/plans", Some(gone)).status, 201);
    g.add_replica().expect("a second replica");
    let base_b = g.replica(1).admin().to_string();
    let mut c = g.redis().connection().unwrap();
    let _: () = redis::cmd("ACL").arg("SETUSER").arg("default").arg("-psubscribe").query(&mut c).unwrap();
    let killed: i64 = redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub").query(&mut c).unwrap();
    assert!(killed >= 2, "both sidecars held a pub/sub connection ({killed})");

    assert_eq!(admin("DELETE", &base_a, "/v1/plans/gone", None).status, 200);
    assert_eq!(admin("GET", &base_b, "/v1/plans/gone", None).status, 200, "B's copy still has it");
    let r = new_key(&base_b, "acme", "gone");
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("plan")), "{}", r.body);
    assert!(r.body.contains("no plan 'gone'"), "{}", r.body);
    let listed = admin("GET", &base_b, "/v1/keys?tenant=acme", None);
    assert_eq!((listed.status, listed.json()), (200, json!([])), "no key record left: {}", listed.body);
    assert_eq!(new_key(&base_b, "acme", "p").status, 201, "a key on a stored plan is made on B");
    let _: () = redis::cmd("ACL").arg("SETUSER").arg("default").arg("+psubscribe").query(&mut c).unwrap();
}

/// `tollgate-sidecar keys create` on the file source refuses a plan the file does not define.
#[test]
fn the_offline_cli_refuses_a_plan_the_file_does_not_define() {
    let g = Gateway::builder().without_envoy().build();
    let out = g.sidecar().cli(&["keys", "create", "--tenant", "acme", "--plan", "no-such-plan"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains("--plan 'no-such-plan': no such plan"), "{stderr}");
    let listed = g.sidecar().cli(&["keys", "list", "--tenant", "acme"]);
    assert_eq!(String::from_utf8_lossy(&listed.stdout).lines().count(), 1, "only the header: nothing was written");
}
