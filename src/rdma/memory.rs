//! Registered destination memory, laid out like the KV layout (see
//! [`super::tcp::windows::WindowMap`] for the offsets). By default kvrecv allocates it: one
//! contiguous host allocation, or (feature `cuda`) device memory. With [`HostMemory`] the host
//! registers its own KV regions (one per layout region) and kvrecv allocates no KV memory at
//! all; with [`DeviceMemory`], its own CUDA device regions.
//!
//! Device memory (kvrecv's or the host's) is reached only through copies
//! (`device_stream`): TCP payloads collect in a bounded staging buffer and go to the
//! device through page-locked staging slots on kvrecv's own non-blocking CUDA streams; a copy
//! returns once the device holds the bytes, before the write counts as landed.
//!
//! The host bytes are shared like DMA memory: the data server writes them through raw pointers
//! from many connections at once (the kernel copies socket data straight in with `recv(2)`), so
//! no reference (`&` or `&mut`) to them is ever made: writes go through raw pointers
//! (`RegisteredMemory::landing_ptr`), reads copy the bytes out ([`RegisteredMemory::read`]).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use thiserror::Error;

/// Alignment of the host allocation (a page: what an RDMA registration, which pins it, wants).
const ALIGN: usize = 4096;

#[derive(Debug, Error)]
/// Why destination memory could not be set up or written.
pub enum MemoryError {
    #[error("cannot allocate {0} bytes of destination memory")]
    /// The allocation of that many bytes failed.
    Alloc(u64),
    #[error("range {offset}+{len} is outside the {size}-byte registered memory")]
    /// A write outside the registered memory.
    OutOfBounds {
        /// Start of the write.
        offset: u64,
        /// Its length.
        len: u64,
        /// Bytes registered.
        size: u64,
    },
    #[error("no CUDA driver library found (libcuda.so); GPU destination memory is unavailable")]
    /// Built with CUDA, but no driver was found at run time.
    NoCudaDriver,
    #[error("kvrecv was built without the `cuda` feature")]
    /// CUDA memory asked for in a build without the `cuda` feature.
    CudaNotBuilt,
    #[error("CUDA: {0}")]
    /// A CUDA driver call failed.
    Cuda(String),
    #[error("host memory: {0}")]
    /// The host's regions do not match the layout.
    HostRegions(String),
    #[error("device memory: {0}")]
    /// The host's device regions do not match the layout.
    DeviceRegions(String),
    #[error("device region {region}: the CUDA driver does not know the pointer ({error})")]
    /// `cuPointerGetAttribute` failed on a region's pointer (not memory of this process's CUDA).
    UnknownPointer {
        /// The region, in layout order.
        region: usize,
        /// The driver's error.
        error: String,
    },
    #[error("device region {region} is not device memory (host, managed or unified memory)")]
    /// A region the driver reports as host or managed memory.
    NotDeviceMemory {
        /// The region, in layout order.
        region: usize,
    },
    #[error("device region {region} was registered on GPU {named} but lives on GPU {actual}")]
    /// A region on another GPU than the one it was registered on.
    OtherDevice {
        /// The region, in layout order.
        region: usize,
        /// The ordinal given to [`DeviceRegion::new`].
        named: usize,
        /// The driver's.
        actual: usize,
    },
    #[error("device region {region} belongs to another CUDA context than region 0")]
    /// Regions of one layout in two contexts (kvrecv copies in one).
    OtherContext {
        /// The region, in layout order.
        region: usize,
    },
    #[error(
        "device region {region} ({len} bytes at {ptr:#x}) is not inside one allocation \
         ({alloc_len} bytes at {alloc_start:#x})"
    )]
    /// A region that runs past the end of (or starts before) the allocation holding its start.
    OutsideAllocation {
        /// The region, in layout order.
        region: usize,
        /// Its start.
        ptr: u64,
        /// Bytes the layout uses from it.
        len: u64,
        /// The allocation's start, per the driver.
        alloc_start: u64,
        /// The allocation's length.
        alloc_len: u64,
    },
}

/// Where destination bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryKind {
    #[default]
    /// Page-aligned host memory kvrecv allocates (pageable: an RDMA registration pins it).
    Host,
    /// Device memory kvrecv allocates on GPU `ordinal` (feature `cuda`), reached through
    /// staging copies.
    Cuda {
        /// The GPU.
        ordinal: usize,
    },
}

/// One KV cache region registered with kvrecv: bytes the host hands over
/// ([`HostRegion::owned`], safe: kvrecv owns them while they are registered) or a pointer and
/// length into memory kvrecv cannot own ([`HostRegion::new`], `unsafe`: a foreign allocator).
pub struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
    /// The bytes, when kvrecv owns them ([`HostRegion::owned`]).
    owned: Option<OwnedBytes>,
}

/// A boxed slice kvrecv owns, held as a raw pointer: the data plane (or a NIC) writes through
/// pointers into it from other threads, which a live `Box` (a unique reference) would not
/// allow. Its bytes are reached only through [`Self::as_ptr`] and copies ([`Self::to_vec`]).
pub(crate) struct OwnedBytes {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain bytes owned by this struct, reached only through raw pointers (struct doc).
unsafe impl Send for OwnedBytes {}
// SAFETY: as for `Send`: `&OwnedBytes` hands out only a pointer and copies.
unsafe impl Sync for OwnedBytes {}

impl OwnedBytes {
    /// `len` zeroed bytes.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self::new(vec![0u8; len].into_boxed_slice())
    }

    /// Start of the bytes (what a NIC registration covers).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// A copy of the bytes as they are now. Writers (the NIC, the data server) may change
    /// them meanwhile: a copy taken while a write is under way may hold part of it.
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: `ptr` is valid for `len` bytes (owned); a raw copy into a fresh Vec, so no
        // reference to the shared bytes exists.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), v.as_mut_ptr(), self.len) };
        v
    }

    fn new(bytes: Box<[u8]>) -> Self {
        let len = bytes.len();
        // SAFETY: Box::into_raw never returns null.
        let ptr = unsafe { NonNull::new_unchecked(Box::into_raw(bytes).cast::<u8>()) };
        OwnedBytes { ptr, len }
    }

    /// The box again (nothing else may reach the bytes any more).
    fn into_box(self) -> Box<[u8]> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `ptr` and `len` came from `Box::into_raw` of a `Box<[u8]>`, taken back once
        // (`self` is not dropped).
        unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                this.ptr.as_ptr(),
                this.len,
            ))
        }
    }
}

impl Drop for OwnedBytes {
    fn drop(&mut self) {
        // SAFETY: as in `into_box`; dropped once.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

// SAFETY: the constructor's contract (or kvrecv's ownership, `owned`) makes the region plain
// bytes shared like DMA memory; kvrecv writes them through raw pointers only (module doc).
unsafe impl Send for HostRegion {}
// SAFETY: as for `Send`: `&HostRegion` reaches the bytes only through raw pointers and copies.
unsafe impl Sync for HostRegion {}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("owned", &self.owned.is_some())
            .finish()
    }
}

impl HostRegion {
    /// Register `len` bytes at `ptr` as one KV region.
    ///
    /// # Safety
    /// The caller guarantees, for as long as any [`crate::embed::KvRecv`] handle (or
    /// [`super::TcpTarget`], or RDMA target, which registers it with the NIC until it is
    /// dropped) built with this region exists, and until its shutdown completed, or until a
    /// [`crate::embed::KvRecv::resume`] onto other memory returned (one onto this region:
    /// from the call on):
    /// - `ptr..ptr + len` is valid, writable memory of one allocation, and stays allocated and
    ///   at the same address (pinned: not freed, moved, reallocated or unmapped);
    /// - kvrecv may write any block of it whose request is loaded and not yet released, from
    ///   its own threads, at any time; the host neither writes nor reads a block while it is
    ///   owned by a request that has not appeared in `finished_recving` (drained), and it
    ///   writes a block only after kvrecv released it;
    /// - nothing else (another kvrecv, another DMA engine) writes the region concurrently.
    ///
    /// A null `ptr` or zero `len` is refused.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Result<Self, MemoryError> {
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| MemoryError::HostRegions("null region pointer".into()))?;
        if len == 0 {
            return Err(MemoryError::HostRegions("empty region".into()));
        }
        Ok(HostRegion {
            ptr,
            len,
            owned: None,
        })
    }

    /// Hand `bytes` over as one KV region: kvrecv owns them while they are registered (as
    /// long as any clone of the [`HostMemory`] holding the region lives: the worker keeps one
    /// until its thread ended), so no contract is left to the host. Read a block back with
    /// [`crate::KvRecv::read_block`]; take the memory back with [`HostMemory::take_back`].
    /// An empty region is refused.
    pub fn owned(bytes: impl Into<Box<[u8]>>) -> Result<Self, MemoryError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(MemoryError::HostRegions("empty region".into()));
        }
        let owned = OwnedBytes::new(bytes);
        Ok(HostRegion {
            ptr: owned.ptr,
            len: owned.len,
            owned: Some(owned),
        })
    }

    /// Whether kvrecv owns the bytes ([`HostRegion::owned`]).
    pub fn is_owned(&self) -> bool {
        self.owned.is_some()
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Copy `out.len()` bytes from `offset` of the region. Only for bytes no writer can reach
    /// now (a block no request holds: [`crate::KvRecv::read_block`] checks, under the lock
    /// every admission takes).
    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) -> Result<(), MemoryError> {
        let end = offset.checked_add(out.len());
        if end.is_none_or(|e| e > self.len) {
            return Err(MemoryError::OutOfBounds {
                offset: offset as u64,
                len: out.len() as u64,
                size: self.len as u64,
            });
        }
        // SAFETY: in bounds (checked); the region is valid for `len` bytes (its constructor's
        // contract, or owned), and the caller made sure nothing writes this range now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Start of the region (what a NIC registration covers).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether the region has no bytes (never: the constructor refuses it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The host's KV regions, one per layout region in layout order (vLLM: one tensor per layer).
/// Each must hold at least `block_len x num_blocks` bytes of its region. Cheap to clone.
#[derive(Debug, Clone)]
pub struct HostMemory(std::sync::Arc<[HostRegion]>);

impl HostMemory {
    /// The regions, in layout order.
    pub fn new(regions: Vec<HostRegion>) -> Self {
        HostMemory(regions.into())
    }

    /// The host's KV cache handed over whole, one buffer per layout region in layout order
    /// (vLLM: one tensor per layer): safe, kvrecv owns the buffers while they are registered
    /// ([`HostRegion::owned`]). `Vec<u8>` and `Box<[u8]>` both fit.
    ///
    /// ```
    /// let memory = kvrecv::HostMemory::owned(vec![vec![0u8; 4096 * 8]; 2])?;
    /// assert_eq!(memory.regions().len(), 2);
    /// // ... start a worker on it; once every handle is gone, the buffers are the host's again:
    /// let buffers = memory.take_back().expect("no other clone");
    /// assert_eq!(buffers[1].len(), 4096 * 8);
    /// # Ok::<(), kvrecv::MemoryError>(())
    /// ```
    pub fn owned<B: Into<Box<[u8]>>>(
        regions: impl IntoIterator<Item = B>,
    ) -> Result<Self, MemoryError> {
        let regions = regions
            .into_iter()
            .map(HostRegion::owned)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HostMemory::new(regions))
    }

    /// The buffers back, once nothing else holds this memory: every other clone dropped
    /// (the builder's, and the worker's, which go when the last [`crate::KvRecv`] handle was
    /// dropped and its thread ended) and every region owned ([`HostRegion::owned`]).
    /// Otherwise the memory comes back unchanged.
    pub fn take_back(mut self) -> Result<Vec<Box<[u8]>>, HostMemory> {
        match std::sync::Arc::get_mut(&mut self.0) {
            Some(regions) if regions.iter().all(HostRegion::is_owned) => Ok(regions
                .iter_mut()
                .filter_map(|r| r.owned.take().map(OwnedBytes::into_box))
                .collect()),
            _ => Err(self),
        }
    }

    /// The regions.
    pub fn regions(&self) -> &[HostRegion] {
        &self.0
    }
}

/// One KV cache region the host allocated in CUDA device memory: a device pointer and length
/// on GPU `ordinal` (feature `cuda`; without it, starting a target with one is a typed error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRegion {
    ordinal: usize,
    ptr: u64,
    len: u64,
}

impl DeviceRegion {
    /// Register `len` bytes of device memory at `ptr` (a `CUdeviceptr`) on GPU `ordinal`.
    ///
    /// # Safety
    /// The same contract as [`HostRegion::new`], for device memory: valid, allocated and not
    /// moved until the handle's shutdown returned (so is its CUDA context); kvrecv copies into
    /// any block whose request is loaded and not yet released, from its own threads and
    /// streams, in the context the memory belongs to (the primary context of `ordinal`, or the
    /// host's own); the host uses a block only after kvrecv released it, and every copy into
    /// it has completed by then. A null `ptr` or zero `len` is refused here; at start the
    /// driver is asked whether the region is device memory on `ordinal` inside one allocation
    /// (typed [`MemoryError`]s otherwise).
    pub unsafe fn new(ordinal: usize, ptr: u64, len: u64) -> Result<Self, MemoryError> {
        if ptr == 0 || len == 0 {
            return Err(MemoryError::DeviceRegions("null or empty region".into()));
        }
        Ok(DeviceRegion { ordinal, ptr, len })
    }

    /// The GPU.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device pointer.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region has no bytes (never: the constructor refuses it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Copies into and out of memory the data server cannot address directly (device memory). TCP
/// payloads reach it through a bounded staging buffer ([`STAGING_CHUNK`]), each copy inside the
/// write's permit gate. Both calls block their thread: callers on the async runtime make them
/// on its blocking pool.
pub(crate) trait DeviceCopy: Send + Sync {
    /// Host -> device: returns once the device holds the bytes (the copy's stream was
    /// synchronised), never merely once the copy was queued.
    fn upload(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError>;
    /// Device -> host, likewise complete on return.
    fn download(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError>;
}

/// Largest staging buffer one write uses on its way to device memory.
pub const STAGING_CHUNK: usize = 1 << 20;

/// The host's device regions, one per layout region in layout order. Cheap to clone.
#[derive(Clone)]
pub struct DeviceMemory(Arc<DeviceInner>);

enum DeviceInner {
    Regions(Vec<DeviceRegion>),
    /// A host buffer behind the device interface, to test the staged path without a GPU.
    #[cfg(any(test, feature = "testing"))]
    Fake(Arc<super::fake_device::FakeDevice>),
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.0 {
            DeviceInner::Regions(r) => f.debug_tuple("DeviceMemory").field(r).finish(),
            #[cfg(any(test, feature = "testing"))]
            DeviceInner::Fake(_) => f.write_str("DeviceMemory(fake)"),
        }
    }
}

impl DeviceMemory {
    /// The regions, in layout order.
    pub fn new(regions: Vec<DeviceRegion>) -> Self {
        DeviceMemory(Arc::new(DeviceInner::Regions(regions)))
    }

    /// The regions, in layout order (`None` for a fake device).
    pub fn regions(&self) -> Option<&[DeviceRegion]> {
        match &*self.0 {
            DeviceInner::Regions(r) => Some(r),
            #[cfg(any(test, feature = "testing"))]
            DeviceInner::Fake(_) => None,
        }
    }

    /// A fake device of `len` bytes (host memory reached only through copies, which complete
    /// only when their staging slot is synchronised), and a view of its bytes for the test.
    #[cfg(any(test, feature = "testing"))]
    pub fn fake(len: usize) -> (Self, Arc<super::fake_device::FakeDevice>) {
        let dev = super::fake_device::FakeDevice::new(len);
        (DeviceMemory(Arc::new(DeviceInner::Fake(dev.clone()))), dev)
    }
}

/// The CUDA copier for the host's device regions `(start, pointer, length)` on `ordinal`.
#[cfg(feature = "cuda")]
fn device_copier(
    ordinal: usize,
    segs: Vec<(u64, u64, u64)>,
) -> Result<Arc<dyn DeviceCopy>, MemoryError> {
    Ok(Arc::new(super::cuda_device::host_regions(ordinal, segs)?))
}

#[cfg(not(feature = "cuda"))]
fn device_copier(
    _ordinal: usize,
    _segs: Vec<(u64, u64, u64)>,
) -> Result<Arc<dyn DeviceCopy>, MemoryError> {
    Err(MemoryError::CudaNotBuilt)
}

/// A contiguous piece of the registered memory: `[start, start + len)` at `ptr`.
struct Segment {
    start: u64,
    ptr: NonNull<u8>,
    len: u64,
}

struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this struct; concurrent access goes through raw
// pointers with the DMA-like contract documented at the top of the module.
unsafe impl Send for HostBuffer {}
// SAFETY: as for `Send`: `&HostBuffer` reaches the bytes only through raw pointers and copies.
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

/// The destination bytes of one D worker.
pub struct RegisteredMemory {
    /// Contiguous, ascending, covering `[0, len)`.
    segments: Vec<Segment>,
    len: u64,
    /// kvrecv's own allocation (none with host-owned memory).
    _owned: Option<HostBuffer>,
    /// Keeps the host's region list alive (the bytes are the host's).
    host_owned: Option<HostMemory>,
    /// Memory reached only through copies (device memory, kvrecv's or the host's): no
    /// segments.
    staged: Option<Arc<dyn DeviceCopy>>,
    /// The staged memory is kvrecv's own CUDA allocation.
    gpu: bool,
}

// SAFETY: the segments point into `_owned` or into the host's regions, both plain bytes under
// the DMA-like contract of the module doc.
unsafe impl Send for RegisteredMemory {}
// SAFETY: as for `Send`: `&RegisteredMemory` reaches the bytes only through raw pointers and copies.
unsafe impl Sync for RegisteredMemory {}

impl std::fmt::Debug for RegisteredMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredMemory")
            .field("len", &self.len)
            .field("gpu", &self.is_gpu())
            .field("host_owned", &self.host_owned.is_some())
            .finish()
    }
}

impl RegisteredMemory {
    /// `len` zeroed bytes of `kind` memory, allocated by kvrecv.
    pub fn new(kind: MemoryKind, len: u64) -> Result<Self, MemoryError> {
        let n = usize::try_from(len).map_err(|_| MemoryError::Alloc(len))?;
        let owned = |host: HostBuffer| RegisteredMemory {
            segments: vec![Segment {
                start: 0,
                ptr: host.ptr,
                len,
            }],
            len,
            _owned: Some(host),
            host_owned: None,
            staged: None,
            gpu: false,
        };
        match kind {
            MemoryKind::Host => Ok(owned(HostBuffer::new(n)?)),
            #[cfg(feature = "cuda")]
            MemoryKind::Cuda { ordinal } => Ok(RegisteredMemory {
                segments: Vec::new(),
                len,
                _owned: None,
                host_owned: None,
                staged: Some(Arc::new(super::cuda_device::allocate(ordinal, n)?)),
                gpu: true,
            }),
            #[cfg(not(feature = "cuda"))]
            MemoryKind::Cuda { .. } => Err(MemoryError::CudaNotBuilt),
        }
    }

    /// The host's own regions as the destination: `spans` are the layout's `(start, length)`
    /// per region ([`super::tcp::windows::WindowMap::region_spans`]); region `i` of `host` backs span
    /// `i` and must be at least as long. Nothing is allocated or zeroed.
    pub fn host_owned(host: HostMemory, spans: &[(u64, u64)]) -> Result<Self, MemoryError> {
        let needed: Vec<u64> = spans.iter().map(|&(_, len)| len).collect();
        super::memory_fit::check_fit(&host, &needed)
            .map_err(|e| MemoryError::HostRegions(e.to_string()))?;
        let mut segments = Vec::with_capacity(spans.len());
        let mut end = 0u64;
        for (i, (r, &(start, len))) in host.regions().iter().zip(spans).enumerate() {
            if start != end {
                return Err(MemoryError::HostRegions(format!(
                    "layout region {i} starts at {start}, expected {end}"
                )));
            }
            end = start + len;
            segments.push(Segment {
                start,
                ptr: r.ptr,
                len,
            });
        }
        Ok(RegisteredMemory {
            segments,
            len: end,
            _owned: None,
            host_owned: Some(host),
            staged: None,
            gpu: false,
        })
    }

    /// The host's own device regions as the destination (one per layout span, each at least as
    /// long; all on one GPU). Nothing is allocated; writes reach them through
    /// a device copy. Without the `cuda` feature: [`MemoryError::CudaNotBuilt`]; without a
    /// driver: [`MemoryError::NoCudaDriver`].
    pub fn device_owned(dev: DeviceMemory, spans: &[(u64, u64)]) -> Result<Self, MemoryError> {
        let len = spans.last().map_or(0, |(s, l)| s + l);
        let staged: Arc<dyn DeviceCopy> = match &*dev.0 {
            DeviceInner::Regions(regions) => {
                let have: Vec<(u64, u64)> = regions.iter().map(|r| (r.ptr, r.len)).collect();
                let needed: Vec<u64> = spans.iter().map(|&(_, len)| len).collect();
                super::memory_fit::check_spans(&have, &needed)
                    .map_err(|e| MemoryError::DeviceRegions(e.to_string()))?;
                let ordinal = regions.first().map_or(0, |r| r.ordinal);
                let mut segs = Vec::with_capacity(spans.len());
                for (i, (r, &(start, need))) in regions.iter().zip(spans).enumerate() {
                    if r.ordinal != ordinal {
                        return Err(MemoryError::DeviceRegions(format!(
                            "region {i} is on GPU {}, region 0 on GPU {ordinal}",
                            r.ordinal
                        )));
                    }
                    segs.push((start, r.ptr, need));
                }
                device_copier(ordinal, segs)?
            }
            #[cfg(any(test, feature = "testing"))]
            DeviceInner::Fake(f) => {
                if (f.len() as u64) < len {
                    return Err(MemoryError::DeviceRegions("fake device too small".into()));
                }
                Arc::new(super::device_stream::StagedCopier::new(
                    vec![(0, 0, len)],
                    f.streams(super::device_stream::STAGING_SLOTS),
                    None,
                ))
            }
        };
        Ok(RegisteredMemory {
            segments: Vec::new(),
            len,
            _owned: None,
            host_owned: None,
            staged: Some(staged),
            gpu: false,
        })
    }

    /// Whether writes must go through a device copy (device memory the host registered)
    /// instead of landing in place.
    pub fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Copy `src` to destination offset `offset` (bounds-checked): staged memory only (the data
    /// server's bounded staging path). Blocks until the device holds the bytes: call it off the
    /// async runtime.
    pub(crate) fn upload(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.check(offset, src.len() as u64)?;
        match &self.staged {
            Some(d) => d.upload(offset, src),
            None => Err(MemoryError::DeviceRegions("not staged memory".into())),
        }
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no regions.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the bytes are the host's own ([`HostMemory`]).
    pub fn is_host_owned(&self) -> bool {
        self.host_owned.is_some()
    }

    /// Whether the bytes are kvrecv's own GPU allocation ([`MemoryKind::Cuda`]).
    pub fn is_gpu(&self) -> bool {
        self.gpu
    }

    fn out_of_bounds(&self, offset: u64, len: u64) -> MemoryError {
        MemoryError::OutOfBounds {
            offset,
            len,
            size: self.len,
        }
    }

    /// The address of `[offset, offset + len)`, which must lie inside one segment (a write
    /// never spans two layout regions: the window map refuses it).
    fn locate(&self, offset: u64, len: u64) -> Result<*mut u8, MemoryError> {
        if self.staged.is_some() {
            return Err(MemoryError::DeviceRegions(
                "device memory is not host-addressable; writes go through upload".into(),
            ));
        }
        let i = self.segments.partition_point(|s| s.start <= offset);
        let seg = i
            .checked_sub(1)
            .and_then(|i| self.segments.get(i))
            .ok_or_else(|| self.out_of_bounds(offset, len))?;
        let rel = offset - seg.start;
        match rel.checked_add(len) {
            Some(end) if end <= seg.len => {
                // SAFETY: `rel < seg.len`, inside the segment's allocation.
                Ok(unsafe { seg.ptr.as_ptr().add(rel as usize) })
            }
            _ => Err(self.out_of_bounds(offset, len)),
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize, MemoryError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(offset as usize),
            _ => Err(self.out_of_bounds(offset, len)),
        }
    }

    /// The address where a write of `[offset, offset + len)` lands (host memory only: device
    /// memory is refused), bounds-checked to lie inside one segment.
    ///
    /// Invariant of the landing path: these bytes are shared like DMA memory (other
    /// connections' socket reads, the NIC, the host once released may write them at any time),
    /// so no `&`/`&mut` reference to them may ever exist. Write through this pointer only with
    /// raw-pointer I/O (`recv(2)` into it: [`super::tcp::raw_recv::try_recv_into`], or
    /// `ptr::copy_nonoverlapping`), and read landed bytes only by copying them out
    /// ([`Self::read`]).
    pub(crate) fn landing_ptr(&self, offset: u64, len: u64) -> Result<*mut u8, MemoryError> {
        self.locate(offset, len)
    }

    /// Make a landed range visible in destination memory (bounds-checked). Nothing is left to
    /// do: host bytes land in place, and device bytes arrive through `upload`, which
    /// returns only once the device holds them.
    pub fn commit(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        self.check(offset, len).map(|_| ())
    }

    /// Copy `out.len()` destination bytes at `offset` into `out` (device memory on GPU).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        self.check(offset, out.len() as u64)?;
        if let Some(d) = &self.staged {
            return d.download(offset, out);
        }
        // Segment by segment: a read may span layout regions.
        let mut done = 0usize;
        while done < out.len() {
            let at = offset + done as u64;
            let i = self.segments.partition_point(|s| s.start <= at) - 1;
            let seg = &self.segments[i];
            let n = ((seg.start + seg.len - at) as usize).min(out.len() - done);
            let p = self.locate(at, n as u64)?;
            // SAFETY: in bounds; `out` is caller-owned and cannot overlap the registered memory.
            unsafe { std::ptr::copy_nonoverlapping(p, out[done..].as_mut_ptr(), n) };
            done += n;
        }
        Ok(())
    }

    /// A copy of `len` destination bytes at `offset`.
    pub fn snapshot(&self, offset: u64, len: u64) -> Result<Vec<u8>, MemoryError> {
        let mut v = vec![0u8; usize::try_from(len).map_err(|_| MemoryError::Alloc(len))?];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// Overwrite destination bytes (tests, READ fixtures); on device memory through a staged
    /// copy (blocking).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        if self.staged.is_some() {
            return self.upload(offset, src);
        }
        let dst = self.landing_ptr(offset, src.len() as u64)?;
        // SAFETY: `dst` is valid for `src.len()` bytes (bounds-checked inside one segment); a
        // raw copy, so no reference to the shared bytes exists (`landing_ptr`); `src` is the
        // caller's and cannot overlap registered memory it does not hold a reference to.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
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

    #[test]
    fn host_owned_regions_back_their_layout_spans_without_copying() {
        let mut a = vec![0u8; 64];
        let mut b = vec![0u8; 100]; // longer than its span: the tail is never touched
                                    // SAFETY: both Vecs outlive `m` and are read only after it is dropped.
        let regions = unsafe {
            vec![
                HostRegion::new(a.as_mut_ptr(), a.len()).unwrap(),
                HostRegion::new(b.as_mut_ptr(), b.len()).unwrap(),
            ]
        };
        let m =
            RegisteredMemory::host_owned(HostMemory::new(regions), &[(0, 64), (64, 64)]).unwrap();
        assert!(m.is_host_owned());
        assert_eq!(m.len(), 128);
        m.write(60, &[1, 2, 3, 4]).unwrap();
        m.write(64, &[5, 6]).unwrap();
        // A read may span regions; a write may not (a write never crosses a layout region).
        assert_eq!(m.snapshot(60, 6).unwrap(), vec![1, 2, 3, 4, 5, 6]);
        assert!(matches!(
            m.write(62, &[0; 4]),
            Err(MemoryError::OutOfBounds { .. })
        ));
        assert!(m.write(126, &[0; 4]).is_err());
        drop(m);
        assert_eq!(&a[60..], &[1, 2, 3, 4]);
        assert_eq!(&b[..2], &[5, 6]);
        assert!(b[64..].iter().all(|&x| x == 0));
    }

    #[test]
    fn host_regions_whose_used_bytes_overlap_are_refused() {
        let mut a = vec![0u8; 256];
        let p = a.as_mut_ptr();
        let host = |offsets: [usize; 2]| {
            // SAFETY: `a` outlives every HostMemory here; nothing is written.
            let regions = offsets
                .iter()
                .map(|&o| unsafe { HostRegion::new(p.add(o), 128).unwrap() })
                .collect();
            RegisteredMemory::host_owned(HostMemory::new(regions), &[(0, 64), (64, 64)])
        };
        // The same buffer twice, and the second region starting inside the first's 64 bytes.
        for offsets in [[0, 0], [0, 32], [32, 0]] {
            let Err(e) = host(offsets) else {
                panic!("{offsets:?}: overlap accepted")
            };
            assert!(e.to_string().contains("regions 0 and 1 overlap"), "{e}");
        }
        // Adjacent is fine: the first's span ends where the second begins (its unused tail may
        // overlap the next region: only the layout's bytes are written).
        assert!(host([0, 64]).is_ok());
        assert!(host([128, 0]).is_ok());
    }

    #[test]
    fn a_region_one_block_short_says_too_short_not_overlap() {
        // One allocation carved per layer, the first one block (32 bytes) short: its span
        // (64 bytes) runs into the second region.
        let mut a = vec![0u8; 256];
        let p = a.as_mut_ptr();
        // SAFETY: `a` outlives the regions; nothing is written (the start is refused).
        let regions = unsafe {
            vec![
                HostRegion::new(p, 32).unwrap(),
                HostRegion::new(p.add(32), 64).unwrap(),
            ]
        };
        let Err(e) = RegisteredMemory::host_owned(HostMemory::new(regions), &[(0, 64), (64, 64)])
        else {
            panic!("a short region accepted")
        };
        assert!(e.to_string().contains("region 0 has 32 bytes"), "{e}");
    }

    #[test]
    fn host_device_regions_are_checked_and_need_cuda() {
        // SAFETY: never dereferenced: every start below is refused before any copy.
        let r = |ordinal, ptr, len| unsafe { DeviceRegion::new(ordinal, ptr, len) }.unwrap();
        let spans = [(0, 64), (64, 64)];
        let err = |regions| {
            RegisteredMemory::device_owned(DeviceMemory::new(regions), &spans).unwrap_err()
        };
        let (p0, p1) = (0x7000_0000, 0x7000_1000);
        assert!(matches!(
            err(vec![r(0, p0, 64)]),
            MemoryError::DeviceRegions(_)
        ));
        assert!(matches!(
            err(vec![r(0, p0, 64), r(0, p1, 63)]),
            MemoryError::DeviceRegions(_)
        ));
        assert!(matches!(
            err(vec![r(0, p0, 64), r(1, p1, 64)]),
            MemoryError::DeviceRegions(_)
        ));
        let e = err(vec![r(0, p0, 64), r(0, p0 + 32, 64)]);
        assert!(e.to_string().contains("overlap"), "{e}");
        // Short, and ending where the next begins: too short is the mistake, not an overlap.
        let e = err(vec![r(0, p0, 32), r(0, p0 + 32, 64)]);
        assert!(e.to_string().contains("region 0 has 32 bytes"), "{e}");
        // Fits: the feature and a driver decide.
        let e = err(vec![r(0, p0, 64), r(0, p1, 64)]);
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(e, MemoryError::CudaNotBuilt), "{e}");
        #[cfg(feature = "cuda")]
        // With a driver, these made-up pointers are unknown to it.
        assert!(
            matches!(
                e,
                MemoryError::NoCudaDriver
                    | MemoryError::Cuda(_)
                    | MemoryError::UnknownPointer { region: 0, .. }
            ),
            "{e}"
        );
        // SAFETY: refused before use.
        assert!(unsafe { DeviceRegion::new(0, 0, 8) }.is_err());
    }

    #[test]
    fn staged_memory_is_reached_only_through_copies() {
        let (dev, view) = DeviceMemory::fake(256);
        let m = RegisteredMemory::device_owned(dev, &[(0, 128), (128, 128)]).unwrap();
        assert!(m.is_staged());
        m.write(120, &[1; 16]).unwrap();
        assert_eq!(view.snapshot(120, 16), vec![1; 16]);
        assert_eq!(m.snapshot(118, 4).unwrap(), vec![0, 0, 1, 1]);
        // Refused: the memory is not host-addressable.
        assert!(m.landing_ptr(0, 8).is_err());
        assert!(m.upload(250, &[0; 8]).is_err());
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
