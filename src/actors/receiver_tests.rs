//! The Receiver actor's own tests (the decisions are [`ReceiverState`](super::ReceiverState)'s, tested there).

#![forbid(unsafe_code)]

use std::time::Duration;

use super::*;
use crate::actors::block_ledger::BlockLedger;
use crate::actors::{EngineTopology, ScriptedTransport, StaticTopology, TopologyError};
use crate::layout::KvLayout;
use crate::messages::{Drain, KvEvent, KvRequest, Outcome, ReqId, SettleOutcome};
use crate::rdma::StaticLanding;

/// A BlockManager, a scripted transport and the events, for a Receiver under test.
struct Rig {
    events: EventSink,
    rx: tokio::sync::mpsc::UnboundedReceiver<KvEvent>,
    bm: Addr<BlockManager>,
    live: SharedLiveSet,
    transport: ScriptedTransport,
    opened: tokio::sync::mpsc::UnboundedReceiver<crate::actors::scripted_transport::OpenedPull>,
}

/// The layout of [`rig_receiver`]: one layer, 8 blocks.
fn rig_config() -> KvRecvConfig {
    KvRecvConfig {
        layout: KvLayout::uniform(1, 64, 8),
        ..KvRecvConfig::default()
    }
}

fn rig_landing() -> Arc<dyn Landing> {
    Arc::new(StaticLanding::new("127.0.0.1", 1, vec![0x1000]))
}

/// Started on the current arbiter (inside an actix test).
fn rig() -> Rig {
    let (events, rx) = EventSink::channel();
    let cfg = rig_config();
    let ledger = BlockLedger::new(cfg.quarantine_deadline, None);
    let live = ledger.live_set();
    let bm = BlockManager::new(ledger, rig_landing(), cfg.policy, events.clone()).start();
    let (transport, opened) = ScriptedTransport::new();
    Rig {
        events,
        rx,
        bm,
        live,
        transport,
        opened,
    }
}

fn rig_receiver(
    topology: Rc<dyn TopologySource>,
    transport: ScriptedTransport,
    bm: &Addr<BlockManager>,
    live: &SharedLiveSet,
    events: EventSink,
) -> Receiver {
    Receiver::new(
        rig_config(),
        topology,
        Rc::new(transport),
        rig_landing(),
        bm.clone(),
        live.share(),
        events,
    )
}

/// A pull whose metadata cannot be encoded is never sent, yet each of its awaited requests
/// is settled Failed by that peer, so the request still completes exactly once.
#[actix::test]
async fn a_pull_that_cannot_be_encoded_settles_failed_and_completes() {
    let Rig {
        events,
        mut rx,
        bm,
        live,
        transport,
        mut opened,
    } = rig();
    let topology = StaticTopology::new([StaticTopology::grid("e0", 2, 1)]);
    let mut receiver = rig_receiver(Rc::new(topology), transport, &bm, &live, events);
    Arc::get_mut(&mut receiver.encoder).unwrap().encode = |_, _| {
        Err(crate::messages::WireError::Encode(
            rmp_serde::encode::Error::Syntax("simulated".into()),
        ))
    };
    let receiver = receiver.start();
    let reply = receiver
        .send(LoadKv {
            requests: vec![KvRequest {
                req_id: "r1".into(),
                transfer_id: Some("t1".into()),
                remote_engine_id: Some("e0".into()),
                remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
                block_ids: vec![vec![3]],
            }],
        })
        .await
        .unwrap();
    assert_eq!(reply.awaiting, 1);
    let mut settles = vec![];
    let outcome = loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the request completes")
            .expect("events open");
        match ev {
            KvEvent::Settled { outcome, .. } => settles.push(outcome),
            KvEvent::Completion { outcome, .. } => break outcome,
            _ => {}
        }
    };
    assert_eq!(settles.len(), 2, "both peers settled");
    assert!(settles
        .iter()
        .all(|s| matches!(s, SettleOutcome::Failed { reason: r, .. } if r.contains("not sent"))));
    assert!(matches!(outcome, Outcome::Failed { .. }));
    let step = bm.send(Drain).await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
    assert_eq!(step.invalid_block_ids, vec![3]);
    assert!(opened.try_recv().is_err(), "nothing was sent");
}

/// A source that hands out whichever topology it holds now.
struct Replaceable(RefCell<Arc<EngineTopology>>);

impl TopologySource for Replaceable {
    fn lookup(
        &self,
        _bootstrap: &str,
        _engine_id: &str,
    ) -> futures::future::LocalBoxFuture<'static, Result<EngineTopology, TopologyError>> {
        let t = EngineTopology::clone(&self.0.borrow());
        Box::pin(async move { Ok(t) })
    }
    fn cached(&self, _bootstrap: &str, _engine_id: &str) -> Option<Arc<EngineTopology>> {
        Some(self.0.borrow().clone())
    }
    fn invalidate(&self, _bootstrap: &str, _engine_id: &str) {}
}

/// The Receiver keeps the peers it derived from a cached topology; when the source holds
/// another one (P moved), the next batch goes to the new topology's peers.
#[actix::test]
async fn a_batch_goes_to_the_peers_of_the_topology_the_source_holds_now() {
    let Rig {
        events,
        bm,
        live,
        transport,
        mut opened,
        ..
    } = rig();
    let topology = Rc::new(Replaceable(RefCell::new(Arc::new(StaticTopology::grid(
        "e0", 1, 1,
    )))));
    let receiver = rig_receiver(topology.clone(), transport, &bm, &live, events).start();
    let load = |id: &str, block: u32| LoadKv {
        requests: vec![KvRequest {
            req_id: id.into(),
            transfer_id: Some(format!("t-{id}")),
            remote_engine_id: Some("e0".into()),
            remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
            block_ids: vec![vec![block]],
        }],
    };
    let mut next_peer = async || opened.recv().await.expect("a pull").peer.to_string();
    for (id, block) in [("r1", 1), ("r2", 2)] {
        assert_eq!(receiver.send(load(id, block)).await.unwrap().awaiting, 1);
        assert_eq!(next_peer().await, "tcp://e0-0-0");
    }
    let moved = EngineTopology {
        workers: vec![vec![PeerId::new("tcp://moved-0-0")]],
        ..StaticTopology::grid("e0", 1, 1)
    };
    *topology.0.borrow_mut() = Arc::new(moved);
    for (id, block) in [("r3", 3), ("r4", 4)] {
        assert_eq!(receiver.send(load(id, block)).await.unwrap().awaiting, 1);
        assert_eq!(next_peer().await, "tcp://moved-0-0");
    }
}

/// The Receiver's sweep also sweeps the transport's idle channels (what a hostile peer queued
/// on one is freed even when no pull comes).
#[actix::test]
async fn the_receivers_sweep_sweeps_the_transports_idle_channels() {
    /// Counts the sweeps it is asked for.
    struct Counting(std::cell::Cell<usize>);
    impl PeerTransport for Counting {
        fn pull(&self, _: &PeerId, _: Vec<u8>, _: crate::actors::CleanFinish) -> crate::actors::ReplyStream {
            unreachable!("no pull in this test")
        }
        fn sweep_idle(&self) {
            self.0.set(self.0.get() + 1);
        }
    }
    let Rig { events, bm, live, .. } = rig();
    let transport = Rc::new(Counting(std::cell::Cell::new(0)));
    let receiver = Receiver::new(
        rig_config(),
        Rc::new(StaticTopology::new([])),
        transport.clone(),
        rig_landing(),
        bm.clone(),
        live.share(),
        events,
    )
    .start();
    receiver.send(SweepDue).await.unwrap();
    receiver.send(SweepDue).await.unwrap();
    // At least those two (its own alarm may have fired too, on a slow machine).
    assert!(transport.0.get() >= 2, "{}", transport.0.get());
}
