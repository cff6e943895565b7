//! P's cache of D layouts (vLLM 0.33's `_layout_by_peer`): a pull that carried its layout and a
//! non-zero `layout_id` is remembered under (D host, D port, D tp rank, D pp size, D tp size,
//! layout id), in an LRU of at most [`MAX_PEER_LAYOUTS`] across every D the worker serves; a
//! later pull with that id and no layout is served from it.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::fast_hash::FastMap;
use crate::messages::MooncakeXferMetadata;

/// vLLM 0.33's `_MAX_PEER_LAYOUTS`.
pub const MAX_PEER_LAYOUTS: usize = 1024;
/// The most bytes the cached layouts may hold together (about: their lists' lengths), beyond
/// vLLM's count: a D sending a 200k-region layout with every pull grew the cache 20 MB a pull.
pub const MAX_CACHED_BYTES: usize = 64 << 20;

/// vLLM's `_peer_layout_key`: (hostname, port, tp rank, pp size, tp size, layout id).
pub type LayoutKey = (String, u32, u32, u32, u32, u64);

/// The layout lists of one pull, as it carried them (the fields of `MooncakeXferMetadata`
/// of the same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedLayout {
    pub kv_caches_base_addr: Vec<u64>,
    pub block_lens: Vec<u64>,
    pub kv_block_lens: Vec<u64>,
    pub registered_layer_names: Vec<String>,
    pub registered_layer_indices: Vec<u32>,
    pub registered_group_indices: Vec<u32>,
    pub registered_shared_group_ids: Vec<Vec<u32>>,
    pub registered_row_offsets: Vec<i64>,
}

impl CachedLayout {
    /// About the bytes it holds.
    fn bytes(&self) -> usize {
        8 * (self.kv_caches_base_addr.len()
            + self.block_lens.len()
            + self.kv_block_lens.len()
            + self.registered_row_offsets.len())
            + 4 * (self.registered_layer_indices.len() + self.registered_group_indices.len())
            + self
                .registered_layer_names
                .iter()
                .map(|n| n.len() + 24)
                .sum::<usize>()
            + self
                .registered_shared_group_ids
                .iter()
                .map(|g| 4 * g.len() + 24)
                .sum::<usize>()
    }

    fn of(md: &MooncakeXferMetadata) -> Self {
        CachedLayout {
            kv_caches_base_addr: md.kv_caches_base_addr.clone(),
            block_lens: md.block_lens.clone(),
            kv_block_lens: md.kv_block_lens.clone(),
            registered_layer_names: md.registered_layer_names.clone(),
            registered_layer_indices: md.registered_layer_indices.clone(),
            registered_group_indices: md.registered_group_indices.clone(),
            registered_shared_group_ids: md.registered_shared_group_ids.clone(),
            registered_row_offsets: md.registered_row_offsets.clone(),
        }
    }

    /// `md` with this layout filled in (what the pull would have carried).
    pub fn fill(&self, md: &mut MooncakeXferMetadata) {
        md.kv_caches_base_addr.clone_from(&self.kv_caches_base_addr);
        md.block_lens.clone_from(&self.block_lens);
        md.kv_block_lens.clone_from(&self.kv_block_lens);
        md.registered_layer_names
            .clone_from(&self.registered_layer_names);
        md.registered_layer_indices
            .clone_from(&self.registered_layer_indices);
        md.registered_group_indices
            .clone_from(&self.registered_group_indices);
        md.registered_shared_group_ids
            .clone_from(&self.registered_shared_group_ids);
        md.registered_row_offsets
            .clone_from(&self.registered_row_offsets);
    }
}

/// The LRU: entries with their last use, and the uses in order.
#[derive(Debug, Default)]
pub struct LayoutCache {
    entries: FastMap<LayoutKey, (u64, Arc<CachedLayout>)>,
    by_use: BTreeMap<u64, LayoutKey>,
    clock: u64,
    /// [`CachedLayout::bytes`] of every entry.
    bytes: usize,
}

/// vLLM's key of a pull.
pub fn key_of(md: &MooncakeXferMetadata) -> LayoutKey {
    (
        md.remote_hostname.clone(),
        md.remote_port,
        md.remote_tp_rank,
        md.remote_pp_size,
        md.remote_tp_size,
        md.layout_id,
    )
}

impl LayoutCache {
    /// Remember the layout `md` carries (a pull with a non-zero id), most recent.
    pub fn remember(&mut self, md: &MooncakeXferMetadata) {
        if md.layout_id == 0 {
            return;
        }
        let layout = CachedLayout::of(md);
        let bytes = layout.bytes();
        if bytes > MAX_CACHED_BYTES {
            return; // served once, not kept: its next pull without it gets LAYOUT_MISS
        }
        let key = key_of(md);
        self.clock += 1;
        if let Some((used, old)) = self.entries.get(&key) {
            self.by_use.remove(used);
            self.bytes -= old.bytes();
        }
        self.by_use.insert(self.clock, key.clone());
        self.entries.insert(key, (self.clock, Arc::new(layout)));
        self.bytes += bytes;
        while self.entries.len() > MAX_PEER_LAYOUTS || self.bytes > MAX_CACHED_BYTES {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            if let Some((_, gone)) = self.entries.remove(&oldest) {
                self.bytes -= gone.bytes();
            }
        }
    }

    /// The layout cached for `md`'s key, now the most recent.
    pub fn lookup(&mut self, md: &MooncakeXferMetadata) -> Option<Arc<CachedLayout>> {
        let key = key_of(md);
        self.clock += 1;
        let (used, layout) = self.entries.get_mut(&key)?;
        self.by_use.remove(used);
        *used = self.clock;
        self.by_use.insert(self.clock, key);
        Some(layout.clone())
    }

    /// Forget every layout (a restart, or the `evict_layouts` fault).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.by_use.clear();
        self.bytes = 0;
    }

    /// Layouts held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pull(port: u32, id: u64) -> MooncakeXferMetadata {
        let mut m = MooncakeXferMetadata::minimal("d", port, 1, 0);
        m.kv_caches_base_addr = vec![u64::from(port)];
        m.layout_id = id;
        m
    }

    #[test]
    fn an_lru_of_1024_keyed_like_vllms() {
        let mut c = LayoutCache::default();
        c.remember(&pull(1, 0));
        assert!(c.is_empty(), "id 0 is never cached");
        for port in 0..MAX_PEER_LAYOUTS as u32 {
            c.remember(&pull(port, 5));
        }
        // Port 0 used again: port 1 is now the oldest and goes first.
        assert!(c.lookup(&pull(0, 5)).is_some());
        c.remember(&pull(5000, 5));
        assert_eq!(c.len(), MAX_PEER_LAYOUTS);
        assert!(c.lookup(&pull(1, 5)).is_none());
        assert!(c.lookup(&pull(0, 5)).is_some());
        assert!(c.lookup(&pull(0, 7)).is_none(), "another id of the same D");
        let mut got = pull(2, 5);
        got.kv_caches_base_addr.clear();
        c.lookup(&pull(2, 5)).unwrap().fill(&mut got);
        assert_eq!(got.kv_caches_base_addr, [2]);
    }

    #[test]
    fn the_cache_keeps_under_its_byte_budget() {
        let mut c = LayoutCache::default();
        let big = |port: u32| {
            let mut m = pull(port, 5);
            m.kv_caches_base_addr = vec![0; MAX_CACHED_BYTES / 8 * 2 / 5]; // 40% of the budget
            m
        };
        for port in 0..4 {
            c.remember(&big(port));
        }
        assert_eq!(c.len(), 2, "the oldest go once the bytes pass the budget");
        assert!(c.bytes <= MAX_CACHED_BYTES);
        assert!(c.lookup(&big(0)).is_none() && c.lookup(&big(3)).is_some());
        let mut huge = pull(9, 5);
        huge.kv_caches_base_addr = vec![0; MAX_CACHED_BYTES / 8 + 1];
        c.remember(&huge);
        assert!(c.lookup(&huge).is_none(), "a layout over the budget is not kept");
        assert_eq!(c.len(), 2, "and evicts nothing");
        c.clear();
        assert_eq!(c.bytes, 0);
    }
}
