//! Tests of the RDMA landing over the fake verbs backend.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use super::*;
use crate::messages::handshake::SegmentDescriptor;
use crate::messages::handshake_desc::HandShakeDesc;
use crate::messages::RequestMeta;
use crate::rdma::verbs::backend::QpId;
use crate::rdma::verbs::fake::{test_nic, FakeVerbs, WriteRefused};
use crate::rdma::verbs::passive::{RdmaHandshakeConfig, PassiveHandshake};
use crate::rdma::verbs::qp_attrs::QpState;
use crate::rdma::verbs::PeerBinding;

const D: &str = "10.0.0.7:15000";
const BLOCK: u64 = 64;
const BLOCKS: u32 = 4;

fn shared() -> SharedHandshake<FakeVerbs> {
    let nic = test_nic(
        "mlx5_0",
        "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07"
            .parse()
            .unwrap(),
    );
    Arc::new(Mutex::new(PassiveHandshake::new(
        FakeVerbs::new(vec![nic]),
        D,
        RdmaHandshakeConfig::default(),
    )))
}

/// D's memory: two layout regions of 4 blocks of 64 bytes, back to back.
struct Memory(Box<[u8]>);

impl Memory {
    fn new() -> Self {
        Memory(vec![0u8; 2 * (BLOCK as usize) * BLOCKS as usize].into_boxed_slice())
    }
    fn spans(&mut self) -> Vec<HostSpan> {
        let base = self.0.as_mut_ptr() as u64;
        let n = BLOCK * u64::from(BLOCKS);
        vec![(base, n), (base + n, n)]
    }
    fn base(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

fn landing_with(
    t: &SharedHandshake<FakeVerbs>,
    mem: &mut Memory,
    windows: usize,
    binding: PeerBinding,
) -> RdmaLanding<FakeVerbs> {
    RdmaLanding::new(
        "10.0.0.7",
        15000,
        &KvLayout::uniform(2, BLOCK, BLOCKS),
        mem.spans(),
        WindowsConfig {
            windows,
            first_slot: Some(0),
            ..WindowsConfig::default()
        },
        Arc::clone(t),
        RdmaFence::with_binding(Arc::clone(t), binding),
    )
    .unwrap()
}

/// P's endpoint handshake from NIC path `p_path` with P's QP numbers `qps`; D's QPs.
fn handshake(t: &SharedHandshake<FakeVerbs>, p_path: &str, qps: [u32; 2]) -> Vec<QpId> {
    let reply = t
        .lock()
        .unwrap()
        .on_connection_request(HandShakeDesc {
            local_gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05".into(),
            local_nic_path: p_path.into(),
            peer_nic_path: format!("{D}@mlx5_0"),
            qp_num: qps.to_vec(),
            ..HandShakeDesc::default()
        })
        .unwrap();
    assert!(reply.reply_msg.is_empty(), "{}", reply.reply_msg);
    reply
        .qp_num
        .iter()
        .map(|&qp_num| QpId { nic: 0, qp_num })
        .collect()
}

/// What Mooncake's TE does to post a slice at `addr`: find the descriptor buffer holding
/// it and take its rkey for D's device 0 (`selectPeerDevice`).
fn rkey_for(desc: &PublishedDescriptor, addr: u64) -> Option<u32> {
    let d: SegmentDescriptor = serde_json::from_slice(&desc.wire()).unwrap();
    d.buffers
        .iter()
        .find(|b| b.addr <= addr && addr < b.addr + b.length)
        .map(|b| b.rkey[0])
}

fn request(id: &str) -> RequestMeta {
    RequestMeta::new(id, id, "e", "b", &[vec![1]])
}

fn open(l: &RdmaLanding<FakeVerbs>, peer: &PeerId, pull_id: u64) -> crate::rdma::RegionBases {
    let reqs = [Arc::new(request("r"))];
    l.open_pull(&PullWindow {
        pull_id,
        peer,
        requests: &reqs,
    })
}

/// The completion's path through the BlockManager: revoke with the suspect, then fence it.
fn complete_with_suspect(l: &RdmaLanding<FakeVerbs>, peer: &PeerId) -> Result<(), FenceError> {
    let r = request("r");
    let revoked = l.revoke(&RevokeRequest {
        req: &r,
        suspects: std::slice::from_ref(peer),
        poison_until: std::time::Instant::now(),
    });
    assert_eq!(revoked.revocation, Revocation::NotExact);
    futures::executor::block_on(l.fence(std::slice::from_ref(peer)))
}

/// With every window poisoned, a batch's pulls are refused (none is opened) instead of
/// being handed the unregistered slot, whose writes would all fail at P.
#[test]
fn a_batch_with_no_clean_window_is_refused_not_sent() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 1, PeerBinding::ByHost);
    let (p, q) = (
        PeerId::new("tcp://10.0.0.5:41233"),
        PeerId::new("tcp://10.0.0.6:41233"),
    );
    let reqs = [Arc::new(request("r"))];
    let batch = |id: u64| {
        l.open_pulls(&[
            PullWindow {
                pull_id: id,
                peer: &p,
                requests: &reqs,
            },
            PullWindow {
                pull_id: id + 1,
                peer: &q,
                requests: &reqs,
            },
        ])
    };
    let bases = batch(1).expect("one clean window, shared by both hosts");
    assert_eq!(bases[0], bases[1]);
    // p turns suspect: its (the only) window is poisoned until the fence retires it.
    let r = request("r");
    l.revoke(&RevokeRequest {
        req: &r,
        suspects: std::slice::from_ref(&p),
        poison_until: std::time::Instant::now(),
    });
    let e = batch(3).unwrap_err();
    assert_eq!((e.needed, e.poisoned, e.usable), (2, 1, 1), "{e}");
    assert!(e.to_string().starts_with(crate::rdma::NO_CLEAN_WINDOW));
    // One at a time, a pull still fails safe: the unregistered slot.
    assert_ne!(open(&l, &q, 5), bases[0]);
}

#[test]
fn a_slice_retried_after_the_fence_and_a_rehandshake_cannot_land() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 2, PeerBinding::ByHost);
    let p = PeerId::new("tcp://10.0.0.5:41233");
    let qps = handshake(&t, "10.0.0.5:16001@mlx5_0", [1, 2]);
    let bases = open(&l, &p, 1);
    // Block 1 of region 1, through the pull's window.
    let addr = bases[1] + BLOCK;
    let rkey = rkey_for(&l.published(), addr).expect("the pull's window is advertised");
    let landed = t
        .lock()
        .unwrap()
        .backend()
        .deliver_write(qps[0], rkey, addr, 8);
    assert_eq!(landed, Ok(mem.base() + BLOCK * u64::from(BLOCKS) + BLOCK));

    // P goes Uncertain; D fences it and may release the request's blocks.
    complete_with_suspect(&l, &p).unwrap();
    for qp in &qps {
        assert_eq!(t.lock().unwrap().backend().state(*qp), Some(QpState::Err));
    }
    let b = t.lock().unwrap();
    assert_eq!(
        b.backend().deliver_write(qps[0], rkey, addr, 8),
        Err(WriteRefused::Dropped),
        "the fenced QP drops the write in flight"
    );
    drop(b);

    // Retry-exceeded: Mooncake re-handshakes (new QPs, RTS) and re-posts the slice.
    let fresh = handshake(&t, "10.0.0.5:16001@mlx5_0", [3, 4]);
    let b = t.lock().unwrap();
    assert!(b
        .backend()
        .state(fresh[0])
        .is_some_and(|s| s == QpState::Rts));
    assert_eq!(
        b.backend().deliver_write(fresh[0], rkey, addr, 8),
        Err(WriteRefused::RemoteAccess),
        "the old rkey died with its window"
    );
    drop(b);
    assert_eq!(
        rkey_for(&l.published(), addr),
        None,
        "a reloaded descriptor names no buffer for the old address: Mooncake fails the slice"
    );

    // The peer's next pull lands through a clean window of its own keys.
    let next = open(&l, &p, 2);
    assert_ne!(next[1], bases[1]);
    let rkey2 = rkey_for(&l.published(), next[1]).unwrap();
    let b = t.lock().unwrap();
    assert!(b
        .backend()
        .deliver_write(fresh[0], rkey2, next[1], 8)
        .is_ok());
    assert_eq!(
        l.live_windows().len(),
        2,
        "a window was registered in its place"
    );
}

#[test]
fn another_hosts_window_survives_the_fence_and_its_writes_still_land() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 2, PeerBinding::ByHost);
    let (p, q) = (
        PeerId::new("tcp://10.0.0.5:1"),
        PeerId::new("tcp://10.0.0.6:1"),
    );
    handshake(&t, "10.0.0.5:16001@mlx5_0", [1, 2]);
    let q_qps = handshake(&t, "10.0.0.6:16001@mlx5_0", [1, 2]);
    let p_bases = open(&l, &p, 1);
    let q_bases = open(&l, &q, 2);
    assert_ne!(p_bases[0], q_bases[0], "one window per host");
    let q_rkey = rkey_for(&l.published(), q_bases[0]).unwrap();
    complete_with_suspect(&l, &p).unwrap();
    assert_eq!(rkey_for(&l.published(), p_bases[0]), None);
    assert_eq!(rkey_for(&l.published(), q_bases[0]), Some(q_rkey));
    let b = t.lock().unwrap();
    assert!(b
        .backend()
        .deliver_write(q_qps[0], q_rkey, q_bases[0], 8)
        .is_ok());
}

#[test]
fn a_peer_whose_queue_pairs_are_unknown_is_fenced_by_its_windows_keys() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 1, PeerBinding::Explicit);
    let qps = handshake(&t, "10.0.0.5:16001@mlx5_0", [1, 2]);
    let stranger = PeerId::new("tcp://10.0.0.9:1");
    let bases = open(&l, &stranger, 1);
    let rkey = rkey_for(&l.published(), bases[0]).unwrap();
    complete_with_suspect(&l, &stranger).unwrap();
    let b = t.lock().unwrap();
    assert_eq!(
        b.backend().state(qps[0]),
        Some(QpState::Rts),
        "no binding: no QP touched"
    );
    assert_eq!(
        b.backend().deliver_write(qps[0], rkey, bases[0], 8),
        Err(WriteRefused::RemoteAccess),
        "whatever QP it writes through, its keys are gone"
    );
}

#[test]
fn a_window_that_cannot_be_deregistered_fails_the_fence_and_stays_out_of_rotation() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 2, PeerBinding::ByHost);
    let p = PeerId::new("tcp://10.0.0.5:1");
    handshake(&t, "10.0.0.5:16001@mlx5_0", [1, 2]);
    let bases = open(&l, &p, 1);
    t.lock().unwrap().backend_mut().fail_deregister = Some(16);
    let err = complete_with_suspect(&l, &p).unwrap_err();
    assert!(
        matches!(&err, FenceError::Failed { peer, reason } if *peer == p && reason.contains("deregister")),
        "{err}"
    );
    let other = open(&l, &PeerId::new("tcp://10.0.0.8:1"), 2);
    assert_ne!(other[0], bases[0], "a poisoned window is handed to nobody");
    // The next fence retries the deregistration.
    complete_with_suspect(&l, &p).unwrap();
    assert_eq!(rkey_for(&l.published(), bases[0]), None);
}

#[test]
fn a_completion_without_suspects_poisons_nothing() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 1, PeerBinding::ByHost);
    let p = PeerId::new("tcp://10.0.0.5:1");
    let first = open(&l, &p, 1);
    let r = request("r");
    let revoked = l.revoke(&RevokeRequest {
        req: &r,
        suspects: &[],
        poison_until: std::time::Instant::now(),
    });
    assert_eq!(revoked.poisoned, 0);
    assert_eq!(open(&l, &p, 2), first);
    assert_eq!(l.endpoint(), ("10.0.0.7", 15000));
}

/// Sleep mode: paused, every window is deregistered (a write with any rkey the descriptor
/// had is refused, on any QP) and the descriptor lists no buffer; resumed, as many windows
/// are registered at slots never advertised before, and their writes land.
#[test]
fn pause_deregisters_every_window_and_resume_registers_fresh_ones() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 2, PeerBinding::ByHost);
    let (p, q) = (
        PeerId::new("tcp://10.0.0.5:1"),
        PeerId::new("tcp://10.0.0.6:1"),
    );
    let qps = handshake(&t, "10.0.0.5:16001@mlx5_0", [1, 2]);
    let before = l.live_windows();
    let d: SegmentDescriptor = serde_json::from_slice(&l.published().wire()).unwrap();
    let old: Vec<(u32, u64)> = d.buffers.iter().map(|b| (b.rkey[0], b.addr)).collect();
    assert_eq!(old.len(), 2 * 2, "two windows of two regions");
    let p_bases = open(&l, &p, 1);
    open(&l, &q, 2);

    l.pause().unwrap();
    assert!(l.live_windows().is_empty());
    assert!(t.lock().unwrap().backend().registrations().is_empty());
    let d: SegmentDescriptor = serde_json::from_slice(&l.published().wire()).unwrap();
    assert!(d.buffers.is_empty(), "a reloaded descriptor offers nothing");
    for &(rkey, addr) in &old {
        assert_eq!(
            t.lock()
                .unwrap()
                .backend()
                .deliver_write(qps[0], rkey, addr, 8),
            Err(WriteRefused::RemoteAccess),
            "rkey {rkey:#x} died with its window"
        );
    }
    let paused_bases = open(&l, &p, 3);
    assert_eq!(rkey_for(&l.published(), paused_bases[0]), None);
    l.pause().unwrap(); // idempotent

    l.resume().unwrap();
    let after = l.live_windows();
    assert_eq!(after.len(), 2, "as many windows as before");
    assert!(
        after.iter().all(|s| !before.contains(s)),
        "fresh IOVA slots: {before:?} then {after:?}"
    );
    let bases = open(&l, &p, 4);
    assert_ne!(bases[0], p_bases[0]);
    let rkey = rkey_for(&l.published(), bases[1]).expect("advertised again");
    assert!(old.iter().all(|&(k, _)| k != rkey), "fresh rkeys");
    assert_eq!(
        t.lock()
            .unwrap()
            .backend()
            .deliver_write(qps[0], rkey, bases[1] + BLOCK, 8),
        Ok(mem.base() + BLOCK * u64::from(BLOCKS) + BLOCK),
        "the same memory, through a new window"
    );
    for &(rkey, addr) in &old {
        assert!(
            t.lock()
                .unwrap()
                .backend()
                .deliver_write(qps[0], rkey, addr, 8)
                .is_err(),
            "an old key stays dead after resume"
        );
    }
}

#[test]
fn close_deregisters_every_window() {
    let t = shared();
    let mut mem = Memory::new();
    let l = landing_with(&t, &mut mem, 3, PeerBinding::ByHost);
    assert_eq!(t.lock().unwrap().backend().registrations().len(), 3 * 2);
    l.close().unwrap();
    assert!(t.lock().unwrap().backend().registrations().is_empty());
}

#[test]
fn memory_that_cannot_hold_the_layout_is_refused() {
    let t = shared();
    let f = || RdmaFence::new(Arc::clone(&t));
    let new = |layout: &KvLayout, spans: Vec<HostSpan>| {
        RdmaLanding::new(
            "h",
            1,
            layout,
            spans,
            WindowsConfig::default(),
            Arc::clone(&t),
            f(),
        )
        .map(|_| ())
    };
    let layout = KvLayout::uniform(2, 64, 4); // 256 bytes per region
    assert!(matches!(
        new(&layout, vec![(0x1000, 256), (0x9000, 255)]).unwrap_err(),
        RdmaLandingError::TooSmall {
            region: 1,
            addr: 0x9000,
            needed: 256,
            have: 255
        }
    ));
    assert!(matches!(
        new(&layout, vec![(0x1000, 512)]).unwrap_err(),
        RdmaLandingError::RegionCount {
            regions: 1,
            layout: 2
        }
    ));
    assert!(matches!(
        new(&KvLayout::uniform(0, 64, 4), vec![]).unwrap_err(),
        RdmaLandingError::EmptyLayout
    ));
    assert!(matches!(
        new(&KvLayout::uniform(1, u64::MAX, 2), vec![(1, 1)]),
        Err(RdmaLandingError::Overflow { .. })
    ));
    assert!(
        t.lock().unwrap().backend().registrations().is_empty(),
        "a refused landing registers nothing"
    );
}
