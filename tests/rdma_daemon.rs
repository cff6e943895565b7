//! The handshake daemon in RDMA mode (PROTOCOL.md §5.1, §6), over real loopback TCP, with the
//! fake verbs backend behind the passive endpoint handshake.

use std::time::Duration;

use kvrecv::layout::KvLayout;
use kvrecv::rdma::handshake_daemon::{request, FrameType};
use kvrecv::rdma::verbs::qp_attrs::{QpState, RdmaMtu};
use kvrecv::rdma::verbs::{
    EndpointState, FakeVerbs, HandShakeDesc, LocalNic, RdmaTarget, RdmaTargetConfig,
    SegmentDescriptor,
};

const T: Duration = Duration::from_secs(10);
const D_GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:7f:00:00:01";
const P_GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05";
const P_PATH: &str = "10.0.0.5:16001@mlx5_3";

fn nic(name: &str) -> LocalNic {
    LocalNic {
        name: name.into(),
        port: 1,
        lid: 7,
        gid: D_GID.parse().unwrap(),
        gid_index: 3,
        active_mtu: RdmaMtu::Mtu4096,
        link_layer: Default::default(),
        numa_node: None,
    }
}

async fn target() -> RdmaTarget<FakeVerbs> {
    RdmaTarget::start(
        FakeVerbs::new(vec![nic("mlx5_0"), nic("mlx5_1")]),
        RdmaTargetConfig::loopback(KvLayout::uniform(2, 64, 8)),
    )
    .await
    .unwrap()
}

fn hs_request(t: &RdmaTarget<FakeVerbs>, qps: &[u32]) -> Vec<u8> {
    HandShakeDesc {
        local_gid: P_GID.into(),
        local_lid: 4,
        local_nic_path: P_PATH.into(),
        peer_nic_path: format!("{}@mlx5_1", t.segment_name()),
        qp_num: qps.to_vec(),
        ready_ack: Some(false),
        ..HandShakeDesc::default()
    }
    .to_json_line()
}

#[tokio::test]
async fn connection_frame_gets_d_qp_numbers_and_connects_the_endpoint() {
    let t = target().await;
    let (ty, body) = request(
        t.handshake_addr(),
        Some(FrameType::Connection),
        &hs_request(&t, &[0x51, 0x52]),
        T,
    )
    .await
    .unwrap();
    assert_eq!(ty, Some(0), "reply carries the request's type byte");
    assert_eq!(body.last(), Some(&b'\n'));
    let reply = HandShakeDesc::from_json(&body).unwrap();
    let hs = t.handshake().lock().unwrap();
    let ep = hs.endpoint(P_PATH).expect("endpoint keyed by P's NIC path");
    assert_eq!(ep.state, EndpointState::AwaitingConfirmation);
    assert_eq!(ep.peer_qps, vec![0x51, 0x52]);
    assert_eq!(
        reply,
        HandShakeDesc {
            local_gid: D_GID.into(),
            local_lid: 7,
            local_nic_path: format!("{}@mlx5_1", t.segment_name()),
            peer_nic_path: P_PATH.into(),
            qp_num: ep.local_qp_nums(),
            ready_ack: Some(false),
            ..HandShakeDesc::default()
        }
    );
    assert_eq!(ep.local_qps.len(), 2);
    for qp in &ep.local_qps {
        assert_eq!(qp.nic, 1, "QPs on the NIC P asked for");
        assert_eq!(hs.backend().state(*qp), Some(QpState::Rts));
    }
    assert_eq!(
        t.handshake_stats()
            .connection
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test]
async fn legacy_untyped_frame_is_a_connection_answered_without_type_byte() {
    let t = target().await;
    let (ty, body) = request(t.handshake_addr(), None, &hs_request(&t, &[1, 2]), T)
        .await
        .unwrap();
    assert_eq!(ty, None);
    assert_eq!(body[0], b'{');
    let reply = HandShakeDesc::from_json(&body).unwrap();
    assert!(reply.reply_msg.is_empty(), "{reply:?}");
    let hs = t.handshake().lock().unwrap();
    assert_eq!(reply.qp_num, hs.endpoint(P_PATH).unwrap().local_qp_nums());
}

#[tokio::test]
async fn ready_ack_round_over_the_daemon_confirms_the_endpoint() {
    let t = target().await;
    let a = t.handshake_addr();
    request(a, Some(FrameType::Connection), &hs_request(&t, &[1, 2]), T)
        .await
        .unwrap();
    let mut confirm = HandShakeDesc::from_json(&hs_request(&t, &[1, 2])).unwrap();
    confirm.ready_ack = Some(true);
    let (ty, body) = request(a, Some(FrameType::Connection), &confirm.to_json_line(), T)
        .await
        .unwrap();
    assert_eq!(ty, Some(0));
    assert_eq!(
        HandShakeDesc::from_json(&body).unwrap(),
        HandShakeDesc::default()
    );
    assert_eq!(
        t.handshake()
            .lock()
            .unwrap()
            .endpoint(P_PATH)
            .unwrap()
            .state,
        EndpointState::Connected
    );
}

#[tokio::test]
async fn qp_count_mismatch_and_malformed_json_get_a_reply_msg_and_no_qps() {
    let t = target().await;
    let a = t.handshake_addr();
    let (ty, body) = request(
        a,
        Some(FrameType::Connection),
        &hs_request(&t, &[1, 2, 3]),
        T,
    )
    .await
    .unwrap();
    assert_eq!(ty, Some(0));
    let reply = HandShakeDesc::from_json(&body).unwrap();
    assert!(
        reply.reply_msg.starts_with("QP count mismatch"),
        "{reply:?}"
    );
    assert!(reply.qp_num.is_empty());
    for garbage in [&b"{not json"[..], b"\"x\"", br#"{"qp_num":[-1]}"#] {
        let (_, body) = request(a, Some(FrameType::Connection), garbage, T)
            .await
            .unwrap();
        let reply = HandShakeDesc::from_json(&body).unwrap();
        assert!(
            reply.reply_msg.starts_with("malformed handshake request"),
            "{reply:?}"
        );
    }
    let hs = t.handshake().lock().unwrap();
    assert!(hs.endpoint(P_PATH).is_none());
    assert_eq!(
        hs.backend().live_qps(),
        0,
        "a refused handshake creates no QP"
    );
}

#[tokio::test]
async fn metadata_returns_the_rdma_descriptor_compact_alphabetical_newline_terminated() {
    let t = target().await;
    let (ty, body) = request(t.handshake_addr(), Some(FrameType::Metadata), b"{}\n", T)
        .await
        .unwrap();
    assert_eq!(ty, Some(1));
    assert_eq!(body, t.descriptor().to_wire());
    assert_eq!(body.last(), Some(&b'\n'));
    assert_eq!(body.iter().filter(|&&b| b == b'\n').count(), 1);
    assert!(!body.contains(&b' '), "compact");
    // serde_json's Map sorts keys: re-encoding the parsed value must give the same bytes.
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let mut sorted = serde_json::to_vec(&v).unwrap();
    sorted.push(b'\n');
    assert_eq!(body, sorted, "keys alphabetical at every level");
    let d: SegmentDescriptor = serde_json::from_slice(&body).unwrap();
    assert_eq!(d.protocol, "rdma");
    assert_eq!(d.name, t.segment_name());
    assert_eq!(
        d.devices
            .iter()
            .map(|x| x.name.as_str())
            .collect::<Vec<_>>(),
        ["mlx5_0", "mlx5_1"]
    );
    let landing = t.landing();
    // One buffer per landing window and layout region, each at the window's IOVA.
    let windows = landing.live_windows();
    assert_eq!(
        windows.len(),
        RdmaTargetConfig::loopback(KvLayout::uniform(2, 64, 8)).windows
    );
    assert_eq!(d.buffers.len(), windows.len() * 2);
    for (i, slot) in windows.iter().enumerate() {
        let bases = landing.window_bases(*slot).unwrap();
        for (r, b) in d.buffers[2 * i..2 * i + 2].iter().enumerate() {
            assert_eq!((b.lkey.len(), b.rkey.len()), (2, 2), "one key per device");
            assert_eq!(b.addr, bases[r], "the window's IOVA for region {r}");
            assert_eq!(b.length, 64 * 8);
        }
    }
    let rkeys: std::collections::BTreeSet<u32> =
        d.buffers.iter().flat_map(|b| b.rkey.clone()).collect();
    assert_eq!(
        rkeys.len(),
        d.buffers.len() * 2,
        "no two buffers share a key"
    );
    let (host, port) = kvrecv::rdma::Landing::endpoint(&*landing);
    assert_eq!(format!("{host}:{port}"), t.segment_name());
}

#[tokio::test]
async fn notify_and_probe_are_unchanged_in_rdma_mode() {
    let t = target().await;
    let a = t.handshake_addr();
    let (ty, body) = request(a, Some(FrameType::Probe), b"{}\n", T)
        .await
        .unwrap();
    assert_eq!(
        (ty, body.as_slice()),
        (Some(3), &b"{\"status\":\"success\"}\n"[..])
    );
    let (ty, body) = request(
        a,
        Some(FrameType::Notify),
        b"{\"name\":\"x\",\"notify_msg\":\"hi\"}\n",
        T,
    )
    .await
    .unwrap();
    assert_eq!(
        (ty, body.as_slice()),
        (
            Some(2),
            &b"{\"name\":\"\",\"notify_msg\":\"success\"}\n"[..]
        )
    );
}

/// RLIMIT_MEMLOCK is checked before anything is registered: a hard limit below the layout × NICs
/// is a typed start error saying what to raise; a soft limit below it is raised to the hard one.
#[tokio::test]
async fn memlock_below_the_layout_is_refused_and_a_low_soft_limit_raised() {
    // 2 regions × 8 blocks × 64 bytes = 1 KiB per NIC, one page each; 2 NICs: 8 KiB pinned.
    let layout = KvLayout::uniform(2, 64, 8);
    let mut fake = FakeVerbs::new(vec![nic("mlx5_0"), nic("mlx5_1")]);
    fake.memlock = Some((4096, 4096));
    let err = RdmaTarget::start(fake, RdmaTargetConfig::loopback(layout.clone()))
        .await
        .unwrap_err();
    let kvrecv::rdma::verbs::RdmaTargetError::Register(
        kvrecv::rdma::verbs::VerbsError::MemlockTooLow {
            need, nics, soft, ..
        },
    ) = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!((*need, *nics, *soft), (8192, 2, 4096));
    assert!(err.to_string().contains("ulimit -l"), "{err}");

    let mut fake = FakeVerbs::new(vec![nic("mlx5_0"), nic("mlx5_1")]);
    fake.memlock = Some((4096, 1 << 20));
    let t = RdmaTarget::start(fake, RdmaTargetConfig::loopback(layout))
        .await
        .unwrap();
    let hs = t.handshake().lock().unwrap();
    assert_eq!(
        hs.backend().memlock,
        Some((1 << 20, 1 << 20)),
        "soft raised to hard"
    );
}

/// One request over a blocking std socket whose read times out by itself (the runtime under
/// test may be stalled): (type byte, body).
fn std_request(addr: std::net::SocketAddr, ty: u8, body: &[u8]) -> std::io::Result<(u8, Vec<u8>)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, T)?;
    s.set_read_timeout(Some(T))?;
    s.write_all(&(body.len() as u64 + 1).to_le_bytes())?;
    s.write_all(&[ty])?;
    s.write_all(body)?;
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let mut payload = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut payload)?;
    let body = payload.split_off(1);
    Ok((payload[0], body))
}

/// A handshake whose firmware call hangs (the fake holds `create_rc_qps`) does not stop the
/// daemon: on a runtime with a single worker, another connection is still answered meanwhile,
/// and the held handshake completes once released. (Before, the verbs calls ran on the worker,
/// so the second request timed out.)
#[test]
fn a_blocked_handshake_does_not_stop_the_daemon_answering_others() {
    use kvrecv::rdma::verbs::fake::FakeGate;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let mut fake = FakeVerbs::new(vec![nic("mlx5_0"), nic("mlx5_1")]);
    fake.gate = Some(FakeGate {
        entered: entered_tx,
        release: release_rx,
    });
    let t = rt
        .block_on(RdmaTarget::start(
            fake,
            RdmaTargetConfig::loopback(KvLayout::uniform(2, 64, 8)),
        ))
        .unwrap();
    // Rebound after `t`, so dropped before it if an assertion fails: the held call is
    // released before `t`'s Drop waits for the handshake lock that call holds.
    let release = release;
    let addr = t.handshake_addr();
    let body = hs_request(&t, &[1, 2]);
    let held = std::thread::spawn(move || std_request(addr, 0, &body));
    entered
        .recv_timeout(T)
        .expect("the handshake reached the backend");

    let (ty, desc) = std_request(addr, 1, b"{}\n")
        .expect("a Metadata request is answered while a handshake's verbs call is held");
    assert_eq!(ty, 1);
    assert_eq!(desc, t.descriptor().to_wire());

    release.send(()).unwrap();
    let (ty, reply) = held.join().unwrap().unwrap();
    assert_eq!(ty, 0);
    let reply = HandShakeDesc::from_json(&reply).unwrap();
    assert!(reply.reply_msg.is_empty(), "{reply:?}");
    assert_eq!(reply.qp_num.len(), 2);
    rt.block_on(async move { drop(t) });
}

/// The target reads its devices' async events by itself: a QP that fails on its own (here the
/// fake reports IBV_EVENT_QP_FATAL) leaves its endpoint Broken, not "Connected".
#[tokio::test]
async fn the_target_reads_async_events_and_breaks_the_failed_endpoint() {
    use kvrecv::rdma::verbs::{AsyncEvent, AsyncEventKind};
    let t = target().await;
    let (_, body) = request(
        t.handshake_addr(),
        Some(FrameType::Connection),
        &hs_request(&t, &[1, 2]),
        T,
    )
    .await
    .unwrap();
    let reply = HandShakeDesc::from_json(&body).unwrap();
    assert!(reply.reply_msg.is_empty(), "{reply:?}");
    let mut handled = t.async_events_handled();
    t.handshake()
        .lock()
        .unwrap()
        .backend_mut()
        .push_async_event(AsyncEvent {
            nic: 1,
            kind: AsyncEventKind::QpFatal {
                qp_num: reply.qp_num[0],
            },
        });
    tokio::time::timeout(T, handled.wait_for(|n| *n >= 1))
        .await
        .expect("the event is read")
        .unwrap();
    let hs = t.handshake().lock().unwrap();
    assert_eq!(hs.endpoint(P_PATH).unwrap().state, EndpointState::Broken);
}
