//! Who owns each destination block right now, as a lock-free table the data plane's audit reads
//! while the block pool writes it. Below both the actors (the pool) and the data plane (the
//! audit), so neither imports the other for it.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// Stable 32-bit tag of a request as the writer knows it (its `transfer_id`), never 0.
///
/// ```
/// let t = kvrecv::block_ownership::owner_tag("t-1");
/// assert_ne!(t, 0);
/// assert_eq!(t, kvrecv::block_ownership::owner_tag("t-1"));
/// ```
pub fn owner_tag(transfer_id: &str) -> u32 {
    // FNV-1a: stable across processes and languages, so a writer can compute it too.
    let h = transfer_id.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    h.max(1)
}

/// Who owns each block right now: `generation << 32 | owner_tag`, tag 0 = free. Lock-free reads
/// for the data server's audit; only the pool writes.
#[derive(Debug)]
pub struct BlockOwnership {
    slots: Vec<AtomicU64>,
}

/// One block's state as the audit sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockState {
    /// Bumped at every allocation of the block, so a writer told an older one is late.
    pub generation: u32,
    /// `None` when the block is free.
    pub owner_tag: Option<u32>,
}

impl BlockOwnership {
    /// A table of `num_blocks` free blocks.
    pub fn new(num_blocks: u32) -> Self {
        BlockOwnership {
            slots: (0..num_blocks).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The block's state now; `None` outside the table.
    pub fn get(&self, block: u32) -> Option<BlockState> {
        let v = self.slots.get(block as usize)?.load(Ordering::Acquire);
        let tag = v as u32;
        Some(BlockState {
            generation: (v >> 32) as u32,
            owner_tag: (tag != 0).then_some(tag),
        })
    }

    pub(crate) fn set(&self, block: u32, generation: u32, tag: u32) {
        self.slots[block as usize].store(
            (u64::from(generation) << 32) | u64::from(tag),
            Ordering::Release,
        );
    }

    /// Blocks in the table.
    pub fn len(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether the table has no block.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}
