//! Destination blocks, one list per KV-cache group, in one allocation: where a
//! `Vec<Vec<u32>>` held 24 bytes inline and two buffers (the outer list's and each group's),
//! this holds 16 bytes inline and one buffer (docs/PERFORMANCE.md, "Where the bytes per
//! in-flight request go"). Read like the lists it replaces: groups by index, each a slice.
//! A request in flight keeps its lists in this stored form at the head of its
//! [`super::request_tail::RequestTail`] (with its transfer id after them) and reads them as
//! [`BlockGroups`]; [`BlockIds`] is the form on its own (a pull's metadata built by hand).

#![forbid(unsafe_code)]

use std::fmt;

/// Destination block ids, one list per KV-cache group (possibly none, possibly empty ones).
///
/// Stored as `[groups, end of group 0, …, end of group G-1, ids…]` (ends counted in ids); no
/// group at all is the empty slice, which allocates nothing.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct BlockIds(Box<[u32]>);

impl BlockIds {
    /// The groups, borrowed (what a pull's metadata serializes).
    pub fn groups(&self) -> BlockGroups<'_> {
        BlockGroups(&self.0)
    }

    /// Number of KV-cache groups.
    pub fn len(&self) -> usize {
        self.groups().len()
    }

    /// Whether there is no group at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Group `g`'s blocks, if there is such a group.
    pub fn get(&self, g: usize) -> Option<&[u32]> {
        self.groups().get(g)
    }

    /// Each group's blocks, in group order.
    pub fn iter(&self) -> Groups<'_> {
        self.groups().iter()
    }

    /// The lists as vectors.
    pub fn to_vecs(&self) -> Vec<Vec<u32>> {
        self.iter().map(<[u32]>::to_vec).collect()
    }
}

/// A [`BlockIds`]' groups, borrowed: serialized as a list of lists, as vLLM's `block_ids`.
#[derive(Clone, Copy, Default)]
pub struct BlockGroups<'a>(&'a [u32]);

impl<'a> BlockGroups<'a> {
    /// No group at all (a request nothing is received for).
    pub const NONE: BlockGroups<'static> = BlockGroups(&[]);

    /// The groups stored as [`BlockIds`] stores them (a request's tail starts so).
    pub(super) fn from_stored(stored: &'a [u32]) -> Self {
        BlockGroups(stored)
    }

    /// The lists as vectors.
    pub fn to_vecs(self) -> Vec<Vec<u32>> {
        self.iter().map(<[u32]>::to_vec).collect()
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

impl<G: AsRef<[u32]>> From<&[G]> for BlockIds {
    /// # Panics
    /// Past `u32::MAX` groups or ids in all (16 GiB of ids: no host's request).
    fn from(groups: &[G]) -> Self {
        if groups.is_empty() {
            return BlockIds::default();
        }
        BlockIds(stored(groups, 0).into_boxed_slice())
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

impl From<Vec<Vec<u32>>> for BlockIds {
    fn from(groups: Vec<Vec<u32>>) -> Self {
        BlockIds::from(groups.as_slice())
    }
}

impl<const N: usize> From<[Vec<u32>; N]> for BlockIds {
    fn from(groups: [Vec<u32>; N]) -> Self {
        BlockIds::from(groups.as_slice())
    }
}

impl std::ops::Index<usize> for BlockIds {
    type Output = [u32];

    /// # Panics
    /// When there is no group `g`, as a `Vec` would.
    fn index(&self, g: usize) -> &[u32] {
        self.get(g).expect("group index out of range")
    }
}

/// The groups of a [`BlockIds`], each its blocks.
#[derive(Clone)]
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

impl<'a> IntoIterator for &'a BlockIds {
    type Item = &'a [u32];
    type IntoIter = Groups<'a>;

    fn into_iter(self) -> Groups<'a> {
        self.iter()
    }
}

impl PartialEq<Vec<Vec<u32>>> for BlockGroups<'_> {
    fn eq(&self, other: &Vec<Vec<u32>>) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_slice())
    }
}

impl PartialEq<Vec<Vec<u32>>> for BlockIds {
    fn eq(&self, other: &Vec<Vec<u32>>) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_slice())
    }
}

impl fmt::Debug for BlockGroups<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl fmt::Debug for BlockIds {
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
            vec![],
            vec![vec![]],
            vec![vec![7]],
            vec![vec![1, 2, 3], vec![], vec![9, 8]],
            vec![vec![], vec![], vec![4]],
        ] {
            let b = BlockIds::from(groups.clone());
            assert_eq!(b.len(), groups.len());
            assert_eq!(b.to_vecs(), groups);
            assert_eq!(b, groups);
            for (g, ids) in groups.iter().enumerate() {
                assert_eq!(&b[g], ids.as_slice());
            }
            assert_eq!(b.get(groups.len()), None);
        }
        assert_ne!(BlockIds::from(vec![]), BlockIds::from(vec![vec![]]));
    }

    /// The groups serialize as the lists they were made of (a pull's `req_blocks`).
    #[test]
    fn serialized_as_lists() {
        for groups in [vec![], vec![vec![]], vec![vec![1, 2], vec![], vec![3]]] {
            let b = BlockIds::from(groups.clone());
            let bytes = rmp_serde::to_vec(&b.groups()).unwrap();
            assert_eq!(bytes, rmp_serde::to_vec(&groups).unwrap());
        }
        let none = rmp_serde::to_vec(&BlockGroups::NONE).unwrap();
        assert_eq!(none, rmp_serde::to_vec(&Vec::<Vec<u32>>::new()).unwrap());
    }

    /// One group of one block, the common case: 16 bytes inline, one 12-byte buffer.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn one_allocation() {
        assert_eq!(std::mem::size_of::<BlockIds>(), 16);
        assert_eq!(BlockIds::from(vec![vec![5]]).0.len(), 3);
        assert_eq!(BlockIds::from(vec![]).0.len(), 0);
    }
}
