//! Tests of the libibverbs backend (pure helpers; the device paths need a NIC).

use super::*;

/// Runs everywhere: with no RDMA device (this CI) opening must fail with a typed error, never
/// panic; on an RDMA host it must list at least one NIC with a GID.
#[test]
fn open_returns_devices_or_a_typed_error() {
    match IbvDevices::open(&RdmaDeviceConfig::default()) {
        Ok(devs) => {
            assert!(!devs.nics().is_empty());
            assert!(devs.nics().iter().all(|n| !n.gid.is_zero()));
        }
        Err(e) => {
            eprintln!("no usable RDMA device here: {e}");
            assert!(
                matches!(
                    e,
                    VerbsError::NoDevice(_)
                        | VerbsError::Unavailable(_)
                        | VerbsError::NoUsableDevice(_)
                ),
                "{e:?}"
            )
        }
    }
    let named = RdmaDeviceConfig {
        devices: Some(vec!["no_such_dev".into()]),
        ..RdmaDeviceConfig::default()
    };
    match IbvDevices::open(&named) {
        Err(VerbsError::NoUsableDevice(skipped)) => {
            assert_eq!(skipped[0].name, "no_such_dev");
            assert_eq!(skipped[0].reason_label(), "not_present");
        }
        other => assert!(
            matches!(
                other,
                Err(VerbsError::Unavailable(_) | VerbsError::NoDevice(_))
            ),
            "{other:?}"
        ),
    }
}

#[test]
fn transitions_map_to_mooncake_masks() {
    use super::super::qp_attrs::{connect_sequence_with, LocalPort, RdmaMtu, PathAttrs, RemoteQp};
    use ffi::ibv_qp_attr_mask as m;
    let seq = connect_sequence_with(
        LocalPort {
            port: 1,
            gid_index: 3,
            active_mtu: RdmaMtu::Mtu4096,
        },
        RdmaMtu::Mtu4096,
        RemoteQp {
            lid: 5,
            gid: Gid([7; 16]),
            qp_num: 0x99,
        },
        PathAttrs {
            traffic_class: 106,
            service_level: 3,
        },
    );
    let (a, mask) = qp_attr(&seq[2]);
    assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
    assert_eq!(
        (a.dest_qp_num, a.path_mtu, a.ah_attr.grh.hop_limit),
        (0x99, 5, 16)
    );
    // SAFETY: reading the byte view of the union.
    assert_eq!(unsafe { a.ah_attr.grh.dgid.raw }, [7; 16]);
    assert_eq!(mask & m::IBV_QP_AV.0, m::IBV_QP_AV.0);
    assert_eq!((a.ah_attr.grh.traffic_class, a.ah_attr.sl), (106, 3));
    let (a, mask) = qp_attr(&QpTransition::ToErr);
    assert_eq!(
        (a.qp_state, mask),
        (ffi::ibv_qp_state::IBV_QPS_ERR, m::IBV_QP_STATE.0)
    );
    let (a, _) = qp_attr(&seq[1]);
    assert_eq!(
        a.qp_access_flags, 0b1111,
        "LOCAL_WRITE|REMOTE_WRITE|REMOTE_READ|REMOTE_ATOMIC"
    );
}
