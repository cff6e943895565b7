//! A request inside a pull, and a pull's requests: shared by every pull of the batch (the
//! Receiver sorts the batch's list once and each pull, one per P worker, holds the same list,
//! where each held a copy before; an entry is the request's pointer, 8 bytes;
//! docs/PERFORMANCE.md, "Where the bytes per in-flight request go"). A batch of one still
//! allocates no list (the request is held inline).

#![forbid(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use super::batch::SharedRequest;

/// One request inside a pull: one pointer, so a batch's list costs 8 bytes a request (a
/// stored `awaited` flag made it 16, though the request itself says it).
#[derive(Clone)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct PullRequest {
    /// The request and its destination blocks.
    pub meta: SharedRequest,
}

impl PullRequest {
    /// Whether an aggregator awaits its settle: the request has a destination block. One
    /// nobody awaits (a cleanup pull's) is still sent and settled, but its settle goes nowhere.
    pub fn awaited(&self) -> bool {
        self.meta.is_awaiting()
    }
}

/// A pull's requests: none, one inline, or a list shared by the batch's pulls. Reads as a
/// slice; a write (tests only) copies a shared list first.
#[derive(Clone, Default)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct PullRequests(Repr);

#[derive(Clone, Default)]
enum Repr {
    #[default]
    None,
    /// Speed only: a batch of one allocates no list (the seven lists inline for one saved 5.0%
    /// of the instructions per request at batch 1; `scripts/callgrind-core`, DESIGN.md §10).
    One(PullRequest),
    Many(Arc<[PullRequest]>),
}

impl PullRequests {
    /// The same requests sorted by request id, an id listed twice kept once (what a pull's
    /// pending set needs). A list already so (the Receiver's) is kept as it is, still shared.
    pub fn into_sorted_unique(self) -> Self {
        let strictly_sorted = self
            .windows(2)
            .all(|w| w[0].meta.req_id < w[1].meta.req_id);
        if strictly_sorted {
            return self;
        }
        Self::sorted_unique(self.iter().cloned())
    }

    /// The requests sorted by request id, an id listed twice kept once: what the Receiver
    /// hands the batch's pulls (sorted before the list is shared, with no copy to sort; one
    /// request still allocates no list).
    pub fn sorted_unique(requests: impl IntoIterator<Item = PullRequest>) -> Self {
        let mut v: smallvec::SmallVec<[PullRequest; 1]> = requests.into_iter().collect();
        v.sort_by(|a, b| a.meta.req_id.cmp(&b.meta.req_id));
        v.dedup_by(|a, b| a.meta.req_id == b.meta.req_id);
        if v.len() <= 1 {
            return PullRequests(v.pop().map_or(Repr::None, Repr::One));
        }
        v.into_vec().into()
    }

    /// Whether two lists are one shared allocation (or both inline / empty).
    pub fn shares_with(&self, other: &PullRequests) -> bool {
        match (&self.0, &other.0) {
            (Repr::Many(a), Repr::Many(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Deref for PullRequests {
    type Target = [PullRequest];

    fn deref(&self) -> &[PullRequest] {
        match &self.0 {
            Repr::None => &[],
            Repr::One(r) => std::slice::from_ref(r),
            Repr::Many(v) => v,
        }
    }
}

impl DerefMut for PullRequests {
    /// Copy-on-write: a list other pulls share is copied before it is changed.
    fn deref_mut(&mut self) -> &mut [PullRequest] {
        if let Repr::Many(v) = &mut self.0 {
            if Arc::get_mut(v).is_none() {
                *v = v.iter().cloned().collect();
            }
        }
        match &mut self.0 {
            Repr::None => &mut [],
            Repr::One(r) => std::slice::from_mut(r),
            Repr::Many(v) => Arc::get_mut(v).expect("copied above when shared"),
        }
    }
}

impl From<Vec<PullRequest>> for PullRequests {
    fn from(mut v: Vec<PullRequest>) -> Self {
        PullRequests(match v.len() {
            0 => Repr::None,
            1 => Repr::One(v.pop().expect("one request")),
            _ => Repr::Many(v.into()),
        })
    }
}

impl FromIterator<PullRequest> for PullRequests {
    fn from_iter<I: IntoIterator<Item = PullRequest>>(iter: I) -> Self {
        let mut it = iter.into_iter();
        let Some(first) = it.next() else {
            return PullRequests(Repr::None);
        };
        match it.next() {
            None => PullRequests(Repr::One(first)),
            Some(second) => {
                let mut v = Vec::with_capacity(2 + it.size_hint().0);
                v.push(first);
                v.push(second);
                v.extend(it);
                PullRequests(Repr::Many(v.into()))
            }
        }
    }
}

/// An awaited request `id` with one block (tests of what holds pull requests).
#[cfg(test)]
pub(crate) fn test_request(id: &str) -> PullRequest {
    PullRequest {
        meta: Arc::new(crate::messages::RequestMeta::new(id, id, "e", "b", &[vec![1]])),
    }
}

/// A request `id` nobody awaits: no destination block (a cleanup pull's).
#[cfg(test)]
pub(crate) fn test_unawaited_request(id: &str) -> PullRequest {
    PullRequest {
        meta: Arc::new(crate::messages::RequestMeta::new(id, id, "e", "b", &[] as &[Vec<u32>])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str) -> PullRequest {
        test_request(id)
    }

    fn ids(l: &PullRequests) -> Vec<&str> {
        l.iter().map(|r| &*r.meta.req_id).collect()
    }

    #[test]
    fn sorted_once_then_shared() {
        let l: PullRequests = ["b", "a", "c", "a"].iter().map(|i| req(i)).collect();
        assert_eq!(ids(&l), ["b", "a", "c", "a"], "collected in order");
        let s = l.into_sorted_unique();
        assert_eq!(ids(&s), ["a", "b", "c"], "sorted, the duplicate once");
        let again = s.clone().into_sorted_unique();
        assert!(again.shares_with(&s), "a sorted list is kept, not copied");
    }

    /// Changing one pull's list (tests do) leaves the batch's other pulls' list alone.
    #[test]
    fn a_write_copies_a_shared_list() {
        let a: PullRequests = ["a", "b"].iter().map(|i| req(i)).collect();
        let mut b = a.clone();
        b[1] = test_unawaited_request("b");
        assert!(a[1].awaited() && !b[1].awaited() && !a.shares_with(&b));
    }

    /// None and one request allocate no list.
    #[test]
    fn none_and_one_are_inline() {
        let none: PullRequests = std::iter::empty().collect();
        let one: PullRequests = std::iter::once(req("a")).collect();
        assert!(none.is_empty() && matches!(none.0, Repr::None));
        assert!(matches!(one.0, Repr::One(_)) && ids(&one) == ["a"]);
    }
}
