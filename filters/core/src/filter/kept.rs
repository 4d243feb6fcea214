//! The bytes of response bodies a worker keeps (decision 142). A request keeps its response's
//! body while it streams when the body is to be stored (a cache fill, an idempotency outcome: up
//! to 1 MiB each) or read for token usage (up to 1 MiB). Each bound is per request; without one
//! per worker, many concurrent large responses grew the worker's Wasm memory without limit
//! until the VM failed, taking every request of that worker with it. Now a worker's requests
//! take their kept bytes from one budget (`maxKeptBodyBytes`, 64 MiB by default); a body that
//! would go past it is not kept — as a body over its own bound: the cache not filled, an
//! idempotency outcome stored without its body (its operation is not run again), token usage
//! not read (the reservation is the charge).

//!
//! A tenant takes at most a quarter of the budget (decision 195): one tenant's slow readers of
//! large responses could hold the whole budget, and every other tenant's bodies went unkept —
//! their idempotent outcomes replayed without bodies, their cache fills skipped, their token
//! usage unread.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// A worker's budget of kept body bytes: what is left of it, and what each tenant holds.
#[derive(Debug, Clone)]
pub struct KeptBudget(Rc<Shared>);

#[derive(Debug)]
struct Shared {
    left: Cell<usize>,
    /// Bytes one tenant may hold at once: a quarter of the budget.
    share: usize,
    /// Bytes held per tenant (only tenants holding some).
    held: RefCell<HashMap<Rc<str>, usize>>,
}

impl KeptBudget {
    pub fn new(bytes: usize) -> KeptBudget {
        KeptBudget(Rc::new(Shared { left: Cell::new(bytes), share: bytes / 4, held: RefCell::default() }))
    }

    /// Bytes no request keeps now.
    pub fn left(&self) -> usize {
        self.0.left.get()
    }

    /// Bytes `tenant`'s requests keep now.
    pub fn held_by(&self, tenant: &str) -> usize {
        self.0.held.borrow().get(tenant).copied().unwrap_or(0)
    }

    fn give(&self, tenant: Option<&Rc<str>>, n: usize) {
        self.0.left.set(self.0.left.get() + n);
        if let Some(t) = tenant {
            let mut held = self.0.held.borrow_mut();
            if let Some(h) = held.get_mut(t) {
                *h = h.saturating_sub(n);
                if *h == 0 {
                    held.remove(t);
                }
            }
        }
    }
}

/// One request's kept bytes, taken from its worker's budget and given back when the body is
/// dropped, handed on, or the request's filter goes away (`Drop`). Without a budget (a filter
/// built without a worker), nothing is counted.
#[derive(Debug, Default)]
pub struct Kept {
    budget: Option<KeptBudget>,
    held: usize,
    /// The tenant the request was let through as: its share bounds what it keeps.
    tenant: Option<Rc<str>>,
}

impl Kept {
    pub fn new(budget: Option<KeptBudget>) -> Kept {
        Kept { budget, held: 0, tenant: None }
    }

    /// The request was let through as `tenant` (before any body is kept): what it keeps counts
    /// against that tenant's share.
    pub fn for_tenant(&mut self, tenant: &str) {
        if self.held == 0 {
            self.tenant = Some(Rc::from(tenant));
        }
    }

    /// Takes `n` more bytes; `false`, taking nothing, when the worker has fewer left or the
    /// request's tenant would hold more than its share.
    pub fn take(&mut self, n: usize) -> bool {
        let Some(b) = &self.budget else { return true };
        let left = b.0.left.get();
        if left < n {
            return false;
        }
        if let Some(t) = &self.tenant {
            let mut held = b.0.held.borrow_mut();
            let h = held.entry(t.clone()).or_insert(0);
            if *h + n > b.0.share {
                if *h == 0 {
                    held.remove(t);
                }
                return false;
            }
            *h += n;
        }
        b.0.left.set(left - n);
        self.held += n;
        true
    }

    /// Gives back `n` of the bytes this request holds (what it no longer keeps).
    pub fn give_back(&mut self, n: usize) {
        let n = n.min(self.held);
        if let Some(b) = &self.budget {
            b.give(self.tenant.as_ref(), n);
        }
        self.held -= n;
    }

    /// Gives back everything this request holds.
    pub fn release(&mut self) {
        if let Some(b) = &self.budget {
            b.give(self.tenant.as_ref(), self.held);
        }
        self.held = 0;
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_share_the_budget_and_give_it_back() {
        let budget = KeptBudget::new(100);
        let mut a = Kept::new(Some(budget.clone()));
        let mut b = Kept::new(Some(budget.clone()));
        assert!(a.take(60));
        assert!(!b.take(50), "only 40 left");
        assert!(b.take(40));
        assert_eq!(budget.left(), 0);
        a.release();
        assert_eq!(budget.left(), 60);
        drop(b);
        assert_eq!(budget.left(), 100, "a request's filter gone gives its bytes back");
        let mut free = Kept::new(None);
        assert!(free.take(usize::MAX), "no budget, no bound");
    }

    /// Decision 195: one tenant keeps at most a quarter of the worker's budget, so another's
    /// bodies are still kept; what it gives back is its own again.
    #[test]
    fn a_tenant_keeps_a_quarter_of_the_budget_at_most() {
        let budget = KeptBudget::new(400);
        let of = |tenant: &str| {
            let mut k = Kept::new(Some(budget.clone()));
            k.for_tenant(tenant);
            k
        };
        let (mut evil_a, mut evil_b, mut acme) = (of("evil"), of("evil"), of("acme"));
        assert!(evil_a.take(60));
        assert!(evil_b.take(40));
        assert!(!evil_b.take(1), "evil holds its share (100 of 400)");
        assert!(acme.take(100), "another tenant's body is kept");
        assert_eq!((budget.held_by("evil"), budget.held_by("acme"), budget.left()), (100, 100, 200));
        evil_a.give_back(10);
        assert!(evil_b.take(10), "given back, its own again");
        drop(evil_a);
        drop(evil_b);
        assert_eq!((budget.held_by("evil"), budget.left()), (0, 300));
        acme.release();
        assert_eq!(budget.left(), 400);
    }
}
