//! kvrecv as a Mooncake RDMA target (PROTOCOL.md §6): device discovery and memory registration,
//! the RDMA segment descriptor, the passive side of the endpoint handshake (type-0 frames), and
//! the fence (queue pairs to ERR, DESIGN.md §5), and [`RdmaLanding`], the core's view of it.
//! The handshake daemon serves this target in RDMA mode
//! ([`RdmaService`](crate::rdma::handshake_daemon::RdmaService)).
//!
//! Every verbs call goes through [`VerbsBackend`]. The logic here compiles and is tested without
//! the `rdma` feature against [`FakeVerbs`]; only `ibverbs_device` (feature `rdma`) links
//! libibverbs.

// `allow(dead_code)` below: parts of the backend that only libibverbs (feature `rdma`), the
// fake backend's tests and the RDMA probe use; the crate's tests (feature `testing`) reach all.
internal_mod!(async_events);
internal_mod!(backend);
internal_mod!(descriptor);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    device_select
);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    endpoint
);
#[cfg(any(test, feature = "testing"))]
internal_mod!(fake);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    fence
);
internal_mod!(gid);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    gid_rank
);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    gpudirect
);
#[cfg(feature = "rdma")]
internal_mod!(ibverbs_device);
internal_mod!(key_windows);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    memlock
);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    memory
);
internal_mod!(nic);
internal_mod!(nic_path);
internal_mod!(passive);
internal_mod!(peer_binding);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    qp_attrs
);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    rdma_landing
);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    rdma_target
);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    window_registrations
);

#[cfg(feature = "testing")]
pub use crate::messages::handshake::SegmentDescriptor;
#[cfg(feature = "testing")]
pub use crate::messages::handshake_desc::{HandShakeDesc, HandShakeDescError};
#[cfg(feature = "testing")]
pub use backend::{AsyncEvent, AsyncEventKind};
pub use backend::{VerbsBackend, VerbsError};
#[cfg(feature = "testing")]
pub use backend::{MrAccess, MrKeys, QpId};
pub use descriptor::PublishedDescriptor;
#[cfg(feature = "testing")]
pub use descriptor::{DescriptorError, RegisteredRegion};
#[cfg(feature = "testing")]
pub use backend::SkippedDevice;
#[cfg(feature = "testing")]
pub use endpoint::{Endpoint, EndpointState};
#[cfg(any(test, feature = "testing"))]
pub use fake::{FakeVerbs, WriteRefused};
pub use fence::SharedHandshake;
#[cfg(feature = "testing")]
pub use fence::RdmaFence;
#[cfg(feature = "testing")]
pub use gid::Gid;
#[cfg(any(feature = "cuda", feature = "testing"))]
pub use gpudirect::{DeviceMemoryExport, DmaBuf};
#[cfg(feature = "testing")]
pub use gpudirect::{GpuDirectError, GpuDirectPath};
#[cfg(feature = "rdma")]
pub use ibverbs_device::{RdmaDeviceConfig, IbvDevices};
#[cfg(feature = "testing")]
pub use memory::MemoryRegistrations;
#[cfg(feature = "testing")]
pub use nic::{LinkLayer, LocalNic};
pub use passive::{RdmaHandshakeConfig, PassiveHandshake};
#[cfg(feature = "testing")]
pub use passive::HandshakeReject;
pub use peer_binding::PeerBinding;
pub use qp_attrs::RdmaMtu;
pub use rdma_landing::WindowsConfig;
#[cfg(feature = "testing")]
pub use rdma_landing::{RdmaLanding, RdmaLandingError};
pub use rdma_target::{RdmaTargetConfig, RdmaTargetError};
#[cfg(any(feature = "rdma", feature = "testing"))]
pub use rdma_target::RdmaTarget;
