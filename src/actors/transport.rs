//! The Peer's view of its socket: get a channel for the pull (fresh, or one whose previous pull
//! ended with a clean FINISH), send one request, stream the replies. The ZMQ implementation
//! lives in `control`; tests use `ScriptedTransport` (feature `testing`).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::stream::LocalBoxStream;
use thiserror::Error;

use crate::messages::PeerId;

/// One reply as it came off the socket: its frames (a well-formed reply has exactly one).
pub type Frames = Vec<Vec<u8>>;

/// A channel-level failure: the pull's socket is unusable.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TransportError {
    /// D could not create the pull's socket (out of sockets or descriptors): nothing was sent,
    /// so the peer can neither have the request nor be blamed for it.
    #[error("D cannot create a channel to {peer}: {reason}")]
    /// The socket could not be created here.
    Local {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    #[error("P's worker address {peer:?} cannot be dialled: {reason}")]
    /// The peer's address (from bootstrap `/query`) is not one ZMQ can connect to: nothing was
    /// sent, as with [`TransportError::Local`], but the fault is the address.
    BadAddress {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    #[error("cannot open a channel to {peer}: {reason}")]
    /// The peer could not be reached, and the pull's request was never taken by a connection:
    /// P cannot have it (the Peer settles Failed, not Uncertain, and restarts). A transport
    /// returns this only when that holds; a failure after the request left is another kind.
    Connect {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    #[error("send to {peer} failed: {reason}")]
    /// The pull could not be sent.
    Send {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    #[error("receive from {peer} failed: {reason}")]
    /// A reply could not be received.
    Recv {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    #[error("peer {peer} went away")]
    /// The peer closed the connection.
    Closed {
        /// The peer.
        peer: PeerId,
    },
}

/// Replies of one pull, in order. The stream ends when the channel is closed by the other side;
/// dropping it closes the channel (for ZMQ: the DEALER, with linger 0).
pub type ReplyStream = LocalBoxStream<'static, Result<Frames, TransportError>>;

/// Set by the Peer when a pull ended with a clean FINISH, before it drops the pull's
/// [`ReplyStream`]: only then may the transport hand that channel to a later pull to the same
/// peer (PROTOCOL.md §2.1). A deadline, a channel error, a malformed reply, an ERROR or a channel
/// that ended early leave it unset, and the channel is closed.
#[derive(Debug, Clone, Default)]
// Atomic only so that test doubles can hand it to another thread; a pull lives on one.
pub struct CleanFinish(Arc<AtomicBool>);

impl CleanFinish {
    /// Record that the pull ended with FINISH and nothing more can arrive for it.
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether the pull ended with a clean FINISH.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Gives each pull a channel of its own (PROTOCOL.md §2.1: never multiplex pulls on one socket).
pub trait PeerTransport: 'static {
    /// Get a channel to `peer`, send `request` as one frame, and return the replies. `finish`
    /// is the Peer's verdict on the pull, read when the stream is dropped: a channel is reused
    /// only when it is set.
    fn pull(&self, peer: &PeerId, request: Vec<u8>, finish: CleanFinish) -> ReplyStream;

    /// Close kept channels that can no longer carry a pull (their peer sent something for no
    /// pull, or the connection went), so that what a hostile peer queues on an idle channel
    /// is freed even when no pull comes. The Receiver calls it on its sweep; the default keeps
    /// nothing to sweep.
    fn sweep_idle(&self) {}
}
