//! The CUDA side of device destinations (feature `cuda`, driver loaded at run time): the host's
//! regions checked with the driver ([`super::device_pointer`]), kvrecv's own allocation, and
//! the staging slots: page-locked host memory (`cuMemHostAlloc`, portable, not write-combined:
//! the audit reads it back), a stream kvrecv creates with `CU_STREAM_NON_BLOCKING`, and an event
//! with `CU_EVENT_BLOCKING_SYNC` so that waiting for a copy sleeps instead of spinning a core.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaSlice};

use super::device_pointer::{check_regions, CopyContext, PointerAttributes};
use super::device_stream::STAGING_CHUNK;
use super::device_stream::{DeviceStream, StagedCopier, STAGING_SLOTS};
use super::memory_error::MemoryError;

fn cuda(op: &'static str) -> impl FnOnce(result::DriverError) -> MemoryError {
    move |e| MemoryError::Cuda(format!("{op}: {e:?}"))
}

/// The GPU's primary context, retained (`cuDevicePrimaryCtxRetain`) until dropped. Fails with
/// [`MemoryError::NoCudaDriver`] without a driver (cudarc panics instead if not checked first).
fn primary(ordinal: usize) -> Result<Arc<CudaContext>, MemoryError> {
    // SAFETY: only probes for the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Err(MemoryError::NoCudaDriver);
    }
    CudaContext::new(ordinal).map_err(cuda("cuDevicePrimaryCtxRetain"))
}

/// The context the slots copy in: a raw handle, kept alive by `_primary` when it is the primary
/// context (a host's non-primary context lives as long as its memory, [`super::device_pointer`]).
struct CopyCtx {
    raw: sys::CUcontext,
    _primary: Arc<CudaContext>,
}

// SAFETY: a CUcontext may be made current on any thread; this only carries the handle.
unsafe impl Send for CopyCtx {}
// SAFETY: `&CopyCtx` only binds the context (cuCtxSetCurrent), which is thread safe.
unsafe impl Sync for CopyCtx {}

impl CopyCtx {
    fn bind(&self) -> Result<(), MemoryError> {
        // SAFETY: a live context (see the struct doc).
        unsafe { result::ctx::set_current(self.raw) }.map_err(cuda("cuCtxSetCurrent"))
    }
}

/// One attribute of `ptr`.
///
/// # Safety
/// `T` is the attribute's C type.
unsafe fn attribute<T: Default>(
    ptr: u64,
    which: sys::CUpointer_attribute,
) -> Result<T, sys::CUresult> {
    let mut v = T::default();
    // SAFETY: `v` is a valid `T`, the attribute's type (caller).
    let rc = unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut _, which, ptr) };
    match rc {
        sys::CUresult::CUDA_SUCCESS => Ok(v),
        e => Err(e),
    }
}

/// What the driver reports about `ptr`, or its error if it does not know the pointer.
fn pointer_attributes(ptr: u64) -> Result<PointerAttributes, sys::CUresult> {
    use sys::CUpointer_attribute as A;
    // SAFETY: each attribute is read into its documented C type, or (the enum and the
    // boolean, whose width the documentation leaves open) into a zeroed wider integer that
    // holds it whatever its width (little-endian).
    unsafe {
        let mem_type: u64 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)?;
        let managed: u64 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED)?;
        let ordinal: i32 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)?;
        let context: usize = attribute(ptr, A::CU_POINTER_ATTRIBUTE_CONTEXT)?;
        let range_start: u64 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)?;
        let range_size: usize = attribute(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_SIZE)?;
        Ok(PointerAttributes {
            device_memory: mem_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64,
            managed: managed != 0,
            ordinal: usize::try_from(ordinal).unwrap_or(usize::MAX),
            context,
            range_start,
            range_size: range_size as u64,
        })
    }
}

/// The host's device regions `(start, pointer, bytes used)` on GPU `ordinal`, checked with the
/// driver, behind [`STAGING_SLOTS`] staging slots.
pub(crate) fn host_regions(
    ordinal: usize,
    segs: Vec<(u64, u64, u64)>,
) -> Result<StagedCopier, MemoryError> {
    let primary = primary(ordinal)?;
    let mut attrs = Vec::with_capacity(segs.len());
    for (i, &(_, ptr, _)) in segs.iter().enumerate() {
        let a = pointer_attributes(ptr).map_err(|e| MemoryError::UnknownPointer {
            region: i,
            error: format!("{e:?}"),
        })?;
        attrs.push(a);
    }
    let named: Vec<(usize, u64, u64)> = segs.iter().map(|&(_, p, l)| (ordinal, p, l)).collect();
    let raw = match check_regions(&named, &attrs, primary.cu_ctx() as usize)? {
        CopyContext::Primary => primary.cu_ctx(),
        CopyContext::Host(c) => {
            tracing::info!(
                ordinal,
                "device regions belong to a non-primary context: copying in it"
            );
            c as sys::CUcontext
        }
    };
    let ctx = Arc::new(CopyCtx {
        raw,
        _primary: primary,
    });
    Ok(StagedCopier::new(segs, slots(&ctx)?, None))
}

/// kvrecv's own `len` zeroed bytes on GPU `ordinal` (primary context), behind staging slots.
pub(crate) fn allocate(ordinal: usize, len: usize) -> Result<StagedCopier, MemoryError> {
    let primary = primary(ordinal)?;
    let stream = primary.default_stream();
    let buf: CudaSlice<u8> = stream
        .alloc_zeros::<u8>(len.max(1))
        .map_err(cuda("cuMemAlloc"))?;
    stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
    let base = {
        use cudarc::driver::DevicePtr;
        let (p, _sync) = buf.device_ptr(&stream);
        p
    };
    let ctx = Arc::new(CopyCtx {
        raw: primary.cu_ctx(),
        _primary: primary,
    });
    let slots = slots(&ctx)?;
    Ok(StagedCopier::new(
        vec![(0, base, len as u64)],
        slots,
        Some(Box::new(buf)),
    ))
}

fn slots(ctx: &Arc<CopyCtx>) -> Result<Vec<Box<dyn DeviceStream>>, MemoryError> {
    (0..STAGING_SLOTS)
        .map(|_| CudaSlot::new(ctx).map(|s| Box::new(s) as Box<dyn DeviceStream>))
        .collect()
}

/// One staging slot on CUDA.
struct CudaSlot {
    ctx: Arc<CopyCtx>,
    stream: sys::CUstream,
    done: sys::CUevent,
    pinned: *mut u8,
}

// SAFETY: the handles and the pinned buffer are owned by the slot, used by one thread at a time
// (`&mut self`), with the context bound first.
unsafe impl Send for CudaSlot {}

impl CudaSlot {
    fn new(ctx: &Arc<CopyCtx>) -> Result<Self, MemoryError> {
        ctx.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(cuda("cuStreamCreate"))?;
        let mut slot = CudaSlot {
            ctx: Arc::clone(ctx),
            stream,
            done: std::ptr::null_mut(),
            pinned: std::ptr::null_mut(),
        };
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out-pointer to a local; the context is bound.
        unsafe { sys::cuEventCreate(&mut slot.done, flags) }
            .result()
            .map_err(cuda("cuEventCreate"))?;
        // Portable: page-locked for every context. Not write-combined: the audit reads it.
        // SAFETY: a fresh allocation, freed in Drop.
        slot.pinned = unsafe { result::malloc_host(STAGING_CHUNK, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda("cuMemHostAlloc"))? as *mut u8;
        Ok(slot)
    }
}

impl DeviceStream for CudaSlot {
    fn staging(&mut self) -> &mut [u8] {
        // SAFETY: STAGING_CHUNK bytes of page-locked memory owned by the slot; no copy touches
        // them between synchronisations when the caller reaches them (trait contract).
        unsafe { std::slice::from_raw_parts_mut(self.pinned, STAGING_CHUNK) }
    }

    unsafe fn enqueue_upload(&mut self, dst: u64, len: usize) -> Result<(), MemoryError> {
        self.ctx.bind()?;
        // SAFETY: `dst` range is device memory kvrecv may write (caller); the source is the
        // slot's pinned buffer, untouched until `synchronize`.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, self.pinned as *const _, len, self.stream) }
            .result()
            .map_err(cuda("cuMemcpyHtoDAsync"))
    }

    unsafe fn enqueue_download(&mut self, src: u64, len: usize) -> Result<(), MemoryError> {
        self.ctx.bind()?;
        // SAFETY: as in `enqueue_upload`, the other way.
        unsafe { sys::cuMemcpyDtoHAsync_v2(self.pinned as *mut _, src, len, self.stream) }
            .result()
            .map_err(cuda("cuMemcpyDtoHAsync"))
    }

    fn synchronize(&mut self) -> Result<(), MemoryError> {
        self.ctx.bind()?;
        // SAFETY: the slot's own event and stream.
        unsafe {
            result::event::record(self.done, self.stream).map_err(cuda("cuEventRecord"))?;
            result::event::synchronize(self.done).map_err(cuda("cuEventSynchronize"))
        }
    }
}

impl Drop for CudaSlot {
    fn drop(&mut self) {
        // Pushed and popped, not set: the thread that drops the slot (a host's own, when it
        // drops a `TcpTarget`) keeps the context it had current.
        // SAFETY: a live context (see `CopyCtx`).
        if unsafe { sys::cuCtxPushCurrent_v2(self.ctx.raw) }
            .result()
            .is_err()
        {
            return; // leak rather than free memory a copy may still use
        }
        // SAFETY: the slot's own handles, released once; the stream is drained first so no
        // copy still reads the pinned buffer (if it cannot be, everything is leaked).
        unsafe {
            if result::stream::synchronize(self.stream).is_ok() {
                let _ = result::stream::destroy(self.stream);
                if !self.done.is_null() {
                    let _ = result::event::destroy(self.done);
                }
                if !self.pinned.is_null() {
                    let _ = result::free_host(self.pinned as *mut _);
                }
            }
            let mut popped = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut popped);
        }
    }
}

/// The GPU side of GPUDirect RDMA for the host's regions: checked with the driver as for the
/// TCP target, each exported as a dma-buf of the allocation holding it.
pub(crate) struct CudaExport {
    ctx: CopyCtx,
    /// `(region pointer, its attributes)`.
    regions: Vec<(u64, PointerAttributes)>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    dma_buf: bool,
}

impl std::fmt::Debug for CudaExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExport")
            .field("regions", &self.regions.len())
            .field("dma_buf", &self.dma_buf)
            .finish()
    }
}

impl CudaExport {
    /// `regions`: `(device pointer, bytes the layout uses)` on GPU `ordinal`.
    pub(crate) fn new(ordinal: usize, regions: &[(u64, u64)]) -> Result<Self, MemoryError> {
        let primary = primary(ordinal)?;
        let mut attrs = Vec::with_capacity(regions.len());
        for (i, &(ptr, _)) in regions.iter().enumerate() {
            attrs.push(
                pointer_attributes(ptr).map_err(|e| MemoryError::UnknownPointer {
                    region: i,
                    error: format!("{e:?}"),
                })?,
            );
        }
        let named: Vec<(usize, u64, u64)> = regions.iter().map(|&(p, l)| (ordinal, p, l)).collect();
        let raw = match check_regions(&named, &attrs, primary.cu_ctx() as usize)? {
            CopyContext::Primary => primary.cu_ctx(),
            CopyContext::Host(c) => c as sys::CUcontext,
        };
        let dma_buf = primary
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .is_ok_and(|v| v == 1);
        Ok(CudaExport {
            ctx: CopyCtx {
                raw,
                _primary: primary,
            },
            regions: regions.iter().map(|&(p, _)| p).zip(attrs).collect(),
            dma_buf,
        })
    }
}

impl crate::rdma::verbs::DeviceMemoryExport for CudaExport {
    fn dma_buf(&self, ptr: u64, len: u64) -> Result<crate::rdma::verbs::DmaBuf, String> {
        use std::os::fd::FromRawFd;
        if !self.dma_buf {
            return Err("the GPU driver does not export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0; \
                 needs the open kernel modules)"
                .into());
        }
        let a = self
            .regions
            .iter()
            .find(|(p, _)| *p == ptr)
            .map(|(_, a)| a)
            .ok_or_else(|| format!("{ptr:#x} is not a registered device region"))?;
        // The whole allocation, widened to host pages as the call requires; the region is
        // `offset` bytes into it.
        // SAFETY: sysconf has no preconditions. 64 KiB on some Arm nodes (Grace).
        let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let start = a.range_start / page * page;
        let end = (a.range_start + a.range_size).div_ceil(page) * page;
        if ptr + len > end {
            return Err(format!("{len} bytes at {ptr:#x} run past the allocation"));
        }
        self.ctx.bind().map_err(|e| e.to_string())?;
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: out-pointer to a local int, as the DMA_BUF_FD handle type writes; a range of
        // one live allocation (checked at construction).
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                &mut fd as *mut std::os::raw::c_int as *mut _,
                start,
                (end - start) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(|e| format!("cuMemGetHandleForAddressRange: {e:?}"))?;
        if fd < 0 {
            return Err("cuMemGetHandleForAddressRange returned no descriptor".into());
        }
        Ok(crate::rdma::verbs::DmaBuf {
            // SAFETY: a fresh descriptor the driver handed over to us.
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
            offset: ptr - start,
        })
    }

    fn peermem_loaded(&self) -> bool {
        crate::rdma::verbs::gpudirect::nvidia_peermem_loaded()
    }
}
