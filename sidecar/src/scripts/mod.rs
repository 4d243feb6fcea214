//! The Rust side of the Lua scripts in `sidecar/lua/`, one module per script: each loads its
//! script (`include_str!`), builds its typed call into KEYS and ARGV, runs it (EVALSHA, loaded
//! again on NOSCRIPT), and reads its reply in a pure, unit-tested function. Nothing else in the
//! sidecar knows a script's argument order or reply layout; a script's contract (the comment
//! at the top of its `.lua` file) and its module change together.

pub mod complete;
pub mod decide;
pub mod idem_complete;
pub mod refund;

use crate::store::{Store, StoreError};
use std::time::Duration;

/// The scripts the request path and the completions run, loaded at start
/// ([`Store::warm_up`]).
pub fn all() -> [&'static redis::Script; 4] {
    [&decide::SCRIPT, &complete::SCRIPT, &idem_complete::SCRIPT, &refund::SCRIPT]
}

/// A script's reply, or a record a script wrote and another reads back, that does not follow
/// the script's contract: retrying the same call cannot fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {why}")]
pub struct BadReply {
    /// What was read: `decide.lua`, `decision record`.
    what: &'static str,
    why: String,
}

impl BadReply {
    fn new(what: &'static str, why: String) -> BadReply {
        BadReply { what, why }
    }
}

/// Why a script call has no reply to use: Redis did not answer in time (retry later), or
/// answered against the contract.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Reply(#[from] BadReply),
}

/// One script call, keys and arguments already encoded.
struct Invocation<'a> {
    script: &'a redis::Script,
    /// The store's operation name (metrics label `op`).
    op: &'static str,
    keys: Vec<String>,
    args: Vec<String>,
}

impl Invocation<'_> {
    /// Runs the call within `deadline` (`None`: the store's request-path deadline).
    async fn run<T: redis::FromRedisValue + Send + 'static>(self, store: &Store, deadline: Option<Duration>) -> Result<T, StoreError> {
        let Invocation { script, op, keys, args } = self;
        let call = |mut c: crate::store::Conn| async move {
            let mut inv = script.prepare_invoke();
            for k in &keys {
                inv.key(k);
            }
            for a in &args {
                inv.arg(a);
            }
            inv.invoke_async(&mut c).await
        };
        match deadline {
            Some(d) => store.run_with_deadline(op, d, call).await,
            None => store.run(op, call).await,
        }
    }
}
