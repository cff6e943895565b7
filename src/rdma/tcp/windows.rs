//! The advertised address space: `windows` copies of the destination layout, side by side
//! above a synthetic base (PROTOCOL.md §5.4). Window `w` is the landing window of one pull; an
//! advertised address maps back to (window, region, offset in region). The registered memory
//! itself exists once: every window aliases the same bytes, so the window is only the epoch
//! that tells the data server which pull a write belongs to.

#![forbid(unsafe_code)]

use thiserror::Error;

use crate::layout::KvLayout;

/// Default first advertised address (the prototype's, well below 2^47).
pub const DEFAULT_BASE: u64 = 0x7e00_0000_0000;
/// Advertised addresses stay below this so every JSON tool keeps them exact.
pub const ADDRESS_LIMIT: u64 = 1 << 53;
/// Windows start on this alignment, so a window's addresses read well in hex dumps.
const WINDOW_ALIGN: u64 = 1 << 21;

/// Why the landing windows could not be laid out over the KV layout (DESIGN.md §5).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WindowError {
    /// Nothing to land in.
    #[error("the layout has no region, no block, or a region with block_len 0")]
    EmptyLayout,
    /// A region whose written part is longer than its block.
    #[error("region {region}: kv_block_len {kv_block_len} exceeds block_len {block_len}")]
    KvBlockLen {
        /// The region, in layout order.
        region: usize,
        /// Bytes written per block.
        kv_block_len: u64,
        /// Bytes per block.
        block_len: u64,
    },
    /// Windows are advertised above a base address, which cannot be 0.
    #[error("base address must be non-zero")]
    ZeroBase,
    /// The windows would not fit below 2^53 (advertised addresses stay exact in every JSON tool).
    #[error("{windows} windows of {stride} bytes above {base:#x} exceed 2^53")]
    TooLarge {
        /// The first window's address.
        base: u64,
        /// Bytes between two windows.
        stride: u64,
        /// How many windows were asked for.
        windows: u32,
    },
    /// Zero windows asked for.
    #[error("at least one window is needed")]
    NoWindow,
}

/// Where an advertised range lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub window: u32,
    pub region: usize,
    /// Offset inside the region.
    pub offset: u64,
    /// Offset inside the registered memory (the same for every window).
    pub mem_offset: u64,
}

/// Geometry of the advertised windows.
#[derive(Debug, Clone)]
pub struct WindowMap {
    base: u64,
    stride: u64,
    windows: u32,
    /// Start of each region inside a window (= inside the registered memory).
    region_start: Vec<u64>,
    region_len: Vec<u64>,
    block_len: Vec<u64>,
    kv_block_len: Vec<u64>,
    group: Vec<u32>,
    /// Regions per KV-cache group (indexed by group).
    regions_per_group: Vec<u64>,
    span: u64,
}

impl WindowMap {
    /// `windows` windows of `layout`, the first at `base`.
    ///
    /// ```
    /// use kvrecv::layout::KvLayout;
    /// use kvrecv::rdma::tcp::windows::{WindowMap, DEFAULT_BASE};
    /// let m = WindowMap::new(&KvLayout::uniform(2, 4096, 4), DEFAULT_BASE, 3).unwrap();
    /// let w1 = m.region_bases(1);
    /// let r = m.resolve(w1[1] + 4096 + 8, 8).unwrap();
    /// assert_eq!((r.window, r.region, r.offset, r.mem_offset), (1, 1, 4104, 4 * 4096 + 4104));
    /// assert!(m.resolve(w1[1] + 4 * 4096 - 4, 8).is_none()); // runs off the region
    /// ```
    pub fn new(layout: &KvLayout, base: u64, windows: u32) -> Result<Self, WindowError> {
        if layout.regions.is_empty() || layout.num_blocks == 0 {
            return Err(WindowError::EmptyLayout);
        }
        if base == 0 {
            return Err(WindowError::ZeroBase);
        }
        if windows == 0 {
            return Err(WindowError::NoWindow);
        }
        let mut region_start = Vec::new();
        let mut region_len = Vec::new();
        let mut at = 0u64;
        for (i, r) in layout.regions.iter().enumerate() {
            if r.block_len == 0 {
                return Err(WindowError::EmptyLayout);
            }
            if r.kv_block_len > r.block_len {
                return Err(WindowError::KvBlockLen {
                    region: i,
                    kv_block_len: r.kv_block_len,
                    block_len: r.block_len,
                });
            }
            let len = r
                .block_len
                .checked_mul(u64::from(layout.num_blocks))
                .ok_or(WindowError::TooLarge {
                    base,
                    stride: u64::MAX,
                    windows,
                })?;
            region_start.push(at);
            region_len.push(len);
            at = at.checked_add(len).ok_or(WindowError::TooLarge {
                base,
                stride: u64::MAX,
                windows,
            })?;
        }
        let span = at;
        let stride = span.div_ceil(WINDOW_ALIGN) * WINDOW_ALIGN;
        let end = stride
            .checked_mul(u64::from(windows))
            .and_then(|t| t.checked_add(base));
        if end.is_none_or(|e| e > ADDRESS_LIMIT) {
            return Err(WindowError::TooLarge {
                base,
                stride,
                windows,
            });
        }
        Ok(WindowMap {
            base,
            stride,
            windows,
            region_start,
            region_len,
            block_len: layout.regions.iter().map(|r| r.block_len).collect(),
            kv_block_len: layout.regions.iter().map(|r| r.kv_block_len).collect(),
            group: layout.regions.iter().map(|r| r.group_index).collect(),
            regions_per_group: {
                // Bounded by the region count (a group index past it has no region to count).
                let mut n = vec![0u64; layout.regions.len()];
                for r in &layout.regions {
                    if let Some(c) = n.get_mut(r.group_index as usize) {
                        *c += 1;
                    }
                }
                n
            },
            span,
        })
    }

    /// Number of windows.
    pub fn windows(&self) -> u32 {
        self.windows
    }

    /// Bytes of registered memory behind one window (all regions).
    pub fn span(&self) -> u64 {
        self.span
    }

    /// Each region's `(start, length)` inside the registered memory (contiguous, in order).
    pub fn region_spans(&self) -> Vec<(u64, u64)> {
        self.region_start
            .iter()
            .copied()
            .zip(self.region_len.iter().copied())
            .collect()
    }

    /// Number of regions.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn regions(&self) -> usize {
        self.region_start.len()
    }

    /// Block stride of `region`.
    pub fn block_len(&self, region: usize) -> u64 {
        self.block_len[region]
    }

    /// Bytes of KV data at the start of each block of `region` (the rest of the stride is
    /// padding).
    pub fn kv_block_len(&self, region: usize) -> u64 {
        self.kv_block_len[region]
    }

    /// Bytes P transfers per block into `region`, summed over every region of KV-cache
    /// `group`: what one destination block of that group receives from all peers together.
    pub fn kv_bytes_per_block(&self, group: u32) -> u64 {
        self.kv_block_len
            .iter()
            .zip(&self.group)
            .filter(|(_, g)| **g == group)
            .map(|(l, _)| *l)
            .sum()
    }

    /// Regions of KV-cache `group`.
    pub fn regions_in_group(&self, group: u32) -> u64 {
        self.regions_per_group
            .get(group as usize)
            .copied()
            .unwrap_or(0)
    }

    /// KV-cache group of `region`.
    pub fn group(&self, region: usize) -> u32 {
        self.group[region]
    }

    /// Advertised base address of every region in `window` (what `kv_caches_base_addr` carries).
    pub fn region_bases(&self, window: u32) -> crate::rdma::RegionBases {
        let w = self.window_base(window);
        self.region_start.iter().map(|s| w + s).collect()
    }

    fn window_base(&self, window: u32) -> u64 {
        self.base + u64::from(window.min(self.windows - 1)) * self.stride
    }

    /// `(addr, length)` of the one descriptor buffer that covers every address any window can
    /// produce. One span instead of one buffer per window keeps the descriptor a few hundred
    /// bytes whatever the epoch count (P caches it and never dereferences the addresses on TCP;
    /// the gaps between windows are refused by [`WindowMap::resolve`]).
    pub fn advertised_span(&self) -> (u64, u64) {
        (self.base, self.stride * u64::from(self.windows))
    }

    /// The most windows of `layout` that fit above `base` below [`ADDRESS_LIMIT`].
    pub fn max_windows(layout: &KvLayout, base: u64) -> Result<u32, WindowError> {
        let one = WindowMap::new(layout, base, 1)?;
        let room = (ADDRESS_LIMIT - base) / one.stride;
        Ok(room.min(u64::from(u32::MAX)) as u32)
    }

    /// Map `[addr, addr + size)` to one region of one window; `None` if the range is empty,
    /// overflows, or is not inside one region.
    pub fn resolve(&self, addr: u64, size: u64) -> Option<Resolved> {
        if size == 0 || addr < self.base {
            return None;
        }
        addr.checked_add(size)?;
        let rel = addr - self.base;
        let window = rel / self.stride;
        if window >= u64::from(self.windows) {
            return None;
        }
        let inside = rel % self.stride;
        // Last region starting at or before `inside`.
        let region = self
            .region_start
            .partition_point(|&s| s <= inside)
            .checked_sub(1)?;
        let offset = inside - self.region_start[region];
        if offset.checked_add(size)? > self.region_len[region] {
            return None;
        }
        Some(Resolved {
            window: window as u32,
            region,
            offset,
            mem_offset: self.region_start[region] + offset,
        })
    }

    /// The blocks `[offset, offset + size)` of `region` touches (first, last).
    pub fn blocks(&self, region: usize, offset: u64, size: u64) -> (u32, u32) {
        let bl = self.block_len[region];
        (
            (offset / bl) as u32,
            ((offset + size.max(1) - 1) / bl) as u32,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_window_address_is_inside_one_buffer_and_below_2_53() {
        let l = KvLayout::uniform(3, 16 * 1024, 64);
        let m = WindowMap::new(&l, DEFAULT_BASE, 16).unwrap();
        let (a, n) = m.advertised_span();
        for w in 0..16 {
            for (i, b) in m.region_bases(w).iter().copied().enumerate() {
                let last = b + 64 * 16 * 1024 - 1;
                let r = m.resolve(last, 1).unwrap();
                assert_eq!((r.window, r.region), (w, i));
                assert!(a <= b && last < a + n);
                assert!(last < ADDRESS_LIMIT);
            }
        }
        assert!(m.resolve(a + n, 1).is_none(), "nothing past the span");
        assert!(m.resolve(DEFAULT_BASE - 1, 1).is_none());
        assert!(m.resolve(DEFAULT_BASE, 0).is_none());
        assert!(m.resolve(u64::MAX - 2, 8).is_none());
        // The gap between a window's last region and the next window is not writable.
        assert!(m.resolve(DEFAULT_BASE + m.span(), 1).is_none());
        // A range spanning two regions is refused.
        assert!(m.resolve(m.region_bases(0)[1] - 4, 8).is_none());
    }

    #[test]
    fn too_many_windows_is_an_error_and_max_windows_fits() {
        let l = KvLayout::uniform(1, 1 << 30, 1024);
        assert!(matches!(
            WindowMap::new(&l, DEFAULT_BASE, 1 << 20),
            Err(WindowError::TooLarge { .. })
        ));
        // A 1 TiB cache still gets thousands of epochs below 2^53.
        let max = WindowMap::max_windows(&l, DEFAULT_BASE).unwrap();
        assert!(max >= 4096, "{max}");
        let m = WindowMap::new(&l, DEFAULT_BASE, max).unwrap();
        let (a, n) = m.advertised_span();
        assert!(a + n <= ADDRESS_LIMIT);
        assert!(WindowMap::new(&l, DEFAULT_BASE, max + 1).is_err());
    }
}
