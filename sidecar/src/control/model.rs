//! The configuration model (tenants, API products, plans, subscriptions, routes) and its
//! validation, routes' included; its sources are in [`super::source`].
//!
//! Invariants: a [`Snapshot`] in force has passed [`Snapshot::validate`]; a change is applied to
//! a copy ([`Snapshot::apply`]), validated, and only then written, so bad input leaves the
//! running configuration untouched. API keys are not part of a snapshot: their records live in
//! PostgreSQL (store of record) and in Redis `apikey:{sha256}` (the hot copy the request path
//! reads). Nothing here is on the request path.

pub use crate::invalid::Invalid;

use crate::invalid::{check_id, invalid};
use crate::keys::{Id, ALL_TENANTS};
use crate::decision::limits::{LimitConfig, ModelLimitConfig, PlanConfig, Plans};
pub use super::prices::PriceEntry;
use super::prices::check_rates;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// A tenant and its subscriptions (the API products it may use).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub id: String,
    #[serde(default)]
    pub name: String,
    /// Subscriptions: ids of [`Product`]s.
    #[serde(default)]
    pub products: Vec<String>,
}

/// An API product: what routes belong to and tenants subscribe to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Product {
    pub id: String,
    #[serde(default)]
    pub name: String,
}

/// A plan as the admin API carries it: an id, the limits of crate::decision::limits and its
/// model policy (issue 42 item 4: `models`, `model_aliases`, `model_limits`, written only when set).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub id: String,
    #[serde(default)]
    pub limits: Vec<LimitConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_aliases: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_limits: Vec<ModelLimitConfig>,
}

impl Plan {
    /// The plan's configuration, without its id.
    pub fn config(self) -> PlanConfig {
        PlanConfig { limits: self.limits, models: self.models, model_aliases: self.model_aliases, model_limits: self.model_limits }
    }

    /// The plan `id` of `config`.
    pub fn of(id: &str, config: &PlanConfig) -> Plan {
        let c = config.clone();
        Plan { id: id.to_string(), limits: c.limits, models: c.models, model_aliases: c.model_aliases, model_limits: c.model_limits }
    }
}

/// What happens when a dependency of a route cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    Open,
    Closed,
}

/// A header a route requires: present (no `value`) or equal to `value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    pub name: String,
    #[serde(default)]
    pub value: Option<String>,
}

/// What a request must look like to take a route. Absent fields match anything.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteMatch {
    /// Exact `:authority` without port, case-insensitive.
    pub host: Option<String>,
    /// Path prefix (segment-unaware, like Envoy's `prefix`). Exclusive with `path`.
    pub path_prefix: Option<String>,
    /// Exact path (query string ignored).
    pub path: Option<String>,
    /// Upper-case HTTP method.
    pub method: Option<String>,
    pub headers: Vec<HeaderMatch>,
}

/// A route: requests it matches go to `cluster`, count as `product`, and get its policies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    pub id: String,
    /// Lower first; ties by id. Default 100.
    #[serde(default = "default_priority")]
    pub priority: i32,
    #[serde(default, rename = "match")]
    pub matches: RouteMatch,
    /// The Envoy upstream cluster the request is steered to.
    pub cluster: String,
    #[serde(default)]
    pub product: Option<String>,
    /// Limit override: the plan whose limits apply on this route instead of the key's plan.
    #[serde(default)]
    pub plan: Option<String>,
    /// What the filter does when the sidecar cannot answer for this route (default: the
    /// filter's own `failureMode`).
    #[serde(default)]
    pub failure_mode: Option<FailureMode>,
    /// Response cache: how long a successful response may be served from the cache (absent: no
    /// caching on this route).
    #[serde(default, with = "humantime_serde")]
    pub cache_ttl: Option<Duration>,
    /// Request headers that are part of the response-cache key (beyond method, path, query, body).
    #[serde(default)]
    pub cache_key_headers: Vec<String>,
    /// The circuit-breaker target (by name, of the filter's `breakers.targets`) that guards this
    /// route; default: the target whose cluster is the route's.
    #[serde(default)]
    pub breaker: Option<String>,
    /// An LLM route (issue 42): its usage events carry the model asked for, the model that
    /// answered and the tokens apart. Written only when set, so a sidecar that predates it
    /// reads the routes that are not (decision 291).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub llm: bool,
}

fn default_priority() -> i32 {
    100
}

/// One generation of configuration: everything but API keys.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Snapshot {
    pub tenants: BTreeMap<String, Tenant>,
    pub products: BTreeMap<String, Product>,
    pub plans: BTreeMap<String, PlanConfig>,
    pub routes: BTreeMap<String, Route>,
    /// Prices of LLM calls (PostgreSQL only; the file's stay in `[usage.pricing]`).
    pub prices: BTreeMap<String, PriceEntry>,
}

tollgate_wire::named_enum! {
    /// The kinds of object the admin API manages (and the PostgreSQL table of each). Its name
    /// is the admin API's path segment and the table's name.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        Tenants => "tenants",
        Products => "products",
        Plans => "plans",
        Routes => "routes",
        Prices => "prices",
    }
}

impl Kind {
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// The most objects of one kind a configuration may hold (decision 208): every replica loads
/// them all at every change, and the filter matches a request against the routes one by one.
pub fn max_objects(kind: Kind) -> usize {
    match kind {
        Kind::Tenants => 100_000,
        Kind::Products => 1_000,
        Kind::Plans => 10_000,
        Kind::Routes => 1_000,
        // every replica compiles them at every change; a model's price history fits many times
        Kind::Prices => 10_000,
    }
}

/// The largest object the admin API takes, in bytes of its JSON (decision 208): no tenant, plan
/// or route needs more, and a row is read by every replica at every change.
pub const MAX_OBJECT_BYTES: usize = 64 * 1024;

/// The first string of `v` (a value or a key) holding a control character, as a field path under
/// `prefix` (decision 201): no name, host, path or header value of the configuration needs one,
/// and PostgreSQL's jsonb refuses `\u0000` — a write carrying it was answered 503
/// `store_unavailable`, as if PostgreSQL were down.
pub fn control_character_at(v: &Value, prefix: &str) -> Option<String> {
    let bad = |s: &str| s.chars().any(char::is_control);
    match v {
        Value::String(s) => bad(s).then(|| prefix.to_string()),
        Value::Array(items) => items.iter().enumerate().find_map(|(i, x)| control_character_at(x, &format!("{prefix}[{i}]"))),
        Value::Object(fields) => fields.iter().find_map(|(k, x)| match bad(k) {
            true => Some(format!("{prefix}.{}", k.escape_debug())),
            false => control_character_at(x, &format!("{prefix}.{k}")),
        }),
        _ => None,
    }
}

/// A change to a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// Create or replace the object (JSON as the admin API takes it).
    Put(Kind, serde_json::Value),
    Delete(Kind, String),
}

/// Names the field in a serde error ("unknown field `x`", "missing field `y`", "… at line …").
fn from_serde(e: serde_json::Error) -> Invalid {
    let msg = e.to_string();
    let field = msg.split('`').nth(1).filter(|_| msg.contains("field")).unwrap_or("body").to_string();
    invalid(field, msg)
}


impl Snapshot {
    /// The stored prices, checked, for the table in force (crate::usage::pricing::merge); one
    /// that breaks a rule is left out (a validated snapshot has none).
    pub fn price_entries(&self) -> Vec<crate::usage::pricing::Entry> {
        super::prices::entries(&self.prices)
    }

    /// Builds a snapshot from the file configuration's lists.
    pub fn from_file(tenants: &[Tenant], products: &[Product], plans: &BTreeMap<String, PlanConfig>, routes: &[Route]) -> Result<Snapshot, Invalid> {
        let mut s = Snapshot { plans: plans.clone(), ..Snapshot::default() };
        for (i, t) in tenants.iter().enumerate() {
            if s.tenants.insert(t.id.clone(), t.clone()).is_some() {
                return Err(invalid(format!("tenants[{i}].id"), "duplicate id"));
            }
        }
        for (i, p) in products.iter().enumerate() {
            if s.products.insert(p.id.clone(), p.clone()).is_some() {
                return Err(invalid(format!("products[{i}].id"), "duplicate id"));
            }
        }
        for (i, r) in routes.iter().enumerate() {
            if s.routes.insert(r.id.clone(), r.clone()).is_some() {
                return Err(invalid(format!("routes[{i}].id"), "duplicate id"));
            }
        }
        if let Some(kind) = Kind::ALL.into_iter().find(|k| s.count(*k) > max_objects(*k)) {
            return Err(invalid(kind.name(), format!("a configuration holds at most {} {}", max_objects(kind), kind.name())));
        }
        s.validate()?;
        Ok(s)
    }

    /// Every rule a configuration in force obeys; the error names the first bad field.
    pub fn validate(&self) -> Result<(), Invalid> {
        self.first_invalid().map_or(Ok(()), |(_, _, e)| Err(e))
    }

    /// The first object that breaks a rule (in [`Kind::ALL`] order, then by id), with why. Each
    /// rule is about one object (and what it names), so the object is known, not guessed from
    /// a field path (ids may hold dots): what the PostgreSQL source needs to set one bad row
    /// aside and keep the rest (decision 206).
    pub fn first_invalid(&self) -> Option<(Kind, String, Invalid)> {
        let tenant = |id: &String, t: &Tenant| -> Result<(), Invalid> {
            let f = format!("tenants.{id}");
            check_id(&format!("{f}.id"), id)?;
            if id.starts_with('_') {
                return Err(invalid(format!("{f}.id"), format!("may not start with '_' ({ALL_TENANTS} is reserved)")));
            }
            let mut seen = BTreeSet::new();
            for p in &t.products {
                if !self.products.contains_key(p) {
                    return Err(invalid(format!("{f}.products"), format!("no product '{p}'")));
                }
                if !seen.insert(p) {
                    return Err(invalid(format!("{f}.products"), format!("'{p}' listed twice")));
                }
            }
            Ok(())
        };
        let found = |kind: Kind, id: &String, r: Result<(), Invalid>| r.err().map(|e| (kind, id.clone(), e));
        self.tenants
            .iter()
            .find_map(|(id, t)| found(Kind::Tenants, id, tenant(id, t)))
            .or_else(|| self.products.keys().find_map(|id| found(Kind::Products, id, check_id(&format!("products.{id}.id"), id))))
            .or_else(|| {
                self.plans.iter().find_map(|(id, p)| {
                    let one = BTreeMap::from([(id.clone(), p.clone())]);
                    found(Kind::Plans, id, Plans::compile(&one).map(|_| ()))
                })
            })
            .or_else(|| self.routes.iter().find_map(|(id, r)| found(Kind::Routes, id, validate_route(id, r, self))))
            .or_else(|| super::prices::first_invalid(&self.prices).map(|(id, e)| (Kind::Prices, id, e)))
    }

    /// How many objects of `kind` there are.
    pub fn count(&self, kind: Kind) -> usize {
        match kind {
            Kind::Tenants => self.tenants.len(),
            Kind::Products => self.products.len(),
            Kind::Plans => self.plans.len(),
            Kind::Routes => self.routes.len(),
            Kind::Prices => self.prices.len(),
        }
    }

    /// Removes an object; whether there was one.
    pub fn remove(&mut self, kind: Kind, id: &str) -> bool {
        match kind {
            Kind::Tenants => self.tenants.remove(id).is_some(),
            Kind::Products => self.products.remove(id).is_some(),
            Kind::Plans => self.plans.remove(id).is_some(),
            Kind::Routes => self.routes.remove(id).is_some(),
            Kind::Prices => self.prices.remove(id).is_some(),
        }
    }

    /// Puts an object (JSON as [`Snapshot::get`] shows it) in under `id`, unvalidated.
    pub fn insert_value(&mut self, kind: Kind, id: &str, v: Value) -> Result<(), serde_json::Error> {
        let id = id.to_string();
        match kind {
            Kind::Tenants => drop(self.tenants.insert(id, serde_json::from_value(v)?)),
            Kind::Products => drop(self.products.insert(id, serde_json::from_value(v)?)),
            Kind::Plans => drop(self.plans.insert(id, serde_json::from_value::<Plan>(v)?.config())),
            Kind::Routes => drop(self.routes.insert(id, serde_json::from_value(v)?)),
            Kind::Prices => drop(self.prices.insert(id, serde_json::from_value(v)?)),
        }
        Ok(())
    }

    /// The snapshot with `change` applied and validated; `self` is untouched either way. A new
    /// object past its kind's bound ([`max_objects`]) is refused, naming the kind.
    pub fn apply(&self, change: &Change) -> Result<Snapshot, Invalid> {
        if let Change::Put(kind, v) = change {
            let id = v.get("id").and_then(Value::as_str).unwrap_or_default();
            let max = max_objects(*kind);
            if self.get(*kind, id).is_none() && self.count(*kind) >= max {
                let what = kind.name();
                return Err(invalid(what, format!("a configuration holds at most {max} {what} (delete one first)")));
            }
        }
        let mut next = self.clone();
        match change {
            Change::Put(kind, value) => {
                let v = value.clone();
                match kind {
                    Kind::Tenants => {
                        let t: Tenant = serde_json::from_value(v).map_err(from_serde)?;
                        check_id("id", &t.id)?;
                        next.tenants.insert(t.id.clone(), t);
                    }
                    Kind::Products => {
                        let p: Product = serde_json::from_value(v).map_err(from_serde)?;
                        check_id("id", &p.id)?;
                        next.products.insert(p.id.clone(), p);
                    }
                    Kind::Plans => {
                        let p: Plan = serde_json::from_value(v).map_err(from_serde)?;
                        check_id("id", &p.id)?;
                        next.plans.insert(p.id.clone(), p.config());
                    }
                    Kind::Routes => {
                        let r: Route = serde_json::from_value(v).map_err(from_serde)?;
                        check_id("id", &r.id)?;
                        next.routes.insert(r.id.clone(), r);
                    }
                    Kind::Prices => {
                        let mut p: PriceEntry = serde_json::from_value(check_rates(v)?).map_err(from_serde)?;
                        check_id("id", &p.id)?;
                        // one spelling of a moment: `2026-03-01` is stored as 2026-03-01T00:00:00Z
                        if let Some(ms) = p.effective_from.as_deref().and_then(crate::usage::pricing::parse_moment) {
                            p.effective_from = Some(crate::usage::pricing::format_moment(ms));
                        }
                        next.prices.insert(p.id.clone(), p);
                    }
                }
            }
            Change::Delete(kind, id) => {
                let found = match kind {
                    Kind::Tenants => next.tenants.remove(id).is_some(),
                    Kind::Products => next.products.remove(id).is_some(),
                    Kind::Plans => next.plans.remove(id).is_some(),
                    Kind::Routes => next.routes.remove(id).is_some(),
                    Kind::Prices => next.prices.remove(id).is_some(),
                };
                if !found {
                    return Err(invalid("id", format!("no {} '{id}'", kind.name())));
                }
            }
        }
        next.validate()?;
        Ok(next)
    }

    /// One object as the admin API shows it.
    pub fn get(&self, kind: Kind, id: &str) -> Option<serde_json::Value> {
        let v = match kind {
            Kind::Tenants => serde_json::to_value(self.tenants.get(id)?),
            Kind::Products => serde_json::to_value(self.products.get(id)?),
            Kind::Plans => serde_json::to_value(Plan::of(id, self.plans.get(id)?)),
            Kind::Routes => serde_json::to_value(self.routes.get(id)?),
            Kind::Prices => serde_json::to_value(self.prices.get(id)?),
        };
        v.ok()
    }

    /// Every object of a kind, by id.
    pub fn list(&self, kind: Kind) -> Vec<serde_json::Value> {
        let ids: Vec<&String> = match kind {
            Kind::Tenants => self.tenants.keys().collect(),
            Kind::Products => self.products.keys().collect(),
            Kind::Plans => self.plans.keys().collect(),
            Kind::Routes => self.routes.keys().collect(),
            Kind::Prices => self.prices.keys().collect(),
        };
        ids.into_iter().filter_map(|id| self.get(kind, id)).collect()
    }
}

const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"];

/// Checks one route against the rest of the snapshot.
fn validate_route(id: &str, r: &Route, s: &Snapshot) -> Result<(), Invalid> {
    let f = format!("routes.{id}");
    check_id(&format!("{f}.id"), id)?;
    let m = &r.matches;
    if m.path.is_some() && m.path_prefix.is_some() {
        return Err(invalid(format!("{f}.match.path"), "give path or path_prefix, not both"));
    }
    for (name, p) in [("path", &m.path), ("path_prefix", &m.path_prefix)] {
        if p.as_ref().is_some_and(|p| !p.starts_with('/')) {
            return Err(invalid(format!("{f}.match.{name}"), "must start with '/'"));
        }
    }
    if m.host.as_ref().is_some_and(|h| h.is_empty() || h.contains(['/', ' '])) {
        return Err(invalid(format!("{f}.match.host"), "not a host name"));
    }
    // the request's port is not compared (the filter strips it): a host with one never matched
    // (decision 204)
    if m.host.as_ref().and_then(|h| h.rsplit_once(':')).is_some_and(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
        return Err(invalid(format!("{f}.match.host"), "a host name without its port (a request's port is not compared)"));
    }
    if m.method.as_ref().is_some_and(|x| !METHODS.contains(&x.as_str())) {
        return Err(invalid(format!("{f}.match.method"), "an upper-case HTTP method"));
    }
    // A client's x-tollgate-* headers are removed before the filter reads anything: a rule on
    // one could never hold, and must not look as if it did.
    let header_name = |field: String, n: &str| {
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(invalid(field, "not a header name"));
        }
        if tollgate_wire::is_internal_header(n) {
            return Err(invalid(field, format!("in Tollgate's own {}* namespace: a client's are removed", tollgate_wire::INTERNAL_HEADER_PREFIX)));
        }
        Ok(())
    };
    for (i, h) in m.headers.iter().enumerate() {
        header_name(format!("{f}.match.headers[{i}].name"), &h.name)?;
    }
    for (i, h) in r.cache_key_headers.iter().enumerate() {
        header_name(format!("{f}.cache_key_headers[{i}]"), h)?;
    }
    // Envoy cluster names are free-form, but this one travels in a header: keep it plain.
    check_id(&format!("{f}.cluster"), &r.cluster)?;
    if let Some(p) = &r.product {
        if !s.products.contains_key(p) {
            return Err(invalid(format!("{f}.product"), format!("no product '{p}'")));
        }
    }
    if let Some(p) = &r.plan {
        if !s.plans.contains_key(p) {
            return Err(invalid(format!("{f}.plan"), format!("no plan '{p}'")));
        }
    }
    Ok(())
}

/// The tenant a change concerns (`None`: every tenant — plans, products and routes are shared).
pub fn tenant_of(change: &Change) -> Option<Id> {
    match change {
        Change::Put(Kind::Tenants, v) => v.get("id").and_then(|i| i.as_str()).and_then(Id::parse),
        Change::Delete(Kind::Tenants, id) => Id::parse(id),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Snapshot {
        let s = Snapshot::default();
        let s = s.apply(&Change::Put(Kind::Products, json!({"id": "chat"}))).unwrap();
        s.apply(&Change::Put(Kind::Tenants, json!({"id": "acme", "products": ["chat"]}))).unwrap()
    }

    #[test]
    fn changes_apply_to_a_copy() {
        let s = base();
        let next = s.apply(&Change::Put(Kind::Plans, json!({"id": "gold", "limits": [{"name": "pm", "algorithm": "fixed_window", "limit": 5}]}))).unwrap();
        assert!(s.plans.is_empty());
        assert_eq!(next.plans["gold"].limits[0].limit, 5);
        assert_eq!(next.get(Kind::Plans, "gold").unwrap()["id"], "gold");
        assert_eq!(next.list(Kind::Tenants).len(), 1);
    }

    #[test]
    fn bad_input_names_the_field() {
        let s = base();
        let e = s.apply(&Change::Put(Kind::Tenants, json!({"id": "x", "prodcts": []}))).unwrap_err();
        assert_eq!(e.field, "prodcts");
        let e = s.apply(&Change::Put(Kind::Tenants, json!({"name": "x"}))).unwrap_err();
        assert_eq!(e.field, "id");
        let e = s.apply(&Change::Put(Kind::Tenants, json!({"id": "b c"}))).unwrap_err();
        assert_eq!(e.field, "id");
        let e = s.apply(&Change::Put(Kind::Tenants, json!({"id": "_all"}))).unwrap_err();
        assert_eq!(e.field, "tenants._all.id");
        let e = s.apply(&Change::Put(Kind::Tenants, json!({"id": "t", "products": ["nope"]}))).unwrap_err();
        assert_eq!(e.field, "tenants.t.products");
        let e = s.apply(&Change::Put(Kind::Plans, json!({"id": "p", "limits": [{"name": "x", "algorithm": "fixed_window", "limit": 0}]}))).unwrap_err();
        assert_eq!(e.field, "plans.p.limits[0].limit");
        // a product in use cannot go
        let e = s.apply(&Change::Delete(Kind::Products, "chat".into())).unwrap_err();
        assert_eq!(e.field, "tenants.acme.products");
        let e = s.apply(&Change::Delete(Kind::Routes, "none".into())).unwrap_err();
        assert_eq!(e.field, "id");
        // a plan's model policy (issue 42 item 4): each bad entry named; written back as given
        let e = s.apply(&Change::Put(Kind::Plans, json!({"id": "p", "models": ["gpt-4o*", "a b"]}))).unwrap_err();
        assert_eq!(e.field, "plans.p.models[1]");
        let e = s.apply(&Change::Put(Kind::Plans, json!({"id": "p", "models": vec!["m"; 257]}))).unwrap_err();
        assert_eq!(e.field, "plans.p.models");
        let e = s.apply(&Change::Put(Kind::Plans, json!({"id": "p", "model_limits": [{"model": "m"}]}))).unwrap_err();
        assert_eq!(e.field, "plans.p.model_limits[0]");
        let e = s.apply(&Change::Put(Kind::Plans, json!({"id": "p", "model_limits": [{"model": "m", "rpm": 1}]}))).unwrap_err();
        assert_eq!(e.field, "rpm");
        let plan = json!({"id": "p", "limits": [], "models": ["gpt-4o*"], "model_aliases": {"fast": "gpt-4o-mini"}, "model_limits": [{"model": "gpt-4o*", "requests_per_minute": 60, "subject": "key", "failure_mode": "open"}]});
        let next = s.apply(&Change::Put(Kind::Plans, plan.clone())).unwrap();
        assert_eq!(next.get(Kind::Plans, "p").unwrap(), plan);
        assert_eq!(next.get(Kind::Plans, "gold"), None);
        let bare = s.apply(&Change::Put(Kind::Plans, json!({"id": "q"}))).unwrap();
        assert_eq!(bare.get(Kind::Plans, "q").unwrap(), json!({"id": "q", "limits": []}), "no policy: no new fields written");
    }

    /// Decision 201: a control character anywhere in a written object is named by its field.
    #[test]
    fn control_characters_are_named_by_their_field() {
        let at = |v: serde_json::Value| control_character_at(&v, "tenants.acme");
        assert_eq!(at(json!({"id": "acme", "name": "a\u{0}b"})), Some("tenants.acme.name".into()));
        assert_eq!(at(json!({"id": "acme", "products": ["chat", "x\ny"]})), Some("tenants.acme.products[1]".into()));
        assert_eq!(at(json!({"id": "acme", "match": {"headers": [{"name": "x", "value": "\u{7f}"}]}})), Some("tenants.acme.match.headers[0].value".into()));
        assert_eq!(at(json!({"id": "acme", "name": "Acmé Ltd. — 例"})), None);
    }

    /// Decision 208: a configuration holds a bounded number of objects of each kind.
    #[test]
    fn a_kind_past_its_bound_is_refused_naming_it() {
        let mut s = base();
        for i in 0..max_objects(Kind::Products) - 1 {
            s.products.insert(format!("p{i}"), Product { id: format!("p{i}"), name: String::new() });
        }
        assert_eq!(s.apply(&Change::Put(Kind::Products, json!({"id": "one-more"}))).unwrap_err().field, "products");
        // replacing one that exists is no new object
        assert!(s.apply(&Change::Put(Kind::Products, json!({"id": "p1", "name": "renamed"}))).is_ok());
        let products: Vec<Product> = s.products.values().cloned().chain([Product { id: "x".into(), name: String::new() }]).collect();
        assert_eq!(Snapshot::from_file(&[], &products, &BTreeMap::new(), &[]).unwrap_err().field, "products");
    }

    #[test]
    fn changes_know_their_tenant() {
        assert_eq!(tenant_of(&Change::Put(Kind::Tenants, json!({"id": "acme"}))), Id::parse("acme"));
        assert_eq!(tenant_of(&Change::Delete(Kind::Plans, "gold".into())), None);
    }

    #[test]
    fn file_lists_refuse_duplicates() {
        let t = Tenant { id: "a".into(), name: String::new(), products: vec![] };
        let e = Snapshot::from_file(&[t.clone(), t], &[], &BTreeMap::new(), &[]).unwrap_err();
        assert_eq!(e.field, "tenants[1].id");
    }

}
