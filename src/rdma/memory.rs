//! Registered destination memory, laid out like the KV layout (see
//! [`WindowMap`](super::tcp::windows::WindowMap) for the offsets). By default kvrecv allocates it: one
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

use std::ptr::NonNull;
use std::sync::Arc;

pub use super::device_memory::{DeviceMemory, DeviceRegion};
pub use super::device_stream::STAGING_CHUNK;
pub(crate) use super::host_memory::OwnedBytes;
pub use super::host_memory::{HostMemory, HostRegion};
pub(crate) use super::host_memory::{HostRegistration, LandingId};
pub use super::memory_error::MemoryError;

use super::device_memory::{device_copier, DeviceInner};
use super::host_buffer::HostBuffer;
use super::device_stream::DeviceCopy;

/// Where destination bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryKind {
    #[default]
    /// Page-aligned host memory kvrecv maps, on transparent huge pages where the kernel allows
    /// (pageable: an RDMA registration pins it).
    Host,
    /// Device memory kvrecv allocates on GPU `ordinal` (feature `cuda`), reached through
    /// staging copies.
    Cuda {
        /// The GPU.
        ordinal: usize,
    },
}

/// A contiguous piece of the registered memory: `[start, start + len)` at `ptr`.
struct Segment {
    start: u64,
    ptr: NonNull<u8>,
    len: u64,
}

/// The destination bytes of one D worker.
pub struct RegisteredMemory {
    /// Contiguous, ascending, covering `[0, len)`.
    segments: Vec<Segment>,
    len: u64,
    /// kvrecv's own allocation (none with host-owned memory).
    _owned: Option<HostBuffer>,
    /// The host's regions, registered for this memory's landing (the bytes are the host's).
    host_owned: Option<HostRegistration>,
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
                ptr: host.ptr(),
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
    /// per region ([`WindowMap::region_spans`](super::tcp::windows::WindowMap::region_spans)); region `i` of `host` backs span
    /// `i` and must be at least as long. Nothing is allocated or zeroed.
    pub(crate) fn host_owned(
        registration: HostRegistration,
        spans: &[(u64, u64)],
    ) -> Result<Self, MemoryError> {
        let host = registration.memory();
        let needed: Vec<u64> = spans.iter().map(|&(_, len)| len).collect();
        super::memory_fit::check_fit(host, &needed)
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
            host_owned: Some(registration),
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
                let have: Vec<(u64, u64)> = regions.iter().map(|r| (r.ptr(), r.len())).collect();
                let needed: Vec<u64> = spans.iter().map(|&(_, len)| len).collect();
                super::memory_fit::check_spans(&have, &needed)
                    .map_err(|e| MemoryError::DeviceRegions(e.to_string()))?;
                let ordinal = regions.first().map_or(0, |r| r.ordinal());
                let mut segs = Vec::with_capacity(spans.len());
                for (i, (r, &(start, need))) in regions.iter().zip(spans).enumerate() {
                    if r.ordinal() != ordinal {
                        return Err(MemoryError::DeviceRegions(format!(
                            "region {i} is on GPU {}, region 0 on GPU {ordinal}",
                            r.ordinal()
                        )));
                    }
                    segs.push((start, r.ptr(), need));
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

    /// The data server stopped: let go of what kvrecv holds in the host's device context (the
    /// staging slots' streams, events and page-locked buffers) once copies in flight finished,
    /// so that the host may destroy that context when shutdown returned ([`DeviceRegion::new`]'s
    /// contract). Later copies fail. Nothing for host memory or kvrecv's own GPU allocation
    /// (in the primary context kvrecv retains).
    pub(crate) fn close_host_device(&self) {
        if let (Some(d), false) = (&self.staged, self.gpu) {
            d.close();
        }
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the bytes are the host's own ([`HostMemory`]).
    #[cfg(test)]
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn snapshot(&self, offset: u64, len: u64) -> Result<Vec<u8>, MemoryError> {
        let mut v = vec![0u8; usize::try_from(len).map_err(|_| MemoryError::Alloc(len))?];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// Overwrite destination bytes (tests, READ fixtures); on device memory through a staged
    /// copy (blocking).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
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
#[path = "memory_tests.rs"]
mod tests;
