//! KV regions the host allocated in CUDA device memory, registered with kvrecv (one per layout
//! region), and the copier that reaches them.

use std::sync::Arc;

use super::device_stream::DeviceCopy;
use super::memory_error::MemoryError;

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
    /// The same contract as [`HostRegion::new`](super::host_memory::HostRegion::new), for device memory: valid, allocated and not
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

/// The host's device regions, one per layout region in layout order. Cheap to clone.
#[derive(Clone)]
pub struct DeviceMemory(pub(super) Arc<DeviceInner>);

pub(super) enum DeviceInner {
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

    /// Whether `other` is this memory (a clone of it).
    pub(crate) fn same(&self, other: &DeviceMemory) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
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
pub(super) fn device_copier(
    ordinal: usize,
    segs: Vec<(u64, u64, u64)>,
) -> Result<Arc<dyn DeviceCopy>, MemoryError> {
    Ok(Arc::new(super::cuda_device::host_regions(ordinal, segs)?))
}

#[cfg(not(feature = "cuda"))]
pub(super) fn device_copier(
    _ordinal: usize,
    _segs: Vec<(u64, u64, u64)>,
) -> Result<Arc<dyn DeviceCopy>, MemoryError> {
    Err(MemoryError::CudaNotBuilt)
}
