//! What a sidecar puts in force when the store of record holds objects it cannot use (decision
//! 206): a row that does not parse (a field a newer sidecar wrote, a hand edit), whose document's
//! id differs from its key column (decision 208), or an object that breaks a rule of the
//! configuration (a route naming a plan deleted by hand). One such row used to fail every reload
//! and every admin write, the DELETE that would remove it included.
//!
//! Now each is set aside on its own: the version this sidecar last had of it stays in force
//! (`kept`), or, when it had none (a start) or that version no longer holds, the object is left
//! out — and what leaving it out breaks (a tenant subscribed to a product left out) is set aside
//! in turn, never the whole configuration. Each is reported: `GET /v1/version`'s `unusable`,
//! `tollgate version`, the gauge `tollgate_sidecar_config_unusable_objects`, a log line when the
//! set changes. Pure: the caller passes what it had in force.

use super::model::{Kind, Snapshot};
use serde_json::{json, Value};

/// A stored object this sidecar does not use as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Unusable {
    pub kind: Kind,
    pub id: String,
    /// Why, as the operator needs it to mend the row.
    pub reason: String,
    /// Whether the version this sidecar last had of it stays in force (else none does).
    pub kept: bool,
}

impl Unusable {
    pub fn new(kind: Kind, id: impl Into<String>, reason: impl Into<String>) -> Unusable {
        Unusable { kind, id: id.into(), reason: reason.into(), kept: false }
    }

    /// As the admin API shows it.
    pub fn to_json(&self) -> Value {
        json!({
            "kind": self.kind.name(),
            "id": self.id,
            "reason": self.reason,
            "in_force": if self.kept { "last_good" } else { "none" },
        })
    }
}

/// The configuration to put in force: `read` (the rows that could be read) with `unread` (those
/// that could not) set aside as the module says, against `last_good` (what is in force now).
/// The answer passes [`Snapshot::validate`]; the list says every object not in force as stored,
/// by kind and id.
pub fn salvage(mut s: Snapshot, mut unusable: Vec<Unusable>, last_good: &Snapshot) -> (Snapshot, Vec<Unusable>) {
    for u in &mut unusable {
        s.remove(u.kind, &u.id);
        if let Some(v) = last_good.get(u.kind, &u.id) {
            u.kept = s.insert_value(u.kind, &u.id, v).is_ok();
        }
    }
    // each round removes an object, or replaces one by its last good version (once): bounded
    let rounds = Kind::ALL.iter().map(|k| s.count(*k)).sum::<usize>() * 2 + 2;
    for _ in 0..rounds {
        let Some((kind, id, e)) = s.first_invalid() else { break };
        match unusable.iter_mut().find(|u| u.kind == kind && u.id == id) {
            // the last good version put back breaks a rule now (what it names is gone)
            Some(u) => {
                s.remove(kind, &id);
                if u.kept {
                    u.reason = format!("{}; its last good version no longer holds: {e}", u.reason);
                    u.kept = false;
                }
            }
            None => {
                let mut u = Unusable::new(kind, id.clone(), e.to_string());
                let stored = s.get(kind, &id);
                s.remove(kind, &id);
                if let Some(v) = last_good.get(kind, &id).filter(|v| Some(v) != stored.as_ref()) {
                    u.kept = s.insert_value(kind, &id, v).is_ok();
                }
                unusable.push(u);
            }
        }
    }
    unusable.sort_by(|a, b| (a.kind as usize, &a.id).cmp(&(b.kind as usize, &b.id)));
    (s, unusable)
}

#[cfg(test)]
mod tests {
    use super::super::model::Change;
    use super::*;

    fn put(s: &Snapshot, kind: Kind, v: Value) -> Snapshot {
        s.apply(&Change::Put(kind, v)).unwrap()
    }

    /// products chat and embed, tenant acme on both, plan p, route r on chat with plan p.
    fn good() -> Snapshot {
        let s = put(&Snapshot::default(), Kind::Products, json!({"id": "chat"}));
        let s = put(&s, Kind::Products, json!({"id": "embed"}));
        let s = put(&s, Kind::Tenants, json!({"id": "acme", "products": ["chat", "embed"]}));
        let s = put(&s, Kind::Plans, json!({"id": "p", "limits": [{"name": "pm", "algorithm": "fixed_window", "limit": 5}]}));
        put(&s, Kind::Routes, json!({"id": "r", "cluster": "c", "product": "chat", "plan": "p"}))
    }

    #[test]
    fn an_unreadable_row_keeps_its_last_good_version_and_the_rest_is_read() {
        let last = good();
        let mut read = good();
        read.remove(Kind::Routes, "r");
        // another change beside it is taken
        let read = put(&read, Kind::Products, json!({"id": "new"}));
        let (s, bad) = salvage(read, vec![Unusable::new(Kind::Routes, "r", "unknown field `timeout`")], &last);
        assert!(s.validate().is_ok());
        assert_eq!(s.routes["r"], last.routes["r"]);
        assert!(s.products.contains_key("new"));
        assert_eq!(bad.len(), 1);
        assert!(bad[0].kept);
        assert_eq!(bad[0].to_json()["in_force"], "last_good");
    }

    #[test]
    fn without_a_last_good_version_it_is_left_out_and_so_is_what_needs_it() {
        let mut read = good();
        read.remove(Kind::Products, "embed");
        let (s, bad) = salvage(read, vec![Unusable::new(Kind::Products, "embed", "unknown field `tier`")], &Snapshot::default());
        assert!(s.validate().is_ok());
        // acme subscribes to embed: set aside too (reported), the route and plan stay
        assert!(!s.tenants.contains_key("acme"));
        assert!(s.routes.contains_key("r") && s.plans.contains_key("p"));
        let named: Vec<(&str, &str, bool)> = bad.iter().map(|u| (u.kind.name(), u.id.as_str(), u.kept)).collect();
        assert_eq!(named, [("tenants", "acme", false), ("products", "embed", false)]);
        assert!(bad[0].reason.contains("no product 'embed'"), "{}", bad[0].reason);
    }

    #[test]
    fn a_readable_object_that_breaks_a_rule_is_set_aside_alone() {
        let last = good();
        let mut read = good();
        // a hand edit: the route names a plan that does not exist
        read.routes.get_mut("r").unwrap().plan = Some("nope".into());
        let (s, bad) = salvage(read.clone(), vec![], &last);
        assert_eq!(s.routes["r"].plan.as_deref(), Some("p"), "its last good version");
        assert_eq!((bad.len(), bad[0].kept), (1, true));
        assert!(bad[0].reason.contains("routes.r.plan"), "{}", bad[0].reason);
        // with no last good version it is left out
        let (s, bad) = salvage(read, vec![], &Snapshot::default());
        assert!(!s.routes.contains_key("r"));
        assert_eq!((bad.len(), bad[0].kept), (1, false));
    }

    #[test]
    fn a_last_good_version_that_no_longer_holds_is_left_out() {
        let last = good();
        let mut read = good();
        read.remove(Kind::Routes, "r");
        read.remove(Kind::Plans, "p"); // the plan the old route names was deleted since
        let (s, bad) = salvage(read, vec![Unusable::new(Kind::Routes, "r", "bad json")], &last);
        assert!(s.validate().is_ok());
        assert!(!s.routes.contains_key("r"));
        assert_eq!((bad.len(), bad[0].kept), (1, false));
        assert!(bad[0].reason.contains("no longer holds"), "{}", bad[0].reason);
    }

    #[test]
    fn a_store_without_problems_is_taken_as_it_is() {
        let (s, bad) = salvage(good(), vec![], &Snapshot::default());
        assert_eq!((s, bad), (good(), vec![]));
    }
}
