//! [`KvRecvBuilder`]: the one wiring path of a D worker (data target, control plane,
//! coordinator). [`KvRecvBuilder::start`] runs it on kvrecv's own thread; `kvrecv serve` runs
//! the same wiring on threads of its own ([`Wiring`]).

#![forbid(unsafe_code)]


use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::Arc;


use tokio::sync::mpsc::UnboundedReceiver;

use futures::future::LocalBoxFuture;

use super::worker::{spawn_worker, DataPlaneHandle, DataStarted, HostBlocks, TcpParts};
use super::{KvRecv, StartError};
use crate::actors::{Coordinator, CoordinatorParts, EventSink};
use crate::config::{KvRecvConfig, MooncakeProtocol};
use crate::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use crate::messages::KvEvent;
use crate::rdma::handshake_daemon::HandshakeStats;
use crate::rdma::memory::{DeviceMemory, HostMemory};
#[cfg(any(feature = "rdma", feature = "testing"))]
use crate::rdma::verbs::{RdmaTarget, VerbsBackend, VerbsError};
use crate::rdma::verbs::{PeerBinding, RdmaTargetConfig};
use crate::rdma::{Landing, TargetConfig, TcpTarget};

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
    rdma_handshake: crate::rdma::verbs::RdmaHandshakeConfig,
    rdma_windows: usize,
    peer_binding: PeerBinding,
    /// What a [`Self::target`] closure changed that is not its to change (start refuses it).
    target_conflict: Option<&'static str>,
    /// The host named the advertised host ([`Self::advertise_host`], or in [`Self::target`]):
    /// [`Self::bind`] leaves it, whichever came first.
    advertise_given: bool,
    /// `kvrecv bench`'s control-plane-only worker: land here, start no data target.
    #[cfg(feature = "cli")]
    landing: Option<Arc<dyn Landing>>,
    /// `kvrecv bench`'s own sink (events stamped as emitted), instead of the handle's stream.
    #[cfg(feature = "cli")]
    sink: Option<EventSink>,
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
    descriptor: crate::messages::handshake::SegmentDescriptor,
    /// The first live window's region bases (what a `ready` line advertises).
    region_bases: Vec<u64>,
    /// Landing windows registered.
    windows: usize,
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
            let landing = target.landing();
            let live = landing.live_windows();
            let region_bases = live
                .first()
                .and_then(|w| landing.window_bases(*w))
                .map(|b| b.to_vec())
                .unwrap_or_default();
            Ok(RdmaStarted {
                descriptor: target.descriptor(),
                region_bases,
                windows: live.len(),
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
            target_conflict: None,
            advertise_given: false,
            #[cfg(feature = "cli")]
            landing: None,
            #[cfg(feature = "cli")]
            sink: None,
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
        if !self.advertise_given {
            // A wildcard address is not reachable: the host must say what P reaches.
            self.target.advertise_host = if ip.is_unspecified() {
                String::new()
            } else {
                ip.to_string()
            };
        }
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
        self.advertise_given = true;
        self
    }

    /// Land every write in the host's own KV regions (one per layout region, in layout order):
    /// kvrecv allocates no KV memory. Memory handed over ([`HostMemory::owned`]) has no
    /// contract; regions given by pointer keep
    /// [`HostRegion::new`](crate::rdma::memory::HostRegion::new)'s until [`KvRecv::shutdown`]
    /// returned (or the last handle was dropped and kvrecv's thread ended). One memory, one
    /// worker: memory another worker holds is refused at start ([`MemoryError::InUse`](crate::MemoryError::InUse)).
    pub fn host_memory(mut self, memory: HostMemory) -> Self {
        self.target.host_memory = Some(memory);
        self
    }

    /// Land every write in the host's own CUDA device regions (feature `cuda`; one per layout
    /// region): kvrecv allocates no KV memory. Over TCP, payloads go through bounded page-locked
    /// staging and kvrecv's own CUDA streams, each copy complete before the write counts as
    /// landed; over RDMA, the regions are registered with the NIC through GPUDirect RDMA
    /// (dma-buf, else nvidia-peermem). The regions are checked with the driver at start.
    /// Contract: [`DeviceRegion::new`](crate::rdma::memory::DeviceRegion::new). Without the feature, a driver, or
    /// (RDMA) GPUDirect support, [`KvRecvBuilder::start`] fails with a typed error.
    pub fn device_memory(mut self, memory: DeviceMemory) -> Self {
        self.target.device_memory = Some(memory);
        self
    }

    /// Adjust the data-plane target further (windows, idle timeout, caps, bind addresses). Its
    /// layout is always the configuration's, and its memory the builder's
    /// ([`Self::host_memory`], [`Self::device_memory`]): a closure that changes either makes
    /// [`Self::start`] fail with [`StartError::TargetConflict`], rather than one call silently
    /// undoing another.
    pub fn target(mut self, f: impl FnOnce(&mut TargetConfig)) -> Self {
        let (host, device, advertised) = (
            self.target.host_memory.clone(),
            self.target.device_memory.clone(),
            self.target.advertise_host.clone(),
        );
        f(&mut self.target);
        self.advertise_given |= self.target.advertise_host != advertised;
        let t = &self.target;
        let conflict = if t.layout != self.config.layout {
            Some("the layout (it is KvRecvConfig::layout's)")
        } else if !same(&host, &t.host_memory, HostMemory::same) {
            Some("the host memory (set it with KvRecvBuilder::host_memory)")
        } else if !same(&device, &t.device_memory, DeviceMemory::same) {
            Some("the device memory (set it with KvRecvBuilder::device_memory)")
        } else {
            None
        };
        self.target_conflict = self.target_conflict.or(conflict);
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
    /// server's listener run there; the data connections have threads of their own,
    /// [`TargetConfig::data_threads`], and the actors one). Default 2.
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
    pub fn rdma_devices(mut self, devices: crate::rdma::verbs::RdmaDeviceConfig) -> Self {
        self.rdma = Some(rdma_starter(move || {
            crate::rdma::verbs::IbvDevices::open(&devices)
        }));
        self.config.mooncake_protocol = MooncakeProtocol::Rdma;
        self
    }

    /// Queue-pair settings of the RDMA target: QPs per endpoint, MTU cap, traffic class and
    /// service level (default: Mooncake's defaults, QoS 0).
    pub fn rdma_handshake(mut self, handshake: crate::rdma::verbs::RdmaHandshakeConfig) -> Self {
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

    /// Land in `landing` and start no data target (`kvrecv bench`: the control plane alone).
    #[cfg(feature = "cli")]
    pub(crate) fn landing(mut self, landing: Arc<dyn Landing>) -> Self {
        self.landing = Some(landing);
        self
    }

    /// Send the actors' events to `sink` (`kvrecv bench`'s stamped channel); the handle then
    /// has no event stream.
    #[cfg(feature = "cli")]
    pub(crate) fn event_sink(mut self, sink: EventSink) -> Self {
        self.sink = Some(sink);
        self
    }

    /// The effective configuration.
    pub fn config(&self) -> &KvRecvConfig {
        &self.config
    }

    /// Bind, start kvrecv's thread and the worker on it. Returns once both listeners are bound.
    pub fn start(self) -> Result<KvRecv, StartError> {
        let Wiring {
            data,
            control,
            events,
            host_blocks,
            worker_threads,
        } = self.wire()?;
        let load_failure_policy = control.config.load_failure_policy;
        spawn_worker(
            load_failure_policy,
            worker_threads,
            events,
            host_blocks,
            move || data.start(),
            move |landing| control.coordinator(landing).0,
        )
    }

    /// Check the configuration and split it into what starts the data target and what makes
    /// the coordinator: [`Self::start`] runs both on kvrecv's thread, `kvrecv serve` on its
    /// own threads (the same wiring, one path).
    pub(crate) fn wire(self) -> Result<Wiring, StartError> {
        if let Some(what) = self.target_conflict {
            return Err(StartError::TargetConflict(what));
        }
        self.config.validate()?;
        if self.target.advertise_host.is_empty() {
            return Err(StartError::NoAdvertiseHost(self.target.data_bind.ip()));
        }
        if !is_host_name(&self.target.advertise_host) {
            return Err(StartError::BadAdvertiseHost(self.target.advertise_host));
        }
        if self.zmq.max_sockets < 1 {
            return Err(StartError::Config(crate::config::ConfigError::Zero {
                key: "ZmqTransportConfig::max_sockets",
            }));
        }
        let KvRecvBuilder {
            mut config,
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
            target_conflict: _,
            advertise_given: _,
            #[cfg(feature = "cli")]
            landing,
            #[cfg(feature = "cli")]
            sink: custom_sink,
        } = self;
        #[cfg(not(feature = "cli"))]
        let (landing, custom_sink) = (None, None);
        if config.engine_id.is_empty() {
            // As vLLM names an engine without an id; never one shared `engine=""` label.
            config.engine_id = uuid::Uuid::new_v4().to_string();
        }
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
        let (sink, events) = match custom_sink {
            Some(s) => (s, None),
            None => sink(events),
        };
        Ok(Wiring {
            data: DataWiring {
                landing,
                layout: config.layout.clone(),
                target,
                rdma,
                rdma_handshake,
                rdma_windows,
                peer_binding,
            },
            control: ControlWiring {
                config,
                labels,
                bootstrap,
                zmq,
                sink,
                builtin_pool,
            },
            events,
            host_blocks,
            worker_threads,
        })
    }
}

/// A worker's wiring, checked and ready to run ([`KvRecvBuilder::wire`]).
pub(crate) struct Wiring {
    /// Starts the data target (on a data runtime).
    pub(crate) data: DataWiring,
    /// Makes the coordinator (inside an actix System).
    pub(crate) control: ControlWiring,
    /// The actors' events, when the builder kept them.
    pub(crate) events: Option<UnboundedReceiver<KvEvent>>,
    /// What [`KvRecv::read_block`] reads.
    pub(crate) host_blocks: HostBlocks,
    /// Worker threads of the data runtime.
    pub(crate) worker_threads: usize,
}

/// What starts the data target: kvrecv's TCP target, or the RDMA one.
pub(crate) struct DataWiring {
    /// A landing given instead of a data target (`kvrecv bench`).
    landing: Option<Arc<dyn Landing>>,
    layout: crate::layout::KvLayout,
    target: TargetConfig,
    rdma: Option<RdmaStarter>,
    rdma_handshake: crate::rdma::verbs::RdmaHandshakeConfig,
    rdma_windows: usize,
    peer_binding: PeerBinding,
}

impl DataWiring {
    /// Start the data target on the current (data) runtime: the core's view of it, the
    /// handle's, and what must live until the worker stops. Its tasks keep running on the
    /// runtime's workers after this returns.
    pub(crate) async fn start(self) -> Result<DataStarted<Arc<dyn Landing>>, StartError> {
        let DataWiring {
            landing,
            layout,
            target,
            rdma,
            rdma_handshake,
            rdma_windows,
            peer_binding,
        } = self;
        if let Some(landing) = landing {
            return Ok((landing, None, Box::new(())));
        }
        let Some(start_rdma) = rdma else {
            let tcp = TcpTarget::start(target).await?;
            let landing = tcp.landing();
            let map = landing.permits().map();
            let data = DataPlaneHandle {
                handshake: tcp.handshake_stats().clone(),
                handshake_addr: tcp.handshake_addr(),
                segment_name: tcp.segment_name().to_owned(),
                descriptor: tcp.descriptor().clone(),
                region_bases: map.region_bases(0).to_vec(),
                windows: map.windows() as usize,
                tcp: Some(TcpParts {
                    stats: tcp.stats().clone(),
                    landing: landing.clone(),
                    data_addr: tcp.data_addr(),
                }),
            };
            return Ok((landing, Some(data), Box::new(tcp)));
        };
        let r = start_rdma(RdmaTargetConfig {
            handshake_bind: target.handshake_bind,
            advertise_host: target.advertise_host.clone(),
            host_memory: target.host_memory.clone(),
            handshake: rdma_handshake,
            windows: rdma_windows,
            // Registered through GPUDirect RDMA (dma-buf or nvidia-peermem); a node with
            // neither fails the start with a typed error.
            device_memory: target.device_memory.clone(),
            peer_binding,
            ..RdmaTargetConfig::loopback(layout)
        })
        .await?;
        let data = DataPlaneHandle {
            handshake: r.handshake,
            handshake_addr: r.handshake_addr,
            segment_name: r.segment_name,
            descriptor: r.descriptor,
            region_bases: r.region_bases,
            windows: r.windows,
            tcp: None,
        };
        Ok((r.landing, Some(data), r.keep))
    }
}

/// What makes the coordinator: its configuration, the HTTP bootstrap client, the ZMQ
/// transport and where events go.
pub(crate) struct ControlWiring {
    pub(crate) config: KvRecvConfig,
    /// The worker's metric labels (engine, ranks).
    pub(crate) labels: crate::telemetry::Labels,
    bootstrap: BootstrapConfig,
    zmq: ZmqTransportConfig,
    sink: EventSink,
    builtin_pool: bool,
}

impl ControlWiring {
    /// Start the coordinator on the current actix arbiter, landing in `landing`; with the CPU
    /// the control plane was pinned to. The ZMQ transport places the control plane as its
    /// configuration says (pinned only if asked).
    pub(crate) fn coordinator(self, landing: Arc<dyn Landing>) -> (Coordinator, Option<usize>) {
        let transport = ZmqTransport::new(self.zmq).with_labels(self.labels.clone());
        let cpu = transport.control_cpu();
        let coord = Coordinator::start(CoordinatorParts {
            config: self.config,
            topology: Rc::new(HttpTopology::new(self.bootstrap).with_labels(self.labels)),
            transport: Rc::new(transport),
            landing,
            events: self.sink,
            builtin_pool: self.builtin_pool,
        });
        (coord, cpu)
    }
}

/// `mooncake_protocol = "rdma"` with no backend given: this host's devices, if built with them.
fn default_rdma() -> Result<RdmaStarter, StartError> {
    #[cfg(feature = "rdma")]
    {
        let devices = crate::rdma::verbs::RdmaDeviceConfig::default();
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

/// Whether `a` and `b` are both none, or the same memory.
fn same<M>(a: &Option<M>, b: &Option<M>, eq: impl Fn(&M, &M) -> bool) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => eq(a, b),
        _ => false,
    }
}

/// Whether `host` can name this machine to P: an IP address, or a DNS name (letters, digits,
/// `-` and `.`). P resolves it itself; D only refuses what no resolver would take.
fn is_host_name(host: &str) -> bool {
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    host.parse::<IpAddr>().is_ok() || (host.len() <= 253 && host.split('.').all(label))
}
