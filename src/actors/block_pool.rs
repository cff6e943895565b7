//! kvrecv's built-in destination-block pool, for hosts without their own and for the demo:
//! allocation, a generation per block, and an ownership table the data plane's audit reads.

#![forbid(unsafe_code)]

use crate::fast_hash::FastMap;
use std::sync::Arc;

pub use crate::block_ownership::BlockOwnership;
#[cfg(feature = "testing")]
pub use crate::block_ownership::{owner_tag, BlockState};
pub use crate::messages::PoolError;
use crate::messages::ReqId;

/// A LIFO pool: the most recently freed block is handed out first, as a busy scheduler would,
/// so a write after free quickly becomes a write into someone else's request.
pub struct BlockPool {
    free: Vec<u32>,
    generation: Vec<u32>,
    holders: FastMap<ReqId, Vec<u32>>,
    table: Arc<BlockOwnership>,
}

impl Clone for BlockPool {
    /// A deep copy: the clone gets its own ownership table (model checking forks states).
    fn clone(&self) -> Self {
        let table = BlockOwnership::new(self.table.len());
        for b in 0..self.table.len() {
            if let Some(s) = self.table.get(b) {
                table.set(b, s.generation, s.owner_tag.unwrap_or(0));
            }
        }
        BlockPool {
            free: self.free.clone(),
            generation: self.generation.clone(),
            holders: self.holders.clone(),
            table: Arc::new(table),
        }
    }
}

impl BlockPool {
    /// Hash free list, generations and holders in a canonical order (model checking).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        self.free.hash(h);
        self.generation.hash(h);
        let mut holders: Vec<_> = self.holders.iter().collect();
        holders.sort();
        holders.hash(h);
    }

    pub fn new(num_blocks: u32) -> Self {
        BlockPool {
            free: (0..num_blocks).rev().collect(),
            generation: vec![0; num_blocks as usize],
            holders: Default::default(),
            table: Arc::new(BlockOwnership::new(num_blocks)),
        }
    }

    pub fn ownership(&self) -> Arc<BlockOwnership> {
        self.table.clone()
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn capacity(&self) -> usize {
        self.generation.len()
    }

    /// Take `n` blocks for `req`, owned by the writer-visible `tag`.
    pub fn allocate(&mut self, req: &ReqId, tag: u32, n: usize) -> Result<Vec<u32>, PoolError> {
        if self.holders.contains_key(req) {
            return Err(PoolError::AlreadyAllocated(req.clone()));
        }
        if n > self.free.len() {
            return Err(PoolError::Exhausted {
                wanted: n,
                free: self.free.len(),
            });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            let g = &mut self.generation[b as usize];
            *g = g.wrapping_add(1);
            self.table.set(b, *g, tag.max(1));
        }
        self.holders.insert(req.clone(), blocks.clone());
        Ok(blocks)
    }

    /// Give `req`'s blocks back; returns them (empty if it held none).
    pub fn release(&mut self, req: &ReqId) -> Vec<u32> {
        let blocks = self.holders.remove(req).unwrap_or_default();
        for &b in &blocks {
            self.table.set(b, self.generation[b as usize], 0);
        }
        self.free.extend(blocks.iter().rev());
        blocks
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn holds(&self, req: &ReqId) -> bool {
        self.holders.contains_key(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_are_reused_first_with_a_new_generation() {
        let mut p = BlockPool::new(4);
        let a: ReqId = "a".into();
        let b: ReqId = "b".into();
        let blocks = p.allocate(&a, 7, 2).unwrap();
        let t = p.ownership();
        assert_eq!(
            t.get(blocks[0]).unwrap(),
            BlockState {
                generation: 1,
                owner_tag: Some(7)
            }
        );
        assert_eq!(p.release(&a), blocks);
        assert_eq!(t.get(blocks[0]).unwrap().owner_tag, None);
        let again = p.allocate(&b, 9, 2).unwrap();
        assert_eq!(
            again.iter().collect::<std::collections::BTreeSet<_>>(),
            blocks.iter().collect()
        );
        assert_eq!(t.get(again[0]).unwrap().generation, 2);
        assert!(matches!(
            p.allocate(&a, 1, 3),
            Err(PoolError::Exhausted { .. })
        ));
        assert!(matches!(
            p.allocate(&b, 1, 1),
            Err(PoolError::AlreadyAllocated(_))
        ));
    }
}
