//! What decisions run by that the configuration plane replaces live (crate::control): the plans
//! and the routing, one value swapped whole (decision 208), the key cache's evictions, and the
//! change count the filters poll.

use super::limits::Plans;
use super::routing::{InForce, Routing};
use super::{tickets, Decider};
use crate::keys::Id;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Live reconfiguration (crate::control): swap the plans and the routing, evict cached key answers.
impl<S> Decider<S> {
    /// The plans and the routing in force now, read together.
    pub fn in_force(&self) -> Arc<InForce> {
        self.config.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The plans in force now.
    pub fn plans(&self) -> Arc<Plans> {
        self.in_force().plans.clone()
    }

    /// The key tickets are sealed and checked with.
    pub fn tickets(&self) -> &tickets::TicketKey {
        &self.tickets
    }

    /// Now, by the decider's clock (ms since the Unix epoch).
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The prices money budgets reserve and settle at, which the configuration plane swaps.
    pub fn price_table(&self) -> Option<&Arc<crate::usage::pricing::PriceTable>> {
        self.pricing.as_ref()
    }

    /// The routing in force now.
    pub fn routing(&self) -> Arc<Routing> {
        self.in_force().routing.clone()
    }

    /// Replaces the plans and the routing as one (decision 208): a decision reads either both
    /// old or both new, never a route of the new configuration with the old plans or the
    /// reverse (a route naming a plan removed with it would find no limits).
    pub fn set_config(&self, plans: Plans, routing: Routing) {
        *self.config.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(InForce { plans: Arc::new(plans), routing: Arc::new(routing) });
    }

    /// Replaces the routing, keeping the plans (tests; the configuration plane uses
    /// [`Decider::set_config`]).
    pub fn set_routing(&self, routing: Routing) {
        let mut config = self.config.write().unwrap_or_else(|p| p.into_inner());
        *config = Arc::new(InForce { plans: config.plans.clone(), routing: Arc::new(routing) });
    }

    /// Replaces the plans, keeping the routing (as [`Decider::set_routing`]).
    pub fn set_plans(&self, plans: Plans) {
        let mut config = self.config.write().unwrap_or_else(|p| p.into_inner());
        *config = Arc::new(InForce { plans: Arc::new(plans), routing: config.routing.clone() });
    }

    /// Forgets the cached answers for `tenant`'s keys, and every cached "no such key" (a key just
    /// issued must not stay unknown for a TTL). `None` forgets everything.
    ///
    /// Then counts the change: filters polling [`Decider::changes`] drop the answers and leases
    /// they got before it (the count moves only once this replica's cache no longer holds them).
    pub fn evict(&self, tenant: Option<&Id>) {
        self.cache.retain(|_, r| match (tenant, r) {
            (None, _) | (_, None) => false,
            (Some(t), Some(r)) => &r.tenant != t,
        });
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// The change count the filters poll (`GET /v1/changes`).
    pub fn changes(&self) -> tollgate_wire::changes::Changes {
        tollgate_wire::changes::Changes { epoch: self.epoch, version: self.changes.load(Ordering::Acquire) }
    }
}
