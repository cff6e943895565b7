//! Peer -> RequestAggregator: one peer's final word on one request.

use actix::Message;
use serde::Serialize;

use super::ids::{PeerId, PullId, ReqId};

/// How one peer settled one request (DESIGN.md §2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "reason", rename_all = "snake_case")]
pub enum SettleOutcome {
    /// The peer reported the request in `ok_reqs`.
    Ok,
    /// The peer answered: `err_reqs`, or FINISH without the request.
    Failed(String),
    /// D stopped waiting without an answer (deadline, socket error, malformed reply, peer-wide
    /// ERROR, restart): the peer may still be writing.
    Uncertain(String),
}

impl SettleOutcome {
    /// Whether P reported the write done.
    pub fn is_ok(&self) -> bool {
        matches!(self, SettleOutcome::Ok)
    }

    /// The failure reason, if any.
    pub fn reason(&self) -> Option<&str> {
        match self {
            SettleOutcome::Ok => None,
            SettleOutcome::Failed(r) | SettleOutcome::Uncertain(r) => Some(r),
        }
    }

    /// The metric label of the outcome.
    pub fn label(&self) -> &'static str {
        match self {
            SettleOutcome::Ok => "ok",
            SettleOutcome::Failed(_) => "failed",
            SettleOutcome::Uncertain(_) => "uncertain",
        }
    }
}

/// Exactly one per (peer, request) of a pull (DESIGN.md §4 rule 1).
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct Settle {
    /// The settling peer.
    pub peer: PeerId,
    /// The pull it settled in.
    pub pull_id: PullId,
    /// The request settled.
    pub req_id: ReqId,
    /// How.
    pub outcome: SettleOutcome,
}
