//! Host-owned destination memory through the front door: the host allocates its KV regions
//! (plain `Vec`s here), registers them, P's real TE initiator writes, and the bytes are in the
//! host's own memory, exactly where vLLM's addressing puts them and nowhere else.

use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_pool::owner_tag;
use kvrecv::config::KvRecvConfig;
use kvrecv::embed::KvRecv;
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, ReqId};
use kvrecv::rdma::audit::stamp_write;
use kvrecv::rdma::memory::{HostMemory, HostRegion, MemoryError};
use kvrecv::rdma::tcp::target::TargetError;
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{PrefillSim, SimConfig};

const BLOCK: usize = 4096;
const BLOCKS: usize = 16;
const REGIONS: usize = 2;
/// What the host's memory holds before anything lands: distinct from any written byte.
const FILL: u8 = 0xEE;

fn config() -> KvRecvConfig {
    KvRecvConfig {
        layout: KvLayout::uniform(REGIONS as u32, BLOCK as u64, BLOCKS as u32),
        ..KvRecvConfig::default()
    }
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_writes_land_in_the_hosts_own_vec() {
    // The host's KV cache: one allocation per layer, kept alive (and unmoved) past shutdown.
    let mut kv_cache: Vec<Vec<u8>> = (0..REGIONS).map(|_| vec![FILL; BLOCK * BLOCKS]).collect();
    let regions = kv_cache
        .iter_mut()
        // SAFETY: each Vec outlives the worker (shut down below, before they are read or
        // dropped), is never resized, and is only read after its blocks were released.
        .map(|v| unsafe { HostRegion::new(v.as_mut_ptr(), v.len()) }.unwrap())
        .collect();
    let kv = KvRecv::builder(config())
        .host_memory(HostMemory::new(regions))
        .events(true)
        .start()
        .unwrap();
    let mut events = kv.events().unwrap();
    let writer = Arc::new(TeWriter::new(InitiatorConfig::default()));
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();
    let reply = kv
        .load_kv(vec![KvRequest {
            req_id: "r1".into(),
            transfer_id: Some("t-r1".into()),
            remote_engine_id: Some(sim.engine_id().to_owned()),
            remote_bootstrap_addr: Some(sim.bootstrap_url()),
            block_ids: vec![vec![3, 9]],
        }])
        .await
        .unwrap();
    assert_eq!(reply.awaiting, 1);
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("released in time")
            .expect("events open");
        if matches!(&ev, KvEvent::Released { req_id, .. } if &**req_id == "r1") {
            break;
        }
    }
    let step = kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
    // Released: the handle reads it back from the host's own regions.
    assert_eq!(kv.read_block(0, 3).unwrap()[1], expected_block("t-r1", 3));
    kv.shutdown().await;
    // Memory given by pointer may be freed once shutdown returned: kvrecv reads none of it.
    assert!(matches!(
        kv.read_block(0, 3),
        Err(kvrecv::BlockReadError::NotValid)
    ));
    drop(sim);
    for (r, region) in kv_cache.iter().enumerate() {
        for b in 0..BLOCKS as u32 {
            let got = &region[b as usize * BLOCK..(b as usize + 1) * BLOCK];
            if b == 3 || b == 9 {
                assert_eq!(
                    got,
                    &expected_block("t-r1", b)[..],
                    "region {r} block {b}: P's bytes"
                );
            } else {
                assert!(
                    got.iter().all(|&x| x == FILL),
                    "region {r} block {b} untouched"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_that_do_not_fit_the_layout_are_refused() {
    let mut short = vec![0u8; BLOCK * BLOCKS - 1];
    let mut ok = vec![0u8; BLOCK * BLOCKS];
    // SAFETY: never written: the start is refused.
    let regions = unsafe {
        vec![
            HostRegion::new(ok.as_mut_ptr(), ok.len()).unwrap(),
            HostRegion::new(short.as_mut_ptr(), short.len()).unwrap(),
        ]
    };
    let e = KvRecv::builder(config())
        .host_memory(HostMemory::new(regions))
        .start()
        .unwrap_err();
    assert!(
        matches!(
            &e,
            kvrecv::embed::StartError::Target(TargetError::Memory(MemoryError::HostRegions(m)))
                if m.contains("region 1")
        ),
        "{e}"
    );
    // SAFETY: only the pointer is checked.
    let one = unsafe { vec![HostRegion::new(ok.as_mut_ptr(), ok.len()).unwrap()] };
    let e = KvRecv::builder(config())
        .host_memory(HostMemory::new(one))
        .start()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("1 memory regions for 2 layout regions"),
        "{e}"
    );
    // SAFETY: refused before use.
    assert!(unsafe { HostRegion::new(std::ptr::null_mut(), 8) }.is_err());
}

/// A host's start-up function returns kvrecv's `StartError`; a refused region goes through
/// `?` as the same error `start` gives for memory, with no detour through the data plane's
/// types.
#[test]
fn a_refused_region_is_a_start_error_through_question_mark() {
    fn hand_over() -> Result<HostMemory, kvrecv::StartError> {
        // SAFETY: refused before use.
        let region = unsafe { HostRegion::new(std::ptr::null_mut(), 8) }?;
        Ok(HostMemory::new(vec![region]))
    }
    let e = hand_over().unwrap_err();
    assert!(
        matches!(
            &e,
            kvrecv::StartError::Target(TargetError::Memory(MemoryError::HostRegions(m)))
                if m.contains("null")
        ),
        "{e}"
    );
}
