//! An actor's own timers firing, sent to it by its [`Alarm`](crate::actors::alarm::Alarm).

#![forbid(unsafe_code)]

use actix::Message;

/// Peer: a pull deadline may have passed; abandon the overdue pulls.
#[derive(Debug, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct DeadlinesDue;

/// BlockManager: a quarantine's last-resort deadline may have passed; release those whose did.
#[derive(Debug, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct QuarantinesDue;

/// Receiver: time to retire the peers idle for too long.
#[derive(Debug, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct SweepDue;
