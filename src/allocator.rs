//! The binary's allocator: mimalloc, entered through its plain `malloc` where that already
//! gives the alignment asked for.
//!
//! glibc's malloc took 11% of `kvrecv bench`'s CPU (perf record, TP2, batch 16, 64 in flight):
//! per-pull messages and per-request state are freed on another thread than the one that
//! allocated them, which glibc pays for in arena locks and consolidation (docs/PERFORMANCE.md).
//! A library user keeps its own allocator.
//!
//! The `mimalloc` crate passes every allocation to `mi_malloc_aligned`. In mimalloc v3 that
//! call takes its fast path only while the size class's page has a free block at hand;
//! otherwise, for a size whose class is not a power of two (24-byte `Arc`s, 96-byte messages),
//! it over-allocates by the alignment and hands out an interior pointer: a fifth of serve's
//! allocations at TP2, batch 16 (`perf probe mi_malloc_aligned`, callgrind). mimalloc is a
//! `malloc` replacement, so `mi_malloc` returns blocks aligned as C's `malloc` must: for any
//! type of that size, up to `max_align_t` (16 bytes). Those requests go there, the rest to
//! the aligned entry points, as std's `System` allocator does with glibc.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// What `malloc` guarantees: the alignment of `max_align_t` (16 bytes on the 64-bit targets
/// mimalloc supports), and for a smaller block, that of any type that fits in it.
const MALLOC_ALIGN: usize = 16;

/// mimalloc, through `mi_malloc` when it is enough.
pub struct MiMalloc;

/// Whether `malloc` of `size` bytes is aligned enough for `align`.
fn plain(size: usize, align: usize) -> bool {
    align <= MALLOC_ALIGN && align <= size
}

// SAFETY: every block comes from mimalloc and goes back to it (`mi_free` takes blocks of every
// entry point); `plain` sends to `mi_malloc`/`mi_realloc` only layouts whose alignment
// `malloc`'s contract already meets, the others to the aligned entry points.
unsafe impl GlobalAlloc for MiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's allocation calls take any size and (aligned) a power-of-two
        // alignment, which a `Layout` guarantees; `plain` picks the entry point (impl comment).
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (GlobalAlloc's contract), so from mimalloc,
        // whose `mi_free` takes blocks of every entry point.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) };
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout` (GlobalAlloc's contract); the
        // new size with the same alignment goes to the entry point `plain` picks, as in `alloc`.
        unsafe {
            if plain(new_size, layout.align()) {
                mi::mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

/// mimalloc's defaults keep freed pages resident for a while and commit whole arenas up front:
/// RSS per in-flight request at 100k in flight went from 1,131 B (glibc) to 1,160–1,218 B
/// (`baseline.py --memory-only`). Purging at once and committing on demand brought it to
/// 1,104 B with the same CPU. Transparent huge pages stay on: turning them off is process-wide
/// (serve's landing region included); `MIMALLOC_ALLOW_THP=0` does it for an operator who wants
/// the ~60 B per in-flight request it saves (docs/PERFORMANCE.md). An operator's `MIMALLOC_*`
/// variable still wins.
pub fn tune() {
    // `mi_option_t` values, the same in mimalloc v2 and v3 (include/mimalloc.h).
    const ARENA_EAGER_COMMIT: mi::mi_option_t = 4;
    const PURGE_DELAY: mi::mi_option_t = 15;
    // mimalloc reads its variables case-insensitively and also under their older names.
    let set_by_operator = |names: &[&str]| {
        std::env::vars_os().any(|(k, _)| {
            k.to_str()
                .is_some_and(|k| names.iter().any(|n| k.eq_ignore_ascii_case(n)))
        })
    };
    for (option, names) in [
        (
            ARENA_EAGER_COMMIT,
            &[
                "MIMALLOC_ARENA_EAGER_COMMIT",
                "MIMALLOC_EAGER_REGION_COMMIT",
            ][..],
        ),
        (
            PURGE_DELAY,
            &["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"][..],
        ),
    ] {
        if !set_by_operator(names) {
            // SAFETY: plain option setters; they take effect on the allocator's next decision.
            unsafe { mi::mi_option_set(option, 0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout, the plain entry points included, gets memory of its alignment, usable for
    /// its whole size, and keeps its bytes through growing and shrinking.
    #[test]
    fn every_layout_gets_its_alignment_and_keeps_its_bytes() {
        let a = MiMalloc;
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in [1, 3, 4, 7, 8, 12, 16, 24, 40, 96, 104, 1000, 1152, 70_000] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // Many blocks per layout: one that happens to be aligned proves nothing.
                let blocks: Vec<*mut u8> = (0..64)
                    // SAFETY: a valid layout; each block is read and written only within its
                    // size, and freed once below.
                    .map(|i| unsafe {
                        let p = if i % 2 == 0 {
                            a.alloc(layout)
                        } else {
                            a.alloc_zeroed(layout)
                        };
                        assert!(!p.is_null());
                        assert_eq!(p as usize % align, 0, "size {size} align {align}");
                        if i % 2 == 1 {
                            assert!(std::slice::from_raw_parts(p, size).iter().all(|&b| b == 0));
                        }
                        std::ptr::write_bytes(p, 0xa5, size);
                        p
                    })
                    .collect();
                for p in blocks {
                    // SAFETY: `p` is a live block of `layout`; each realloc's result is used
                    // within its new size and freed once with its own layout.
                    unsafe {
                        // Grown, then shrunk: the bytes kept each time are the ones written.
                        let (grown, shrunk) = (size * 3 + 5, (size / 2).max(1));
                        let q = a.realloc(p, layout, grown);
                        assert_eq!(q as usize % align, 0, "grow {size} align {align}");
                        assert!(std::slice::from_raw_parts(q, size)
                            .iter()
                            .all(|&b| b == 0xa5));
                        std::ptr::write_bytes(q, 0x5a, grown);
                        let grown_layout = Layout::from_size_align(grown, align).unwrap();
                        let r = a.realloc(q, grown_layout, shrunk);
                        assert_eq!(r as usize % align, 0, "shrink {size} align {align}");
                        assert!(std::slice::from_raw_parts(r, shrunk)
                            .iter()
                            .all(|&b| b == 0x5a));
                        a.dealloc(r, Layout::from_size_align(shrunk, align).unwrap());
                    }
                }
            }
        }
    }
}
