//! One key's lease at this Envoy as kept in shared data: its batches of units, the observed
//! request rate, the claims of an ask and a renewal, and the identity the grant said. Encoded in
//! a compact binary form (every admitted request reads and rewrites it); sized by the rule of
//! [`want_for`].

use super::config::LeaseConfig;
use serde::{Deserialize, Serialize};
use tollgate_wire::Header;

/// The shortest time a rate is measured over (a burst of two requests is not 1000/s).
const MIN_SPAN_MS: u64 = 50;

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
    /// The generation the grants in `batches` were asked under (crate::changes): a worker at a
    /// later generation spends none of them.
    pub gen: u64,
}

impl LeaseRecord {
    pub(super) fn new(now_ms: u64) -> LeaseRecord {
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

    /// Folds the observation into the smoothed rate and restarts it, once it spans at least
    /// `MIN_SPAN_MS`; a shorter one keeps growing. Grants arriving every few milliseconds (a busy
    /// key, fast answers) must not restart it each time: the rate would never be measured and stay
    /// frozen at whatever it was (after a long idle span, a few requests per second).
    pub(super) fn fold(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.obs_since_ms) >= MIN_SPAN_MS {
            self.rate_per_s = self.rate(now_ms);
            self.obs_since_ms = now_ms;
            self.obs_spent = 0;
        }
    }

    /// What the next lease should ask for (0: none, the rate does not pay for one).
    pub fn want(&self, c: &LeaseConfig, now_ms: u64) -> u64 {
        want_for(self.rate(now_ms), self.last_granted, c)
    }

    pub(super) fn needs_renewal(&self, c: &LeaseConfig, now_ms: u64) -> bool {
        if self.renewing_until_ms > now_ms {
            return false;
        }
        let ahead = c.renew_ahead.as_millis() as u64;
        let low_water = (self.rate(now_ms) * ahead as f64 / 1000.0).ceil().max(1.0) as u64;
        let ends = self.batches.iter().filter(|b| b.units > 0).map(|b| b.until_ms).max().unwrap_or(0);
        self.units(now_ms) <= low_water || ends.saturating_sub(now_ms) <= ahead
    }

    /// Drops expired and empty batches.
    pub(super) fn prune(&mut self, now_ms: u64) {
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

/// The first byte of an encoded [`LeaseRecord`]: its format. A record in another format (an older
/// filter's, in the same Envoy) reads as absent: its units are lost — under-use, never over-use.
pub const RECORD_FORMAT: u8 = 3;

impl LeaseRecord {
    /// Little-endian: the format byte; obs_spent, obs_since_ms, rate_per_s (f64 bits), last_granted,
    /// renewing_until_ms, asking_until_ms, gen (u64 each); the batch count (u8) and each batch's units
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
            self.gen,
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
            gen: r.u64()?,
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
    fn an_observation_is_folded_only_once_it_spans_the_minimum() {
        let mut r = LeaseRecord::new(0);
        r.obs_spent = 1;
        r.fold(40_000);
        assert_eq!((r.rate_per_s, r.obs_since_ms, r.obs_spent), (0.025, 40_000, 0), "one request in an idle 40 s");
        r.obs_spent = 90;
        r.fold(40_030);
        assert_eq!((r.obs_since_ms, r.obs_spent), (40_000, 90), "30 ms: kept growing, not restarted");
        assert_eq!(r.rate_per_s, 0.025);
        r.obs_spent = 150;
        r.fold(40_050);
        assert_eq!((r.rate_per_s, r.obs_since_ms, r.obs_spent), ((0.025 + 3_000.0) / 2.0, 40_050, 0));
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
            gen: 5,
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
}
