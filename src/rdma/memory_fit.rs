//! Whether the host's regions can hold the layout: one region per layout region, each at
//! least as long as the layout needs, no two overlapping. Checked where new host memory comes
//! in after start (sleep mode's resume on new memory, DESIGN.md §7), before anything of the
//! old memory is let go, so a refusal leaves the worker paused on its old memory.

use thiserror::Error;

use super::memory::HostMemory;

/// Why the host's regions cannot hold the layout.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
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
    let regions = host.regions();
    if regions.len() != needed.len() {
        return Err(MemoryFitError::RegionCount {
            regions: regions.len(),
            layout: needed.len(),
        });
    }
    for (i, (r, &n)) in regions.iter().zip(needed).enumerate() {
        if (r.len() as u64) < n {
            return Err(MemoryFitError::TooSmall {
                region: i,
                have: r.len() as u64,
                needed: n,
            });
        }
    }
    let mut order: Vec<(u64, u64, usize)> = regions
        .iter()
        .zip(needed)
        .enumerate()
        .map(|(i, (r, &n))| (r.as_ptr() as u64, n, i))
        .collect();
    order.sort_unstable();
    for w in order.windows(2) {
        let ((a, a_len, i), (b, _, j)) = (w[0], w[1]);
        if a.saturating_add(a_len) > b {
            return Err(MemoryFitError::Overlap {
                first: i.min(j),
                second: i.max(j),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
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
