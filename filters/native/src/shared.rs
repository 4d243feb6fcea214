//! Shared data in plain Rust: one process-wide map with CAS tokens, the native counterpart of
//! proxy-wasm's shared data (process-wide per `vm_id` there; process-wide here, so a new
//! configuration sees what the one it replaces wrote, as Wasm's VMs of one `vm_id` do).
//!
//! Invariant: the map's lock is never held across a call into Envoy (nothing here calls Envoy).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};
use tollgate_filter_core::host::SharedSetError;

/// Each value and its CAS token (the token grows by one at every write).
type Map = HashMap<String, (Vec<u8>, u32)>;
static DATA: LazyLock<Mutex<Map>> = LazyLock::new(Mutex::default);

fn data() -> MutexGuard<'static, Map> {
    // a panic while writing left a whole map (inserts are single calls): keep using it
    DATA.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The value and its CAS token (`(None, None)` when absent).
pub fn get(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    match data().get(key) {
        Some((value, cas)) => (Some(value.clone()), Some(*cas)),
        None => (None, None),
    }
}

/// Writes `value` if the key still has token `cas` (`None`: unconditionally).
pub fn set(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
    let mut map = data();
    let current = map.get(key).map(|(_, c)| *c);
    if let Some(expected) = cas {
        if current != Some(expected) {
            return Err(SharedSetError::CasMismatch);
        }
    }
    let next = current.map_or(1, |c| c.wrapping_add(1).max(1));
    map.insert(key.to_string(), (value.to_vec(), next));
    Ok(())
}
