//! Host memory kvrecv allocates for landing ([`MemoryKind::Host`](super::memory::MemoryKind::Host)): an anonymous
//! mapping of its own, not the allocator's, on transparent huge pages.
//!
//! Why huge pages: on the TCP data plane the kernel's copy into the destination is most of a
//! receiver's CPU, and with 4 KiB pages that copy walks a page table entry per 4 KiB. Advised
//! huge pages (`MADV_HUGEPAGE`, which the kernel honours in its `madvise` mode too) took
//! kvrecv's target from 0.207 to 0.185 CPU s/GiB and the raw floor from 0.165 to 0.135
//! (`scripts/dataplane-profile`, 256 KiB writes, three alternated pairs, docs/PERFORMANCE.md
//! "Landing on huge pages"). The mapping is zero and faulted in as it is first written, as
//! `alloc_zeroed`'s was; an RDMA registration pins it all the same.

use std::ptr::NonNull;

use super::memory_error::MemoryError;

/// A huge page (x86-64 and aarch64 with 4 KiB base pages): the mapping starts on one so that
/// all of it can be backed by them.
const HUGE_PAGE: usize = 2 << 20;

/// `len` zeroed bytes in a private anonymous mapping, page-aligned (what an RDMA registration
/// wants), starting on a huge-page boundary when `len` spans one.
pub(crate) struct HostBuffer {
    ptr: NonNull<u8>,
    /// Mapped length: `len` rounded up to a page.
    mapped: usize,
}

// SAFETY: the mapping is plain bytes owned by this struct; concurrent access goes through raw
// pointers with the DMA-like contract documented in `super::memory`.
unsafe impl Send for HostBuffer {}
// SAFETY: as for `Send`: `&HostBuffer` hands out only the pointer.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Map `len` bytes (at least one page).
    pub(crate) fn new(len: usize) -> Result<Self, MemoryError> {
        let page = page_size();
        let mapped = len
            .max(1)
            .checked_next_multiple_of(page)
            .ok_or(MemoryError::Alloc(len as u64))?;
        // Room to slide the start up to a huge-page boundary; the slack is unmapped below.
        let slack = if mapped >= HUGE_PAGE { HUGE_PAGE } else { 0 };
        let total = mapped
            .checked_add(slack)
            .ok_or(MemoryError::Alloc(len as u64))?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemoryError::Alloc(len as u64));
        }
        let base = p as usize;
        let start = if slack > 0 {
            base.next_multiple_of(HUGE_PAGE)
        } else {
            base
        };
        // SAFETY: both ranges lie inside the mapping made above and outside
        // `[start, start + mapped)`, which stays mapped; page-aligned (mmap's base, a huge-page
        // boundary, and `mapped` a multiple of the page).
        unsafe {
            if start > base {
                libc::munmap(p, start - base);
            }
            let end = start + mapped;
            if base + total > end {
                libc::munmap(end as *mut libc::c_void, base + total - end);
            }
            // Advice only: a kernel with huge pages off (or none free) keeps base pages.
            libc::madvise(start as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
        }
        let ptr = NonNull::new(start as *mut u8).ok_or(MemoryError::Alloc(len as u64))?;
        Ok(HostBuffer { ptr, mapped })
    }

    /// Start of the bytes.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, exactly; nothing reaches it after the drop (the
        // memory's users hold the `RegisteredMemory` that owns this buffer).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
    }
}

fn page_size() -> usize {
    // SAFETY: a plain query with no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's view of the mapping holding `addr`: its `smaps` lines.
    fn smaps_of(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut out = String::new();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                    inside = a <= addr && addr < b;
                    continue;
                }
            }
            if inside {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// A landing buffer is zero, writable end to end, page-aligned, starts on a huge page
    /// when it spans one, and carries the huge-page advice (`hg` in `VmFlags`).
    #[test]
    fn a_buffer_is_zeroed_aligned_and_advised_huge() {
        let len = 3 * HUGE_PAGE + 123;
        let b = HostBuffer::new(len).unwrap();
        let p = b.ptr().as_ptr();
        assert_eq!(p as usize % HUGE_PAGE, 0);
        // SAFETY: `len` bytes of the buffer, owned by this test.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, len) };
        assert!(bytes.iter().all(|&x| x == 0));
        bytes[len - 1] = 7;
        bytes[0] = 9;
        let flags = smaps_of(p as usize);
        let vm_flags = flags
            .lines()
            .find(|l| l.starts_with("VmFlags:"))
            .expect("the mapping is in smaps");
        // A kernel built without transparent huge pages refuses the advice (and has no
        // such directory); the buffer is still what it must be.
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            assert!(vm_flags.split_whitespace().any(|f| f == "hg"), "{vm_flags}");
        }
        let small = HostBuffer::new(10).unwrap();
        assert_eq!(small.ptr().as_ptr() as usize % page_size(), 0);
    }
}
