//! Registered destination memory: one contiguous allocation laid out like the KV layout (see
//! [`super::windows::WindowMap`] for the offsets). Host memory by default; with the `cuda`
//! feature, device memory behind a host staging mirror: TCP bytes land in the mirror and are
//! copied to the device by [`RegisteredMemory::commit`] before the write is acknowledged.
//!
//! The bytes are shared like DMA memory: the data server writes them through raw pointers
//! from many connections at once (the kernel copies socket data straight in), so they are never
//! handed out as `&mut` outside this module except for the span of one socket read.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use thiserror::Error;

/// Alignment of the host allocation (a page: what pinning or registration would want).
const ALIGN: usize = 4096;

#[derive(Debug, Error)]
pub enum MemoryError {
    #[error("cannot allocate {0} bytes of destination memory")]
    Alloc(u64),
    #[error("range {offset}+{len} is outside the {size}-byte registered memory")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("no CUDA driver library found (libcuda.so); GPU destination memory is unavailable")]
    NoCudaDriver,
    #[error("kvrecv was built without the `cuda` feature")]
    CudaNotBuilt,
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// Where destination bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryKind {
    #[default]
    Host,
    /// Device memory on GPU `ordinal` (feature `cuda`).
    Cuda { ordinal: usize },
}

struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this struct; concurrent access goes through raw
// pointers with the DMA-like contract documented at the top of the module.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn new(len: usize) -> Result<Self, MemoryError> {
        let layout = Layout::from_size_align(len.max(1), ALIGN)
            .map_err(|_| MemoryError::Alloc(len as u64))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or(MemoryError::Alloc(len as u64))?;
        Ok(HostBuffer { ptr, len })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this exact layout.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len.max(1), ALIGN),
            )
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use cudarc::driver::{result, sys, CudaContext, CudaSlice, DevicePtr};

    use super::MemoryError;

    /// Device allocation mirrored by the host staging buffer.
    pub(super) struct GpuMirror {
        ctx: Arc<CudaContext>,
        _buf: CudaSlice<u8>,
        base: sys::CUdeviceptr,
    }

    fn err(e: impl std::fmt::Debug) -> MemoryError {
        MemoryError::Cuda(format!("{e:?}"))
    }

    impl GpuMirror {
        pub(super) fn new(ordinal: usize, len: usize) -> Result<Self, MemoryError> {
            // Without a driver `CudaContext::new` panics instead of failing: check first.
            // SAFETY: only probes for the shared library.
            if !unsafe { sys::is_culib_present() } {
                return Err(MemoryError::NoCudaDriver);
            }
            let ctx = CudaContext::new(ordinal).map_err(err)?;
            let stream = ctx.default_stream();
            let buf = stream.alloc_zeros::<u8>(len.max(1)).map_err(err)?;
            let base = {
                let (p, _sync) = buf.device_ptr(&stream);
                p
            };
            stream.synchronize().map_err(err)?;
            Ok(GpuMirror {
                ctx,
                _buf: buf,
                base,
            })
        }

        /// Host -> device, synchronous: returns once the bytes are in device memory.
        pub(super) fn upload(&self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
            self.ctx.bind_to_thread().map_err(err)?;
            // SAFETY: `offset + src.len()` was bounds-checked against the allocation by the caller.
            unsafe { result::memcpy_htod_sync(self.base + offset as u64, src) }.map_err(err)
        }

        /// Device -> host, synchronous.
        pub(super) fn download(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
            self.ctx.bind_to_thread().map_err(err)?;
            // SAFETY: as in `upload`.
            unsafe { result::memcpy_dtoh_sync(dst, self.base + offset as u64) }.map_err(err)
        }
    }
}

/// The destination bytes of one D worker.
pub struct RegisteredMemory {
    host: HostBuffer,
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::GpuMirror>,
}

impl std::fmt::Debug for RegisteredMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredMemory")
            .field("len", &self.host.len)
            .field("gpu", &self.is_gpu())
            .finish()
    }
}

impl RegisteredMemory {
    /// `len` zeroed bytes of `kind` memory.
    pub fn new(kind: MemoryKind, len: u64) -> Result<Self, MemoryError> {
        let n = usize::try_from(len).map_err(|_| MemoryError::Alloc(len))?;
        match kind {
            MemoryKind::Host => Ok(RegisteredMemory {
                host: HostBuffer::new(n)?,
                #[cfg(feature = "cuda")]
                gpu: None,
            }),
            #[cfg(feature = "cuda")]
            MemoryKind::Cuda { ordinal } => {
                let gpu = gpu::GpuMirror::new(ordinal, n)?;
                Ok(RegisteredMemory {
                    host: HostBuffer::new(n)?,
                    gpu: Some(gpu),
                })
            }
            #[cfg(not(feature = "cuda"))]
            MemoryKind::Cuda { .. } => Err(MemoryError::CudaNotBuilt),
        }
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.host.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.host.len == 0
    }

    /// Whether the bytes live on a GPU (behind the staging mirror).
    pub fn is_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.gpu.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize, MemoryError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(offset as usize),
            _ => Err(MemoryError::OutOfBounds {
                offset,
                len,
                size: self.len(),
            }),
        }
    }

    /// The host bytes where a write of `[offset, offset + len)` lands (the staging mirror on
    /// GPU), for the duration of one socket read.
    ///
    /// # Safety
    /// The caller must not keep the slice across an `.await` of another writer of the same
    /// range and must not read it as a consistent snapshot: other connections may write the
    /// same bytes concurrently (like DMA). The range must be in bounds (checked, `Err` if not).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn landing_slice(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<&mut [u8], MemoryError> {
        let at = self.check(offset, len)?;
        // SAFETY: in bounds; aliasing contract above.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host.ptr.as_ptr().add(at), len as usize) })
    }

    /// The host bytes of a landed range, for the audit (staging mirror on GPU).
    ///
    /// # Safety
    /// Same DMA-like contract as [`Self::landing_slice`].
    pub(crate) unsafe fn landed(&self, offset: u64, len: u64) -> Result<&[u8], MemoryError> {
        let at = self.check(offset, len)?;
        // SAFETY: in bounds; aliasing contract above.
        Ok(unsafe { std::slice::from_raw_parts(self.host.ptr.as_ptr().add(at), len as usize) })
    }

    /// Make a landed range visible in destination memory: a no-op on host, the host-to-device
    /// copy on GPU. Returns once the copy completed.
    pub fn commit(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        let _at = self.check(offset, len)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            // SAFETY: in bounds; the staging bytes are plain memory.
            let src = unsafe { self.landed(offset, len)? };
            return g.upload(_at, src);
        }
        Ok(())
    }

    /// Copy `out.len()` destination bytes at `offset` into `out` (device memory on GPU).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let at = self.check(offset, out.len() as u64)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.download(at, out);
        }
        // SAFETY: in bounds; `out` is caller-owned and cannot overlap the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.host.ptr.as_ptr().add(at),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// A copy of `len` destination bytes at `offset`.
    pub fn snapshot(&self, offset: u64, len: u64) -> Result<Vec<u8>, MemoryError> {
        let mut v = vec![0u8; usize::try_from(len).map_err(|_| MemoryError::Alloc(len))?];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// Overwrite destination bytes (tests, READ fixtures). Goes through the staging mirror and
    /// [`Self::commit`].
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        // SAFETY: in bounds (checked); DMA-like contract.
        let dst = unsafe { self.landing_slice(offset, src.len() as u64)? };
        dst.copy_from_slice(src);
        self.commit(offset, src.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_zeroed_bounds_checked_and_round_trips() {
        let m = RegisteredMemory::new(MemoryKind::Host, 8192).unwrap();
        assert_eq!(m.snapshot(0, 8192).unwrap(), vec![0u8; 8192]);
        m.write(4090, &[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(m.snapshot(4090, 6).unwrap(), vec![1, 2, 3, 4, 5, 6]);
        assert!(matches!(
            m.write(8190, &[0; 4]),
            Err(MemoryError::OutOfBounds { .. })
        ));
        assert!(matches!(
            m.snapshot(u64::MAX, 2),
            Err(MemoryError::OutOfBounds { .. })
        ));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_typed_error() {
        assert!(matches!(
            RegisteredMemory::new(MemoryKind::Cuda { ordinal: 0 }, 16),
            Err(MemoryError::CudaNotBuilt)
        ));
    }

    /// Built with `cuda`: a typed error without a driver, a device round trip with one.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_memory_round_trips_or_reports_a_missing_driver() {
        match RegisteredMemory::new(MemoryKind::Cuda { ordinal: 0 }, 1 << 20) {
            Err(MemoryError::NoCudaDriver) => {
                eprintln!("no CUDA driver here: GPU path not exercised")
            }
            Err(e) => panic!("unexpected error: {e}"),
            Ok(m) => {
                assert!(m.is_gpu());
                m.write(4096, &[9; 64]).unwrap();
                // `read` comes from device memory, so this proves the commit reached the GPU.
                assert_eq!(m.snapshot(4096, 64).unwrap(), vec![9; 64]);
                assert_eq!(m.snapshot(0, 8).unwrap(), vec![0; 8]);
            }
        }
    }
}
