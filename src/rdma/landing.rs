//! What the coordinator needs from the data plane: an address window per pull (the landing
//! permit), revocation of a request's permits before its blocks are released, and a fence for
//! peers whose writes cannot be refused per request (DESIGN.md §5).

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use futures::future::{BoxFuture, LocalBoxFuture};
use thiserror::Error;

use crate::messages::{PeerId, PullId, RequestMeta};

/// The pull a window is opened for.
#[derive(Debug, Clone)]
pub struct PullWindow<'a> {
    /// The pull (its window's owner).
    pub pull_id: PullId,
    /// The writer the window is for.
    pub peer: &'a PeerId,
    /// Awaiting requests of the pull (each with its destination blocks).
    pub requests: &'a [Arc<RequestMeta>],
}

/// What revoking a request's permits proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revocation {
    /// No write can land in the request's blocks any more (TCP data plane with permits).
    Exact,
    /// Nothing could be revoked: peers that may still write need a fence.
    NotExact,
}

/// What the BlockManager revokes at a completion.
#[derive(Debug, Clone, Copy)]
pub struct RevokeRequest<'a> {
    /// The completed request.
    pub req: &'a RequestMeta,
    /// Peers that may still write into the request's blocks: settled Uncertain, failed by the
    /// transport engine, or not settled at all (policy `naive`). The address windows of their
    /// pulls are poisoned (DESIGN.md §5): never handed out again before `poison_until`.
    pub suspects: &'a [PeerId],
    /// Last resort: when a poisoned window may return to rotation without a fence.
    pub poison_until: Instant,
}

/// The result of a revocation.
pub struct Revoked {
    /// What the revocation proves.
    pub revocation: Revocation,
    /// Windows (epochs) this revocation poisoned.
    pub poisoned: usize,
    /// Resolves once no socket read admitted before the revocation can still copy into the
    /// request's blocks; `None` when none was copying. The blocks may be released only after it.
    pub quiesced: Option<BoxFuture<'static, ()>>,
}

impl Revoked {
    /// Nothing was revocable (no data plane of kvrecv's own, or RDMA).
    pub fn not_exact() -> Self {
        Revoked {
            revocation: Revocation::NotExact,
            poisoned: 0,
            quiesced: None,
        }
    }
}

impl std::fmt::Debug for Revoked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Revoked")
            .field("revocation", &self.revocation)
            .field("poisoned", &self.poisoned)
            .field("quiesced", &self.quiesced.as_ref().map(|_| "pending"))
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
/// Why a fence could not be confirmed: the blocks stay quarantined until the deadline.
pub enum FenceError {
    #[error("this data plane cannot fence peers: {0}")]
    /// This data plane cannot fence (no such mechanism configured).
    Unavailable(String),
    #[error("fence of {peer} failed: {reason}")]
    /// Fencing a peer failed.
    Failed {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
}

/// Why a landing could not close or reopen for sleep mode (DESIGN.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LandingPauseError {
    /// This data plane has no way to stop writes (or to take them again).
    #[error("this data plane cannot pause: {0}")]
    Unsupported(String),
    /// Closing (or reopening) failed part-way: on a close, some memory may still be
    /// writable, so it must not be released.
    #[error("{0}")]
    Failed(String),
    /// A resume's new memory cannot hold the layout: still paused, on the old memory.
    #[error("the new memory does not fit the layout: {0}")]
    DoesNotFit(#[from] crate::rdma::memory_fit::MemoryFitError),
    /// A resume's new memory is another worker's ([`MemoryError::InUse`](crate::MemoryError::InUse)): still
    /// paused, on the old memory.
    #[error("the new memory is registered with another worker")]
    InUse,
}

/// The start of the reason a request fails with when its batch's pulls could not all get a
/// clean landing window (`NoWindow`): nothing was sent to P; the host may load it again later.
pub const NO_CLEAN_WINDOW: &str = "no clean landing window";

/// Why a batch's pulls got no landing window: none of them is sent (P is never handed
/// addresses whose writes would all be refused), and its requests fail with this reason.
/// Backpressure: windows come back as pulls complete (or, poisoned, at their deadline).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{NO_CLEAN_WINDOW}: {needed} needed, {in_use} in use, {poisoned} poisoned of {usable} ({why}); nothing was sent, retry later")]
pub struct NoWindow {
    /// Windows the batch's pulls needed.
    pub needed: usize,
    /// Windows held by open pulls.
    pub in_use: usize,
    /// Windows poisoned (an abandoned writer may still write through them).
    pub poisoned: usize,
    /// Windows that can be handed out at all.
    pub usable: usize,
    /// Which limit was hit.
    pub why: NoWindowReason,
}

/// Which limit kept a batch's pulls from their windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoWindowReason {
    /// Every usable window is held by an open pull or poisoned.
    Exhausted,
    /// The P deployment holds its share of poisoned windows (DESIGN.md §5).
    DeploymentShare,
    /// A pull id already has an open permit, or the pull is too large to index.
    InvalidPull,
}

impl std::fmt::Display for NoWindowReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NoWindowReason::Exhausted => "all in use or poisoned",
            NoWindowReason::DeploymentShare => "the P deployment holds its share of poisoned ones",
            NoWindowReason::InvalidPull => "a pull id is open already, or the pull is too large",
        })
    }
}

impl NoWindowReason {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            NoWindowReason::Exhausted => "exhausted",
            NoWindowReason::DeploymentShare => "deployment_share",
            NoWindowReason::InvalidPull => "invalid_pull",
        }
    }
}

/// The base address of every region, as a pull advertises them. Shared: a data plane whose
/// bases never change hands every pull the same list (no copy per pull).
pub type RegionBases = std::sync::Arc<[u64]>;

/// The data plane, as the Receiver (windows) and the BlockManager (revoke, fence) see it.
pub trait Landing: Send + Sync + 'static {
    /// `remote_hostname` and `remote_port` to advertise: where P's TE finds D's handshake daemon.
    fn endpoint(&self) -> (&str, u32);

    /// Open the pull's landing permit; returns the advertised base address of every region.
    /// A data plane with no clean window returns addresses that admit nothing: callers that
    /// send pulls use [`Landing::open_pulls`], which refuses instead.
    fn open_pull(&self, window: &PullWindow<'_>) -> RegionBases;

    /// Open the landing permits of one batch's pulls (one per peer), all or none: `Err` when
    /// any of them would get no clean window, and then none is opened. The Receiver sends a
    /// batch's pulls only with this (DESIGN.md §5.5). Data planes whose every window is always
    /// clean open each with [`Landing::open_pull`].
    fn open_pulls(&self, windows: &[PullWindow<'_>]) -> Result<Vec<RegionBases>, NoWindow> {
        Ok(windows.iter().map(|w| self.open_pull(w)).collect())
    }

    /// Close every permit covering this request's blocks, and poison the windows of the pulls of
    /// `suspects`. Called once per completion, before the request's blocks are released,
    /// whatever the outcome; the blocks wait for `Revoked::quiesced` too.
    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked;

    /// Whether what landed backs every peer's ok for `req` (PROTOCOL.md §5.3: a v1 writer's ok
    /// proves nothing). Asked once, when every peer settled Ok, before the revocation. `Err`
    /// carries why the request must fail instead. Data planes without accounting accept.
    fn verify_ok(&self, _req: &RequestMeta) -> Result<(), String> {
        Ok(())
    }

    /// What the data plane knows about why `req` failed (e.g. a pull got no landing window),
    /// appended to the failure's reason so a failure always carries its cause.
    fn failure_context(&self, _req: &RequestMeta) -> Option<String> {
        None
    }

    /// Make sure none of `peers` can land a write any more (RDMA: queue pairs to the error
    /// state). Resolves when done.
    fn fence(&self, peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>>;

    /// Sleep mode: admit no write at all until [`Landing::resume`] (TCP: every write refused,
    /// `paused`; RDMA: every window deregistered, the descriptor empty). Called once no
    /// request holds blocks; idempotent. May block on firmware calls (run it off the
    /// runtime's workers).
    fn pause(&self) -> Result<(), LandingPauseError> {
        Err(LandingPauseError::Unsupported(
            "this landing has no pause".into(),
        ))
    }

    /// Admit writes again after [`Landing::pause`], over the same memory (RDMA: windows
    /// registered at fresh IOVA slots). A landing that is not paused is left as it is.
    fn resume(&self) -> Result<(), LandingPauseError> {
        Err(LandingPauseError::Unsupported(
            "this landing has no pause".into(),
        ))
    }

    /// [`Landing::resume`] on `memory`, the host's new regions, checked against the layout
    /// first (`LandingPauseError::DoesNotFit`). Only while paused: every write after it
    /// lands in `memory`, none in the old memory, which the host may free once this returned.
    /// On an error the landing is still paused, on the old memory.
    fn resume_on(
        &self,
        _memory: &crate::rdma::memory::HostMemory,
    ) -> Result<(), LandingPauseError> {
        Err(LandingPauseError::Unsupported(
            "this landing cannot resume on new memory".into(),
        ))
    }
}

#[cfg(any(test, feature = "testing", feature = "cli"))]
/// No data plane of kvrecv's own (the host's memory is written by someone else): fixed base
/// addresses, nothing revocable, no fence. Quarantined blocks wait for the last-resort deadline.
///
/// ```
/// use kvrecv::rdma::{Landing, StaticLanding};
/// let l = StaticLanding::new("10.0.0.7", 15000, vec![0x7e00_0000_0000]);
/// assert_eq!(l.endpoint(), ("10.0.0.7", 15000));
/// ```
#[derive(Debug, Clone)]
pub struct StaticLanding {
    host: String,
    port: u32,
    bases: RegionBases,
}

#[cfg(any(test, feature = "testing", feature = "cli"))]
impl StaticLanding {
    /// A landing at (`host`, `port`) with one base address per region; it admits and fences nothing
    /// (test double).
    pub fn new(host: &str, port: u32, bases: Vec<u64>) -> Self {
        StaticLanding {
            host: host.to_owned(),
            port,
            bases: bases.into(),
        }
    }
}

#[cfg(any(test, feature = "testing", feature = "cli"))]
impl Landing for StaticLanding {
    fn endpoint(&self) -> (&str, u32) {
        (&self.host, self.port)
    }

    fn open_pull(&self, _window: &PullWindow<'_>) -> RegionBases {
        self.bases.clone()
    }

    fn revoke(&self, _r: &RevokeRequest<'_>) -> Revoked {
        Revoked::not_exact()
    }

    fn fence(&self, _peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        Box::pin(async { Err(FenceError::Unavailable("no data plane".into())) })
    }

    /// Nothing of kvrecv's own lands through it: there is nothing to close.
    fn pause(&self) -> Result<(), LandingPauseError> {
        Ok(())
    }

    fn resume(&self) -> Result<(), LandingPauseError> {
        Ok(())
    }
}
