//! Host -> BlockManager / Receiver: sleep mode (DESIGN.md §7, "pause and resume"). Admission
//! closes, every request holding blocks is driven to its release, and the pause's report says
//! how each one's blocks came back.

#![forbid(unsafe_code)]

use actix::Message;
use tokio::sync::oneshot;

use super::ids::ReqId;

/// Host -> BlockManager: close admission and watch every request that holds blocks until it
/// is released. Answers which requests it waits for (the host aborts them) and where the
/// report comes once the last one was released. Idempotent: a second one (a pause dropped
/// midway, then called again) watches whatever still holds blocks.
#[derive(Debug, Message)]
#[rtype(result = "PauseStarted")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct BeginPause;

/// What [`BeginPause`] answers.
#[derive(Debug)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct PauseStarted {
    /// Requests holding blocks when admission closed (in flight, or quarantined).
    pub holders: Vec<ReqId>,
    /// The report, sent once every holder was released (at once when there is none).
    pub report: oneshot::Receiver<PauseReport>,
}

/// Host -> Receiver: the destination memory is registered again (resume): draw a new
/// layout-id nonce, so that P learns the layout again instead of trusting what it cached.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct NewRegistration;

/// What a pause (or a shutdown) did to the requests that held blocks: what
/// [`KvRecv::pause`](crate::KvRecv::pause) and [`KvRecv::shutdown`](crate::KvRecv::shutdown) return.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PauseReport {
    /// A pause: every request that held blocks when it began, in the order they were
    /// released; each completed (failed, if the pause aborted it in flight) and reaches the
    /// host's drain. A shutdown: every request that held blocks when the worker stopped; none
    /// reaches a drain any more.
    pub abandoned: Vec<AbandonedRequest>,
}

/// One request a pause waited for, or a shutdown abandoned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbandonedRequest {
    /// The request.
    pub req_id: ReqId,
    /// Its blocks (every KV-cache group's, in order), the host's again.
    pub blocks: Vec<u32>,
    /// A peer that may have been writing was fenced before the release (TCP: the revocation
    /// refused its writes; RDMA: its queue pairs and windows; a shutdown: kvrecv's data plane
    /// closed). Neither fenced nor forced: no peer was left to write (each answered). Either
    /// way, not `forced` means the blocks are safe to reuse now.
    pub fenced: bool,
    /// Released by the last-resort deadline, without a fence: a peer may still write (a
    /// shutdown of a [`KvRecv::from_parts`](crate::KvRecv::from_parts) handle, whose landing is the host's: kvrecv
    /// could not close it). Reuse these blocks last.
    pub forced: bool,
}
