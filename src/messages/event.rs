//! Observable events (for `kvrecv serve`, the demo and tests). One JSON object each.

use serde::Serialize;

use super::completion::Outcome;
use super::ids::{PeerId, PullId, ReqId};
use super::settle::SettleOutcome;

/// Something an operator or a test may want to see, in the order it happened inside its actor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum KvEvent {
    Settled {
        peer: PeerId,
        pull_id: PullId,
        req_id: ReqId,
        outcome: SettleOutcome,
    },
    /// One reply named `count` ids that were not pending for that pull (unknown, duplicate,
    /// late); `sample` holds the first few. At most one per reply.
    Stale {
        peer: PeerId,
        pull_id: PullId,
        count: usize,
        sample: Vec<ReqId>,
    },
    FirstFailure {
        req_id: ReqId,
        peer: Option<PeerId>,
        reason: String,
    },
    Completion {
        req_id: ReqId,
        #[serde(flatten)]
        outcome: Outcome,
        uncertain_peers: Vec<PeerId>,
        unsettled_peers: Vec<PeerId>,
    },
    /// Blocks held until the data plane fences the uncertain peers.
    Quarantined {
        req_id: ReqId,
        blocks: Vec<u32>,
        peers: Vec<PeerId>,
    },
    /// Blocks given back (the request appears in `finished_recving`).
    Released {
        req_id: ReqId,
        blocks: Vec<u32>,
        fenced: bool,
        forced: bool,
    },
    PeerRestarted {
        peer: PeerId,
        restarts: u32,
    },
}
