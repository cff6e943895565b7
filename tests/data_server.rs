//! The TCP data server (PROTOCOL.md §5.2) driven by raw sockets and by the Rust initiator.

#[path = "common/data_plane.rs"]
mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{mem_off, open, pattern, req, target, target_reading, BLOCK};
use kvrecv::rdma::tcp::wire::{Header, ProtoVersion, STATUS_OK, STATUS_REJECT};
use kvrecv::rdma::{TargetConfig, TcpTarget};
use kvrecv::sim::initiator::{InitiatorConfig, TeInitiator, WriteError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(10);

async fn raw(t: &TcpTarget) -> TcpStream {
    let s = TcpStream::connect(t.data_addr()).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

async fn status(s: &mut TcpStream) -> u64 {
    tokio::time::timeout(T, s.read_u64_le())
        .await
        .expect("status frame")
        .unwrap()
}

/// The connection is closed by the server: EOF or reset, no more bytes.
async fn closed(s: &mut TcpStream) {
    let mut b = [0u8; 8];
    match tokio::time::timeout(T, s.read(&mut b))
        .await
        .expect("server closes")
    {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected {n} bytes after a rejection"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_and_v2_writes_on_one_connection_land_and_v2_acks_after_the_bytes() {
    let t = target_reading(true).await;
    let bases = open(&t, 1, &[req("a", &[3, 4])]);
    let mut s = raw(&t).await;
    let p1 = pattern(1, BLOCK as usize);
    let p2 = pattern(2, BLOCK as usize);
    // v1 write of block 3 region 0, then a v2 write of block 4 region 1 on the same lane.
    s.write_all(&Header::new(true, bases[0] + 3 * BLOCK, BLOCK, ProtoVersion::V1).encode())
        .await
        .unwrap();
    s.write_all(&p1).await.unwrap();
    s.write_all(&Header::new(true, bases[1] + 4 * BLOCK, BLOCK, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&p2).await.unwrap();
    assert_eq!(status(&mut s).await, STATUS_OK);
    // Requests on a lane are sequential, so the v2 ack proves both landed.
    let m = t.plane().memory();
    assert_eq!(m.snapshot(mem_off(0, 3), BLOCK).unwrap(), p1);
    assert_eq!(m.snapshot(mem_off(1, 4), BLOCK).unwrap(), p2);
    assert_eq!(
        m.snapshot(mem_off(0, 4), BLOCK).unwrap(),
        vec![0; BLOCK as usize]
    );
    // READ v2: OK, then the bytes; the connection stays usable.
    s.write_all(&Header::new(false, bases[1] + 4 * BLOCK + 100, 50, ProtoVersion::V2).encode())
        .await
        .unwrap();
    assert_eq!(status(&mut s).await, STATUS_OK);
    let mut back = vec![0u8; 50];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(back, p2[100..150]);
    // READ v1: only the bytes.
    s.write_all(&Header::new(false, bases[0] + 3 * BLOCK, 8, ProtoVersion::V1).encode())
        .await
        .unwrap();
    let mut back = [0u8; 8];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(back, p1[..8]);
    drop(s);
    let st = t.stats();
    assert_eq!(st.writes_landed.load(Ordering::Relaxed), 2);
    assert_eq!(st.bytes_landed.load(Ordering::Relaxed), 2 * BLOCK);
    assert_eq!(st.reads_served.load(Ordering::Relaxed), 2);
    let pb = t.landing().permits().pull_bytes(1).unwrap();
    assert_eq!(
        (pb.bytes_landed, pb.writes_landed, pb.open),
        (2 * BLOCK, 2, true)
    );
}

/// By default the data port answers no READ, not even of an open pull's blocks (vLLM's P only
/// writes into D; a READ would let anyone who reaches the port read KV in flight): a reject
/// frame, a close, counted; writes are unaffected.
#[tokio::test]
async fn reads_are_refused_unless_turned_on() {
    let mut cfg = TargetConfig::loopback(common::layout());
    cfg.windows = Some(8);
    let t = TcpTarget::start(cfg).await.unwrap();
    let bases = open(&t, 1, &[req("a", &[3])]);
    let at = bases[0] + 3 * BLOCK;
    let mut s = raw(&t).await;
    s.write_all(&Header::new(true, at, 8, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&[5; 8]).await.unwrap();
    assert_eq!(status(&mut s).await, STATUS_OK, "the write lands");
    for v in [ProtoVersion::V2, ProtoVersion::V1] {
        let mut s = raw(&t).await;
        s.write_all(&Header::new(false, at, 8, v).encode())
            .await
            .unwrap();
        if v == ProtoVersion::V2 {
            assert_eq!(status(&mut s).await, STATUS_REJECT);
        }
        closed(&mut s).await;
    }
    let st = t.stats();
    assert_eq!(st.reads_served.load(Ordering::Relaxed), 0);
    assert_eq!(st.rejected_reads_off.load(Ordering::Relaxed), 2);
    assert_eq!(st.writes_landed.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn invalid_requests_get_a_reject_frame_and_a_close_and_land_nothing() {
    let t = target(true).await;
    let bases = open(&t, 1, &[req("a", &[0, 1])]);
    let region_end = bases[0] + u64::from(common::BLOCKS) * BLOCK;
    let cases: Vec<(&str, Header)> = vec![
        ("size 0", Header::new(true, bases[0], 0, ProtoVersion::V2)),
        (
            "below base",
            Header::new(true, bases[0] - 4096, 16, ProtoVersion::V2),
        ),
        (
            "overflow",
            Header::new(true, u64::MAX - 8, 16, ProtoVersion::V2),
        ),
        (
            "across regions",
            Header::new(true, region_end - 8, 16, ProtoVersion::V2),
        ),
        (
            "past every window",
            Header::new(true, bases[0] + (1 << 40), 16, ProtoVersion::V2),
        ),
        (
            "block not in the pull",
            Header::new(true, bases[0] + 5 * BLOCK, 16, ProtoVersion::V2),
        ),
        (
            "window without a pull",
            Header::new(true, bases[0] + (1 << 21), 16, ProtoVersion::V2),
        ),
        (
            "opcode 2",
            Header {
                size: 16,
                addr: bases[0],
                opcode: 0x82,
            },
        ),
        (
            "opcode 0x7f",
            Header {
                size: 16,
                addr: bases[0],
                opcode: 0xff,
            },
        ),
    ];
    for (what, h) in &cases {
        let mut s = raw(&t).await;
        s.write_all(&h.encode()).await.unwrap();
        // The payload is not read; sending it may fail once the server has closed.
        let _ = s.write_all(&[0xAB; 16]).await;
        assert_eq!(status(&mut s).await, STATUS_REJECT, "{what}");
        closed(&mut s).await;
    }
    // v1: no frame, just the close.
    let mut s = raw(&t).await;
    s.write_all(&Header::new(true, bases[0] + 5 * BLOCK, 16, ProtoVersion::V1).encode())
        .await
        .unwrap();
    closed(&mut s).await;
    let st = t.stats();
    assert_eq!(st.rejected_out_of_range.load(Ordering::Relaxed), 5);
    assert_eq!(st.rejected_no_permit.load(Ordering::Relaxed), 3);
    assert_eq!(st.rejected_bad_opcode.load(Ordering::Relaxed), 2);
    assert_eq!(st.writes_landed.load(Ordering::Relaxed), 0);
    let m = t.plane().memory();
    assert!(
        m.snapshot(0, m.len()).unwrap().iter().all(|&b| b == 0),
        "a rejected write landed bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_lanes_and_initiators_land_every_byte() {
    let t = target(true).await;
    let blocks: Vec<u32> = (0..common::BLOCKS).collect();
    let bases = open(&t, 7, &[req("all", &blocks)]);
    let mut tasks = Vec::new();
    for i in 0..4u8 {
        let hs = t.handshake_addr();
        let bases = bases.clone();
        tasks.push(tokio::spawn(async move {
            let cfg = InitiatorConfig {
                lanes: 4,
                ..Default::default()
            };
            let ini = TeInitiator::connect(hs, cfg).await.unwrap();
            assert_eq!(ini.version(), ProtoVersion::V2);
            // Initiator i writes blocks i, i+4, ... of both regions, each in two head slices.
            let mut writes = Vec::new();
            for b in (u32::from(i)..common::BLOCKS).step_by(4) {
                for (r, base) in bases.iter().enumerate() {
                    for half in 0..2u64 {
                        let addr = base + u64::from(b) * BLOCK + half * BLOCK / 2;
                        let seed = (b as u8).wrapping_mul(7) ^ (r as u8) ^ (half as u8 * 3);
                        writes.push((addr, pattern(seed, (BLOCK / 2) as usize)));
                    }
                }
            }
            let refs: Vec<(u64, &[u8])> = writes.iter().map(|(a, d)| (*a, d.as_slice())).collect();
            for r in ini.write_batch(&refs).await {
                r.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let m = t.plane().memory();
    for b in 0..common::BLOCKS {
        for r in 0..2usize {
            for half in 0..2u64 {
                let seed = (b as u8).wrapping_mul(7) ^ (r as u8) ^ (half as u8 * 3);
                let got = m
                    .snapshot(mem_off(r, b) + half * BLOCK / 2, BLOCK / 2)
                    .unwrap();
                assert_eq!(
                    got,
                    pattern(seed, (BLOCK / 2) as usize),
                    "block {b} region {r} half {half}"
                );
            }
        }
    }
    let total = u64::from(common::BLOCKS) * 2 * BLOCK;
    assert_eq!(t.stats().bytes_landed.load(Ordering::Relaxed), total);
    assert_eq!(
        t.landing().permits().pull_bytes(7).unwrap().bytes_landed,
        total
    );
}

#[tokio::test]
async fn initiator_sees_rejections_and_recovers_on_a_new_lane() {
    let t = target_reading(true).await;
    let bases = open(&t, 1, &[req("a", &[2])]);
    let ini = TeInitiator::connect(
        t.handshake_addr(),
        InitiatorConfig {
            lanes: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(matches!(
        ini.write(bases[0] + 9 * BLOCK, &[1; 32]).await,
        Err(WriteError::Rejected)
    ));
    ini.write(bases[0] + 2 * BLOCK, &[7; 32]).await.unwrap();
    assert_eq!(
        ini.read(bases[0] + 2 * BLOCK, 32).await.unwrap(),
        vec![7; 32]
    );
}

#[tokio::test]
async fn idle_connections_are_closed() {
    let mut cfg = TargetConfig::loopback(common::layout());
    cfg.idle_timeout = Duration::from_millis(100);
    let t = TcpTarget::start(cfg).await.unwrap();
    let mut s = raw(&t).await;
    closed(&mut s).await;
    // Idle inside a payload too.
    let bases = open(&t, 1, &[req("a", &[0])]);
    let mut s = raw(&t).await;
    s.write_all(&Header::new(true, bases[0], 64, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&[1; 10]).await.unwrap();
    closed(&mut s).await;
    assert_eq!(t.stats().idle_timeouts.load(Ordering::Relaxed), 2);
    assert_eq!(t.stats().writes_landed.load(Ordering::Relaxed), 0);
}

/// The payload wait asks the kernel to wake it only once the rest of the payload is queued
/// (`SO_RCVLOWAT`): a writer that keeps sending within the idle timeout is progressing even if
/// no wakeup came, and once the payload is in, a request with no payload (a READ) wakes the
/// server again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_payload_lands_and_the_next_request_is_served() {
    let mut cfg = TargetConfig::loopback(common::layout());
    cfg.idle_timeout = Duration::from_millis(300);
    cfg.serve_reads = true;
    let t = TcpTarget::start(cfg).await.unwrap();
    let bases = open(&t, 1, &[req("a", &[0])]);
    let mut s = raw(&t).await;
    let len = 4096usize;
    s.write_all(&Header::new(true, bases[0], len as u64, ProtoVersion::V2).encode())
        .await
        .unwrap();
    // The writer's pace is the scenario: 10 bytes every 60 ms for 1.2 s, four idle timeouts'
    // worth, none of them without progress; then the rest in one piece, which is below no
    // low-water mark the server set.
    let payload = pattern(7, len);
    let trickled = 200;
    for chunk in payload[..trickled].chunks(10) {
        s.write_all(chunk).await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    s.write_all(&payload[trickled..]).await.unwrap();
    assert_eq!(status(&mut s).await, STATUS_OK);
    assert_eq!(t.stats().idle_timeouts.load(Ordering::Relaxed), 0);
    assert_eq!(t.stats().writes_landed.load(Ordering::Relaxed), 1);
    // A READ has no payload: its 24-byte header alone must wake the server.
    s.write_all(&Header::new(false, bases[0], 8, ProtoVersion::V2).encode())
        .await
        .unwrap();
    assert_eq!(status(&mut s).await, STATUS_OK);
    let mut b = [0u8; 8];
    tokio::time::timeout(T, s.read_exact(&mut b))
        .await
        .expect("read served")
        .unwrap();
    assert_eq!(&b[..], &payload[..8]);
}

/// A v2 READ of 8 bytes at `addr` is served on `s` (the connection holds a server slot).
async fn served(s: &mut TcpStream, addr: u64) {
    s.write_all(&Header::new(false, addr, 8, ProtoVersion::V2).encode())
        .await
        .unwrap();
    assert_eq!(status(s).await, STATUS_OK);
    let mut b = [0u8; 8];
    tokio::time::timeout(T, s.read_exact(&mut b))
        .await
        .expect("read served")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_data_cap_the_idlest_connection_is_closed_to_make_room() {
    let mut cfg = TargetConfig::loopback(common::layout());
    cfg.windows = Some(8);
    cfg.max_data_connections = 2;
    cfg.serve_reads = true;
    let t = TcpTarget::start(cfg).await.unwrap();
    let bases = open(&t, 1, &[req("a", &[3])]);
    let at = bases[0] + 3 * BLOCK;
    // Two idle connections hold both places.
    let (mut a, mut b) = (raw(&t).await, raw(&t).await);
    // A third is served: the idlest (a, the older) is closed to make room. Before the fix it
    // was closed at accept, for as long as the idle ones stayed (60 s by default).
    let mut c = raw(&t).await;
    served(&mut c, at).await;
    closed(&mut a).await;
    served(&mut b, at).await;
    let st = t.stats();
    assert_eq!(st.evicted.load(Ordering::Relaxed), 1);
    assert_eq!(st.refused_over_cap.load(Ordering::Relaxed), 0);
    assert_eq!(st.connections.load(Ordering::Relaxed), 3);
}

/// A lying P: an acknowledged (v2) write whose payload stops halfway, then P reports ok (its
/// FINISH). The missing bytes never land (the connection ended), and the request must not be
/// reported complete: the ok is checked against the bytes, and fails. The same request with
/// every byte acknowledged passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ok_after_a_write_cut_short_is_not_believed() {
    use kvrecv::rdma::Landing;
    let t = target(true).await;
    let (a, b) = (req("a", &[3]), req("b", &[5]));
    let bases = open(&t, 1, &[a.clone(), b.clone()]);
    let full = pattern(7, BLOCK as usize);
    // a: region 0 written in full and acknowledged; region 1 only half, then the lane closes.
    let mut s = raw(&t).await;
    s.write_all(&Header::new(true, bases[0] + 3 * BLOCK, BLOCK, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&full).await.unwrap();
    assert_eq!(status(&mut s).await, STATUS_OK);
    s.write_all(&Header::new(true, bases[1] + 3 * BLOCK, BLOCK, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&full[..BLOCK as usize / 2]).await.unwrap();
    drop(s);
    let st = t.stats().clone();
    tokio::time::timeout(T, async {
        while st.broken.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the cut-short lane ends");
    let err = t.landing().verify_ok(&a).unwrap_err();
    assert!(err.contains("4096 of 8192 bytes"), "{err}");
    // b, in the same pull, gets both its blocks in full on a fresh lane: its ok holds.
    let mut s = raw(&t).await;
    for base in &bases {
        s.write_all(&Header::new(true, base + 5 * BLOCK, BLOCK, ProtoVersion::V2).encode())
            .await
            .unwrap();
        s.write_all(&full).await.unwrap();
        assert_eq!(status(&mut s).await, STATUS_OK);
    }
    assert_eq!(t.landing().verify_ok(&b), Ok(()));
}

/// A READ streams its range chunk by chunk. Once the request is revoked (completed, its blocks
/// handed back) the stream stops: no byte is copied out of a block that may already hold the
/// next owner's KV. Here the reader stalls after its first byte, the request is revoked, the
/// next pull writes 0xBB into the region's last block, and the reader then drains its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_stops_at_revocation_and_never_sees_the_next_owners_bytes() {
    const BIG: u64 = 4 << 20; // 16 blocks: a 64 MiB region, far more than socket buffers hold
    let mut cfg = TargetConfig::loopback(kvrecv::layout::KvLayout::uniform(1, BIG, 16));
    cfg.serve_reads = true;
    cfg.windows = Some(8);
    let t = TcpTarget::start(cfg).await.unwrap();
    let a = req("a", &(0..16).collect::<Vec<u32>>());
    let bases = open(&t, 1, std::slice::from_ref(&a));
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(t.data_addr()).await.unwrap();
    s.write_all(&Header::new(false, bases[0], 16 * BIG, ProtoVersion::V1).encode())
        .await
        .unwrap();
    let mut first = [0u8; 1];
    tokio::time::timeout(T, s.read_exact(&mut first))
        .await
        .expect("the READ streams")
        .unwrap();
    common::revoke(&t, &a).await;
    let b = req("b", &[15]);
    let bases_b = open(&t, 2, std::slice::from_ref(&b));
    let mut w = raw(&t).await;
    w.write_all(&Header::new(true, bases_b[0] + 15 * BIG, BIG, ProtoVersion::V2).encode())
        .await
        .unwrap();
    w.write_all(&vec![0xbb; BIG as usize]).await.unwrap();
    assert_eq!(status(&mut w).await, STATUS_OK);
    let mut got = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut got))
        .await
        .expect("the READ ends");
    assert!(
        !got.contains(&0xbb),
        "the reader saw the next owner's bytes"
    );
    assert!(
        (got.len() as u64) < 16 * BIG - 1,
        "the stream was cut short"
    );
    assert_eq!(t.stats().rejected_revoked.load(Ordering::Relaxed), 1);
}

/// v1 writes carry no acknowledgement, so P's ok is checked against what landed. A write landed
/// twice (a retry, or a P padding its count) covers its bytes once: the block it never wrote
/// still fails the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1_write_landed_twice_does_not_stand_in_for_a_missing_one() {
    use kvrecv::rdma::Landing;
    let t = target(true).await;
    let c = req("c", &[7]);
    let bases = open(&t, 1, std::slice::from_ref(&c));
    let full = pattern(9, BLOCK as usize);
    let mut s = raw(&t).await;
    for _ in 0..2 {
        s.write_all(&Header::new(true, bases[0] + 7 * BLOCK, BLOCK, ProtoVersion::V1).encode())
            .await
            .unwrap();
        s.write_all(&full).await.unwrap();
    }
    let st = t.stats().clone();
    tokio::time::timeout(T, async {
        while st.writes_landed.load(Ordering::Relaxed) < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("both writes land");
    // 8192 bytes landed, but region 1's block 7 (4096 of the 8192 expected) never did.
    let err = t.landing().verify_ok(&c).unwrap_err();
    assert!(err.contains("4096 of 8192 bytes"), "{err}");
    s.write_all(&Header::new(true, bases[1] + 7 * BLOCK, BLOCK, ProtoVersion::V1).encode())
        .await
        .unwrap();
    s.write_all(&full).await.unwrap();
    tokio::time::timeout(T, async {
        while st.writes_landed.load(Ordering::Relaxed) < 3 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the third write lands");
    assert_eq!(t.landing().verify_ok(&c), Ok(()));
}
