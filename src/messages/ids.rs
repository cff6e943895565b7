//! Identifiers shared by every actor.

#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;

/// D's own request id (the key of `req_blocks`, what the host scheduler knows).
pub type ReqId = Arc<str>;

/// Process-unique id of one pull (one `MooncakeXferMetadata` sent to one peer).
pub type PullId = u64;

static NEXT_PULL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// `n` consecutive pull ids no other pull of this process has or will have: coordinators may
/// share one landing (its permits are found by pull id), so ids are not per coordinator.
pub fn next_pull_ids(n: u64) -> std::ops::Range<PullId> {
    let first = NEXT_PULL.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    first..first + n
}

/// One prefill worker, identified by its side-channel address (`tcp://ip:port`).
///
/// ```
/// let p = kvrecv::messages::PeerId::new("tcp://127.0.0.1:5555");
/// assert_eq!(p.to_string(), "tcp://127.0.0.1:5555");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(Arc<str>);

impl PeerId {
    /// A peer at ZMQ address `addr` (`tcp://host:port`).
    pub fn new(addr: impl AsRef<str>) -> Self {
        PeerId(Arc::from(addr.as_ref()))
    }

    /// The side-channel address the DEALER connects to.
    pub fn addr(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({})", self.0)
    }
}

impl serde::Serialize for PeerId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}
