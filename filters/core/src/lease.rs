//! Leased limits, filter side: spending a lease locally, sizing the next one, renewing it off the
//! request path.
//!
//! The sidecar grants a lease (`tollgate_wire::Lease`) with an allow: `units` requests of one key
//! already taken from every limit of its plan, spendable until `ttl_ms` after the call was sent.
//! The lease lives in VM-wide shared data ([`lease_key`]: every worker of this Envoy spends from
//! it), as a [`LeaseRecord`] of *batches* (units, expiry): each grant is a batch of its own, so a
//! unit is never spent after the expiry of the grant it came from (a fixed window's units never
//! leak into the next window). A request spends one unit with a CAS write (retried on a CAS
//! mismatch, a few times, then it falls back to the call) and pays no callout and no Redis.
//!
//! Sizing: the record observes this Envoy's request rate for the key (spends and misses); a lease
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
//! never admits more than the sidecar granted it.

use crate::config::ConfigError;
use crate::filter::{interpret, CallSpec, Host, LogLevel, Metric};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;
use tollgate_wire::{DecideRequest, DecideResponse, Header, Lease, LeaseAsk, DECIDE_PATH};

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
/// The shortest time a rate is measured over (a burst of two requests is not 1000/s).
const MIN_SPAN_MS: u64 = 50;

/// The shared-data key of a key hash's lease.
pub fn lease_key(key_hash: &str) -> String {
    format!("tollgate.lease.v1.{key_hash}")
}

/// What a lease belongs to: the key hash, and the route when the request was routed (a route's
/// product and plan override change what the key may do there, as for the auth cache). Every
/// `key_hash` parameter of this module takes this scope.
pub fn scope(request: &DecideRequest) -> String {
    match &request.route {
        Some(r) => format!("{}.{r}", request.key_hash),
        None => request.key_hash.clone(),
    }
}

/// Lease settings (plugin configuration `leases`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Ask for leases at all (off: every request of a limited key is a call).
    pub enabled: bool,
    /// The lifetime a lease is sized for (the sidecar bounds the real one, 500 ms by default).
    pub target_lifetime: Duration,
    /// Renew when the lease has less than this much time or rate-worth of units left.
    pub renew_ahead: Duration,
    /// The first lease of a key asks at most this much.
    pub initial_want: u64,
    /// No lease asks for more.
    pub max_want: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            enabled: true,
            target_lifetime: Duration::from_millis(500),
            renew_ahead: Duration::from_millis(250),
            initial_want: 8,
            max_want: 10_000,
        }
    }
}

/// `leases` as written in the plugin configuration.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawLeases {
    #[serde(default = "yes")]
    enabled: bool,
    #[serde(default)]
    target_lifetime: Option<String>,
    #[serde(default)]
    renew_ahead: Option<String>,
    #[serde(default)]
    initial_want: Option<u64>,
    #[serde(default)]
    max_want: Option<u64>,
}

fn yes() -> bool {
    true
}

impl Default for RawLeases {
    fn default() -> Self {
        RawLeases { enabled: true, target_lifetime: None, renew_ahead: None, initial_want: None, max_want: None }
    }
}

impl LeaseConfig {
    pub fn compile(raw: RawLeases) -> Result<LeaseConfig, ConfigError> {
        let d = LeaseConfig::default();
        let dur = |v: Option<String>, dflt: Duration, name: &str| -> Result<Duration, ConfigError> {
            let Some(v) = v else { return Ok(dflt) };
            let t = crate::config::parse_duration(&v).map_err(|e| ConfigError(format!("leases.{name}: {e}")))?;
            if t < Duration::from_millis(10) || t > Duration::from_secs(10) {
                return Err(ConfigError(format!("leases.{name}: must be between 10ms and 10s")));
            }
            Ok(t)
        };
        let c = LeaseConfig {
            enabled: raw.enabled,
            target_lifetime: dur(raw.target_lifetime, d.target_lifetime, "targetLifetime")?,
            renew_ahead: dur(raw.renew_ahead, d.renew_ahead, "renewAhead")?,
            initial_want: raw.initial_want.unwrap_or(d.initial_want),
            max_want: raw.max_want.unwrap_or(d.max_want),
        };
        if c.initial_want == 0 || c.max_want == 0 || c.initial_want > c.max_want || c.max_want > 1_000_000 {
            return Err(ConfigError("leases: need 1 <= initialWant <= maxWant <= 1000000".into()));
        }
        if c.renew_ahead >= c.target_lifetime {
            return Err(ConfigError("leases.renewAhead: must be shorter than targetLifetime".into()));
        }
        Ok(c)
    }
}

/// Units of one grant and when they expire (this Envoy's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub units: u64,
    pub until_ms: u64,
}

/// Who a leased request is, as the granting decision said.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseIdentity {
    pub tenant: String,
    pub key_id: String,
    pub plan: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_headers: Vec<Header>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub response_headers: Vec<Header>,
}

/// One key's lease at this Envoy (shared data, in the binary form of [`LeaseRecord::encode`]: every
/// admitted request reads and rewrites it, so it is kept cheap to decode and encode).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LeaseRecord {
    /// Empty until a first grant (a record may only observe the rate).
    pub identity: LeaseIdentity,
    pub batches: Vec<Batch>,
    /// Requests seen (spent or not) since `obs_since_ms`.
    pub obs_spent: u64,
    pub obs_since_ms: u64,
    /// The smoothed request rate (per second) at the last grant.
    pub rate_per_s: f64,
    pub last_granted: u64,
    /// A renewal is queued or in flight (or backing off) until then.
    pub renewing_until_ms: u64,
    /// A request's call asking for a lease is in flight (or backing off) until then.
    pub asking_until_ms: u64,
}

impl LeaseRecord {
    fn new(now_ms: u64) -> LeaseRecord {
        LeaseRecord { obs_since_ms: now_ms, ..LeaseRecord::default() }
    }

    /// Units spendable at `now_ms`.
    pub fn units(&self, now_ms: u64) -> u64 {
        self.batches.iter().filter(|b| b.until_ms > now_ms).map(|b| b.units).sum()
    }

    /// The rate seen now: the last smoothed rate blended with the current observation.
    pub fn rate(&self, now_ms: u64) -> f64 {
        let span = now_ms.saturating_sub(self.obs_since_ms);
        let sample = self.obs_spent as f64 * 1000.0 / span.max(MIN_SPAN_MS) as f64;
        if self.rate_per_s <= 0.0 {
            sample
        } else if span >= MIN_SPAN_MS {
            (self.rate_per_s + sample) / 2.0
        } else {
            self.rate_per_s
        }
    }

    /// What the next lease should ask for (0: none, the rate does not pay for one).
    pub fn want(&self, c: &LeaseConfig, now_ms: u64) -> u64 {
        want_for(self.rate(now_ms), self.last_granted, c)
    }

    fn needs_renewal(&self, c: &LeaseConfig, now_ms: u64) -> bool {
        if self.renewing_until_ms > now_ms {
            return false;
        }
        let ahead = c.renew_ahead.as_millis() as u64;
        let low_water = (self.rate(now_ms) * ahead as f64 / 1000.0).ceil().max(1.0) as u64;
        let ends = self.batches.iter().filter(|b| b.units > 0).map(|b| b.until_ms).max().unwrap_or(0);
        self.units(now_ms) <= low_water || ends.saturating_sub(now_ms) <= ahead
    }

    /// Drops expired and empty batches.
    fn prune(&mut self, now_ms: u64) {
        self.batches.retain(|b| b.units > 0 && b.until_ms > now_ms);
    }
}

/// The size of a lease for a rate (requests/s) — pure, the sizing rule of the module docs.
pub fn want_for(rate_per_s: f64, last_granted: u64, c: &LeaseConfig) -> u64 {
    let expected = rate_per_s * c.target_lifetime.as_secs_f64();
    if expected.is_nan() || expected < 1.0 {
        return 0;
    }
    let cap = c.initial_want.max(last_granted.saturating_mul(4)).min(c.max_want);
    ((expected * 1.25).ceil() as u64).clamp(1, cap)
}

fn decode(bytes: Option<Vec<u8>>) -> Option<LeaseRecord> {
    LeaseRecord::decode(&bytes?)
}

/// The first byte of an encoded [`LeaseRecord`]: its format. A record in another format (an older
/// filter's, in the same Envoy) reads as absent: its units are lost — under-use, never over-use.
pub const RECORD_FORMAT: u8 = 2;

impl LeaseRecord {
    /// Little-endian: the format byte; obs_spent, obs_since_ms, rate_per_s (f64 bits), last_granted,
    /// renewing_until_ms, asking_until_ms (u64 each); the batch count (u8) and each batch's units
    /// and until_ms (u64); then tenant, key id, plan (u32 length + UTF-8) and the request and
    /// response headers (u32 count, then name and value as strings).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(128);
        b.push(RECORD_FORMAT);
        let fixed = [
            self.obs_spent,
            self.obs_since_ms,
            self.rate_per_s.to_bits(),
            self.last_granted,
            self.renewing_until_ms,
            self.asking_until_ms,
        ];
        for v in fixed {
            b.extend_from_slice(&v.to_le_bytes());
        }
        // never more than MAX_BATCHES (+1 while merging) in practice; the count is one byte
        let batches = &self.batches[..self.batches.len().min(u8::MAX as usize)];
        b.push(batches.len() as u8);
        for x in batches {
            b.extend_from_slice(&x.units.to_le_bytes());
            b.extend_from_slice(&x.until_ms.to_le_bytes());
        }
        let id = &self.identity;
        for text in [&id.tenant, &id.key_id, &id.plan] {
            put_str(&mut b, text);
        }
        for headers in [&id.request_headers, &id.response_headers] {
            b.extend_from_slice(&(headers.len() as u32).to_le_bytes());
            for h in headers {
                put_str(&mut b, &h.name);
                put_str(&mut b, &h.value);
            }
        }
        b
    }

    /// The record `encode` wrote; `None` for anything else (another format, truncated bytes).
    pub fn decode(bytes: &[u8]) -> Option<LeaseRecord> {
        let mut r = Reader(bytes);
        if r.take(1)?.first() != Some(&RECORD_FORMAT) {
            return None;
        }
        let mut rec = LeaseRecord {
            obs_spent: r.u64()?,
            obs_since_ms: r.u64()?,
            rate_per_s: f64::from_bits(r.u64()?),
            last_granted: r.u64()?,
            renewing_until_ms: r.u64()?,
            asking_until_ms: r.u64()?,
            ..LeaseRecord::default()
        };
        let n = *r.take(1)?.first()?;
        for _ in 0..n {
            rec.batches.push(Batch { units: r.u64()?, until_ms: r.u64()? });
        }
        rec.identity.tenant = r.string()?;
        rec.identity.key_id = r.string()?;
        rec.identity.plan = r.string()?;
        rec.identity.request_headers = r.headers()?;
        rec.identity.response_headers = r.headers()?;
        r.0.is_empty().then_some(rec)
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// Reads an encoded record front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<usize> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize)
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u32()?;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
    fn headers(&mut self) -> Option<Vec<Header>> {
        let n = self.u32()?;
        // each header takes at least 8 bytes: a corrupt count cannot make a huge allocation
        let mut v = Vec::with_capacity(n.min(self.0.len() / 8));
        for _ in 0..n {
            let name = self.string()?;
            let value = self.string()?;
            v.push(Header { name, value });
        }
        Some(v)
    }
}

/// The outcome of trying to admit a request from the lease.
#[derive(Debug, Clone, PartialEq)]
pub enum Spend {
    /// Admitted locally; `renew` is set when this request claimed the renewal (its want).
    Hit { identity: LeaseIdentity, renew: Option<u64> },
    /// No unit: decide by a call, asking for `want` units (0: ask none).
    Miss { want: u64 },
}

/// Spends one unit of `key_hash`'s lease, if there is one (see the module docs).
pub fn spend(host: &mut impl Host, key_hash: &str, c: &LeaseConfig, now_ms: u64) -> Spend {
    let key = lease_key(key_hash);
    for _ in 0..MAX_CAS_TRIES {
        let (bytes, cas) = host.shared_get_cas(&key);
        // The first request seen starts the observation: it is its origin, not a sample.
        let (mut rec, first) = match decode(bytes) {
            Some(r) => (r, false),
            None => (LeaseRecord::new(now_ms), true),
        };
        rec.prune(now_ms);
        if !first {
            rec.obs_spent += 1;
        }
        // the batch that expires first is spent first
        let batch = rec.batches.iter_mut().min_by_key(|b| b.until_ms);
        let hit = match batch {
            Some(b) if !rec.identity.tenant.is_empty() => {
                b.units -= 1;
                true
            }
            _ => false,
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
        match host.shared_set_cas(&key, &bytes, cas) {
            Ok(()) if hit => return Spend::Hit { identity: rec.identity, renew },
            Ok(()) => return Spend::Miss { want },
            Err(crate::breaker::SharedSetError::CasMismatch) => continue,
            Err(crate::breaker::SharedSetError::Other(_)) => return Spend::Miss { want },
        }
    }
    // Heavy contention: decide this one by a call (it may bring more units).
    Spend::Miss { want: 0 }
}

/// Stores a grant: a new batch valid until `sent_ms + ttl` (the call was sent at `sent_ms`, no
/// later than the sidecar took the units, so the batch never outlives the sidecar's bound).
/// `renewal`: the answer to a renewal (else to a request's ask); that claim is released.
pub fn store_grant(host: &mut impl Host, key_hash: &str, identity: LeaseIdentity, lease: &Lease, sent_ms: u64, now_ms: u64, renewal: bool) {
    let key = lease_key(key_hash);
    let batch = Batch { units: lease.units, until_ms: sent_ms.saturating_add(lease.ttl_ms) };
    for _ in 0..MAX_CAS_TRIES {
        let (bytes, cas) = host.shared_get_cas(&key);
        let mut rec = decode(bytes).unwrap_or_else(|| LeaseRecord::new(now_ms));
        rec.prune(now_ms);
        rec.rate_per_s = rec.rate(now_ms);
        rec.obs_since_ms = now_ms;
        rec.obs_spent = 0;
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
        if renewal {
            rec.renewing_until_ms = 0;
        } else {
            rec.asking_until_ms = 0;
        }
        let bytes = rec.encode();
        match host.shared_set_cas(&key, &bytes, cas) {
            Ok(()) => return,
            Err(crate::breaker::SharedSetError::CasMismatch) => continue,
            Err(crate::breaker::SharedSetError::Other(e)) => {
                host.log(LogLevel::Debug, &format!("tollgate: cannot store a lease: {e}"));
                return;
            }
        }
    }
}

/// Applies a decision call's answer to `key_hash`'s lease: `asked_at` is when the call was sent
/// if it asked for a lease (its claim is released, or the grant stored). A 401 (the key is no
/// longer allowed) drops the lease whether the call asked or not.
pub fn on_answer(
    host: &mut impl Host,
    key_hash: &str,
    answer: &Result<DecideResponse, String>,
    asked_at: Option<u64>,
    now_ms: u64,
    renewal: bool,
) {
    match (answer, asked_at) {
        (Ok(DecideResponse::Deny { status: 401, .. }), _) => forget(host, key_hash),
        (Ok(DecideResponse::Allow { tenant, key_id, plan, request_headers, lease: Some(lease), .. }), Some(sent_ms)) => {
            let identity = LeaseIdentity {
                tenant: tenant.clone(),
                key_id: key_id.clone(),
                plan: plan.clone(),
                request_headers: request_headers.clone(),
                response_headers: Vec::new(),
            };
            store_grant(host, key_hash, identity, lease, sent_ms, now_ms, renewal);
        }
        (_, Some(_)) => release_claim(host, key_hash, now_ms, renewal),
        (_, None) => {}
    }
}

/// An ask that brought nothing (or failed): back off before the next one.
fn release_claim(host: &mut impl Host, key_hash: &str, now_ms: u64, renewal: bool) {
    let key = lease_key(key_hash);
    for _ in 0..MAX_CAS_TRIES {
        let (bytes, cas) = host.shared_get_cas(&key);
        let Some(mut rec) = decode(bytes) else { return };
        if renewal {
            rec.renewing_until_ms = now_ms + RENEWAL_BACKOFF_MS;
        } else {
            rec.asking_until_ms = now_ms + RENEWAL_BACKOFF_MS;
        }
        let bytes = rec.encode();
        if !matches!(host.shared_set_cas(&key, &bytes, cas), Err(crate::breaker::SharedSetError::CasMismatch)) {
            return;
        }
    }
}

/// Drops `key_hash`'s lease (the key is no longer allowed): every worker stops spending it.
pub fn forget(host: &mut impl Host, key_hash: &str) {
    let key = lease_key(key_hash);
    if host.shared_get(&key).is_some_and(|b| !b.is_empty()) {
        host.shared_set(&key, b"");
    }
}

/// A renewal waiting for the root context's tick.
#[derive(Debug, Clone, PartialEq)]
pub struct Renewal {
    /// The lease's [`scope`].
    pub key_hash: String,
    /// The decision request to send (the request that claimed it, with `lease.renewal`).
    pub request: DecideRequest,
}

/// The worker's queue of renewals: HTTP contexts push, the root context sends.
#[derive(Debug, Default)]
pub struct RenewalQueue {
    pending: VecDeque<Renewal>,
    /// Renewals dropped because the queue was full.
    pub dropped: u64,
}

impl RenewalQueue {
    /// Queues a renewal for `request`'s key, asking for `want` units.
    pub fn push(&mut self, mut request: DecideRequest, want: u64) {
        let scope = scope(&request);
        if self.pending.iter().any(|r| r.key_hash == scope) {
            return;
        }
        if self.pending.len() >= MAX_QUEUED_RENEWALS {
            self.dropped += 1;
            return;
        }
        request.lease = Some(LeaseAsk { want, renewal: true });
        request.token_estimate = None;
        self.pending.push_back(Renewal { key_hash: scope, request });
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Sends a worker's queued renewals from its root context and applies their answers.
pub struct LeaseRenewer {
    queue: Rc<RefCell<RenewalQueue>>,
    /// Calls in flight: token → (key hash, sent at).
    in_flight: Vec<(u32, String, u64)>,
}

impl LeaseRenewer {
    pub fn new(queue: Rc<RefCell<RenewalQueue>>) -> LeaseRenewer {
        LeaseRenewer { queue, in_flight: Vec::new() }
    }

    /// Sends every queued renewal (the root context's tick).
    pub fn on_tick(&mut self, host: &mut impl Host, config: &crate::config::FilterConfig) {
        let pending: Vec<Renewal> = self.queue.borrow_mut().pending.drain(..).collect();
        for r in pending {
            let now = host.now_ms();
            let Ok(body) = serde_json::to_vec(&r.request) else { continue };
            let call = CallSpec {
                cluster: config.sidecar_cluster.clone(),
                headers: vec![
                    (":method".into(), "POST".into()),
                    (":path".into(), DECIDE_PATH.into()),
                    (":authority".into(), config.sidecar_authority.clone()),
                    ("content-type".into(), "application/json".into()),
                ],
                body,
                timeout: RENEWAL_TIMEOUT,
            };
            match host.dispatch(call) {
                Ok(token) => {
                    host.count(Metric::LeaseRenewal);
                    self.in_flight.push((token, r.key_hash, now));
                }
                Err(e) => {
                    host.log(LogLevel::Debug, &format!("tollgate: cannot send a lease renewal: {e}"));
                    release_claim(host, &r.key_hash, now, true);
                }
            }
        }
    }

    /// Applies a call's answer; false when `token` is not a renewal of this renewer.
    pub fn on_call_response(&mut self, host: &mut impl Host, token: u32, status: Option<u16>, body: &[u8]) -> bool {
        let Some(i) = self.in_flight.iter().position(|(t, _, _)| *t == token) else { return false };
        let (_, key_hash, sent_ms) = self.in_flight.swap_remove(i);
        let now = host.now_ms();
        let answer = interpret(status, body);
        if let Err(e) = &answer {
            host.log(LogLevel::Debug, &format!("tollgate: lease renewal failed: {e}"));
        }
        // A denied renewal (the key was revoked or expired; limits unavailable and closed) drops
        // the lease: on_answer forgets it on a 401, and a 503 brings no units.
        if let Ok(DecideResponse::Deny { .. }) = &answer {
            forget(host, &key_hash);
        }
        on_answer(host, &key_hash, &answer, Some(sent_ms), now, true);
        true
    }

    /// Renewals waiting for an answer.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn sizing_follows_the_rate_with_a_slow_start_and_none_at_low_rates() {
        let c = LeaseConfig::default(); // 500 ms lifetime, initial 8
        assert_eq!(want_for(0.0, 0, &c), 0);
        assert_eq!(want_for(1.0, 0, &c), 0, "half a request per lease: exact");
        assert_eq!(want_for(2.0, 0, &c), 2, "one request per lease: 1.25 rounded up");
        assert_eq!(want_for(10_000.0, 0, &c), 8, "the first lease is small");
        assert_eq!(want_for(10_000.0, 8, &c), 32, "then at most quadruples");
        assert_eq!(want_for(100.0, 1000, &c), 63, "the rate rules once grown: 50 × 1.25");
        assert_eq!(want_for(1e9, 1 << 40, &c), c.max_want);
        assert_eq!(want_for(f64::NAN, 0, &c), 0);
    }

    #[test]
    fn the_rate_is_observed_over_a_span_and_smoothed() {
        let mut r = LeaseRecord::new(1_000);
        r.obs_spent = 2;
        assert_eq!(r.rate(1_001), 40.0, "at least 50 ms: 2 requests in 1 ms is not 2000/s");
        assert_eq!(r.rate(1_100), 20.0);
        r.rate_per_s = 40.0;
        assert_eq!(r.rate(1_100), 30.0);
        assert_eq!(r.rate(1_010), 40.0, "a short span keeps the known rate");
        r.rate_per_s = 0.0;
        r.obs_spent = 0;
        assert_eq!(r.rate(5_000), 0.0);
    }

    #[test]
    fn records_round_trip_in_binary_and_refuse_anything_else() {
        let rec = LeaseRecord {
            identity: LeaseIdentity {
                tenant: "acme".into(),
                key_id: "k_1".into(),
                plan: "pro".into(),
                request_headers: vec![Header::new("x-tollgate-org", "ü")],
                response_headers: vec![Header::new("ratelimit", "limit=10, remaining=3"), Header::new("a", "")],
            },
            batches: vec![Batch { units: 7, until_ms: 1_500 }, Batch { units: u64::MAX, until_ms: 9 }],
            obs_spent: 3,
            obs_since_ms: 1_000,
            rate_per_s: 123.25,
            last_granted: 8,
            renewing_until_ms: 2_000,
            asking_until_ms: 0,
        };
        let bytes = rec.encode();
        assert_eq!(bytes[0], RECORD_FORMAT);
        assert_eq!(LeaseRecord::decode(&bytes), Some(rec.clone()));
        assert_eq!(LeaseRecord::decode(&LeaseRecord::default().encode()), Some(LeaseRecord::default()));
        // truncated anywhere, or with trailing bytes: refused, never half-read
        for n in 0..bytes.len() {
            assert_eq!(LeaseRecord::decode(&bytes[..n]), None, "truncated to {n}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(LeaseRecord::decode(&longer), None);
        // an older filter's JSON record, a forgotten lease (empty), another format
        assert_eq!(LeaseRecord::decode(br#"{"batches":[{"units":5,"untilMs":9}]}"#), None);
        assert_eq!(LeaseRecord::decode(b""), None);
        let mut other = bytes;
        other[0] = RECORD_FORMAT + 1;
        assert_eq!(LeaseRecord::decode(&other), None);
    }

    #[test]
    fn config_defaults_and_refusals() {
        let c = LeaseConfig::compile(RawLeases::default()).unwrap();
        assert_eq!(c, LeaseConfig::default());
        let raw: RawLeases = serde_json::from_str(r#"{"renewAhead":"600ms"}"#).unwrap();
        assert!(LeaseConfig::compile(raw).unwrap_err().0.contains("renewAhead"));
        let raw: RawLeases = serde_json::from_str(r#"{"initialWant":0}"#).unwrap();
        assert!(LeaseConfig::compile(raw).is_err());
        assert!(serde_json::from_str::<RawLeases>(r#"{"want":1}"#).is_err());
    }
}
