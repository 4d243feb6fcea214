//! What every script module shares: one call (its script, keys and arguments already encoded,
//! run within a deadline, loaded again on NOSCRIPT) and how a call fails.

use crate::store::{Store, StoreError};
use std::time::Duration;

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
    pub(super) fn new(what: &'static str, why: String) -> BadReply {
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
pub(super) struct Invocation<'a> {
    pub(super) script: &'a redis::Script,
    /// The store's operation name (metrics label `op`).
    pub(super) op: &'static str,
    pub(super) keys: Vec<String>,
    pub(super) args: Vec<String>,
}

impl Invocation<'_> {
    /// Runs the call within `deadline` (`None`: the store's request-path deadline).
    pub(super) async fn run<T: redis::FromRedisValue + Send + 'static>(self, store: &Store, deadline: Option<Duration>) -> Result<T, StoreError> {
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
