//! kvrecv's thread: the data runtime, the actors' System, the event forwarder, and what the
//! handle keeps of them.

#![forbid(unsafe_code)]


use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use std::cell::RefCell;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;


use super::{KvRecv, StartError};
use crate::actors::Coordinator;
use crate::config::LoadFailurePolicy;
use crate::messages::KvEvent;
use crate::rdma::handshake_daemon::HandshakeStats;
use crate::rdma::memory::HostMemory;
use crate::rdma::tcp::server::DataStats;
use crate::rdma::TcpLanding;

/// On kvrecv's thread: hands the host the events in bursts, each burst being what the actors
/// emitted before this task's turn (a batch's completions come from one handler). Sent one by
/// one across threads, each event woke the host's thread, which read it and slept again before
/// the next: ~16 context switches per batch of 16 on the host's thread, ~2 in bursts
/// (`kvrecv bench --via handle`, docs/PERFORMANCE.md).
pub(super) async fn forward_events(
    rx: Rc<RefCell<UnboundedReceiver<KvEvent>>>,
    tx: UnboundedSender<Vec<KvEvent>>,
) {
    // The receiver is borrowed only inside a poll, never across an await: the thread takes it
    // back after the System stopped (`forward_burst` there) for what this task had no turn for.
    while let Some(first) = std::future::poll_fn(|cx| rx.borrow_mut().poll_recv(cx)).await {
        if !forward_burst(first, &mut rx.borrow_mut(), &tx) {
            // The host dropped its stream: close the actors' channel, so that their events are
            // dropped where they are emitted rather than queued for nobody.
            let mut rx = rx.borrow_mut();
            rx.close();
            while rx.try_recv().is_ok() {}
            return;
        }
    }
}

/// Sends `first` and whatever else is queued as one burst; false once the host dropped the
/// stream.
pub(super) fn forward_burst(
    first: KvEvent,
    rx: &mut UnboundedReceiver<KvEvent>,
    tx: &UnboundedSender<Vec<KvEvent>>,
) -> bool {
    let mut burst = vec![first];
    while let Ok(ev) = rx.try_recv() {
        burst.push(ev);
    }
    tx.send(burst).is_ok()
}

/// What the data runtime started: what the coordinator is made with, the handle's view of the
/// data plane, and what must live until the worker stops (the target).
pub(crate) type DataStarted<T> = (T, Option<DataPlaneHandle>, Box<dyn std::any::Any>);

/// Start kvrecv's thread. The data plane (`start_data`) runs its listeners on a multi-thread
/// runtime of `worker_threads` and its connections on threads of their own (`ConnShards`); the
/// actors (`make`) run in an actix System on a current-thread runtime of their own on kvrecv's
/// thread, which polls their sockets itself.
/// One runtime for both made every control-plane wake-up a hop: a worker's epoll saw the
/// socket ready and woke the actors' thread.
pub(super) fn spawn_worker<D, DFut, T, M>(
    load_failure_policy: LoadFailurePolicy,
    worker_threads: usize,
    events: Option<UnboundedReceiver<KvEvent>>,
    host_blocks: HostBlocks,
    start_data: D,
    make: M,
) -> Result<KvRecv, StartError>
where
    D: FnOnce() -> DFut + Send + 'static,
    DFut: std::future::Future<Output = Result<DataStarted<T>, StartError>>,
    M: FnOnce(T) -> Coordinator + Send + 'static,
{
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    // Events cross to the host's threads in bursts (see `forward_events`).
    let (events, bursts) = match events {
        Some(rx) => {
            let (tx, bursts) = unbounded_channel();
            (Some((rx, tx)), Some(bursts))
        }
        None => (None, None),
    };
    let thread = std::thread::Builder::new()
        .name("kvrecv".into())
        .spawn(move || {
            let data_rt = match data_runtime(worker_threads, "kvrecv-io") {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(StartError::Runtime(e)));
                    return;
                }
            };
            // The target's tasks keep running on the data runtime's workers after this returns.
            let (made_with, data, keep) = match data_rt.block_on(start_data()) {
                Ok(started) => started,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let sys = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => actix_rt::System::with_tokio_rt(move || rt),
                Err(e) => {
                    let _ = ready_tx.send(Err(StartError::Runtime(e)));
                    return;
                }
            };
            let events = events.map(|(rx, tx)| (Rc::new(RefCell::new(rx)), tx));
            let forwarder = events.clone();
            let (coord, system) = sys.block_on(async move {
                if let Some((rx, tx)) = forwarder {
                    actix_rt::spawn(forward_events(rx, tx));
                }
                (make(made_with), actix::System::current())
            });
            if ready_tx.send(Ok((coord, data, system))).is_ok() {
                let _ = sys.run();
            }
            // The actors are gone (and their senders with them); what they emitted after the
            // forwarder's last turn still reaches the host, as it did through one channel.
            if let Some((rx, tx)) = events {
                let mut rx = rx.borrow_mut();
                if let Ok(first) = rx.try_recv() {
                    forward_burst(first, &mut rx, &tx);
                }
            }
            // Listeners stop when the target drops, after the actors stopped.
            drop(keep);
            drop(data_rt);
            let _ = done_tx.send(());
        })?;
    let (coord, data, system) = ready_rx.recv().map_err(|_| StartError::ThreadEnded)??;
    Ok(KvRecv {
        inner: Arc::new(Inner {
            coord,
            load_failure_policy,
            data,
            system,
            events: Mutex::new(bursts),
            queued: Arc::default(),
            done: futures::FutureExt::shared(done_rx),
            thread: Some(thread),
            sleep: tokio::sync::Mutex::new(()),
            host_blocks: std::sync::RwLock::new(host_blocks),
        }),
    })
}

/// The data plane's runtime (handshake daemon, data server's listener): `threads` workers
/// named `name`, none on the control plane's CPU.
pub(crate) fn data_runtime(threads: usize, name: &str) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        // Not the control plane's CPU: a thread spawned later from its thread inherits it.
        .on_thread_start(crate::control::control_cpu::unpin_current_thread)
        .enable_all()
        .build()
}

/// What [`KvRecv::read_block`] reads: the host's memory (`None`: kvrecv's own, or device
/// memory) and the layout (`None` on the advanced path, whose landing is the host's).
#[derive(Default)]
pub(crate) struct HostBlocks {
    pub(super) memory: Option<HostMemory>,
    pub(super) layout: Option<crate::layout::KvLayout>,
}

/// What the handle keeps of the data plane (counters are shared atomics).
pub(crate) struct DataPlaneHandle {
    pub(crate) handshake: Arc<HandshakeStats>,
    pub(crate) handshake_addr: SocketAddr,
    pub(crate) segment_name: String,
    // The next three are for `kvrecv serve`'s `ready` line (feature `cli`).
    /// The segment descriptor P reads from the handshake daemon.
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub(crate) descriptor: crate::messages::handshake::SegmentDescriptor,
    /// Each layout region's advertised base address (the first window's).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub(crate) region_bases: Vec<u64>,
    /// Landing windows (TCP: the permit map's; RDMA: those registered).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub(crate) windows: usize,
    /// The TCP target's data server (`None` on RDMA: the NICs write, nothing is served).
    pub(crate) tcp: Option<TcpParts>,
}

/// The TCP target's data server, as the handle sees it.
pub(crate) struct TcpParts {
    pub(crate) stats: Arc<DataStats>,
    pub(crate) landing: Arc<TcpLanding>,
    pub(crate) data_addr: SocketAddr,
}

pub(super) struct Inner {
    pub(super) coord: Coordinator,
    pub(super) load_failure_policy: LoadFailurePolicy,
    pub(super) data: Option<DataPlaneHandle>,
    pub(super) system: actix::System,
    pub(super) events: Mutex<Option<UnboundedReceiver<Vec<KvEvent>>>>,
    /// Requests submitted and not yet taken by the Receiver ([`KvRecv::submit`]).
    pub(super) queued: Arc<std::sync::atomic::AtomicUsize>,
    /// Resolves once kvrecv's thread stopped its actors, listeners and runtime.
    pub(super) done: futures::future::Shared<oneshot::Receiver<()>>,
    /// kvrecv's thread, joined when the last handle goes.
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
    /// Held by a pause or a resume for its whole course: one at a time.
    pub(super) sleep: tokio::sync::Mutex<()>,
    /// The host's memory and its layout, for [`KvRecv::read_block`] (`None` without host
    /// memory). Replaced by a resume on new memory, before the resume returns.
    pub(super) host_blocks: std::sync::RwLock<HostBlocks>,
}

impl Drop for Inner {
    /// The last handle gone: stop kvrecv's System and wait for its thread, so that once the
    /// drop returns no connection of the data target can still write into the host's memory
    /// (a host that returns early with `?` frees its KV cache right after). Not from kvrecv's
    /// own threads (a handle dropped there would wait for itself): those only stop it.
    fn drop(&mut self) {
        self.system.stop();
        let Some(thread) = self.thread.take() else {
            return;
        };
        let current = std::thread::current();
        let ours = current.id() == thread.thread().id()
            || current
                .name()
                .is_some_and(|n| n.starts_with("kvrecv-io") || n.starts_with("kvrecv-conn-"));
        if !ours {
            let _ = thread.join();
            // Nothing can return a report from here: say it, for an operator.
            let held = self.coord.holdings();
            if !held.is_empty() {
                tracing::warn!(
                    requests = held.len(),
                    blocks = held.iter().map(|(_, b)| b.len()).sum::<usize>(),
                    "kvrecv dropped while requests held blocks (KvRecv::shutdown reports them)"
                );
            }
        }
    }
}

