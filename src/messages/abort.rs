//! Host -> Receiver -> Peers: the host stopped waiting for a request (its client went away).

use actix::Message;

use super::ids::ReqId;

/// The reason an aborted request's pending peers settle with (Uncertain: the peer was given
/// the block addresses and may still be writing).
pub const ABORTED_BY_HOST: &str = "aborted by the host";

/// Host -> Receiver: stop waiting for `req_id`. Peers still pending for it settle Uncertain
/// ("aborted by the host"); the failure is published and the blocks are released once fenced,
/// like any other uncertain settle (DESIGN.md §5).
#[derive(Debug, Clone, Message)]
#[rtype(result = "AbortReply")]
pub struct Abort {
    /// The request the host stopped waiting for.
    pub req_id: ReqId,
}

/// What an abort reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, actix::MessageResponse)]
pub struct AbortReply {
    /// Peers that still owed the request: each settles it Uncertain, at once or once the
    /// other pending requests of its pull are settled.
    pub peers_settled: usize,
    /// The request was loaded but not yet sent to any peer (its topology lookup was in
    /// flight): it completed Failed at once and is never sent.
    pub before_dispatch: bool,
}

/// Receiver -> Peer: settle `req_id` Uncertain if it is still pending in any pull (once the
/// pull has nothing else pending, `PeerState::abort`); answers how many pulls held it.
#[derive(Debug, Clone, Message)]
#[rtype(result = "usize")]
pub struct AbortAtPeer {
    /// The request to settle at this peer.
    pub req_id: ReqId,
}
