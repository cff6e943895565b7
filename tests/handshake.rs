//! The Mooncake P2P handshake daemon, driven with raw frames (PROTOCOL.md §5.1).

#[path = "common/data_plane.rs"]
mod common;

use std::time::Duration;

use kvrecv::messages::handshake::{HandShakeDesc, SegmentDescriptor};
use kvrecv::rdma::handshake_daemon::{request, FrameType};
use kvrecv::rdma::tcp::windows::ADDRESS_LIMIT;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn metadata_returns_the_compact_alphabetical_descriptor_covering_every_window() {
    let t = common::target(true).await;
    let (ty, body) = request(
        t.handshake_addr(),
        Some(FrameType::Metadata),
        b"{\"name\":\"p\"}\n",
        T,
    )
    .await
    .unwrap();
    assert_eq!(ty, Some(1));
    assert_eq!(body, t.descriptor().to_wire());
    assert_eq!(*body.last().unwrap(), b'\n');
    let text = std::str::from_utf8(&body).unwrap();
    assert!(text.starts_with("{\"buffers\":[{\"addr\":"), "{text}");
    let keys = [
        "\"name\":",
        "\"protocol\":\"tcp\"",
        "\"rdma_server_name\":\"\"",
        "\"tcp_data_host\":\"127.0.0.1\"",
        "\"tcp_data_port\":",
        "\"tcp_proto_version\":2",
        "\"timestamp\":",
    ];
    let mut at = text.rfind("}]").unwrap();
    for k in keys {
        let pos = text[at..]
            .find(k)
            .unwrap_or_else(|| panic!("{k} missing or out of order in {text}"));
        at += pos;
    }
    assert!(!text.contains("tcp_caps"));
    let d: SegmentDescriptor = serde_json::from_slice(&body).unwrap();
    assert_eq!(d.name, format!("127.0.0.1:{}", t.handshake_addr().port()));
    assert_eq!(d.tcp_data_port, t.data_addr().port());
    // One buffer spanning every window; every region base any pull can get is inside it.
    assert_eq!(d.buffers.len(), 1);
    for (i, _) in (0..20u64).enumerate() {
        let bases = common::open(&t, i as u64, &[common::req(&format!("r{i}"), &[0])]);
        for b in bases {
            let end = b + u64::from(common::BLOCKS) * common::BLOCK;
            assert!(
                d.buffers
                    .iter()
                    .any(|x| x.addr <= b && end <= x.addr + x.length),
                "{b:#x} not covered"
            );
            assert!(end < ADDRESS_LIMIT);
        }
        common::revoke(&t, &common::req(&format!("r{i}"), &[0])).await;
    }
    assert!(d
        .buffers
        .iter()
        .all(|b| b.name == d.name && b.addr != 0 && b.length != 0));
    // The first two pulls got different windows.
    assert_eq!(
        t.handshake_stats()
            .metadata
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test]
async fn notify_probe_connection_and_legacy_frames_get_their_replies() {
    let t = common::target(true).await;
    let a = t.handshake_addr();
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
    let (ty, body) = request(a, Some(FrameType::Probe), b"{}\n", T)
        .await
        .unwrap();
    assert_eq!(
        (ty, body.as_slice()),
        (Some(3), &b"{\"status\":\"success\"}\n"[..])
    );
    let hs = br#"{"local_nic_path":"10.0.0.1:1@mlx5_0","peer_nic_path":"x@mlx5_0","qp_num":[1,2],"extra":1}"#;
    let (ty, body) = request(a, Some(FrameType::Connection), hs, T)
        .await
        .unwrap();
    assert_eq!(ty, Some(0));
    let d: HandShakeDesc = serde_json::from_slice(&body).unwrap();
    assert!(!d.reply_msg.is_empty());
    assert_eq!(d.peer_nic_path, "10.0.0.1:1@mlx5_0");
    // Legacy: no type byte; handled as Connection and answered without a type byte.
    let (ty, body) = request(a, None, hs, T).await.unwrap();
    assert_eq!(ty, None);
    assert_eq!(body[0], b'{');
    let d: HandShakeDesc = serde_json::from_slice(&body).unwrap();
    assert!(!d.reply_msg.is_empty());
}

async fn send_len_expect_close(addr: std::net::SocketAddr, len: u64) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&len.to_le_bytes()).await.unwrap();
    let _ = s.write_all(&[1u8; 64]).await;
    let mut buf = Vec::new();
    // The daemon closes without a reply (reset or EOF, both are a close).
    let r = tokio::time::timeout(T, s.read_to_end(&mut buf))
        .await
        .expect("closed before the safety timeout");
    assert!(
        r.is_err() || buf.is_empty(),
        "got a reply to length {len}: {buf:?}"
    );
}

#[tokio::test]
async fn zero_and_oversized_lengths_are_closed_without_reply() {
    let t = common::target(true).await;
    send_len_expect_close(t.handshake_addr(), 0).await;
    send_len_expect_close(t.handshake_addr(), (1 << 20) + 1).await;
    assert_eq!(
        t.handshake_stats()
            .refused
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

#[tokio::test]
async fn reply_comes_before_eof_then_half_close_and_connections_are_concurrent() {
    let t = common::target(true).await;
    // A client that connected and says nothing must not hold up others.
    let _stalled = TcpStream::connect(t.handshake_addr()).await.unwrap();
    let mut s = TcpStream::connect(t.handshake_addr()).await.unwrap();
    let body = b"{}\n";
    let mut frame = ((body.len() + 1) as u64).to_le_bytes().to_vec();
    frame.push(3);
    frame.extend_from_slice(body);
    s.write_all(&frame).await.unwrap();
    // We keep our write side open: the reply must still arrive, followed by the server's EOF.
    let mut buf = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut buf))
        .await
        .expect("reply and half-close")
        .unwrap();
    let mut want = 22u64.to_le_bytes().to_vec();
    want.push(3);
    want.extend_from_slice(b"{\"status\":\"success\"}\n");
    assert_eq!(buf, want);
}

#[tokio::test]
async fn at_the_handshake_cap_the_idlest_connection_is_closed_to_make_room() {
    let mut cfg = kvrecv::rdma::TargetConfig::loopback(common::layout());
    cfg.max_handshakes = 2;
    let t = kvrecv::rdma::TcpTarget::start(cfg).await.unwrap();
    let addr = t.handshake_addr();
    let stats = t.handshake_stats();
    // Two clients that say nothing hold both places (the daemon would wait 5 s for a frame).
    let mut a = TcpStream::connect(addr).await.unwrap();
    let mut b = TcpStream::connect(addr).await.unwrap();
    // A third is served at once: the idlest of the two (a, the older) makes room for it.
    // Before the fix it was closed at accept until one of them timed out.
    let (ty, body) = request(addr, Some(FrameType::Probe), b"{}\n", T)
        .await
        .expect("served at the cap");
    assert_eq!(
        (ty, body),
        (Some(3), b"{\"status\":\"success\"}\n".to_vec())
    );
    let mut buf = Vec::new();
    let r = tokio::time::timeout(T, a.read_to_end(&mut buf))
        .await
        .expect("a closed before the safety timeout");
    assert!(r.is_err() || buf.is_empty(), "{buf:?}");
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&stats.evicted), 1);
    assert_eq!(n(&stats.refused_over_cap), 0);
    // b was kept: its request is still answered on the connection it opened first.
    let body = b"{}\n";
    let mut frame = ((body.len() + 1) as u64).to_le_bytes().to_vec();
    frame.push(3);
    frame.extend_from_slice(body);
    b.write_all(&frame).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(T, b.read_to_end(&mut reply))
        .await
        .expect("b answered")
        .unwrap();
    assert!(reply.ends_with(b"{\"status\":\"success\"}\n"), "{reply:?}");
}
