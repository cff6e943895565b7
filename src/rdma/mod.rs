//! The data plane D exposes to P. At the root, what both transports share: the core's view of
//! it (`landing`: windows, revocation, fences), destination memory, the Mooncake handshake daemon
//! and the audit. `tcp/` is kvrecv's TCP target (windows, permits, data server); `verbs/` the
//! RDMA target (the libibverbs backend behind feature `rdma`).

#[doc(hidden)]
pub mod accept_cap;
#[doc(hidden)]
pub mod audit;
pub(crate) mod conn_table;
#[cfg(feature = "cuda")]
mod cuda_device;
mod device_memory;
pub mod device_pointer;
pub(crate) mod device_stream;
#[cfg(any(test, feature = "testing"))]
pub mod fake_device;
#[doc(hidden)]
pub mod handshake_daemon;
mod host_memory;
pub mod landing;
pub mod memory;
mod memory_error;
pub mod memory_fit;
pub mod tcp;
#[doc(hidden)]
pub mod verbs;

pub use landing::{
    FenceError, Landing, LandingPauseError, NoWindow, NoWindowReason, PullWindow, RegionBases,
    Revocation, RevokeRequest, Revoked, StaticLanding, NO_CLEAN_WINDOW,
};
pub use tcp::{TargetConfig, TcpLanding, TcpTarget};
