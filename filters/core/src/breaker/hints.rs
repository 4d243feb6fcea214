//! The hint poller: one root context per Envoy reports local OPEN transitions to the sidecar and
//! applies other replicas' hints to the shared breaker states.
//!
//! `on_tick` fires in every root context (every worker's VM and the main thread's), so each tick
//! first tries to hold the election in shared data (crate::election,
//! [`crate::shared_keys::HINTS_POLLER`]); only the holder works. The holder (1) sends each target's pending local OPEN (the
//! state's `publish` stamp, set by the request path) as a fire-and-forget
//! `POST /v1/breaker/hints`, and (2) asks `GET /v1/breaker/hints` for the other replicas' live
//! hints and applies each to the matching targets ([`super::State::apply_hint`]:
//! closed → open only). The request path never calls out for breakers; it only reads shared data.
//!
//! Why the request path does not post the hint itself: a call dispatched from an HTTP context is
//! cancelled when that stream ends, which is right after the response that tripped the breaker.

use super::config::BreakerConfig;
use super::guard::report;
use super::local::WorkerBreakers;
use super::{read, update, HintEffect, Transition};
use crate::host::{CallSpec, Host, LogLevel};
use crate::jobs::{Job, Outage};
use crate::sidecar::Sidecar;
use crate::{election, shared_keys};
use std::cell::RefCell;
use std::rc::Rc;
use tollgate_wire::breaker::{HintList, HintReport, HINTS_PATH};

/// The poller of one root context.
pub struct HintPoller {
    config: Rc<BreakerConfig>,
    sidecar: Sidecar,
    /// This VM's identity in the lease (random per VM, non-zero).
    owner: u64,
    list_call: Option<(u32, u64)>,
    /// This worker's view of its breakers: a target a hint opens is no longer known clean.
    worker: Option<Rc<RefCell<WorkerBreakers>>>,
    posts: Vec<u32>,
    outage: Outage,
}

impl HintPoller {
    pub fn new(config: Rc<BreakerConfig>, sidecar: Sidecar, owner: u64) -> HintPoller {
        HintPoller { config, sidecar, owner: owner.max(1), list_call: None, worker: None, posts: Vec::new(), outage: Outage::default() }
    }

    /// A target a hint opens is forgotten by this worker's view at once (other workers of the
    /// Envoy see it at their next tick).
    pub fn with_worker(mut self, worker: Rc<RefCell<WorkerBreakers>>) -> HintPoller {
        self.worker = Some(worker);
        self
    }

    /// How long a lease lasts without renewal: a few poll intervals, so a stalled holder is
    /// replaced quickly but a busy one is not.
    fn lease_ms(&self) -> u64 {
        (self.config.hints.poll_interval.as_millis() as u64).saturating_mul(4).max(1_000)
    }

    /// Takes or renews the lease; true when this context holds it now.
    pub fn hold_lease(&self, host: &mut impl Host, now_ms: u64) -> bool {
        election::hold(host, &shared_keys::HINTS_POLLER, self.owner, now_ms, self.lease_ms())
    }

    fn call(&self, method: &str, body: Vec<u8>) -> CallSpec {
        let json: &[(&str, &str)] = if body.is_empty() { &[] } else { &[("content-type", "application/json")] };
        self.sidecar.call(method, HINTS_PATH, json, body, self.config.hints.timeout)
    }

    fn sidecar_state(&mut self, host: &mut impl Host, ok: bool, why: &str) {
        self.outage.note(host, ok, "tollgate: breaker hints: the sidecar answers again", || format!("tollgate: breaker hints not shared for now: {why}"));
    }

    /// Applies listed hints to the matching targets.
    pub fn apply(&self, host: &mut impl Host, list: &HintList) {
        let b = &self.config;
        let now = host.now_ms();
        for hint in &list.hints {
            let fp = super::hint_fingerprint(&hint.replica, hint.opened_at_ms);
            for (idx, target) in b.targets.iter().enumerate() {
                if target.hint.as_ref() != Some(&(hint.provider.clone(), hint.model.clone())) {
                    continue;
                }
                let key = shared_keys::breaker(&target.name);
                match update(host, &key, |s| s.apply_hint(&b.policy, now, fp)) {
                    Ok(HintEffect::Opened) => {
                        if let Some(w) = &self.worker {
                            w.borrow_mut().saw(idx, false);
                        }
                        report(host, target, Transition::OpenedByHint, &format!("hint from replica {}", hint.replica))
                    }
                    Ok(HintEffect::Ignored) => host.count_named(&target.stat("hint_ignored")),
                    Ok(HintEffect::Known) => {}
                    Err(e) => host.log(LogLevel::Debug, &format!("tollgate: breaker {}: hint not applied: {e:?}", target.name)),
                }
            }
        }
    }
}

/// Runs every `breakers.hints.pollInterval` (crate::jobs::Every).
impl Job for HintPoller {
    /// One tick: if this context holds the lease, report pending opens and ask for hints.
    fn on_tick(&mut self, host: &mut impl Host) {
        if !self.config.shares_hints() {
            return;
        }
        let now = host.now_ms();
        if !self.hold_lease(host, now) {
            return;
        }
        let config = self.config.clone();
        for target in config.targets.iter() {
            let Some((provider, model)) = &target.hint else { continue };
            let key = shared_keys::breaker(&target.name);
            let pending = read(host, &key).publish;
            if pending == 0 {
                continue;
            }
            let report = HintReport { provider: provider.clone(), model: model.clone(), opened_at_ms: pending };
            let Ok(body) = serde_json::to_vec(&report) else { continue };
            match host.dispatch(self.call("POST", body)) {
                Ok(token) => self.posts.push(token),
                Err(e) => self.sidecar_state(host, false, &format!("cannot call the sidecar: {e}")),
            }
            // Sent or not, a report is attempted once: hints are advisory.
            let _ = update(host, &key, |s| {
                let clear = s.publish == pending;
                if clear {
                    s.publish = 0;
                }
                ((), clear)
            });
        }
        let stale = self.list_call.is_some_and(|(_, at)| now.saturating_sub(at) > 10_000);
        if self.list_call.is_none() || stale {
            match host.dispatch(self.call("GET", Vec::new())) {
                Ok(token) => self.list_call = Some((token, now)),
                Err(e) => self.sidecar_state(host, false, &format!("cannot call the sidecar: {e}")),
            }
        }
    }

    /// Whether `token` is one of this poller's calls.
    fn owns(&self, token: u32) -> bool {
        self.posts.contains(&token) || self.list_call.is_some_and(|(t, _)| t == token)
    }

    /// A call response arrived at the root context.
    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        if let Some(i) = self.posts.iter().position(|t| *t == token) {
            self.posts.swap_remove(i);
            let ok = matches!(status, Some(200..=299));
            self.sidecar_state(host, ok, &format!("hint report answered {status:?}"));
            return;
        }
        if self.list_call.map(|(t, _)| t) != Some(token) {
            host.log(LogLevel::Debug, "tollgate: breaker hints: ignoring a response with an unexpected token");
            return;
        }
        self.list_call = None;
        let list: HintList = match (status, serde_json::from_slice::<HintList>(body)) {
            (Some(200), Ok(l)) => l,
            (s, _) => {
                self.sidecar_state(host, false, &format!("hint list answered {s:?}"));
                return;
            }
        };
        self.sidecar_state(host, true, "");
        self.apply(host, &list);
    }
}

