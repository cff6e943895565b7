//! Audit mode (DESIGN.md §5): the writer stamps every block slice it writes with the owner it
//! believes it writes for; the data server checks each landed write's stamps against the block
//! pool's ownership table and counts writes after free and after reallocation. The stamp format
//! is defined here once and used by both the initiator ([`stamp_write`]) and the server
//! ([`Auditor::check`]).
//!
//! Stamp (16 bytes, little-endian) at the start of each block slice of a write:
//! `magic u32 = "KVAU" | owner_tag u32 | block u32 | generation u32` (generation 0 = not
//! known to the writer, so only the owner is checked). A block slice is the part of a write
//! that falls into one block: a write starting mid-block (a head slice) has its first stamp at
//! its first byte; every later block's stamp is at that block's start.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::block_ownership::BlockOwnership;

/// First four bytes of a stamp ("KVAU" little-endian).
pub const STAMP_MAGIC: u32 = u32::from_le_bytes(*b"KVAU");
/// Bytes of one stamp. Block slices shorter than this carry none.
pub const STAMP_LEN: usize = 16;

/// What the writer believes about one block it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// `owner_tag(transfer_id)` of the request the writer writes for.
    pub owner_tag: u32,
    /// The block's index in its region.
    pub block: u32,
    /// Block generation the writer was told, 0 if unknown.
    pub generation: u32,
}

impl Stamp {
    /// The 16 wire bytes.
    pub fn encode(&self) -> [u8; STAMP_LEN] {
        let mut b = [0u8; STAMP_LEN];
        b[0..4].copy_from_slice(&STAMP_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.owner_tag.to_le_bytes());
        b[8..12].copy_from_slice(&self.block.to_le_bytes());
        b[12..16].copy_from_slice(&self.generation.to_le_bytes());
        b
    }

    /// Parse a stamp; `None` when the bytes do not start with the magic.
    pub fn decode(b: &[u8]) -> Option<Stamp> {
        let w = |i: usize| {
            b.get(i..i + 4)
                .and_then(|s| s.try_into().ok())
                .map(u32::from_le_bytes)
        };
        if w(0)? != STAMP_MAGIC {
            return None;
        }
        Some(Stamp {
            owner_tag: w(4)?,
            block: w(8)?,
            generation: w(12)?,
        })
    }
}

/// Offsets (inside the write) and block ids of every block slice of a write of `len` bytes
/// starting at byte `offset` of a region with block stride `block_len`.
///
/// ```
/// use kvrecv::rdma::audit::block_slices;
/// // Starts mid block 2 (a head slice at +512), runs into block 3.
/// let v: Vec<_> = block_slices(2 * 1024 + 512, 1024, 1024).collect();
/// assert_eq!(v, vec![(0, 2, 512), (512, 3, 512)]);
/// ```
pub fn block_slices(
    offset: u64,
    len: u64,
    block_len: u64,
) -> impl Iterator<Item = (u64, u32, u64)> {
    let end = offset.saturating_add(len);
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end || block_len == 0 {
            return None;
        }
        let block = at / block_len;
        let slice_end = ((block + 1) * block_len).min(end);
        let item = (at - offset, block as u32, slice_end - at);
        at = slice_end;
        Some(item)
    })
}

#[cfg(any(feature = "sim", feature = "testing"))]
/// Writer side: stamp `payload`, to be written at byte `offset` of a region with stride
/// `block_len`, for the owner `owner_tag` (generation per block from `generation`).
pub fn stamp_write(
    payload: &mut [u8],
    offset: u64,
    block_len: u64,
    owner_tag: u32,
    generation: impl Fn(u32) -> u32,
) {
    for (at, block, len) in block_slices(offset, payload.len() as u64, block_len) {
        if len >= STAMP_LEN as u64 {
            let s = Stamp {
                owner_tag,
                block,
                generation: generation(block),
            }
            .encode();
            payload[at as usize..at as usize + STAMP_LEN].copy_from_slice(&s);
        }
    }
}

/// Audit counters, readable while the server runs.
#[derive(Debug, Default)]
pub struct AuditCounters {
    /// Block slices checked (stamped ones).
    pub audited: AtomicU64,
    /// Block slices without a stamp (e.g. a real TE writing arbitrary bytes).
    pub unstamped: AtomicU64,
    /// Stamped slices that landed in a block that is free now.
    pub writes_after_free: AtomicU64,
    /// Stamped slices that landed in a block owned by someone else (or another generation) now.
    pub writes_after_realloc: AtomicU64,
    /// Stamps naming a block other than the one written (a writer bug).
    pub misdirected: AtomicU64,
    /// Owners (writer-side request tags) with at least one write after free or reallocation:
    /// the request-level count the seed reports.
    pub late_owners: std::sync::Mutex<std::collections::HashSet<u32>>,
}

/// A point-in-time copy of [`AuditCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
pub struct AuditSnapshot {
    pub audited: u64,
    pub unstamped: u64,
    pub writes_after_free: u64,
    pub writes_after_realloc: u64,
    pub misdirected: u64,
    /// Distinct requests that had a write land after their block was freed.
    pub requests_written_after_free: u64,
}

impl AuditCounters {
    fn late_owner(&self, tag: u32) {
        if let Ok(mut s) = self.late_owners.lock() {
            s.insert(tag);
        }
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn snapshot(&self) -> AuditSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AuditSnapshot {
            audited: l(&self.audited),
            unstamped: l(&self.unstamped),
            writes_after_free: l(&self.writes_after_free),
            writes_after_realloc: l(&self.writes_after_realloc),
            misdirected: l(&self.misdirected),
            requests_written_after_free: self.late_owners.lock().map_or(0, |s| s.len() as u64),
        }
    }
}

/// Server side: checks landed writes against the pool's ownership table.
#[derive(Debug)]
pub struct Auditor {
    ownership: Arc<BlockOwnership>,
    counters: Arc<AuditCounters>,
}

impl Auditor {
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn new(ownership: Arc<BlockOwnership>) -> Self {
        Auditor {
            ownership,
            counters: Arc::default(),
        }
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn counters(&self) -> Arc<AuditCounters> {
        self.counters.clone()
    }

    /// Check the stamps of a write that just landed: `landed` are its bytes as they are in
    /// destination memory (a copy: see [`Self::check_with`]), written at byte `offset` of a
    /// region with stride `block_len`.
    pub fn check(&self, landed: &[u8], offset: u64, block_len: u64) {
        self.check_with(landed.len() as u64, offset, block_len, |at, stamp| {
            landed
                .get(at as usize..at as usize + STAMP_LEN)
                .map(|b| stamp.copy_from_slice(b))
                .is_some()
        });
    }

    /// [`Self::check`] for a write of `len` bytes that is read through `read_stamp(at, buf)`:
    /// copy the [`STAMP_LEN`] bytes at `at` (inside the write) into `buf`, `false` if they
    /// cannot be read (counted as unstamped). The data server copies only the stamps out of
    /// destination memory this way: other connections may write those bytes at any time, so
    /// no `&[u8]` view of them may exist.
    pub fn check_with(
        &self,
        len: u64,
        offset: u64,
        block_len: u64,
        mut read_stamp: impl FnMut(u64, &mut [u8; STAMP_LEN]) -> bool,
    ) {
        let c = &self.counters;
        let mut buf = [0u8; STAMP_LEN];
        for (at, block, len) in block_slices(offset, len, block_len) {
            if len < STAMP_LEN as u64 {
                continue;
            }
            let stamp = read_stamp(at, &mut buf)
                .then(|| Stamp::decode(&buf))
                .flatten();
            let Some(stamp) = stamp else {
                c.unstamped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            c.audited.fetch_add(1, Ordering::Relaxed);
            if stamp.block != block {
                c.misdirected.fetch_add(1, Ordering::Relaxed);
            }
            let Some(now) = self.ownership.get(block) else {
                c.misdirected.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            match now.owner_tag {
                None => {
                    c.writes_after_free.fetch_add(1, Ordering::Relaxed);
                    c.late_owner(stamp.owner_tag);
                    tracing::warn!(block, owner = stamp.owner_tag, "audit: write after free");
                }
                Some(t)
                    if t != stamp.owner_tag
                        || (stamp.generation != 0 && stamp.generation != now.generation) =>
                {
                    c.writes_after_realloc.fetch_add(1, Ordering::Relaxed);
                    c.late_owner(stamp.owner_tag);
                    tracing::warn!(
                        block,
                        writer = stamp.owner_tag,
                        owner = t,
                        "audit: write after reallocation"
                    );
                }
                Some(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::block_pool::BlockPool;

    #[test]
    fn stamp_round_trips_and_rejects_foreign_bytes() {
        let s = Stamp {
            owner_tag: 7,
            block: 3,
            generation: 2,
        };
        assert_eq!(Stamp::decode(&s.encode()), Some(s));
        assert_eq!(Stamp::decode(&[0u8; 16]), None);
        assert_eq!(Stamp::decode(&s.encode()[..10]), None);
    }

    #[test]
    fn auditor_classifies_owner_free_and_reallocated() {
        let mut pool = BlockPool::new(4);
        let a: crate::messages::ReqId = "a".into();
        let blocks = pool.allocate(&a, 11, 2).unwrap();
        let aud = Auditor::new(pool.ownership());
        let bl = 64u64;
        let mut buf = vec![0u8; 64];
        let off = u64::from(blocks[0]) * bl;
        stamp_write(&mut buf, off, bl, 11, |_| 0);
        aud.check(&buf, off, bl);
        assert_eq!(
            aud.counters().snapshot(),
            AuditSnapshot {
                audited: 1,
                ..Default::default()
            }
        );
        pool.release(&a);
        aud.check(&buf, off, bl);
        assert_eq!(aud.counters().snapshot().writes_after_free, 1);
        pool.allocate(&"b".into(), 12, 4).unwrap();
        aud.check(&buf, off, bl);
        assert_eq!(aud.counters().snapshot().writes_after_realloc, 1);
        aud.check(&[0u8; 64], off, bl);
        assert_eq!(aud.counters().snapshot().unstamped, 1);
    }
}
