//! The end of a response whose outcome is stored: an idempotency claim's outcome (the 2xx to
//! replay, or the claim's release) is sent to the sidecar when the response completes — at its
//! body's end of stream or its trailers — and the response's end waits for the answer
//! (decision 94); what cannot be sent now goes to the worker's batch.

use super::AuthFilter;
use crate::config::FilterConfig;
use crate::host::{Action, Host, LogLevel};
use tollgate_wire::responses::{StoreBatch, StoreItem, RESPONSES_PATH};

/// How long the end of an idempotent response waits for its outcome to be stored.
fn outcome_timeout(config: &FilterConfig) -> std::time::Duration {
    let store = std::time::Duration::from_millis(tollgate_wire::responses::OUTCOME_STORE_DEADLINE_MS);
    config.sidecar.timeout.max(store)
}

impl AuthFilter {
    /// The response ends with trailers (HTTP/2, gRPC), after its last body frame: it is complete
    /// now, as at a body's end of stream — its idempotency outcome is stored before the trailers
    /// reach the client, and a cache fill may be stored. A gRPC status other than 0 in them is a
    /// failure, whatever the HTTP status said: never stored as a success (decision 173).
    pub fn on_response_trailers(&mut self, host: &mut impl Host) -> Action {
        self.response.end();
        if self.response.replayed || self.response.pending_store.is_none() {
            return Action::Continue;
        }
        let grpc_failed = host.response_trailer("grpc-status").is_some_and(|s| s.trim() != "0");
        if let Some(p) = &mut self.response.pending_store {
            if grpc_failed {
                p.storable = false;
            }
        }
        self.response.on_body(host, 0, 0, true);
        self.store_outcome(host)
    }

    /// The response to an idempotency claim is complete: its outcome (the 2xx to replay, or the
    /// claim's release) is sent to the sidecar now, and the response's end waits for the answer,
    /// so a retry the client sends once it has the answer finds the outcome, never the claim
    /// (a 409). A call that cannot be sent, or fails, leaves the item to the worker's batch.
    pub(super) fn store_outcome(&mut self, host: &mut impl Host) -> Action {
        let Some(item) = self.response.take_idempotency_outcome(host) else { return Action::Continue };
        let batch = StoreBatch { responses: vec![item] };
        let sent = serde_json::to_vec(&batch).map_err(|e| e.to_string()).and_then(|body| {
            host.dispatch(self.config.sidecar.post_json(RESPONSES_PATH, body, outcome_timeout(&self.config)))
        });
        let item = batch.responses.into_iter().next();
        match (sent, item) {
            (Ok(token), Some(item)) => {
                self.outcome_call = Some((token, item));
                Action::Pause
            }
            (Err(e), Some(item)) => {
                host.log(LogLevel::Debug, &format!("tollgate: cannot store an idempotency outcome now: {e}"));
                self.queue_store(item);
                Action::Continue
            }
            (_, None) => Action::Continue,
        }
    }

    /// The outcome call is answered (any 200 means the sidecar read the batch and stored it).
    pub(super) fn outcome_stored(&mut self, status: Option<u16>) {
        if let Some((_, item)) = self.outcome_call.take() {
            if status != Some(200) {
                self.queue_store(item);
            }
        }
        self.resume_response = true;
    }

    pub(super) fn queue_store(&self, item: StoreItem) {
        if let Some(queue) = &self.worker.responses {
            queue.borrow_mut().push(item);
        }
    }

    /// Whether the adapter must resume the response now (once per held response end).
    pub fn take_resume_response(&mut self) -> bool {
        std::mem::take(&mut self.resume_response)
    }
}
