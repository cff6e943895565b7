//! The destination KV layout D advertises: regions (one per layer and KV-cache group), block
//! stride and bytes per block, number of blocks.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// Most regions (layers, or K and V caches) a layout may have: real models have a few hundred;
/// a count in the millions is a typo that would allocate gigabytes of per-region state.
pub const MAX_REGIONS: usize = 4096;

/// One registered region (vLLM: one layer's KV cache tensor view).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// vLLM's layer name (reported to P in the descriptor).
    pub layer_name: String,
    /// Position of the layer in the model.
    pub layer_index: u32,
    /// KV-cache group the region belongs to (hybrid models have several).
    pub group_index: u32,
    /// Block stride in bytes.
    pub block_len: u64,
    /// Bytes transferred per block (<= `block_len`).
    pub kv_block_len: u64,
}

/// The whole destination layout of one D worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// One region per layer (and K/V split), each `num_blocks` blocks long.
    pub regions: Vec<Region>,
    /// Blocks per region (the pool size).
    pub num_blocks: u32,
    /// KV-cache groups (`req_blocks` carries one block list per group).
    pub num_groups: u32,
}

impl KvLayout {
    /// `layers` regions named like vLLM's, one group, `block_len` bytes per block.
    ///
    /// ```
    /// let l = kvrecv::KvLayout::uniform(2, 4096, 16);
    /// assert_eq!(l.regions[1].layer_name, "model.layers.1.self_attn.attn");
    /// assert_eq!(l.region_bytes(), 4096 * 16);
    /// ```
    pub fn uniform(layers: u32, block_len: u64, num_blocks: u32) -> Self {
        debug_assert!(
            layers as usize <= MAX_REGIONS,
            "check layers against MAX_REGIONS first"
        );
        KvLayout {
            regions: (0..layers)
                .map(|i| Region {
                    layer_name: format!("model.layers.{i}.self_attn.attn"),
                    layer_index: i,
                    group_index: 0,
                    block_len,
                    kv_block_len: block_len,
                })
                .collect(),
            num_blocks,
            num_groups: 1,
        }
    }

    /// Bytes of one region (all blocks).
    pub fn region_bytes(&self) -> u64 {
        self.regions.first().map_or(0, |r| r.block_len) * u64::from(self.num_blocks)
    }
}

impl Default for KvLayout {
    fn default() -> Self {
        KvLayout::uniform(4, 16 * 1024, 1024)
    }
}
