//! What D knows about one of its RDMA NICs after discovery.

#![forbid(unsafe_code)]

use super::gid::Gid;
use super::qp_attrs::{LocalPort, RdmaMtu};

/// The port's link layer (`ibv_port_attr.link_layer`). Kept per NIC: a node may have both,
/// and an InfiniBand NIC cannot reach a RoCE one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkLayer {
    /// InfiniBand (also what verbs reports as "unspecified").
    #[default]
    InfiniBand,
    /// Ethernet: RoCE.
    Ethernet,
}

impl LinkLayer {
    /// From `IBV_LINK_LAYER_*` (0 unspecified and 1 InfiniBand are InfiniBand).
    pub fn from_code(code: u8) -> LinkLayer {
        if code == 2 {
            LinkLayer::Ethernet
        } else {
            LinkLayer::InfiniBand
        }
    }
}

/// One opened RDMA device (one port of it), in the order the descriptor lists devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalNic {
    /// Device name (`mlx5_0`): the `<nic>` part of D's NIC paths.
    pub name: String,
    /// Port number used (Mooncake `MC_IB_PORT`, default 1).
    pub port: u8,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// The GID published for this device and used as the source GID.
    pub gid: Gid,
    /// Index of `gid` in the port's GID table (the RTR `sgid_index`).
    pub gid_index: u8,
    /// The port's active MTU (capped by `MC_MTU` at RTR).
    pub active_mtu: RdmaMtu,
    /// InfiniBand or RoCE.
    pub link_layer: LinkLayer,
    /// NUMA node the device hangs off (sysfs `device/numa_node`); `None` if unknown. Decides
    /// which NICs the descriptor lists as preferred for a `cpu:<node>` buffer.
    pub numa_node: Option<u32>,
}

impl LocalNic {
    /// The local half of the RTR address vector.
    pub fn local_port(&self) -> LocalPort {
        LocalPort {
            port: self.port,
            gid_index: self.gid_index,
            active_mtu: self.active_mtu,
        }
    }
}
