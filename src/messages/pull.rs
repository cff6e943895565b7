//! Receiver -> Peer: ask one prefill worker for its share of a batch.

use actix::{Message, Recipient};

use super::batch::SharedRequest;
use super::ids::PullId;
use super::settle::Settle;

/// One request inside a pull, with where its settle goes.
#[derive(Clone)]
pub struct PullRequest {
    pub meta: SharedRequest,
    /// The request's aggregator; `None` for a request nobody awaits (empty pull): it is still
    /// sent and settled, but its settle goes nowhere.
    pub aggregator: Option<Recipient<Settle>>,
}

/// One `MooncakeXferMetadata` for one peer. The payload is already encoded: the Peer only
/// transports it and interprets the replies.
#[derive(Clone, Message)]
#[rtype(result = "()")]
pub struct Pull {
    pub pull_id: PullId,
    pub payload: Vec<u8>,
    pub requests: Vec<PullRequest>,
}

/// A pull whose metadata could not be encoded, so nothing was sent: the Peer settles each of
/// its requests Failed (nothing reached P, so nothing can be written), and every aggregator
/// still reaches zero.
#[derive(Clone, Message)]
#[rtype(result = "()")]
pub struct UnsentPull {
    pub pull_id: PullId,
    pub requests: Vec<PullRequest>,
    pub reason: String,
}

impl std::fmt::Debug for Pull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pull")
            .field("pull_id", &self.pull_id)
            .field("payload_len", &self.payload.len())
            .field(
                "requests",
                &self
                    .requests
                    .iter()
                    .map(|r| &*r.meta.req_id)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}
