//! A decision's outcome on its way from the root context to its request's context: a batch's
//! items (crate::batch) and the decision stream's messages (crate::stream) come back this way.

use tollgate_wire::DecideResponse;

/// One request's answer, for its context (`ctx`, the adapter's id of the request's context).
#[derive(Debug)]
pub struct Delivery {
    pub ctx: u32,
    pub answer: Result<DecideResponse, String>,
    /// The decision left (in a batch, on the stream): the sidecar may have taken for it, so a
    /// lost answer is refunded; `false`: it failed before it was sent, nothing was taken.
    pub sent: bool,
}

impl Delivery {
    pub(crate) fn unsent(ctx: u32, why: String) -> Delivery {
        Delivery { ctx, answer: Err(why), sent: false }
    }
}
