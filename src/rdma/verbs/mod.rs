//! kvrecv as a Mooncake RDMA target (PROTOCOL.md §6): device discovery and memory registration,
//! the RDMA segment descriptor, the passive side of the endpoint handshake (type-0 frames), and
//! the fence (queue pairs to ERR, DESIGN.md §5), and [`RdmaLanding`], the core's view of it.
//! The handshake daemon serves this target in RDMA mode
//! ([`crate::rdma::handshake_daemon::RdmaService`]).
//!
//! Every verbs call goes through [`VerbsBackend`]. The logic here compiles and is tested without
//! the `rdma` feature against [`FakeVerbs`]; only `ibverbs_device` (feature `rdma`) links
//! libibverbs.

pub mod async_events;
pub mod backend;
pub mod descriptor;
pub mod device_select;
pub mod endpoint;
pub mod fake;
pub mod fence;
pub mod gid;
pub mod gid_rank;
pub mod gpudirect;
#[cfg(feature = "rdma")]
pub mod ibverbs_device;
pub mod key_windows;
pub mod memlock;
pub mod memory;
pub mod nic;
pub mod nic_path;
pub mod passive;
pub mod peer_binding;
pub mod qp_attrs;
pub mod rdma_landing;
pub mod rdma_target;
pub mod window_registrations;

pub use crate::messages::handshake::SegmentDescriptor;
pub use crate::messages::handshake_desc::{HandShakeDesc, HandShakeDescError};
pub use async_events::{AsyncEvent, AsyncEventKind};
pub use backend::{MrAccess, MrKeys, QpId, VerbsBackend, VerbsError};
pub use descriptor::{DescriptorError, PublishedDescriptor, RegisteredRegion};
pub use device_select::SkippedDevice;
pub use endpoint::{Endpoint, EndpointState};
pub use fake::{FakeVerbs, WriteRefused};
pub use fence::{RdmaFence, SharedHandshake};
pub use gid::Gid;
pub use gpudirect::{DeviceMemoryExport, DmaBuf, GpuDirectError, GpuDirectPath};
#[cfg(feature = "rdma")]
pub use ibverbs_device::{DeviceConfig, IbvDevices};
pub use memory::MemoryRegistrations;
pub use nic::{LinkLayer, LocalNic};
pub use passive::{HandshakeConfig, HandshakeReject, PassiveHandshake};
pub use peer_binding::PeerBinding;
pub use rdma_landing::{RdmaLanding, RdmaLandingError, WindowsConfig};
pub use rdma_target::{RdmaTarget, RdmaTargetConfig, RdmaTargetError};
