//! Every awaited request's aggregation, keyed by request id: the Receiver registers a batch's
//! states here before it hands any Peer the batch's pull, and the RequestAggregator settles and
//! completes them. Shared by the two (one D worker's actors run on one thread), so that
//! registering is not a message: no settle can arrive before its state exists, because the
//! state exists before the pull is sent (DESIGN.md §4 rule 5).

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::time::Instant;

use std::hash::BuildHasher;

use hashbrown::hash_table::{Entry as Slot, HashTable};

use crate::messages::{PullId, ReqId};

use super::aggregator_state::AggregatorState;

/// One awaited request's state machine and what its settles are checked against.
pub struct Entry {
    /// The request's state machine (DESIGN.md §4 rules 5, 8, 9).
    pub state: AggregatorState,
    /// What every request of its batch shares (one allocation per batch): 48 bytes a request
    /// with the state's own sharing (mimalloc's size classes; it was 96, then 80), less per
    /// request in flight (`an_entry_fits_in_48_bytes`; issue 40's memory figure,
    /// docs/PERFORMANCE.md).
    batch: Rc<BatchAttempt>,
}

/// A batch's attempt, shared by its requests' entries.
struct BatchAttempt {
    /// When the Receiver took the batch (a completion's latency counts from there).
    since: Instant,
    /// The attempt's pulls are `first_pull..first_pull + peers` (one per peer, consecutive).
    first_pull: PullId,
}

impl Entry {
    fn counts(&self, pull: PullId) -> bool {
        pull.checked_sub(self.batch.first_pull)
            .is_some_and(|k| k < self.state.peers().len() as u64)
    }

    /// When the Receiver took the request's batch (its completion's latency counts from there).
    pub fn since(&self) -> Instant {
        self.batch.since
    }

    /// The request's id, the entry's key.
    fn id(&self) -> &str {
        &self.state.req().req_id
    }
}

/// The awaited requests not yet completed.
#[derive(Default)]
pub struct AggregationTable {
    /// Boxed: the table's slots stay small, so growing it costs little per request. Found by
    /// the request id in the entry itself, so a slot is the box alone (8 bytes, not 24 with a
    /// copy of the id as key). Size only: RSS per in-flight request 720–724 → 701–706 B (lib;
    /// serve 797–802 → 776–782 B; `baseline.py --memory-only`, debug build; docs/PERFORMANCE.md).
    entries: HashTable<Box<Entry>>,
    /// foldhash, as [`crate::fast_hash`] says why.
    hasher: foldhash::fast::RandomState,
}

/// The table the Receiver and the RequestAggregator share.
pub type SharedAggregation = Rc<RefCell<AggregationTable>>;

impl AggregationTable {
    /// Register a batch's awaited requests, whose pulls are `pulls` (one per peer), taken at
    /// `since`. Called before any of those pulls is handed to a Peer.
    pub fn register(
        &mut self,
        pulls: Range<PullId>,
        states: impl Iterator<Item = AggregatorState>,
        since: Instant,
    ) {
        // The most it can be (the batch's size): usually exact, every request awaited.
        let (least, most) = states.size_hint();
        let Self { entries, hasher } = self;
        #[allow(clippy::borrowed_box)] // what hashbrown's rehash is given: a slot
        let rehash = |e: &Box<Entry>| hasher.hash_one(e.id());
        entries.reserve(most.unwrap_or(least), rehash);
        let batch = Rc::new(BatchAttempt {
            since,
            first_pull: pulls.start,
        });
        for state in states {
            let entry = Box::new(Entry {
                state,
                batch: batch.clone(),
            });
            let hash = hasher.hash_one(entry.id());
            match entries.entry(hash, |e| e.id() == entry.id(), rehash) {
                Slot::Occupied(mut old) => {
                    // Admission refuses an id still live, so this is a bug elsewhere: say so
                    // rather than lose the older attempt silently.
                    tracing::error!(req_id = %old.get().id(), "request registered twice for aggregation");
                    *old.get_mut() = entry;
                }
                Slot::Vacant(slot) => {
                    slot.insert(entry);
                }
            }
        }
    }

    /// The entry a settle of `req_id` from `pull` counts for: none if the request is not
    /// awaited here or the pull is not one of its attempt's (a late settle of an earlier one).
    pub fn counting(&mut self, req_id: &ReqId, pull: PullId) -> Option<&mut Entry> {
        let hash = self.hasher.hash_one(&**req_id);
        self.entries
            .find_mut(hash, |e| e.id() == &**req_id)
            .map(|e| &mut **e)
            .filter(|e| e.counts(pull))
    }

    /// `req_id` completed: forget it.
    pub fn remove(&mut self, req_id: &ReqId) {
        let hash = self.hasher.hash_one(&**req_id);
        if let Ok(entry) = self.entries.find_entry(hash, |e| e.id() == &**req_id) {
            entry.remove();
        }
    }

    /// Whether no request is awaited.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::Policy;
    use crate::messages::{PeerId, RequestMeta};

    /// One entry per request in flight: the issue's memory budget (≤ 1 KiB per request at 100k
    /// in flight, `benches/baseline.py --memory-only`) has no room for it to grow unnoticed.
    /// 48 bytes is one of mimalloc's size classes (the next is 64); it was 144 (rounded up to
    /// 160), then 96, then 80.
    #[test]
    fn an_entry_fits_in_48_bytes() {
        assert!(
            std::mem::size_of::<Entry>() <= 48,
            "Entry is {} bytes",
            std::mem::size_of::<Entry>()
        );
    }

    /// A settle counts only for the pulls of the attempt registered last: one of two peers'
    /// pulls (7 and 8) counts, an earlier attempt's (3) or a later batch's (9) does not.
    #[test]
    fn a_settle_counts_only_for_the_pulls_of_its_attempt() {
        let mut t = AggregationTable::default();
        let req = Arc::new(RequestMeta::new("r", "t", "e", "b", &[vec![1]]));
        let peers = vec![PeerId::new("tcp://p:1"), PeerId::new("tcp://p:2")];
        let state = AggregatorState::new(req, peers, Policy::Settle);
        t.register(7..9, [state].into_iter(), Instant::now());
        let r = ReqId::from("r");
        for (pull, counts) in [(3, false), (7, true), (8, true), (9, false)] {
            assert_eq!(t.counting(&r, pull).is_some(), counts, "pull {pull}");
        }
        t.remove(&r);
        assert!(t.counting(&r, 7).is_none() && t.is_empty());
    }
}
