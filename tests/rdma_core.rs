//! The RDMA target wired into the actor core (DESIGN.md §5): `RdmaLanding` on the fake verbs
//! backend as the coordinator's `Landing`, P's endpoints connected through the real handshake
//! daemon on loopback, pulls answered with a scripted transport. Uncertain peers are fenced by
//! moving their queue pairs to ERR before the blocks are released.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;

use kvrecv::actors::{
    Coordinator, CoordinatorParts, EventSink, OpenedPull, ScriptedTransport, StaticTopology,
};
use kvrecv::config::{KvRecvConfig, Policy};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, LoadKv, PeerId, XferStatus};
use kvrecv::rdma::handshake_daemon::{request, FrameType};
use kvrecv::rdma::verbs::fake::test_nic;
use kvrecv::rdma::verbs::qp_attrs::QpState;
use kvrecv::rdma::verbs::{
    EndpointState, FakeVerbs, HandShakeDesc, PeerBinding, QpId, RdmaTarget, RdmaTargetConfig,
};

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(10);
const P_GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05";
/// The Mooncake segment P's TE writes from, and a bystander's.
const P_SEGMENT: &str = "10.0.0.5:16001";
const OTHER_SEGMENT: &str = "10.0.0.6:16001";
const TE_FAILURE: &str = "Mooncake transfer engine returned -1";

fn layout() -> KvLayout {
    KvLayout::uniform(2, 64, 64)
}

/// The single P worker of engine `e0` (TP 1, PP 1).
fn p_peer() -> PeerId {
    PeerId::new("tcp://e0-0-0")
}

struct Rig {
    target: RdmaTarget<FakeVerbs>,
    coord: Coordinator,
    opened: UnboundedReceiver<OpenedPull>,
    events: UnboundedReceiver<KvEvent>,
    seen: Rc<RefCell<Vec<KvEvent>>>,
}

impl Rig {
    async fn start(protocol: &str, quarantine_deadline: Duration, bind: bool) -> Rig {
        let nic = test_nic(
            "mlx5_0",
            "00:00:00:00:00:00:00:00:00:00:ff:ff:7f:00:00:01"
                .parse()
                .unwrap(),
        );
        // Explicit bindings only: these tests are about what `bind_peer` says (binding by host
        // is tested through the front door, tests/rdma_front_door.rs).
        let target = RdmaTarget::start(
            FakeVerbs::new(vec![nic]),
            RdmaTargetConfig {
                peer_binding: PeerBinding::Explicit,
                ..RdmaTargetConfig::loopback(layout())
            },
        )
        .await
        .unwrap();
        // P's TE and a bystander's connect their endpoints through the daemon.
        for segment in [P_SEGMENT, OTHER_SEGMENT] {
            let req = HandShakeDesc {
                local_gid: P_GID.into(),
                local_nic_path: format!("{segment}@mlx5_0"),
                peer_nic_path: format!("{}@mlx5_0", target.segment_name()),
                qp_num: vec![0x51, 0x52],
                ..HandShakeDesc::default()
            };
            let (_, body) = request(
                target.handshake_addr(),
                Some(FrameType::Connection),
                &req.to_json_line(),
                PATIENCE,
            )
            .await
            .unwrap();
            let reply = HandShakeDesc::from_json(&body).unwrap();
            assert!(reply.reply_msg.is_empty(), "{reply:?}");
        }
        if bind {
            target.landing().bind_peer(p_peer(), P_SEGMENT);
        }
        let (transport, opened) = ScriptedTransport::new();
        let (events_tx, events) = EventSink::channel();
        let config = KvRecvConfig {
            policy: Policy::Settle,
            mooncake_protocol: if protocol == "rdma" {
                kvrecv::config::MooncakeProtocol::Rdma
            } else {
                kvrecv::config::MooncakeProtocol::Tcp
            },
            pull_timeout: Duration::from_secs(60),
            quarantine_deadline,
            peer_backoff_base: Duration::from_millis(1),
            peer_backoff_max: Duration::from_millis(5),
            layout: layout(),
            ..KvRecvConfig::default()
        };
        let coord = Coordinator::start(CoordinatorParts {
            config,
            topology: Rc::new(StaticTopology::new([StaticTopology::grid("e0", 1, 1)])),
            transport: Rc::new(transport),
            landing: target.landing(),
            events: events_tx,
            builtin_pool: true,
        });
        Rig {
            target,
            coord,
            opened,
            events,
            seen: Default::default(),
        }
    }

    async fn load(&self, id: &str, blocks: &[u32]) {
        self.coord
            .load_kv(LoadKv {
                requests: vec![KvRequest {
                    req_id: id.into(),
                    transfer_id: Some(format!("t-{id}")),
                    remote_engine_id: Some("e0".into()),
                    remote_bootstrap_addr: Some("http://127.0.0.1:8998".into()),
                    block_ids: vec![blocks.to_vec()],
                }],
            })
            .await
            .expect("receiver alive");
    }

    async fn next_pull(&mut self) -> OpenedPull {
        tokio::time::timeout(PATIENCE, self.opened.recv())
            .await
            .expect("a pull was opened")
            .expect("open")
    }

    async fn wait_for(&mut self, what: &str, pred: impl Fn(&KvEvent) -> bool) -> KvEvent {
        if let Some(ev) = self.seen.borrow().iter().find(|e| pred(e)) {
            return ev.clone();
        }
        let fut = async {
            loop {
                let ev = self.events.recv().await.expect("event channel open");
                self.seen.borrow_mut().push(ev.clone());
                if pred(&ev) {
                    return ev;
                }
            }
        };
        match tokio::time::timeout(PATIENCE, fut).await {
            Ok(ev) => ev,
            Err(_) => panic!(
                "timed out waiting for {what}; saw {:#?}",
                self.seen.borrow()
            ),
        }
    }

    /// Whether `id` is released, as the host sees it: drained, and announced by a `Released`
    /// event (returned). Two round trips through the BlockManager: an alarm the last clock
    /// move fired was woken before the first drain was sent, so what it tells the
    /// BlockManager is queued before the second.
    async fn released_now(&mut self, id: &str) -> (bool, Option<KvEvent>) {
        let mut drained = false;
        for _ in 0..2 {
            let step = self.coord.drain().await.unwrap();
            drained |= step.finished_recving.iter().any(|r| &**r == id);
        }
        while let Ok(ev) = self.events.try_recv() {
            self.seen.borrow_mut().push(ev);
        }
        let ev = self
            .seen
            .borrow()
            .iter()
            .find(|e| is_released(id)(e))
            .cloned();
        (drained, ev)
    }

    fn count(&self, pred: impl Fn(&KvEvent) -> bool) -> usize {
        self.seen.borrow().iter().filter(|e| pred(e)).count()
    }

    fn qps(&self, segment: &str) -> Vec<QpId> {
        let hs = self.target.handshake().lock().unwrap();
        hs.endpoint(&format!("{segment}@mlx5_0"))
            .unwrap()
            .local_qps
            .clone()
    }

    fn states(&self, segment: &str) -> Vec<Option<QpState>> {
        let qps = self.qps(segment);
        let hs = self.target.handshake().lock().unwrap();
        qps.iter().map(|q| hs.backend().state(*q)).collect()
    }

    fn endpoint_state(&self, segment: &str) -> EndpointState {
        let hs = self.target.handshake().lock().unwrap();
        hs.endpoint(&format!("{segment}@mlx5_0")).unwrap().state
    }
}

fn is_quarantined(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::Quarantined { req_id, .. } if &**req_id == id)
}

fn is_released(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::Released { req_id, .. } if &**req_id == id)
}

fn is_completion(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::Completion { req_id, .. } if &**req_id == id)
}

const RTS: [Option<QpState>; 2] = [Some(QpState::Rts); 2];
const ERR: [Option<QpState>; 2] = [Some(QpState::Err); 2];

/// The pull advertises the IOVAs of a registered landing window (DESIGN.md §5), each region
/// inside one descriptor buffer.
#[actix::test]
async fn pulls_advertise_a_registered_windows_base_addresses() {
    let mut rig = Rig::start("rdma", Duration::from_secs(60), true).await;
    rig.load("r1", &[1, 2]).await;
    let pull = rig.next_pull().await;
    assert_eq!(pull.peer, p_peer());
    let bases = pull.metadata().kv_caches_base_addr;
    let landing = rig.target.landing();
    let window = landing
        .live_windows()
        .into_iter()
        .find(|w| landing.window_bases(*w).is_some_and(|b| *b == bases[..]))
        .expect("the bases of a registered window");
    let d = rig.target.descriptor();
    for base in &bases {
        let b = d
            .buffers
            .iter()
            .find(|b| b.addr == *base)
            .unwrap_or_else(|| panic!("window {window}: no buffer at {base:#x}"));
        assert_eq!(b.length, 64 * 64);
    }
    pull.respond(XferStatus::Finish, &["r1"], &[], None);
    let ev = rig.wait_for("release", is_released("r1")).await;
    assert!(matches!(ev, KvEvent::Released { fenced: false, .. }));
    assert_eq!(rig.states(P_SEGMENT), RTS, "an Ok settle fences nothing");
}

/// DESIGN.md §5: an ERROR reply makes the peer Uncertain; the blocks are quarantined, the
/// peer's QPs go to ERR, and only then are the blocks released (fenced, not forced).
#[actix::test]
async fn uncertain_peer_is_quarantined_fenced_to_err_then_released() {
    let mut rig = Rig::start("rdma", Duration::from_secs(60), true).await;
    rig.load("r1", &[3, 4]).await;
    let pull = rig.next_pull().await;
    assert_eq!(rig.states(P_SEGMENT), RTS);
    pull.respond(XferStatus::Error, &[], &[], Some("exception while serving"));
    let q = rig.wait_for("quarantine", is_quarantined("r1")).await;
    let KvEvent::Quarantined { blocks, peers, .. } = q else {
        unreachable!()
    };
    assert_eq!(blocks, vec![3, 4]);
    assert_eq!(peers, vec![p_peer()]);
    let rel = rig.wait_for("release", is_released("r1")).await;
    assert!(
        matches!(rel, KvEvent::Released { fenced: true, forced: false, ref blocks, .. } if *blocks == [3, 4]),
        "{rel:?}"
    );
    assert_eq!(rig.states(P_SEGMENT), ERR, "the peer's QPs are in ERR");
    assert_eq!(rig.endpoint_state(P_SEGMENT), EndpointState::Fenced);
    assert_eq!(rig.states(OTHER_SEGMENT), RTS, "the bystander is untouched");
    assert_eq!(
        rig.coord.drain().await.unwrap().finished_recving,
        vec!["r1".into()]
    );
}

/// With `mooncake_protocol = "rdma"`, a TE failure in `err_reqs` is no proof the NIC stopped
/// writing: the peer is fenced like an uncertain one.
#[actix::test]
async fn te_failure_in_err_reqs_is_fenced_on_rdma() {
    let mut rig = Rig::start("rdma", Duration::from_secs(60), true).await;
    rig.load("r1", &[5]).await;
    let pull = rig.next_pull().await;
    pull.respond(XferStatus::Finish, &[], &["r1"], Some(TE_FAILURE));
    let c = rig.wait_for("completion", is_completion("r1")).await;
    assert!(
        matches!(c, KvEvent::Completion { ref uncertain_peers, .. } if *uncertain_peers == [p_peer()]),
        "{c:?}"
    );
    rig.wait_for("quarantine", is_quarantined("r1")).await;
    let rel = rig.wait_for("release", is_released("r1")).await;
    assert!(
        matches!(
            rel,
            KvEvent::Released {
                fenced: true,
                forced: false,
                ..
            }
        ),
        "{rel:?}"
    );
    assert_eq!(rig.states(P_SEGMENT), ERR);
    assert_eq!(rig.states(OTHER_SEGMENT), RTS);
}

/// Control for the test above: the same reply with `mooncake_protocol = "tcp"` is an explicit
/// failure, released at once without a fence.
#[actix::test]
async fn te_failure_in_err_reqs_is_not_fenced_on_tcp() {
    let mut rig = Rig::start("tcp", Duration::from_secs(60), true).await;
    rig.load("r1", &[5]).await;
    let pull = rig.next_pull().await;
    pull.respond(XferStatus::Finish, &[], &["r1"], Some(TE_FAILURE));
    let rel = rig.wait_for("release", is_released("r1")).await;
    assert!(
        matches!(rel, KvEvent::Released { fenced: false, .. }),
        "{rel:?}"
    );
    assert_eq!(rig.count(is_quarantined("r1")), 0);
    assert_eq!(rig.states(P_SEGMENT), RTS);
}

/// A peer bound to no segment is still fenced: its landing window's registrations are
/// destroyed (whatever QP it writes through, its keys are gone), so its blocks are released as
/// fenced at once, and no QP is touched.
#[actix::test]
async fn unbound_peer_is_fenced_by_its_windows_keys() {
    let mut rig = Rig::start("rdma", Duration::from_secs(3600), false).await;
    rig.load("r1", &[6]).await;
    let pull = rig.next_pull().await;
    let bases = pull.metadata().kv_caches_base_addr;
    pull.respond(XferStatus::Error, &[], &[], Some("boom"));
    let rel = rig.wait_for("release", is_released("r1")).await;
    assert!(
        matches!(
            rel,
            KvEvent::Released {
                fenced: true,
                forced: false,
                ..
            }
        ),
        "{rel:?}"
    );
    assert!(
        rig.target
            .descriptor()
            .buffers
            .iter()
            .all(|b| !bases.contains(&b.addr)),
        "the window's buffers left the descriptor"
    );
    assert_eq!(rig.states(P_SEGMENT), RTS);
    assert_eq!(rig.states(OTHER_SEGMENT), RTS);
}

/// A window whose registrations cannot be destroyed (and no QP to stop) is not a fence: the
/// blocks stay quarantined until the last-resort deadline, not a moment less, and are released
/// then, forced. Tokio's clock is paused once the rig is up (its handshakes are real sockets)
/// and moved by hand: the deadline is exact, and the runtime does not move the clock while the
/// fence runs on the blocking pool.
#[actix::test]
async fn a_window_that_cannot_be_deregistered_holds_the_blocks_until_the_deadline() {
    let ms = Duration::from_millis;
    let mut rig = Rig::start("rdma", ms(200), false).await;
    tokio::time::pause();
    rig.load("r1", &[6]).await;
    let pull = rig.next_pull().await;
    rig.target
        .handshake()
        .lock()
        .unwrap()
        .backend_mut()
        .fail_deregister = Some(16);
    pull.respond(XferStatus::Error, &[], &[], Some("boom"));
    rig.wait_for("quarantine", is_quarantined("r1")).await; // t=0
                                                            // The fence ran (its deregistration failed) before the clock moves: the hold that
                                                            // follows is the failed fence's, not a fence still under way.
    while rig
        .target
        .handshake()
        .lock()
        .unwrap()
        .backend()
        .fail_deregister
        .is_some()
    {
        tokio::task::yield_now().await;
    }
    tokio::time::advance(ms(199)).await;
    let (drained, rel) = rig.released_now("r1").await;
    assert!(
        !drained && rel.is_none(),
        "released 1 ms before the deadline: {rel:?}"
    );
    tokio::time::advance(ms(2)).await;
    let (drained, rel) = rig.released_now("r1").await;
    assert!(drained, "not drained 1 ms after the deadline");
    assert!(
        matches!(
            rel,
            Some(KvEvent::Released {
                fenced: false,
                forced: true,
                ..
            })
        ),
        "{rel:?}"
    );
}

/// After a fence the peer can re-handshake (same QP numbers: the fenced QPs are reset and
/// reconnected), and its next failure is fenced again.
#[actix::test]
async fn fenced_peer_rehandshakes_and_is_fenced_again() {
    let mut rig = Rig::start("rdma", Duration::from_secs(60), true).await;
    rig.load("r1", &[7]).await;
    rig.next_pull()
        .await
        .respond(XferStatus::Error, &[], &[], Some("boom"));
    rig.wait_for("release r1", is_released("r1")).await;
    assert_eq!(rig.states(P_SEGMENT), ERR);
    let req = HandShakeDesc {
        local_gid: P_GID.into(),
        local_nic_path: format!("{P_SEGMENT}@mlx5_0"),
        peer_nic_path: format!("{}@mlx5_0", rig.target.segment_name()),
        qp_num: vec![0x51, 0x52],
        ..HandShakeDesc::default()
    };
    let (_, body) = request(
        rig.target.handshake_addr(),
        Some(FrameType::Connection),
        &req.to_json_line(),
        PATIENCE,
    )
    .await
    .unwrap();
    assert!(HandShakeDesc::from_json(&body)
        .unwrap()
        .reply_msg
        .is_empty());
    assert_eq!(rig.states(P_SEGMENT), RTS);
    rig.load("r2", &[8]).await;
    rig.next_pull()
        .await
        .respond(XferStatus::Error, &[], &[], Some("boom"));
    let rel = rig.wait_for("release r2", is_released("r2")).await;
    assert!(matches!(rel, KvEvent::Released { fenced: true, .. }));
    assert_eq!(rig.states(P_SEGMENT), ERR);
}
