//! What D knows about one of its RDMA NICs after discovery, and how the source GID is chosen.

use super::gid::Gid;
use super::qp_attrs::{LocalPort, Mtu};

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
    pub active_mtu: Mtu,
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

/// GID flavour of a GID table entry (`ibv_gid_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand, or RoCE v1 (same verbs code).
    IbOrRoceV1,
    RoceV2,
}

/// One valid entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntryInfo {
    pub index: u8,
    pub gid: Gid,
    pub kind: GidKind,
}

/// Choose the source GID: the configured index if given (Mooncake `MC_GID_INDEX`); otherwise the
/// first RoCE v2 IPv4-mapped entry (routable across subnets, what RoCE fabrics are set up for),
/// then any RoCE v2 entry, then the first non-zero entry (InfiniBand). `None` if the table has
/// no usable entry or the configured index is not in it.
pub fn select_gid(entries: &[GidEntryInfo], configured: Option<u8>) -> Option<GidEntryInfo> {
    let usable = || entries.iter().filter(|e| !e.gid.is_zero());
    if let Some(i) = configured {
        return usable().find(|e| e.index == i).copied();
    }
    usable()
        .find(|e| e.kind == GidKind::RoceV2 && e.gid.is_ipv4_mapped())
        .or_else(|| usable().find(|e| e.kind == GidKind::RoceV2))
        .or_else(|| usable().next())
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, gid: &str, kind: GidKind) -> GidEntryInfo {
        GidEntryInfo {
            index,
            gid: gid.parse().unwrap(),
            kind,
        }
    }

    const LINK_LOCAL: &str = "fe:80:00:00:00:00:00:00:02:42:ac:ff:fe:11:00:02";
    const V4: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07";
    const ZERO: &str = "00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00";

    #[test]
    fn prefers_roce_v2_ipv4_then_v2_then_first() {
        let table = [
            entry(0, LINK_LOCAL, GidKind::IbOrRoceV1),
            entry(1, LINK_LOCAL, GidKind::RoceV2),
            entry(2, V4, GidKind::IbOrRoceV1),
            entry(3, V4, GidKind::RoceV2),
        ];
        assert_eq!(select_gid(&table, None).unwrap().index, 3);
        assert_eq!(select_gid(&table[..3], None).unwrap().index, 1);
        assert_eq!(select_gid(&table[..1], None).unwrap().index, 0);
    }

    #[test]
    fn configured_index_wins_but_must_exist_and_be_non_zero() {
        let table = [
            entry(0, LINK_LOCAL, GidKind::IbOrRoceV1),
            entry(1, ZERO, GidKind::RoceV2),
        ];
        assert_eq!(select_gid(&table, Some(0)).unwrap().index, 0);
        assert_eq!(select_gid(&table, Some(1)), None);
        assert_eq!(select_gid(&table, Some(9)), None);
        assert_eq!(select_gid(&[entry(0, ZERO, GidKind::RoceV2)], None), None);
    }
}
