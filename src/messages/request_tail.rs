//! A request's variable-length data in one allocation: its destination block lists and its
//! transfer id. A request in flight held them in two (the lists' buffer and the id's `Arc`)
//! behind 32 bytes of pointers; one buffer behind 16 takes `RequestMeta`'s `Arc` from the
//! 80-byte size class to the 64-byte one and drops an allocation per request
//! (docs/PERFORMANCE.md, "Where the bytes per in-flight request go").

#![forbid(unsafe_code)]

use std::fmt;

use zerocopy::IntoBytes;

use super::block_ids::{stored, BlockGroups};

/// Block lists and transfer id, stored as `[groups, end of group 0, …, end of group G-1,
/// ids…, transfer id length in bytes, the id's bytes packed into words]`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RequestTail(Box<[u32]>);

impl RequestTail {
    /// The groups' blocks and the transfer id in one buffer.
    ///
    /// # Panics
    /// Past `u32::MAX` groups, ids or id bytes (16 GiB of ids: no host's request).
    pub fn new<G: AsRef<[u32]>>(groups: &[G], transfer_id: &str) -> Self {
        let id = transfer_id.as_bytes();
        let words = id.len().div_ceil(4);
        let mut v = stored(groups, 1 + words);
        v.push(u32::try_from(id.len()).expect("a transfer id fits u32 bytes"));
        let start = v.len();
        v.resize(start + words, 0);
        v[start..].as_mut_bytes()[..id.len()].copy_from_slice(id);
        RequestTail(v.into_boxed_slice())
    }

    /// Where the block lists end (the transfer id's length is there).
    fn lists_end(&self) -> usize {
        let groups = self.0[0] as usize;
        let ids = if groups == 0 { 0 } else { self.0[groups] as usize };
        1 + groups + ids
    }

    /// The block lists (what a pull's metadata serializes).
    pub fn block_ids(&self) -> BlockGroups<'_> {
        match self.lists_end() {
            1 => BlockGroups::NONE,
            end => BlockGroups::from_stored(&self.0[..end]),
        }
    }

    /// The transfer id.
    pub fn transfer_id(&self) -> &str {
        let at = self.lists_end();
        let len = self.0[at] as usize;
        // Written from a `&str` in `new`, so valid UTF-8; an empty id were it not.
        std::str::from_utf8(&self.0[at + 1..].as_bytes()[..len]).unwrap_or_default()
    }

    /// The `u32`s held (tests).
    #[cfg(test)]
    pub(crate) fn stored_len(&self) -> usize {
        self.0.len()
    }
}

impl fmt::Debug for RequestTail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestTail")
            .field("block_ids", &self.block_ids())
            .field("transfer_id", &self.transfer_id())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_id_read_back_whatever_their_lengths() {
        let many: Vec<u32> = (0..1000).collect();
        for id in ["", "t", "t-1", "abcd", "abcde", "xfer-ü-😀-long-id-0123456789"] {
            for groups in [
                vec![],
                vec![vec![]],
                vec![vec![7]],
                vec![vec![1, 2, 3], vec![], many.clone()],
            ] {
                let t = RequestTail::new(&groups, id);
                assert_eq!(t.transfer_id(), id);
                let back: Vec<Vec<u32>> = t.block_ids().iter().map(<[u32]>::to_vec).collect();
                assert_eq!(back, groups, "id {id:?}");
                assert_eq!(t.block_ids().len(), groups.len());
                assert_eq!(t.block_ids().is_empty(), groups.is_empty());
            }
        }
    }

    /// One buffer: the lists as before (count, ends, ids), then the id's length and its bytes
    /// in words.
    #[test]
    fn one_buffer_holds_both() {
        let t = RequestTail::new(&[vec![1u32], vec![2, 3]], "t-12345");
        assert_eq!(t.stored_len(), 1 + 2 + 3 + 1 + 2);
    }
}
