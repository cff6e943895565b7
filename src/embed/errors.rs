//! Why a D worker could not start, why a call on its handle failed, why a pause or resume did.

#![forbid(unsafe_code)]


use std::net::IpAddr;

use thiserror::Error;




use crate::config::ConfigError;
use crate::rdma::tcp::target::TargetError;
use crate::rdma::verbs::{RdmaTargetError, VerbsError};
use crate::rdma::LandingPauseError;

/// Why a D worker could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StartError {
    #[error("configuration: {0}")]
    /// The configuration was refused.
    Config(#[from] ConfigError),
    #[error("data plane: {0}")]
    /// The data target could not start (bind, memory).
    Target(#[from] TargetError),
    #[error("cannot start kvrecv's thread or runtime: {0}")]
    /// The OS refused a thread or runtime.
    Runtime(#[from] std::io::Error),
    #[error("kvrecv's thread ended during start-up")]
    /// kvrecv's thread died before it reported readiness.
    ThreadEnded,
    #[error("no advertised host: binding {0} needs advertise_host (the address P reaches)")]
    /// A wildcard bind needs the address P should connect to.
    NoAdvertiseHost(IpAddr),
    #[error("advertised host {0:?} is neither an IP address nor a DNS name")]
    /// `advertise_host` that no resolver would take: P could reach D by no such name.
    BadAdvertiseHost(String),
    /// The RDMA devices could not be opened (none, no driver, a named one missing).
    #[error("RDMA devices: {0}")]
    RdmaDevices(#[from] VerbsError),
    /// The RDMA target could not start (bind, registration, descriptor).
    #[error("RDMA target: {0}")]
    Rdma(#[from] RdmaTargetError),
    /// `mooncake_protocol` is `rdma` but this build has no verbs backend (feature `rdma`).
    #[error(
        "mooncake_protocol is \"rdma\" but kvrecv was built without the `rdma` feature: rebuild \
         with --features rdma"
    )]
    RdmaNotBuilt,
    /// [`KvRecvBuilder::target`](crate::KvRecvBuilder::target) changed what the builder sets itself (the layout,
    /// host or device memory): set those through the configuration and the builder's own
    /// methods, so that no later call silently undoes an earlier one.
    #[error("KvRecvBuilder::target changed {0}")]
    TargetConflict(&'static str),
}

/// Memory the host hands over ([`HostRegion`](crate::HostRegion), [`HostMemory`](crate::HostMemory),
/// [`DeviceRegion`](crate::DeviceRegion)) that kvrecv refused: the same error [`KvRecvBuilder::start`](crate::KvRecvBuilder::start)
/// returns when it checks that memory against the layout, so a host's `?` reads alike.
impl From<crate::rdma::memory::MemoryError> for StartError {
    fn from(e: crate::rdma::memory::MemoryError) -> Self {
        StartError::Target(TargetError::Memory(e))
    }
}

/// Why a call on a running handle failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KvRecvError {
    /// The worker was shut down (or its thread ended): nothing more can be loaded or drained.
    #[error("the kvrecv worker is not running (shut down, or its thread ended)")]
    Stopped,
    /// The event stream was already taken (there is one consumer), or events were not enabled
    /// with [`KvRecvBuilder::events`](crate::KvRecvBuilder::events).
    #[error(
        "no event stream: enable it with KvRecvBuilder::events(true) (or completion_events()); \
         it can be taken once"
    )]
    NoEvents,
    /// The worker is paused ([`KvRecv::pause`](crate::KvRecv::pause)): nothing is loaded until [`KvRecv::resume`](crate::KvRecv::resume).
    #[error("kvrecv is paused (sleep mode): nothing is loaded until resume")]
    Paused,
}

/// Why a [`KvRecv::pause`](crate::KvRecv::pause) or [`KvRecv::resume`](crate::KvRecv::resume) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PauseError {
    /// The worker was shut down (or its thread ended).
    #[error("the kvrecv worker is not running (shut down, or its thread ended)")]
    Stopped,
    /// The data plane could not close (pause: some memory may still be writable, do not
    /// release it; admission stays closed and `pause` may be called again) or reopen (resume:
    /// still paused; `resume` may be called again).
    #[error("data plane: {0}")]
    Landing(#[from] LandingPauseError),
    /// [`ResumeMemory::Host`](crate::ResumeMemory::Host) on a worker that cannot take new host memory (it lands in
    /// device memory, runs without landing permits, or its data plane is not kvrecv's).
    /// Still paused: resume with [`ResumeMemory::Same`](crate::ResumeMemory::Same), or start a new worker.
    #[error(
        "this worker cannot resume on new host memory ({0}): resume with the same memory, or \
         start a new worker on the new memory"
    )]
    NewMemoryUnsupported(String),
    /// [`ResumeMemory::Host`](crate::ResumeMemory::Host) whose regions cannot hold the layout. Still paused, on the old
    /// memory (which must stay valid): resume again with memory that fits.
    #[error("the new host memory does not fit the layout: {0}")]
    MemoryDoesNotFit(#[from] crate::rdma::memory_fit::MemoryFitError),
    /// `resume` on a worker that is not paused.
    #[error("kvrecv is not paused")]
    NotPaused,
    /// [`ResumeMemory::Host`](crate::ResumeMemory::Host) with memory another worker holds
    /// ([`MemoryError::InUse`](crate::MemoryError::InUse)): still paused, on the old memory.
    #[error(
        "the new host memory is registered with another worker that is still running (or whose \
         handles are not all dropped)"
    )]
    MemoryInUse,
}


/// A message the worker's actors can no longer take: they stopped. The host sees kvrecv's
/// error, not actix's (it has no actix in its code).
pub(super) fn stopped(_: actix::MailboxError) -> KvRecvError {
    KvRecvError::Stopped
}
