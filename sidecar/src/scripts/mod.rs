//! The Rust side of the Lua scripts in `sidecar/lua/`, one module per script: each loads its
//! script (`include_str!`), builds its typed call into KEYS and ARGV, runs it (EVALSHA, loaded
//! again on NOSCRIPT), and reads its reply in a pure, unit-tested function. Nothing else in the
//! sidecar knows a script's argument order or reply layout; a script's contract (the comment
//! at the top of its `.lua` file) and its module change together.

mod call;
pub mod alert_claim;
pub mod alert_fire;
pub mod complete;
pub mod copy_key;
pub mod decide;
pub mod idem_complete;
pub mod idem_keep;
pub mod refund;
pub mod store_response;
pub mod touch_key;

pub use call::{BadReply, ScriptError};

/// The scripts the request path and the completions run, loaded at start
/// ([`crate::store::Store::warm_up`]).
pub fn all() -> [&'static redis::Script; 6] {
    [&decide::SCRIPT, &complete::SCRIPT, &idem_complete::SCRIPT, &idem_keep::SCRIPT, &refund::SCRIPT, &store_response::SCRIPT]
}
