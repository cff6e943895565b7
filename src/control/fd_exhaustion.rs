//! Naming why a connect failed for want of a file descriptor: libzmq reports a connect whose
//! socket() failed as a retried one, with the errno lost, so the transport remembers the last
//! EMFILE it saw and, on failure, compares the open descriptors with the process's limit.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// When (ms on a monotonic clock) opening a socket last failed for want of a file descriptor.
/// The descriptor table is the process's, so this is too; 0: never.
static LAST_FD_EXHAUSTION_MS: AtomicU64 = AtomicU64::new(0);

/// An EMFILE seen this long ago still explains a connect that libzmq retried: when the event is
/// read, the descriptors the failing pulls held may already be free again. (A connect truly
/// refused within this time is named an fd shortage too: only the message is affected.)
const FD_EXHAUSTION_MEMORY: Duration = Duration::from_secs(10);

fn monotonic_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    // +1 so that a failure in the first millisecond is not read as "never".
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1
}

/// Remember that opening a socket just failed with EMFILE.
pub(super) fn note_fd_exhaustion() {
    LAST_FD_EXHAUSTION_MS.store(monotonic_ms(), Ordering::Relaxed);
}

/// Why a connect libzmq retried may have failed for want of a file descriptor (libzmq reports
/// a connect whose socket() failed as a retried one, errno lost): an EMFILE seen recently, or
/// this process within 5% of its open-file limit now. Read only on failure (it lists
/// `/proc/self/fd`).
pub(super) fn fd_exhaustion() -> Option<String> {
    let last = LAST_FD_EXHAUSTION_MS.load(Ordering::Relaxed);
    let ago = monotonic_ms().saturating_sub(last);
    if last != 0 && u128::from(ago) <= FD_EXHAUSTION_MEMORY.as_millis() {
        return Some(format!(
            "no file descriptor was free for a socket {ago} ms ago (EMFILE: raise the limit)"
        ));
    }
    fd_exhaustion_from(
        std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64),
        std::fs::read_to_string("/proc/self/limits"),
    )
}

/// [`fd_exhaustion`] from what reading `/proc/self/fd` and `/proc/self/limits` gave.
fn fd_exhaustion_from(
    open: std::io::Result<u64>,
    limits: std::io::Result<String>,
) -> Option<String> {
    // Counting needs a descriptor of its own: failing to get one is the answer.
    let out_of_fds = |e: std::io::Error| {
        matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
            .then(|| format!("every file descriptor is in use ({e}: raise the limit)"))
    };
    let open = match open {
        Ok(n) => n,
        Err(e) => return out_of_fds(e),
    };
    let limits = match limits {
        Ok(l) => l,
        Err(e) => return out_of_fds(e),
    };
    let soft: u64 = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    (open * 20 >= soft * 19).then(|| {
        format!(
            "{open} of this process's {soft} file descriptors are open (EMFILE: raise the limit)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Out of descriptors, `/proc/self/fd` cannot even be listed: that failure is the answer.
    #[test]
    fn fd_exhaustion_names_a_full_table_and_nothing_else() {
        let limits = || {
            Ok(
                "Max open files            1024                 4096                 files\n"
                    .to_owned(),
            )
        };
        fn emfile<T>() -> std::io::Result<T> {
            Err(std::io::Error::from_raw_os_error(libc::EMFILE))
        }
        let m = fd_exhaustion_from(emfile::<u64>(), limits()).expect("EMFILE listing the table");
        assert!(m.contains("every file descriptor is in use"), "{m}");
        assert!(fd_exhaustion_from(Ok(3), emfile()).is_some());
        let m = fd_exhaustion_from(Ok(1000), limits()).expect("within 5% of the limit");
        assert!(m.contains("1000 of this process's 1024"), "{m}");
        assert_eq!(
            fd_exhaustion_from(Ok(10), limits()),
            None,
            "far from the limit"
        );
        let other = Err(std::io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(
            fd_exhaustion_from(other, limits()),
            None,
            "no /proc: no claim"
        );
    }
}
