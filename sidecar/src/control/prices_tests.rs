//! Prices as configuration objects: validated as the file's, one per model and moment
//! (crate::control::prices; decisions 337-340).

use super::model::{Change, Kind, Snapshot};
use serde_json::{json, Value};

fn base() -> Snapshot {
    Snapshot::default()
}

/// Issue 42 item 2: a price is checked as the file's are, its rates integers within 2^53
/// named by their field, its moment stored in one spelling, two of one model from one moment
/// refused.
#[test]
fn prices_are_checked_as_the_files_are() {
    let s = base();
    let put = |s: &Snapshot, v: Value| s.apply(&Change::Put(Kind::Prices, v));
    let p = json!({"id": "mini", "model": "gpt-4o-mini*", "input_per_mtok": 150000, "output_per_mtok": 600000, "effective_from": "2026-03-01"});
    let next = put(&s, p.clone()).unwrap();
    assert_eq!(next.get(Kind::Prices, "mini").unwrap()["effective_from"], "2026-03-01T00:00:00Z");
    assert_eq!(next.price_entries().len(), 1);
    let field = |v: Value| put(&s, v).unwrap_err().field;
    let with = |k: &str, x: Value| {
        let mut v = p.clone();
        v[k] = x;
        v
    };
    assert_eq!(field(with("input_per_mtok", json!(1.5))), "input_per_mtok");
    assert_eq!(field(with("output_per_mtok", json!(-1))), "output_per_mtok");
    assert_eq!(field(with("input_per_mtok", json!((1u64 << 53) + 1))), "input_per_mtok");
    assert_eq!(field(with("input_per_mtok", json!(1e3))), "input_per_mtok");
    assert_eq!(field(with("cached_input_per_mtok", json!("5"))), "cached_input_per_mtok");
    assert!(put(&s, with("input_per_mtok", json!(1u64 << 53))).is_ok(), "2^53 itself");
    assert_eq!(field(with("rate", json!(1))), "rate");
    assert_eq!(field(with("model", json!("gpt 4"))), "prices.mini.model");
    assert_eq!(field(with("effective_from", json!("soon"))), "prices.mini.effective_from");
    assert_eq!(field(with("id", json!("a/b"))), "id");
    assert_eq!(field(with("currency", json!("usd"))), "prices.mini.currency");
    // the same model from the same moment, however spelt: the second id is refused
    let again = json!({"id": "mini2", "model": "gpt-4o-mini*", "input_per_mtok": 1, "output_per_mtok": 1, "effective_from": "2026-03-01T00:00:00Z"});
    assert_eq!(put(&next, again).unwrap_err().field, "prices.mini2.effective_from");
    assert!(put(&next, json!({"id": "any", "model": "*", "input_per_mtok": 1, "output_per_mtok": 1})).is_ok(), "the default");
}
