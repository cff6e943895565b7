//! `kvrecv serve`'s stdout: a queue of lines, one writer draining it, and a bound on what may
//! wait in it.
//!
//! Every input line is answered, so a host that keeps writing stdin but stops reading stdout
//! would grow serve's queue without limit. The queue counts the bytes waiting in it; over the
//! high-water mark serve stops reading stdin (the host's writes then block on the full pipe)
//! until the writer has brought it down to half the mark. Events still queue while stdin is
//! paused: they are bounded by the requests already admitted (and a pull's `stale` events by
//! 8). If stdout closes, serve stops.

#![forbid(unsafe_code)]

use std::io::Write;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;

/// The writer credits what it has handed to its buffer at least this often, not only when the
/// queue runs empty: under a steady stream of events it may never run empty, and the backlog
/// would seem to grow until stdin paused.
const CREDIT_CHUNK: usize = 16 * 1024;

/// Bytes queued for stdout and not yet handed to the writer's buffer (at most 64 KiB more sit
/// there unwritten), shared by the queue and its writer.
#[derive(Default)]
struct Backlog {
    bytes: AtomicUsize,
    /// The writer is gone (stdout closed): nothing will drain the count again.
    closed: AtomicBool,
    room: Notify,
    /// Woken when the writer is gone.
    gone: Notify,
}

impl Backlog {
    /// The writer wrote `n` bytes (or dropped them).
    fn written(&self, n: usize) {
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.room.notify_one();
    }

    /// The writer handed a `len`-byte line (and its newline) to its buffer; `pending` holds
    /// what it has not credited yet, credited every [`CREDIT_CHUNK`].
    fn handed(&self, pending: &mut usize, len: usize) {
        *pending += len + 1;
        if *pending >= CREDIT_CHUNK {
            self.written(std::mem::take(pending));
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.room.notify_one();
        self.gone.notify_waiters();
    }
}

/// The sending half: what serve's loop writes lines into.
pub struct Output {
    tx: UnboundedSender<String>,
    backlog: Arc<Backlog>,
    high_water: usize,
}

/// The receiving half, handed to the writer.
pub struct OutputQueue {
    rx: UnboundedReceiver<String>,
    backlog: Arc<Backlog>,
}

/// A queue whose sender reports [`Output::over_high_water`] while more than `high_water` bytes
/// wait in it.
pub fn output(high_water: usize) -> (Output, OutputQueue) {
    let (tx, rx) = unbounded_channel();
    let backlog = Arc::new(Backlog::default());
    (
        Output {
            tx,
            backlog: backlog.clone(),
            high_water,
        },
        OutputQueue { rx, backlog },
    )
}

impl Output {
    /// Queue one line (without its newline). Lost only if stdout is closed.
    pub fn send(&self, line: String) {
        let n = line.len() + 1;
        // Counted before it is sent, so the writer never subtracts what was not yet added.
        self.backlog.bytes.fetch_add(n, Ordering::AcqRel);
        if self.tx.send(line).is_err() {
            self.backlog.bytes.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Bytes waiting to be written.
    pub fn queued(&self) -> usize {
        self.backlog.bytes.load(Ordering::Acquire)
    }

    /// More than the high-water mark waits and a writer is still there to drain it.
    pub fn over_high_water(&self) -> bool {
        self.queued() > self.high_water && !self.backlog.closed.load(Ordering::Acquire)
    }

    /// Resolves once stdout's writer is gone (stdout closed, or a write to it failed): nothing
    /// serve says can reach the host any more.
    /// Owns what it waits on, so serve makes it once, not per round of its loop.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + 'static {
        let backlog = self.backlog.clone();
        async move {
            let gone = backlog.gone.notified();
            tokio::pin!(gone);
            // Registered before the check, so a close in between still wakes us.
            gone.as_mut().enable();
            if backlog.closed.load(Ordering::Acquire) {
                return;
            }
            gone.await;
        }
    }

    /// Resolves once the backlog is at or under half the high-water mark (or stdout is
    /// closed): stdin resumes with room to spare, not to pause again a line later.
    pub async fn room(&self) {
        while self.queued() > self.high_water / 2 && !self.backlog.closed.load(Ordering::Acquire) {
            self.backlog.room.notified().await;
        }
    }
}

impl OutputQueue {
    /// Drain everything queued now, starting with `first`, into `sink`, crediting the bytes
    /// handed over every [`CREDIT_CHUNK`]; the bytes handed over and not yet credited.
    fn batch(
        &mut self,
        first: String,
        mut sink: impl FnMut(&str) -> std::io::Result<()>,
    ) -> (usize, std::io::Result<()>) {
        let mut n = 0;
        let mut next = Some(first);
        while let Some(line) = next.take().or_else(|| self.rx.try_recv().ok()) {
            let r = sink(&line);
            self.backlog.handed(&mut n, line.len());
            if let Err(e) = r {
                return (n, Err(e));
            }
        }
        (n, Ok(()))
    }
}

impl Drop for OutputQueue {
    fn drop(&mut self) {
        self.backlog.close();
    }
}

/// stdout's writer. Both kinds drain the queue into a buffer and flush when it is empty, and
/// end when every sender is gone (after flushing) or stdout is closed.
pub enum Writer {
    /// A pipe, non-blocking through the runtime's epoll, written by a task on the actors'
    /// thread (a slow reader suspends the task, never the thread).
    Pipe(tokio::task::JoinHandle<()>),
    /// Anything else (a file, a terminal, a socket), written by a thread of its own so that a
    /// blocking write stalls neither the actors nor the runtime's workers. The receiver hears
    /// when the thread ends: nothing waits on a thread blocked in `write(2)` (a joined one would
    /// keep the runtime from ending after a stop signal gave up on the host).
    Thread(tokio::sync::oneshot::Receiver<()>),
}

impl Writer {
    pub fn start(q: OutputQueue) -> std::io::Result<Writer> {
        let pipe = std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .and_then(|fd| pipe::Sender::from_file(std::fs::File::from(fd)));
        match pipe {
            Ok(p) => Ok(Writer::Pipe(actix_rt::spawn(pipe_writer(p, q)))),
            Err(_) => {
                let (ended, rx) = tokio::sync::oneshot::channel();
                std::thread::Builder::new()
                    .name("kvrecv-stdout".into())
                    .spawn(move || {
                        let stdout = std::io::stdout();
                        // A write error ends the thread as the end of the queue does.
                        let _ = write_all(q, stdout.lock());
                        let _ = ended.send(());
                    })
                    .map(|_| Writer::Thread(rx))
            }
        }
    }

    /// Wait until everything queued is written (or stdout failed).
    pub async fn join(self) {
        match self {
            Writer::Pipe(t) => {
                let _ = t.await;
            }
            Writer::Thread(ended) => {
                let _ = ended.await;
            }
        }
    }
}

async fn pipe_writer(p: pipe::Sender, mut q: OutputQueue) {
    let mut w = tokio::io::BufWriter::with_capacity(64 * 1024, p);
    while let Some(first) = q.rx.recv().await {
        // The pipe may be full: lines are written one at a time, each awaited (the same loop
        // as `OutputQueue::batch`, which cannot await).
        let mut n = 0;
        let mut next = Some(first);
        let mut ok = true;
        while let Some(line) = next.take().or_else(|| q.rx.try_recv().ok()) {
            ok = w.write_all(line.as_bytes()).await.is_ok() && w.write_all(b"\n").await.is_ok();
            q.backlog.handed(&mut n, line.len());
            if !ok {
                break;
            }
        }
        ok = ok && w.flush().await.is_ok();
        q.backlog.written(n);
        if !ok {
            return;
        }
    }
}

/// Write every queued line to `out` (blocking), flushing whenever the queue is empty.
fn write_all(mut q: OutputQueue, out: impl Write) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::with_capacity(64 * 1024, out);
    while let Some(first) = q.rx.blocking_recv() {
        let (n, r) = q.batch(first, |line| {
            w.write_all(line.as_bytes())?;
            w.write_all(b"\n")
        });
        let r = r.and_then(|()| w.flush());
        q.backlog.written(n);
        r?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backlog_counts_queued_bytes_until_the_writer_takes_them() {
        let (out, q) = output(10);
        out.send("12345".into());
        assert_eq!(out.queued(), 6);
        assert!(!out.over_high_water());
        out.send("abcde".into());
        assert_eq!(out.queued(), 12);
        assert!(out.over_high_water());
        let written = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = SharedVec(written.clone());
        let t = std::thread::spawn(move || write_all(q, sink));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // The writer drains the queue; room() is what serve awaits before reading stdin again.
        rt.block_on(out.room());
        assert_eq!(out.queued(), 0);
        drop(out);
        t.join().unwrap().unwrap();
        assert_eq!(&*written.lock().unwrap(), b"12345\nabcde\n");
    }

    /// A writer that never sees its queue empty still credits what it wrote: stdin is not
    /// paused for a backlog that is in fact moving.
    #[test]
    fn a_steady_stream_is_credited_before_the_queue_empties() {
        let (out, q) = output(1 << 20);
        let line = "x".repeat(1023);
        for _ in 0..100 {
            out.send(line.clone());
        }
        assert_eq!(out.queued(), 100 * 1024);
        let (reached, wait_reached) = std::sync::mpsc::channel();
        let (go, wait_go) = std::sync::mpsc::channel::<()>();
        let sink = Gated {
            bytes: 0,
            stop_at: 40 * 1024,
            reached,
            go: wait_go,
        };
        let t = std::thread::spawn(move || write_all(q, sink));
        wait_reached.recv().unwrap();
        // Lines are still queued, but what went to the buffer is no longer counted.
        assert!(
            out.queued() <= 100 * 1024 - 32 * 1024,
            "queued {}",
            out.queued()
        );
        go.send(()).unwrap();
        drop(out);
        t.join().unwrap().unwrap();
    }

    /// Takes bytes until `stop_at`, then says so and waits for `go` before taking more.
    struct Gated {
        bytes: usize,
        stop_at: usize,
        reached: std::sync::mpsc::Sender<()>,
        go: std::sync::mpsc::Receiver<()>,
    }
    impl Write for Gated {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.bytes < self.stop_at && self.bytes + b.len() >= self.stop_at {
                let _ = self.reached.send(());
                let _ = self.go.recv();
            }
            self.bytes += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// stdin resumes at half the mark, not just under it: no pause again one line later.
    #[test]
    fn stdin_resumes_at_half_the_high_water_mark() {
        use futures::FutureExt;
        let (out, q) = output(100);
        out.send("x".repeat(149)); // 150 bytes queued
        assert!(out.over_high_water());
        q.backlog.written(70); // 80: under the mark, not under half of it
        assert!(!out.over_high_water());
        assert!(out.room().now_or_never().is_none());
        q.backlog.written(30); // 50
        assert!(out.room().now_or_never().is_some());
    }

    /// `closed()` resolves once the writer is gone, also for a waiter registered before.
    #[test]
    fn closed_resolves_when_the_writer_goes() {
        use futures::FutureExt;
        let (out, q) = output(100);
        let mut waiting = Box::pin(out.closed());
        assert!(waiting.as_mut().now_or_never().is_none());
        drop(q);
        assert!(waiting.now_or_never().is_some());
        assert!(out.closed().now_or_never().is_some());
    }

    #[test]
    fn a_closed_stdout_never_holds_stdin() {
        let (out, q) = output(1);
        out.send("a line".into());
        assert!(out.over_high_water());
        drop(q); // stdout's writer gone, its lines with it
        assert!(!out.over_high_water());
        out.send("lost".into());
        assert!(!out.over_high_water());
    }

    struct SharedVec(Arc<std::sync::Mutex<Vec<u8>>>);
    impl Write for SharedVec {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
