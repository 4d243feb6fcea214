#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Property tests (proptest) of the filter's parsers, where an invariant is easier to state than
//! an example (docs/fuzzing.md): percent-decoding round trips, query parameters are found and
//! removed exactly, the bearer scheme in any whitespace form, canonical JSON is idempotent and
//! independent of key order, query normalization is idempotent, route matching equals a plain
//! reference implementation, `usage.total_tokens` is read from JSON and SSE. Natively only.
#![cfg(not(target_arch = "wasm32"))]

use proptest::prelude::*;
use serde_json::Value;
use tollgate_filter_core::hostmap;
use tollgate_filter_core::key::{self, KeySource};
use tollgate_filter_core::responses::{cache_key, canonical_body, normalize_query};
use tollgate_filter_core::usage::usage_tokens;
use tollgate_wire::routes::{HeaderRule, RequestView, RouteSpec, RouteTable};

/// Every byte as `%XX`, hex digits in the case `upper` says.
fn encode_all(s: &str, upper: bool) -> String {
    s.bytes().map(|b| if upper { format!("%{b:02X}") } else { format!("%{b:02x}") }).collect()
}

/// Unreserved characters as they are, every other byte escaped (what a client library sends).
fn encode_component(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e15f64..1e15).prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        "\\PC{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("\\PC{0,6}", inner, 0..6).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// `v` as JSON text with every object's members in the order `rotate` picks (a rotation per
/// object), and the given whitespace between tokens.
fn write_shuffled(v: &Value, rotate: usize, ws: &str, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut members: Vec<(&String, &Value)> = m.iter().collect();
            if !members.is_empty() {
                let n = rotate % members.len();
                members.rotate_left(n);
                members.reverse();
            }
            out.push('{');
            for (i, (k, x)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    out.push_str(ws);
                }
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push_str(ws);
                out.push(':');
                write_shuffled(x, rotate + 1, ws, out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(ws);
                write_shuffled(x, rotate + 1, ws, out);
            }
            out.push(']');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap()),
    }
}

/// The routing rule as documented on `RouteSpec`, written plainly.
fn reference_find<'t>(table: &'t RouteTable, authority: &str, method: &str, path: &str, headers: &[(String, String)]) -> Option<&'t str> {
    let path = path.split(['?', '#']).next().unwrap();
    let host = match authority.rsplit_once(':') {
        Some((h, port)) if !port.is_empty() && port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    let header = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
    for r in &table.routes {
        let ok = r.host.as_ref().is_none_or(|h| h.to_lowercase() == host.to_lowercase())
            && r.path.as_ref().is_none_or(|p| p == path)
            && r.path_prefix.as_ref().is_none_or(|p| path.get(..p.len()) == Some(p.as_str()))
            && r.method.as_ref().is_none_or(|m| m == method)
            && r.headers.iter().all(|h| header(&h.name).is_some_and(|v| h.value.as_ref().is_none_or(|want| want == v)));
        if ok {
            return Some(&r.id);
        }
    }
    None
}

fn route() -> impl Strategy<Value = RouteSpec> {
    let opt = |s: &'static str| proptest::option::of(s);
    (
        opt("(api|API|x)\\.test"),
        opt("/(v1|v2)(/chat)?"),
        opt("/(v1|v)?"),
        opt("(GET|POST)"),
        prop::collection::vec(("x-(a|b)", proptest::option::of("(1|2)")), 0..2),
    )
        .prop_map(|(host, path, path_prefix, method, headers)| RouteSpec {
            id: format!("{host:?}{path:?}{path_prefix:?}{method:?}{headers:?}"),
            host,
            path,
            path_prefix,
            method,
            headers: headers.into_iter().map(|(name, value)| HeaderRule { name, value }).collect(),
            cluster: "c".into(),
            product: None,
            failure_mode: None,
            cache_ttl_ms: None,
            cache_key_headers: Vec::new(),
            breaker: None,
            llm: false,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn percent_decoding_round_trips(s in "\\PC*", upper in any::<bool>()) {
        prop_assert_eq!(key::percent_decode(&encode_all(&s, upper)), s.clone());
        prop_assert_eq!(key::percent_decode(&encode_component(&s)), s.clone());
        // text without `%` and `+` decodes to itself
        let plain: String = s.chars().filter(|c| *c != '%' && *c != '+').collect();
        prop_assert_eq!(key::percent_decode(&plain), plain);
    }

    #[test]
    fn query_keys_are_found_in_order_and_removed_exactly(
        others in prop::collection::vec(("[a-z]{1,4}", "\\PC{0,6}"), 0..4),
        keys in prop::collection::vec("\\PC{1,8}", 1..3),
        at in any::<prop::sample::Index>(),
    ) {
        let mut params: Vec<(String, String)> = others.iter().filter(|(n, _)| n != "api_key").cloned().collect();
        let kept = params.clone();
        for (i, k) in keys.iter().enumerate() {
            let pos = (at.index(params.len() + 1) + i).min(params.len());
            params.insert(pos, ("api_key".into(), k.clone()));
        }
        let query: Vec<String> = params.iter().map(|(n, v)| format!("{}={}", encode_component(n), encode_component(v))).collect();
        let path = format!("/v1/x?{}#frag", query.join("&"));
        prop_assert_eq!(key::query_params(&path, "api_key"), keys.clone());
        let new_path = key::remove_query_params(&path, &["api_key"]).unwrap();
        prop_assert!(key::query_params(&new_path, "api_key").is_empty());
        let rest: Vec<String> = kept.iter().map(|(n, v)| format!("{}={}", encode_component(n), encode_component(v))).collect();
        let expected = if rest.is_empty() { "/v1/x#frag".to_string() } else { format!("/v1/x?{}#frag", rest.join("&")) };
        prop_assert_eq!(new_path, expected);
        // one key sent once is used; different keys are refused
        let plan = key::plan(&[KeySource::Query { name: "api_key".into() }], |_| Vec::new(), &path);
        let distinct = keys.iter().collect::<std::collections::BTreeSet<_>>().len();
        prop_assert_eq!(plan.key.is_some(), keys.windows(2).all(|w| w[0] == w[1]) && distinct == 1);
    }

    #[test]
    fn bearer_is_found_in_any_whitespace_form(
        token in "[!-~]{1,40}",
        upper in prop::collection::vec(any::<bool>(), 6),
        before in "[ \t]{0,3}", between in "[ \t]{1,3}", after in "[ \t]{0,3}",
    ) {
        let scheme: String = "bearer".chars().zip(&upper).map(|(c, u)| if *u { c.to_ascii_uppercase() } else { c }).collect();
        let value = format!("{before}{scheme}{between}{token}{after}");
        prop_assert_eq!(key::bearer_token(&value), Some(token.as_str()));
        let plan = key::plan(&[KeySource::Bearer], |n| if n == "authorization" { vec![value.as_bytes()] } else { vec![] }, "/");
        prop_assert_eq!(plan.remove_headers, vec!["authorization".to_string()]);
        prop_assert_eq!(plan.key.map(|k| k.hash()), Some(key::hash_key(&token)));
    }

    #[test]
    fn canonical_json_is_idempotent_and_independent_of_key_order(v in json_value(), rotate in 0usize..8) {
        let compact = serde_json::to_vec(&v).unwrap();
        let canon = canonical_body(Some("application/json"), &compact);
        prop_assert_eq!(canonical_body(Some("application/json"), &canon), canon.clone(), "not idempotent");
        let mut shuffled = String::new();
        write_shuffled(&v, rotate, " \n", &mut shuffled);
        prop_assert_eq!(canonical_body(Some("application/json"), shuffled.as_bytes()), canon.clone(), "depends on order: {}", shuffled);
        // it is still the same document
        let back: Value = serde_json::from_slice(&canon).unwrap();
        prop_assert_eq!(back.is_object(), v.is_object());
    }

    #[test]
    fn query_normalization_is_idempotent_and_sorts_by_name(
        params in prop::collection::btree_map("[a-z]{1,5}", "[^&#]{0,8}", 0..6),
        raw in "[^#]{0,24}",
    ) {
        let once = normalize_query(&raw);
        prop_assert_eq!(normalize_query(&once), once.clone());
        let forward: Vec<String> = params.iter().map(|(n, v)| format!("{n}={}", encode_component(v))).collect();
        let backward: Vec<String> = forward.iter().rev().cloned().collect();
        prop_assert_eq!(normalize_query(&forward.join("&")), normalize_query(&backward.join("&")));
        let path = |q: &[String]| format!("/p?{}", q.join("&"));
        prop_assert_eq!(cache_key("GET", &path(&forward), &[], b""), cache_key("GET", &path(&backward), &[], b""));
    }

    #[test]
    fn route_matching_equals_the_reference(
        routes in prop::collection::vec(route(), 0..6),
        authority in "(api|API|x)\\.test(:[0-9]{0,4})?",
        method in "(GET|POST|get)",
        path in "/(v1|v2|v)?(/chat)?[?#]?[a-z/]{0,4}",
        headers in prop::collection::vec(("x-(a|b)", "(1|2)"), 0..3),
    ) {
        let table = RouteTable { version: 1, etag: String::new(), routes };
        let header = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        let view = RequestView { authority: &authority, method: &method, path: &path, header };
        prop_assert_eq!(table.find(&view).map(|r| r.id.as_str()), reference_find(&table, &authority, &method, &path, &headers));
    }

    #[test]
    fn total_tokens_are_read_from_json_and_sse(n in 0u64..(1 << 53), other in any::<u64>(), noise in "[a-z ]{0,12}") {
        let json = format!(r#"{{"id":"{noise}","choices":[],"usage":{{"prompt_tokens":{other},"total_tokens":{n}}}}}"#);
        prop_assert_eq!(usage_tokens(json.as_bytes()), Some(n));
        let sse = format!("data: {{\"choices\":[{{\"text\":\"{noise}\"}}]}}\n\ndata: {{\"usage\":{{\"total_tokens\":{n}}}}}\n\ndata: [DONE]\n\n");
        prop_assert_eq!(usage_tokens(sse.as_bytes()), Some(n));
        prop_assert_eq!(usage_tokens(noise.as_bytes()), None);
    }

    #[test]
    fn header_maps_round_trip(pairs in prop::collection::vec((prop::collection::vec(any::<u8>(), 0..8), prop::collection::vec(any::<u8>(), 0..8)), 0..6)) {
        let refs: Vec<(&[u8], &[u8])> = pairs.iter().map(|(n, v)| (n.as_slice(), v.as_slice())).collect();
        let bytes = hostmap::serialize_pairs(&refs);
        prop_assert_eq!(hostmap::parse_pairs(&bytes), Some(pairs.clone()));
        for cut in 1..bytes.len() {
            // a truncated map is malformed or shorter, never a panic
            let _ = hostmap::parse_pairs(&bytes[..cut]);
        }
    }
}
