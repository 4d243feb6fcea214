//! The per-request side of the circuit breakers: admit or reject a request before it goes
//! upstream, route it to a fallback target while its own is open, and record its outcome.
//!
//! The guard runs after authentication allowed the request. It reads the routed cluster
//! (`xds.cluster_name`) to find the request's target; a cluster that is no target is not
//! guarded. Admission reads the target's shared state and writes only when the breaker is not
//! closed (half-open trial slots); with the worker's view ([`super::local`]) a target the worker
//! knows clean is not even read. No callout either way. While the target is open, the fallback targets are tried in order: the first
//! one that admits the request gets it, by the request header [`CLUSTER_HEADER`] that the Envoy
//! route `cluster_header` action follows (setting it clears the route cache). When none
//! admits it, the filter replies 503 with `Retry-After`.
//!
//! Outcomes are observed in the response headers: an upstream status in the failure set, or an
//! Envoy local reply (connect failure, reset, timeout: `response.code_details` other than
//! `via_upstream`) with a 5xx status, is a failure.
//!
//! A success of a request admitted on a closed breaker with no failure streak changes nothing
//! but the window's success count: the worker tallies it ([`WorkerBreakers`]) and adds it to the
//! shared state on its tick (or with its next failure on that target), so a healthy request costs
//! no shared-data write and workers do not contend on the target's CAS. Every other result is
//! written at once.

use super::config::{BreakerConfig, Target};
use super::local::{is_clean, WorkerBreakers};
use super::{update, Admission, Outcome, Transition};
use crate::host::{Action, Host, LogLevel};
use crate::shared_keys;
use std::cell::RefCell;
use std::rc::Rc;
use tollgate_wire::routes::RouteSpec;

/// Request header the filter sets to send a request to a fallback target's cluster; Envoy routes
/// on it (`route: {cluster_header: x-tollgate-cluster}`). Clients cannot set it: the filter strips
/// the `x-tollgate-*` namespace first.
pub const CLUSTER_HEADER: &str = "x-tollgate-cluster";
/// Response header naming the target that served the request.
pub const TARGET_HEADER: &str = "x-tollgate-target";
/// Response header on the filter's own 503 while every candidate target is open.
pub const BREAKER_HEADER: &str = "x-tollgate-breaker";
/// Error code of that 503.
pub const BREAKER_OPEN: &str = "upstream_unavailable";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GuardState {
    Idle,
    /// `clean`: admitted on a closed breaker with no failure streak; `trial`: the half-open
    /// period of a trial.
    Admitted { target: usize, trial: Option<u64>, clean: bool },
    Done,
}

/// One request's breaker guard.
pub struct BreakerGuard {
    config: Rc<BreakerConfig>,
    state: GuardState,
    worker: Option<Rc<RefCell<WorkerBreakers>>>,
    /// The request went to a fallback of its route's target.
    rerouted: bool,
}

/// Classifies a response: `status` from `:status`, `details` from `response.code_details`.
pub fn classify(config: &BreakerConfig, status: Option<u16>, details: Option<&str>) -> Outcome {
    let Some(status) = status else { return Outcome::Failure };
    let local_reply = details.is_some_and(|d| d != "via_upstream");
    if (local_reply && status >= 500) || (!local_reply && config.is_failure_status(status)) {
        Outcome::Failure
    } else {
        Outcome::Success
    }
}

/// Counts and logs a transition of `target` (transitions only, never per request).
pub fn report(host: &mut impl Host, target: &Target, transition: Transition, why: &str) {
    host.count_named(&target.stat(transition.name()));
    let level = match transition {
        Transition::Opened | Transition::OpenedByHint | Transition::Reopened => LogLevel::Warn,
        Transition::HalfOpened | Transition::Closed => LogLevel::Info,
    };
    host.log(level, &format!("tollgate: breaker {} {} ({why})", target.name, transition.name()));
}

impl BreakerGuard {
    /// A guard that writes every result to shared data at once.
    pub fn new(config: Rc<BreakerConfig>) -> BreakerGuard {
        BreakerGuard { config, state: GuardState::Idle, worker: None, rerouted: false }
    }

    /// Admission on a target the worker knows clean reads nothing, and clean successes are
    /// tallied by the worker ([`super::local`]).
    pub fn with_worker(mut self, worker: Rc<RefCell<WorkerBreakers>>) -> BreakerGuard {
        self.worker = Some(worker);
        self
    }

    /// Call when the request may go upstream as far as authentication is concerned. Returns
    /// `Pause` when the guard replied itself (every candidate open).
    pub fn on_request(&mut self, host: &mut impl Host) -> Action {
        self.on_request_routed(host, None)
    }

    /// [`Self::on_request`] for a request the filter routed: the route's `breaker` target, else
    /// the target of the route's cluster (Envoy's routed cluster is not re-read: the filter has
    /// just steered the request).
    pub fn on_request_routed(&mut self, host: &mut impl Host, route: Option<&RouteSpec>) -> Action {
        if self.state != GuardState::Idle {
            return Action::Continue;
        }
        self.state = GuardState::Done;
        let b = &self.config;
        if b.targets.is_empty() {
            return Action::Continue;
        }
        let primary = match route {
            // a name no target has (a typo, a target since removed from the plugin's
            // configuration) falls back to the cluster's target: before, the route went
            // unguarded, silently (decision 203)
            Some(r) => r
                .breaker
                .as_ref()
                .and_then(|name| b.targets.iter().position(|t| &t.name == name))
                .or_else(|| b.targets.iter().position(|t| t.cluster == r.cluster)),
            None => {
                let Some(cluster) = host.property(&["xds", "cluster_name"]).and_then(|v| String::from_utf8(v).ok()) else {
                    return Action::Continue;
                };
                b.targets.iter().position(|t| t.cluster == cluster)
            }
        };
        let Some(primary) = primary else {
            return Action::Continue;
        };
        let now = host.now_ms();
        let mut retry_after_ms = None;
        let candidates = std::iter::once(primary).chain(b.targets.get(primary).map(|t| t.fallback.clone()).unwrap_or_default());
        for idx in candidates {
            let Some(target) = b.targets.get(idx) else { continue };
            if self.worker.as_ref().is_some_and(|w| w.borrow_mut().admit_locally(idx)) {
                self.admitted(host, idx, primary, None, true);
                return Action::Continue;
            }
            let result = update(host, &shared_keys::breaker(&target.name), |s| {
                let clean = is_clean(s);
                let (admission, changed, transition) = s.admit(&b.policy, now);
                let trial = (admission == Admission::Trial).then(|| s.trial_period()).flatten();
                ((admission, transition, clean, trial), changed)
            });
            if let (Some(w), Ok((_, _, clean, _))) = (&self.worker, &result) {
                w.borrow_mut().saw(idx, *clean);
            }
            let (admission, clean, trial) = match result {
                Ok((admission, transition, clean, trial)) => {
                    if let Some(t) = transition {
                        report(host, target, t, "open time over: letting trials through");
                    }
                    (admission, clean, trial)
                }
                Err(e) => {
                    // Only a breaker that is not closed writes on admission; under that much
                    // contention, keep the trial bound rather than the request.
                    host.log(LogLevel::Debug, &format!("tollgate: breaker {}: admission not recorded: {e:?}", target.name));
                    (Admission::Reject { retry_after_ms: 1_000 }, false, None)
                }
            };
            match admission {
                Admission::Pass | Admission::Trial => {
                    self.admitted(host, idx, primary, trial, clean);
                    return Action::Continue;
                }
                Admission::Reject { retry_after_ms: r } => {
                    retry_after_ms.get_or_insert(r);
                }
            }
        }
        let Some(target) = b.targets.get(primary) else { return Action::Continue };
        host.count_named(&target.stat("rejected"));
        let retry_after = retry_after_ms.unwrap_or(1_000).div_ceil(1_000).max(1).to_string();
        let message = format!("upstream '{}' is failing; retry later", target.name);
        let extra = [("retry-after", retry_after.as_str()), (BREAKER_HEADER, "open")];
        crate::reply::json_error(host, 503, BREAKER_OPEN, &message, None, &extra);
        Action::Pause
    }

    /// The request goes to target `idx` (a fallback of `primary` if they differ); `trial`: the
    /// half-open period it is a trial of.
    fn admitted(&mut self, host: &mut impl Host, idx: usize, primary: usize, trial: Option<u64>, clean: bool) {
        let b = &self.config;
        self.rerouted = idx != primary;
        if idx != primary {
            if let Some(target) = b.targets.get(idx) {
                host.set_request_header(CLUSTER_HEADER, &target.cluster);
            }
            if let Some(p) = b.targets.get(primary) {
                host.count_named(&p.stat("fallback"));
            }
        }
        self.state = GuardState::Admitted { target: idx, trial, clean };
    }

    /// Whether the request was sent to a fallback of its route's target (its answer is not the
    /// route's: never cached under it, decision 192).
    pub fn rerouted(&self) -> bool {
        self.rerouted
    }

    /// Records the outcome of an admitted request and names the target that served it.
    pub fn on_response(&mut self, host: &mut impl Host) -> Action {
        let GuardState::Admitted { target: idx, trial, clean } = self.state else { return Action::Continue };
        self.state = GuardState::Done;
        let b = &self.config;
        let Some(target) = b.targets.get(idx) else { return Action::Continue };
        let status = host.response_header(":status").and_then(|s| s.parse::<u16>().ok());
        // Where the response came from only matters for a 5xx or a failure status: read it (an
        // Envoy attribute, a costly host call) only then; `classify` needs no more.
        let details = match status {
            Some(s) if s < 500 && !b.is_failure_status(s) => None,
            _ => host.property(&["response", "code_details"]).and_then(|v| String::from_utf8(v).ok()),
        };
        let outcome = classify(b, status, details.as_deref());
        host.add_response_header(TARGET_HEADER, &target.name);
        if let (Some(w), Outcome::Success, true) = (&self.worker, outcome, clean && trial.is_none()) {
            w.borrow_mut().add_success(idx);
            return Action::Continue;
        }
        // this worker's tallied successes go with its failure: the ratio sees them
        let tallied = self.worker.as_ref().map_or(0, |w| w.borrow_mut().take(idx));
        let now = host.now_ms();
        let result = update(host, &shared_keys::breaker(&target.name), |s| {
            let added = s.add_successes(&b.policy, now, tallied);
            let (changed, transition) = s.record(&b.policy, now, trial, outcome);
            ((transition, is_clean(s)), changed || added)
        });
        if let Some(w) = &self.worker {
            w.borrow_mut().saw(idx, result.as_ref().is_ok_and(|(_, clean)| *clean));
        }
        match result.map(|(t, _)| t) {
            Ok(Some(t)) => {
                let why = format!(
                    "status {}{}",
                    status.map_or("none".to_string(), |s| s.to_string()),
                    details.as_deref().map(|d| format!(", {d}")).unwrap_or_default()
                );
                report(host, target, t, &why);
            }
            Ok(None) => {}
            Err(e) => {
                host.log(LogLevel::Debug, &format!("tollgate: breaker {}: result not recorded: {e:?}", target.name));
                if let Some(w) = &self.worker {
                    w.borrow_mut().give_back(idx, tallied);
                }
            }
        }
        Action::Continue
    }

    /// The request ended. A trial that never saw response headers gives its slot back.
    pub fn on_done(&mut self, host: &mut impl Host) {
        let GuardState::Admitted { target: idx, trial, .. } = self.state else { return };
        self.state = GuardState::Done;
        let Some(period) = trial else { return };
        if let Some(target) = self.config.targets.get(idx) {
            let _ = update(host, &shared_keys::breaker(&target.name), |s| ((), s.release_trial(period)));
        }
    }
}
