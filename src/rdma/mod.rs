//! The data plane D exposes to P: landing permits and fences (the core's view of it), registered
//! memory, the Mooncake handshake daemon, the TCP data server, and (feature `rdma`) the ibverbs
//! target.

pub mod landing;
pub mod verbs;

pub use landing::{FenceError, Landing, PullWindow, Revocation, StaticLanding};
