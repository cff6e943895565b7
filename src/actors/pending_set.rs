//! The requests one pull still owes, compactly: the pull's requests sorted by id (binary
//! search) and one bit each for "settled". About 8 bytes a request (the batch's list, shared
//! by its pulls), where a hash map with its slack cost 64 (docs/PERFORMANCE.md, memory per in-flight request).

#![forbid(unsafe_code)]

use crate::messages::{PullRequest, PullRequests};

/// Pending requests of one pull, each at most once.
#[derive(Clone, Default)]
pub struct PendingSet {
    /// Sorted by `meta.req_id`, without duplicates; kept until the pull is forgotten (the
    /// batch's other pulls share it).
    requests: PullRequests,
    /// Bit `i` set: `requests[i]` settled (inline up to 64 requests).
    settled: smallvec::SmallVec<[u64; 1]>,
    left: usize,
    /// Where the next id is looked for first: the one after the last found. P names a pull's
    /// requests in an order of its own, usually the order they were asked in, which for ids
    /// like vLLM's (one prefix, a counter) is mostly this set's: then one comparison finds an
    /// id instead of a binary search's several over long shared prefixes.
    next: usize,
}

impl PendingSet {
    /// The pull's requests; an id listed twice is kept once.
    pub fn new(v: impl Into<PullRequests>) -> Self {
        let v = v.into().into_sorted_unique();
        let left = v.len();
        PendingSet {
            settled: smallvec::smallvec![0; left.div_ceil(64)],
            requests: v,
            left,
            next: 0,
        }
    }

    fn is_settled(&self, i: usize) -> bool {
        self.settled[i / 64] & (1 << (i % 64)) != 0
    }

    /// Index of `req_id` if the pull carried it.
    fn index(&self, req_id: &str) -> Option<usize> {
        if self
            .requests
            .get(self.next)
            .is_some_and(|r| *r.meta.req_id == *req_id)
        {
            return Some(self.next);
        }
        self.requests
            .binary_search_by(|r| (*r.meta.req_id).cmp(req_id))
            .ok()
    }

    /// Index of `req_id` if it is still owed.
    fn find(&self, req_id: &str) -> Option<usize> {
        self.index(req_id).filter(|&i| !self.is_settled(i))
    }

    /// Number of requests still owed.
    pub fn len(&self) -> usize {
        self.left
    }

    /// Whether nothing is owed.
    pub fn is_empty(&self) -> bool {
        self.left == 0
    }

    /// Whether the pull carried `req_id`, settled or not.
    pub fn carries(&self, req_id: &str) -> bool {
        self.index(req_id).is_some()
    }

    /// Whether `req_id` is still owed.
    pub fn contains(&self, req_id: &str) -> bool {
        self.find(req_id).is_some()
    }

    /// Mark `req_id` settled if it is still owed, and return it.
    pub fn remove(&mut self, req_id: &str) -> Option<&PullRequest> {
        let i = self.find(req_id)?;
        self.settled[i / 64] |= 1 << (i % 64);
        self.left -= 1;
        self.next = i + 1;
        Some(&self.requests[i])
    }

    /// Every request still owed, in id order.
    pub fn iter(&self) -> impl Iterator<Item = &PullRequest> {
        self.requests
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.is_settled(*i))
            .map(|(_, r)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// "About 8 bytes a request" (module doc): one `PullRequest` (a pointer) and one bit.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_pending_request_is_8_bytes_and_a_bit() {
        assert_eq!(std::mem::size_of::<PullRequest>(), 8);
    }

    fn req(id: &str) -> PullRequest {
        crate::messages::pull_requests::test_request(id)
    }

    /// The batch's pulls each track the one list the Receiver sorted (8 bytes a request for
    /// the batch, not for each pull); a list not sorted yet is sorted into a copy of its own.
    #[test]
    fn the_pulls_of_a_batch_share_one_sorted_list() {
        let sorted: PullRequests = ["a", "b", "c"].iter().map(|i| req(i)).collect();
        let (one, two) = (PendingSet::new(sorted.clone()), PendingSet::new(sorted.clone()));
        assert!(one.requests.shares_with(&sorted) && two.requests.shares_with(&one.requests));
        let unsorted: PullRequests = ["c", "a", "b"].iter().map(|i| req(i)).collect();
        let three = PendingSet::new(unsorted.clone());
        assert!(!three.requests.shares_with(&unsorted));
        let order: Vec<&str> = three.requests.iter().map(|r| &*r.meta.req_id).collect();
        assert_eq!(order, ["a", "b", "c"]);
    }

    #[test]
    fn each_request_is_owed_once_and_settles_once() {
        let ids = ["r3", "r1", "r2", "r1"];
        let reqs: Vec<_> = ids.iter().map(|i| req(i)).collect();
        let mut s = PendingSet::new(reqs.clone());
        assert_eq!(s.len(), 3, "a duplicate is tracked once");
        assert!(s.contains("r2") && !s.contains("r9"));
        assert_eq!(&*s.remove("r2").unwrap().meta.req_id, "r2");
        assert!(s.remove("r2").is_none(), "settled once");
        assert!(!s.contains("r2"));
        let left: Vec<_> = s.iter().map(|r| r.meta.req_id.to_string()).collect();
        assert_eq!(left, ["r1", "r3"], "the rest, in id order");
        s.remove("r1");
        s.remove("r3");
        assert!(s.is_empty());
    }

    /// Whatever order P names them in (the set's own, reversed, interleaved, repeated, with
    /// strangers), each id settles exactly once and the set agrees with a plain model.
    #[test]
    fn any_naming_order_settles_each_id_once() {
        let ids: Vec<String> = (0..40).map(|i| format!("cmpl-{i}")).collect();
        let reqs: Vec<_> = ids.iter().map(|i| req(i)).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        let mut orders = vec![sorted.clone(), sorted.iter().rev().cloned().collect()];
        orders.push(
            sorted
                .iter()
                .step_by(2)
                .chain(sorted.iter().skip(1).step_by(2))
                .cloned()
                .collect(),
        );
        orders.push(
            ids.iter()
                .flat_map(|i| [i.clone(), i.clone(), "stranger".into()])
                .collect(),
        );
        for order in orders {
            let mut s = PendingSet::new(reqs.clone());
            let mut owed: std::collections::BTreeSet<&str> =
                ids.iter().map(|i| i.as_str()).collect();
            for id in &order {
                let removed = s.remove(id).map(|r| r.meta.req_id.to_string());
                let expected = owed.remove(id.as_str()).then(|| id.clone());
                assert_eq!(removed, expected, "{id} in {order:?}");
                assert!(!s.contains(id) && s.carries(id) == ids.contains(id));
                assert_eq!(s.len(), owed.len());
                assert!(s.iter().map(|r| &*r.meta.req_id).eq(owed.iter().copied()));
            }
            assert!(s.is_empty());
        }
    }

    #[test]
    fn bits_past_the_first_word_are_tracked() {
        let reqs: Vec<_> = (0..130).map(|i| req(&format!("r{i:03}"))).collect();
        let mut s = PendingSet::new(reqs.clone());
        assert!(s.remove("r129").is_some());
        assert!(s.remove("r064").is_some());
        assert!(!s.contains("r129") && s.contains("r063") && s.contains("r128"));
        assert_eq!(s.len(), 128);
    }
}
