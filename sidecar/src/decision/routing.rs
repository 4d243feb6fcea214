//! What decisions and the filters need from the routing configuration: the table the filters
//! match against (served on `GET /v1/routes`), and per route what the sidecar applies — the API
//! product (a tenant must subscribe to it), a plan override, the response cache's TTL. Built from
//! a configuration snapshot by the configuration plane (`Routing::of`, crate::control::routes).

use super::limits::Plans;
use crate::keys::Id;
use std::sync::Arc;
use std::collections::{BTreeSet, HashMap};
use tollgate_wire::routes::RouteTable;

#[derive(Debug, Default)]
pub struct Routing {
    /// Served as is on `GET /v1/routes`.
    pub table: RouteTable,
    routes: HashMap<String, RouteEffect>,
    /// Tenant → the products it subscribes to.
    subscriptions: HashMap<String, BTreeSet<String>>,
}

/// What the sidecar applies on one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEffect {
    pub product: Option<Id>,
    pub plan: Option<String>,
    /// The response cache on this route (issue 7): its key segment — the route's id and a digest
    /// of what its answers depend on, its cluster and TTL (decision 202: a changed route starts
    /// an empty cache) — and its TTL.
    pub cache: Option<(Id, u64)>,
    /// An LLM route (`llm = true`): a model policy applies to its requests, named or not.
    pub llm: bool,
}

impl Routing {
    /// A routing from its parts: the table, each route's effect by route id, and each tenant's
    /// subscriptions (tenant → product ids).
    pub fn new(table: RouteTable, routes: HashMap<String, RouteEffect>, subscriptions: HashMap<String, BTreeSet<String>>) -> Routing {
        Routing { table, routes, subscriptions }
    }

    /// The effect of a route id (none: a route this replica does not know, yet or any more).
    pub fn route(&self, id: &str) -> Option<&RouteEffect> {
        self.routes.get(id)
    }

    /// Whether `tenant` subscribes to `product`.
    pub fn subscribes(&self, tenant: &Id, product: &Id) -> bool {
        self.subscriptions.get(tenant.as_str()).is_some_and(|s| s.contains(product.as_str()))
    }

    /// The response-cache TTL of a route id (none: unknown route, or it does not cache).
    pub fn cache_ttl_ms(&self, route: &str) -> Option<u64> {
        self.cache(route).map(|(_, ms)| ms)
    }

    /// The response cache's key segment and TTL of a route id (none: unknown route, or it does
    /// not cache).
    pub fn cache(&self, route: &str) -> Option<(Id, u64)> {
        self.routes.get(route).and_then(|r| r.cache.clone())
    }
}

/// The plans and the routing in force: one value, replaced whole (decision 208).
pub struct InForce {
    pub plans: Arc<Plans>,
    pub routing: Arc<Routing>,
}
