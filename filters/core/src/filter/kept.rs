//! The bytes of response bodies a worker keeps (decision 142). A request keeps its response's
//! body while it streams when the body is to be stored (a cache fill, an idempotency outcome: up
//! to 1 MiB each) or read for token usage (up to 1 MiB). Each bound is per request; without one
//! per worker, many concurrent large responses grew the worker's Wasm memory without limit
//! until the VM failed, taking every request of that worker with it. Now a worker's requests
//! take their kept bytes from one budget (`maxKeptBodyBytes`, 64 MiB by default); a body that
//! would go past it is not kept — as a body over its own bound: the cache not filled, an
//! idempotency outcome stored without its body (its operation is not run again), token usage
//! not read (the reservation is the charge).

use std::cell::Cell;
use std::rc::Rc;

/// A worker's budget of kept body bytes: what is left of it.
#[derive(Debug, Clone)]
pub struct KeptBudget(Rc<Cell<usize>>);

impl KeptBudget {
    pub fn new(bytes: usize) -> KeptBudget {
        KeptBudget(Rc::new(Cell::new(bytes)))
    }

    /// Bytes no request keeps now.
    pub fn left(&self) -> usize {
        self.0.get()
    }
}

/// One request's kept bytes, taken from its worker's budget and given back when the body is
/// dropped, handed on, or the request's filter goes away (`Drop`). Without a budget (a filter
/// built without a worker), nothing is counted.
#[derive(Debug, Default)]
pub struct Kept {
    budget: Option<KeptBudget>,
    held: usize,
}

impl Kept {
    pub fn new(budget: Option<KeptBudget>) -> Kept {
        Kept { budget, held: 0 }
    }

    /// Takes `n` more bytes; `false`, taking nothing, when the worker has fewer left.
    pub fn take(&mut self, n: usize) -> bool {
        let Some(b) = &self.budget else { return true };
        let left = b.0.get();
        if left < n {
            return false;
        }
        b.0.set(left - n);
        self.held += n;
        true
    }

    /// Gives back `n` of the bytes this request holds (what it no longer keeps).
    pub fn give_back(&mut self, n: usize) {
        let n = n.min(self.held);
        if let Some(b) = &self.budget {
            b.0.set(b.0.get() + n);
        }
        self.held -= n;
    }

    /// Gives back everything this request holds.
    pub fn release(&mut self) {
        if let Some(b) = &self.budget {
            b.0.set(b.0.get() + self.held);
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
}
