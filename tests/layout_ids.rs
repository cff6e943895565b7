//! vLLM 0.33's layout ids end to end (PROTOCOL.md §2.7, DESIGN.md §5.4): real actors, real ZMQ,
//! the simulator's P over HTTP bootstrap writing through the Rust TE initiator into kvrecv's TCP
//! target with landing permits. What P saw of each pull comes from the simulator's counters.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_pool::owner_tag;
use kvrecv::actors::{Coordinator, CoordinatorParts, EventSink};
use kvrecv::config::KvRecvConfig;
use kvrecv::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{Allocate, KvEvent, KvRequest, LoadKv, Outcome};
use kvrecv::rdma::{TargetConfig, TcpTarget};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{Faults, LayoutStats, PrefillSim, SimConfig};
use tokio::sync::mpsc::UnboundedReceiver;

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);

struct Rig {
    coord: Coordinator,
    events: UnboundedReceiver<KvEvent>,
    sim: PrefillSim,
    _target: TcpTarget,
}

async fn rig(layers: u32, layout_ids: bool, faults: Faults) -> Rig {
    let layout = KvLayout::uniform(layers, 4096, 8);
    let target = TcpTarget::start(TargetConfig::loopback(layout.clone()))
        .await
        .unwrap();
    let (sink, events) = EventSink::channel();
    let coord = Coordinator::start(CoordinatorParts {
        config: KvRecvConfig {
            layout,
            layout_ids,
            ..KvRecvConfig::default()
        },
        topology: Rc::new(HttpTopology::new(BootstrapConfig::default())),
        transport: Rc::new(ZmqTransport::new(ZmqTransportConfig::default())),
        landing: target.landing(),
        events: sink,
        builtin_pool: true,
    });
    let writer = Arc::new(TeWriter::new(InitiatorConfig::default()));
    let sim = PrefillSim::start_with_writer(
        SimConfig {
            faults,
            ..SimConfig::default()
        },
        writer,
    )
    .await
    .unwrap();
    Rig {
        coord,
        events,
        sim,
        _target: target,
    }
}

impl Rig {
    /// Load one request of one block and wait for its completion.
    async fn request(&mut self, id: &str) -> Outcome {
        let blocks = self
            .coord
            .block_manager
            .send(Allocate {
                req_id: id.into(),
                owner_tag: owner_tag(&format!("t-{id}")),
                n: 1,
            })
            .await
            .unwrap()
            .unwrap();
        let reply = self
            .coord
            .load_kv(LoadKv {
                requests: vec![KvRequest {
                    req_id: id.into(),
                    transfer_id: Some(format!("t-{id}")),
                    remote_engine_id: Some(self.sim.engine_id().to_owned()),
                    remote_bootstrap_addr: Some(self.sim.bootstrap_url()),
                    block_ids: vec![blocks],
                }],
            })
            .await
            .unwrap();
        assert_eq!(reply.accepted, 1, "{reply:?}");
        loop {
            let ev = tokio::time::timeout(PATIENCE, self.events.recv())
                .await
                .expect("an event in time")
                .expect("events open");
            // Released after its completion: its block is free for the next request.
            if let KvEvent::Released { req_id, .. } = &ev {
                if &**req_id == id {
                    break;
                }
            }
            if let KvEvent::Completion {
                req_id, outcome, ..
            } = ev
            {
                if &*req_id == id && outcome != Outcome::Ok {
                    return outcome;
                }
            }
        }
        Outcome::Ok
    }

    fn stats(&self) -> LayoutStats {
        self.sim.worker(0, 0).layout_stats()
    }
}

/// After the first pull, a 0.33-style P holds the layout of the peer's window (the per-peer ring
/// hands the window back): every later pull omits it, P fills it from its cache, and each
/// request still lands and completes ok. Without layout ids every pull carries it.
#[actix::test]
async fn after_a_warm_up_pulls_to_a_0_33_p_carry_no_layout_and_complete_ok() {
    let mut r = rig(2, true, Faults::default()).await;
    for i in 0..20 {
        assert_eq!(r.request(&format!("r{i}")).await, Outcome::Ok, "r{i}");
    }
    let s = r.stats();
    eprintln!("2 layers, layout ids on: {s:?}");
    assert_eq!(s.misses, 0);
    assert!(s.with_layout <= 2, "{s:?}");
    assert!(s.without_layout >= 18, "{s:?}");
    assert!(
        s.smallest < s.largest,
        "a layout-less pull is smaller: {s:?}"
    );
}

/// P loses its cache (LRU eviction, restart): the next pull omits a layout P no longer holds,
/// P answers LAYOUT_MISS without writing, and D resends the same pull with the layout once:
/// the request completes ok, and the pulls after it omit the layout again.
#[actix::test]
async fn after_p_loses_its_cache_the_next_request_completes_ok_with_exactly_one_resend() {
    let mut r = rig(2, true, Faults::default()).await;
    for i in 0..3 {
        assert_eq!(r.request(&format!("w{i}")).await, Outcome::Ok);
    }
    let before = r.stats();
    assert!(before.without_layout >= 1, "warm: {before:?}");
    r.sim.worker(0, 0).evict_layouts();
    assert_eq!(r.request("after-eviction").await, Outcome::Ok);
    let after = r.stats();
    assert_eq!(after.misses, 1, "{after:?}");
    assert_eq!(
        (
            after.without_layout - before.without_layout,
            after.with_layout - before.with_layout
        ),
        (1, 1),
        "the pull without its layout, then the same pull with it: {after:?}"
    );
    assert_eq!(r.request("warm-again").await, Outcome::Ok);
    let last = r.stats();
    assert_eq!(
        (last.without_layout, last.misses),
        (after.without_layout + 1, 1)
    );
}

/// `repro --soak`'s knob: P evicts its cache every few pulls; every request still completes ok,
/// each miss answered by one resend.
#[actix::test]
async fn a_p_that_keeps_evicting_costs_resends_never_requests() {
    let faults = Faults {
        evict_layouts_every: Some(3),
        ..Faults::default()
    };
    let mut r = rig(2, true, faults).await;
    for i in 0..12 {
        assert_eq!(r.request(&format!("s{i}")).await, Outcome::Ok, "s{i}");
    }
    let s = r.stats();
    assert!(s.misses >= 2, "{s:?}");
    // Every miss is one more pull, with the layout; 12 requests in all.
    assert_eq!(s.with_layout + s.without_layout, 12 + s.misses, "{s:?}");
}

/// A P of vLLM 0.32 or older never echoes the id: it gets the layout on every pull, and works
/// as before. So does any P with layout ids off on D (no id is sent at all).
#[actix::test]
async fn a_0_32_p_and_layout_ids_off_get_the_layout_on_every_pull() {
    let legacy = Faults {
        legacy_0_32: true,
        ..Faults::default()
    };
    for (ids, faults) in [(true, legacy), (false, Faults::default())] {
        let mut r = rig(2, ids, faults).await;
        for i in 0..6 {
            assert_eq!(r.request(&format!("l{i}")).await, Outcome::Ok);
        }
        let s = r.stats();
        assert_eq!(
            (s.with_layout, s.without_layout, s.misses),
            (6, 0, 0),
            "{s:?}"
        );
        if !ids {
            // No id on the wire: the same size as a 0.32 pull (nothing but the request's own
            // ids differs from pull to pull here: one char each).
            assert_eq!(s.smallest, s.largest, "{s:?}");
        }
    }
}

/// Metadata bytes per pull with and without layout ids, at 2 and 64 layers (informational,
/// printed; asserted only in that the layout-less pull is smaller and flat in the layers).
#[actix::test]
async fn metadata_bytes_per_pull_at_2_and_64_layers() {
    let mut sizes = vec![];
    for layers in [2, 64] {
        for ids in [false, true] {
            let mut r = rig(layers, ids, Faults::default()).await;
            for i in 0..4 {
                assert_eq!(r.request(&format!("m{i}")).await, Outcome::Ok);
            }
            let s = r.stats();
            eprintln!(
                "{layers} layers, layout ids {}: largest pull {} B, smallest {} B",
                if ids { "on" } else { "off" },
                s.largest,
                s.smallest
            );
            sizes.push((layers, ids, s.largest, s.smallest));
        }
    }
    let bare: Vec<u64> = sizes.iter().filter(|s| s.1).map(|s| s.3).collect();
    assert_eq!(
        bare[0], bare[1],
        "a layout-less pull does not grow with layers"
    );
    assert!(sizes.iter().filter(|s| !s.1).all(|s| s.3 > bare[0]));
}
