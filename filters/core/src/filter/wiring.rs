//! How a worker wires an [`AuthFilter`] to the state it shares with its other requests (the
//! queues, caches and counters of crate::worker): one builder method each.

use super::kept::{Kept, KeptBudget};
use super::AuthFilter;
use crate::auth_cache::LocalAllows;
use crate::batch::DecisionBatcher;
use crate::changes::Generation;
use crate::ids::DecisionIds;
use crate::lease::renewer::RenewalQueue;
use crate::refunds::RefundQueue;
use crate::responses::claims::ClaimBook;
use crate::responses::queue::ResponseQueue;
use crate::routing::WorkerRoutes;
use crate::usage::Meter;
use std::cell::RefCell;
use std::rc::Rc;

impl AuthFilter {
    /// Lets this request's decision ride `batcher`'s batches under concurrency (crate::batch);
    /// `ctx` is the adapter's id of the request's context, to which its answer is delivered.
    pub fn with_batcher(mut self, batcher: Rc<RefCell<DecisionBatcher>>, ctx: u32) -> AuthFilter {
        self.worker.batcher = Some((batcher, ctx));
        self
    }

    /// Names every decision call with an id from `ids` (crate::ids).
    pub fn with_decision_ids(mut self, ids: Rc<RefCell<DecisionIds>>) -> AuthFilter {
        self.worker.decision_ids = Some(ids);
        self
    }

    /// Trusts cached answers and leases of generation `gen` and later (crate::changes).
    pub fn with_generation(mut self, gen: Generation) -> AuthFilter {
        self.worker.gen = gen;
        self
    }

    /// Reports decisions whose answer was abandoned to `queue`, for the sidecar to refund
    /// (crate::refunds; needs decision ids).
    pub fn with_refunds(mut self, queue: Rc<RefCell<RefundQueue>>) -> AuthFilter {
        self.worker.refunds = Some(queue);
        self
    }

    /// Keeps this worker's copy of auth cache entries in `allows` (see [`LocalAllows`]).
    pub fn with_local_allows(mut self, allows: Rc<RefCell<LocalAllows>>) -> AuthFilter {
        self.worker.local_allows = Some(allows);
        self
    }

    /// Keeps response bodies within the worker's `budget` (crate::filter::kept).
    pub fn with_kept_budget(mut self, budget: KeptBudget) -> AuthFilter {
        self.response.kept = Kept::new(Some(budget));
        self
    }

    /// Stores responses through `queue` (when the response cache or idempotency is on), and keeps
    /// idempotency claims in `claims` while their requests run (decision 186).
    pub fn with_responses(mut self, queue: Rc<RefCell<ResponseQueue>>, claims: Rc<RefCell<ClaimBook>>) -> AuthFilter {
        self.worker.responses = (self.config.response_cache.enabled || self.config.idempotency.enabled).then_some(queue);
        self.worker.claims = self.config.idempotency.enabled.then_some(claims);
        self
    }

    /// Routes requests by `routes` (when the configuration turns routing on).
    pub fn with_routes(mut self, routes: Rc<RefCell<WorkerRoutes>>) -> AuthFilter {
        self.worker.routes = self.config.routing.enabled.then_some(routes);
        self
    }

    /// Spends and renews leases of leased limits through `renewals` (when the configuration
    /// enables leases; crate::lease).
    pub fn with_leases(mut self, renewals: Rc<RefCell<RenewalQueue>>) -> AuthFilter {
        self.worker.leases = self.config.leases.enabled.then_some(renewals);
        self
    }

    /// Meters this request into `meter` (when the configuration enables usage metering).
    pub fn with_meter(mut self, meter: Rc<RefCell<Meter>>) -> AuthFilter {
        self.worker.meter = self.config.usage.enabled.then_some(meter);
        self
    }
}
