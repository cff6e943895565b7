//! Destination blocks, one list per KV-cache group, stored in one buffer of `u32`s:
//! `[groups, end of group 0, …, end of group G-1, ids…]` (ends counted in ids), where a
//! `Vec<Vec<u32>>` held two buffers (the outer list's and each group's; docs/PERFORMANCE.md,
//! "Where the bytes per in-flight request go"). A request in flight keeps its lists so at the
//! head of its [`RequestTail`](super::request_tail::RequestTail) (its transfer id after them) and reads
//! them as [`BlockGroups`]: groups by index, each a slice, like the lists they replace.

#![forbid(unsafe_code)]

use std::fmt;

/// Stored block lists, borrowed: serialized as a list of lists, as vLLM's `block_ids`.
#[derive(Clone, Copy, Default)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct BlockGroups<'a>(&'a [u32]);

impl<'a> BlockGroups<'a> {
    /// No group at all (a request nothing is received for).
    pub const NONE: BlockGroups<'static> = BlockGroups(&[]);

    /// The groups in their stored form ([`stored`]; a request's tail starts so).
    pub(super) fn from_stored(stored: &'a [u32]) -> Self {
        BlockGroups(stored)
    }

    /// Number of KV-cache groups.
    pub fn len(self) -> usize {
        self.0.first().map_or(0, |&g| g as usize)
    }

    /// Whether there is no group at all.
    pub fn is_empty(self) -> bool {
        self.0.is_empty()
    }

    /// Group `g`'s blocks, if there is such a group.
    pub fn get(self, g: usize) -> Option<&'a [u32]> {
        let groups = self.len();
        if g >= groups {
            return None;
        }
        let ids = &self.0[1 + groups..];
        let start = if g == 0 { 0 } else { self.0[g] as usize };
        Some(&ids[start..self.0[1 + g] as usize])
    }

    /// Each group's blocks, in group order.
    pub fn iter(self) -> Groups<'a> {
        Groups {
            ids: self,
            next: 0,
            end: self.len(),
        }
    }
}

impl serde::Serialize for BlockGroups<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

/// `groups` as stored (`[groups, end of each group, ids…]`), with room for `spare` more words
/// (a request's tail appends its transfer id).
///
/// # Panics
/// Past `u32::MAX` groups or ids in all (16 GiB of ids: no host's request).
pub(super) fn stored<G: AsRef<[u32]>>(groups: &[G], spare: usize) -> Vec<u32> {
    let total: usize = groups.iter().map(|g| g.as_ref().len()).sum();
    let n = |x: usize| u32::try_from(x).expect("a request's block ids fit u32 counts");
    let mut v = Vec::with_capacity(1 + groups.len() + total + spare);
    v.push(n(groups.len()));
    let mut end = 0;
    for g in groups {
        end += g.as_ref().len();
        v.push(n(end));
    }
    for g in groups {
        v.extend_from_slice(g.as_ref());
    }
    v
}

/// The groups of a [`BlockGroups`], each its blocks.
#[derive(Clone)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Groups<'a> {
    ids: BlockGroups<'a>,
    next: usize,
    end: usize,
}

impl<'a> Iterator for Groups<'a> {
    type Item = &'a [u32];

    fn next(&mut self) -> Option<&'a [u32]> {
        if self.next == self.end {
            return None;
        }
        self.next += 1;
        self.ids.get(self.next - 1)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.end - self.next, Some(self.end - self.next))
    }
}

impl ExactSizeIterator for Groups<'_> {}

impl DoubleEndedIterator for Groups<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        if self.next == self.end {
            return None;
        }
        self.end -= 1;
        self.ids.get(self.end)
    }
}

impl PartialEq<Vec<Vec<u32>>> for BlockGroups<'_> {
    fn eq(&self, other: &Vec<Vec<u32>>) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_slice())
    }
}

impl fmt::Debug for BlockGroups<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_read_back_as_given() {
        for groups in [
            vec![vec![]],
            vec![vec![7]],
            vec![vec![1, 2, 3], vec![], vec![9, 8]],
            vec![vec![], vec![], vec![4]],
        ] {
            let v = stored(&groups, 0);
            let b = BlockGroups::from_stored(&v);
            assert_eq!(b.len(), groups.len());
            assert_eq!(b, groups);
            for (g, ids) in groups.iter().enumerate() {
                assert_eq!(b.get(g), Some(ids.as_slice()));
            }
            assert_eq!(b.get(groups.len()), None);
            assert_eq!(b.iter().rev().count(), groups.len());
        }
        assert!(BlockGroups::NONE.is_empty() && BlockGroups::NONE.get(0).is_none());
    }

    /// The groups serialize as the lists they were made of (a pull's `req_blocks`).
    #[test]
    fn serialized_as_lists() {
        for groups in [vec![vec![]], vec![vec![1, 2], vec![], vec![3]]] {
            let v = stored(&groups, 0);
            let bytes = rmp_serde::to_vec(&BlockGroups::from_stored(&v)).unwrap();
            assert_eq!(bytes, rmp_serde::to_vec(&groups).unwrap());
        }
        let none = rmp_serde::to_vec(&BlockGroups::NONE).unwrap();
        assert_eq!(none, rmp_serde::to_vec(&Vec::<Vec<u32>>::new()).unwrap());
    }

    /// One group of one block, the common case: three words (count, end, id).
    #[test]
    fn one_group_of_one_block_is_three_words() {
        assert_eq!(stored(&[vec![5u32]], 0), [1, 1, 5]);
    }
}
