//! Asynchronous events of D's devices (`ibv_get_async_event`): a QP that fails by itself
//! (`IBV_EVENT_QP_FATAL`, `QP_REQ_ERR`, `QP_ACCESS_ERR`, `PATH_MIG_ERR`) or a port or device
//! that goes down leaves its endpoints in ERR without anyone asking; they are marked Broken (so
//! a re-handshake replaces their QPs and a confirmation round is refused), counted and logged.
//! [`watch`] is the target's task that reads them as they arrive.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::watch;

use super::backend::VerbsBackend;
use super::fence::SharedHandshake;

/// A device file descriptor the task polls; the backend owns it (the task keeps the backend
/// alive through the shared handshake).
struct BorrowedFd(RawFd);

impl AsRawFd for BorrowedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn lock<B>(hs: &SharedHandshake<B>) -> std::sync::MutexGuard<'_, super::PassiveHandshake<B>> {
    hs.lock().unwrap_or_else(|p| p.into_inner())
}

/// Read the backend's async events as they arrive and act on them
/// ([`PassiveHandshake::on_async_events`](super::PassiveHandshake::on_async_events)); `seen` counts the events handled. One task
/// per event file descriptor ([`VerbsBackend::async_event_fds`]); returns at once if the
/// backend has none. The draining runs on the blocking pool (it takes the handshake lock).
pub async fn watch<B: VerbsBackend + 'static>(
    hs: SharedHandshake<B>,
    seen: Arc<watch::Sender<u64>>,
) {
    let fds = lock(&hs).backend().async_event_fds();
    let mut tasks = Vec::with_capacity(fds.len());
    for fd in fds {
        // SAFETY: the backend owns `fd` and keeps it open while it lives
        // (`VerbsBackend::async_event_fds`); this task holds the backend (through `hs`) for as
        // long as the `AsyncFd` exists, and nothing else replaces the descriptor.
        let registered =
            unsafe { AsyncFd::register_with_interest(BorrowedFd(fd), Interest::READABLE) };
        let afd = match registered {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(fd, error = %e, "RDMA async events cannot be watched");
                continue;
            }
        };
        let hs = Arc::clone(&hs);
        let seen = Arc::clone(&seen);
        tasks.push(tokio::spawn(async move {
            loop {
                let Ok(mut ready) = afd.readable().await else {
                    return;
                };
                // Cleared before draining: an event arriving meanwhile makes it ready again.
                ready.clear_ready();
                let hs = Arc::clone(&hs);
                let n = tokio::task::spawn_blocking(move || lock(&hs).on_async_events())
                    .await
                    .unwrap_or(0);
                if n > 0 {
                    seen.send_modify(|c| *c += n as u64);
                }
            }
        }));
    }
    // Held here so that aborting `watch` stops them too.
    let _abort = AbortAll(tasks);
    std::future::pending::<()>().await;
}

struct AbortAll(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortAll {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}
