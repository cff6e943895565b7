//! The requests that are live and the blocks they own, the one thing that decides whether a
//! request may start (DESIGN.md §4 rule 8, §6). Shared ([`Shared`]) by the three parties that
//! change it, each at its own step and none through another's mailbox: the Receiver admits a
//! batch before it sends any pull, the BlockManager gives blocks back when it releases them,
//! and the host's drain hands finished requests over.

#![forbid(unsafe_code)]

use std::collections::hash_map::Entry;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use crate::fast_hash::{FastMap, FastSet};
use crate::messages::{BatchError, ReqId, RequestMeta, SharedRequest};

use super::shared::Shared;

/// Live requests and who owns each block.
#[derive(Debug, Clone)]
pub struct LiveSet {
    /// Awaiting requests admitted and not yet handed to the host by a drain: loading one again
    /// would give the host two completions for it. Found by the request id in the request
    /// itself, so a slot is one pointer (8 bytes, not a 16-byte id; docs/PERFORMANCE.md,
    /// "Where the bytes per in-flight request go").
    live: HashTable<SharedRequest>,
    /// (KV-cache group, block) -> the live request that owns it, until its blocks are released
    /// (quarantine included): two writers into one block are never both admitted. The owner
    /// as one pointer, not a 16-byte id: 16-byte slots, not 24.
    owners: FastMap<(u32, u32), SharedRequest>,
    /// foldhash, as [`crate::fast_hash`] says why.
    hasher: foldhash::fast::RandomState,
    /// Most live requests at once (backpressure).
    max_live: usize,
    /// Sleep mode (DESIGN.md §7): nothing is admitted, whatever it is.
    paused: bool,
}

/// A live set the Receiver, the BlockManager and the host's drain share.
pub type SharedLiveSet = Shared<LiveSet>;

impl LiveSet {
    /// An empty set that refuses requests beyond `max_live` live ones (at least 1).
    pub fn new(max_live: usize) -> Self {
        LiveSet {
            live: HashTable::new(),
            owners: FastMap::default(),
            hasher: Default::default(),
            max_live: max_live.max(1),
            paused: false,
        }
    }

    /// Let `req` start, or say why not: its id is still live (in flight, or completed but not
    /// drained), or one of its blocks belongs to another live request whose blocks are not
    /// released yet. A request with no blocks (cleanup pull) never becomes live.
    pub fn admit(&mut self, req: &SharedRequest) -> Result<(), BatchError> {
        // Paused: the landing is (or is about to be) closed, so no pull may start, not even
        // an empty one (it would reach P, which may answer after the memory is gone).
        if self.paused {
            return Err(BatchError::Paused {
                req_id: req.req_id.to_string(),
            });
        }
        if self.is_live(&req.req_id) {
            return Err(BatchError::AlreadyLive {
                req_id: req.req_id.to_string(),
            });
        }
        if !req.is_awaiting() {
            return Ok(());
        }
        // Backpressure (DESIGN.md §6): a host that loads without draining gets an error, not
        // unbounded state.
        if self.live.len() >= self.max_live {
            return Err(BatchError::Backpressure {
                req_id: req.req_id.to_string(),
                live: self.live.len(),
                limit: self.max_live,
            });
        }
        for (group, blocks) in req.block_ids().iter().enumerate() {
            for &block in blocks {
                if let Some(owner) = self.owners.get(&(group as u32, block)) {
                    return Err(BatchError::BlockInUse {
                        req_id: req.req_id.to_string(),
                        group,
                        block,
                        owner: owner.req_id.to_string(),
                    });
                }
            }
        }
        let hasher = &self.hasher;
        self.live.insert_unique(hasher.hash_one(&*req.req_id), req.clone(), |r| {
            hasher.hash_one(&*r.req_id)
        });
        for (group, blocks) in req.block_ids().iter().enumerate() {
            for &block in blocks {
                self.owners.insert((group as u32, block), req.clone());
            }
        }
        Ok(())
    }

    /// `req`'s blocks are released: another request may own them. Its id stays live until
    /// [`LiveSet::hand_over`].
    pub fn release_blocks(&mut self, req: &RequestMeta) {
        for (group, blocks) in req.block_ids().iter().enumerate() {
            for &block in blocks {
                if let Entry::Occupied(o) = self.owners.entry((group as u32, block)) {
                    if o.get().req_id == req.req_id {
                        o.remove();
                    }
                }
            }
        }
    }

    /// The host has these finished requests: their ids may be loaded again.
    pub fn hand_over(&mut self, finished: &[ReqId]) {
        for id in finished {
            let hash = self.hasher.hash_one(&**id);
            if let Ok(e) = self.live.find_entry(hash, |r| r.req_id == *id) {
                e.remove();
            }
        }
    }

    /// Close (`true`) or reopen admission (sleep mode). Under the same lock as every
    /// admission: a batch admitted before the pause is complete, one after it refused whole.
    pub fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
    }

    /// Whether admission is closed (sleep mode).
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The requests that hold blocks (in flight, or completed and quarantined), each once.
    pub fn holders(&self) -> Vec<ReqId> {
        let ids: FastSet<&ReqId> = self.owners.values().map(|r| &r.req_id).collect();
        ids.into_iter().cloned().collect()
    }

    /// The request that holds `block` of KV-cache `group`, if any (in flight, or completed and
    /// not yet released).
    pub fn owner(&self, group: u32, block: u32) -> Option<&ReqId> {
        self.owners.get(&(group, block)).map(|r| &r.req_id)
    }

    /// Every request that holds blocks, with them: per group, ascending (group-major).
    pub fn holdings(&self) -> Vec<(ReqId, Vec<u32>)> {
        let mut held: Vec<(u32, u32, &ReqId)> =
            self.owners.iter().map(|(&(g, b), r)| (g, b, &r.req_id)).collect();
        held.sort_unstable();
        let mut out: Vec<(ReqId, Vec<u32>)> = Vec::new();
        let mut index: FastMap<&ReqId, usize> = FastMap::default();
        for (_, block, req) in held {
            let i = *index.entry(req).or_insert_with(|| {
                out.push((req.clone(), Vec::new()));
                out.len() - 1
            });
            out[i].1.push(block);
        }
        out
    }

    /// Whether `req_id` was admitted and not yet handed over.
    pub fn is_live(&self, req_id: &ReqId) -> bool {
        let hash = self.hasher.hash_one(&**req_id);
        self.live.find(hash, |r| r.req_id == *req_id).is_some()
    }

    /// Requests admitted and not yet handed over.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no request is live.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Hash the live ids and the owners, in a stable order (model checking).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        let mut live: Vec<&ReqId> = self.live.iter().map(|r| &r.req_id).collect();
        live.sort();
        live.hash(h);
        let mut owners: Vec<_> = self.owners.iter().map(|(k, r)| (k, &r.req_id)).collect();
        owners.sort();
        owners.hash(h);
        self.paused.hash(h);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::messages::SharedRequest;

    fn req(id: &str, blocks: &[u32]) -> SharedRequest {
        Arc::new(RequestMeta::new(id, id, "e", "b", &[blocks.to_vec()]))
    }

    /// What the BlockManager releases through its share, the Receiver's share sees at its next
    /// admission; the id itself only once the host's drain handed it over.
    #[test]
    fn released_blocks_and_handed_ids_are_seen_by_every_share() {
        let receiver = SharedLiveSet::new(LiveSet::new(8));
        let (manager, drain) = (receiver.share(), receiver.share());
        let a = req("a", &[1, 2]);
        receiver.lock().admit(&a).unwrap();
        assert!(matches!(
            receiver.lock().admit(&req("b", &[2])),
            Err(BatchError::BlockInUse { block: 2, .. })
        ));
        manager.lock().release_blocks(&a);
        assert_eq!(receiver.lock().admit(&req("b", &[2])), Ok(()));
        assert!(matches!(
            receiver.lock().admit(&req("a", &[5])),
            Err(BatchError::AlreadyLive { .. })
        ));
        drain.lock().hand_over(&["a".into()]);
        assert_eq!(receiver.lock().admit(&req("a", &[5])), Ok(()));
        assert_eq!(receiver.lock().len(), 2);
    }

    /// Paused, nothing is admitted (not even a request without blocks), and the holders are
    /// the requests whose blocks are not released yet; reopened, admission works as before.
    #[test]
    fn paused_admits_nothing_and_names_the_holders() {
        let mut live = LiveSet::new(8);
        let (a, b) = (req("a", &[1, 2]), req("b", &[3]));
        live.admit(&a).unwrap();
        live.admit(&b).unwrap();
        live.release_blocks(&b);
        live.set_paused(true);
        assert!(matches!(
            live.admit(&req("c", &[5])),
            Err(BatchError::Paused { req_id }) if req_id == "c"
        ));
        assert!(matches!(
            live.admit(&req("d", &[])),
            Err(BatchError::Paused { .. })
        ));
        assert_eq!(
            live.holders(),
            vec![ReqId::from("a")],
            "b released its blocks"
        );
        live.set_paused(false);
        assert_eq!(live.admit(&req("c", &[5])), Ok(()));
    }

    /// A live entry and a block's owner are one pointer each (the request), not a 16-byte id:
    /// 8- and 16-byte slots (live set 131,072 slots at 100k in flight: ~21 B per request less).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn an_entry_is_one_pointer() {
        assert_eq!(std::mem::size_of::<SharedRequest>(), 8);
        assert_eq!(std::mem::size_of::<((u32, u32), SharedRequest)>(), 16);
    }

    /// A release gives back only the blocks the request owns: a block another request took
    /// after an earlier release stays that request's.
    #[test]
    fn a_release_leaves_other_owners_alone() {
        let mut live = LiveSet::new(8);
        let a = req("a", &[1]);
        live.admit(&a).unwrap();
        live.release_blocks(&a);
        live.admit(&req("b", &[1])).unwrap();
        live.release_blocks(&a);
        assert!(matches!(
            live.admit(&req("c", &[1])),
            Err(BatchError::BlockInUse { owner, .. }) if owner == "b"
        ));
    }
}
