//! The data plane D exposes to P. At the root, what both transports share: the core's view of
//! it (`landing`: windows, revocation, fences), destination memory, the Mooncake handshake daemon
//! and the audit. `tcp/` is kvrecv's TCP target (windows, permits, data server); `verbs/` the
//! RDMA target (the libibverbs backend behind feature `rdma`).

internal_mod!(accept_cap);
internal_mod!(audit);
pub(crate) mod conn_table;
#[cfg(feature = "cuda")]
mod cuda_device;
mod device_memory;
internal_mod!(
    // The CUDA backend's checks (feature `cuda`), unit-tested without it.
    #[cfg_attr(not(any(feature = "cuda", feature = "testing")), allow(dead_code))]
    device_pointer
);
pub(crate) mod device_stream;
#[cfg(any(test, feature = "testing"))]
internal_mod!(fake_device);
internal_mod!(handshake_daemon);
mod host_buffer;
mod host_memory;
internal_mod!(landing);
internal_mod!(memory);
mod memory_error;
internal_mod!(memory_fit);
internal_mod!(tcp);
internal_mod!(verbs);

pub use landing::{
    FenceError, Landing, LandingPauseError, NoWindow, NoWindowReason, PullWindow, RegionBases,
    Revocation, RevokeRequest, Revoked, NO_CLEAN_WINDOW,
};
// `kvrecv bench` measures the control plane alone on it.
#[cfg(any(test, feature = "testing", feature = "cli"))]
pub use landing::StaticLanding;
pub use tcp::{TargetConfig, TcpLanding, TcpTarget};
