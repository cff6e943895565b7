//! The RDMA target through the front door (issue 10 item 6): the builder starts the RDMA
//! target on a verbs backend (the fake one, shared with the test so it can read QP states), P's
//! TE connects its endpoint through the real handshake daemon on loopback, and the simulator's
//! P answers pulls over real ZMQ. No `bind_peer` anywhere: an uncertain peer's queue pairs are
//! found by host and fenced before its blocks are released.

#[path = "net/mod.rs"]
mod net;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrecv::config::{KvRecvConfig, MooncakeProtocol};
use kvrecv::embed::{EventStream, KvRecv};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest};
use kvrecv::rdma::handshake_daemon::{request, FrameType};
use kvrecv::rdma::verbs::fake::test_nic;
use kvrecv::rdma::verbs::qp_attrs::{QpState, QpTransition};
use kvrecv::rdma::verbs::{
    FakeVerbs, HandShakeDesc, LocalNic, MrAccess, MrKeys, QpId, RdmaHandshakeConfig,
    SegmentDescriptor, VerbsBackend, VerbsError, WriteRefused,
};
use kvrecv::sim::writer::NoopWriter;
use kvrecv::sim::{Faults, PrefillSim, SimConfig};

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);
const P_GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:7f:00:00:01";

/// The fake backend, shared: kvrecv's thread owns one handle, the test reads QP states with
/// the other.
#[derive(Clone)]
struct SharedVerbs {
    inner: Arc<Mutex<FakeVerbs>>,
    nics: Vec<LocalNic>,
}

impl SharedVerbs {
    fn new() -> Self {
        let nics = vec![test_nic("mlx5_0", P_GID.parse().unwrap())];
        SharedVerbs {
            inner: Arc::new(Mutex::new(FakeVerbs::new(nics.clone()))),
            nics,
        }
    }

    fn state(&self, qp: QpId) -> Option<QpState> {
        self.inner.lock().unwrap().state(qp)
    }
}

impl VerbsBackend for SharedVerbs {
    fn nics(&self) -> &[LocalNic] {
        &self.nics
    }
    fn create_rc_qps(&mut self, nic: usize, count: usize) -> Result<Vec<QpId>, VerbsError> {
        self.inner.lock().unwrap().create_rc_qps(nic, count)
    }
    fn modify_qp(&mut self, qp: QpId, t: &QpTransition) -> Result<(), VerbsError> {
        self.inner.lock().unwrap().modify_qp(qp, t)
    }
    fn query_qp_state(&self, qp: QpId) -> Result<QpState, VerbsError> {
        self.inner.lock().unwrap().query_qp_state(qp)
    }
    fn destroy_qp(&mut self, qp: QpId) -> Result<(), VerbsError> {
        self.inner.lock().unwrap().destroy_qp(qp)
    }
    unsafe fn register_memory_iova(
        &mut self,
        addr: u64,
        length: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<Vec<MrKeys>, VerbsError> {
        // SAFETY: forwarded as is; the caller's contract is the fake's.
        unsafe {
            self.inner
                .lock()
                .unwrap()
                .register_memory_iova(addr, length, iova, access)
        }
    }
    fn deregister_memory(&mut self, addr: u64) -> Result<(), VerbsError> {
        self.inner.lock().unwrap().deregister_memory(addr)
    }
}

struct World {
    kv: KvRecv,
    events: EventStream,
    sim: PrefillSim,
    verbs: SharedVerbs,
}

/// A worker whose quarantines last `quarantine` at most (an hour: a release inside the test's
/// time can only come from a fence).
async fn world_with(quarantine: Duration) -> World {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        pull_timeout: Duration::from_secs(3600),
        quarantine_deadline: quarantine,
        ..KvRecvConfig::default()
    };
    let verbs = SharedVerbs::new();
    let backend = verbs.clone();
    let kv = KvRecv::builder(config)
        .rdma(move || Ok(backend.clone()))
        .events(true)
        .start()
        .unwrap();
    let events = kv.events().unwrap();
    let sim = PrefillSim::start_with_writer(SimConfig::default(), Arc::new(NoopWriter))
        .await
        .unwrap();
    World {
        kv,
        events,
        sim,
        verbs,
    }
}

async fn world() -> World {
    world_with(Duration::from_secs(3600)).await
}

/// P's TE connects one endpoint from `segment` (`host:port`) to D's daemon; its QPs on D.
async fn connect(w: &World, segment: &str) -> Vec<QpId> {
    let req = HandShakeDesc {
        local_gid: P_GID.into(),
        local_nic_path: format!("{segment}@mlx5_0"),
        peer_nic_path: format!("{}@mlx5_0", w.kv.segment_name().unwrap()),
        qp_num: vec![0x51, 0x52],
        ..HandShakeDesc::default()
    };
    let (_, body) = request(
        w.kv.handshake_addr().unwrap(),
        Some(FrameType::Connection),
        &req.to_json_line(),
        PATIENCE,
    )
    .await
    .unwrap();
    let reply = HandShakeDesc::from_json(&body).unwrap();
    assert!(reply.reply_msg.is_empty(), "{reply:?}");
    // D's QP numbers for this endpoint, as the fake numbered them.
    reply
        .qp_num
        .iter()
        .map(|&qp_num| QpId { nic: 0, qp_num })
        .collect()
}

fn states(w: &World, qps: &[QpId]) -> Vec<Option<QpState>> {
    qps.iter().map(|q| w.verbs.state(*q)).collect()
}

fn req(w: &World, id: &str, blocks: &[u32]) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some(w.sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(w.sim.bootstrap_url()),
        block_ids: vec![blocks.to_vec()],
    }
}

async fn released(events: &mut EventStream, id: &str) -> KvEvent {
    loop {
        let ev = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .expect("an event in time")
            .expect("events open");
        if matches!(&ev, KvEvent::Released { req_id, .. } if &**req_id == id) {
            return ev;
        }
    }
}

const RTS: [Option<QpState>; 2] = [Some(QpState::Rts); 2];
const ERR: [Option<QpState>; 2] = [Some(QpState::Err); 2];

fn fenced(ev: &KvEvent) -> bool {
    matches!(
        ev,
        KvEvent::Released {
            fenced: true,
            forced: false,
            ..
        }
    )
}

/// P's side channel and TE share a host (as vLLM builds both from `get_ip()`): a failed peer's
/// endpoint goes to ERR with no binding given; a segment D cannot attribute to any peer goes
/// with it (it could be the peer's TE on another interface).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_peer_is_fenced_by_host_without_manual_binding() {
    let mut w = world().await;
    let p_qps = connect(&w, "127.0.0.1:16001").await;
    let orphan_qps = connect(&w, "10.9.9.9:16001").await;
    assert_eq!(states(&w, &p_qps), RTS);

    // A healthy pull: nothing is fenced.
    w.kv.load_kv(vec![req(&w, "ok", &[1, 2])]).await.unwrap();
    let ev = released(&mut w.events, "ok").await;
    assert!(
        matches!(ev, KvEvent::Released { fenced: false, .. }),
        "{ev:?}"
    );
    assert_eq!(states(&w, &p_qps), RTS, "an Ok settle fences nothing");

    // P answers ERROR: the peer is uncertain; the release waits for the fence.
    w.sim.set_faults(
        0,
        0,
        Faults {
            reject_pulls: Some("exception while serving".into()),
            ..Faults::default()
        },
    );
    w.kv.load_kv(vec![req(&w, "bad", &[3])]).await.unwrap();
    let ev = released(&mut w.events, "bad").await;
    assert!(fenced(&ev), "{ev:?}");
    assert_eq!(states(&w, &p_qps), ERR, "P's queue pairs are in ERR");
    assert_eq!(
        states(&w, &orphan_qps),
        ERR,
        "an unattributable segment too"
    );
    let stats = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(stats.protocol, MooncakeProtocol::Rdma);
    assert_eq!(stats.handshakes, 2);
    w.kv.shutdown().await;
}

/// The builder's window count is what the target registers and advertises: that many windows
/// of every layout region, each at an IOVA of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_rdma_windows_sets_the_registered_landing_windows() {
    for windows in [1usize, 3] {
        let verbs = SharedVerbs::new();
        let backend = verbs.clone();
        let kv = KvRecv::builder(KvRecvConfig {
            layout: KvLayout::uniform(2, 4096, 16),
            ..KvRecvConfig::default()
        })
        .rdma(move || Ok(backend.clone()))
        .rdma_windows(windows)
        .start()
        .unwrap();
        let (_, body) = request(
            kv.handshake_addr().unwrap(),
            Some(FrameType::Metadata),
            b"",
            PATIENCE,
        )
        .await
        .unwrap();
        let d: SegmentDescriptor = serde_json::from_slice(&body).unwrap();
        let addrs: std::collections::BTreeSet<u64> = d.buffers.iter().map(|b| b.addr).collect();
        assert_eq!(addrs.len(), windows * 2, "{windows} windows x 2 regions");
        assert_eq!(
            verbs.inner.lock().unwrap().registrations().len(),
            windows * 2
        );
        kv.shutdown().await;
    }
}

/// The builder's QP settings reach the handshake: every RTR carries the configured traffic
/// class and service level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_traffic_class_and_service_level_reach_the_qps() {
    let verbs = SharedVerbs::new();
    let backend = verbs.clone();
    let kv = KvRecv::builder(KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        ..KvRecvConfig::default()
    })
    .rdma(move || Ok(backend.clone()))
    .rdma_handshake(RdmaHandshakeConfig {
        traffic_class: 106,
        service_level: 3,
        ..RdmaHandshakeConfig::default()
    })
    .start()
    .unwrap();
    let req = HandShakeDesc {
        local_gid: P_GID.into(),
        local_nic_path: "10.0.0.5:16001@mlx5_0".into(),
        peer_nic_path: format!("{}@mlx5_0", kv.segment_name().unwrap()),
        qp_num: vec![0x51, 0x52],
        ..HandShakeDesc::default()
    };
    let (_, body) = request(
        kv.handshake_addr().unwrap(),
        Some(FrameType::Connection),
        &req.to_json_line(),
        PATIENCE,
    )
    .await
    .unwrap();
    let reply = HandShakeDesc::from_json(&body).unwrap();
    assert!(reply.reply_msg.is_empty(), "{reply:?}");
    for qp_num in reply.qp_num {
        let rtr: Vec<QpTransition> = verbs
            .inner
            .lock()
            .unwrap()
            .transitions_of(QpId { nic: 0, qp_num })
            .into_iter()
            .filter(|t| matches!(t, QpTransition::ToRtr(_)))
            .collect();
        assert!(
            matches!(&rtr[..], [QpTransition::ToRtr(r)] if (r.traffic_class, r.sl) == (106, 3)),
            "{rtr:?}"
        );
    }
    kv.shutdown().await;
}

/// P's TE connected from an address that is no peer's side-channel host: D cannot attribute
/// it, so a failed peer on no segment's host fences it rather than claim a silent success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_te_uses_another_address_fences_the_orphan_segment() {
    let mut w = world().await;
    let te_qps = connect(&w, "10.9.9.9:16001").await;
    w.sim.set_faults(
        0,
        0,
        Faults {
            reject_pulls: Some("boom".into()),
            ..Faults::default()
        },
    );
    w.kv.load_kv(vec![req(&w, "bad", &[4])]).await.unwrap();
    let ev = released(&mut w.events, "bad").await;
    assert!(fenced(&ev), "{ev:?}");
    assert_eq!(states(&w, &te_qps), ERR);
    w.kv.shutdown().await;
}

/// D's descriptor as P's TE fetches it: `(address, rkey on device 0)` of every buffer.
async fn descriptor_keys(w: &World) -> Vec<(u64, u32)> {
    let (_, body) = request(
        w.kv.handshake_addr().unwrap(),
        Some(FrameType::Metadata),
        b"",
        PATIENCE,
    )
    .await
    .unwrap();
    let d: SegmentDescriptor = serde_json::from_slice(&body).unwrap();
    d.buffers.iter().map(|b| (b.addr, b.rkey[0])).collect()
}

/// A peer whose TE has not connected yet has D's addresses and may connect after the failure:
/// no QP of its can be stopped, but its landing window's registrations are destroyed, so when
/// it connects afterwards and writes with the keys it was given, nothing lands. Its blocks are
/// released as fenced at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_not_connected_yet_is_fenced_by_its_windows_keys() {
    let mut w = world_with(Duration::from_secs(3600)).await;
    let before = descriptor_keys(&w).await;
    w.sim.set_faults(
        0,
        0,
        Faults {
            reject_pulls: Some("boom".into()),
            ..Faults::default()
        },
    );
    w.kv.load_kv(vec![req(&w, "bad", &[6])]).await.unwrap();
    let ev = released(&mut w.events, "bad").await;
    assert!(fenced(&ev), "{ev:?}");
    // The TE connects late and posts with what it had: the retired window's keys fail.
    let qps = connect(&w, "127.0.0.1:16001").await;
    assert_eq!(states(&w, &qps), RTS);
    let after = descriptor_keys(&w).await;
    let gone: Vec<&(u64, u32)> = before.iter().filter(|b| !after.contains(b)).collect();
    assert!(!gone.is_empty(), "the pull's window left the descriptor");
    for &(addr, rkey) in &before {
        let r = w
            .verbs
            .inner
            .lock()
            .unwrap()
            .deliver_write(qps[0], rkey, addr, 8);
        if gone.contains(&&(addr, rkey)) {
            assert_eq!(r, Err(WriteRefused::RemoteAccess), "{addr:#x}");
        } else {
            assert!(r.is_ok(), "a window still advertised takes writes: {r:?}");
        }
    }
    w.kv.shutdown().await;
}

/// Sleep mode on RDMA (DESIGN.md §7): a request P holds (not ready) is in flight when the
/// host pauses; the pause aborts it, P stays silent, so after `abort_grace` it settles
/// Uncertain and its blocks are released only once fenced. Then every landing window is
/// deregistered: the descriptor offers no buffer and a write with any key it ever had is
/// refused. After resume, windows are registered at fresh addresses with fresh keys, their
/// writes land, and a new request completes ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_deregisters_every_window_and_resume_registers_fresh_ones() {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        pull_timeout: Duration::from_secs(3600),
        abort_grace: Duration::from_millis(200),
        quarantine_deadline: Duration::from_secs(3600),
        ..KvRecvConfig::default()
    };
    let verbs = SharedVerbs::new();
    let backend = verbs.clone();
    let kv = KvRecv::builder(config)
        .rdma(move || Ok(backend.clone()))
        .events(true)
        .start()
        .unwrap();
    let events = kv.events().unwrap();
    // P gets a's pull and holds its transfer for ever (a stuck write), saying so.
    let (held_tx, mut held) = tokio::sync::mpsc::unbounded_channel();
    let sim = PrefillSim::start_with_writer(
        SimConfig::default(),
        Arc::new(net::HoldingWriter {
            held: "a",
            has_it: held_tx,
        }),
    )
    .await
    .unwrap();
    let mut w = World {
        kv,
        events,
        sim,
        verbs,
    };
    let qps = connect(&w, "127.0.0.1:16001").await;
    let before = descriptor_keys(&w).await;
    assert!(!before.is_empty());
    let reply = w.kv.load_kv(vec![req(&w, "a", &[5])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    tokio::time::timeout(PATIENCE, held.recv())
        .await
        .expect("P got a's pull in time")
        .expect("P runs");

    let report = tokio::time::timeout(PATIENCE, w.kv.pause())
        .await
        .expect("the pause resolves once a's blocks came back")
        .unwrap();
    assert!(
        matches!(&report.abandoned[..], [a] if &*a.req_id == "a" && a.fenced && !a.forced),
        "{report:?}"
    );
    assert_eq!(states(&w, &qps), ERR, "a's silent peer was fenced");
    assert!(
        descriptor_keys(&w).await.is_empty(),
        "paused: the descriptor offers no buffer"
    );
    assert!(
        w.verbs.inner.lock().unwrap().registrations().is_empty(),
        "every window deregistered"
    );
    // P's TE reconnects and posts with every key it ever had: nothing lands.
    let fresh_qps = connect(&w, "127.0.0.1:16001").await;
    for &(addr, rkey) in &before {
        let r = w
            .verbs
            .inner
            .lock()
            .unwrap()
            .deliver_write(fresh_qps[0], rkey, addr, 8);
        assert_eq!(r, Err(WriteRefused::RemoteAccess), "{addr:#x}");
    }
    assert!(matches!(
        w.kv.load_kv(vec![req(&w, "b", &[6])]).await,
        Err(kvrecv::embed::KvRecvError::Paused)
    ));

    w.kv.resume(kvrecv::embed::ResumeMemory::Same)
        .await
        .unwrap();
    let after = descriptor_keys(&w).await;
    assert_eq!(after.len(), before.len(), "as many windows as before");
    for (addr, rkey) in &after {
        assert!(
            before.iter().all(|(a, k)| a != addr && k != rkey),
            "fresh address and key: {addr:#x} {rkey:#x}"
        );
        let r = w
            .verbs
            .inner
            .lock()
            .unwrap()
            .deliver_write(fresh_qps[0], *rkey, *addr, 8);
        assert!(
            r.is_ok(),
            "a window registered at resume takes writes: {r:?}"
        );
    }
    let reply = w.kv.load_kv(vec![req(&w, "b", &[6])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    let ev = released(&mut w.events, "b").await;
    assert!(
        matches!(ev, KvEvent::Released { fenced: false, .. }),
        "{ev:?}"
    );
    let step = w.kv.drain().await.unwrap();
    assert_eq!(step.invalid_block_ids, vec![5], "only a failed: {step:?}");
    assert_eq!(step.finished_recving.len(), 2, "a and b: {step:?}");
    w.kv.shutdown().await;
}

/// `mooncake_protocol = "rdma"` with no verbs backend in the build is refused at start, never
/// served over TCP (P would write over RDMA into nothing).
#[cfg(not(feature = "rdma"))]
#[test]
fn rdma_protocol_without_the_feature_is_a_typed_start_error() {
    let json = r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"mooncake_protocol":"rdma",
        "kvrecv":{"layout":{"num_blocks":4,"num_groups":1,"regions":[{"layer_name":"l0",
        "layer_index":0,"group_index":0,"block_len":64,"kv_block_len":64}]}}}}"#;
    let err = kvrecv::embed::KvRecvBuilder::from_kv_transfer_config(json)
        .unwrap()
        .start()
        .unwrap_err();
    assert!(
        matches!(err, kvrecv::embed::StartError::RdmaNotBuilt),
        "{err}"
    );
}

/// Sleep mode with new host memory on RDMA: the worker starts on the host's regions, pauses
/// (every window deregistered), refuses memory that does not fit the layout (typed, still
/// paused), and resumes on a second buffer: every window it registers lands its writes inside
/// the new memory, in the region the address names, and no key of before reaches anything.
/// The old memory is dropped right after `resume` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_on_new_host_memory_registers_windows_on_it() {
    use kvrecv::embed::{PauseError, ResumeMemory};
    use kvrecv::rdma::memory::{HostMemory, HostRegion};
    use kvrecv::rdma::memory_fit::MemoryFitError;

    const REGION: usize = 4096 * 16;
    // SAFETY (both): each Vec stays allocated, unresized, while the worker may land in it:
    // `old` until the resume onto `new` returned, `new` until the shutdown.
    fn regions(bufs: &mut [Vec<u8>]) -> HostMemory {
        HostMemory::new(
            bufs.iter_mut()
                .map(|b| unsafe { HostRegion::new(b.as_mut_ptr(), b.len()) }.unwrap())
                .collect(),
        )
    }
    let mut old = vec![vec![0u8; REGION]; 2];
    let mut new = vec![vec![0u8; REGION]; 2];
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        pull_timeout: Duration::from_secs(3600),
        quarantine_deadline: Duration::from_secs(3600),
        ..KvRecvConfig::default()
    };
    let verbs = SharedVerbs::new();
    let backend = verbs.clone();
    let kv = KvRecv::builder(config)
        .rdma(move || Ok(backend.clone()))
        .host_memory(regions(&mut old))
        .events(true)
        .start()
        .unwrap();
    let events = kv.events().unwrap();
    let sim = PrefillSim::start_with_writer(SimConfig::default(), Arc::new(NoopWriter))
        .await
        .unwrap();
    let mut w = World {
        kv,
        events,
        sim,
        verbs,
    };
    let qps = connect(&w, "127.0.0.1:16001").await;
    let before = descriptor_keys(&w).await;
    let inside = |bufs: &[Vec<u8>], at: u64| {
        bufs.iter()
            .position(|b| (b.as_ptr() as u64..b.as_ptr() as u64 + b.len() as u64).contains(&at))
    };
    for &(addr, rkey) in &before {
        let at = w
            .verbs
            .inner
            .lock()
            .unwrap()
            .deliver_write(qps[0], rkey, addr, 8)
            .unwrap();
        assert!(inside(&old, at).is_some(), "started on the old memory");
    }
    let report = w.kv.pause().await.unwrap();
    assert!(report.abandoned.is_empty(), "{report:?}");

    let mut short = vec![vec![0u8; REGION], vec![0u8; REGION - 1]];
    assert!(matches!(
        w.kv.resume(ResumeMemory::Host(regions(&mut short))).await,
        Err(PauseError::MemoryDoesNotFit(MemoryFitError::TooSmall {
            region: 1,
            ..
        }))
    ));
    assert!(
        w.kv.is_paused(),
        "a refused resume leaves the worker paused"
    );
    assert!(
        w.verbs.inner.lock().unwrap().registrations().is_empty(),
        "nothing registered on memory that does not fit"
    );

    w.kv.resume(ResumeMemory::Host(regions(&mut new)))
        .await
        .unwrap();
    let old_spans: Vec<(u64, u64)> = old
        .iter()
        .map(|b| (b.as_ptr() as u64, b.len() as u64))
        .collect();
    drop(old);

    let after = descriptor_keys(&w).await;
    assert_eq!(after.len(), before.len(), "as many windows as before");
    let mut regions_seen = Vec::new();
    for &(addr, rkey) in &after {
        assert!(before.iter().all(|&(a, k)| a != addr && k != rkey));
        let b = w.verbs.inner.lock().unwrap();
        // The first and the last 8 bytes of the buffer the descriptor advertises.
        for off in [0, REGION as u64 - 8] {
            let at = b
                .deliver_write(qps[0], rkey, addr + off, 8)
                .expect("a window registered at resume takes writes");
            let region = inside(&new, at).expect("every write lands in the new memory");
            assert!(
                old_spans.iter().all(|&(s, l)| !(s..s + l).contains(&at)),
                "{at:#x} is in the old memory"
            );
            assert_eq!(at, new[region].as_ptr() as u64 + off);
            regions_seen.push(region);
        }
    }
    regions_seen.sort_unstable();
    regions_seen.dedup();
    assert_eq!(regions_seen, [0, 1], "both regions are registered again");
    for &(addr, rkey) in &before {
        let r = w
            .verbs
            .inner
            .lock()
            .unwrap()
            .deliver_write(qps[0], rkey, addr, 8);
        assert_eq!(r, Err(WriteRefused::RemoteAccess), "an old key: {addr:#x}");
    }
    let reply = w.kv.load_kv(vec![req(&w, "b", &[6])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    released(&mut w.events, "b").await;
    let step = w.kv.drain().await.unwrap();
    assert!(step.invalid_block_ids.is_empty(), "b is ok: {step:?}");
    w.kv.shutdown().await;
}
