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

use smallvec::SmallVec;

use crate::fast_hash::FastMap;
use crate::messages::{PullId, ReqId};

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
    runs: FastMap<ReqId, Run>,
    /// Requests whose pulls do not form one run.
    lists: FastMap<ReqId, List>,
}

impl RequestPulls {
    /// Record that `req` is at `index` of `pull`.
    pub fn add(&mut self, req: &ReqId, pull: PullId, index: u32) {
        // `lists` is empty unless a request's pulls broke a run: no hash in the common case.
        if let Some(list) = self.lists_mut(req) {
            list.push((pull, index));
            return;
        }
        match self.runs.get_mut(req) {
            None => {
                self.runs.insert(
                    req.clone(),
                    Run {
                        first: pull,
                        count: 1,
                        index,
                    },
                );
            }
            Some(run)
                if run.index == index
                    && run.count < u32::MAX
                    && run.first.checked_add(u64::from(run.count)) == Some(pull) =>
            {
                run.count += 1;
            }
            Some(_) => {
                let run = self.runs.remove(req).expect("matched above");
                let mut list: List = run.iter().map(|(p, _)| (p, run.index)).collect();
                list.push((pull, index));
                self.lists.insert(req.clone(), list);
            }
        }
    }

    /// The (pull, index) pairs of `req`.
    pub fn get(&self, req: &ReqId) -> Pairs {
        match self.runs.get(req) {
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
        match self.runs.remove(req) {
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
    pub fn sorted(&self) -> Vec<(ReqId, Pairs)> {
        let mut v: Vec<_> = self
            .runs
            .keys()
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

    #[test]
    fn consecutive_pulls_at_one_index_are_one_run() {
        let mut t = RequestPulls::default();
        for p in 10..13 {
            t.add(&id("a"), p, 4);
        }
        t.add(&id("b"), 10, 5);
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
        t.add(&id("gap"), 10, 0);
        t.add(&id("gap"), 12, 0); // pull 11 got the reserved window, say
        t.add(&id("idx"), 20, 1);
        t.add(&id("idx"), 21, 2);
        t.add(&id("idx"), 22, 2);
        assert_eq!(t.get(&id("gap")).as_slice(), &[(10, 0), (12, 0)]);
        assert_eq!(t.get(&id("idx")).as_slice(), &[(20, 1), (21, 2), (22, 2)]);
        assert_eq!(t.remove(&id("idx")).len(), 3);
        assert!(t.get(&id("idx")).is_empty());
        assert_eq!(t.sorted().len(), 1);
    }

    #[test]
    fn the_index_is_kept_in_16_bytes() {
        assert_eq!(std::mem::size_of::<Run>(), 16);
    }
}
