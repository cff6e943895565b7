//! Receiver -> Peer: a Peer no pull was handed for a while is retired (its actor, its state
//! and its pooled sockets go), so that peers that came and went (a P restarted on new ports,
//! a bootstrap server listing workers that never answer) do not accumulate for the life of
//! the process.

#![forbid(unsafe_code)]

use actix::Message;

/// Stop once nothing is in flight. The Receiver has already forgotten the Peer: a later pull
/// to the same address gets a new one. Pulls still in flight are served to their end (aborts
/// still reach them) and the actor stops after the last.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Retire;

/// -> Receiver: how many Peer actors there are now.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "PeerCount")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct CountPeers;

/// The answer to [`CountPeers`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, actix::MessageResponse)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct PeerCount {
    /// Peers the Receiver hands pulls to.
    pub serving: usize,
    /// Retired Peers still serving a pull in flight (stopped ones are not counted).
    pub retiring: usize,
}
