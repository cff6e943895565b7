//! Queue-pair state transitions as plain data, with exactly the attribute values of PROTOCOL.md
//! §6 (Mooncake's `RdmaEndPoint::doSetupConnection`). The verbs backend executes them; tests
//! assert them. Keeping them as data is what lets the handshake be checked without a NIC.

#![forbid(unsafe_code)]

use super::gid::Gid;

/// `hop_limit` of the RTR address vector (Mooncake's `MAX_HOP_LIMIT`).
pub const HOP_LIMIT: u8 = 16;
/// `max_dest_rd_atomic` (RTR) and `max_rd_atomic` (RTS).
pub const MAX_RD_ATOMIC: u8 = 16;
/// `min_rnr_timer` (RTR).
pub const MIN_RNR_TIMER: u8 = 12;
/// Local ACK `timeout` (RTS): 4.096 µs × 2^14 ≈ 67 ms.
pub const ACK_TIMEOUT: u8 = 14;
/// `retry_cnt` (RTS).
pub const RETRY_CNT: u8 = 7;
/// `rnr_retry` (RTS); 7 means "retry forever".
pub const RNR_RETRY: u8 = 7;
/// Packet sequence numbers start at 0 on both sides (`rq_psn`, `sq_psn`).
pub const START_PSN: u32 = 0;

/// Path MTU, ordered so `min` picks the smaller one. Values are the verbs `ibv_mtu` codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RdmaMtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl RdmaMtu {
    /// From bytes (`MC_MTU`); `None` for a size verbs does not define.
    pub fn from_bytes(bytes: u32) -> Option<RdmaMtu> {
        Some(match bytes {
            256 => RdmaMtu::Mtu256,
            512 => RdmaMtu::Mtu512,
            1024 => RdmaMtu::Mtu1024,
            2048 => RdmaMtu::Mtu2048,
            4096 => RdmaMtu::Mtu4096,
            _ => return None,
        })
    }

    /// From the `ibv_mtu` code a port reports; `None` for an unknown code.
    pub fn from_code(code: u32) -> Option<RdmaMtu> {
        Some(match code {
            1 => RdmaMtu::Mtu256,
            2 => RdmaMtu::Mtu512,
            3 => RdmaMtu::Mtu1024,
            4 => RdmaMtu::Mtu2048,
            5 => RdmaMtu::Mtu4096,
            _ => return None,
        })
    }

    /// The `ibv_mtu` code.
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// A QP state as verbs names them (the subset D uses or may observe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    /// Send queue drained / send queue error: not used by D, reported if observed.
    Other(u32),
    Err,
}

/// Remote access rights granted on the QP at INIT. Mooncake grants LOCAL_WRITE | REMOTE_READ |
/// REMOTE_WRITE | REMOTE_ATOMIC on every QP; D copies that so a Mooncake initiator sees the
/// peer it expects. What P may actually touch is limited by the memory registrations, which
/// grant REMOTE_WRITE only (see `MrAccess`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAccess {
    pub local_write: bool,
    pub remote_read: bool,
    pub remote_write: bool,
    pub remote_atomic: bool,
}

impl QpAccess {
    /// The flags of PROTOCOL.md §6.
    pub const MOONCAKE: QpAccess = QpAccess {
        local_write: true,
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
    };
}

/// RESET → INIT attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitAttrs {
    pub port: u8,
    pub pkey_index: u16,
    pub access: QpAccess,
}

/// INIT → RTR attributes (address vector always global: RoCE needs a GRH).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RtrAttrs {
    pub path_mtu: RdmaMtu,
    pub dest_qp_num: u32,
    pub rq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub dlid: u16,
    pub dgid: Gid,
    pub sgid_index: u8,
    pub hop_limit: u8,
    /// GRH traffic class (`MC_IB_TC`; DSCP << 2 on RoCE v2), 0 by default.
    pub traffic_class: u8,
    pub sl: u8,
    pub port: u8,
}

/// RTR → RTS attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RtsAttrs {
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub sq_psn: u32,
    pub max_rd_atomic: u8,
}

/// One `ibv_modify_qp` call.
// Named as the verbs state machine names its transitions (to RESET, INIT, RTR, RTS, ERR).
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QpTransition {
    /// Any → RESET (only the state attribute).
    ToReset,
    ToInit(InitAttrs),
    ToRtr(RtrAttrs),
    ToRts(RtsAttrs),
    /// Any → ERR (except from RESET, which the kernel refuses): the fence. A QP in ERR silently
    /// drops incoming packets (no NAK); the writer sees its retries exhausted.
    ToErr,
}

impl QpTransition {
    /// The state the QP is in after the call succeeds.
    pub fn target(&self) -> QpState {
        match self {
            QpTransition::ToReset => QpState::Reset,
            QpTransition::ToInit(_) => QpState::Init,
            QpTransition::ToRtr(_) => QpState::Rtr,
            QpTransition::ToRts(_) => QpState::Rts,
            QpTransition::ToErr => QpState::Err,
        }
    }
}

/// The local side of a connection: which port and GID of which NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalPort {
    pub port: u8,
    pub gid_index: u8,
    pub active_mtu: RdmaMtu,
}

/// The remote side as P announced it in its HandShakeDesc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQp {
    pub lid: u16,
    pub gid: Gid,
    pub qp_num: u32,
}

/// Fabric QoS of D's QPs, set at RTR in the address handle: Mooncake's `MC_IB_TC` (GRH traffic
/// class) and `MC_IB_SL` (service level). Both 0 unless the fabric's QoS setup asks otherwise
/// (e.g. a lossless RoCE priority mapped from a DSCP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathAttrs {
    pub traffic_class: u8,
    pub service_level: u8,
}

/// The four calls that connect one QP: any → RESET → INIT → RTR → RTS. RESET first even on a
/// fresh QP because the same path re-connects an endpoint that was connected, and some NICs
/// refuse INIT from anything but RESET. Traffic class and service level 0.
pub fn connect_sequence(local: LocalPort, mtu_cap: RdmaMtu, remote: RemoteQp) -> [QpTransition; 4] {
    connect_sequence_with(local, mtu_cap, remote, PathAttrs::default())
}

/// [`connect_sequence`] with the fabric's traffic class and service level.
pub fn connect_sequence_with(
    local: LocalPort,
    mtu_cap: RdmaMtu,
    remote: RemoteQp,
    path: PathAttrs,
) -> [QpTransition; 4] {
    [
        QpTransition::ToReset,
        QpTransition::ToInit(InitAttrs {
            port: local.port,
            pkey_index: 0,
            access: QpAccess::MOONCAKE,
        }),
        QpTransition::ToRtr(RtrAttrs {
            path_mtu: local.active_mtu.min(mtu_cap),
            dest_qp_num: remote.qp_num,
            rq_psn: START_PSN,
            max_dest_rd_atomic: MAX_RD_ATOMIC,
            min_rnr_timer: MIN_RNR_TIMER,
            dlid: remote.lid,
            dgid: remote.gid,
            sgid_index: local.gid_index,
            hop_limit: HOP_LIMIT,
            traffic_class: path.traffic_class,
            sl: path.service_level,
            port: local.port,
        }),
        QpTransition::ToRts(RtsAttrs {
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_CNT,
            rnr_retry: RNR_RETRY,
            sq_psn: START_PSN,
            max_rd_atomic: MAX_RD_ATOMIC,
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_sequence_has_protocol_values() {
        let gid: Gid = "fe:80:00:00:00:00:00:00:02:42:ac:ff:fe:11:00:02"
            .parse()
            .unwrap();
        let local = LocalPort {
            port: 1,
            gid_index: 3,
            active_mtu: RdmaMtu::Mtu4096,
        };
        let seq = connect_sequence(
            local,
            RdmaMtu::Mtu1024,
            RemoteQp {
                lid: 7,
                gid,
                qp_num: 0x1234,
            },
        );
        assert_eq!(seq[0], QpTransition::ToReset);
        assert_eq!(
            seq[1],
            QpTransition::ToInit(InitAttrs {
                port: 1,
                pkey_index: 0,
                access: QpAccess::MOONCAKE
            })
        );
        let QpTransition::ToRtr(rtr) = &seq[2] else {
            panic!("RTR expected, got {:?}", seq[2])
        };
        assert_eq!(rtr.path_mtu, RdmaMtu::Mtu1024, "min(active 4096, MC_MTU 1024)");
        assert_eq!((rtr.dest_qp_num, rtr.rq_psn), (0x1234, 0));
        assert_eq!((rtr.max_dest_rd_atomic, rtr.min_rnr_timer), (16, 12));
        assert_eq!((rtr.dlid, rtr.dgid, rtr.sgid_index), (7, gid, 3));
        assert_eq!((rtr.hop_limit, rtr.sl, rtr.port), (16, 0, 1));
        assert_eq!(
            seq[3],
            QpTransition::ToRts(RtsAttrs {
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                sq_psn: 0,
                max_rd_atomic: 16
            })
        );
    }

    #[test]
    fn traffic_class_and_service_level_go_into_the_rtr_address_handle() {
        let local = LocalPort {
            port: 1,
            gid_index: 3,
            active_mtu: RdmaMtu::Mtu4096,
        };
        let remote = RemoteQp {
            lid: 0,
            gid: Gid::default(),
            qp_num: 1,
        };
        let path = PathAttrs {
            traffic_class: 106,
            service_level: 3,
        };
        let seq = connect_sequence_with(local, RdmaMtu::Mtu4096, remote, path);
        let QpTransition::ToRtr(rtr) = &seq[2] else {
            panic!("{:?}", seq[2])
        };
        assert_eq!((rtr.traffic_class, rtr.sl), (106, 3));
        let plain = connect_sequence(local, RdmaMtu::Mtu4096, remote);
        assert!(matches!(&plain[2], QpTransition::ToRtr(r) if (r.traffic_class, r.sl) == (0, 0)));
    }

    #[test]
    fn path_mtu_is_the_smaller_of_port_and_cap() {
        let local = LocalPort {
            port: 1,
            gid_index: 0,
            active_mtu: RdmaMtu::Mtu1024,
        };
        let seq = connect_sequence(
            local,
            RdmaMtu::Mtu4096,
            RemoteQp {
                lid: 0,
                gid: Gid::default(),
                qp_num: 1,
            },
        );
        assert!(matches!(&seq[2], QpTransition::ToRtr(r) if r.path_mtu == RdmaMtu::Mtu1024));
    }

    #[test]
    fn mtu_codes_and_sizes() {
        assert_eq!(RdmaMtu::from_bytes(4096).map(RdmaMtu::code), Some(5));
        assert_eq!(RdmaMtu::from_bytes(1500), None);
        assert_eq!(RdmaMtu::from_code(3), Some(RdmaMtu::Mtu1024));
        assert_eq!(RdmaMtu::from_code(0), None);
    }
}
