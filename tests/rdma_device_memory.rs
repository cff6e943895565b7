//! The RDMA target registers the host's GPU memory through GPUDirect RDMA (issue 41, defect 5):
//! with `device_memory`, every layout region is registered in place (dma-buf, else
//! nvidia-peermem) once per landing window, each at the window's own IOVA (DESIGN.md §5), and
//! advertised to P as `cuda:<ordinal>` descriptor buffers; on a node with neither path the start
//! fails with a typed error instead of the old blanket refusal. On the fake verbs backend and a fake GPU side
//! (the device pointers are never dereferenced).

use std::sync::Arc;

use kvrecv::layout::KvLayout;
use kvrecv::rdma::memory::{DeviceMemory, DeviceRegion};
use kvrecv::rdma::verbs::fake::{test_nic, VerbsCall};
use kvrecv::rdma::verbs::{
    DeviceMemoryExport, DmaBuf, FakeVerbs, GpuDirectError, RdmaTarget, RdmaTargetConfig,
    RdmaTargetError,
};

const BLOCK: u64 = 64;
const BLOCKS: u32 = 32;
/// Two layers' device regions, 2 MiB apart (as separate allocations would be).
const PTRS: [u64; 2] = [0x7f00_0000_0000, 0x7f00_0020_0000];
const WINDOWS: usize = 2;

fn fake() -> FakeVerbs {
    FakeVerbs::new(vec![test_nic("mlx5_0", Default::default())])
}

#[derive(Debug)]
struct Gpu {
    dma_buf: bool,
    peermem: bool,
}

impl DeviceMemoryExport for Gpu {
    fn dma_buf(&self, _ptr: u64, _len: u64) -> Result<DmaBuf, String> {
        if !self.dma_buf {
            return Err("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0".into());
        }
        let f = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
        Ok(DmaBuf {
            fd: f.into(),
            offset: 0,
        })
    }

    fn peermem_loaded(&self) -> bool {
        self.peermem
    }
}

fn config(gpu: Gpu) -> RdmaTargetConfig {
    let len = BLOCK * u64::from(BLOCKS);
    // SAFETY: the fake backend and fake GPU never touch these addresses.
    let regions = PTRS
        .iter()
        .map(|&p| unsafe { DeviceRegion::new(1, p, len) }.unwrap())
        .collect();
    RdmaTargetConfig {
        device_memory: Some(DeviceMemory::new(regions)),
        device_export: Some(Arc::new(gpu)),
        windows: WINDOWS,
        ..RdmaTargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS))
    }
}

#[tokio::test]
async fn device_regions_are_registered_through_dma_buf_and_advertised_as_cuda_buffers() {
    let target = RdmaTarget::start(
        fake(),
        config(Gpu {
            dma_buf: true,
            peermem: false,
        }),
    )
    .await
    .unwrap();
    let len = BLOCK * u64::from(BLOCKS);
    let hs = Arc::clone(target.handshake());
    let calls = hs.lock().unwrap().backend().calls.clone();
    let registered: Vec<(u64, u64)> = calls
        .iter()
        .filter_map(|c| match c {
            VerbsCall::RegisterDmaBuf { iova, length, .. } => Some((*iova, *length)),
            VerbsCall::Register { addr, .. } | VerbsCall::RegisterAt { addr, .. } => {
                panic!("host registration of {addr:#x}")
            }
            _ => None,
        })
        .collect();
    // One dma-buf registration per window and layer, each at the window's IOVA.
    let landing = target.landing();
    let expected: Vec<(u64, u64)> = landing
        .live_windows()
        .iter()
        .flat_map(|w| landing.window_bases(*w).unwrap().to_vec())
        .map(|iova| (iova, len))
        .collect();
    assert_eq!(expected.len(), WINDOWS * PTRS.len());
    assert_eq!(registered, expected);
    let descriptor = target.descriptor();
    let advertised: Vec<(&str, u64, u64)> = descriptor
        .buffers
        .iter()
        .map(|b| (b.name.as_str(), b.addr, b.length))
        .collect();
    let cuda: Vec<(&str, u64, u64)> = expected.iter().map(|&(a, l)| ("cuda:1", a, l)).collect();
    assert_eq!(advertised, cuda);
    // The NIC's access goes with the target.
    drop(landing);
    drop(target);
    let calls = hs.lock().unwrap().backend().calls.clone();
    for (addr, _) in expected {
        assert!(calls.contains(&VerbsCall::Deregister { addr }), "{calls:?}");
    }
}

#[tokio::test]
async fn peermem_registers_the_device_pointer_when_dma_buf_is_unavailable() {
    let target = RdmaTarget::start(
        fake(),
        config(Gpu {
            dma_buf: false,
            peermem: true,
        }),
    )
    .await
    .unwrap();
    let hs = Arc::clone(target.handshake());
    let addrs: Vec<u64> = hs
        .lock()
        .unwrap()
        .backend()
        .calls
        .iter()
        .filter_map(|c| match c {
            VerbsCall::RegisterAt { addr, .. } => Some(*addr),
            _ => None,
        })
        .collect();
    // The device pointers themselves, once per window (each at the window's IOVA).
    assert_eq!(addrs, [PTRS, PTRS].concat());
}

#[tokio::test]
async fn a_node_without_gpudirect_fails_the_start_with_a_typed_error() {
    let err = RdmaTarget::start(
        fake(),
        config(Gpu {
            dma_buf: false,
            peermem: false,
        }),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            RdmaTargetError::GpuDirect(GpuDirectError::Unavailable { region: 0, .. })
        ),
        "{err}"
    );
    // A fake (host-backed) device cannot be handed to a NIC at all.
    let (dev, _view) = DeviceMemory::fake(4096);
    let cfg = RdmaTargetConfig {
        device_memory: Some(dev),
        ..RdmaTargetConfig::loopback(KvLayout::uniform(1, 64, 64))
    };
    let err = RdmaTarget::start(fake(), cfg).await.unwrap_err();
    assert!(
        matches!(err, RdmaTargetError::GpuDirect(GpuDirectError::Regions(_))),
        "{err}"
    );
}

/// Through the front door, device memory over RDMA is no longer refused outright: the start
/// goes to the GPUDirect registration, which needs CUDA (the feature, then a driver) to check
/// and export the regions, and reports what is missing.
#[test]
fn the_front_door_hands_device_memory_to_the_gpudirect_registration() {
    use kvrecv::embed::StartError;
    use kvrecv::{KvRecv, KvRecvConfig};
    let len = BLOCK * u64::from(BLOCKS);
    // SAFETY: never dereferenced: the start fails before any registration.
    let regions = PTRS
        .iter()
        .map(|&p| unsafe { DeviceRegion::new(0, p, len) }.unwrap())
        .collect();
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, BLOCK, BLOCKS),
        ..KvRecvConfig::default()
    };
    let err = KvRecv::builder(config)
        .rdma(|| Ok(fake()))
        .device_memory(DeviceMemory::new(regions))
        .start()
        .unwrap_err();
    #[cfg(not(feature = "cuda"))]
    assert!(
        matches!(
            err,
            StartError::Rdma(RdmaTargetError::GpuDirect(GpuDirectError::CudaNotBuilt))
        ),
        "{err}"
    );
    // With CUDA: no driver here, or (on a GPU node) made-up pointers the driver does not know.
    #[cfg(feature = "cuda")]
    assert!(
        matches!(
            err,
            StartError::Rdma(RdmaTargetError::GpuDirect(GpuDirectError::Regions(_)))
        ),
        "{err}"
    );
}
