//! The threads that serve data connections: each runs a current-thread tokio runtime, and a
//! connection lives on the one that had the fewest when it was accepted. A connection's reads,
//! permit checks and status frames then stay on one thread with nothing else to wake.
//!
//! Why not the multi-thread data runtime: on it, even with one worker, connections reached
//! payloads before they were all queued far more often (6,100–9,300 `SO_RCVLOWAT` calls per
//! 8,192 writes of 256 KiB, against 600–1,000 here), each a wait and a wakeup more, and two
//! workers also woke each other (futex, eventfd). One such thread (the default) costs 0.76–0.82x the CPU per
//! GiB the runtime did with the Rust writer, 0.94–1.12x with the TE wheel, the floor's CPU
//! within 4% (`dataplane_bench`, docs/PERFORMANCE.md, "One thread for the data connections").

#![forbid(unsafe_code)]

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// Threads serving data connections (see the module doc). Dropping it stops them: their
/// runtimes drop every connection's task, closing its socket.
pub(crate) struct ConnShards {
    shards: Vec<Shard>,
}

struct Shard {
    handle: Handle,
    /// Connections on this thread now.
    open: Arc<AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Counts a connection on its thread until its task ends or is dropped.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ConnShards {
    /// Start `threads` connection threads (at least one), named `kvrecv-conn-<i>`.
    pub(crate) fn start(threads: usize) -> io::Result<Self> {
        let mut shards = Vec::new();
        for i in 0..threads.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = rt.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("kvrecv-conn-{i}"))
                .spawn(move || {
                    // Not the control plane's CPU, if the thread that started us was pinned.
                    crate::control::control_cpu::unpin_current_thread();
                    // Until stopped (or the owner is gone); the runtime's drop then drops
                    // the connections' tasks.
                    rt.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            shards.push(Shard {
                handle,
                open: Arc::default(),
                stop: Some(stop),
                thread: Some(thread),
            });
        }
        Ok(ConnShards { shards })
    }

    /// Run a connection's task on the thread with the fewest connections (it is polled there,
    /// so a socket it registers belongs to that thread's runtime).
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let Some(shard) = self
            .shards
            .iter()
            .min_by_key(|s| s.open.load(Ordering::Relaxed))
        else {
            return;
        };
        shard.open.fetch_add(1, Ordering::Relaxed);
        let open = Open(Arc::clone(&shard.open));
        shard.handle.spawn(async move {
            let _open = open;
            task.await;
        });
    }

    /// Connections on each thread now.
    #[cfg(test)]
    fn open_per_thread(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|s| s.open.load(Ordering::Relaxed))
            .collect()
    }
}

impl Drop for ConnShards {
    /// Stops every thread and waits for it: its connections' tasks are dropped (their
    /// sockets closed) and no kvrecv thread outlives its target. A thread only drops its
    /// runtime, which waits for nothing but a device copy in flight.
    fn drop(&mut self) {
        for s in &mut self.shards {
            if let Some(stop) = s.stop.take() {
                let _ = stop.send(());
            }
        }
        let me = std::thread::current().id();
        for s in &mut self.shards {
            if let Some(t) = s.thread.take() {
                // Never wait for ourselves (a last reference dropped on a connection thread).
                if t.thread().id() != me {
                    let _ = t.join();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Signals when dropped (a task's future dropped with its runtime).
    struct Dropped(Option<std::sync::mpsc::Sender<()>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }

    /// Waits, bounded, until `f` holds (the counts move on the shards' threads).
    fn eventually(what: &str, f: impl Fn() -> bool) {
        for _ in 0..2000 {
            if f() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("{what}");
    }

    #[test]
    fn a_connection_goes_to_the_thread_with_the_fewest_and_stopping_drops_them_all() {
        let shards = ConnShards::start(2).unwrap();
        let (dropped_tx, dropped_rx) = std::sync::mpsc::channel();
        let mut ends = Vec::new();
        let (names_tx, names_rx) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (end, ended) = oneshot::channel::<()>();
            ends.push(end);
            let (names, dropped) = (names_tx.clone(), Dropped(Some(dropped_tx.clone())));
            shards.spawn(async move {
                let _dropped = dropped;
                let _ = names.send(std::thread::current().name().map(str::to_owned));
                let _ = ended.await;
            });
        }
        let mut threads = [names_rx.recv().unwrap(), names_rx.recv().unwrap()];
        threads.sort();
        assert_eq!(
            threads,
            [Some("kvrecv-conn-0".into()), Some("kvrecv-conn-1".into())],
            "one connection on each thread"
        );
        assert_eq!(shards.open_per_thread(), [1, 1]);
        // The first ends: the next connection goes to the thread it leaves empty.
        let _ = ends.remove(0).send(());
        dropped_rx.recv().unwrap();
        eventually("the ended connection is no longer counted", || {
            shards.open_per_thread().iter().sum::<usize>() == 1
        });
        let empty = shards.open_per_thread().iter().position(|&n| n == 0);
        let (dropped, names) = (Dropped(Some(dropped_tx.clone())), names_tx.clone());
        shards.spawn(async move {
            let _dropped = dropped;
            let _ = names.send(std::thread::current().name().map(str::to_owned));
            std::future::pending::<()>().await;
        });
        let name = names_rx.recv().unwrap().unwrap();
        assert_eq!(Some(format!("kvrecv-conn-{}", empty.unwrap())), Some(name));
        assert_eq!(shards.open_per_thread(), [1, 1]);
        // Stopping drops the two still open (a socket in them would close).
        drop(shards);
        for _ in 0..2 {
            dropped_rx
                .recv_timeout(Duration::from_secs(10))
                .expect("an open connection's task dropped at stop");
        }
    }
}
