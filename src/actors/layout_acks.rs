//! Which layout ids each P worker echoed: vLLM 0.33's `_acked_layout_peers`, kept per id since
//! kvrecv's ids are per landing window (DESIGN.md §5.4). Written by the Peers (an echo acks an
//! id, `LAYOUT_MISS` or a restart forgets the worker's acks), read by the Receiver when it
//! encodes a pull: a pull whose window's id the worker acked omits the layout.

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use crate::fast_hash::FastMap;
use crate::messages::PeerId;

/// Acked ids kept per worker: the most recent ones. The per-peer window ring
/// (`rdma::tcp::permits`) reuses far fewer windows than this, so a steady peer's ids all fit.
pub const ACKS_PER_PEER: usize = 64;

/// Acked layout ids per P worker, the most recently acked last.
#[derive(Debug, Default)]
pub struct LayoutAcks {
    by_peer: FastMap<PeerId, VecDeque<u64>>,
}

/// The Receiver's and its Peers' table (one arbiter).
pub type SharedLayoutAcks = Rc<RefCell<LayoutAcks>>;

impl LayoutAcks {
    /// Whether `peer` echoed `id` (never for 0).
    pub fn is_acked(&self, peer: &PeerId, id: u64) -> bool {
        id != 0 && self.by_peer.get(peer).is_some_and(|ids| ids.contains(&id))
    }

    /// `peer` echoed `id` in a CONTINUE or FINISH: it holds that layout.
    pub fn echoed(&mut self, peer: &PeerId, id: u64) {
        if id == 0 {
            return;
        }
        if let Some(ids) = self.by_peer.get_mut(peer) {
            if ids.back() == Some(&id) {
                return; // the usual case: the same window's pull again
            }
            ids.retain(|&i| i != id);
            if ids.len() == ACKS_PER_PEER {
                ids.pop_front();
            }
            ids.push_back(id);
            return;
        }
        self.by_peer.insert(peer.clone(), VecDeque::from([id]));
    }

    /// `peer` lost its layouts (it answered `LAYOUT_MISS`, or its channel failed and it may have
    /// restarted): its next pulls carry the layout again.
    pub fn forget(&mut self, peer: &PeerId) {
        self.by_peer.remove(peer);
    }

    /// Ids acked by `peer`.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn acked(&self, peer: &PeerId) -> usize {
        self.by_peer.get(peer).map_or(0, VecDeque::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_are_per_peer_bounded_and_forgotten_whole() {
        let (p, q) = (PeerId::new("tcp://p:1"), PeerId::new("tcp://q:1"));
        let mut a = LayoutAcks::default();
        assert!(!a.is_acked(&p, 0));
        a.echoed(&p, 0);
        assert_eq!(a.acked(&p), 0, "0 is never an id");
        for id in 1..=(ACKS_PER_PEER as u64 + 1) {
            a.echoed(&p, id);
        }
        assert!(!a.is_acked(&p, 1), "the oldest left");
        assert!(a.is_acked(&p, 2) && a.is_acked(&p, ACKS_PER_PEER as u64 + 1));
        assert!(!a.is_acked(&q, 2), "an ack is the worker's own");
        // Re-acking an old id refreshes it instead of duplicating it.
        a.echoed(&p, 2);
        a.echoed(&p, 1000);
        assert!(a.is_acked(&p, 2) && !a.is_acked(&p, 3));
        assert_eq!(a.acked(&p), ACKS_PER_PEER);
        a.forget(&p);
        assert!(!a.is_acked(&p, 2));
    }
}
