//! RequestAggregator -> BlockManager: the failure signal (at once) and the completion (once every
//! peer settled).

#![forbid(unsafe_code)]

use actix::Message;
use serde::Serialize;

use super::batch::SharedRequest;
use super::ids::{PeerId, ReqId};
use super::settle::Cause;

/// The first failed or uncertain settle of a request; sent once, immediately, so the host can
/// fail the request while other peers are still writing.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct FirstFailure {
    /// The request.
    pub req: SharedRequest,
    /// `None` when no peer was involved (topology failure).
    pub peer: Option<PeerId>,
    /// Why, as a host matches on it.
    pub cause: Cause,
    /// Why (the first failing peer's reason).
    pub reason: String,
}

/// The outcome of a whole receive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Every peer settled Ok: the blocks hold the KV.
    Ok,
    /// Some peer did not deliver; the blocks must be recomputed.
    Failed {
        /// The first failing peer, if a peer failed (not the topology).
        peer: Option<PeerId>,
        /// Why, as a host matches on it (retry, recompute, give up): the first failure's
        /// [`Cause`].
        cause: Cause,
        /// Why, in words (the peer's, and what D knows of it).
        reason: String,
    },
}

impl Outcome {
    /// Whether every peer delivered.
    pub fn is_ok(&self) -> bool {
        matches!(self, Outcome::Ok)
    }
}

/// What ends a request's receive, once per request; it reaches the BlockManager inside a
/// [`Completions`] message. Its blocks may be reused once the landing permits are revoked and,
/// for `uncertain_peers`, the data plane fenced them (DESIGN.md §5).
#[derive(Debug, Clone)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Completion {
    /// The request.
    pub req: SharedRequest,
    /// How its receive ended.
    pub outcome: Outcome,
    /// Peers whose settle was Uncertain: they may still be writing.
    pub uncertain_peers: Vec<PeerId>,
    /// Peers that had not settled when the completion was sent. Always empty under policy
    /// `settle`; under `naive` these are the peers that can still write (the upstream bug).
    pub unsettled_peers: Vec<PeerId>,
    /// Peers whose Failed settle came from their transfer engine: a timed-out TE batch can
    /// return before the transport stopped touching D's memory (PROTOCOL.md §5.3).
    pub transport_failed_peers: Vec<PeerId>,
}

impl Completion {
    /// The request's id.
    pub fn req_id(&self) -> &ReqId {
        &self.req.req_id
    }

    /// Every peer that may still write into this request's blocks: uncertain, transport-failed
    /// or unsettled. The windows of their pulls are poisoned at revocation (DESIGN.md §5).
    pub fn suspects(&self) -> Vec<PeerId> {
        let mut v: Vec<PeerId> = self
            .uncertain_peers
            .iter()
            .chain(&self.unsettled_peers)
            .chain(&self.transport_failed_peers)
            .cloned()
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// Completions in order, inline for one (a batch of one allocates no list).
/// Speed only: the seven lists inline for one save 5.0% of the instructions per request at batch 1
/// (`scripts/callgrind-core`; DESIGN.md §10).
pub type CompletionList = smallvec::SmallVec<[Completion; 1]>;

/// RequestAggregator -> BlockManager: the completions one batch of settles produced, in order
/// (one message where a reply settles a whole batch, not one per request). Handled as that
/// many [`Completion`]s one after another.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Completions {
    /// The completions, in the order their requests completed.
    pub completions: CompletionList,
    /// When the aggregator published them: the time their quarantines and poisoned windows
    /// count from (microseconds before the BlockManager reads them; one clock read, not two).
    /// On tokio's clock (`rediscovery::clock_now`), the one the deadline alarm sleeps on.
    pub at: std::time::Instant,
}
