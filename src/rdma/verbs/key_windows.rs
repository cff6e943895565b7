//! Landing windows on RDMA (DESIGN.md §5, docs/RDMA.md "The fence"): which registration of
//! the destination memory each P host writes through, and which registrations a fence must
//! destroy. Sans-IO: this decides, [`RdmaLanding`](super::RdmaLanding) registers and
//! deregisters.
//!
//! On TCP a window is an address range kvrecv's data server resolves. On RDMA the NIC resolves
//! P's addresses through memory registrations, so a window is **a registration of the whole
//! layout at an IOVA slot of its own, with rkeys of its own**. Moving a suspect's queue pairs
//! to ERR is not enough: Mooncake answers retry-exceeded by re-handshaking (new QPs), reloading
//! D's descriptor and re-posting the slice with the rkey the descriptor names for the slice's
//! address (`worker_pool.cpp`, `redispatch`). A fence therefore also *retires* the suspect's
//! window: its registrations are destroyed (a write with its rkeys gets a remote access error)
//! and its IOVA slot leaves the descriptor (a reloaded descriptor names no buffer for the
//! address, so Mooncake fails the slice without posting it). A retired slot is not handed out
//! again until every other slot has been.
//!
//! Windows are per P *host*: the QP fence already stops every segment on a suspect's host
//! (`PeerBinding::ByHost`), so retiring the host's window costs no pull that the QP fence
//! spares. With more hosts than windows, hosts share the least-loaded window, and retiring it
//! also fails the other hosts' writes in flight (they complete failed, never land late).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

/// One live window.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Window {
    /// Hosts whose pulls are handed this window.
    hosts: BTreeSet<String>,
    /// A suspect was handed it: no new pull gets it, and the next fence retires it.
    poisoned: bool,
}

/// The windows' state. Plain data (`Clone + Hash`): the model check drives it directly.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyWindows {
    /// IOVA slots in the address map.
    slots: u32,
    /// First slot handed out; random per start so that a restarted D advertises other IOVAs
    /// than the keys P may still hold from before.
    start: u32,
    /// Slots handed out so far (slot `(start + n) % slots` is the n-th).
    issued: u64,
    /// Live windows to keep registered.
    want: usize,
    live: BTreeMap<u32, Window>,
    by_host: BTreeMap<String, u32>,
    /// Per peer (side-channel address), the live slots whose addresses it was given.
    handed: BTreeMap<String, BTreeSet<u32>>,
}

impl KeyWindows {
    /// `want` windows (at least 1) kept live out of `slots` IOVA slots, the first at `start`.
    ///
    /// ```
    /// use kvrecv::rdma::verbs::key_windows::KeyWindows;
    /// let mut w = KeyWindows::new(8, 2, 5);
    /// let a = w.fresh_slot().unwrap();
    /// w.added(a);
    /// assert_eq!(w.assign("tcp://10.0.0.5:1", "10.0.0.5"), Some(a));
    /// assert_eq!(w.poison(&["tcp://10.0.0.5:1"]), 1);
    /// assert_eq!(w.to_retire(), vec![a]);
    /// w.retired(a);
    /// assert!(w.fenced("tcp://10.0.0.5:1"));
    /// ```
    pub fn new(slots: u32, want: usize, start: u32) -> Self {
        let slots = slots.max(1);
        KeyWindows {
            slots,
            start: start % slots,
            issued: 0,
            want: want.max(1),
            live: BTreeMap::new(),
            by_host: BTreeMap::new(),
            handed: BTreeMap::new(),
        }
    }

    /// The next slot to register a window at: never one that is live, and one that was retired
    /// only after every other slot was handed out since. `None` when every slot is live.
    pub fn fresh_slot(&mut self) -> Option<u32> {
        for _ in 0..self.slots {
            let slot = ((u64::from(self.start) + self.issued) % u64::from(self.slots)) as u32;
            self.issued += 1;
            if !self.live.contains_key(&slot) {
                return Some(slot);
            }
        }
        None
    }

    /// A window was registered at `slot` (from [`fresh_slot`](Self::fresh_slot)).
    pub fn added(&mut self, slot: u32) {
        self.live.insert(
            slot,
            Window {
                hosts: BTreeSet::new(),
                poisoned: false,
            },
        );
    }

    /// How many clean windows are missing from the wanted count.
    pub fn missing(&self) -> usize {
        let clean = self.live.values().filter(|w| !w.poisoned).count();
        self.want.saturating_sub(clean)
    }

    /// Whether [`KeyWindows::assign`] would give `host` a window (no state changes).
    pub fn can_assign(&self, host: &str) -> bool {
        self.by_host.contains_key(host) || self.live.values().any(|w| !w.poisoned)
    }

    /// The window a pull from `peer` on `host` lands through: the host's window while it is
    /// clean, else the clean window with the fewest hosts. `None` when no window is clean.
    pub fn assign(&mut self, peer: &str, host: &str) -> Option<u32> {
        let slot = match self.by_host.get(host) {
            Some(&s) => s,
            None => {
                let (&slot, w) = self
                    .live
                    .iter_mut()
                    .filter(|(_, w)| !w.poisoned)
                    .min_by_key(|(slot, w)| (w.hosts.len(), **slot))?;
                w.hosts.insert(host.to_owned());
                self.by_host.insert(host.to_owned(), slot);
                slot
            }
        };
        match self.handed.get_mut(peer) {
            Some(set) => {
                set.insert(slot);
            }
            None => {
                self.handed.insert(peer.to_owned(), BTreeSet::from([slot]));
            }
        }
        Some(slot)
    }

    /// Poison every live window `suspects` were given: no pull gets it any more (its hosts
    /// move to a clean window at their next pull) and the next fence retires it. Returns how
    /// many windows this newly poisoned.
    pub fn poison<S: AsRef<str>>(&mut self, suspects: &[S]) -> usize {
        let mut newly = 0;
        for s in suspects {
            let Some(slots) = self.handed.get(s.as_ref()) else {
                continue;
            };
            for slot in slots {
                if let Some(w) = self.live.get_mut(slot) {
                    if !w.poisoned {
                        w.poisoned = true;
                        newly += 1;
                        for h in std::mem::take(&mut w.hosts) {
                            self.by_host.remove(&h);
                        }
                    }
                }
            }
        }
        newly
    }

    /// Poison every live window (sleep mode): no pull gets any, and the next pass retires
    /// them all. Returns how many this newly poisoned.
    pub fn poison_all(&mut self) -> usize {
        let mut newly = 0;
        for w in self.live.values_mut() {
            if !w.poisoned {
                w.poisoned = true;
                newly += 1;
            }
            w.hosts.clear();
        }
        self.by_host.clear();
        newly
    }

    /// Poisoned windows, which the fence deregisters.
    pub fn to_retire(&self) -> Vec<u32> {
        self.live
            .iter()
            .filter(|(_, w)| w.poisoned)
            .map(|(s, _)| *s)
            .collect()
    }

    /// `slot`'s registrations are gone: no write through its keys or addresses can land.
    pub fn retired(&mut self, slot: u32) {
        if let Some(w) = self.live.remove(&slot) {
            for h in w.hosts {
                self.by_host.remove(&h);
            }
        }
        self.handed.retain(|_, set| {
            set.remove(&slot);
            !set.is_empty()
        });
    }

    /// Whether `peer` holds no address of a live window: nothing it posts can land.
    pub fn fenced(&self, peer: &str) -> bool {
        !self.handed.contains_key(peer)
    }

    /// Live slots, in order (the descriptor lists exactly these).
    pub fn live(&self) -> Vec<u32> {
        self.live.keys().copied().collect()
    }

    /// Number of poisoned windows awaiting a fence.
    pub fn poisoned(&self) -> usize {
        self.live.values().filter(|w| w.poisoned).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_windows(n: usize) -> KeyWindows {
        let mut w = KeyWindows::new(16, n, 3);
        for _ in 0..n {
            let s = w.fresh_slot().unwrap();
            w.added(s);
        }
        w
    }

    #[test]
    fn hosts_spread_over_windows_and_keep_theirs() {
        let mut w = with_windows(2);
        let a = w.assign("tcp://a:1", "a").unwrap();
        let b = w.assign("tcp://b:1", "b").unwrap();
        assert_ne!(a, b, "the second host takes the empty window");
        assert_eq!(
            w.assign("tcp://a:2", "a"),
            Some(a),
            "a host keeps its window"
        );
        let c = w.assign("tcp://c:1", "c").unwrap();
        assert!(c == a || c == b);
    }

    #[test]
    fn a_poisoned_window_is_handed_to_nobody_and_its_hosts_move() {
        let mut w = with_windows(2);
        let a = w.assign("tcp://a:1", "a").unwrap();
        assert_eq!(w.poison(&["tcp://a:1"]), 1);
        assert_eq!(w.poison(&["tcp://a:1"]), 0, "poisoned once");
        let again = w.assign("tcp://a:1", "a").unwrap();
        assert_ne!(again, a, "the host moved to a clean window");
        assert_eq!(w.to_retire(), vec![a]);
        assert!(!w.fenced("tcp://a:1"));
        w.retired(a);
        assert!(
            !w.fenced("tcp://a:1"),
            "still holds the clean window it moved to"
        );
        w.poison(&["tcp://a:1"]);
        w.retired(again);
        assert!(w.fenced("tcp://a:1"));
        assert_eq!(w.missing(), 2);
        assert_eq!(w.assign("tcp://x:1", "x"), None, "no clean window left");
    }

    #[test]
    fn a_retired_slot_comes_back_only_after_every_other_slot() {
        let mut w = KeyWindows::new(4, 1, 2);
        let first = w.fresh_slot().unwrap();
        w.added(first);
        w.assign("tcp://a:1", "a");
        w.poison(&["tcp://a:1"]);
        w.retired(first);
        let mut seen = vec![first];
        for _ in 0..3 {
            let s = w.fresh_slot().unwrap();
            assert!(!seen.contains(&s), "slot {s} reused early: {seen:?}");
            seen.push(s);
        }
        assert_eq!(w.fresh_slot(), Some(first), "wraps after all four");
    }

    #[test]
    fn fresh_slot_skips_live_slots_and_ends_when_all_are_live() {
        let mut w = KeyWindows::new(2, 2, 0);
        let a = w.fresh_slot().unwrap();
        w.added(a);
        let b = w.fresh_slot().unwrap();
        w.added(b);
        assert_eq!(w.fresh_slot(), None);
    }
}
