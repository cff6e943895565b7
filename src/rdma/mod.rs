//! The data plane D exposes to P: landing permits and fences (the core's view of it), registered
//! memory, the Mooncake handshake daemon, the TCP data server, and (feature `rdma`) the ibverbs
//! target.

#[doc(hidden)]
pub mod audit;
#[doc(hidden)]
pub mod handshake_daemon;
#[doc(hidden)]
pub mod initiator;
pub mod landing;
pub mod memory;
#[doc(hidden)]
pub mod permits;
pub mod target;
#[doc(hidden)]
pub mod tcp_server;
#[doc(hidden)]
pub mod tcp_wire;
#[doc(hidden)]
pub mod verbs;
#[doc(hidden)]
pub mod windows;

pub use landing::{
    FenceError, Landing, PullWindow, Revocation, RevokeRequest, Revoked, StaticLanding,
};
pub use permits::TcpLanding;
pub use target::{TargetConfig, TcpTarget};
