//! Peer -> RequestAggregator: one peer's final word on one request.

#![forbid(unsafe_code)]

use actix::Message;
use serde::Serialize;

use super::ids::{PeerId, PullId, ReqId};

/// Why a settle was not Ok, classified once, where the reply is decoded or the pull ends; the
/// fence decision and the repro's accounting match on it, never on the reason's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Cause {
    /// `err_reqs` for a reason P gave (not its transfer engine).
    PeerError,
    /// `err_reqs` from P's transfer engine ("Mooncake transfer engine returned N"): its
    /// transport may still touch D's memory (PROTOCOL.md §5.3).
    TransportEngine,
    /// FINISH without the request (DESIGN.md §4 rule 3).
    Omitted,
    /// The pull never left D (socket, encoding, peer known down): no peer can write for it.
    NotSent,
    /// D's pull deadline passed.
    Timeout,
    /// The side channel failed or closed, or the peer actor restarted.
    Channel,
    /// The reply could not be decoded.
    Malformed,
    /// A peer-wide ERROR.
    PeerWideError,
    /// The host aborted the request: `Failed` when P answered it ok afterwards (its writes
    /// stopped), `Uncertain` when P had not answered within the abort's grace.
    Aborted,
    /// Every peer said ok, but what landed does not back it (v1 accounting, no window).
    Unbacked,
}

/// How one peer settled one request (DESIGN.md §2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SettleOutcome {
    /// The peer reported the request in `ok_reqs`.
    Ok,
    /// The peer answered: `err_reqs`, or FINISH without the request (or nothing was sent).
    Failed {
        /// What kind of failure.
        cause: Cause,
        /// The peer's words, or D's.
        reason: String,
    },
    /// D stopped waiting without an answer (deadline, socket error, malformed reply, peer-wide
    /// ERROR, restart, abort): the peer may still be writing.
    Uncertain {
        /// What kind of uncertainty.
        cause: Cause,
        /// What happened.
        reason: String,
    },
}

impl SettleOutcome {
    /// A Failed settle.
    pub fn failed(cause: Cause, reason: impl Into<String>) -> Self {
        SettleOutcome::Failed {
            cause,
            reason: reason.into(),
        }
    }

    /// An Uncertain settle.
    pub fn uncertain(cause: Cause, reason: impl Into<String>) -> Self {
        SettleOutcome::Uncertain {
            cause,
            reason: reason.into(),
        }
    }

    /// Whether P reported the write done.
    pub fn is_ok(&self) -> bool {
        matches!(self, SettleOutcome::Ok)
    }

    /// The failure reason, if any.
    pub fn reason(&self) -> Option<&str> {
        match self {
            SettleOutcome::Ok => None,
            SettleOutcome::Failed { reason, .. } | SettleOutcome::Uncertain { reason, .. } => {
                Some(reason)
            }
        }
    }

    /// The cause, if not Ok.
    pub fn cause(&self) -> Option<Cause> {
        match self {
            SettleOutcome::Ok => None,
            SettleOutcome::Failed { cause, .. } | SettleOutcome::Uncertain { cause, .. } => {
                Some(*cause)
            }
        }
    }

    /// The metric label of the outcome.
    pub fn label(&self) -> &'static str {
        match self {
            SettleOutcome::Ok => "ok",
            SettleOutcome::Failed { .. } => "failed",
            SettleOutcome::Uncertain { .. } => "uncertain",
        }
    }
}

/// Peer -> RequestAggregator: the settles of the awaited requests one reply (or one failure)
/// of a pull produced, in order. One message per reply, not per request: at batch 16 the
/// per-request messages were most of the actors' mailbox traffic.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Settles(pub SettleList);

/// Settles in order, inline for one (a reply at batch 1 allocates no list).
/// Speed only: the seven lists inline for one save 5.0% of the instructions per request at batch 1
/// (`scripts/callgrind-core`; DESIGN.md §10).
pub type SettleList = smallvec::SmallVec<[Settle; 1]>;

/// Exactly one per (peer, request) of a pull (DESIGN.md §4 rule 1); it reaches the
/// RequestAggregator inside a [`Settles`] message.
#[derive(Debug, Clone)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
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
