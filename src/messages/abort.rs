//! Host -> Receiver -> Peers: the host stopped waiting for a request (its client went away).

#![forbid(unsafe_code)]

use actix::Message;

use super::ids::ReqId;

/// The reason an aborted request's pending peers settle with.
pub const ABORTED_BY_HOST: &str = "aborted by the host";

/// Host -> Receiver: stop waiting for `req_id`. Each peer still pending for it settles it
/// ("aborted by the host") on P's answer to its pull, keeping what the answer proves: P's ok
/// (its writes are done) or its failure settles Failed, with no suspect unless P's failure was
/// a transfer-engine one; no answer settles Uncertain (the peer is a suspect, fenced before
/// the blocks are released, DESIGN.md §5). P's answer is waited for up to
/// [`KvRecvConfig::abort_grace`](crate::config::KvRecvConfig::abort_grace) once the pull owes
/// nothing but aborted requests; a pull that still owes other requests keeps its
/// `pull_timeout`, so an aborted request sharing a pull waits for that pull's answer. The
/// request completes Failed either way.
#[derive(Debug, Clone, Message)]
#[rtype(result = "AbortReply")]
pub struct Abort {
    /// The request the host stopped waiting for.
    pub req_id: ReqId,
}

/// What an abort reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, actix::MessageResponse)]
pub struct AbortReply {
    /// Peers that still owed the request: each settles it on P's answer to its pull (Failed,
    /// "aborted by the host", no suspect when P answered ok), or Uncertain (a suspect, fenced)
    /// when no answer came within the abort's grace ([`Abort`]).
    pub peers_settled: usize,
    /// The request was loaded but not yet sent to any peer (its topology lookup was in
    /// flight): it completed Failed at once and is never sent.
    pub before_dispatch: bool,
}

/// Receiver -> Peer: settle `req_id` as aborted if it is still pending in any pull, on P's
/// answer or Uncertain after the abort's grace (`PeerState::abort`); answers how many pulls
/// held it.
#[derive(Debug, Clone, Message)]
#[rtype(result = "usize")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct AbortAtPeer {
    /// The request to settle at this peer.
    pub req_id: ReqId,
}
