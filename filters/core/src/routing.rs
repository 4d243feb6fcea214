//! Routing in the filter: the sidecar's routing table, kept in Envoy shared data, matched
//! locally on every request (no callout).
//!
//! ```text
//!  sidecar GET /v1/routes ──(one root context per Envoy, elected: RouteTablePoller)──►
//!      shared data `tollgate.routes.v1` (JSON table, written by CAS; crate::shared_keys)
//!          └──► each worker's [`WorkerRoutes`] (parsed once per change, on the tick) ──► requests
//! ```
//!
//! The poller asks with `If-None-Match: <etag>` every `routing.refreshInterval`; an unchanged
//! table costs a 304 with no body. A worker re-reads the shared table only when its CAS token
//! moved, so the request path does no parsing and no host call for routing once loaded.
//! Invariants: only the elected poller writes the table; a table is written only if it parses;
//! until a table was ever loaded, a request finds [`Lookup::NotLoaded`] (the failure mode
//! applies), never a wrong route.

use crate::host::{Host, LogLevel};
use crate::jobs::{Cadence, Job, Outage};
use crate::settings::{duration_within, given, ConfigError};
use crate::shared_keys::{ROUTES_POLLER, ROUTES_TABLE};
use crate::sidecar::Sidecar;
use crate::election;
use serde::Deserialize;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use tollgate_wire::routes::{RequestView, RouteSpec, RouteTable, ROUTES_PATH};

/// Routing (issue 4, plugin configuration `routing`): the filter matches every request against
/// the sidecar's routing table, kept in shared data, and steers it to the route's cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingConfig {
    pub enabled: bool,
    /// How often one root context per Envoy asks the sidecar whether the table changed.
    pub refresh_interval: Duration,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig { enabled: false, refresh_interval: Duration::from_millis(200) }
    }
}

/// `routing` as written in the plugin configuration.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawRouting {
    #[serde(default, deserialize_with = "given")]
    enabled: Option<bool>,
    #[serde(default, deserialize_with = "given")]
    refresh_interval: Option<String>,
}

impl RoutingConfig {
    pub fn compile(raw: RawRouting) -> Result<RoutingConfig, ConfigError> {
        let (min, max) = (Duration::from_millis(10), Duration::from_secs(10));
        let defaults = RoutingConfig::default();
        let refresh_interval = match raw.refresh_interval {
            Some(s) => duration_within("routing.refreshInterval", &s, min, max, "10ms and 10s")?,
            None => defaults.refresh_interval,
        };
        Ok(RoutingConfig { enabled: raw.enabled.unwrap_or(defaults.enabled), refresh_interval })
    }
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
    /// Some route of the table has a header rule (else no request's headers are looked at).
    header_rules: bool,
}

impl WorkerRoutes {
    /// Re-reads the shared table if it changed since the last read (the CAS token moved).
    pub fn refresh(&mut self, host: &impl Host) {
        let (bytes, cas) = host.shared_get_cas(ROUTES_TABLE.as_str());
        let (Some(bytes), Some(cas)) = (bytes, cas) else { return };
        if self.table.as_ref().is_some_and(|(c, _)| *c == cas) {
            return;
        }
        if let Ok(t) = serde_json::from_slice::<RouteTable>(&bytes) {
            self.header_rules = t.routes.iter().any(|r| !r.headers.is_empty());
            self.table = Some((cas, Rc::new(t)));
        }
    }

    /// The first request header a rule read in finding `req`'s route fails `ambiguous` (sent
    /// twice, not UTF-8): the rules of the routes whose host, path and method fit, up to the one
    /// taken. A route `req` could never take reads nothing of it.
    pub fn ambiguous_rule_header<'a, H: Fn(&str) -> Option<&'a str>>(
        &self,
        req: &RequestView<'a, H>,
        ambiguous: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let (_, table) = self.table.as_ref().filter(|_| self.header_rules)?;
        for route in table.routes.iter().filter(|r| r.matches_request_line(req)) {
            if let Some(h) = route.headers.iter().find(|h| ambiguous(&h.name)) {
                return Some(h.name.clone());
            }
            if route.matches(req) {
                return None;
            }
        }
        None
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
    config: RoutingConfig,
    sidecar: Sidecar,
    owner: u64,
    call: Option<(u32, u64)>,
    /// Polls at most every `refreshInterval` (counted from the last poll sent).
    cadence: Cadence,
    outage: Outage,
}

impl RouteTablePoller {
    pub fn new(config: RoutingConfig, sidecar: Sidecar, owner: u64) -> RouteTablePoller {
        let cadence = Cadence::every(config.refresh_interval);
        RouteTablePoller { config, sidecar, owner: owner.max(1), call: None, cadence, outage: Outage::default() }
    }

    fn lease_ms(&self) -> u64 {
        (self.config.refresh_interval.as_millis() as u64).saturating_mul(4).max(1_000)
    }

    /// One tick: when the refresh interval is over and this context holds the lease, ask the
    /// sidecar for the table (conditionally on the etag in shared data).
    pub fn on_tick(&mut self, host: &mut impl Host) {
        let now = host.now_ms();
        if !self.cadence.is_due(now) {
            return;
        }
        // A call that never came back (it has Envoy's timeout, but be safe): forget it.
        if self.call.is_some_and(|(_, at)| now.saturating_sub(at) < 10_000) {
            return;
        }
        if !election::hold(host, &ROUTES_POLLER, self.owner, now, self.lease_ms()) {
            return;
        }
        self.cadence.mark(now);
        let etag = host
            .shared_get(ROUTES_TABLE.as_str())
            .and_then(|b| serde_json::from_slice::<RouteTable>(&b).ok())
            .map(|t| t.etag)
            .unwrap_or_default();
        let if_none_match = format!("\"{etag}\"");
        let extra: &[(&str, &str)] = if etag.is_empty() { &[] } else { &[("if-none-match", &if_none_match)] };
        let timeout = self.sidecar.timeout.max(Duration::from_secs(1));
        match host.dispatch(self.sidecar.call("GET", ROUTES_PATH, extra, Vec::new(), timeout)) {
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
                    let (_, cas) = host.shared_get_cas(ROUTES_TABLE.as_str());
                    match host.shared_set_cas(ROUTES_TABLE.as_str(), body, cas) {
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
        self.outage.note(host, ok, "tollgate: routing table: the sidecar answers again", || format!("tollgate: routing table not refreshed for now: {why}"));
    }
}

/// The routing job of a worker's root context: the poller (which writes shared data's table when
/// this root context is the elected one) and the worker's own copy, re-read when the table moved.
pub struct RoutesJob {
    pub poller: RouteTablePoller,
    pub routes: Rc<RefCell<WorkerRoutes>>,
}

impl Job for RoutesJob {
    fn on_tick(&mut self, host: &mut impl Host) {
        self.poller.on_tick(host);
        self.routes.borrow_mut().refresh(host);
    }
    fn owns(&self, token: u32) -> bool {
        self.poller.owns(token)
    }
    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        self.poller.on_call_response(host, token, status, body);
        self.routes.borrow_mut().refresh(host);
    }
}
