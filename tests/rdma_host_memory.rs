//! The RDMA target registers the host's own KV regions (issue 10, item 2's last part): with
//! `host_memory`, every layout region is registered in place with the NIC — once per landing
//! window, each at the window's own IOVA (DESIGN.md §5) — and advertised to P as one
//! descriptor buffer per window and region; kvrecv allocates and registers nothing else, and
//! deregisters every window when the target goes. On the fake verbs backend.

use std::sync::Arc;

use kvrecv::layout::KvLayout;
use kvrecv::rdma::memory::{HostMemory, HostRegion};
use kvrecv::rdma::verbs::fake::{test_nic, VerbsCall};
use kvrecv::rdma::verbs::{FakeVerbs, RdmaTarget, RdmaTargetConfig, RdmaTargetError};

const BLOCK: u64 = 64;
const BLOCKS: u32 = 32;

fn fake() -> FakeVerbs {
    FakeVerbs::new(vec![test_nic("mlx5_0", Default::default())])
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

/// `(host address, length, IOVA)` of every registration made.
fn registered(calls: &[VerbsCall]) -> Vec<(u64, u64, u64)> {
    calls
        .iter()
        .filter_map(|c| match c {
            VerbsCall::Register { addr, length, .. } => Some((*addr, *length, *addr)),
            VerbsCall::RegisterAt {
                addr, length, iova, ..
            } => Some((*addr, *length, *iova)),
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
    let windows = 3;
    let cfg = RdmaTargetConfig {
        host_memory: Some(host_memory(&mut cache)),
        windows,
        ..RdmaTargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS))
    };
    let target = RdmaTarget::start(fake(), cfg).await.unwrap();

    // Exactly the host's regions were registered, once per window: no kvrecv-owned KV buffer.
    let hs = Arc::clone(target.handshake());
    let regs = registered(&hs.lock().unwrap().backend().calls);
    assert_eq!(regs.len(), windows * spans.len());
    for (i, chunk) in regs.chunks(spans.len()).enumerate() {
        let host: Vec<(u64, u64)> = chunk.iter().map(|&(a, l, _)| (a, l)).collect();
        assert_eq!(
            host, spans,
            "window {i} registers the host's regions in layout order"
        );
    }
    let iovas: std::collections::BTreeSet<u64> = regs.iter().map(|r| r.2).collect();
    assert_eq!(
        iovas.len(),
        regs.len(),
        "every registration has an IOVA of its own"
    );
    // P is told the windows' IOVAs, one descriptor buffer per window and region.
    let advertised: Vec<(u64, u64)> = target
        .descriptor()
        .buffers
        .iter()
        .map(|b| (b.addr, b.length))
        .collect();
    let expected: Vec<(u64, u64)> = regs.iter().map(|&(_, l, iova)| (iova, l)).collect();
    assert_eq!(advertised, expected);
    assert!(
        target.snapshot().is_none(),
        "no kvrecv-owned buffer to read"
    );

    // Dropping the target takes the NIC's access away before the host may free its memory.
    drop(target);
    let calls = hs.lock().unwrap().backend().calls.clone();
    for (_, _, iova) in &regs {
        assert!(
            calls.contains(&VerbsCall::Deregister { addr: *iova }),
            "{iova:#x} still registered: {calls:?}"
        );
    }
    assert!(hs.lock().unwrap().backend().registrations().is_empty());
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

#[tokio::test]
async fn a_second_target_on_registered_host_memory_is_refused() {
    let memory = HostMemory::owned(host_cache(2)).unwrap();
    let cfg = || RdmaTargetConfig {
        host_memory: Some(memory.clone()),
        ..RdmaTargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS))
    };
    let first = RdmaTarget::start(fake(), cfg()).await.unwrap();
    match RdmaTarget::start(fake(), cfg()).await {
        Err(RdmaTargetError::Memory(kvrecv::MemoryError::InUse)) => {}
        other => panic!("two targets on one memory: {:?}", other.err()),
    }
    // The first target gone (its windows deregistered), the memory may be registered again.
    drop(first);
    assert!(!memory.is_registered());
    let again = RdmaTarget::start(fake(), cfg()).await.unwrap();
    drop(again);
    assert!(
        memory.take_back().is_ok(),
        "nothing holds the memory any more"
    );
}

/// A start that fails after registering windows (here: a descriptor over the handshake's frame
/// cap) deregisters them; when one cannot be deregistered the NIC may still write the memory,
/// so the host's memory stays registered (leaked with it), never free to be taken back.
#[tokio::test]
async fn memory_a_failed_start_could_not_deregister_is_never_released() {
    let start = |memory: &HostMemory, fail_deregister: Option<i32>| {
        let mut backend = fake();
        backend.fail_deregister = fail_deregister;
        let cfg = RdmaTargetConfig {
            host_memory: Some(memory.clone()),
            windows: 512, // x 64 regions: a descriptor over 1 MiB
            ..RdmaTargetConfig::loopback(KvLayout::uniform(64, BLOCK, BLOCKS))
        };
        RdmaTarget::start(backend, cfg)
    };
    let memory = HostMemory::owned(host_cache(64)).unwrap();
    match start(&memory, None).await {
        Err(RdmaTargetError::Landing(e)) => assert!(e.to_string().contains("1 MiB"), "{e}"),
        other => panic!("{:?}", other.err()),
    }
    assert!(
        !memory.is_registered(),
        "every window deregistered: the memory is free"
    );
    match start(&memory, Some(16)).await {
        Err(RdmaTargetError::Landing(e)) => assert!(e.to_string().contains("leaked"), "{e}"),
        other => panic!("{:?}", other.err()),
    }
    assert!(memory.is_registered(), "a window may still be on it");
    assert!(memory.take_back().is_err(), "never handed back to be freed");
}
