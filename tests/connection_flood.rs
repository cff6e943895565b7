//! Connection caps that cannot lock a P out (issue 39): idle connections held open on the
//! handshake daemon and the data server, more than either listener's cap, must not stop a new
//! P's handshake and writes; and one peer address cannot take more than its share of a
//! listener while another address still gets in. Real actors, real ZMQ, the simulator's P over
//! HTTP bootstrap writing through the Rust TE initiator; the floods come from other loopback
//! addresses (127.0.0.2 and up) than P (127.0.0.1).

use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_pool::owner_tag;
use kvrecv::actors::{Coordinator, CoordinatorParts, EventSink};
use kvrecv::config::KvRecvConfig;
use kvrecv::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{Allocate, KvEvent, KvRequest, LoadKv, Outcome};
use kvrecv::rdma::handshake_daemon::{request, FrameType};
use kvrecv::rdma::tcp::wire::{Header, ProtoVersion, STATUS_REJECT};
use kvrecv::rdma::{TargetConfig, TcpTarget};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{PrefillSim, SimConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Safety net only: every wait ends on an event long before this. Shorter than the daemon's
/// 5 s receive timeout, so a P locked out until the flood times out does not pass.
const PATIENCE: Duration = Duration::from_secs(4);

/// Room for the floods' sockets (both ends live in this process).
fn raise_nofile() {
    let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap();
    let want = 8192.min(hard);
    if soft < want {
        rlimit::Resource::NOFILE.set(want, hard).unwrap();
    }
}

fn lo(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// `n` connections to `to` from `from`, held open and idle by the caller.
async fn flood(to: SocketAddr, from: &[IpAddr], n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let s = TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::new(from[i % from.len()], 0)).unwrap();
        held.push(
            s.connect(to)
                .await
                .expect("connected (the kernel accepts it)"),
        );
    }
    held
}

fn n(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

#[actix::test]
async fn a_thousand_idle_connections_on_both_ports_do_not_keep_a_new_p_out() {
    raise_nofile();
    let layout = KvLayout::uniform(1, 4096, 8);
    let mut tcfg = TargetConfig::loopback(layout.clone());
    // Below the flood, so that it reaches the data server's cap as it reaches the handshake
    // daemon's (64 by default).
    tcfg.max_data_connections = 512;
    let target = TcpTarget::start(tcfg).await.unwrap();
    // Ten flooding hosts: each stays under its own share, together they reach both caps.
    let hosts: Vec<IpAddr> = (2..12).map(lo).collect();
    let _handshake_flood = flood(target.handshake_addr(), &hosts, 1000).await;
    let _data_flood = flood(target.data_addr(), &hosts, 1000).await;

    let (sink, mut events) = EventSink::channel();
    let coord = Coordinator::start(CoordinatorParts {
        config: KvRecvConfig {
            layout,
            ..KvRecvConfig::default()
        },
        topology: Rc::new(HttpTopology::new(BootstrapConfig::default())),
        transport: Rc::new(ZmqTransport::new(ZmqTransportConfig::default())),
        landing: target.landing(),
        events: sink,
        builtin_pool: true,
    });
    let te = Arc::new(TeWriter::new(InitiatorConfig::default()));
    let written = te.stats();
    let sim = PrefillSim::start_with_writer(SimConfig::default(), te)
        .await
        .unwrap();
    let blocks = coord
        .block_manager
        .send(Allocate {
            req_id: "p".into(),
            owner_tag: owner_tag("t-p"),
            n: 2,
        })
        .await
        .unwrap()
        .unwrap();
    let reply = coord
        .load_kv(LoadKv {
            requests: vec![KvRequest {
                req_id: "p".into(),
                transfer_id: Some("t-p".into()),
                remote_engine_id: Some(sim.engine_id().to_owned()),
                remote_bootstrap_addr: Some(sim.bootstrap_url()),
                block_ids: vec![blocks],
            }],
        })
        .await
        .unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    let outcome = tokio::time::timeout(PATIENCE, async {
        loop {
            match events.recv().await.expect("events open") {
                KvEvent::Completion {
                    req_id, outcome, ..
                } if &*req_id == "p" => break outcome,
                _ => {}
            }
        }
    })
    .await
    .expect("the new P's pull completed while the floods are held open");
    assert!(matches!(outcome, Outcome::Ok), "{outcome:?}");
    // P handshook (Metadata) and wrote through the daemon and the data server it shares with
    // the floods: every byte of both blocks landed, no connection was refused.
    let data = target.stats();
    assert_eq!(n(&data.bytes_landed), 2 * 4096);
    assert_eq!(n(&written.failed_writes), 0);
    let hs = target.handshake_stats();
    assert!(n(&hs.metadata) >= 1);
    for (what, refused) in [
        ("handshake over cap", &hs.refused_over_cap),
        ("handshake per address", &hs.refused_per_address),
        ("data over cap", &data.refused_over_cap),
        ("data per address", &data.refused_per_address),
    ] {
        assert_eq!(n(refused), 0, "{what}");
    }
    // The floods' idle connections made room: both listeners are at most at their caps.
    assert!(n(&hs.evicted) >= 1000 - 64, "{}", n(&hs.evicted));
    assert!(n(&data.evicted) >= 1000 - 512, "{}", n(&data.evicted));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_more_than_its_share_while_another_gets_in() {
    raise_nofile();
    let mut tcfg = TargetConfig::loopback(KvLayout::uniform(1, 4096, 8));
    tcfg.max_handshakes = 64;
    tcfg.max_handshakes_per_address = 16;
    tcfg.max_data_connections = 64;
    tcfg.max_data_connections_per_address = 16;
    let target = TcpTarget::start(tcfg).await.unwrap();
    let (greedy, other) = (lo(2), lo(3));
    // The other host holds a few idle connections on each port first.
    let _other_hs = flood(target.handshake_addr(), &[other], 8).await;
    let _other_data = flood(target.data_addr(), &[other], 8).await;
    // One host opens 200 on each: far more than the listener's cap.
    let _greedy_hs = flood(target.handshake_addr(), &[greedy], 200).await;
    let _greedy_data = flood(target.data_addr(), &[greedy], 200).await;
    // The other host still gets in: a handshake exchange on a new connection. The daemon
    // accepts in order, so the greedy host's connections were all admitted before it.
    let (ty, body) = request(
        target.handshake_addr(),
        Some(FrameType::Probe),
        b"{}\n",
        PATIENCE,
    )
    .await
    .expect("the other host gets in");
    assert_eq!(
        (ty, body),
        (Some(3), b"{\"status\":\"success\"}\n".to_vec())
    );
    // Only the greedy host's own connections made room for it: it holds its share, no more,
    // and the other host's idle connections are all still open.
    let daemon = target.daemon();
    assert_eq!(daemon.open_connections_from(greedy), 16);
    assert!(daemon.open_connections_from(other) >= 8);
    let hs = target.handshake_stats();
    assert_eq!(n(&hs.evicted), 200 - 16);
    assert_eq!(n(&hs.refused_over_cap) + n(&hs.refused_per_address), 0);
    // The data server: a new connection of the other host is served (its out-of-range write
    // refused with a status frame) behind the greedy host's 200, accepted in order, so they
    // were all admitted or made room by then.
    let mut late = flood(target.data_addr(), &[other], 1).await.remove(0);
    late.write_all(&Header::new(true, 0, 8, ProtoVersion::V2).encode())
        .await
        .unwrap();
    let status = tokio::time::timeout(PATIENCE, late.read_u64_le())
        .await
        .expect("the other host's connection is served")
        .unwrap();
    assert_eq!(status, STATUS_REJECT);
    let plane = target.plane();
    let data = target.stats();
    assert_eq!(plane.open_connections_from(greedy), 16);
    assert!(plane.open_connections_from(other) >= 8);
    assert_eq!(n(&data.connections), 8 + 200 + 1);
    assert_eq!(n(&data.evicted), 200 - 16);
    assert_eq!(n(&data.refused_over_cap) + n(&data.refused_per_address), 0);
}
