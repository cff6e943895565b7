//! The front door: one builder that starts a whole D worker (the data target: TCP with landing
//! permits, or RDMA when configured; control plane; coordinator) on kvrecv's own thread, and one
//! handle ([`KvRecv`]) a host calls from any tokio runtime, with no actix in the host.
//!
//! kvrecv's thread runs its own actix `System` on a current-thread tokio runtime that polls the
//! actors' sockets itself; the data plane (handshake daemon, data server and its connections)
//! runs on a multi-thread runtime of its own ([`KvRecvBuilder::worker_threads`]). The host's
//! runtime only awaits replies (actix mailboxes and tokio channels work across runtimes).
//!
//! Hosts that run actix themselves can still wire the actors directly
//! ([`crate::actors::Coordinator::start`], the advanced path); [`KvRecv::from_parts`] puts
//! such custom parts (a scripted transport, a static topology) behind the same handle.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use std::cell::RefCell;
use std::collections::VecDeque;
use thiserror::Error;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

use futures::future::LocalBoxFuture;

use crate::actors::{Coordinator, CoordinatorParts, EventSink};
use crate::block_read::{copy_block, BlockReadError};
use crate::config::{ConfigError, KvRecvConfig, LoadFailurePolicy, MooncakeProtocol};
use crate::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use crate::messages::{AbandonedRequest, BeginPause, NewRegistration, PauseReport};
use crate::messages::{
    Abort, AbortReply, BatchError, GetLedgerStats, KvEvent, KvRequest, LedgerStats, LoadKv,
    LoadKvReply, LoadKvTo, Queued, ReqId, StepOutput,
};
use crate::rdma::handshake_daemon::HandshakeStats;
use crate::rdma::memory::{DeviceMemory, HostMemory};
use crate::rdma::tcp::server::DataStats;
use crate::rdma::tcp::target::TargetError;
#[cfg(any(feature = "rdma", feature = "testing"))]
use crate::rdma::verbs::{RdmaTarget, VerbsBackend};
use crate::rdma::verbs::{PeerBinding, RdmaTargetConfig, RdmaTargetError, VerbsError};
use crate::rdma::{Landing, LandingPauseError, TargetConfig, TcpLanding, TcpTarget};

/// Why a D worker could not start.
#[derive(Debug, Error)]
pub enum StartError {
    #[error("configuration: {0}")]
    /// The configuration was refused.
    Config(#[from] ConfigError),
    #[error("data plane: {0}")]
    /// The data target could not start (bind, memory).
    Target(#[from] TargetError),
    #[error("cannot start kvrecv's thread or runtime: {0}")]
    /// The OS refused a thread or runtime.
    Runtime(#[from] std::io::Error),
    #[error("kvrecv's thread ended during start-up")]
    /// kvrecv's thread died before it reported readiness.
    ThreadEnded,
    #[error("no advertised host: binding {0} needs advertise_host (the address P reaches)")]
    /// A wildcard bind needs the address P should connect to.
    NoAdvertiseHost(IpAddr),
    /// The RDMA devices could not be opened (none, no driver, a named one missing).
    #[error("RDMA devices: {0}")]
    RdmaDevices(#[from] VerbsError),
    /// The RDMA target could not start (bind, registration, descriptor).
    #[error("RDMA target: {0}")]
    Rdma(#[from] RdmaTargetError),
    /// `mooncake_protocol` is `rdma` but this build has no verbs backend (feature `rdma`).
    #[error(
        "mooncake_protocol is \"rdma\" but kvrecv was built without the `rdma` feature: rebuild \
         with --features rdma, or give a verbs backend with KvRecvBuilder::rdma"
    )]
    RdmaNotBuilt,
}

/// Memory the host hands over ([`crate::HostRegion`], [`crate::HostMemory`],
/// [`crate::DeviceRegion`]) that kvrecv refused: the same error [`KvRecvBuilder::start`]
/// returns when it checks that memory against the layout, so a host's `?` reads alike.
impl From<crate::rdma::memory::MemoryError> for StartError {
    fn from(e: crate::rdma::memory::MemoryError) -> Self {
        StartError::Target(TargetError::Memory(e))
    }
}

/// Why a call on a running handle failed.
#[derive(Debug, Error)]
pub enum KvRecvError {
    /// The worker was shut down (or its thread ended): nothing more can be loaded or drained.
    #[error("the kvrecv worker is not running (shut down, or its thread ended)")]
    Stopped,
    /// The event stream was already taken (there is one consumer), or events were not enabled
    /// with [`KvRecvBuilder::events`].
    #[error(
        "no event stream: enable it with KvRecvBuilder::events(true) (or completion_events()); \
         it can be taken once"
    )]
    NoEvents,
    /// The worker is paused ([`KvRecv::pause`]): nothing is loaded until [`KvRecv::resume`].
    #[error("kvrecv is paused (sleep mode): nothing is loaded until resume")]
    Paused,
}

/// Why a [`KvRecv::pause`] or [`KvRecv::resume`] failed.
#[derive(Debug, Error)]
pub enum PauseError {
    /// The worker was shut down (or its thread ended).
    #[error("the kvrecv worker is not running (shut down, or its thread ended)")]
    Stopped,
    /// The data plane could not close (pause: some memory may still be writable, do not
    /// release it; admission stays closed and `pause` may be called again) or reopen (resume:
    /// still paused; `resume` may be called again).
    #[error("data plane: {0}")]
    Landing(#[from] LandingPauseError),
    /// [`ResumeMemory::Host`] on a worker that cannot take new host memory (it lands in
    /// device memory, runs without landing permits, or its data plane is not kvrecv's).
    /// Still paused: resume with [`ResumeMemory::Same`], or start a new worker.
    #[error(
        "this worker cannot resume on new host memory ({0}): resume with the same memory, or \
         start a new worker on the new memory"
    )]
    NewMemoryUnsupported(String),
    /// [`ResumeMemory::Host`] whose regions cannot hold the layout. Still paused, on the old
    /// memory (which must stay valid): resume again with memory that fits.
    #[error("the new host memory does not fit the layout: {0}")]
    MemoryDoesNotFit(#[from] crate::rdma::memory_fit::MemoryFitError),
    /// `resume` on a worker that is not paused.
    #[error("kvrecv is not paused")]
    NotPaused,
}

/// The memory a [`KvRecv::resume`] lands in.
#[derive(Debug, Clone)]
pub enum ResumeMemory {
    /// The memory the worker started with, at the same addresses (vLLM 0.33's
    /// `restore_kv_caches`: the same base addresses and lengths). It must be valid again
    /// before `resume` is called.
    Same,
    /// Other host memory: the host's own regions, one per layout region (checked like at
    /// start: [`PauseError::MemoryDoesNotFit`]), under [`HostRegion::new`]'s contract from
    /// the call on. From `resume`'s return every write lands in it and none in the old
    /// memory, which the host may then free. A worker on device memory refuses it
    /// ([`PauseError::NewMemoryUnsupported`]).
    ///
    /// [`HostRegion::new`]: crate::rdma::memory::HostRegion::new
    Host(HostMemory),
}

/// A message the worker's actors can no longer take: they stopped. The host sees kvrecv's
/// error, not actix's (it has no actix in its code).
fn stopped(_: actix::MailboxError) -> KvRecvError {
    KvRecvError::Stopped
}

/// Starts one D worker. Defaults: TCP target on 127.0.0.1 (ephemeral ports), landing permits
/// and the epoch rule on, kvrecv-owned host memory, no built-in block pool (the host allocates
/// blocks), no event stream. With `mooncake_protocol = "rdma"` (or `KvRecvBuilder::rdma_devices`) the
/// data target is the RDMA one: same handshake daemon address, the same host memory
/// registered with the NICs, and each peer bound to its Mooncake segments by host so that an
/// uncertain peer's queue pairs are fenced ([`PeerBinding`]).
#[derive(Clone)]
pub struct KvRecvBuilder {
    config: KvRecvConfig,
    target: TargetConfig,
    bootstrap: BootstrapConfig,
    zmq: ZmqTransportConfig,
    events: Events,
    builtin_pool: bool,
    worker_threads: usize,
    rdma: Option<RdmaStarter>,
    rdma_handshake: crate::rdma::verbs::HandshakeConfig,
    rdma_windows: usize,
    peer_binding: PeerBinding,
}

impl std::fmt::Debug for KvRecvBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRecvBuilder")
            .field("config", &self.config)
            .field("target", &self.target)
            .field("events", &self.events)
            .field("builtin_pool", &self.builtin_pool)
            .field("rdma_backend", &self.rdma.is_some())
            .field("peer_binding", &self.peer_binding)
            .finish_non_exhaustive()
    }
}

/// What an RDMA data plane hands the worker.
struct RdmaStarted {
    landing: Arc<dyn Landing>,
    handshake: Arc<HandshakeStats>,
    handshake_addr: SocketAddr,
    segment_name: String,
    keep: Box<dyn std::any::Any>,
}

/// Opens a verbs backend and starts the RDMA target on it (on kvrecv's thread).
type RdmaStarter = Arc<
    dyn Fn(RdmaTargetConfig) -> LocalBoxFuture<'static, Result<RdmaStarted, StartError>>
        + Send
        + Sync,
>;

#[cfg(any(feature = "rdma", feature = "testing"))]
fn rdma_starter<B, F>(open: F) -> RdmaStarter
where
    B: VerbsBackend + 'static,
    F: Fn() -> Result<B, VerbsError> + Send + Sync + 'static,
{
    Arc::new(move |cfg| {
        let backend = open();
        Box::pin(async move {
            let target = RdmaTarget::start(backend?, cfg).await?;
            Ok(RdmaStarted {
                landing: target.landing(),
                handshake: Arc::clone(target.handshake_stats()),
                handshake_addr: target.handshake_addr(),
                segment_name: target.segment_name().to_owned(),
                keep: Box::new(target),
            })
        })
    })
}

impl KvRecvBuilder {
    /// From typed configuration (its layout is the destination layout).
    pub fn new(config: KvRecvConfig) -> Self {
        let target = TargetConfig::loopback(config.layout.clone());
        KvRecvBuilder {
            config,
            target,
            bootstrap: BootstrapConfig::default(),
            zmq: ZmqTransportConfig::default(),
            events: Events::Off,
            builtin_pool: false,
            worker_threads: 2,
            rdma: None,
            rdma_handshake: Default::default(),
            rdma_windows: crate::rdma::verbs::WindowsConfig::default().windows,
            peer_binding: PeerBinding::default(),
        }
    }

    /// From vLLM's `--kv-transfer-config` JSON ([`KvRecvConfig::from_kv_transfer_config`]).
    pub fn from_kv_transfer_config(json: &str) -> Result<Self, StartError> {
        Ok(Self::new(KvRecvConfig::from_kv_transfer_config(json)?))
    }

    /// Interface both data-plane listeners bind (port 0: any). Nothing authenticates them: bind
    /// the interface the prefill nodes use, never a public one. Also the advertised host unless
    /// [`Self::advertise_host`] is given.
    pub fn bind(mut self, ip: IpAddr) -> Self {
        self.target.handshake_bind.set_ip(ip);
        self.target.data_bind.set_ip(ip);
        // A wildcard address is not reachable: the host must say what P reaches.
        self.target.advertise_host = if ip.is_unspecified() {
            String::new()
        } else {
            ip.to_string()
        };
        self
    }

    /// Handshake daemon and data server ports (0: any).
    pub fn ports(mut self, handshake: u16, data: u16) -> Self {
        self.target.handshake_bind.set_port(handshake);
        self.target.data_bind.set_port(data);
        self
    }

    /// The host P reaches both listeners at (required when binding a wildcard address).
    pub fn advertise_host(mut self, host: impl Into<String>) -> Self {
        self.target.advertise_host = host.into().trim().to_owned();
        self
    }

    /// Land every write in the host's own KV regions (one per layout region, in layout order):
    /// kvrecv allocates no KV memory. The regions' safety contract is
    /// [`crate::rdma::memory::HostRegion::new`]'s; it holds until [`KvRecv::shutdown`] returned
    /// (or the last handle was dropped and kvrecv's thread ended).
    pub fn host_memory(mut self, memory: HostMemory) -> Self {
        self.target.host_memory = Some(memory);
        self
    }

    /// Land every write in the host's own CUDA device regions (feature `cuda`; one per layout
    /// region): kvrecv allocates no KV memory. Over TCP, payloads go through bounded page-locked
    /// staging and kvrecv's own CUDA streams, each copy complete before the write counts as
    /// landed; over RDMA, the regions are registered with the NIC through GPUDirect RDMA
    /// (dma-buf, else nvidia-peermem). The regions are checked with the driver at start.
    /// Contract: [`crate::rdma::memory::DeviceRegion::new`]. Without the feature, a driver, or
    /// (RDMA) GPUDirect support, [`KvRecvBuilder::start`] fails with a typed error.
    pub fn device_memory(mut self, memory: DeviceMemory) -> Self {
        self.target.device_memory = Some(memory);
        self
    }

    /// Adjust the data-plane target further (windows, idle timeout, caps). Its layout is always
    /// the configuration's.
    pub fn target(mut self, f: impl FnOnce(&mut TargetConfig)) -> Self {
        f(&mut self.target);
        self
    }

    /// HTTP bootstrap client settings.
    pub fn bootstrap(mut self, cfg: BootstrapConfig) -> Self {
        self.bootstrap = cfg;
        self
    }

    /// ZMQ transport settings.
    pub fn zmq(mut self, cfg: ZmqTransportConfig) -> Self {
        self.zmq = cfg;
        self
    }

    /// Keep [`KvEvent`]s for [`KvRecv::events`]. Off by default: the stream is unbounded (an
    /// observer must never slow the receive path), so enable it only when it is read.
    pub fn events(mut self, on: bool) -> Self {
        self.events = if on { Events::All } else { Events::Off };
        self
    }

    /// Keep only [`KvEvent::Completion`]s for [`KvRecv::events`] (a host that waits for its
    /// requests' completions and needs no settles): the other events are not even built, which
    /// saves the worker's thread their cost and the host a wake-up per settle.
    pub fn completion_events(mut self) -> Self {
        self.events = Events::Completions;
        self
    }

    /// Use kvrecv's built-in block pool (for hosts without an allocator of their own).
    pub fn builtin_pool(mut self, on: bool) -> Self {
        self.builtin_pool = on;
        self
    }

    /// Worker threads of kvrecv's data-plane runtime (the handshake daemon and the data
    /// server's connections run there; the actors have a thread of their own). Default 2.
    pub fn worker_threads(mut self, n: usize) -> Self {
        self.worker_threads = n.max(1);
        self
    }

    /// Be an RDMA target on the verbs backend `open` returns (called on kvrecv's thread at
    /// start): sets `mooncake_protocol = "rdma"`. The handshake daemon binds as for TCP; the
    /// layout's memory (the host's, with [`Self::host_memory`]) is registered on every device.
    /// Production code uses `rdma_devices` (feature `rdma`); this crate's tests pass a fake
    /// backend (feature `testing`: the backend trait is not part of the interface).
    #[cfg(feature = "testing")]
    pub fn rdma<B, F>(mut self, open: F) -> Self
    where
        B: VerbsBackend + 'static,
        F: Fn() -> Result<B, VerbsError> + Send + Sync + 'static,
    {
        self.rdma = Some(rdma_starter(open));
        self.config.mooncake_protocol = MooncakeProtocol::Rdma;
        self
    }

    /// Be an RDMA target on this host's RDMA devices (libibverbs; feature `rdma`): which devices
    /// (unusable ones are skipped), port and GID index. Without this call,
    /// `mooncake_protocol = "rdma"` opens every device with the default settings.
    #[cfg(feature = "rdma")]
    pub fn rdma_devices(mut self, devices: crate::rdma::verbs::DeviceConfig) -> Self {
        self.rdma = Some(rdma_starter(move || {
            crate::rdma::verbs::IbvDevices::open(&devices)
        }));
        self.config.mooncake_protocol = MooncakeProtocol::Rdma;
        self
    }

    /// Queue-pair settings of the RDMA target: QPs per endpoint, MTU cap, traffic class and
    /// service level (default: Mooncake's defaults, QoS 0).
    pub fn rdma_handshake(mut self, handshake: crate::rdma::verbs::HandshakeConfig) -> Self {
        self.rdma_handshake = handshake;
        self
    }

    /// RDMA landing windows kept registered (default 4): each is one registration of the whole
    /// layout per NIC with keys of its own, handed to one P host while they last; the fence
    /// retires a suspect's window (DESIGN.md §5).
    pub fn rdma_windows(mut self, windows: usize) -> Self {
        self.rdma_windows = windows.max(1);
        self
    }

    /// How the RDMA fence finds the queue pairs of a peer to fence (default: by host).
    pub fn peer_binding(mut self, binding: PeerBinding) -> Self {
        self.peer_binding = binding;
        self
    }

    /// The effective configuration.
    pub fn config(&self) -> &KvRecvConfig {
        &self.config
    }

    /// Bind, start kvrecv's thread and the worker on it. Returns once both listeners are bound.
    pub fn start(self) -> Result<KvRecv, StartError> {
        self.config.validate()?;
        if self.target.advertise_host.is_empty() {
            return Err(StartError::NoAdvertiseHost(self.target.data_bind.ip()));
        }
        let KvRecvBuilder {
            config,
            mut target,
            bootstrap,
            zmq,
            events,
            builtin_pool,
            worker_threads,
            rdma,
            rdma_handshake,
            rdma_windows,
            peer_binding,
        } = self;
        target.layout = config.layout.clone();
        // What `read_block` reads: the host's memory, unless device memory takes its place.
        let host_blocks = HostBlocks {
            memory: match (&target.device_memory, &target.host_memory) {
                (None, Some(host)) => Some(host.clone()),
                _ => None,
            },
            layout: Some(config.layout.clone()),
        };
        let rdma = match (config.mooncake_protocol, rdma) {
            (MooncakeProtocol::Tcp, _) => None,
            (MooncakeProtocol::Rdma, Some(r)) => Some(r),
            (MooncakeProtocol::Rdma, None) => Some(default_rdma()?),
        };
        // One label set for the whole worker: the coordinator derives the same from `config`.
        let labels = crate::telemetry::Labels::for_config(&config);
        target.labels = labels.clone();
        let (sink, rx) = sink(events);
        spawn_worker(
            config.load_failure_policy,
            worker_threads,
            rx,
            host_blocks,
            move || async move {
                let (landing, data, keep) = match rdma {
                    Some(start_rdma) => {
                        let r = start_rdma(RdmaTargetConfig {
                            handshake_bind: target.handshake_bind,
                            advertise_host: target.advertise_host.clone(),
                            host_memory: target.host_memory.clone(),
                            handshake: rdma_handshake,
                            windows: rdma_windows,
                            // Registered through GPUDirect RDMA (dma-buf or nvidia-peermem); a
                            // node with neither fails the start with a typed error.
                            device_memory: target.device_memory.clone(),
                            peer_binding,
                            ..RdmaTargetConfig::loopback(config.layout.clone())
                        })
                        .await?;
                        let data = DataPlaneHandle {
                            handshake: r.handshake,
                            handshake_addr: r.handshake_addr,
                            segment_name: r.segment_name,
                            tcp: None,
                        };
                        (r.landing, data, r.keep)
                    }
                    None => {
                        let tcp = TcpTarget::start(target).await?;
                        let landing = tcp.landing();
                        let data = DataPlaneHandle {
                            handshake: tcp.handshake_stats().clone(),
                            handshake_addr: tcp.handshake_addr(),
                            segment_name: tcp.segment_name().to_owned(),
                            tcp: Some(TcpParts {
                                stats: tcp.stats().clone(),
                                landing: landing.clone(),
                                data_addr: tcp.data_addr(),
                            }),
                        };
                        (
                            landing as Arc<dyn Landing>,
                            data,
                            Box::new(tcp) as Box<dyn std::any::Any>,
                        )
                    }
                };
                Ok(((landing, config), Some(data), keep))
            },
            move |(landing, config)| {
                Coordinator::start(CoordinatorParts {
                    config,
                    topology: Rc::new(HttpTopology::new(bootstrap).with_labels(labels.clone())),
                    transport: Rc::new(ZmqTransport::new(zmq).with_labels(labels)),
                    landing,
                    events: sink,
                    builtin_pool,
                })
            },
        )
    }
}

/// `mooncake_protocol = "rdma"` with no backend given: this host's devices, if built with them.
fn default_rdma() -> Result<RdmaStarter, StartError> {
    #[cfg(feature = "rdma")]
    {
        let devices = crate::rdma::verbs::DeviceConfig::default();
        Ok(rdma_starter(move || {
            crate::rdma::verbs::IbvDevices::open(&devices)
        }))
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(StartError::RdmaNotBuilt)
    }
}

/// Which events the handle's stream carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Events {
    Off,
    Completions,
    All,
}

fn sink(events: Events) -> (EventSink, Option<UnboundedReceiver<KvEvent>>) {
    let (s, rx) = match events {
        Events::Off => return (EventSink::none(), None),
        Events::Completions => EventSink::completions_channel(),
        Events::All => EventSink::channel(),
    };
    (s, Some(rx))
}

/// On kvrecv's thread: hands the host the events in bursts, each burst being what the actors
/// emitted before this task's turn (a batch's completions come from one handler). Sent one by
/// one across threads, each event woke the host's thread, which read it and slept again before
/// the next: ~16 context switches per batch of 16 on the host's thread, ~2 in bursts
/// (`kvrecv bench --via handle`, docs/PERFORMANCE.md).
async fn forward_events(
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
fn forward_burst(
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
type DataStarted<T> = (T, Option<DataPlaneHandle>, Box<dyn std::any::Any>);

/// Start kvrecv's thread. The data plane (`start_data`: listeners, connections) runs on a
/// multi-thread runtime of `worker_threads`; the actors (`make`) run in an actix System on a
/// current-thread runtime of their own on kvrecv's thread, which polls their sockets itself.
/// One runtime for both made every control-plane wake-up a hop: a worker's epoll saw the
/// socket ready and woke the actors' thread.
fn spawn_worker<D, DFut, T, M>(
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
            let data_rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(worker_threads)
                .thread_name("kvrecv-io")
                // Not the control plane's CPU: a thread spawned later from its thread inherits it.
                .on_thread_start(crate::control::control_cpu::unpin_current_thread)
                .enable_all()
                .build();
            let data_rt = match data_rt {
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

/// What [`KvRecv::read_block`] reads: the host's memory (`None`: kvrecv's own, or device
/// memory) and the layout (`None` on the advanced path, whose landing is the host's).
#[derive(Default)]
struct HostBlocks {
    memory: Option<HostMemory>,
    layout: Option<crate::layout::KvLayout>,
}

/// What the handle keeps of the data plane (counters are shared atomics).
struct DataPlaneHandle {
    handshake: Arc<HandshakeStats>,
    handshake_addr: SocketAddr,
    segment_name: String,
    /// The TCP target's data server (`None` on RDMA: the NICs write, nothing is served).
    tcp: Option<TcpParts>,
}

struct TcpParts {
    stats: Arc<DataStats>,
    landing: Arc<TcpLanding>,
    data_addr: SocketAddr,
}

struct Inner {
    coord: Coordinator,
    load_failure_policy: LoadFailurePolicy,
    data: Option<DataPlaneHandle>,
    system: actix::System,
    events: Mutex<Option<UnboundedReceiver<Vec<KvEvent>>>>,
    /// Requests submitted and not yet taken by the Receiver ([`KvRecv::submit`]).
    queued: Arc<std::sync::atomic::AtomicUsize>,
    /// Resolves once kvrecv's thread stopped its actors, listeners and runtime.
    done: futures::future::Shared<oneshot::Receiver<()>>,
    /// kvrecv's thread, joined when the last handle goes.
    thread: Option<std::thread::JoinHandle<()>>,
    /// Held by a pause or a resume for its whole course: one at a time.
    sleep: tokio::sync::Mutex<()>,
    /// The host's memory and its layout, for [`KvRecv::read_block`] (`None` without host
    /// memory). Replaced by a resume on new memory, before the resume returns.
    host_blocks: std::sync::RwLock<HostBlocks>,
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
            || current.name().is_some_and(|n| n.starts_with("kvrecv-io"));
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

/// A running D worker. `Send + Sync + Clone`: every clone talks to the same worker; the worker
/// stops at [`KvRecv::shutdown`] or when the last clone is dropped (the drop then waits, a few
/// milliseconds, until kvrecv's thread and its data target stopped: nothing writes into host
/// memory after it returns).
///
/// ```no_run
/// # async fn host() -> Result<(), Box<dyn std::error::Error>> {
/// use kvrecv::embed::KvRecvBuilder;
/// let kv = KvRecvBuilder::from_kv_transfer_config(r#"{"kv_role":"kv_consumer",
///     "kv_connector_extra_config":{"kvrecv":{"layout":{"num_blocks":1024,"num_groups":1,
///       "regions":[{"layer_name":"l0","layer_index":0,"group_index":0,
///                   "block_len":16384,"kv_block_len":16384}]}}}}"#)?
///     .start()?;
/// let reply = kv.load_kv(vec![/* KvRequest { req_id, transfer_id, .. } */]).await?;
/// let step = kv.drain().await?; // once per scheduler step
/// kv.abort("req-7").await?;     // the client went away
/// # let _ = (reply, step);
/// kv.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KvRecv {
    inner: Arc<Inner>,
}

/// Counters of a running worker, for an operator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Blocks held for a fence, and the built-in pool's free count.
    pub ledger: LedgerStats,
    /// Data-plane counters (`None` for a handle started [`KvRecv::from_parts`]).
    pub data: Option<DataPlaneStats>,
}

/// Data-plane counters (a snapshot). On RDMA the NICs write without D's CPU, so only the
/// handshakes are counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataPlaneStats {
    /// The data target's transport.
    pub protocol: MooncakeProtocol,
    /// Data connections accepted.
    pub connections: u64,
    /// Bytes written into destination memory.
    pub bytes_landed: u64,
    /// Writes landed.
    pub writes_landed: u64,
    /// Late writes refused because their request was revoked (the fence at work).
    pub rejected_revoked: u64,
    /// Writes refused because no permit covered them.
    pub rejected_no_permit: u64,
    /// Writes refused because the worker was paused ([`KvRecv::pause`]).
    pub rejected_paused: u64,
    /// Writes refused because they fell outside the advertised windows.
    pub rejected_out_of_range: u64,
    /// Mooncake handshakes served (segment metadata requests and RDMA endpoint connections).
    pub handshakes: u64,
    /// Landing permits open now.
    pub live_permits: u64,
    /// Landing windows poisoned now (their writer may still write).
    pub poisoned_windows: usize,
}

/// The reply to a [`KvRecv::submit`]: await it, or check it without waiting
/// ([`LoadTicket::try_reply`]). Dropping it leaves the batch loaded (its refusals unread).
#[must_use = "a refused request never completes: read the ticket's reply"]
#[derive(Debug)]
pub struct LoadTicket {
    reply: oneshot::Receiver<LoadKvReply>,
}

impl LoadTicket {
    /// The reply if it is there; else the ticket back, to check again or await.
    pub fn try_reply(mut self) -> Result<Result<LoadKvReply, KvRecvError>, LoadTicket> {
        match self.reply.try_recv() {
            Ok(reply) => Ok(Ok(reply)),
            Err(oneshot::error::TryRecvError::Closed) => Ok(Err(KvRecvError::Stopped)),
            Err(oneshot::error::TryRecvError::Empty) => Err(self),
        }
    }
}

impl std::future::Future for LoadTicket {
    type Output = Result<LoadKvReply, KvRecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.reply)
            .poll(cx)
            .map(|r| r.map_err(|_| KvRecvError::Stopped))
    }
}

/// An asynchronous stream of [`KvEvent`]s (settles, first failures, completions, releases).
pub struct EventStream {
    bursts: UnboundedReceiver<Vec<KvEvent>>,
    /// The rest of the burst being read.
    ready: VecDeque<KvEvent>,
}

impl futures::Stream for EventStream {
    type Item = KvEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<KvEvent>> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Poll::Ready(Some(ev));
            }
            match self.bursts.poll_recv(cx) {
                Poll::Ready(Some(burst)) => self.ready = burst.into(),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl EventStream {
    /// The next event (`None` once the worker stopped).
    pub async fn recv(&mut self) -> Option<KvEvent> {
        futures::StreamExt::next(self).await
    }
}

impl KvRecv {
    /// A builder from typed configuration ([`KvRecvBuilder::new`]).
    pub fn builder(config: KvRecvConfig) -> KvRecvBuilder {
        KvRecvBuilder::new(config)
    }

    /// The advanced path behind the same handle: `make` runs on kvrecv's thread, inside its
    /// actix System, and returns the coordinator's parts (custom transport, topology, landing;
    /// they need not be `Send`). No data-plane target is started. Events go to the parts' own
    /// sink.
    pub fn from_parts<F>(make: F) -> Result<KvRecv, StartError>
    where
        F: FnOnce() -> CoordinatorParts + Send + 'static,
    {
        spawn_worker(
            LoadFailurePolicy::default(),
            1,
            None,
            HostBlocks::default(),
            || async { Ok(((), None, Box::new(()) as Box<dyn std::any::Any>)) },
            move |()| Coordinator::start(make()),
        )
    }

    /// Hand a batch over (after allocating its blocks). Refused requests come back in
    /// [`LoadKvReply::rejected`]; the rest of the batch goes on. Not cancel-safe: dropped
    /// after its first poll, the batch may or may not have been loaded (a loaded request
    /// still completes through [`KvRecv::drain`]); await it to the end.
    pub async fn load_kv(&self, requests: Vec<KvRequest>) -> Result<LoadKvReply, KvRecvError> {
        if self.inner.coord.is_paused() {
            return Err(KvRecvError::Paused);
        }
        self.inner
            .coord
            .load_kv(LoadKv { requests })
            .await
            .map_err(stopped)
    }

    /// Hand a batch over now and read its reply later: the batch is queued before this
    /// returns (batches keep the order of `submit` and [`KvRecv::load_kv`] calls); the ticket
    /// holds the reply once the batch was validated. A step-driven host (vLLM's
    /// `start_load_kv`, then `get_finished` at the next step) checks the ticket when it comes
    /// round ([`LoadTicket::try_reply`]) and is not woken for the reply, which awaiting
    /// [`KvRecv::load_kv`] costs it once per batch (`kvrecv bench --via handle`,
    /// docs/PERFORMANCE.md). A refused request never completes: read every ticket. Unlike
    /// `load_kv`, `submit` does not wait for room in kvrecv's mailbox: requests submitted and
    /// not yet taken by kvrecv count against `max_live_requests`, and a batch that would go
    /// over it is refused at once, every request as [`BatchError::Backpressure`] (its ticket
    /// holds the reply; nothing of it is loaded). Pace it with the completions, as a
    /// scheduler's step does.
    ///
    /// ```no_run
    /// # async fn host(kv: kvrecv::KvRecv, batch: Vec<kvrecv::messages::KvRequest>)
    /// # -> Result<(), kvrecv::embed::KvRecvError> {
    /// let mut ticket = kv.submit(batch);
    /// // ... the rest of the step; at the next one:
    /// ticket = match ticket.try_reply() {
    ///     Ok(reply) => {
    ///         for refused in reply?.rejected { /* give its blocks back */ let _ = refused; }
    ///         return Ok(());
    ///     }
    ///     Err(not_yet) => not_yet, // or `not_yet.await`
    /// };
    /// # let _ = ticket; Ok(()) }
    /// ```
    pub fn submit(&self, requests: Vec<KvRequest>) -> LoadTicket {
        let (reply, rx) = oneshot::channel();
        let limit = self.inner.coord.max_live;
        let queued = match Queued::try_add(&self.inner.queued, requests.len(), limit) {
            Ok(q) => q,
            Err(live) => {
                // A host that submits faster than kvrecv takes batches is told, as `load_kv`
                // tells one over the live limit, instead of growing the mailbox without end.
                let rejected = requests
                    .into_iter()
                    .map(|r| BatchError::Backpressure {
                        req_id: r.req_id,
                        live,
                        limit,
                    })
                    .collect();
                let _ = reply.send(LoadKvReply {
                    rejected,
                    ..LoadKvReply::default()
                });
                return LoadTicket { reply: rx };
            }
        };
        // `do_send`: queued now, whatever the mailbox's fill (`send` would hold the batch in
        // its future until polled when the mailbox is full). A stopped Receiver drops the
        // message and `reply` with it: the ticket then reads `Stopped`.
        self.inner.coord.receiver.do_send(LoadKvTo {
            batch: LoadKv { requests },
            reply,
            queued,
        });
        LoadTicket { reply: rx }
    }

    /// Once per scheduler step: vLLM's `get_finished` (`finished_recving`: the blocks may be
    /// reused) and `get_block_ids_with_load_errors` (`invalid_block_ids`, or `failed_recving`
    /// for multi-group caches) in one call. A failure is never drained after its completion.
    /// It waits for nothing (kvrecv leaves the step's output where the handle takes it), so it
    /// never wakes the host's thread (one that finds nothing yields to the host's runtime once),
    /// and it is cancel-safe: in `select!` or under `timeout`, a drain dropped before it
    /// returned took nothing.
    pub async fn drain(&self) -> Result<StepOutput, KvRecvError> {
        self.inner.coord.drain().await.map_err(stopped)
    }

    /// Stop waiting for `req_id` (the client went away). P still has its block addresses, so
    /// each peer that owes it settles it ("aborted by the host") on P's answer, which proves P
    /// stopped writing (its landing window stays in rotation), or Uncertain if no answer came
    /// within [`KvRecvConfig::abort_grace`](crate::config::KvRecvConfig::abort_grace) once its
    /// pull owed nothing else (fenced: the window poisoned). The request fails either way, and
    /// its blocks appear in `finished_recving` only once no peer can write into them - never
    /// early. A request still in its bootstrap lookup is never sent: it completes Failed at
    /// once. Aborting an unknown or completed request does nothing.
    pub async fn abort(&self, req_id: &str) -> Result<AbortReply, KvRecvError> {
        self.inner
            .coord
            .receiver
            .send(Abort {
                req_id: ReqId::from(req_id),
            })
            .await
            .map_err(stopped)
    }

    /// Sleep mode (vLLM 0.33's `unregister_kv_caches`; DESIGN.md §7): take kvrecv off the
    /// destination memory. Admission closes at once (a later `load_kv` fails with
    /// [`KvRecvError::Paused`], a submitted request is refused as [`BatchError::Paused`]);
    /// every request holding blocks is aborted ([`KvRecv::abort`]: it settles on P's answer,
    /// or Uncertain after `abort_grace`) and no request survives: each completes failed
    /// ("aborted by the host") and reaches [`KvRecv::drain`] as usual. This resolves once every
    /// block is released (fenced, or at the last-resort deadline, never early), then closes
    /// the landing: TCP refuses every write (`paused`), RDMA deregisters every landing window
    /// and publishes an empty descriptor. From its return until [`KvRecv::resume`] nothing
    /// lands, and the host may release or reuse the memory. The report lists the requests
    /// it waited for and how each one's blocks came back. Pauses and resumes are serialised.
    /// Dropped midway, admission stays closed: call it again (it is idempotent).
    pub async fn pause(&self) -> Result<PauseReport, PauseError> {
        let _one = self.inner.sleep.lock().await;
        let started = self
            .inner
            .coord
            .block_manager
            .send(BeginPause)
            .await
            .map_err(|_| PauseError::Stopped)?;
        tracing::info!(
            holders = started.holders.len(),
            "pause: aborting the requests that hold blocks"
        );
        for req_id in started.holders {
            // One that already completed (quarantined) ignores it.
            self.inner
                .coord
                .receiver
                .send(Abort { req_id })
                .await
                .map_err(|_| PauseError::Stopped)?;
        }
        let report = started.report.await.map_err(|_| PauseError::Stopped)?;
        self.on_landing(|l| l.pause()).await?;
        tracing::info!(
            abandoned = report.abandoned.len(),
            "paused: no block held, the landing admits nothing"
        );
        Ok(report)
    }

    /// Wake from [`KvRecv::pause`]: the landing admits again (RDMA: windows registered at
    /// fresh IOVA slots, with fresh rkeys), pulls carry layout ids of a new nonce (P learns
    /// the layout again), and admission reopens. With [`ResumeMemory::Same`] the memory must
    /// be valid again before this is called; with [`ResumeMemory::Host`] writes land in the
    /// new regions from now on (TCP: the data server's memory is swapped; RDMA: windows are
    /// registered on the new regions) and the old memory may be freed once this returned.
    /// On an error the worker stays paused.
    pub async fn resume(&self, memory: ResumeMemory) -> Result<(), PauseError> {
        let _one = self.inner.sleep.lock().await;
        if !self.inner.coord.block_manager.connected() {
            return Err(PauseError::Stopped);
        }
        if !self.inner.coord.is_paused() {
            return Err(PauseError::NotPaused);
        }
        match memory {
            ResumeMemory::Same => self.on_landing(|l| l.resume()).await?,
            ResumeMemory::Host(host) => {
                let kept = host.clone();
                self.on_landing(move |l| l.resume_on(&host))
                    .await
                    .map_err(|e| match e {
                        PauseError::Landing(LandingPauseError::DoesNotFit(e)) => e.into(),
                        PauseError::Landing(LandingPauseError::Unsupported(why)) => {
                            PauseError::NewMemoryUnsupported(why)
                        }
                        e => e,
                    })?;
                // `read_block` reads the new memory from now on: the host may free the old
                // once this returns (the write lock waits for a copy from the old in flight).
                self.inner
                    .host_blocks
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .memory = Some(kept);
            }
        }
        self.inner
            .coord
            .receiver
            .send(NewRegistration)
            .await
            .map_err(|_| PauseError::Stopped)?;
        self.inner.coord.reopen_admission();
        tracing::info!("resumed: admitting requests again");
        Ok(())
    }

    /// Whether the worker is paused (or pausing): admission is closed.
    pub fn is_paused(&self) -> bool {
        self.inner.coord.is_paused()
    }

    /// Close or reopen the landing off the runtime's workers (RDMA's are firmware calls).
    async fn on_landing(
        &self,
        f: impl FnOnce(&dyn Landing) -> Result<(), LandingPauseError> + Send + 'static,
    ) -> Result<(), PauseError> {
        let landing = Arc::clone(&self.inner.coord.landing);
        if tokio::runtime::Handle::try_current().is_err() {
            return Ok(f(&*landing)?);
        }
        tokio::task::spawn_blocking(move || f(&*landing))
            .await
            .unwrap_or_else(|e| Err(LandingPauseError::Failed(format!("task failed: {e}"))))?;
        Ok(())
    }

    /// The event stream. There is one: the first call takes it.
    pub fn events(&self) -> Result<EventStream, KvRecvError> {
        self.inner
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|bursts| EventStream {
                bursts,
                ready: VecDeque::new(),
            })
            .ok_or(KvRecvError::NoEvents)
    }

    /// Counters for an operator.
    pub async fn stats(&self) -> Result<Stats, KvRecvError> {
        let ledger = self
            .inner
            .coord
            .block_manager
            .send(GetLedgerStats)
            .await
            .map_err(stopped)?;
        let data = self.inner.data.as_ref().map(|d| {
            let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            let handshakes = n(&d.handshake.metadata) + n(&d.handshake.connection);
            match &d.tcp {
                Some(t) => DataPlaneStats {
                    protocol: MooncakeProtocol::Tcp,
                    connections: n(&t.stats.connections),
                    bytes_landed: n(&t.stats.bytes_landed),
                    writes_landed: n(&t.stats.writes_landed),
                    rejected_revoked: n(&t.stats.rejected_revoked),
                    rejected_no_permit: n(&t.stats.rejected_no_permit),
                    rejected_paused: n(&t.stats.rejected_paused),
                    rejected_out_of_range: n(&t.stats.rejected_out_of_range),
                    handshakes,
                    live_permits: t.landing.permits().live(),
                    poisoned_windows: t.landing.permits().poisoned_windows(),
                },
                None => DataPlaneStats {
                    protocol: MooncakeProtocol::Rdma,
                    handshakes,
                    ..DataPlaneStats::default()
                },
            }
        });
        Ok(Stats { ledger, data })
    }

    /// The segment P's transfer engine writes into (`host:port` of the handshake daemon).
    pub fn segment_name(&self) -> Option<&str> {
        self.inner.data.as_ref().map(|d| d.segment_name.as_str())
    }

    /// Where the TCP target's handshake daemon and data server listen (`None` on RDMA: see
    /// [`Self::handshake_addr`]).
    pub fn listen_addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        let d = self.inner.data.as_ref()?;
        Some((d.handshake_addr, d.tcp.as_ref()?.data_addr))
    }

    /// Where the handshake daemon listens (TCP and RDMA).
    pub fn handshake_addr(&self) -> Option<SocketAddr> {
        self.inner.data.as_ref().map(|d| d.handshake_addr)
    }

    /// vLLM's `kv_load_failure_policy` from the configuration: what the host's scheduler does
    /// with a failed load ([`LoadFailurePolicy`] says how kvrecv's signals serve each).
    pub fn load_failure_policy(&self) -> LoadFailurePolicy {
        self.inner.load_failure_policy
    }

    /// The running actors, for hosts that also talk to them directly (advanced).
    pub fn coordinator(&self) -> &Coordinator {
        &self.inner.coord
    }

    /// Stop the worker (every clone) and wait until its thread has stopped its actors and
    /// listeners. Calls after this fail with [`KvRecvError::Stopped`].
    ///
    /// The report lists the requests abandoned: each one that still held blocks when the
    /// worker stopped (in flight, or completed and held for a fence), with its blocks (per
    /// KV-cache group, ascending). `fenced`: kvrecv's own data plane is closed (TCP: its
    /// server and connections are gone; RDMA: every window deregistered), so no peer can
    /// write those blocks any more and they are the host's to reuse now. `forced` instead (a
    /// handle of [`KvRecv::from_parts`], whose landing is the host's): kvrecv could not close
    /// it, the host's landing decides when they are safe. Requests that completed and
    /// were released but not yet drained are not in it (their blocks were released: drain
    /// before shutting down to learn of them). Every clone gets the same report. A handle
    /// dropped without `shutdown` cannot report: it logs how many requests it abandoned.
    pub async fn shutdown(&self) -> PauseReport {
        self.inner.system.stop();
        // Every clone waits for the same end, however many call this.
        let _ = self.inner.done.clone().await;
        // kvrecv's threads ended: who holds which block no longer changes.
        let fenced = self.inner.data.is_some();
        PauseReport {
            abandoned: self
                .inner
                .coord
                .holdings()
                .into_iter()
                .map(|(req_id, blocks)| AbandonedRequest {
                    req_id,
                    blocks,
                    fenced,
                    forced: !fenced,
                })
                .collect(),
        }
    }

    /// Whether kvrecv's thread has ended (after [`KvRecv::shutdown`], or a start that failed
    /// later): nothing of the worker writes any more.
    fn ended(&self) -> bool {
        self.inner.done.peek().is_some()
    }

    /// A copy of `block` of KV-cache `group` from the host's memory
    /// ([`KvRecvBuilder::host_memory`]): one `Vec` per layout region of the group, in layout
    /// order, each the block's whole stride (`block_len`; its KV bytes, `kv_block_len`,
    /// first). Safe and bounds-checked: only a block no request holds is read (one the host
    /// never loaded, or one a drain handed back in `finished_recving`), and no request can
    /// take it while it is copied; a held block is refused ([`BlockReadError::Held`]). Once
    /// the worker stopped ([`KvRecv::shutdown`]) nothing writes, and any block is read. Memory
    /// given by pointer ([`crate::HostRegion::new`]) is not read while the worker is paused
    /// or after it stopped ([`BlockReadError::NotValid`]: the host may have released it).
    pub fn read_block(&self, group: u32, block: u32) -> Result<Vec<Vec<u8>>, BlockReadError> {
        let blocks = self
            .inner
            .host_blocks
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let (Some(memory), Some(layout)) = (&blocks.memory, &blocks.layout) else {
            return Err(BlockReadError::NoHostMemory);
        };
        crate::block_read::check_in_range(layout, group, block)?;
        let owned = memory
            .regions()
            .iter()
            .all(crate::rdma::memory::HostRegion::is_owned);
        // Every check under the live set's lock, which a pause takes to close admission and a
        // shutdown takes before it returns: neither completes (and lets the host release
        // memory given by pointer) while a copy runs.
        self.inner
            .coord
            .with_block_owner(group, block, |owner, paused| {
                let ended = self.ended();
                if !owned && (paused || ended) {
                    return Err(BlockReadError::NotValid);
                }
                match owner {
                    Some(req_id) if !ended => Err(BlockReadError::Held {
                        group,
                        block,
                        req_id: req_id.clone(),
                    }),
                    _ => copy_block(memory, layout, group, block),
                }
            })
    }
}

impl std::fmt::Debug for KvRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRecv")
            .field("listen", &self.listen_addrs())
            .finish()
    }
}

/// The unspecified IPv4 address, for [`KvRecvBuilder::bind`] on every interface.
#[cfg(test)]
const ANY_IPV4: IpAddr = IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync_clone<T: Send + Sync + Clone + 'static>() {}

    fn released(id: &str) -> KvEvent {
        KvEvent::Released {
            req_id: ReqId::from(id),
            blocks: vec![],
            fenced: true,
            forced: false,
        }
    }

    fn id(ev: &KvEvent) -> &str {
        match ev {
            KvEvent::Released { req_id, .. } => req_id,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn once_the_host_dropped_its_stream_events_are_no_longer_queued() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        let (sink_tx, rx) = unbounded_channel();
        let (tx, bursts) = unbounded_channel();
        drop(bursts);
        // kvrecv's thread keeps a reference too (for the flush after a stop).
        let rx = Rc::new(RefCell::new(rx));
        let kept = rx.clone();
        let forwarder = local.spawn_local(forward_events(rx, tx));
        sink_tx.send(released("r0")).unwrap();
        local.block_on(&rt, forwarder).unwrap();
        assert!(
            sink_tx.send(released("r1")).is_err(),
            "the actors' channel is closed: later events are dropped, not kept"
        );
        assert!(kept.borrow_mut().try_recv().is_err(), "nothing queued");
    }

    #[test]
    fn a_burst_is_everything_queued_in_order_and_stops_once_the_host_is_gone() {
        let (sink_tx, mut rx) = unbounded_channel();
        let (tx, mut bursts) = unbounded_channel();
        for i in 1..4 {
            sink_tx.send(released(&format!("r{i}"))).unwrap();
        }
        assert!(forward_burst(released("r0"), &mut rx, &tx));
        let burst = bursts.try_recv().expect("one burst");
        let ids: Vec<&str> = burst.iter().map(id).collect();
        assert_eq!(ids, ["r0", "r1", "r2", "r3"]);
        assert!(bursts.try_recv().is_err(), "one burst, not one per event");
        drop(bursts);
        assert!(
            !forward_burst(released("r4"), &mut rx, &tx),
            "the host dropped the stream"
        );
    }

    #[test]
    fn the_handle_is_send_sync_clone() {
        assert_send_sync_clone::<KvRecv>();
    }

    #[test]
    fn a_wildcard_bind_needs_an_advertised_host() {
        let cfg = KvRecvConfig {
            layout: crate::layout::KvLayout::uniform(1, 64, 4),
            ..KvRecvConfig::default()
        };
        let e = KvRecvBuilder::new(cfg.clone())
            .bind(ANY_IPV4)
            .start()
            .unwrap_err();
        assert!(matches!(e, StartError::NoAdvertiseHost(_)), "{e}");
        let kv = KvRecvBuilder::new(cfg)
            .bind(ANY_IPV4)
            .advertise_host("127.0.0.1")
            .start()
            .unwrap();
        assert_eq!(
            kv.segment_name().map(|s| s.starts_with("127.0.0.1:")),
            Some(true)
        );
    }
}
