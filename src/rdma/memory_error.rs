//! Why destination memory could not be set up or written.

#![forbid(unsafe_code)]

use thiserror::Error;

#[derive(Debug, Error)]
/// Why destination memory could not be set up or written.
#[non_exhaustive]
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
    #[error(
        "host memory: registered with another worker that is still running (or whose handles \
         are not all dropped); one memory lands for one worker at a time"
    )]
    /// The [`HostMemory`](crate::HostMemory) is registered with another worker's landing.
    InUse,
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
        /// The ordinal given to [`DeviceRegion::new`](super::device_memory::DeviceRegion::new).
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
