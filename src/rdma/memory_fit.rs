//! Whether the host's regions can hold the layout: one region per layout region, each at
//! least as long as the layout needs, no two overlapping. The one check for every place host or
//! device regions come in: the TCP target's and the RDMA target's start, and sleep mode's
//! resume on new memory (DESIGN.md §7, checked before anything of the old memory is let go, so
//! a refusal leaves the worker paused on its old memory).

use thiserror::Error;

use super::host_memory::HostMemory;

/// Why the host's regions cannot hold the layout.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MemoryFitError {
    /// Not one region per layout region.
    #[error("{regions} memory regions for {layout} layout regions: give one per layout region")]
    RegionCount {
        /// Regions given.
        regions: usize,
        /// Regions of the layout.
        layout: usize,
    },
    /// A region shorter than its layout region (`block_len x num_blocks`).
    #[error("memory region {region} has {have} bytes; the layout needs {needed}")]
    TooSmall {
        /// The region, in layout order.
        region: usize,
        /// Its bytes.
        have: u64,
        /// The layout's bytes for it.
        needed: u64,
    },
    /// Two regions share bytes: two layers would land in the same place.
    #[error(
        "memory regions {first} and {second} overlap: two layers would land in the same bytes"
    )]
    Overlap {
        /// The lower index.
        first: usize,
        /// The higher.
        second: usize,
    },
}

/// Check `host` against `needed`, the bytes of every layout region in layout order.
pub fn check_fit(host: &HostMemory, needed: &[u64]) -> Result<(), MemoryFitError> {
    let have: Vec<(u64, u64)> = host
        .regions()
        .iter()
        .map(|r| (r.as_ptr() as u64, r.len() as u64))
        .collect();
    check_spans(&have, needed)
}

/// The same check for regions given as `(address, length)` (host or device pointers): the
/// count, then each length, then overlaps — in that order, so a region one block short that
/// ends where the next begins is named too short, not overlapping.
pub fn check_spans(have: &[(u64, u64)], needed: &[u64]) -> Result<(), MemoryFitError> {
    if have.len() != needed.len() {
        return Err(MemoryFitError::RegionCount {
            regions: have.len(),
            layout: needed.len(),
        });
    }
    for (i, (&(_, len), &n)) in have.iter().zip(needed).enumerate() {
        if len < n {
            return Err(MemoryFitError::TooSmall {
                region: i,
                have: len,
                needed: n,
            });
        }
    }
    let used: Vec<(u64, u64)> = have
        .iter()
        .zip(needed)
        .map(|(&(a, _), &n)| (a, n))
        .collect();
    match first_overlap(&used) {
        Some((first, second)) => Err(MemoryFitError::Overlap { first, second }),
        None => Ok(()),
    }
}

/// The first two of `ranges` (`(start, length)`) that share bytes, lower index first.
fn first_overlap(ranges: &[(u64, u64)]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].0);
    order.windows(2).find_map(|w| {
        let (a, b) = (ranges[w[0]], ranges[w[1]]);
        (a.0.saturating_add(a.1) > b.0).then(|| (w[0].min(w[1]), w[0].max(w[1])))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps_are_found_whatever_the_order_and_adjacent_ranges_are_not() {
        assert_eq!(first_overlap(&[(10, 5), (0, 10), (15, 1)]), None);
        assert_eq!(first_overlap(&[(10, 5), (0, 11)]), Some((0, 1)));
    }
    use crate::rdma::memory::HostRegion;

    fn host(bufs: &mut [Vec<u8>]) -> HostMemory {
        HostMemory::new(
            bufs.iter_mut()
                // SAFETY: the buffers outlive the check, which reads only their addresses.
                .map(|b| unsafe { HostRegion::new(b.as_mut_ptr(), b.len()) }.unwrap())
                .collect(),
        )
    }

    #[test]
    fn regions_that_cannot_hold_the_layout_are_refused_by_kind() {
        let mut bufs = vec![vec![0u8; 256], vec![0u8; 255]];
        let h = host(&mut bufs);
        assert_eq!(check_fit(&h, &[256, 255]), Ok(()));
        assert_eq!(
            check_fit(&h, &[256, 256]),
            Err(MemoryFitError::TooSmall {
                region: 1,
                have: 255,
                needed: 256
            })
        );
        assert_eq!(
            check_fit(&h, &[256]),
            Err(MemoryFitError::RegionCount {
                regions: 2,
                layout: 1
            })
        );
        let mut one = vec![0u8; 512];
        let p = one.as_mut_ptr();
        // SAFETY: inside `one`, which outlives the check; only addresses are read.
        let twice = HostMemory::new(vec![
            unsafe { HostRegion::new(p, 512) }.unwrap(),
            unsafe { HostRegion::new(p.add(128), 256) }.unwrap(),
        ]);
        assert_eq!(
            check_fit(&twice, &[256, 256]),
            Err(MemoryFitError::Overlap {
                first: 0,
                second: 1
            })
        );
        assert_eq!(
            check_fit(&twice, &[128, 256]),
            Ok(()),
            "adjacent, not shared"
        );
    }
}
