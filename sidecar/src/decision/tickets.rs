//! Sealed tickets: what comes back to the sidecar after a decision — the completion [`Ticket`]
//! and the response-store [`StoreTicket`] (a cache entry, an idempotency outcome) — carries a MAC
//! the sidecar made when it decided, so no caller can forge one, change a field (tenant, budget,
//! reservation, route, hash, idempotency key, expiry) or move it to another tenant.
//!
//! The MAC is HMAC-SHA256 under a key derived from the deployment's filter secret (and the
//! sidecar-only `server.ticket_key`, when set), over a canonical encoding of every field of the
//! ticket: a domain tag per kind, then each field length-prefixed (numbers as 8 big-endian bytes,
//! lists by their count), so no two tickets share an encoding. It is checked in constant time.
//!
//! Each ticket expires ([`COMPLETION_TICKET_TTL_MS`], [`STORE_TICKET_TTL_MS`]); within its
//! lifetime a ticket already settled changes nothing when it comes again: a reservation's settled
//! marker lives at least until the ticket expires (`complete.lua`), a slot is a set member gone
//! once freed, an idempotency claim is settled once (its token), and a cache entry is written
//! only where none is (`SET NX`) by a ticket whose lifetime ends before the entry would.
//!
//! Only the sidecar computes MACs: the filter echoes tickets as it got them.

use crate::keys::RESERVATION_TTL_MS;
use crate::secret::Secret;
use crate::secret::{hex, hmac_sha256};
use tollgate_wire::responses::{Seal, StoreTicket};
use tollgate_wire::Ticket;

/// How long a completion ticket is taken back (at least as long as its slots can be held).
pub const COMPLETION_TICKET_TTL_MS: u64 = RESERVATION_TTL_MS;
/// How long a store ticket is taken back (an idempotency claim's in-flight life; a cache
/// ticket's is also at most its route's TTL).
pub const STORE_TICKET_TTL_MS: u64 = crate::keys::IDEMPOTENCY_IN_FLIGHT_TTL_MS;

/// Metric: tickets refused, labelled `kind` (completion | cache | idempotency) and `reason`
/// (mac | expired).
pub const TICKETS_REFUSED: &str = "tollgate_sidecar_tickets_refused_total";

/// Why a ticket is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No MAC, or not the one its fields give: forged or altered.
    Mac,
    /// Past its expiry.
    Expired,
}

impl Refused {
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Mac => "mac",
            Refused::Expired => "expired",
        }
    }
}

/// The key tickets are sealed with.
#[derive(Clone)]
pub struct TicketKey([u8; 32]);

impl std::fmt::Debug for TicketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketKey(<redacted>)")
    }
}

const DERIVE_LABEL: &[u8] = b"tollgate/ticket-mac/v1";

/// A canonical, unambiguous encoding of a ticket's fields.
struct Canon(Vec<u8>);

impl Canon {
    fn new(kind: &str) -> Canon {
        let mut c = Canon(Vec::with_capacity(256));
        c.str(kind);
        c
    }
    fn str(&mut self, s: &str) -> &mut Canon {
        self.0.extend_from_slice(&(s.len() as u64).to_be_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn num(&mut self, n: u64) -> &mut Canon {
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
}

fn completion_canon(t: &Ticket) -> Canon {
    let mut c = Canon::new("completion");
    c.str(&t.tenant).str(&t.request_id).num(t.expires_at_ms).num(t.budgets.len() as u64);
    for b in &t.budgets {
        c.str(&b.limit).str(&b.subject).num(u64::from(b.period)).num(b.reserved);
    }
    c.num(t.slots.len() as u64);
    for s in &t.slots {
        c.str(&s.limit).str(&s.subject);
    }
    // Money budgets' pricing moments (issue 42), after everything else and only when there is
    // one: a ticket without any encodes as before (tickets sealed by an older sidecar hold), and
    // one with them has bytes past where any without ends, so no two share an encoding.
    if t.budgets.iter().any(|b| b.priced_at_ms.is_some()) {
        c.str("spend");
        for b in &t.budgets {
            c.num(b.priced_at_ms.map_or(0, |at| at.saturating_add(1)));
        }
    }
    c
}

fn store_canon(t: &StoreTicket) -> Canon {
    let seal = t.seal();
    let mut c = match t {
        StoreTicket::Cache { tenant, plan, route, hash, .. } => {
            let mut c = Canon::new("cache");
            c.str(tenant).str(plan).str(route).str(hash);
            c
        }
        StoreTicket::Idempotency { tenant, key_id, digest, key, token, .. } => {
            let mut c = Canon::new("idempotency");
            c.str(tenant).str(key_id).str(digest).str(key).str(token);
            c
        }
    };
    c.str(&seal.id).num(seal.expires_at_ms);
    c
}


impl TicketKey {
    /// The key of a deployment: derived from the filter secret and, when set, the sidecar-only
    /// `ticket_key` (then a caller knowing the filter secret still cannot make a ticket).
    pub fn derive(secret: &Secret, ticket_key: &Secret) -> TicketKey {
        TicketKey(hmac_sha256(secret.expose().as_bytes(), &[DERIVE_LABEL, ticket_key.expose().as_bytes()]))
    }

    /// A key of this process only (tests, and a decider nobody configured).
    pub fn random() -> TicketKey {
        TicketKey(rand::random())
    }

    fn mac(&self, canon: &Canon) -> String {
        hex(&hmac_sha256(&self.0, &[&canon.0]))
    }

    fn check(&self, canon: &Canon, expires_at_ms: u64, mac: &str, now_ms: u64) -> Result<(), Refused> {
        // the MAC first: an expiry is only worth reading once it is the sidecar's own
        if !crate::secret::same(self.mac(canon).as_bytes(), mac.as_bytes()) {
            return Err(Refused::Mac);
        }
        if now_ms > expires_at_ms {
            return Err(Refused::Expired);
        }
        Ok(())
    }

    /// Seals a completion ticket made at `now_ms` whose slots are held up to `hold_ms`: it is
    /// taken back for [`COMPLETION_TICKET_TTL_MS`] (the reservation's life) or that, the longer.
    pub fn seal(&self, t: &mut Ticket, now_ms: u64, hold_ms: u64) {
        t.expires_at_ms = now_ms + COMPLETION_TICKET_TTL_MS.max(hold_ms);
        t.mac = self.mac(&completion_canon(t));
    }

    /// Whether a completion ticket is one this deployment sealed, unaltered and unexpired.
    pub fn verify(&self, t: &Ticket, now_ms: u64) -> Result<(), Refused> {
        self.check(&completion_canon(t), t.expires_at_ms, &t.mac, now_ms).inspect_err(|r| count("completion", *r))
    }

    /// Seals a store ticket of decision `id`, taken back until `expires_at_ms`.
    pub fn seal_store(&self, t: &mut StoreTicket, id: &str, expires_at_ms: u64) {
        *t.seal_mut() = Seal { id: id.to_string(), expires_at_ms, mac: String::new() };
        let mac = self.mac(&store_canon(t));
        t.seal_mut().mac = mac;
    }

    /// Whether a store ticket is one this deployment sealed, unaltered and unexpired.
    pub fn verify_store(&self, t: &StoreTicket, now_ms: u64) -> Result<(), Refused> {
        let seal = t.seal();
        let kind = match t {
            StoreTicket::Cache { .. } => "cache",
            StoreTicket::Idempotency { .. } => "idempotency",
        };
        self.check(&store_canon(t), seal.expires_at_ms, &seal.mac, now_ms).inspect_err(|r| count(kind, *r))
    }
}

fn count(kind: &'static str, r: Refused) {
    metrics::counter!(TICKETS_REFUSED, "kind" => kind, "reason" => r.as_str()).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_wire::{BudgetHold, SlotHold};

    fn ticket() -> Ticket {
        Ticket::new(
            "acme",
            "0123456789abcdef0123456789abcdef",
            vec![BudgetHold { limit: "tokens".into(), subject: "k.key_1".into(), period: 202612, reserved: 100, priced_at_ms: None }],
            vec![SlotHold { limit: "conc".into(), subject: "t".into() }],
        )
    }

    #[test]
    fn a_completion_ticket_is_refused_when_forged_altered_or_expired() {
        let key = TicketKey::derive(&Secret::new("filter-secret-0123456789"), &Secret::default());
        let mut t = ticket();
        assert_eq!(key.verify(&t, 1), Err(Refused::Mac), "unsealed");
        let mut long = t.clone();
        key.seal(&mut long, 1_000, 3_600_000);
        assert_eq!(long.expires_at_ms, 1_000 + 3_600_000, "as long as a slot is held");
        key.seal(&mut t, 1_000, 60_000);
        assert_eq!(t.expires_at_ms, 1_000 + COMPLETION_TICKET_TTL_MS);
        assert_eq!(t.mac.len(), 64);
        assert_eq!(key.verify(&t, 1_000), Ok(()));
        assert_eq!(key.verify(&t, t.expires_at_ms), Ok(()));
        assert_eq!(key.verify(&t, t.expires_at_ms + 1), Err(Refused::Expired));
        type Alter = Box<dyn Fn(&mut Ticket)>;
        let altered: Vec<Alter> = vec![
            Box::new(|t: &mut Ticket| t.tenant = "beta".into()),
            Box::new(|t: &mut Ticket| t.request_id = "0123456789abcdef0123456789abcdee".into()),
            Box::new(|t: &mut Ticket| t.budgets[0].reserved = 1_000_000),
            Box::new(|t: &mut Ticket| t.budgets[0].limit = "other".into()),
            Box::new(|t: &mut Ticket| t.budgets[0].subject = "t".into()),
            Box::new(|t: &mut Ticket| t.budgets[0].period = 202611),
            Box::new(|t: &mut Ticket| t.budgets[0].priced_at_ms = Some(0)),
            Box::new(|t: &mut Ticket| t.budgets.clear()),
            Box::new(|t: &mut Ticket| t.slots.push(SlotHold { limit: "conc".into(), subject: "k.key_2".into() })),
            Box::new(|t: &mut Ticket| t.expires_at_ms += 1),
            Box::new(|t: &mut Ticket| t.mac = t.mac.to_uppercase()),
            Box::new(|t: &mut Ticket| t.mac.clear()),
            // moving bytes between fields changes the encoding
            Box::new(|t: &mut Ticket| {
                t.tenant = "acme0".into();
                t.request_id = "123456789abcdef0123456789abcdef".into();
            }),
        ];
        for (i, alter) in altered.iter().enumerate() {
            let mut a = t.clone();
            alter(&mut a);
            assert_eq!(key.verify(&a, 1_000), Err(Refused::Mac), "alteration {i}");
        }
        let other = TicketKey::derive(&Secret::new("filter-secret-0123456789"), &Secret::new("sidecar-only-key-0123"));
        assert_eq!(other.verify(&t, 1_000), Err(Refused::Mac), "another deployment's key");
        assert!(format!("{key:?}").contains("redacted"));
    }

    #[test]
    fn a_store_ticket_is_refused_when_forged_altered_or_expired() {
        let key = TicketKey::random();
        let mut c = StoreTicket::Cache { tenant: "acme".into(), plan: "p".into(), route: "chat".into(), hash: "ab".repeat(32), seal: Seal::default() };
        key.seal_store(&mut c, "d1", 5_000);
        assert_eq!(key.verify_store(&c, 5_000), Ok(()));
        assert_eq!(key.verify_store(&c, 5_001), Err(Refused::Expired));
        let mut i = StoreTicket::Idempotency {
            tenant: "acme".into(),
            key_id: "key_1".into(),
            digest: "0a".repeat(16),
            key: "k-1".into(),
            token: "tok".into(),
            seal: Seal::default(),
        };
        key.seal_store(&mut i, "d2", 5_000);
        assert_eq!(key.verify_store(&i, 1), Ok(()));
        let mut moved = c.clone();
        if let StoreTicket::Cache { tenant, .. } = &mut moved {
            *tenant = "beta".into();
        }
        assert_eq!(key.verify_store(&moved, 1), Err(Refused::Mac), "another tenant");
        let mut rerouted = c.clone();
        if let StoreTicket::Cache { route, .. } = &mut rerouted {
            *route = "other".into();
        }
        assert_eq!(key.verify_store(&rerouted, 1), Err(Refused::Mac));
        let mut longer = c.clone();
        longer.seal_mut().expires_at_ms += 1;
        assert_eq!(key.verify_store(&longer, 1), Err(Refused::Mac), "a longer life");
        let mut renamed = i.clone();
        renamed.seal_mut().id = "d3".into();
        assert_eq!(key.verify_store(&renamed, 1), Err(Refused::Mac));
        let mut rekeyed = i.clone();
        if let StoreTicket::Idempotency { key_id, .. } = &mut rekeyed {
            *key_id = "key_2".into();
        }
        assert_eq!(key.verify_store(&rekeyed, 1), Err(Refused::Mac));
        // a cache ticket's MAC is no idempotency ticket's: the kind is in the encoding
        let mut as_other_kind = i.clone();
        *as_other_kind.seal_mut() = c.seal().clone();
        assert_eq!(key.verify_store(&as_other_kind, 1), Err(Refused::Mac));
    }
}
