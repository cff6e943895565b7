//! Host -> BlockManager, once per scheduler step: what finished, what failed.

#![forbid(unsafe_code)]

use actix::Message;
use serde::Serialize;

use super::ids::ReqId;

/// The signals a vLLM-style scheduler drains each step (PROTOCOL.md §4).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct StepOutput {
    /// Completions: the receive is over and the blocks may be reused.
    pub finished_recving: Vec<ReqId>,
    /// Request-level failures (caches with more than one KV-cache group).
    pub failed_recving: Vec<ReqId>,
    /// Block-level failures (single-group caches): every block of a failed request.
    pub invalid_block_ids: Vec<u32>,
}

impl StepOutput {
    /// Whether there is nothing to report this step.
    pub fn is_empty(&self) -> bool {
        self.finished_recving.is_empty()
            && self.failed_recving.is_empty()
            && self.invalid_block_ids.is_empty()
    }
}

/// Take everything the BlockManager has ready for the host.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "StepOutput")]
pub struct Drain;
