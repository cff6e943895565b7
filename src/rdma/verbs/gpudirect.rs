//! GPUDirect RDMA: registering the host's device memory (a GPU KV cache) with the NIC so P
//! writes straight into it. Two ways, tried in this order:
//!
//! 1. **dma-buf** (upstream kernel ≥ 5.12, rdma-core ≥ 34, NVIDIA open kernel modules): the GPU
//!    driver exports the allocation as a dma-buf file descriptor
//!    (`cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`) and
//!    `ibv_reg_dmabuf_mr` registers the region from it, with the device pointer as the address
//!    P writes to;
//! 2. **nvidia-peermem** (`/sys/module/nvidia_peermem`): `ibv_reg_mr` on the device pointer
//!    itself, which the peer-memory module resolves to GPU pages.
//!
//! Neither: a typed error naming both reasons, at start, before anything is registered for
//! that region. The choice is made per region by [`register_device_region`], a function of the
//! backend and of a [`DeviceMemoryExport`] (the GPU side), so it is tested with fakes of both.

use thiserror::Error;

pub use super::backend::DmaBuf;
use super::backend::{MrAccess, MrKeys, VerbsBackend, VerbsError};

/// The GPU side of a GPUDirect registration.
pub trait DeviceMemoryExport: Send + Sync + std::fmt::Debug {
    /// A dma-buf for the `len` device bytes at `ptr`, or why the GPU or its driver cannot
    /// export one.
    fn dma_buf(&self, ptr: u64, len: u64) -> Result<DmaBuf, String>;

    /// Whether the nvidia-peermem kernel module is loaded (so `ibv_reg_mr` accepts device
    /// pointers).
    fn peermem_loaded(&self) -> bool;
}

/// Whether `nvidia_peermem` is loaded on this node.
pub fn nvidia_peermem_loaded() -> bool {
    std::path::Path::new("/sys/module/nvidia_peermem").exists()
}

/// How a device region was registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuDirectPath {
    /// `ibv_reg_dmabuf_mr` on a dma-buf the GPU driver exported.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer, through nvidia-peermem.
    PeerMem,
}

/// Why device memory could not be registered with the NIC.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum GpuDirectError {
    /// Neither path is available: P cannot write into this GPU's memory over RDMA on this node.
    #[error(
        "device region {region}: GPUDirect RDMA is unavailable on this node (dma-buf: {dma_buf}; \
         nvidia-peermem: module not loaded); use the TCP target, load nvidia_peermem, or use \
         an RDMA stack with dma-buf support"
    )]
    Unavailable {
        /// The region, in layout order.
        region: usize,
        /// Why the dma-buf path failed.
        dma_buf: String,
    },
    /// nvidia-peermem is loaded but the NIC refused the device pointer.
    #[error(
        "device region {region}: dma-buf: {dma_buf}; ibv_reg_mr through nvidia-peermem: {source}"
    )]
    PeerMem {
        /// The region, in layout order.
        region: usize,
        /// Why the dma-buf path failed.
        dma_buf: String,
        /// The registration's error.
        source: VerbsError,
    },
    /// Device memory over RDMA needs the `cuda` feature (to check and export it).
    #[error("device memory over RDMA needs kvrecv built with the `cuda` feature")]
    CudaNotBuilt,
    /// The regions failed the driver's checks, or cannot be registered at all.
    #[error("device regions: {0}")]
    Regions(String),
}

/// Register device region `region` (`len` bytes at device pointer `ptr`) on every device of
/// `backend`, addressed by P as `iova..iova + len` (a landing window's, DESIGN.md §5): dma-buf
/// first, nvidia-peermem if that fails, a typed error if neither works.
///
/// # Safety
/// `ptr..ptr + len` is device memory that stays allocated until it is deregistered (the
/// contract of [`DeviceRegion::new`](crate::rdma::memory::DeviceRegion::new)): any peer holding the rkey can write
/// it at any time.
pub unsafe fn register_device_region<B: VerbsBackend + ?Sized>(
    backend: &mut B,
    export: &dyn DeviceMemoryExport,
    region: usize,
    ptr: u64,
    len: u64,
    iova: u64,
    access: MrAccess,
) -> Result<(GpuDirectPath, Vec<MrKeys>), GpuDirectError> {
    let dma_buf = match export.dma_buf(ptr, len) {
        // SAFETY: the dma-buf covers the region (exporter) and the caller keeps it allocated.
        Ok(buf) => match unsafe { backend.register_dmabuf(&buf, iova, len, access) } {
            Ok(keys) => return Ok((GpuDirectPath::DmaBuf, keys)),
            Err(e) => format!("the NIC refused it: {e}"),
        },
        Err(why) => why,
    };
    if !export.peermem_loaded() {
        return Err(GpuDirectError::Unavailable { region, dma_buf });
    }
    tracing::info!(region, %dma_buf, "dma-buf registration unavailable: using nvidia-peermem");
    // SAFETY: with nvidia-peermem the NIC resolves the device pointer; kept allocated (caller).
    match unsafe { backend.register_memory_iova(ptr, len, iova, access) } {
        Ok(keys) => Ok((GpuDirectPath::PeerMem, keys)),
        Err(source) => Err(GpuDirectError::PeerMem {
            region,
            dma_buf,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::verbs::fake::{test_nic, FakeVerbs, VerbsCall};

    #[derive(Debug)]
    struct Export {
        dma_buf: bool,
        peermem: bool,
    }

    impl DeviceMemoryExport for Export {
        fn dma_buf(&self, ptr: u64, _len: u64) -> Result<DmaBuf, String> {
            if !self.dma_buf {
                return Err("CUDA_ERROR_NOT_SUPPORTED".into());
            }
            let f = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
            Ok(DmaBuf {
                fd: f.into(),
                offset: ptr % 0x20_0000,
            })
        }

        fn peermem_loaded(&self) -> bool {
            self.peermem
        }
    }

    fn fake() -> FakeVerbs {
        FakeVerbs::new((0..2).map(|i| test_nic(&format!("mlx5_{i}"), Default::default())).collect())
    }

    const PTR: u64 = 0x7f00_0020_1000;

    fn register(
        b: &mut FakeVerbs,
        dma_buf: bool,
        peermem: bool,
    ) -> Result<(GpuDirectPath, Vec<MrKeys>), GpuDirectError> {
        let e = Export { dma_buf, peermem };
        // SAFETY: the fake backend never touches the memory.
        unsafe { register_device_region(b, &e, 3, PTR, 4096, PTR, MrAccess::default()) }
    }

    #[test]
    fn dma_buf_is_preferred_with_the_device_pointer_as_the_address() {
        let mut b = fake();
        let (path, keys) = register(&mut b, true, true).unwrap();
        assert_eq!(path, GpuDirectPath::DmaBuf);
        assert_eq!(keys.len(), 2, "one key pair per NIC");
        assert!(
            matches!(
                b.calls.as_slice(),
                [VerbsCall::RegisterDmaBuf {
                    offset: 0x1000,
                    iova: PTR,
                    length: 4096,
                    ..
                }]
            ),
            "{:?}",
            b.calls
        );
        // Deregistered by the address P writes to, like host memory.
        b.deregister_memory(PTR).unwrap();
    }

    #[test]
    fn peermem_is_the_fallback_when_dma_buf_fails_on_either_side() {
        // The GPU driver cannot export a dma-buf.
        let mut b = fake();
        assert_eq!(
            register(&mut b, false, true).unwrap().0,
            GpuDirectPath::PeerMem
        );
        assert!(
            matches!(
                b.calls.as_slice(),
                [VerbsCall::Register {
                    addr: PTR,
                    length: 4096,
                    ..
                }]
            ),
            "{:?}",
            b.calls
        );
        // The NIC (an rdma-core or kernel without dma-buf) refuses it.
        let mut b = fake();
        b.fail_dmabuf = Some(95); // EOPNOTSUPP
        assert_eq!(
            register(&mut b, true, true).unwrap().0,
            GpuDirectPath::PeerMem
        );
    }

    #[test]
    fn neither_path_is_a_typed_error_naming_both() {
        let mut b = fake();
        let e = register(&mut b, false, false).unwrap_err();
        assert!(
            matches!(&e, GpuDirectError::Unavailable { region: 3, dma_buf } if dma_buf.contains("NOT_SUPPORTED")),
            "{e}"
        );
        assert!(e.to_string().contains("nvidia-peermem"), "{e}");
        assert!(b.calls.is_empty(), "nothing registered");
        let mut b = fake();
        b.fail_dmabuf = Some(95);
        let e = register(&mut b, true, false).unwrap_err();
        assert!(e.to_string().contains("the NIC refused it"), "{e}");
    }
}
