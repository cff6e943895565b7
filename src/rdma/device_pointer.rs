//! What the driver says about the host's device regions, checked at start: each region must be
//! device memory (not host or managed memory), on the GPU the host named, inside one
//! allocation, and every region in the same CUDA context. The checks are a pure function of the
//! queried attributes (`cuPointerGetAttribute`: `MEMORY_TYPE`, `DEVICE_ORDINAL`, `CONTEXT`,
//! `RANGE_START_ADDR`, `RANGE_SIZE`), so they are tested without a GPU.
//!
//! Contexts: kvrecv copies in the context the memory belongs to. The primary context (PyTorch's,
//! and vLLM's) is retained by kvrecv for as long as it copies; a non-primary context is used as
//! it is, not retained (the driver has no retain for it): its memory's validity, which
//! [`DeviceRegion::new`](super::memory::DeviceRegion::new)'s contract requires until shutdown, implies it lives.
//! Memory mapped through the virtual memory management API (`cuMemMap`) reports no context:
//! kvrecv copies into it from the device's primary context.

#![forbid(unsafe_code)]

use super::memory_error::MemoryError;

/// The attributes of one region's start pointer, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerAttributes {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` is `CU_MEMORYTYPE_DEVICE`.
    pub device_memory: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`: unified memory, which may migrate.
    pub managed: bool,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    pub ordinal: usize,
    /// `CU_POINTER_ATTRIBUTE_CONTEXT` as an address (0: none, as for `cuMemMap` memory).
    pub context: usize,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: start of the allocation holding the pointer.
    pub range_start: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: its length.
    pub range_size: u64,
}

/// The context copies go through, once the regions passed [`check_regions`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyContext {
    /// The GPU's primary context (retained by kvrecv).
    Primary,
    /// The host's own, non-primary context at this address (used, not retained).
    Host(usize),
}

/// Check the host's regions, `(ordinal named by the host, device pointer, bytes the layout
/// uses)` each, against the driver's `attrs` (same order); `primary` is the address of the
/// primary context of the regions' GPU.
pub fn check_regions(
    regions: &[(usize, u64, u64)],
    attrs: &[PointerAttributes],
    primary: usize,
) -> Result<CopyContext, MemoryError> {
    let mut context = None;
    for (i, (&(ordinal, ptr, len), a)) in regions.iter().zip(attrs).enumerate() {
        if !a.device_memory || a.managed {
            return Err(MemoryError::NotDeviceMemory { region: i });
        }
        if a.ordinal != ordinal {
            return Err(MemoryError::OtherDevice {
                region: i,
                named: ordinal,
                actual: a.ordinal,
            });
        }
        let end = ptr.checked_add(len);
        let alloc_end = a.range_start.checked_add(a.range_size);
        let inside =
            ptr >= a.range_start && matches!((end, alloc_end), (Some(e), Some(ae)) if e <= ae);
        if !inside {
            return Err(MemoryError::OutsideAllocation {
                region: i,
                ptr,
                len,
                alloc_start: a.range_start,
                alloc_len: a.range_size,
            });
        }
        let c = if a.context == 0 || a.context == primary {
            CopyContext::Primary
        } else {
            CopyContext::Host(a.context)
        };
        match context {
            None => context = Some(c),
            Some(first) if first != c => return Err(MemoryError::OtherContext { region: i }),
            Some(_) => {}
        }
    }
    Ok(context.unwrap_or(CopyContext::Primary))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIMARY: usize = 0xc000;
    const GIB: u64 = 1 << 30;

    fn attrs(start: u64, size: u64) -> PointerAttributes {
        PointerAttributes {
            device_memory: true,
            managed: false,
            ordinal: 1,
            context: PRIMARY,
            range_start: start,
            range_size: size,
        }
    }

    #[test]
    fn regions_inside_their_allocations_on_the_named_gpu_pass() {
        // Two regions carved out of one allocation (the start is not the allocation's).
        let regions = [
            (1, 0x7000_0000, GIB / 2),
            (1, 0x7000_0000 + GIB / 2, GIB / 2),
        ];
        let a = [attrs(0x7000_0000, GIB), attrs(0x7000_0000, GIB)];
        assert_eq!(
            check_regions(&regions, &a, PRIMARY).unwrap(),
            CopyContext::Primary
        );
        // `cuMemMap` memory has no context: the primary one is used.
        let vmm = [PointerAttributes { context: 0, ..a[0] }, a[1]];
        assert_eq!(
            check_regions(&regions, &vmm, PRIMARY).unwrap(),
            CopyContext::Primary
        );
    }

    #[test]
    fn a_region_past_the_end_of_its_allocation_is_refused() {
        let regions = [(1, 0x7000_0000, GIB), (1, 0x9000_0000, GIB + 1)];
        let a = [attrs(0x7000_0000, GIB), attrs(0x9000_0000, GIB)];
        let e = check_regions(&regions, &a, PRIMARY).unwrap_err();
        assert!(
            matches!(e, MemoryError::OutsideAllocation { region: 1, len, .. } if len == GIB + 1),
            "{e}"
        );
        // A pointer before the allocation's start (stale attributes, another allocation).
        let e = check_regions(&regions[..1], &[attrs(0x7000_1000, GIB)], PRIMARY).unwrap_err();
        assert!(
            matches!(e, MemoryError::OutsideAllocation { region: 0, .. }),
            "{e}"
        );
        // No overflow at the top of the address space.
        let e = check_regions(&[(1, u64::MAX - 1, 4)], &[attrs(u64::MAX - 1, 1)], PRIMARY);
        assert!(matches!(e, Err(MemoryError::OutsideAllocation { .. })));
    }

    #[test]
    fn another_gpu_host_or_managed_memory_is_refused() {
        let regions = [(0, 0x7000_0000, 64)];
        let e = check_regions(&regions, &[attrs(0x7000_0000, 64)], PRIMARY).unwrap_err();
        assert!(
            matches!(
                e,
                MemoryError::OtherDevice {
                    region: 0,
                    named: 0,
                    actual: 1
                }
            ),
            "{e}"
        );
        let regions = [(1, 0x7000_0000, 64)];
        let host = PointerAttributes {
            device_memory: false,
            ..attrs(0x7000_0000, 64)
        };
        let e = check_regions(&regions, &[host], PRIMARY).unwrap_err();
        assert!(
            matches!(e, MemoryError::NotDeviceMemory { region: 0 }),
            "{e}"
        );
        let managed = PointerAttributes {
            managed: true,
            ..attrs(0x7000_0000, 64)
        };
        let e = check_regions(&regions, &[managed], PRIMARY).unwrap_err();
        assert!(
            matches!(e, MemoryError::NotDeviceMemory { region: 0 }),
            "{e}"
        );
    }

    #[test]
    fn a_non_primary_context_is_used_and_must_be_shared_by_every_region() {
        let regions = [(1, 0x7000_0000, 64), (1, 0x8000_0000, 64)];
        let own = |start| PointerAttributes {
            context: 0xd000,
            ..attrs(start, 64)
        };
        assert_eq!(
            check_regions(&regions, &[own(0x7000_0000), own(0x8000_0000)], PRIMARY).unwrap(),
            CopyContext::Host(0xd000)
        );
        let e = check_regions(
            &regions,
            &[own(0x7000_0000), attrs(0x8000_0000, 64)],
            PRIMARY,
        )
        .unwrap_err();
        assert!(matches!(e, MemoryError::OtherContext { region: 1 }), "{e}");
    }
}
