//! Which pulls each open request is in, and at which index: the permit table's index from a
//! request to its permits, kept per request in flight and therefore compact.
//!
//! The coordinator opens a batch's pulls one after another, one per peer, with the same
//! awaiting requests in the same order: a request sits at the same index of consecutive pulls.
//! One run (first pull, count, index: 16 bytes) then describes all of them, where a list of
//! permit handles with an index each took 40 bytes per request, plus the table's slack (at 100k
//! requests in flight, 75 bytes per request in all; `benches/baseline.py --memory-only`).
//! Anything else (a pull out of sequence, another index) moves the request to a plain list, so
//! no caller is held to that pattern.

#![forbid(unsafe_code)]

use std::hash::BuildHasher;

use hashbrown::HashTable;
use smallvec::SmallVec;

use crate::fast_hash::FastMap;
use crate::messages::{PullId, ReqId, SharedRequest};

/// A request's (pull, index) pairs.
pub type Pairs = SmallVec<[(PullId, usize); 2]>;

/// A request's pairs when they do not form one run (indexes as stored: u32).
type List = SmallVec<[(PullId, u32); 2]>;

fn list_pairs(l: &List) -> Pairs {
    l.iter().map(|&(p, i)| (p, i as usize)).collect()
}

/// Consecutive pulls `first..first + count`, the request at `index` in each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Run {
    first: PullId,
    count: u32,
    index: u32,
}

impl Run {
    fn iter(self) -> impl Iterator<Item = (PullId, usize)> {
        (0..u64::from(self.count)).map(move |k| (self.first + k, self.index as usize))
    }
}

/// Every (pull, index) of each request not yet removed.
#[derive(Debug, Clone, Default)]
pub struct RequestPulls {
    /// Each request's run, found by the request id in the request itself: a slot is the
    /// request's one pointer and its run (24 bytes, not 32 with a 16-byte id as key; at 100k
    /// in flight ~10 B per request less, docs/PERFORMANCE.md).
    runs: HashTable<(SharedRequest, Run)>,
    /// Requests whose pulls do not form one run.
    lists: FastMap<ReqId, List>,
    /// foldhash, as [`crate::fast_hash`] says why.
    hasher: foldhash::fast::RandomState,
}

impl RequestPulls {
    fn hash(&self, req: &str) -> u64 {
        self.hasher.hash_one(req)
    }

    fn run(&self, req: &ReqId) -> Option<Run> {
        self.runs
            .find(self.hash(req), |(r, _)| r.req_id == *req)
            .map(|&(_, run)| run)
    }

    fn remove_run(&mut self, req: &ReqId) -> Option<Run> {
        let hash = self.hash(req);
        let e = self.runs.find_entry(hash, |(r, _)| r.req_id == *req).ok()?;
        Some(e.remove().0 .1)
    }

    /// Record that `req` is at `index` of `pull`.
    pub fn add(&mut self, req: &SharedRequest, pull: PullId, index: u32) {
        let id = &req.req_id;
        // `lists` is empty unless a request's pulls broke a run: no hash in the common case.
        if let Some(list) = self.lists_mut(id) {
            list.push((pull, index));
            return;
        }
        let hash = self.hash(id);
        match self.runs.find_mut(hash, |(r, _)| r.req_id == *id) {
            None => {
                let hasher = &self.hasher;
                let run = Run {
                    first: pull,
                    count: 1,
                    index,
                };
                self.runs
                    .insert_unique(hash, (req.clone(), run), |(r, _)| {
                        hasher.hash_one(&*r.req_id)
                    });
            }
            Some((_, run))
                if run.index == index
                    && run.count < u32::MAX
                    && run.first.checked_add(u64::from(run.count)) == Some(pull) =>
            {
                run.count += 1;
            }
            Some(_) => {
                let run = self.remove_run(id).expect("matched above");
                let mut list: List = run.iter().map(|(p, _)| (p, run.index)).collect();
                list.push((pull, index));
                self.lists.insert(id.clone(), list);
            }
        }
    }

    /// The (pull, index) pairs of `req`.
    pub fn get(&self, req: &ReqId) -> Pairs {
        match self.run(req) {
            Some(run) => run.iter().collect(),
            None if self.lists.is_empty() => Pairs::new(),
            None => self.lists.get(req).map(list_pairs).unwrap_or_default(),
        }
    }

    fn lists_mut(&mut self, req: &ReqId) -> Option<&mut List> {
        if self.lists.is_empty() {
            return None;
        }
        self.lists.get_mut(req)
    }

    /// Forget `req`, returning its (pull, index) pairs.
    pub fn remove(&mut self, req: &ReqId) -> Pairs {
        // A request is in `runs` or in `lists`, never both (`add` moves it).
        match self.remove_run(req) {
            Some(run) => run.iter().collect(),
            None if self.lists.is_empty() => Pairs::new(),
            None => self
                .lists
                .remove(req)
                .as_ref()
                .map(list_pairs)
                .unwrap_or_default(),
        }
    }

    /// Every request with its pairs, sorted (model checking).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn sorted(&self) -> Vec<(ReqId, Pairs)> {
        let mut v: Vec<_> = self
            .runs
            .iter()
            .map(|(r, _)| &r.req_id)
            .chain(self.lists.keys())
            .map(|r| (r.clone(), self.get(r)))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ReqId {
        s.into()
    }

    fn req(s: &str) -> SharedRequest {
        std::sync::Arc::new(crate::messages::RequestMeta::new(s, s, "e", "b", &[vec![1]]))
    }

    #[test]
    fn consecutive_pulls_at_one_index_are_one_run() {
        let mut t = RequestPulls::default();
        for p in 10..13 {
            t.add(&req("a"), p, 4);
        }
        t.add(&req("b"), 10, 5);
        assert!(
            t.lists.is_empty(),
            "the coordinator's pattern needs no list"
        );
        assert_eq!(t.get(&id("a")).as_slice(), &[(10, 4), (11, 4), (12, 4)]);
        assert_eq!(t.get(&id("b")).as_slice(), &[(10, 5)]);
        assert_eq!(t.remove(&id("a")).as_slice(), &[(10, 4), (11, 4), (12, 4)]);
        assert!(t.get(&id("a")).is_empty() && t.remove(&id("a")).is_empty());
        assert!(t.remove(&id("never")).is_empty());
        assert_eq!(t.get(&id("b")).as_slice(), &[(10, 5)], "b is untouched");
    }

    #[test]
    fn a_gap_or_another_index_keeps_every_pair() {
        let mut t = RequestPulls::default();
        t.add(&req("gap"), 10, 0);
        t.add(&req("gap"), 12, 0); // pull 11 got the reserved window, say
        t.add(&req("idx"), 20, 1);
        t.add(&req("idx"), 21, 2);
        t.add(&req("idx"), 22, 2);
        assert_eq!(t.get(&id("gap")).as_slice(), &[(10, 0), (12, 0)]);
        assert_eq!(t.get(&id("idx")).as_slice(), &[(20, 1), (21, 2), (22, 2)]);
        assert_eq!(t.remove(&id("idx")).len(), 3);
        assert!(t.get(&id("idx")).is_empty());
        assert_eq!(t.sorted().len(), 1);
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn the_index_is_kept_in_16_bytes_and_a_pointer() {
        assert_eq!(std::mem::size_of::<Run>(), 16);
        assert_eq!(std::mem::size_of::<(SharedRequest, Run)>(), 24);
    }
}
