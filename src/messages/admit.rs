//! Receiver -> BlockManager: may these validated requests start? The BlockManager's ledger
//! knows which requests and blocks are still live (awaiting, quarantined, or completed but not
//! yet drained), so it is the one place that can keep the host boundary exactly-once.

use actix::Message;

use super::batch::{BatchError, SharedRequest};

/// Admit each request in order (earlier ones of the same message count as live for later
/// ones); the reply has one entry per request, in the same order.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Vec<Result<(), BatchError>>")]
pub struct Admit {
    /// The awaited requests of the batch, in order.
    pub requests: Vec<SharedRequest>,
}
