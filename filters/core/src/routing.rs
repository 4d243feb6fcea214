//! Routing in the filter: the sidecar's routing table, kept in Envoy shared data, matched
//! locally on every request (no callout).
//!
//! ```text
//!  sidecar GET /v1/routes ──(one root context per Envoy, holding RouteTablePoller's lease)──►
//!      shared data `tollgate.routes.v1` (JSON table, written by CAS)
//!          └──► each worker's [`WorkerRoutes`] (parsed once per change, on the tick) ──► requests
//! ```
//!
//! The poller asks with `If-None-Match: <etag>` every `routing.refreshInterval`; an unchanged
//! table costs a 304 with no body. A worker re-reads the shared table only when its CAS token
//! moved, so the request path does no parsing and no host call for routing once loaded.
//! Invariants: only the lease holder writes the table; a table is written only if it parses;
//! until a table was ever loaded, a request finds [`Lookup::NotLoaded`] (the failure mode
//! applies), never a wrong route.

use crate::config::FilterConfig;
use crate::filter::{CallSpec, Host, LogLevel};
use std::rc::Rc;
use tollgate_wire::routes::{RequestView, RouteSpec, RouteTable, ROUTES_PATH};

/// Shared-data key of the routing table (JSON of [`RouteTable`]).
pub const TABLE_KEY: &str = "tollgate.routes.v1";
/// Shared-data key of the poller lease: owner (u64 LE) then expiry in ms (u64 LE).
pub const LEASE_KEY: &str = "tollgate.routes.v1.lease";

/// Takes or renews a lease in shared data (owner, expiry), by CAS; true when `owner` holds it
/// now. One root context per Envoy works, whatever the number of workers.
pub fn hold_lease(host: &mut impl Host, key: &str, owner: u64, now_ms: u64, lease_ms: u64) -> bool {
    let (bytes, cas) = host.shared_get_cas(key);
    if let Some((holder, until)) = bytes.as_deref().and_then(decode_lease) {
        if holder != owner && until > now_ms {
            return false;
        }
    }
    let mut value = owner.to_le_bytes().to_vec();
    value.extend_from_slice(&now_ms.saturating_add(lease_ms).to_le_bytes());
    host.shared_set_cas(key, &value, cas).is_ok()
}

fn decode_lease(bytes: &[u8]) -> Option<(u64, u64)> {
    let owner = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
    let until = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    Some((owner, until))
}

/// A request's route, as found in one table generation.
#[derive(Debug, Clone)]
pub struct Routed {
    table: Rc<RouteTable>,
    index: usize,
}

impl Routed {
    pub fn spec(&self) -> Option<&RouteSpec> {
        self.table.routes.get(self.index)
    }
}

/// What routing says about a request.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// Routing is off, or the table has no routes: Envoy's own route applies.
    Unrouted,
    /// No table was ever loaded on this worker or in shared data.
    NotLoaded,
    /// Routes exist and none matches.
    NoMatch,
    Route(Routed),
}

/// One worker's parsed copy of the shared table.
#[derive(Debug, Default)]
pub struct WorkerRoutes {
    table: Option<(u32, Rc<RouteTable>)>,
}

impl WorkerRoutes {
    /// Re-reads the shared table if it changed since the last read (the CAS token moved).
    pub fn refresh(&mut self, host: &impl Host) {
        let (bytes, cas) = host.shared_get_cas(TABLE_KEY);
        let (Some(bytes), Some(cas)) = (bytes, cas) else { return };
        if self.table.as_ref().is_some_and(|(c, _)| *c == cas) {
            return;
        }
        if let Ok(t) = serde_json::from_slice::<RouteTable>(&bytes) {
            self.table = Some((cas, Rc::new(t)));
        }
    }

    pub fn table(&self) -> Option<&RouteTable> {
        self.table.as_ref().map(|(_, t)| t.as_ref())
    }

    /// The route of a request. Reads shared data only while nothing is loaded yet.
    pub fn lookup<'a, H: Fn(&str) -> Option<&'a str>>(&mut self, host: &impl Host, req: &RequestView<'a, H>) -> Lookup {
        if self.table.is_none() {
            self.refresh(host);
        }
        let Some((_, table)) = &self.table else { return Lookup::NotLoaded };
        if table.routes.is_empty() {
            return Lookup::Unrouted;
        }
        match table.routes.iter().position(|r| r.matches(req)) {
            Some(index) => Lookup::Route(Routed { table: table.clone(), index }),
            None => Lookup::NoMatch,
        }
    }
}

/// Keeps shared data's table in step with the sidecar's (one root context per Envoy does it).
pub struct RouteTablePoller {
    config: Rc<FilterConfig>,
    owner: u64,
    call: Option<(u32, u64)>,
    last_poll_ms: u64,
    failing: bool,
}

impl RouteTablePoller {
    pub fn new(config: Rc<FilterConfig>, owner: u64) -> RouteTablePoller {
        RouteTablePoller { config, owner: owner.max(1), call: None, last_poll_ms: 0, failing: false }
    }

    fn lease_ms(&self) -> u64 {
        (self.config.routing.refresh_interval.as_millis() as u64).saturating_mul(4).max(1_000)
    }

    /// One tick: when the refresh interval is over and this context holds the lease, ask the
    /// sidecar for the table (conditionally on the etag in shared data).
    pub fn on_tick(&mut self, host: &mut impl Host) {
        let now = host.now_ms();
        let interval = self.config.routing.refresh_interval.as_millis() as u64;
        if now.saturating_sub(self.last_poll_ms) + 5 < interval {
            return;
        }
        // A call that never came back (it has Envoy's timeout, but be safe): forget it.
        if self.call.is_some_and(|(_, at)| now.saturating_sub(at) < 10_000) {
            return;
        }
        if !hold_lease(host, LEASE_KEY, self.owner, now, self.lease_ms()) {
            return;
        }
        self.last_poll_ms = now;
        let etag = host
            .shared_get(TABLE_KEY)
            .and_then(|b| serde_json::from_slice::<RouteTable>(&b).ok())
            .map(|t| t.etag)
            .unwrap_or_default();
        let c = &self.config;
        let mut headers = vec![
            (":method".to_string(), "GET".to_string()),
            (":path".to_string(), ROUTES_PATH.to_string()),
            (":authority".to_string(), c.sidecar_authority.clone()),
        ];
        if !etag.is_empty() {
            headers.push(("if-none-match".to_string(), format!("\"{etag}\"")));
        }
        let timeout = c.sidecar_timeout.max(std::time::Duration::from_secs(1));
        match host.dispatch(CallSpec { cluster: c.sidecar_cluster.clone(), headers, body: Vec::new(), timeout }) {
            Ok(token) => self.call = Some((token, now)),
            Err(e) => self.state(host, false, &format!("cannot call the sidecar: {e}")),
        }
    }

    /// Whether `token` is this poller's call.
    pub fn owns(&self, token: u32) -> bool {
        self.call.is_some_and(|(t, _)| t == token)
    }

    /// The sidecar's answer: 200 with a table (written to shared data if it parses), or 304.
    pub fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        if !self.owns(token) {
            return;
        }
        self.call = None;
        match status {
            Some(304) => self.state(host, true, ""),
            Some(200) => match serde_json::from_slice::<RouteTable>(body) {
                Ok(table) => {
                    let (_, cas) = host.shared_get_cas(TABLE_KEY);
                    match host.shared_set_cas(TABLE_KEY, body, cas) {
                        Ok(()) => {
                            host.log(
                                LogLevel::Info,
                                &format!("tollgate: routing table {} ({} routes, version {})", table.etag, table.routes.len(), table.version),
                            );
                            self.state(host, true, "");
                        }
                        // Someone else wrote meanwhile (a former lease holder): the next poll compares again.
                        Err(e) => host.log(LogLevel::Debug, &format!("tollgate: routing table not written: {e:?}")),
                    }
                }
                Err(e) => self.state(host, false, &format!("undecodable routing table: {e}")),
            },
            s => self.state(host, false, &format!("routing table answered {s:?}")),
        }
    }

    fn state(&mut self, host: &mut impl Host, ok: bool, why: &str) {
        if ok && self.failing {
            host.log(LogLevel::Info, "tollgate: routing table: the sidecar answers again");
        } else if !ok && !self.failing {
            host.log(LogLevel::Warn, &format!("tollgate: routing table not refreshed for now: {why}"));
        }
        self.failing = !ok;
    }
}
