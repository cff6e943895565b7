//! Observable events (for `kvrecv serve`, the demo and tests). One JSON object each.

#![forbid(unsafe_code)]

use serde::Serialize;

use super::completion::Outcome;
use super::ids::{PeerId, PullId, ReqId};
use super::settle::{Cause, SettleOutcome};

/// What happened to a request, for a host that wants more than [`crate::KvRecv::drain`]'s
/// step output (why one failed, when its blocks came back): [`crate::KvRecv::events`], in the
/// order it happened inside its actor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum KvEvent {
    /// A peer settled one request of a pull.
    Settled {
        /// The peer.
        peer: PeerId,
        /// The pull.
        pull_id: PullId,
        /// The request.
        req_id: ReqId,
        /// How it settled.
        outcome: SettleOutcome,
    },
    /// One reply named `count` ids that were not pending for that pull (unknown, duplicate,
    /// late); `sample` holds the first few. At most one per reply, and at most
    /// `STALE_EVENTS_PER_PULL` per pull (the
    /// rest are counted in `kvrecv_stale_settles_total`).
    Stale {
        /// The peer.
        peer: PeerId,
        /// The pull.
        pull_id: PullId,
        /// Ids not pending.
        count: usize,
        /// The first few of them.
        sample: Vec<ReqId>,
    },
    /// A request's first failure, published at once (before its completion).
    FirstFailure {
        /// The request.
        req_id: ReqId,
        /// The failing peer (none for a topology failure).
        peer: Option<PeerId>,
        /// Why, as a host matches on it.
        cause: Cause,
        /// Why, in words.
        reason: String,
    },
    /// Every peer settled (or was treated as Uncertain): the receive is over.
    Completion {
        /// The request.
        req_id: ReqId,
        #[serde(flatten)]
        /// Ok, or the first failure.
        outcome: Outcome,
        /// Peers that may still write (their blocks wait for a fence).
        uncertain_peers: Vec<PeerId>,
        /// Peers that never settled (policy `naive`, or an abort).
        unsettled_peers: Vec<PeerId>,
    },
    /// Blocks held until the data plane fences the uncertain peers.
    Quarantined {
        /// The request.
        req_id: ReqId,
        /// The held blocks.
        blocks: Vec<u32>,
        /// Peers to fence before the blocks are free.
        peers: Vec<PeerId>,
    },
    /// Blocks given back (the request appears in `finished_recving`).
    Released {
        /// The request.
        req_id: ReqId,
        /// The blocks given back.
        blocks: Vec<u32>,
        /// A fence (or exact revocation) proved no write can land.
        fenced: bool,
        /// Released by the last-resort deadline without a fence.
        forced: bool,
    },
    /// A peer actor was restarted after its channel failed.
    PeerRestarted {
        /// The peer.
        peer: PeerId,
        /// Restarts so far.
        restarts: u32,
    },
}
