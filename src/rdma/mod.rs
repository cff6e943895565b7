//! The data plane D exposes to P: landing permits and fences (the core's view of it), registered
//! memory, the Mooncake handshake daemon, the TCP data server, and (feature `rdma`) the ibverbs
//! target.

pub mod audit;
pub mod handshake_daemon;
pub mod initiator;
pub mod landing;
pub mod memory;
pub mod permits;
pub mod target;
pub mod tcp_server;
pub mod tcp_wire;
pub mod verbs;
pub mod windows;

pub use landing::{
    FenceError, Landing, PullWindow, Revocation, RevokeRequest, Revoked, StaticLanding,
};
pub use permits::TcpLanding;
pub use target::{TargetConfig, TcpTarget};
