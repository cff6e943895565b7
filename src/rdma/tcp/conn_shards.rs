//! The threads that serve data connections: each runs a current-thread tokio runtime, and a
//! connection lives on the one that had the fewest when it was accepted. A connection's reads,
//! permit checks and status frames then stay on one thread with nothing else to wake.
//!
//! Why not the multi-thread data runtime: on it, even with one worker, connections reached
//! payloads before they were all queued far more often (6,100–9,300 `SO_RCVLOWAT` calls per
//! 8,192 writes of 256 KiB, against 600–1,000 here), each a wait and a wakeup more, and two
//! workers also woke each other (futex, eventfd). One such thread (the default) costs 0.76–0.84x
//! the CPU per GiB the runtime did with the Rust writer, 0.94–1.12x with the TE wheel, and
//! 0.92–1.04x the floor's (`dataplane_bench`, docs/PERFORMANCE.md, "One thread for the data
//! connections"). Two such threads each wake sooner for less and cost as much as the runtime.

#![forbid(unsafe_code)]

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// Threads serving data connections (see the module doc). [`ConnShards::stop`] (or the drop)
/// stops them: their runtimes drop every connection's task, closing its socket.
pub(crate) struct ConnShards {
    shards: Vec<Shard>,
}

struct Shard {
    handle: Handle,
    /// Connections on this thread now.
    open: Arc<AtomicUsize>,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Counts a connection on its thread until its task ends or is dropped.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shard {
    /// Start thread `i`. Its runtime is built and dropped on that thread: the caller runs
    /// inside a runtime, where dropping another one (a failed spawn's closure) would panic.
    fn start(i: usize) -> io::Result<Shard> {
        let (stop, stopped) = oneshot::channel::<()>();
        let (built, handle) = mpsc::channel::<io::Result<Handle>>();
        let thread = std::thread::Builder::new()
            .name(format!("kvrecv-conn-{i}"))
            .spawn(move || {
                // Not the control plane's CPU, if the thread that started us was pinned.
                crate::control::control_cpu::unpin_current_thread();
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    // Its blocking pool: device copies (`spawn_blocking` in `server.rs`).
                    .thread_name(format!("kvrecv-copy-{i}"))
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = built.send(Err(e));
                        return;
                    }
                };
                let _ = built.send(Ok(rt.handle().clone()));
                // Until stopped (or the owner is gone); the runtime's drop then drops the
                // connections' tasks.
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        let handle = match handle.recv() {
            Ok(h) => h,
            Err(_) => Err(io::Error::other("a data connection thread ended at start")),
        };
        let handle = match handle {
            Ok(h) => h,
            Err(e) => {
                let _ = thread.join();
                return Err(e);
            }
        };
        Ok(Shard {
            handle,
            open: Arc::default(),
            stop: Mutex::new(Some(stop)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Still serving: its thread has not ended (nor been stopped).
    fn live(&self) -> bool {
        lock(&self.thread)
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }
}

/// A poisoned lock's data is still whole here (a sender or a join handle, taken once).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConnShards {
    /// Start `threads` connection threads (at least one), named `kvrecv-conn-<i>`. If one
    /// cannot start, those already started are stopped and joined.
    pub(crate) fn start(threads: usize) -> io::Result<Self> {
        let mut shards = ConnShards { shards: Vec::new() };
        for i in 0..threads.max(1) {
            // On error `shards` drops here, stopping the threads started so far.
            shards.shards.push(Shard::start(i)?);
        }
        Ok(shards)
    }

    /// Run a connection's task on the live thread with the fewest connections (it is polled
    /// there, so a socket it registers belongs to that thread's runtime). `false`, the task
    /// dropped, when no thread is serving (stopped, or every one ended).
    #[must_use]
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> bool {
        let Some(shard) = self
            .shards
            .iter()
            .filter(|s| s.live())
            .min_by_key(|s| s.open.load(Ordering::Relaxed))
        else {
            return false;
        };
        shard.open.fetch_add(1, Ordering::Relaxed);
        let open = Open(Arc::clone(&shard.open));
        shard.handle.spawn(async move {
            let _open = open;
            task.await;
        });
        true
    }

    /// Stop every thread and wait for it: its connections' tasks are dropped (their sockets
    /// closed), so no connection writes once this returns. A thread only drops its runtime,
    /// which waits for nothing but a device copy in flight. Never waits for the calling thread
    /// itself (a last reference dropped on a connection thread).
    pub(crate) fn stop(&self) {
        for s in &self.shards {
            if let Some(stop) = lock(&s.stop).take() {
                let _ = stop.send(());
            }
        }
        let me = std::thread::current().id();
        for s in &self.shards {
            if let Some(t) = lock(&s.thread).take() {
                if t.thread().id() != me {
                    let _ = t.join();
                }
            }
        }
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
    /// As [`ConnShards::stop`]: no kvrecv thread outlives its target.
    fn drop(&mut self) {
        self.stop();
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
            assert!(shards.spawn(async move {
                let _dropped = dropped;
                let _ = names.send(std::thread::current().name().map(str::to_owned));
                let _ = ended.await;
            }));
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
        assert!(shards.spawn(async move {
            let _dropped = dropped;
            let _ = names.send(std::thread::current().name().map(str::to_owned));
            std::future::pending::<()>().await;
        }));
        let name = names_rx.recv().unwrap().unwrap();
        assert_eq!(Some(format!("kvrecv-conn-{}", empty.unwrap())), Some(name));
        assert_eq!(shards.open_per_thread(), [1, 1]);
        // Stopping drops the two still open (a socket in them would close) before it returns.
        shards.stop();
        for _ in 0..2 {
            dropped_rx
                .try_recv()
                .expect("an open connection's task dropped by the time stop returns");
        }
        // Stopped: a new connection is refused (its task dropped), not queued on a dead thread.
        let dropped = Dropped(Some(dropped_tx.clone()));
        assert!(!shards.spawn(async move {
            let _dropped = dropped;
        }));
        dropped_rx.try_recv().expect("the refused task is dropped at once");
    }

    fn cpus_allowed(status: &str) -> String {
        std::fs::read_to_string(status)
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_owned()
    }

    /// Started from a thread pinned to the control CPU, a connection thread still has every CPU
    /// (the data plane's copies must not queue behind the actors).
    #[test]
    fn a_connection_thread_started_from_a_pinned_thread_has_every_cpu() {
        let all = cpus_allowed("/proc/self/status");
        if !all.contains(['-', ',']) {
            eprintln!("skipped: this process may run on one CPU only ({all})");
            return;
        }
        let pinned = crate::control::control_cpu::pin_current_thread(
            crate::control::ControlCpu::Current,
        );
        let shards = ConnShards::start(1);
        crate::control::control_cpu::unpin_current_thread();
        let cpu = pinned.unwrap().expect("pinned to one CPU");
        let shards = shards.unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        assert!(shards.spawn(async move {
            let _ = tx.send(cpus_allowed("/proc/thread-self/status"));
        }));
        let theirs = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_ne!(theirs, cpu.to_string());
        assert_eq!(theirs, all);
    }
}
