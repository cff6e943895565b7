//! Tests of the passive handshake over the fake verbs backend.

#![forbid(unsafe_code)]

use super::*;
use crate::rdma::verbs::backend::QpId;
use crate::rdma::verbs::fake::{FakeVerbs, VerbsCall};
use crate::rdma::verbs::nic::LocalNic;
use crate::rdma::verbs::qp_attrs::{connect_sequence, LocalPort, QpState, QpTransition, RemoteQp};

const D: &str = "10.0.0.7:15000";
const P_PATH: &str = "10.0.0.5:16001@mlx5_3";
const P_GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05";
const D_GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07";

fn nic(name: &str, mtu: RdmaMtu) -> LocalNic {
    LocalNic {
        name: name.into(),
        port: 1,
        lid: 9,
        gid: D_GID.parse().unwrap(),
        gid_index: 3,
        active_mtu: mtu,
        link_layer: Default::default(),
        numa_node: None,
    }
}

fn target() -> PassiveHandshake<FakeVerbs> {
    let fake = FakeVerbs::new(vec![
        nic("mlx5_0", RdmaMtu::Mtu4096),
        nic("mlx5_1", RdmaMtu::Mtu1024),
    ]);
    PassiveHandshake::new(fake, D, RdmaHandshakeConfig::default())
}

fn request(qps: &[u32], ready_ack: Option<bool>) -> HandShakeDesc {
    HandShakeDesc {
        local_gid: P_GID.into(),
        local_lid: 4,
        local_nic_path: P_PATH.into(),
        peer_nic_path: format!("{D}@mlx5_1"),
        qp_num: qps.to_vec(),
        ready_ack,
        ..HandShakeDesc::default()
    }
}

fn reject_msg(t: &mut PassiveHandshake<FakeVerbs>, req: &HandShakeDesc) -> String {
    let reply = t.on_connection_frame(&req.to_json_line());
    HandShakeDesc::from_json(&reply).unwrap().reply_msg
}

#[test]
fn handshake_creates_qps_drives_them_to_rts_and_replies() {
    let mut t = target();
    let reply = t
        .on_connection_request(request(&[0x51, 0x52], Some(false)))
        .unwrap();
    let ep = t.endpoint(P_PATH).unwrap().clone();
    assert_eq!(ep.nic, 1);
    assert_eq!(ep.state, EndpointState::AwaitingConfirmation);
    assert_eq!(
        reply,
        HandShakeDesc {
            local_gid: D_GID.into(),
            local_lid: 9,
            local_nic_path: format!("{D}@mlx5_1"),
            peer_nic_path: P_PATH.into(),
            qp_num: ep.local_qp_nums(),
            ready_ack: Some(false),
            reply_msg: String::new(),
            ..HandShakeDesc::default()
        }
    );
    let fake = t.backend();
    assert_eq!(
        fake.calls[0],
        VerbsCall::Create {
            nic: 1,
            qps: ep.local_qps.clone()
        }
    );
    let local = LocalPort {
        port: 1,
        gid_index: 3,
        active_mtu: RdmaMtu::Mtu1024,
    };
    for (qp, peer) in ep.local_qps.iter().zip([0x51, 0x52]) {
        let remote = RemoteQp {
            lid: 4,
            gid: P_GID.parse().unwrap(),
            qp_num: peer,
        };
        assert_eq!(
            fake.transitions_of(*qp),
            connect_sequence(local, RdmaMtu::Mtu4096, remote).to_vec(),
            "QP {qp:?} must be connected to P QP {peer:#x} with the §6 attributes"
        );
        assert_eq!(fake.state(*qp), Some(QpState::Rts));
    }
}

#[test]
fn configured_traffic_class_and_service_level_reach_every_rtr() {
    let fake = FakeVerbs::new(vec![nic("mlx5_1", RdmaMtu::Mtu4096)]);
    let cfg = RdmaHandshakeConfig {
        traffic_class: 106,
        service_level: 3,
        ..RdmaHandshakeConfig::default()
    };
    let mut t = PassiveHandshake::new(fake, D, cfg);
    t.on_connection_request(request(&[1, 2], None)).unwrap();
    for qp in qps(&t) {
        let rtr = t.backend().transitions_of(qp)[2].clone();
        assert!(
            matches!(&rtr, QpTransition::ToRtr(r) if (r.traffic_class, r.sl) == (106, 3)),
            "{rtr:?}"
        );
    }
}

#[test]
fn confirmation_round_with_same_qps_gets_an_empty_descriptor() {
    let mut t = target();
    t.on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    let calls = t.backend().calls.len();
    let reply = t.on_connection_frame(&request(&[1, 2], Some(true)).to_json_line());
    assert_eq!(
        HandShakeDesc::from_json(&reply).unwrap(),
        HandShakeDesc::default()
    );
    assert_eq!(t.endpoint(P_PATH).unwrap().state, EndpointState::Connected);
    assert_eq!(t.backend().calls.len(), calls, "confirmation touches no QP");
}

#[test]
fn confirmation_with_other_qps_or_without_endpoint_is_rejected() {
    let mut t = target();
    assert_eq!(
        t.on_connection_request(request(&[1, 2], Some(true))),
        Err(HandshakeReject::NothingToConfirm(P_PATH.into()))
    );
    t.on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    assert_eq!(
        t.on_connection_request(request(&[1, 3], Some(true))),
        Err(HandshakeReject::ConfirmationMismatch {
            expected: vec![1, 2],
            got: vec![1, 3]
        })
    );
    assert!(reject_msg(&mut t, &request(&[2, 1], Some(true))).contains("differ"));
    assert_eq!(
        t.endpoint(P_PATH).unwrap().state,
        EndpointState::AwaitingConfirmation
    );
}

#[test]
fn legacy_initiator_without_ready_ack_gets_none_back() {
    let mut t = target();
    let reply = t.on_connection_request(request(&[1, 2], None)).unwrap();
    assert_eq!(reply.ready_ack, None);
    assert!(!String::from_utf8(reply.to_json_line())
        .unwrap()
        .contains("ready_ack"));
    assert_eq!(t.endpoint(P_PATH).unwrap().state, EndpointState::Connected);
}

#[test]
fn rehandshake_with_same_qps_reuses_and_with_new_qps_resets() {
    let mut t = target();
    let first = t
        .on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    t.backend_mut().clear_calls();
    let again = t
        .on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    assert_eq!(again.qp_num, first.qp_num);
    assert!(t.backend().calls.is_empty(), "reuse must not touch the QPs");

    let reset = t
        .on_connection_request(request(&[7, 8], Some(false)))
        .unwrap();
    assert_eq!(
        reset.qp_num, first.qp_num,
        "the same local QPs are reset, not replaced"
    );
    let fake = t.backend();
    assert!(!fake
        .calls
        .iter()
        .any(|c| matches!(c, VerbsCall::Create { .. })));
    let qp = t.endpoint(P_PATH).unwrap().local_qps[1];
    let seq = fake.transitions_of(qp);
    assert_eq!(seq.len(), 4);
    assert_eq!(seq[0], QpTransition::ToReset);
    assert!(matches!(&seq[2], QpTransition::ToRtr(r) if r.dest_qp_num == 8));
    assert_eq!(t.endpoint(P_PATH).unwrap().peer_qps, vec![7, 8]);
    assert_eq!(fake.live_qps(), 2);
}

fn to_nic(qps: &[u32], ready_ack: Option<bool>, nic: &str) -> HandShakeDesc {
    HandShakeDesc {
        peer_nic_path: format!("{D}@{nic}"),
        ..request(qps, ready_ack)
    }
}

fn states_of(t: &PassiveHandshake<FakeVerbs>, ep: &Endpoint) -> Vec<Option<QpState>> {
    ep.local_qps.iter().map(|q| t.backend().state(*q)).collect()
}

#[test]
fn handshake_from_one_p_nic_to_a_second_d_nic_keeps_both_endpoints() {
    // Mooncake's P picks one of D's NICs per slice: the same P NIC connects to both.
    let mut t = target();
    let first = t
        .on_connection_request(to_nic(&[1, 2], Some(false), "mlx5_1"))
        .unwrap();
    t.on_connection_request(to_nic(&[1, 2], Some(true), "mlx5_1"))
        .unwrap();
    t.backend_mut().clear_calls();
    let second = t
        .on_connection_request(to_nic(&[3, 4], None, "mlx5_0"))
        .unwrap();
    assert_ne!(first.qp_num, second.qp_num);
    let on1 = t.endpoint_on("mlx5_1", P_PATH).unwrap().clone();
    let on0 = t.endpoint_on("mlx5_0", P_PATH).unwrap().clone();
    assert_eq!((on0.nic, on1.nic), (0, 1));
    assert_eq!(on1.local_qp_nums(), first.qp_num);
    assert_eq!(
        on1.state,
        EndpointState::Connected,
        "first endpoint untouched"
    );
    assert_eq!(on1.peer_qps, vec![1, 2]);
    assert_eq!(states_of(&t, &on1), vec![Some(QpState::Rts); 2]);
    assert_eq!(states_of(&t, &on0), vec![Some(QpState::Rts); 2]);
    assert!(
        t.backend().calls.iter().all(|c| match c {
            VerbsCall::Create { nic, .. } => *nic == 0,
            VerbsCall::Modify { qp, .. } | VerbsCall::Destroy { qp } => qp.nic == 0,
            _ => true,
        }),
        "the second handshake touched mlx5_1's QPs: {:?}",
        t.backend().calls
    );
    assert_eq!(t.backend().live_qps(), 4);
    assert_eq!(t.endpoints_from(P_PATH).count(), 2);
    // Each endpoint's confirmation round is its own.
    assert!(t
        .on_connection_request(to_nic(&[1, 2], Some(true), "mlx5_0"))
        .is_err());
}

#[test]
fn fence_stops_the_segments_endpoints_on_every_d_nic() {
    let mut t = target();
    t.on_connection_request(to_nic(&[1, 2], None, "mlx5_1"))
        .unwrap();
    t.on_connection_request(to_nic(&[3, 4], None, "mlx5_0"))
        .unwrap();
    assert_eq!(t.fence_server("10.0.0.5:16001"), Ok(2));
    for nic in ["mlx5_0", "mlx5_1"] {
        let ep = t.endpoint_on(nic, P_PATH).unwrap().clone();
        assert_eq!(ep.state, EndpointState::Fenced, "{nic}");
        assert_eq!(states_of(&t, &ep), vec![Some(QpState::Err); 2], "{nic}");
    }
}

#[test]
fn rehandshake_after_a_fence_gets_new_qps_and_the_old_numbers_reach_no_qp() {
    let mut t = target();
    t.on_connection_request(request(&[1, 2], None)).unwrap();
    let old = qps(&t);
    assert_eq!(t.fence_server("10.0.0.5:16001"), Ok(1));
    // Same peer QP numbers: P's retry after its endpoint was torn down.
    let reply = t.on_connection_request(request(&[1, 2], None)).unwrap();
    let new = qps(&t);
    for qp in &old {
        assert!(!new.contains(qp), "old QP {qp:?} reused");
        assert!(!reply.qp_num.contains(&qp.qp_num));
        assert_eq!(t.backend().state(*qp), None, "old QP {qp:?} not destroyed");
    }
    assert_eq!(
        states_of(&t, t.endpoint(P_PATH).unwrap()),
        vec![Some(QpState::Rts); 2]
    );
    assert_eq!(t.backend().live_qps(), 2);
}

#[test]
fn unknown_nic_wrong_server_and_bad_paths_are_rejected_without_verbs_calls() {
    let mut t = target();
    let mut r = request(&[1, 2], None);
    r.peer_nic_path = format!("{D}@mlx5_9");
    assert_eq!(
        t.on_connection_request(r.clone()),
        Err(HandshakeReject::UnknownNic("mlx5_9".into()))
    );
    assert!(reject_msg(&mut t, &r).contains("mlx5_9"));
    r.peer_nic_path = "10.9.9.9:1@mlx5_0".into();
    assert!(matches!(
        t.on_connection_request(r.clone()),
        Err(HandshakeReject::WrongServer { .. })
    ));
    r.peer_nic_path = "mlx5_0".into();
    assert!(matches!(
        t.on_connection_request(r.clone()),
        Err(HandshakeReject::BadNicPath {
            field: "peer_nic_path",
            ..
        })
    ));
    let mut r = request(&[1, 2], None);
    r.local_nic_path = String::new();
    assert!(matches!(
        t.on_connection_request(r),
        Err(HandshakeReject::BadNicPath {
            field: "local_nic_path",
            ..
        })
    ));
    assert!(t.backend().calls.is_empty());
}

#[test]
fn qp_count_mismatch_is_rejected_with_a_message() {
    let mut t = target();
    for qps in [&[][..], &[1], &[1, 2, 3]] {
        let req = request(qps, Some(false));
        assert_eq!(
            t.on_connection_request(req.clone()),
            Err(HandshakeReject::QpCountMismatch {
                got: qps.len(),
                expected: 2
            })
        );
        assert!(reject_msg(&mut t, &req).starts_with("QP count mismatch"));
    }
    assert!(t.backend().calls.is_empty());
    assert!(t.endpoint(P_PATH).is_none());
}

#[test]
fn malformed_json_gets_a_rejection_reply() {
    let mut t = target();
    for body in [&b"{not json"[..], b"", br#"{"qp_num":"x"}"#, b"\x00\x01"] {
        let reply = HandShakeDesc::from_json(&t.on_connection_frame(body)).unwrap();
        assert!(
            reply.reply_msg.starts_with("malformed handshake request"),
            "{reply:?}"
        );
        assert!(reply.qp_num.is_empty());
    }
    assert!(t.backend().calls.is_empty());
}

#[test]
fn missing_or_bad_peer_gid_is_rejected() {
    let mut t = target();
    let mut r = request(&[1, 2], None);
    r.local_gid = String::new();
    assert_eq!(
        t.on_connection_request(r.clone()),
        Err(HandshakeReject::MissingPeerGid)
    );
    r.local_gid = "fe80::1".into();
    assert!(matches!(
        t.on_connection_request(r),
        Err(HandshakeReject::BadPeerGid(_))
    ));
    assert!(t.backend().calls.is_empty());
}

#[test]
fn failed_transition_sends_every_qp_to_err_and_rejects() {
    let mut t = target();
    t.backend_mut().fail_modify_to = Some((QpState::Rts, 110));
    let err = t.on_connection_request(request(&[1, 2], None)).unwrap_err();
    assert_eq!(
        err,
        HandshakeReject::Verbs(VerbsError::Os {
            op: "ibv_modify_qp",
            errno: 110
        })
    );
    let ep = t.endpoint(P_PATH).unwrap().clone();
    assert_eq!(ep.state, EndpointState::Broken);
    // The first QP failed at RTS (it was in RTR), the second never left RESET, which
    // cannot go to ERR (the kernel refuses RESET → ERR) and accepts nothing as it is.
    assert_eq!(
        states_of(&t, &ep),
        vec![Some(QpState::Err), Some(QpState::Reset)],
        "no QP may stay in RTR"
    );
    // The next attempt replaces the broken QPs and succeeds.
    t.on_connection_request(request(&[1, 2], None)).unwrap();
    let again = t.endpoint(P_PATH).unwrap();
    assert_eq!(again.state, EndpointState::Connected);
    assert!(again.local_qps.iter().all(|q| !ep.local_qps.contains(q)));
    assert_eq!(t.backend().live_qps(), 2);
}

fn qps(t: &PassiveHandshake<FakeVerbs>) -> Vec<QpId> {
    t.endpoint(P_PATH).unwrap().local_qps.clone()
}

#[test]
fn fence_moves_the_segments_qps_to_err_and_peer_can_rehandshake() {
    let mut t = target();
    t.on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    t.on_connection_request(request(&[1, 2], Some(true)))
        .unwrap();
    let mut other = request(&[5, 6], None);
    other.local_nic_path = "10.0.0.6:16001@mlx5_0".into();
    t.on_connection_request(other).unwrap();

    assert_eq!(t.fence_server("10.0.0.5:16001"), Ok(1));
    for qp in qps(&t) {
        assert_eq!(t.backend().state(qp), Some(QpState::Err));
    }
    assert_eq!(t.endpoint(P_PATH).unwrap().state, EndpointState::Fenced);
    let bystander = t.endpoint("10.0.0.6:16001@mlx5_0").unwrap();
    assert_eq!(
        bystander.state,
        EndpointState::Connected,
        "other segments are untouched"
    );

    // A confirmation on a fenced endpoint is refused; a re-handshake, even with the same
    // peer QP numbers, connects new QPs.
    assert!(t
        .on_connection_request(request(&[1, 2], Some(true)))
        .is_err());
    t.backend_mut().clear_calls();
    t.on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    for qp in qps(&t) {
        assert_eq!(t.backend().transitions_of(qp)[0], QpTransition::ToReset);
        assert_eq!(t.backend().state(qp), Some(QpState::Rts));
    }
    assert!(t
        .backend()
        .calls
        .iter()
        .any(|c| matches!(c, VerbsCall::Create { .. })));
    assert_eq!(
        t.fence_server("10.9.9.9:1"),
        Ok(0),
        "nothing connected, nothing to fence"
    );
}

#[test]
fn a_qp_that_fails_by_itself_breaks_its_endpoint_only_and_is_replaced_next_time() {
    use crate::rdma::verbs::backend::{AsyncEvent, AsyncEventKind};
    let mut t = target();
    t.on_connection_request(request(&[1, 2], Some(false)))
        .unwrap();
    let mut other = request(&[5, 6], None);
    other.local_nic_path = "10.0.0.6:16001@mlx5_0".into();
    t.on_connection_request(other).unwrap();
    let failed = qps(&t);
    t.backend_mut().push_async_event(AsyncEvent {
        nic: 1,
        kind: AsyncEventKind::QpFatal {
            qp_num: failed[1].qp_num,
        },
    });
    assert_eq!(t.on_async_events(), 1);
    assert_eq!(t.endpoint(P_PATH).unwrap().state, EndpointState::Broken);
    assert_eq!(
        t.endpoint("10.0.0.6:16001@mlx5_0").unwrap().state,
        EndpointState::Connected
    );
    assert_eq!(t.on_async_events(), 0, "taken once");
    // Not confirmable; the same peer QPs are not reused but connected to new QPs.
    assert!(t
        .on_connection_request(request(&[1, 2], Some(true)))
        .is_err());
    t.on_connection_request(request(&[1, 2], None)).unwrap();
    assert!(qps(&t).iter().all(|q| !failed.contains(q)));
    assert_eq!(t.endpoint(P_PATH).unwrap().state, EndpointState::Connected);
}

#[test]
fn a_port_or_device_going_down_breaks_every_endpoint_on_that_nic() {
    use crate::rdma::verbs::backend::{AsyncEvent, AsyncEventKind};
    let mut t = target();
    t.on_connection_request(to_nic(&[1, 2], None, "mlx5_1"))
        .unwrap();
    t.on_connection_request(to_nic(&[3, 4], None, "mlx5_0"))
        .unwrap();
    let on = |t: &PassiveHandshake<FakeVerbs>, nic| t.endpoint_on(nic, P_PATH).unwrap().state;
    for (nic, kind) in [
        (1, AsyncEventKind::Other { code: 4 }),
        (1, AsyncEventKind::PortErr { port: 2 }),
    ] {
        t.backend_mut().push_async_event(AsyncEvent { nic, kind });
    }
    assert_eq!(t.on_async_events(), 2);
    assert_eq!(
        on(&t, "mlx5_1"),
        EndpointState::Connected,
        "COMM_EST, other port"
    );
    t.backend_mut().push_async_event(AsyncEvent {
        nic: 1,
        kind: AsyncEventKind::PortErr { port: 1 },
    });
    t.on_async_events();
    assert_eq!(on(&t, "mlx5_1"), EndpointState::Broken);
    assert_eq!(on(&t, "mlx5_0"), EndpointState::Connected);
    t.backend_mut().push_async_event(AsyncEvent {
        nic: 0,
        kind: AsyncEventKind::DeviceFatal,
    });
    t.on_async_events();
    assert_eq!(on(&t, "mlx5_0"), EndpointState::Broken);
}

#[test]
fn fence_destroys_a_qp_that_refuses_err_or_reports_failure() {
    let mut t = target();
    t.on_connection_request(request(&[1, 2], None)).unwrap();
    let before = qps(&t);
    t.backend_mut().fail_modify_to = Some((QpState::Err, 5));
    assert_eq!(t.fence_server("10.0.0.5:16001"), Ok(1));
    assert_eq!(t.backend().state(before[0]), None, "destroyed instead");
    assert_eq!(t.backend().state(before[1]), Some(QpState::Err));
    // Next handshake rebuilds a full set of QPs.
    t.on_connection_request(request(&[3, 4], None)).unwrap();
    assert_eq!(qps(&t).len(), 2);
    assert_eq!(t.backend().live_qps(), 2);

    // A NIC that does not report ERR after the call: the QP is destroyed as well.
    t.backend_mut().query_override = Some(QpState::Rts);
    assert_eq!(t.fence_server("10.0.0.5:16001"), Ok(1));
    assert_eq!(t.backend().live_qps(), 0);
}
