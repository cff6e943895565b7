//! vLLM 0.33's layout ids as kvrecv draws them: one id per landing window (DESIGN.md §5.4).
//!
//! The layout a pull carries is its window's base addresses (with the fixed block lengths and
//! layer lists), so an id names one window's layout: `H(nonce, window bases) | 1`, 63 bits. The
//! nonce is drawn per registration of the destination memory (a coordinator started on it):
//! a restart or new host memory draws a new one, so ids never repeat across registrations.
//! Same window, same id: what P cached under it is exactly what the layout would say again.

#![forbid(unsafe_code)]

use std::hash::BuildHasher;

/// The layout ids of one registration of the destination memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutIds {
    nonce: u64,
}

/// The 63 bits a `layout_id` may use (vLLM draws `randbits(63) | 1`).
const ID_BITS: u64 = u64::MAX >> 1;

impl LayoutIds {
    /// A fresh registration: a random nonce from the OS-seeded generator.
    pub fn draw() -> Self {
        LayoutIds {
            nonce: rand::random(),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    /// The ids of the registration with this nonce (tests, replays).
    pub fn with_nonce(nonce: u64) -> Self {
        LayoutIds { nonce }
    }

    /// The id of the layout that advertises `bases`: odd (never 0) and below 2^63, as vLLM's.
    /// Every base is hashed, not only the window's first: the id then names exactly the
    /// addresses the layout would carry whatever the window geometry. One pass over the bases
    /// per pull (64 words at 64 layers), less than encoding them.
    ///
    /// ```
    /// use kvrecv::messages::layout_id::LayoutIds;
    /// let ids = LayoutIds::with_nonce(7);
    /// let a = ids.id_of(&[0x7e00_0000_0000, 0x7e00_1000_0000]);
    /// assert_eq!(a % 2, 1);
    /// assert!(a < 1 << 63);
    /// assert_eq!(a, ids.id_of(&[0x7e00_0000_0000, 0x7e00_1000_0000]));
    /// assert_ne!(a, ids.id_of(&[0x7e00_2000_0000, 0x7e00_3000_0000]));
    /// assert_ne!(a, LayoutIds::with_nonce(8).id_of(&[0x7e00_0000_0000, 0x7e00_1000_0000]));
    /// ```
    pub fn id_of(&self, bases: &[u64]) -> u64 {
        let h = foldhash::quality::FixedState::with_seed(self.nonce).hash_one(bases);
        (h | 1) & ID_BITS
    }
}
