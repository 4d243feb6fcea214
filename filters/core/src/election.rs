//! Electing one root context per Envoy for a job that must run once (`on_tick` fires in every
//! root context: every worker's VM and the main thread's).
//!
//! The election is a lease in shared data — owner (u64 LE) then expiry in ms (u64 LE) — taken or
//! renewed by CAS. The holder renews it on each of its ticks; a holder that goes quiet is
//! replaced once its lease expires.

use crate::host::Host;
use crate::shared_keys::SharedKey;

/// Takes or renews the lease at `key`; true when `owner` holds it now.
pub fn hold(host: &mut impl Host, key: &SharedKey, owner: u64, now_ms: u64, lease_ms: u64) -> bool {
    let (bytes, cas) = host.shared_get_cas(key.as_str());
    if let Some((holder, until)) = bytes.as_deref().and_then(decode) {
        if holder != owner && until > now_ms {
            return false;
        }
    }
    let mut value = owner.to_le_bytes().to_vec();
    value.extend_from_slice(&now_ms.saturating_add(lease_ms).to_le_bytes());
    host.shared_set_cas(key.as_str(), &value, cas).is_ok()
}

fn decode(bytes: &[u8]) -> Option<(u64, u64)> {
    let owner = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
    let until = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    Some((owner, until))
}
