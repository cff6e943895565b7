//! Which RDMA devices D uses, decided as Mooncake decides (`Topology::discover`,
//! `RdmaTransport::initializeRdmaResources`): a device whose port is not ACTIVE, or has no usable
//! GID, or cannot be opened, is skipped with a warning and the rest are used; only when none is
//! usable does startup fail, naming why each was skipped. GPU nodes carry 8–10 NICs, some of
//! them down or unconfigured; one of those must not stop the target.
//!
//! Pure: the libibverbs backend probes each device and feeds the results in, so every rule is
//! tested without hardware.

#![forbid(unsafe_code)]

use super::backend::VerbsError;
use super::backend::SkippedDevice;
use super::gid_rank::{select_gid, GidEntryInfo};
use super::nic::{LinkLayer, LocalNic};
use super::qp_attrs::RdmaMtu;

/// `IBV_PORT_ACTIVE`.
pub const PORT_ACTIVE: u32 = 4;

/// Metric: devices skipped at startup; label `reason` (`not_present`, `open_failed`,
/// `port_not_active`, `no_gid`).
pub const DEVICES_SKIPPED: &str = "kvrecv_rdma_devices_skipped_total";

/// What the backend read from one device's configured port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortProbe {
    /// `ibv_port_state` code ([`PORT_ACTIVE`] = usable).
    pub state: u32,
    pub lid: u16,
    /// `ibv_mtu` code of the active MTU.
    pub active_mtu: u32,
    /// `IBV_LINK_LAYER_*` code.
    pub link_layer: u8,
    /// The port's valid GID table entries.
    pub gids: Vec<GidEntryInfo>,
    /// sysfs `numa_node` (`None` for -1 or unreadable).
    pub numa_node: Option<u32>,
}

/// The devices to open, in order: every present one, or the configured names (Mooncake's
/// device filter) in the configured order. A configured name that is not present is skipped.
pub fn devices_to_open(
    filter: Option<&[String]>,
    present: &[String],
) -> (Vec<String>, Vec<SkippedDevice>) {
    match filter {
        None => (present.to_vec(), Vec::new()),
        Some(names) => {
            let mut open = Vec::new();
            let mut skipped = Vec::new();
            for n in names {
                if present.contains(n) {
                    if !open.contains(n) {
                        open.push(n.clone());
                    }
                } else {
                    skipped.push(SkippedDevice {
                        name: n.clone(),
                        reason: VerbsError::UnknownDevice(n.clone()),
                    });
                }
            }
            (open, skipped)
        }
    }
}

/// The NIC device `name` gives on `port`, or why it is skipped: port not ACTIVE, or no usable
/// GID (the configured index absent or zero, or no entry Mooncake's ranking accepts).
pub fn describe_port(
    name: &str,
    port: u8,
    gid_index: Option<u8>,
    probe: &PortProbe,
) -> Result<LocalNic, VerbsError> {
    if probe.state != PORT_ACTIVE {
        return Err(VerbsError::PortNotActive {
            nic: name.to_owned(),
            port,
            state: probe.state,
        });
    }
    let chosen = select_gid(&probe.gids, gid_index).ok_or_else(|| VerbsError::NoGid {
        nic: name.to_owned(),
        port,
        detail: match gid_index {
            Some(i) => format!(" (configured index {i} is absent or zero)"),
            None => format!(" ({} entries, none usable)", probe.gids.len()),
        },
    })?;
    Ok(LocalNic {
        name: name.to_owned(),
        port,
        lid: probe.lid,
        gid: chosen.gid,
        gid_index: chosen.index,
        active_mtu: RdmaMtu::from_code(probe.active_mtu).unwrap_or(RdmaMtu::Mtu1024),
        link_layer: LinkLayer::from_code(probe.link_layer),
        numa_node: probe.numa_node,
    })
}

/// End of discovery: warn about and count every skipped device; the usable ones, or
/// [`VerbsError::NoUsableDevice`] naming why each was skipped when there is none.
pub fn finish<T>(usable: Vec<T>, skipped: Vec<SkippedDevice>) -> Result<Vec<T>, VerbsError> {
    for s in &skipped {
        tracing::warn!(device = %s.name, reason = %s.reason, "RDMA device skipped");
        metrics::counter!(DEVICES_SKIPPED, "reason" => s.reason_label()).increment(1);
    }
    if usable.is_empty() {
        return Err(VerbsError::NoUsableDevice(skipped));
    }
    Ok(usable)
}

/// Warn when the chosen NICs mix InfiniBand and RoCE: a P NIC of one kind cannot reach a D NIC
/// of the other, yet P may pick any listed NIC. Returns whether they mix.
pub fn warn_if_mixed(nics: &[LocalNic]) -> bool {
    let ib: Vec<&str> = nics
        .iter()
        .filter(|n| n.link_layer == LinkLayer::InfiniBand)
        .map(|n| n.name.as_str())
        .collect();
    let mixed = !ib.is_empty() && ib.len() < nics.len();
    if mixed {
        tracing::warn!(
            infiniband = ?ib,
            "RDMA devices mix InfiniBand and RoCE ports; choose one kind with the device list"
        );
    }
    mixed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::verbs::gid_rank::GidKind;

    fn probe(state: u32, gids: Vec<GidEntryInfo>) -> PortProbe {
        PortProbe {
            state,
            lid: 0,
            active_mtu: 5,
            link_layer: 2,
            gids,
            numa_node: Some(1),
        }
    }

    fn v2(index: u8, gid: &str) -> GidEntryInfo {
        GidEntryInfo {
            index,
            gid: gid.parse().unwrap(),
            kind: GidKind::RoceV2,
            ndev: Some("eth0".into()),
        }
    }

    const V4: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:c0:00:02:07";
    const ZERO: &str = "00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00";

    /// Three devices of a GPU node: one down, one without a GID, one usable. Startup uses the
    /// usable one instead of failing on the first bad one.
    #[test]
    fn inactive_and_gidless_devices_are_skipped_and_the_rest_used() {
        let present: Vec<String> = ["mlx5_0", "mlx5_1", "mlx5_2"].map(String::from).to_vec();
        let probes = [
            probe(1, vec![v2(3, V4)]),   // DOWN
            probe(4, vec![v2(3, ZERO)]), // ACTIVE, no usable GID
            probe(4, vec![v2(3, V4)]),
        ];
        let (open, mut skipped) = devices_to_open(None, &present);
        let mut nics = Vec::new();
        for (name, p) in open.iter().zip(&probes) {
            match describe_port(name, 1, None, p) {
                Ok(n) => nics.push(n),
                Err(reason) => skipped.push(SkippedDevice {
                    name: name.clone(),
                    reason,
                }),
            }
        }
        let nics = finish(nics, skipped.clone()).unwrap();
        assert_eq!(nics.len(), 1);
        let n = &nics[0];
        assert_eq!((n.name.as_str(), n.gid_index), ("mlx5_2", 3));
        assert_eq!((n.link_layer, n.numa_node), (LinkLayer::Ethernet, Some(1)));
        assert_eq!(
            skipped.iter().map(|s| s.reason_label()).collect::<Vec<_>>(),
            ["port_not_active", "no_gid"]
        );
    }

    #[test]
    fn no_usable_device_is_a_typed_error_naming_each_reason() {
        let present = vec!["mlx5_0".to_string()];
        let filter = vec!["mlx5_0".to_string(), "mlx5_9".to_string()];
        let (open, mut skipped) = devices_to_open(Some(&filter), &present);
        assert_eq!(open, ["mlx5_0"]);
        skipped.push(SkippedDevice {
            name: "mlx5_0".into(),
            reason: describe_port("mlx5_0", 1, Some(7), &probe(4, vec![v2(3, V4)])).unwrap_err(),
        });
        let err = finish::<LocalNic>(Vec::new(), skipped).unwrap_err();
        let VerbsError::NoUsableDevice(ref list) = err else {
            panic!("{err:?}")
        };
        assert_eq!(list.len(), 2);
        let msg = err.to_string();
        assert!(
            msg.contains("mlx5_9: RDMA device \"mlx5_9\" not found"),
            "{msg}"
        );
        assert!(msg.contains("configured index 7"), "{msg}");
    }

    #[test]
    fn filter_keeps_the_configured_order() {
        let present: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let filter: Vec<String> = ["c", "a", "c"].map(String::from).to_vec();
        assert_eq!(devices_to_open(Some(&filter), &present).0, ["c", "a"]);
        assert_eq!(devices_to_open(None, &present).0, present);
    }

    #[test]
    fn mixed_link_layers_are_noticed() {
        let mut a = describe_port("a", 1, None, &probe(4, vec![v2(0, V4)])).unwrap();
        assert!(!warn_if_mixed(std::slice::from_ref(&a)));
        let mut b = a.clone();
        b.link_layer = LinkLayer::InfiniBand;
        assert!(warn_if_mixed(&[a.clone(), b]));
        a.link_layer = LinkLayer::InfiniBand;
        assert!(!warn_if_mixed(&[a]));
    }
}
