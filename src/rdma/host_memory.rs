//! KV regions in host memory that the host registers with kvrecv (one per layout region), or
//! hands over for kvrecv to own. Their bytes are shared like DMA memory (see [`super::memory`]).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::memory_error::MemoryError;

/// One KV cache region registered with kvrecv: bytes the host hands over
/// ([`HostRegion::owned`], safe: kvrecv owns them while they are registered) or a pointer and
/// length into memory kvrecv cannot own ([`HostRegion::new`], `unsafe`: a foreign allocator).
pub struct HostRegion {
    pub(super) ptr: NonNull<u8>,
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
    /// The caller guarantees, for as long as any [`KvRecv`](crate::embed::KvRecv) handle (or
    /// [`TcpTarget`](super::TcpTarget), or RDMA target, which registers it with the NIC until it is
    /// dropped) built with this region exists, and until its shutdown completed, or until a
    /// [`KvRecv::resume`](crate::embed::KvRecv::resume) onto other memory returned (one onto this region:
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
    /// [`KvRecv::read_block`](crate::KvRecv::read_block); take the memory back with [`HostMemory::take_back`].
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
    /// now (a block no request holds: [`KvRecv::read_block`](crate::KvRecv::read_block) checks, under the lock
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
///
/// One memory, one worker: a worker (its target) registers the memory, and while it holds the
/// registration another worker's start (or a resume onto it) is refused with
/// [`MemoryError::InUse`], so two workers can never land in the same bytes. The registration
/// ends when the worker's target is gone: every [`KvRecv`](crate::KvRecv) handle dropped and its
/// thread ended (as [`HostMemory::take_back`] needs).
#[derive(Debug, Clone)]
pub struct HostMemory(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    regions: Box<[HostRegion]>,
    /// The landing that registered the memory, and how many of its holds are alive.
    registered: Mutex<Option<(LandingId, usize)>>,
}

/// One landing (a target's), as the registrations of host memory tell owners apart: a resume
/// onto memory its own landing holds is allowed, another landing's is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LandingId(u64);

impl LandingId {
    /// A new id, never handed out before in this process.
    pub(crate) fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        LandingId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A landing's hold on a [`HostMemory`] while it may write it (see its doc); dropped, the
/// registration ends with the last hold of its landing.
#[derive(Debug)]
pub(crate) struct HostRegistration {
    memory: HostMemory,
    landing: LandingId,
}

impl HostRegistration {
    /// The landing that holds it.
    pub(crate) fn landing(&self) -> LandingId {
        self.landing
    }

    /// The memory held.
    pub(crate) fn memory(&self) -> &HostMemory {
        &self.memory
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let mut r = lock(&self.memory.0.registered);
        if let Some((_, holds)) = r.as_mut() {
            *holds -= 1;
            if *holds == 0 {
                *r = None;
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded data is a plain count, consistent at every step: a panic elsewhere cannot
    // leave it half-updated.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostMemory {
    /// The regions, in layout order.
    pub fn new(regions: Vec<HostRegion>) -> Self {
        HostMemory(Arc::new(Shared {
            regions: regions.into_boxed_slice(),
            registered: Mutex::new(None),
        }))
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
    /// (the builder's, and the worker's, which go when the last [`KvRecv`](crate::KvRecv) handle was
    /// dropped and its thread ended) and every region owned ([`HostRegion::owned`]).
    /// Otherwise the memory comes back unchanged.
    pub fn take_back(mut self) -> Result<Vec<Box<[u8]>>, HostMemory> {
        match Arc::get_mut(&mut self.0) {
            Some(shared) if shared.regions.iter().all(HostRegion::is_owned) => Ok(shared
                .regions
                .iter_mut()
                .filter_map(|r| r.owned.take().map(OwnedBytes::into_box))
                .collect()),
            _ => Err(self),
        }
    }

    /// The regions.
    pub fn regions(&self) -> &[HostRegion] {
        &self.0.regions
    }

    /// Whether `other` is this memory (a clone of it).
    pub(crate) fn same(&self, other: &HostMemory) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Whether a worker's landing holds this memory now (see the type's doc).
    pub fn is_registered(&self) -> bool {
        lock(&self.0.registered).is_some()
    }

    /// Register the memory for `landing`: refused while another landing holds it.
    pub(crate) fn register(&self, landing: LandingId) -> Result<HostRegistration, MemoryError> {
        let mut r = lock(&self.0.registered);
        match r.as_mut() {
            None => *r = Some((landing, 1)),
            Some((owner, holds)) if *owner == landing => *holds += 1,
            Some(_) => return Err(MemoryError::InUse),
        }
        Ok(HostRegistration {
            memory: self.clone(),
            landing,
        })
    }
}
