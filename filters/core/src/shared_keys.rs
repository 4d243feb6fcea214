//! Every key of Envoy shared data the filter reads or writes: built here and nowhere else.
//!
//! Shared data is per Envoy (per `vm_id`) and seen by every worker's VM; these keys never leave
//! the Envoy. Each format carries a version (`v1`): a change of a value's encoding gets a new
//! version, so a filter never misreads an older filter's value in the same Envoy. Only the hash
//! of an API key enters a key, never the key itself.
//!
//! | key | value | writers |
//! |---|---|---|
//! | `tollgate.auth.v1.{key_hash}[.{route}]` | JSON `CachedAllow` (crate::auth_cache) | request path |
//! | `tollgate.lease.v1.{key_hash}[.{route}]` | binary `LeaseRecord` (crate::lease) | request path, lease renewals, by CAS |
//! | `tollgate.breaker.v1.{target}` | 194-byte breaker `State` (crate::breaker) | request path, hint poller, by CAS |
//! | `tollgate.breaker.v1.lease` | hint poller election: owner, expiry (crate::election) | root contexts, by CAS |
//! | `tollgate.routes.v1` | JSON `RouteTable` (crate::routing) | the route poller, by CAS |
//! | `tollgate.routes.v1.lease` | route poller election: owner, expiry | root contexts, by CAS |
//! | `tollgate.changes.v1` | generation, sidecar epoch and change count, 3 × u64 LE (crate::changes) | the change poller, by CAS |
//! | `tollgate.changes.v1.lease` | change poller election: owner, expiry | root contexts, by CAS |
//!
//! The route suffix makes an entry per route where a route's product and plan override change
//! what a key may do. A breaker target may not be named `lease` in practice: its state would
//! share the hint poller's election key (target names are checked at configuration time only
//! for their alphabet).

use std::borrow::Cow;

/// A shared-data key. Only this module makes one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SharedKey(Cow<'static, str>);

impl SharedKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0.into_owned()
    }
}

/// The routing table the route poller keeps in step with the sidecar's.
pub const ROUTES_TABLE: SharedKey = SharedKey(Cow::Borrowed("tollgate.routes.v1"));
/// The election of the one root context per Envoy that polls the routing table.
pub const ROUTES_POLLER: SharedKey = SharedKey(Cow::Borrowed("tollgate.routes.v1.lease"));
/// The generation of cached answers and leases, and the sidecar change count it follows.
pub const CHANGES: SharedKey = SharedKey(Cow::Borrowed("tollgate.changes.v1"));
/// The election of the one root context per Envoy that polls the sidecar's change count.
pub const CHANGES_POLLER: SharedKey = SharedKey(Cow::Borrowed("tollgate.changes.v1.lease"));
/// When a worker of this Envoy last sent a decision or lease renewal call (host ms, 8 bytes
/// little-endian): the change poller sleeps once nothing cached can be left (crate::changes).
pub const CHANGES_CALLS: SharedKey = SharedKey(Cow::Borrowed("tollgate.changes.v1.calls"));
/// The election of the one root context per Envoy that exchanges breaker hints.
pub const HINTS_POLLER: SharedKey = SharedKey(Cow::Borrowed("tollgate.breaker.v1.lease"));

/// `key_hash`, or `key_hash.route` on a route.
fn scoped(prefix: &str, key_hash: &str, route: Option<&str>) -> SharedKey {
    SharedKey(Cow::Owned(match route {
        Some(r) => format!("{prefix}{key_hash}.{r}"),
        None => format!("{prefix}{key_hash}"),
    }))
}

/// A key's cached allow answer (per route: a route's product and plan override change it).
pub fn auth_cache(key_hash: &str, route: Option<&str>) -> SharedKey {
    scoped("tollgate.auth.v1.", key_hash, route)
}

/// A key's lease of a leased limit, at this Envoy (per route, as for the auth cache).
pub fn lease(key_hash: &str, route: Option<&str>) -> SharedKey {
    scoped("tollgate.lease.v1.", key_hash, route)
}

/// A breaker target's state.
pub fn breaker(target: &str) -> SharedKey {
    SharedKey(Cow::Owned(format!("tollgate.breaker.v1.{target}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn every_format_is_pinned() {
        assert_eq!(auth_cache("ab12", None).as_str(), "tollgate.auth.v1.ab12");
        assert_eq!(auth_cache("ab12", Some("chat")).as_str(), "tollgate.auth.v1.ab12.chat");
        assert_eq!(lease("ab12", None).as_str(), "tollgate.lease.v1.ab12");
        assert_eq!(lease("ab12", Some("chat")).as_str(), "tollgate.lease.v1.ab12.chat");
        assert_eq!(breaker("llm-a").as_str(), "tollgate.breaker.v1.llm-a");
        assert_eq!(HINTS_POLLER.as_str(), "tollgate.breaker.v1.lease");
        assert_eq!(ROUTES_TABLE.as_str(), "tollgate.routes.v1");
        assert_eq!(ROUTES_POLLER.as_str(), "tollgate.routes.v1.lease");
        assert_eq!(CHANGES.as_str(), "tollgate.changes.v1");
        assert_eq!(CHANGES_POLLER.as_str(), "tollgate.changes.v1.lease");
        assert_eq!(CHANGES_CALLS.as_str(), "tollgate.changes.v1.calls");
        assert_eq!(lease("h", None).into_string(), "tollgate.lease.v1.h");
    }
}
