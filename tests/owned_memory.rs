//! A host that hands kvrecv memory it owns, with no `unsafe` in its code (the crate attribute
//! below makes any a compile error): P's real TE initiator writes into it, the host reads the
//! landed blocks back through the handle, a block still held by a request is refused, the
//! shutdown reports what it abandoned, and the buffers come back once the worker is gone.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_pool::owner_tag;
use kvrecv::layout::KvLayout;
use kvrecv::rdma::audit::stamp_write;
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{Faults, PrefillSim, SimConfig};
use kvrecv::{
    AbandonedRequest, BlockReadError, HostMemory, KvEvent, KvRecv, KvRecvConfig, KvRequest,
    MemoryError, PauseError, ReqId, ResumeMemory, StartError, TargetError,
};

const BLOCK: usize = 4096;
const BLOCKS: usize = 16;
const REGIONS: usize = 2;
/// What the host's memory holds before anything lands: distinct from any written byte.
const FILL: u8 = 0xEE;

/// The bytes the simulator's TE writer sends for `block` of a request with `transfer_id`.
fn expected_block(transfer_id: &str, block: u32) -> Vec<u8> {
    let tag = owner_tag(transfer_id);
    let mut p = vec![(tag & 0xff) as u8; BLOCK];
    stamp_write(
        &mut p,
        u64::from(block) * BLOCK as u64,
        BLOCK as u64,
        tag,
        |_| 0,
    );
    p
}

fn request(id: &str, sim: &PrefillSim, blocks: Vec<u32>) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some(sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(sim.bootstrap_url()),
        block_ids: vec![blocks],
    }
}

async fn prefill(hang: bool) -> PrefillSim {
    let writer = Arc::new(TeWriter::new(InitiatorConfig::default()));
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();
    if hang {
        // P never answers: the request stays in flight, its block held.
        sim.set_faults(
            0,
            0,
            Faults {
                hang: true,
                ..Faults::default()
            },
        );
    }
    sim
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_receives_into_memory_it_owns_reads_it_back_and_learns_what_shutdown_abandoned() {
    let memory = HostMemory::owned((0..REGIONS).map(|_| vec![FILL; BLOCK * BLOCKS])).unwrap();
    let kv = KvRecv::builder(KvRecvConfig {
        layout: KvLayout::uniform(REGIONS as u32, BLOCK as u64, BLOCKS as u32),
        ..KvRecvConfig::default()
    })
    .host_memory(memory.clone())
    .events(true)
    .start()
    .unwrap();
    let mut events = kv.events().unwrap();
    let (p, silent) = (prefill(false).await, prefill(true).await);
    let reply = kv
        .load_kv(vec![
            request("r1", &p, vec![3, 9]),
            request("r2", &silent, vec![5]),
        ])
        .await
        .unwrap();
    assert_eq!(reply.awaiting, 2, "{reply:?}");
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("released in time")
            .expect("events open");
        if matches!(&ev, KvEvent::Released { req_id, .. } if &**req_id == "r1") {
            break;
        }
    }
    assert_eq!(
        kv.drain().await.unwrap().finished_recving,
        vec![ReqId::from("r1")]
    );

    // r1's blocks are the host's again: P's bytes, in every region of the group.
    for b in [3u32, 9] {
        let block = kv.read_block(0, b).unwrap();
        assert_eq!(block.len(), REGIONS, "one copy per layout region");
        for (r, bytes) in block.iter().enumerate() {
            assert_eq!(bytes, &expected_block("t-r1", b), "region {r} block {b}");
        }
    }
    assert!(kv
        .read_block(0, 0)
        .unwrap()
        .iter()
        .flatten()
        .all(|&x| x == FILL));
    // r2 is in flight: its block is not the host's to read.
    match kv.read_block(0, 5) {
        Err(BlockReadError::Held {
            block: 5, req_id, ..
        }) => assert_eq!(&*req_id, "r2"),
        other => panic!("a held block read: {:?}", other.map(|b| b.len())),
    }
    assert!(matches!(
        kv.read_block(0, BLOCKS as u32),
        Err(BlockReadError::OutOfRange { .. })
    ));
    assert!(matches!(
        kv.read_block(1, 0),
        Err(BlockReadError::OutOfRange { .. })
    ));

    // Shut down with r2 in flight: the report names it, its block, and that it is safe now
    // (kvrecv's data plane is closed).
    let report = kv.shutdown().await;
    assert_eq!(
        report.abandoned,
        vec![AbandonedRequest {
            req_id: "r2".into(),
            blocks: vec![5],
            fenced: true,
            forced: false,
        }]
    );
    assert_eq!(
        kv.clone().shutdown().await,
        report,
        "every clone, the same report"
    );
    // Nothing writes any more: every block may be read, r2's included (P never wrote it).
    assert!(kv
        .read_block(0, 5)
        .unwrap()
        .iter()
        .flatten()
        .all(|&x| x == FILL));

    // The handle holds the memory; once it is gone, the buffers are the host's again.
    let memory = memory
        .take_back()
        .expect_err("the handle still holds a clone");
    drop(kv);
    let buffers = memory.take_back().expect("nothing else holds the memory");
    assert_eq!(buffers.len(), REGIONS);
    for (r, region) in buffers.iter().enumerate() {
        assert_eq!(
            &region[9 * BLOCK..10 * BLOCK],
            &expected_block("t-r1", 9)[..],
            "region {r}"
        );
        assert!(region[5 * BLOCK..6 * BLOCK].iter().all(|&x| x == FILL));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_memory_lands_for_one_worker_at_a_time() {
    let config = || KvRecvConfig {
        layout: KvLayout::uniform(REGIONS as u32, BLOCK as u64, BLOCKS as u32),
        ..KvRecvConfig::default()
    };
    let owned = || HostMemory::owned((0..REGIONS).map(|_| vec![FILL; BLOCK * BLOCKS])).unwrap();
    let (memory, other) = (owned(), owned());
    let first = KvRecv::builder(config())
        .host_memory(memory.clone())
        .start()
        .unwrap();
    assert!(memory.is_registered());

    // A second worker on the same memory (a clone of it) would land in the first's blocks.
    match KvRecv::builder(config())
        .host_memory(memory.clone())
        .start()
    {
        Err(StartError::Target(TargetError::Memory(MemoryError::InUse))) => {}
        other => panic!("a second worker on registered memory: {:?}", other.err()),
    }
    // Nor may a worker on other memory resume onto it.
    let second = KvRecv::builder(config())
        .host_memory(other.clone())
        .start()
        .unwrap();
    second.pause().await.unwrap();
    let refused = second
        .resume(ResumeMemory::Host(memory.clone()))
        .await
        .expect_err("resumed onto another worker's memory");
    assert!(matches!(refused, PauseError::MemoryInUse), "{refused}");
    assert!(second.is_paused(), "a refused resume stays paused");
    // Its own memory is still its own to resume onto.
    second
        .resume(ResumeMemory::Host(other.clone()))
        .await
        .unwrap();

    // The first worker gone, its memory is free for another.
    drop(first);
    assert!(!memory.is_registered());
    let third = KvRecv::builder(config())
        .host_memory(memory.clone())
        .start()
        .unwrap();
    drop((second, third));
    assert!(!memory.is_registered() && !other.is_registered());
}

/// `target()` adjusts the data target, but the layout is the configuration's and the memory
/// the builder's: a closure that changes either makes `start` fail, rather than silently
/// undoing `host_memory` (the worker would land in memory of its own) or being ignored.
#[test]
fn a_target_closure_cannot_undo_the_builders_memory_or_layout() {
    let config = || KvRecvConfig {
        layout: KvLayout::uniform(REGIONS as u32, BLOCK as u64, BLOCKS as u32),
        ..KvRecvConfig::default()
    };
    let memory = HostMemory::owned((0..REGIONS).map(|_| vec![FILL; BLOCK * BLOCKS])).unwrap();
    let conflict = |b: kvrecv::KvRecvBuilder, what: &str| match b.start() {
        Err(StartError::TargetConflict(why)) => assert!(why.contains(what), "{why}"),
        other => panic!("started: {:?}", other.err()),
    };
    conflict(
        KvRecv::builder(config())
            .host_memory(memory.clone())
            .target(|t| t.host_memory = None),
        "host memory",
    );
    conflict(
        KvRecv::builder(config()).target(|t| t.layout.num_blocks = 1_000_000),
        "layout",
    );
    assert!(!memory.is_registered(), "nothing started");
    // What is the target's own to set is taken, memory and all.
    let kv = KvRecv::builder(config())
        .host_memory(memory.clone())
        .target(|t| t.windows = Some(4))
        .start()
        .unwrap();
    assert!(memory.is_registered());
    drop(kv);
}
