//! What the sidecar tells the filter about changes to keys and plans (`GET /v1/changes`).
//!
//! The filter reuses allow answers (its auth cache) and spends leases without asking the
//! sidecar; a revoked key or a changed plan must reach that state too. The sidecar counts every
//! change it applies (a revocation, a plan or key change announced on `config_changed:*`, a
//! resynchronisation) *after* it forgot its own cached key answers; one root context per Envoy
//! polls the count, and when it moved the filter drops every cached answer and lease it got
//! before, so the next request of each key is decided by the sidecar again.

use serde::{Deserialize, Serialize};

/// Path of the change count on the sidecar.
pub const CHANGES_PATH: &str = "/v1/changes";

/// The sidecar's change count. A different `epoch` (the sidecar restarted) is a change too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Changes {
    /// Random per sidecar process (below 2^53, so any JSON reader keeps it exact).
    pub epoch: u64,
    /// Changes applied by this process since it started.
    pub version: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_is_pinned() {
        let c = Changes { epoch: 7, version: 3 };
        assert_eq!(serde_json::to_string(&c).unwrap(), r#"{"epoch":7,"version":3}"#);
        assert_eq!(serde_json::from_str::<Changes>(r#"{"epoch":7,"version":3,"later":1}"#).unwrap(), c);
    }
}
