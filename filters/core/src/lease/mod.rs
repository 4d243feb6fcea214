//! Leased limits, filter side: spending a lease locally, sizing the next one, renewing it off the
//! request path.
//!
//! The sidecar grants a lease (`tollgate_wire::Lease`) with an allow: `units` requests of one key
//! already taken from every limit of its plan, spendable until `ttl_ms` after the call was sent.
//! The lease lives in VM-wide shared data ([`key_of`]: every worker of this Envoy spends from
//! it), as a [`LeaseRecord`] of *batches* (units, expiry): each grant is a batch of its own, so a
//! unit is never spent after the expiry of the grant it came from (a fixed window's units never
//! leak into the next window). A request spends one unit with a CAS write (retried on a CAS
//! mismatch, a few times, then it falls back to the call) and pays no callout and no Redis. That
//! write takes a [`share`] of the units for the worker when the key is busy: its next requests
//! spend from the worker's memory, with no shared data at all.
//!
//! Sizing: the record observes this Envoy's request rate for the key (spends and misses; each span
//! of at least 50 ms is folded into a smoothed rate as it ends, by spends and grants alike); a lease
//! asks for what the rate spends in `targetLifetime` (× 1.25), at most four times the last grant (a
//! slow start) and nothing when fewer than one request is expected in a lease's lifetime (a lease that
//! expires unspent is under-use: at low rates the filter stays exact). The sidecar grants at most
//! a fraction of what each limit has left, so near the limit grants shrink to nothing and the
//! tail of a window is decided exactly.
//!
//! Renewal: when a spend leaves fewer units than the rate spends in `renewAhead`, or the lease
//! ends within `renewAhead`, that request claims the renewal in the record (one per Envoy at a
//! time) and queues it for its worker's root context, whose tick sends it as a decision call with
//! `lease.renewal = true` ([`LeaseRenewer`]); no request waits for it. A renewal the sidecar denies
//! (the key was revoked or expired) drops the lease at once.
//!
//! Invariant: a unit is spent at most once (CAS), only before its batch's expiry, so this Envoy
//! never admits more than the sidecar granted it. A record is created only once the sidecar has
//! allowed the key (a grant, or [`on_answer`] starting the observation): a request with an
//! unknown key writes nothing to shared data.

pub mod config;
pub mod record;
pub mod renewer;
pub mod share;

pub use config::{LeaseConfig, RawLeases};
pub use record::{want_for, Batch, LeaseIdentity, LeaseRecord, RECORD_FORMAT};
pub use share::{Share, Shares};

use crate::host::{Host, LogLevel, SharedSetError};
use crate::shared_keys::{self, SharedKey};
use std::time::Duration;
use tollgate_wire::{DecideRequest, DecideResponse, Lease};

/// CAS attempts of one spend before the request falls back to a call.
pub const MAX_CAS_TRIES: u32 = 8;
/// Batches kept per record (beyond this the two that expire first are merged, expiring with the
/// earlier: never over-use).
pub const MAX_BATCHES: usize = 4;
/// How long a claimed renewal blocks another one (its call's timeout).
pub const RENEWAL_TIMEOUT: Duration = Duration::from_secs(1);
/// After a renewal that brought nothing (or failed), the next one waits this long.
pub const RENEWAL_BACKOFF_MS: u64 = 100;
/// Renewals a worker keeps queued (one per key; more keys wait for their next spend).
pub const MAX_QUEUED_RENEWALS: usize = 256;

/// The shared-data key of a request's lease: its key hash, and its route when it was routed (a
/// route's product and plan override change what the key may do there, as for the auth cache).
pub fn key_of(request: &DecideRequest) -> SharedKey {
    shared_keys::lease(&request.key_hash, request.route.as_deref())
}

fn decode(bytes: Option<Vec<u8>>) -> Option<LeaseRecord> {
    LeaseRecord::decode(&bytes?)
}

/// The outcome of trying to admit a request from the lease.
#[derive(Debug, Clone, PartialEq)]
pub enum Spend {
    /// Admitted locally; `renew` is set when this request claimed the renewal (its want).
    Hit { identity: LeaseIdentity, renew: Option<u64> },
    /// No unit: decide by a call, asking for `want` units (0: ask none). `recorded`: the key has
    /// a record here (its rate is observed already: an allow need not start one).
    Miss { want: u64, recorded: bool },
}

/// Spends one unit of the lease at `key`, if there is one (see the module docs). `gen`: the
/// worker's generation (crate::changes); grants asked under an older one are dropped unspent.
/// Takes no [`share`]: every spend reads and writes the record.
pub fn spend(host: &mut impl Host, key: &SharedKey, c: &LeaseConfig, now_ms: u64, gen: u64) -> Spend {
    spend_from(host, &mut Shares::with_capacity(0), key, c, now_ms, gen)
}

/// Spends one unit of this worker's share of `key`, else of the record, taking a share of it for
/// the worker's next requests ([`share`]).
pub fn spend_from(host: &mut impl Host, shares: &mut Shares, key: &SharedKey, c: &LeaseConfig, now_ms: u64, gen: u64) -> Spend {
    if let Some(identity) = shares.spend(key.as_str(), now_ms, gen) {
        return Spend::Hit { identity, renew: None };
    }
    // the requests the worker's share admitted since the record last saw them
    let admitted = shares.take_admitted(key.as_str());
    for _ in 0..MAX_CAS_TRIES {
        let (bytes, cas) = host.shared_get_cas(key.as_str());
        // No record: this key was never allowed here (or its lease was dropped). Nothing is
        // written for it until the sidecar says it is valid ([`on_answer`] starts the record),
        // so a flood of random keys leaves no shared data behind.
        let Some(mut rec) = decode(bytes) else { return Spend::Miss { want: 0, recorded: false } };
        rec.prune(now_ms);
        if rec.gen < gen {
            // a key or plan changed since these units were granted: ask the sidecar again
            rec.batches.clear();
        }
        rec.obs_spent += 1 + admitted;
        // every span of at least MIN_SPAN_MS is folded into the rate as it ends (a span as long as
        // an idle minute is one sample, not the denominator of the burst that follows it)
        rec.fold(now_ms);
        // the batch that expires first is spent first
        let rate = rec.rate(now_ms);
        let batch = rec.batches.iter_mut().min_by_key(|b| b.until_ms);
        let (hit, share) = match batch {
            Some(b) if !rec.identity.tenant.is_empty() => {
                // this request's unit, and the worker's share beside it
                let taken = shares.size(key.as_str(), rate, b.units, now_ms);
                b.units -= taken;
                (true, (taken > 1).then_some((taken - 1, b.until_ms)))
            }
            _ => (false, None),
        };
        let mut renew = None;
        if hit && rec.needs_renewal(c, now_ms) {
            let want = rec.want(c, now_ms);
            if want > 0 {
                rec.renewing_until_ms = now_ms + RENEWAL_TIMEOUT.as_millis() as u64;
                renew = Some(want);
            }
        }
        // One request-path ask in flight per Envoy (beside at most one renewal): concurrent misses
        // are decided exactly, so a burst does not pile up leases at this replica.
        let mut want = 0;
        if !hit && rec.asking_until_ms <= now_ms {
            want = rec.want(c, now_ms);
            if want > 0 {
                rec.asking_until_ms = now_ms + RENEWAL_TIMEOUT.as_millis() as u64;
            }
        }
        let bytes = rec.encode();
        match host.shared_set_cas(key.as_str(), &bytes, cas) {
            Ok(()) if hit => {
                if let Some((units, until_ms)) = share {
                    shares.hold(key.as_str(), Share { units, until_ms, gen: rec.gen, identity: rec.identity.clone() });
                }
                return Spend::Hit { identity: rec.identity, renew };
            }
            Ok(()) => return Spend::Miss { want, recorded: true },
            Err(SharedSetError::CasMismatch) => continue,
            Err(SharedSetError::Other(_)) => return Spend::Miss { want, recorded: true },
        }
    }
    // Heavy contention: decide this one by a call (it may bring more units).
    Spend::Miss { want: 0, recorded: true }
}

/// Stores a grant: a new batch valid until `sent_ms + ttl` (the call was sent at `sent_ms`, no
/// later than the sidecar took the units, so the batch never outlives the sidecar's bound).
/// `renewal`: the answer to a renewal (else to a request's ask); that claim is released. `gen`:
/// the generation the call was sent under: a grant older than the record's is not kept, a newer
/// one replaces the record's batches.
#[allow(clippy::too_many_arguments)]
pub fn store_grant(host: &mut impl Host, key: &SharedKey, identity: LeaseIdentity, lease: &Lease, sent_ms: u64, now_ms: u64, renewal: bool, gen: u64) {
    let batch = Batch { units: lease.units, until_ms: sent_ms.saturating_add(lease.ttl_ms) };
    for _ in 0..MAX_CAS_TRIES {
        let (bytes, cas) = host.shared_get_cas(key.as_str());
        let mut rec = decode(bytes).unwrap_or_else(|| LeaseRecord { gen, ..LeaseRecord::new(now_ms) });
        rec.prune(now_ms);
        // A grant asked before a change another worker already knows of is not kept; one asked
        // after a change the record predates replaces its batches.
        if gen > rec.gen {
            rec.batches.clear();
            rec.gen = gen;
        }
        if gen == rec.gen {
            rec.fold(now_ms);
            rec.last_granted = lease.units;
            rec.identity = LeaseIdentity { response_headers: lease.response_headers.clone(), ..identity.clone() };
            if batch.until_ms > now_ms && batch.units > 0 {
                rec.batches.push(batch);
            }
            rec.batches.sort_by_key(|b| b.until_ms);
            while rec.batches.len() > MAX_BATCHES {
                // Merge the two that expire first: the units stay, spendable until the earlier expiry.
                let first = rec.batches.remove(0);
                if let Some(b) = rec.batches.first_mut() {
                    *b = Batch { units: b.units + first.units, until_ms: first.until_ms };
                }
            }
        }
        if renewal {
            rec.renewing_until_ms = 0;
        } else {
            rec.asking_until_ms = 0;
        }
        let bytes = rec.encode();
        match host.shared_set_cas(key.as_str(), &bytes, cas) {
            Ok(()) => return,
            Err(SharedSetError::CasMismatch) => continue,
            Err(SharedSetError::Other(e)) => {
                host.log(LogLevel::Debug, &format!("tollgate: cannot store a lease: {e}"));
                return;
            }
        }
    }
}

/// The generations of a decision call: the one it was sent under, and the worker's when its
/// answer came (crate::changes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Gens {
    pub sent: u64,
    pub now: u64,
}

/// Applies a decision call's answer to the lease at `key`: `asked_at` is when the call was sent
/// if it asked for a lease (its claim is released, or the grant stored — unless a change came
/// while the call was out: then the grant is not kept). A 401 (the key is no longer allowed)
/// drops the lease whether the call asked or not, and this worker's share of it (`shares`).
/// `recorded`: the request's spend found the key's record, so an allow that asked for nothing
/// has nothing to start (no read: a cold key's call makes one shared-data read fewer).
#[allow(clippy::too_many_arguments)]
pub fn on_answer(
    host: &mut impl Host,
    shares: &mut Shares,
    key: &SharedKey,
    answer: &Result<DecideResponse, String>,
    asked_at: Option<u64>,
    recorded: bool,
    now_ms: u64,
    renewal: bool,
    gens: Gens,
) {
    match (answer, asked_at) {
        (Ok(DecideResponse::Deny { status: 401, .. }), _) => {
            shares.drop_key(key.as_str());
            forget(host, key)
        }
        (Ok(DecideResponse::Allow { lease: Some(_), .. }), Some(_)) if gens.sent < gens.now => {
            release_claim(host, key, now_ms, renewal)
        }
        (Ok(DecideResponse::Allow { tenant, key_id, plan, request_headers, lease: Some(lease), .. }), Some(sent_ms)) => {
            let identity = LeaseIdentity {
                tenant: tenant.clone(),
                key_id: key_id.clone(),
                plan: plan.clone(),
                request_headers: request_headers.clone(),
                response_headers: Vec::new(),
            };
            store_grant(host, key, identity, lease, sent_ms, now_ms, renewal, gens.sent);
        }
        (_, Some(_)) => release_claim(host, key, now_ms, renewal),
        (Ok(DecideResponse::Allow { .. }), None) if !recorded => start_observing(host, key, now_ms),
        (_, None) => {}
    }
}

/// The sidecar allowed a key that has no record here: the record starts observing its rate
/// (this request is its origin, not a sample). The only place a record is created without a
/// grant, and only for a key the sidecar has just said is valid.
fn start_observing(host: &mut impl Host, key: &SharedKey, now_ms: u64) {
    let (bytes, cas) = host.shared_get_cas(key.as_str());
    if decode(bytes).is_some() {
        return;
    }
    // a CAS mismatch: another worker started it meanwhile
    let _ = host.shared_set_cas(key.as_str(), &LeaseRecord::new(now_ms).encode(), cas);
}

/// An ask that brought nothing (or failed): back off before the next one.
fn release_claim(host: &mut impl Host, key: &SharedKey, now_ms: u64, renewal: bool) {
    for _ in 0..MAX_CAS_TRIES {
        let (bytes, cas) = host.shared_get_cas(key.as_str());
        let Some(mut rec) = decode(bytes) else { return };
        if renewal {
            rec.renewing_until_ms = now_ms + RENEWAL_BACKOFF_MS;
        } else {
            rec.asking_until_ms = now_ms + RENEWAL_BACKOFF_MS;
        }
        let bytes = rec.encode();
        if !matches!(host.shared_set_cas(key.as_str(), &bytes, cas), Err(SharedSetError::CasMismatch)) {
            return;
        }
    }
}

/// Drops the lease at `key` (the key is no longer allowed): every worker stops spending it.
pub fn forget(host: &mut impl Host, key: &SharedKey) {
    if host.shared_get(key.as_str()).is_some_and(|b| !b.is_empty()) {
        host.shared_set(key.as_str(), b"");
    }
}

