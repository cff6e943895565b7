//! The RDMA target registers the host's own KV regions (issue 10, item 2's last part): with
//! `host_memory`, every layout region is registered in place with the NIC, advertised to P as
//! its own descriptor buffer, and used as the landing's base; kvrecv allocates and registers
//! nothing else, and deregisters the host's regions when the target goes. On the fake verbs
//! backend.

use std::sync::Arc;

use kvrecv::layout::KvLayout;
use kvrecv::rdma::memory::{HostMemory, HostRegion};
use kvrecv::rdma::verbs::fake::VerbsCall;
use kvrecv::rdma::verbs::qp_attrs::Mtu;
use kvrecv::rdma::verbs::{FakeVerbs, LocalNic, RdmaTarget, RdmaTargetConfig, RdmaTargetError};

const BLOCK: u64 = 64;
const BLOCKS: u32 = 32;

fn fake() -> FakeVerbs {
    FakeVerbs::new(vec![LocalNic {
        name: "mlx5_0".into(),
        port: 1,
        lid: 0,
        gid: Default::default(),
        gid_index: 3,
        active_mtu: Mtu::Mtu4096,
        link_layer: Default::default(),
        numa_node: None,
    }])
}

/// The host's KV cache: one buffer per layer, as a model runner allocates it.
fn host_cache(layers: usize) -> Vec<Vec<u8>> {
    (0..layers)
        .map(|_| vec![0u8; (BLOCK * u64::from(BLOCKS)) as usize])
        .collect()
}

fn host_memory(cache: &mut [Vec<u8>]) -> HostMemory {
    HostMemory::new(
        cache
            .iter_mut()
            // SAFETY: the buffers outlive the target (dropped at the end of the test, after it)
            // and nothing else touches them meanwhile.
            .map(|b| unsafe { HostRegion::new(b.as_mut_ptr(), b.len()) }.unwrap())
            .collect(),
    )
}

fn registered(calls: &[VerbsCall]) -> Vec<(u64, u64)> {
    calls
        .iter()
        .filter_map(|c| match c {
            VerbsCall::Register { addr, length, .. } => Some((*addr, *length)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn the_host_regions_are_registered_in_place_and_advertised() {
    let mut cache = host_cache(2);
    let spans: Vec<(u64, u64)> = cache
        .iter()
        .map(|b| (b.as_ptr() as u64, b.len() as u64))
        .collect();
    let cfg = RdmaTargetConfig {
        host_memory: Some(host_memory(&mut cache)),
        ..RdmaTargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS))
    };
    let target = RdmaTarget::start(fake(), cfg).await.unwrap();

    // Exactly the host's regions were registered: no kvrecv-owned KV buffer exists.
    let hs = Arc::clone(target.handshake());
    assert_eq!(registered(&hs.lock().unwrap().backend().calls), spans);
    // P is told to write straight into them, one descriptor buffer per region.
    let advertised: Vec<(u64, u64)> = target
        .descriptor()
        .buffers
        .iter()
        .map(|b| (b.addr, b.length))
        .collect();
    assert_eq!(advertised, spans);
    let bases: Vec<u64> = spans.iter().map(|s| s.0).collect();
    assert_eq!(target.landing().bases(), &bases[..]);
    assert!(target.bytes().is_none(), "no kvrecv-owned buffer to read");

    // Dropping the target takes the NIC's access away before the host may free its memory.
    drop(target);
    let calls = hs.lock().unwrap().backend().calls.clone();
    for (addr, _) in &spans {
        assert!(
            calls.contains(&VerbsCall::Deregister { addr: *addr }),
            "{addr:#x} still registered: {calls:?}"
        );
    }
}

#[tokio::test]
async fn host_regions_that_do_not_fit_the_layout_are_refused() {
    // One region for a two-region layout.
    let mut one = host_cache(1);
    let cfg = RdmaTargetConfig {
        host_memory: Some(host_memory(&mut one)),
        ..RdmaTargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS))
    };
    let err = RdmaTarget::start(fake(), cfg).await.unwrap_err();
    assert!(matches!(err, RdmaTargetError::HostRegions(_)), "{err}");

    // A region one block short.
    let mut short = host_cache(2);
    short[1].truncate((BLOCK * u64::from(BLOCKS - 1)) as usize);
    let cfg = RdmaTargetConfig {
        host_memory: Some(host_memory(&mut short)),
        ..RdmaTargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS))
    };
    let err = RdmaTarget::start(fake(), cfg).await.unwrap_err();
    assert!(matches!(err, RdmaTargetError::HostRegions(_)), "{err}");
}
