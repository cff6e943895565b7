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
/// 1,104 B with the same CPU. An operator's `MIMALLOC_*` variable still wins.
///
/// Set before `main`, from the ELF constructor below, not in it: mimalloc reserves its first
/// arena at the Rust runtime's first allocation, before `main`, and by default commits it at
/// once and advises it onto transparent huge pages, where every partly used 2 MiB page is
/// resident whole. Set in `main` (as it was) the options came too late for that arena, which
/// holds everything: 25–53 B per in-flight request more (docs/PERFORMANCE.md, "mimalloc's
/// first arena"). Transparent huge pages stay allowed for the process: kvrecv's landing
/// memory asks for them (`rdma/host_buffer.rs`), and `MIMALLOC_ALLOW_THP=0` would turn them off
/// for all of it. Allocates nothing (the environment is read in place).
fn tune() {
    // `mi_option_t` values, the same in mimalloc v2 and v3 (include/mimalloc.h).
    const ARENA_EAGER_COMMIT: mi::mi_option_t = 4;
    const PURGE_DELAY: mi::mi_option_t = 15;
    for (option, names) in [
        (
            ARENA_EAGER_COMMIT,
            &[
                &b"MIMALLOC_ARENA_EAGER_COMMIT"[..],
                b"MIMALLOC_EAGER_REGION_COMMIT",
            ][..],
        ),
        (
            PURGE_DELAY,
            &[&b"MIMALLOC_PURGE_DELAY"[..], b"MIMALLOC_RESET_DELAY"][..],
        ),
    ] {
        if !set_by_operator(names) {
            // SAFETY: plain option setters; they take effect on the allocator's next decision.
            unsafe { mi::mi_option_set(option, 0) };
        }
    }
}

/// Whether the environment names any of `names` (ASCII case ignored, as mimalloc reads
/// them), read without allocating.
fn set_by_operator(names: &[&[u8]]) -> bool {
    extern "C" {
        // `mut`: `setenv` replaces it; read once, through a raw pointer.
        static mut environ: *const *const std::ffi::c_char;
    }
    // SAFETY: `environ` is the process's NULL-terminated array of NUL-terminated strings;
    // nothing changes it while the constructors run (one thread), and kvrecv never sets a
    // variable.
    unsafe {
        let mut e = std::ptr::addr_of!(environ).read();
        while !e.is_null() && !(*e).is_null() {
            let var = std::ffi::CStr::from_ptr(*e).to_bytes();
            // As mimalloc matches them: `NAME=value`; an entry without `=` sets nothing.
            if let Some(eq) = var.iter().position(|&b| b == b'=') {
                if names.iter().any(|n| var[..eq].eq_ignore_ascii_case(n)) {
                    return true;
                }
            }
            e = e.add(1);
        }
    }
    false
}

/// [`tune`] as an ELF constructor: glibc runs `.init_array` before `main` and before the Rust
/// runtime's first allocation.
#[used]
#[link_section = ".init_array"]
static TUNE_BEFORE_MAIN: extern "C" fn() = {
    extern "C" fn tune_before_main() {
        tune();
    }
    tune_before_main
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The options were set before mimalloc's first arena: no mapping of this process (this
    /// test binary has the binary's allocator and constructor) is advised onto huge pages,
    /// where the arena was when the options came in `main`; and they read back as set.
    #[test]
    fn the_first_arena_is_committed_on_demand_and_not_on_huge_pages() {
        // Something allocated: the arena exists.
        let held: Vec<Vec<u8>> = (0..1000).map(|i| vec![1u8; 100 + i]).collect();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let advised: Vec<&str> = smaps
            .lines()
            .filter(|l| l.starts_with("VmFlags:") && l.split_whitespace().any(|f| f == "hg"))
            .collect();
        assert!(
            advised.is_empty(),
            "huge-page advised mappings: {advised:?}"
        );
        // SAFETY: plain option getters.
        let (commit, purge) = unsafe { (mi::mi_option_get(4), mi::mi_option_get(15)) };
        if !set_by_operator(&[
            b"MIMALLOC_ARENA_EAGER_COMMIT",
            b"MIMALLOC_EAGER_REGION_COMMIT",
        ]) {
            assert_eq!(commit, 0);
        }
        if !set_by_operator(&[b"MIMALLOC_PURGE_DELAY", b"MIMALLOC_RESET_DELAY"]) {
            assert_eq!(purge, 0);
        }
        drop(held);
    }

    /// The environment is read as mimalloc reads it: names in any case, whole names only.
    #[test]
    fn operator_variables_are_found_in_any_case() {
        assert!(std::env::var_os("PATH").is_some(), "tests run with a PATH");
        assert!(set_by_operator(&[b"path"]));
        assert!(set_by_operator(&[b"NOPE_NOT_SET_KVRECV", b"Path"]));
        assert!(!set_by_operator(&[b"PAT"]));
        assert!(!set_by_operator(&[b"NOPE_NOT_SET_KVRECV"]));
    }

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
