//! Decision 184 with real processes: `GET /v1/keys?limit=N` pages a key listing in key-id order,
//! each page linking the next (`Link: <…>; rel="next"`) while more follow, on both sources (the
//! file source's keys in Redis, PostgreSQL's `api_keys`), with and without a tenant; a query
//! out of its bounds is a 400 naming the field. Before, a listing was one array of every key (a
//! million keys: one answer of ~250 MB), and `limit`/`after` were refused.

use serde_json::{json, Value};
use tollgate_tests::{admin_call, Gateway};

const TOKEN: &str = "test-admin-token-0123456789";

/// Every page of `query` from its first, following the `Link` headers: the key ids of each.
fn pages(base: &str, query: &str) -> Vec<Vec<String>> {
    let mut out = vec![];
    let mut next = Some(format!("/v1/keys?{query}"));
    while let Some(path) = next.take() {
        let r = admin_call("GET", base, TOKEN, &path, None);
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let page: Vec<Value> = serde_json::from_str(&r.body).unwrap();
        out.push(page.iter().map(|k| k["key_id"].as_str().unwrap().to_string()).collect());
        next = r.header("link").map(|l| {
            assert!(l.ends_with(">; rel=\"next\""), "{l}");
            l.trim_start_matches('<').split('>').next().unwrap().to_string()
        });
        assert!(out.len() <= 10, "pages never end: {out:?}");
    }
    out
}

/// Pages of 3 over `ids` (acme's 5 and beta's 2): every key once, in id order, the last page
/// without a link; a tenant's pages hold its keys alone; bad queries are refused.
fn check(base: &str, acme: &[String], beta: &[String]) {
    let mut all: Vec<String> = acme.iter().chain(beta).cloned().collect();
    all.sort();
    let got = pages(base, "limit=3");
    assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 1], "{got:?}");
    assert_eq!(got.concat(), all);
    let mut acme = acme.to_vec();
    acme.sort();
    assert_eq!(pages(base, "tenant=acme&limit=2").concat(), acme);
    assert_eq!(pages(base, &format!("limit=100&after={}", all[4])).concat(), all[5..]);
    for (query, field) in [("limit=0", "limit"), ("limit=10001", "limit"), ("after=key_x", "after"), ("limit=2&after=..%2F", "after")] {
        let r = admin_call("GET", base, TOKEN, &format!("/v1/keys?{query}"), None);
        assert_eq!(r.status, 400, "{query}: {}", r.body);
        assert_eq!(serde_json::from_str::<Value>(&r.body).unwrap()["field"], field, "{query}");
    }
    // without a limit: every key in one answer, as before
    let one: Vec<Value> = serde_json::from_str(&admin_call("GET", base, TOKEN, "/v1/keys", None).body).unwrap();
    assert_eq!(one.len(), all.len());
}

#[test]
fn a_file_source_listing_pages_in_key_id_order() {
    let g = Gateway::builder().admin_api(TOKEN).build();
    let acme: Vec<String> = (0..5).map(|_| g.sidecar().create_key("acme", "free", &[]).id).collect();
    let beta: Vec<String> = (0..2).map(|_| g.sidecar().create_key("beta", "free", &[]).id).collect();
    let base = g.replica(0).admin();
    check(base, &acme, &beta);
    // a key whose record is gone (deleted by hand, lost in a failover) leaves its page short and
    // never ends the listing: the next page starts after the id, not after the last record
    let mut all: Vec<String> = acme.iter().chain(&beta).cloned().collect();
    all.sort();
    let gone = all.remove(2);
    let mut c = g.redis().connection().unwrap();
    let hash: String = redis::cmd("GET").arg(format!("apikey-id:{gone}")).query(&mut c).unwrap();
    let _: () = redis::cmd("DEL").arg(format!("apikey:{hash}")).query(&mut c).unwrap();
    let got = pages(base, "limit=1");
    assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 0, 1, 1, 1, 1], "{got:?}");
    assert_eq!(got.concat(), all);
}

#[test]
fn a_postgres_listing_pages_in_key_id_order() {
    let g = Gateway::builder().config_in_postgres().admin_api(TOKEN).build();
    let base = g.replica(0).admin();
    for t in ["acme", "beta"] {
        assert_eq!(admin_call("POST", base, TOKEN, "/v1/tenants", Some(json!({"id": t}))).status, 201);
    }
    assert_eq!(admin_call("POST", base, TOKEN, "/v1/plans", Some(json!({"id": "p", "limits": []}))).status, 201);
    let key = |t: &str| {
        let r = admin_call("POST", base, TOKEN, "/v1/keys", Some(json!({"tenant": t, "plan": "p"})));
        assert_eq!(r.status, 201, "{}", r.body);
        serde_json::from_str::<Value>(&r.body).unwrap()["key_id"].as_str().unwrap().to_string()
    };
    let acme: Vec<String> = (0..5).map(|_| key("acme")).collect();
    let beta: Vec<String> = (0..2).map(|_| key("beta")).collect();
    check(base, &acme, &beta);
    // pages in key-id byte order have an index under any collation (migration 3)
    let indexes = tollgate_tests::billing::psql(g.pg(), "SELECT indexname FROM pg_indexes WHERE tablename = 'api_keys' ORDER BY 1");
    let indexes = indexes.unwrap_or_default();
    assert!(["api_keys_id_c", "api_keys_tenant_id_c"].iter().all(|i| indexes.iter().any(|x| x == i)), "{indexes:?}");
}

/// The remote CLI reads a listing of any size: `tollgate keys list` follows the pages (10,000
/// keys an answer) and shows every key by creation time. Before, it read one answer, and one
/// past ureq's 10 MB limit (~85,000 keys) was shown as an empty listing with success.
#[test]
fn the_remote_cli_lists_a_hundred_thousand_keys_through_pages() {
    const KEYS: u64 = 100_000;
    let g = Gateway::builder().admin_api(TOKEN).build();
    let mut c = g.redis().connection().unwrap();
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(5_000) {
        let mut pipe = redis::pipe();
        for n in chunk {
            let (id, hash) = (format!("key_bulk{n:08}"), format!("{n:064x}"));
            let created = (KEYS - n).to_string(); // creation order is the reverse of id order
            let fields = [("key_id", id.as_str()), ("tenant", "bulk"), ("plan", "free"), ("status", "active"), ("created_at", created.as_str())];
            pipe.hset_multiple(format!("apikey:{hash}"), &fields).ignore();
            pipe.set(format!("apikey-id:{id}"), &hash).ignore();
            pipe.sadd("apikey-index:bulk", &id).ignore();
        }
        let _: () = pipe.query(&mut c).unwrap();
    }
    let bin = tollgate_tests::process::native_bin("TOLLGATE_CLI", "tollgate");
    let out = std::process::Command::new(bin)
        .env("TOLLGATE_ADMIN_URL", g.replica(0).admin())
        .env("TOLLGATE_ADMIN_TOKEN", TOKEN)
        .args(["--json", "keys", "list"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.len() as u64, KEYS);
    assert_eq!(listed[0]["key_id"], format!("key_bulk{:08}", KEYS - 1), "by creation time");
    assert_eq!(listed[KEYS as usize - 1]["key_id"], "key_bulk00000000");
}
