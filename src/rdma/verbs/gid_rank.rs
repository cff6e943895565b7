//! Which GID of a port D publishes and uses as its source GID: the configured index
//! (`MC_GID_INDEX`), or else the best entry as Mooncake ranks them
//! (`rdma_gid_probe.h`, `rankAutoGidCandidates`, Mooncake main 3b5a594). Pure: the libibverbs
//! backend feeds it the port's GID table and each entry's network device.
//!
//! Mooncake's classes, best first (ties broken by the lower index):
//! 0. routable, with a network device; 1. routable, without one;
//! 2. private IPv4 (10/8, 172.16/12, 100.64/10), with a network device;
//! 3. degraded (overlay interface or link-local fe80::), with a network device;
//! 4. private IPv4 without a network device; 5. degraded without one;
//! 6. the first non-zero entry of another type (RoCE v1), as a last resort.
//!
//! Only RoCE v2 entries are ever private or degraded; InfiniBand entries (whose GIDs are
//! fe80:: by construction) are routable. RoCE v1 entries only make the fallback, so RoCE v2
//! wins over v1 on an Ethernet port.

#![forbid(unsafe_code)]

use super::gid::Gid;

/// GID type of a GID table entry (`enum ibv_gid_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand (`IBV_GID_TYPE_IB`).
    Ib,
    /// RoCE v1 (`IBV_GID_TYPE_ROCE_V1`): layer 2 only.
    RoceV1,
    /// RoCE v2 (`IBV_GID_TYPE_ROCE_V2`): UDP/IP, routable.
    RoceV2,
}

/// One valid entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntryInfo {
    pub index: u8,
    pub gid: Gid,
    pub kind: GidKind,
    /// The network interface the entry belongs to (sysfs `gid_attrs/ndevs/<index>`, or the
    /// entry's `ndev_ifindex`); `None` if it has none.
    pub ndev: Option<String>,
}

/// Mooncake's `AutoGidCandidateClass`, in rank order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum GidClass {
    NetworkRoutable,
    NoNetworkRoutable,
    NetworkPrivateV4,
    NetworkDegraded,
    NoNetworkPrivateV4,
    NoNetworkDegraded,
    FallbackNonzero,
}

/// Interfaces Mooncake treats as overlays (`isOverlayNetwork`): a GID on them is demoted.
fn is_overlay_ndev(ndev: &str) -> bool {
    ["flannel", "cni", "calico", "vxlan", "docker"]
        .iter()
        .any(|p| ndev.starts_with(p))
        || ndev == "tunl0"
}

/// `::ffff:a.b.c.d`, or the IPv4-encoded multicast form `ff0e::ffff:a.b.c.d` (the kernel's
/// `ipv6_addr_v4mapped` as Mooncake copies it).
fn is_v4_mapped(g: &Gid) -> bool {
    let b = &g.0;
    let tail = b[8..12] == [0, 0, 0xff, 0xff];
    tail && (b[..8] == [0; 8] || (b[..4] == [0xff, 0x0e, 0, 0] && b[4..8] == [0; 4]))
}

/// 10/8, 172.16/12, 100.64/10 (Mooncake's `isOverlayIPv4`), for an IPv4-mapped GID.
fn is_private_v4(g: &Gid) -> bool {
    let (a, b) = (g.0[12], g.0[13]);
    a == 10 || (a == 172 && (16..=31).contains(&b)) || (a == 100 && (64..=127).contains(&b))
}

/// fe80::/10.
fn is_link_local(g: &Gid) -> bool {
    g.0[0] == 0xfe && (g.0[1] & 0xc0) == 0x80
}

/// The class of one entry, or `None` if only the fallback may use it (RoCE v1) or it is
/// unusable (all-zero GID).
pub fn classify(e: &GidEntryInfo) -> Option<GidClass> {
    if e.gid.is_zero() || e.kind == GidKind::RoceV1 {
        return None;
    }
    let v2 = e.kind == GidKind::RoceV2;
    let overlay = v2 && e.ndev.as_deref().is_some_and(is_overlay_ndev);
    let private = v2 && !overlay && is_v4_mapped(&e.gid) && is_private_v4(&e.gid);
    let link_local = v2 && !is_v4_mapped(&e.gid) && is_link_local(&e.gid);
    let degraded = overlay || link_local;
    Some(match (e.ndev.is_some(), degraded, private) {
        (true, true, _) => GidClass::NetworkDegraded,
        (true, false, true) => GidClass::NetworkPrivateV4,
        (true, false, false) => GidClass::NetworkRoutable,
        (false, true, _) => GidClass::NoNetworkDegraded,
        (false, false, true) => GidClass::NoNetworkPrivateV4,
        (false, false, false) => GidClass::NoNetworkRoutable,
    })
}

/// Every usable entry, best first, with its class (Mooncake's `rankAutoGidCandidates`).
pub fn rank_gids(entries: &[GidEntryInfo]) -> Vec<(GidClass, &GidEntryInfo)> {
    let mut ranked: Vec<(GidClass, &GidEntryInfo)> = entries
        .iter()
        .filter_map(|e| classify(e).map(|c| (c, e)))
        .collect();
    ranked.sort_by_key(|(c, e)| (*c, e.index));
    if let Some(fallback) = entries
        .iter()
        .find(|e| !e.gid.is_zero() && classify(e).is_none())
    {
        ranked.push((GidClass::FallbackNonzero, fallback));
    }
    ranked
}

/// Choose the source GID: the configured index if given (it must be in the table and
/// non-zero, as Mooncake checks), otherwise the best-ranked entry. `None` if nothing fits.
pub fn select_gid(entries: &[GidEntryInfo], configured: Option<u8>) -> Option<GidEntryInfo> {
    match configured {
        Some(i) => entries
            .iter()
            .find(|e| e.index == i && !e.gid.is_zero())
            .cloned(),
        None => rank_gids(entries).first().map(|(_, e)| (*e).clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, gid: &str, kind: GidKind, ndev: Option<&str>) -> GidEntryInfo {
        GidEntryInfo {
            index,
            gid: gid.parse().unwrap(),
            kind,
            ndev: ndev.map(str::to_owned),
        }
    }

    const LINK_LOCAL: &str = "fe:80:00:00:00:00:00:00:02:42:ac:ff:fe:11:00:02";
    const PRIVATE_V4: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07"; // 10.0.0.7
    const PUBLIC_V4: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:c0:00:02:07"; // 192.0.2.7
    const CGNAT_V4: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:64:40:00:01"; // 100.64.0.1
    const GLOBAL_V6: &str = "20:01:0d:b8:00:00:00:00:00:00:00:00:00:00:00:01";
    const ZERO: &str = "00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00";

    fn order(entries: &[GidEntryInfo]) -> Vec<(u8, GidClass)> {
        rank_gids(entries)
            .into_iter()
            .map(|(c, e)| (e.index, c))
            .collect()
    }

    #[test]
    fn typical_roce_port_ranks_routable_v2_over_private_over_link_local_and_v1_last() {
        use GidClass::*;
        // A RoCE port's table: each address as v1 then v2, as mlx5 lays it out.
        let table = [
            entry(0, LINK_LOCAL, GidKind::RoceV1, Some("eth0")),
            entry(1, LINK_LOCAL, GidKind::RoceV2, Some("eth0")),
            entry(2, PRIVATE_V4, GidKind::RoceV1, Some("eth0")),
            entry(3, PRIVATE_V4, GidKind::RoceV2, Some("eth0")),
            entry(4, PUBLIC_V4, GidKind::RoceV1, Some("eth0")),
            entry(5, PUBLIC_V4, GidKind::RoceV2, Some("eth0")),
        ];
        assert_eq!(
            order(&table),
            vec![
                (5, NetworkRoutable),
                (3, NetworkPrivateV4),
                (1, NetworkDegraded),
                (0, FallbackNonzero)
            ]
        );
        assert_eq!(select_gid(&table, None).unwrap().index, 5);
        // Without the public address the private one wins; with neither, link-local.
        assert_eq!(select_gid(&table[..4], None).unwrap().index, 3);
        assert_eq!(select_gid(&table[..2], None).unwrap().index, 1);
        // Only v1 entries: the first non-zero one, as a last resort.
        assert_eq!(select_gid(&table[..1], None).unwrap().index, 0);
    }

    #[test]
    fn network_device_and_overlays_rank_as_mooncake_does() {
        use GidClass::*;
        let table = [
            // Routable, but on a docker bridge: degraded.
            entry(0, PUBLIC_V4, GidKind::RoceV2, Some("docker0")),
            // Private, no network device.
            entry(1, CGNAT_V4, GidKind::RoceV2, None),
            // Global IPv6 without a network device: routable.
            entry(2, GLOBAL_V6, GidKind::RoceV2, None),
            entry(3, PRIVATE_V4, GidKind::RoceV2, Some("flannel.1")),
            entry(4, ZERO, GidKind::RoceV2, Some("eth0")),
        ];
        assert_eq!(
            order(&table),
            vec![
                (2, NoNetworkRoutable),
                (0, NetworkDegraded),
                (3, NetworkDegraded),
                (1, NoNetworkPrivateV4)
            ]
        );
    }

    #[test]
    fn infiniband_link_local_gids_are_routable() {
        let table = [
            entry(0, LINK_LOCAL, GidKind::Ib, None),
            entry(1, ZERO, GidKind::Ib, None),
        ];
        assert_eq!(order(&table), vec![(0, GidClass::NoNetworkRoutable)]);
    }

    #[test]
    fn configured_index_wins_but_must_exist_and_be_non_zero() {
        let table = [
            entry(0, LINK_LOCAL, GidKind::RoceV1, None),
            entry(1, ZERO, GidKind::RoceV2, None),
            entry(2, PUBLIC_V4, GidKind::RoceV2, Some("eth0")),
        ];
        assert_eq!(select_gid(&table, Some(0)).unwrap().index, 0);
        assert_eq!(select_gid(&table, Some(1)), None);
        assert_eq!(select_gid(&table, Some(9)), None);
        assert_eq!(
            select_gid(&[entry(0, ZERO, GidKind::RoceV2, None)], None),
            None
        );
    }

    #[test]
    fn v4_mapped_multicast_form_counts_as_ipv4() {
        let g: Gid = "ff:0e:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01"
            .parse()
            .unwrap();
        assert!(is_v4_mapped(&g));
        assert!(is_private_v4(&g));
        let e = entry(
            0,
            "ff:0e:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01",
            GidKind::RoceV2,
            None,
        );
        assert_eq!(classify(&e), Some(GidClass::NoNetworkPrivateV4));
    }
}
