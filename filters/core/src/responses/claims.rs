//! Idempotency claims a worker keeps while their requests run (decision 186).
//!
//! A claim lives its in-flight TTL from its decision (5 min by default): a request that outlives
//! it lost it, so a retry ran the operation a second time beside the first, and the first's
//! outcome was refused (its ticket expired with the claim). Now each request holding a claim
//! opens it in its worker's [`ClaimBook`]; the root context's tick ([`ClaimKeeper`]) asks the
//! sidecar (`POST /v1/responses/claims`) to keep the claims a third of whose life has passed, and
//! the sidecar answers each ticket sealed again for another TTL, or `null` when the claim is no
//! longer the request's (then the worker stops asking). The request takes its freshest ticket
//! back when its outcome is stored ([`ClaimBook::close`]). If the Envoy dies, nobody asks any
//! more and the claim ends one TTL later, as before.
//!
//! Bounded: at most [`MAX_OPEN_CLAIMS`] claims per worker, a quarter of them per tenant (a claim
//! past that is not kept: it lives its TTL, as before, counted
//! `tollgate.idempotency.claims_not_kept`), [`MAX_CLAIM_BATCH`] per call, one call out at a time.
//!
//! Clocks: a claim is asked for again a third of the in-flight TTL the sidecar last gave after
//! its answer, by the worker's own clock; only a claim not yet kept is scheduled from its ticket's
//! expiry (the sidecar's clock, beside the Envoy's), and never sooner than a second apart.

use crate::host::{Host, LogLevel};
use crate::jobs::{Job, Outage};
use crate::sidecar::Sidecar;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;
use tollgate_wire::responses::{ClaimRenewal, ClaimsKept, StoreTicket, CLAIMS_PATH, MAX_CLAIM_BATCH};

/// Claims a worker keeps at most.
pub const MAX_OPEN_CLAIMS: usize = 10_000;
/// Claims of one tenant a worker keeps at most: one tenant's slow requests do not leave the
/// others' claims unkept.
pub const MAX_TENANT_CLAIMS: usize = MAX_OPEN_CLAIMS / 4;
/// How long a call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// After a failed call, when its claims are asked for again.
const RETRY_MS: u64 = 1_000;

#[derive(Debug, Clone)]
struct Claim {
    ticket: StoreTicket,
    tenant: String,
    /// When to ask for it to be kept (host ms); `u64::MAX`: never (not kept any more).
    due_ms: u64,
}

/// When a claim whose ticket lives `left_ms` more is next asked for, at `now_ms`: once a third
/// of that is gone (the two thirds left give the asks room to fail and be tried again), never
/// sooner than [`RETRY_MS`].
fn due(now_ms: u64, left_ms: u64) -> u64 {
    now_ms + (left_ms / 3).max(RETRY_MS)
}

/// A worker's open claims (see the module docs).
#[derive(Debug)]
pub struct ClaimBook {
    next: u64,
    open: BTreeMap<u64, Claim>,
    /// Open claims per tenant.
    tenants: std::collections::HashMap<String, usize>,
    /// No claim is due before this (host ms): a tick before it looks at none.
    next_due_ms: u64,
}

impl Default for ClaimBook {
    fn default() -> Self {
        ClaimBook { next: 0, open: BTreeMap::new(), tenants: Default::default(), next_due_ms: u64::MAX }
    }
}

impl ClaimBook {
    /// Opens the claim of `ticket` (an idempotency ticket) at `now_ms`: its id, or `None` when
    /// the book or its tenant's share is full (the claim then lives its TTL) or the ticket is
    /// not an idempotency one.
    pub fn open(&mut self, ticket: &StoreTicket, now_ms: u64) -> Option<u64> {
        let StoreTicket::Idempotency { tenant, .. } = ticket else { return None };
        let held = self.tenants.get(tenant).copied().unwrap_or(0);
        if self.open.len() >= MAX_OPEN_CLAIMS || held >= MAX_TENANT_CLAIMS {
            return None;
        }
        self.tenants.insert(tenant.clone(), held + 1);
        self.next += 1;
        // not kept yet: its life as its ticket says (the sidecar's clock, beside this one)
        let due_ms = due(now_ms, ticket.seal().expires_at_ms.saturating_sub(now_ms));
        self.next_due_ms = self.next_due_ms.min(due_ms);
        self.open.insert(self.next, Claim { ticket: ticket.clone(), tenant: tenant.clone(), due_ms });
        Some(self.next)
    }

    /// Closes claim `id`: its freshest ticket (sealed again by every keep).
    pub fn close(&mut self, id: u64) -> Option<StoreTicket> {
        let c = self.open.remove(&id)?;
        if let Some(n) = self.tenants.get_mut(&c.tenant) {
            *n -= 1;
            if *n == 0 {
                self.tenants.remove(&c.tenant);
            }
        }
        Some(c.ticket)
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// The claims due at `now_ms` (at most a batch): their ids and the body of the call. When
    /// none is (the earliest closed meanwhile), the next due time is found again: one scan, not
    /// one a tick.
    fn due_batch(&mut self, now_ms: u64) -> Option<(Vec<u64>, Vec<u8>)> {
        if now_ms < self.next_due_ms {
            return None;
        }
        let due: Vec<(u64, &Claim)> = self.open.iter().filter(|(_, c)| c.due_ms <= now_ms).take(MAX_CLAIM_BATCH).map(|(id, c)| (*id, c)).collect();
        if due.is_empty() {
            self.next_due_ms = self.open.values().map(|c| c.due_ms).min().unwrap_or(u64::MAX);
            return None;
        }
        let batch = ClaimRenewal { claims: due.iter().map(|(_, c)| c.ticket.clone()).collect() };
        let body = serde_json::to_vec(&batch).ok()?;
        Some((due.into_iter().map(|(id, _)| id).collect(), body))
    }

    /// Applies the answer to the claims `ids` at `now_ms`: `Some` the sidecar's answer, `None`
    /// the call failed (asked again in [`RETRY_MS`], while its tickets live).
    fn settle(&mut self, ids: &[u64], answer: Option<ClaimsKept>, now_ms: u64) {
        match answer {
            Some(kept) if kept.claims.len() == ids.len() => {
                for (id, t) in ids.iter().zip(kept.claims) {
                    let Some(c) = self.open.get_mut(id) else { continue }; // closed meanwhile
                    match t {
                        // kept: it lives the sidecar's in-flight TTL from now, by this clock
                        Some(t) if kept.in_flight_ms > 0 && t.seal().expires_at_ms != c.ticket.seal().expires_at_ms => {
                            c.due_ms = due(now_ms, kept.in_flight_ms);
                            c.ticket = t;
                        }
                        // not kept now (Redis could not say), or an older sidecar's answer
                        Some(t) => {
                            c.due_ms = due(now_ms, t.seal().expires_at_ms.saturating_sub(now_ms));
                            c.ticket = t;
                        }
                        None => c.due_ms = u64::MAX,
                    }
                }
            }
            _ => {
                for id in ids {
                    if let Some(c) = self.open.get_mut(id) {
                        c.due_ms = now_ms + RETRY_MS;
                    }
                }
            }
        }
        self.next_due_ms = self.open.values().map(|c| c.due_ms).min().unwrap_or(u64::MAX);
    }
}

/// A request's open claim in its worker's book: closed when dropped — the request is over,
/// whatever its end (an outcome stored, the stream reset: then the claim lives one TTL more and
/// ends, as decision 166 wants of an outcome not known).
#[derive(Debug)]
pub struct OpenClaim {
    book: Rc<RefCell<ClaimBook>>,
    id: u64,
}

impl OpenClaim {
    /// Opens the claim of `ticket` in `book` at `now_ms` (`None`: not kept, see [`ClaimBook::open`]).
    pub fn open(book: &Rc<RefCell<ClaimBook>>, ticket: &StoreTicket, now_ms: u64) -> Option<OpenClaim> {
        let id = book.borrow_mut().open(ticket, now_ms)?;
        Some(OpenClaim { book: book.clone(), id })
    }

    /// Its freshest ticket (sealed again by every keep).
    pub fn ticket(&self) -> Option<StoreTicket> {
        self.book.borrow().open.get(&self.id).map(|c| c.ticket.clone())
    }
}

impl Drop for OpenClaim {
    fn drop(&mut self) {
        self.book.borrow_mut().close(self.id);
    }
}

/// Asks the sidecar to keep the worker's due claims, from every tick of the root context (a tick
/// with none due costs a comparison).
pub struct ClaimKeeper {
    book: Rc<RefCell<ClaimBook>>,
    sidecar: Sidecar,
    /// The call out: its token and the claims it carries.
    out: Option<(u32, Vec<u64>)>,
    outage: Outage,
}

impl ClaimKeeper {
    pub fn new(book: Rc<RefCell<ClaimBook>>, sidecar: Sidecar) -> ClaimKeeper {
        ClaimKeeper { book, sidecar, out: None, outage: Outage::default() }
    }
}

impl Job for ClaimKeeper {
    fn on_tick(&mut self, host: &mut impl Host) {
        if self.out.is_some() {
            return;
        }
        let now = host.now_ms();
        let Some((ids, body)) = self.book.borrow_mut().due_batch(now) else { return };
        match host.dispatch(self.sidecar.post_json(CLAIMS_PATH, body, CALL_TIMEOUT)) {
            Ok(token) => self.out = Some((token, ids)),
            Err(e) => {
                host.log(LogLevel::Debug, &format!("tollgate: cannot ask to keep idempotency claims: {e}"));
                self.book.borrow_mut().settle(&ids, None, now);
            }
        }
    }

    fn owns(&self, token: u32) -> bool {
        self.out.as_ref().is_some_and(|(t, _)| *t == token)
    }

    fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) {
        let Some((_, ids)) = self.out.take_if(|(t, _)| *t == token) else { return };
        let answer = (status == Some(200)).then(|| serde_json::from_slice::<ClaimsKept>(body).ok()).flatten();
        let ok = answer.is_some();
        self.outage.note(host, ok, "tollgate: idempotency claims are kept again", || {
            format!("tollgate: idempotency claims of running requests could not be kept (status {status:?}): asked again")
        });
        self.book.borrow_mut().settle(&ids, answer, host.now_ms());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use tollgate_wire::responses::Seal;

    fn ticket(expires_at_ms: u64, token: &str) -> StoreTicket {
        StoreTicket::Idempotency {
            tenant: "acme".into(),
            key_id: "key_1".into(),
            digest: "0a".repeat(16),
            key: "k".into(),
            token: token.into(),
            seal: Seal { id: "d".into(), expires_at_ms, mac: "m".into() },
        }
    }

    #[test]
    fn a_claim_is_asked_for_once_a_third_of_its_life_is_gone_and_closes_with_its_freshest_ticket() {
        let mut book = ClaimBook::default();
        let a = book.open(&ticket(300_000, "a"), 0).unwrap();
        let b = book.open(&ticket(330_000, "b"), 30_000).unwrap();
        assert!(book.due_batch(99_999).is_none());
        let (ids, body) = book.due_batch(100_000).unwrap();
        assert_eq!(ids, [a]);
        let sent: ClaimRenewal = serde_json::from_slice(&body).unwrap();
        assert_eq!(sent.claims, [ticket(300_000, "a")]);
        // kept: sealed again until 400,000 (seen at 100,000): due again at 200,000
        book.settle(&ids, Some(ClaimsKept { claims: vec![Some(ticket(400_000, "a"))], in_flight_ms: 300_000 }), 100_000);
        assert_eq!(book.due_batch(130_000).map(|(ids, _)| ids), Some(vec![b]));
        assert_eq!(book.due_batch(200_000).map(|(ids, _)| ids), Some(vec![a, b]));
        // not kept any more: never asked again; a failed call: asked again a second later
        book.settle(&[a, b], Some(ClaimsKept { claims: vec![None, Some(ticket(500_000, "b"))], in_flight_ms: 300_000 }), 200_000);
        assert!(book.due_batch(299_999).is_none());
        assert_eq!(book.due_batch(300_000).map(|(ids, _)| ids), Some(vec![b]));
        book.settle(&[b], None, 300_000);
        assert!(book.due_batch(300_999).is_none());
        assert!(book.due_batch(301_000).is_some());
        // an answer of the wrong length is a failed call
        book.settle(&[b], Some(ClaimsKept { claims: vec![], in_flight_ms: 300_000 }), 301_000);
        assert!(book.due_batch(302_000).is_some());
        assert_eq!(book.close(a), Some(ticket(400_000, "a")), "the freshest ticket");
        assert_eq!(book.close(b), Some(ticket(500_000, "b")));
        assert!(book.is_empty() && book.close(a).is_none());
    }

    fn ticket_of(tenant: &str) -> StoreTicket {
        let mut t = ticket(1_000, "t");
        if let StoreTicket::Idempotency { tenant: x, .. } = &mut t {
            *x = tenant.into();
        }
        t
    }

    #[test]
    fn the_book_is_bounded_a_tenant_to_its_share_and_holds_idempotency_claims_only() {
        let mut book = ClaimBook::default();
        let first: Vec<u64> = (0..MAX_TENANT_CLAIMS).map(|_| book.open(&ticket_of("acme"), 0).unwrap()).collect();
        assert!(book.open(&ticket_of("acme"), 0).is_none(), "acme's share is full");
        assert!(book.open(&ticket_of("beta"), 0).is_some(), "beta's claims are still kept");
        book.close(first[0]);
        assert!(book.open(&ticket_of("acme"), 0).is_some(), "a closed claim frees its tenant's place");
        for i in 0..MAX_OPEN_CLAIMS {
            if book.len() == MAX_OPEN_CLAIMS {
                break;
            }
            book.open(&ticket_of(&format!("t{}", i / MAX_TENANT_CLAIMS)), 0).unwrap();
        }
        assert!(book.open(&ticket_of("zeta"), 0).is_none(), "the book is full");
        let cache = StoreTicket::Cache { tenant: "a".into(), plan: "p".into(), route: "r".into(), hash: "h".into(), seal: Seal::default() };
        assert!(ClaimBook::default().open(&cache, 0).is_none());
        assert_eq!(book.due_batch(1_000).unwrap().0.len(), MAX_CLAIM_BATCH, "a batch at most");
    }

    #[test]
    fn a_kept_claim_is_scheduled_by_this_clock_and_the_next_due_time_follows_closed_claims() {
        // this clock ahead of the sidecar's: the resealed ticket looks expired here, yet it is
        // asked for a third of the in-flight TTL later, not at every tick
        let mut book = ClaimBook::default();
        let a = book.open(&ticket(30_000, "a"), 0).unwrap();
        book.settle(&[a], Some(ClaimsKept { claims: vec![Some(ticket(39_000, "a"))], in_flight_ms: 30_000 }), 50_000);
        assert!(book.due_batch(50_001).is_none() && book.due_batch(59_999).is_none());
        assert!(book.due_batch(60_000).is_some());
        // the earliest claim closes: the next due time is found again
        let mut book = ClaimBook::default();
        let (a, b) = (book.open(&ticket(300, "a"), 0).unwrap(), book.open(&ticket(7_500, "b"), 0).unwrap());
        book.close(a);
        assert!(book.due_batch(1_500).is_none());
        assert_eq!(book.next_due_ms, 2_500, "b's");
        assert_eq!(book.due_batch(2_500).map(|(ids, _)| ids), Some(vec![b]));
    }

    #[test]
    fn an_open_claim_closes_when_its_request_is_dropped() {
        let book: Rc<RefCell<ClaimBook>> = Rc::default();
        let claim = OpenClaim::open(&book, &ticket(3_000, "a"), 0).unwrap();
        let id = claim.id;
        book.borrow_mut().settle(&[id], Some(ClaimsKept { claims: vec![Some(ticket(4_000, "a"))], in_flight_ms: 3_000 }), 1_000);
        assert_eq!(claim.ticket(), Some(ticket(4_000, "a")));
        drop(claim);
        assert!(book.borrow().is_empty(), "never asked for again");
    }
}
