//! kvrecv as a Mooncake TE target: registered memory, the advertised windows, landing permits,
//! the handshake daemon and the TCP data server, started together on a tokio runtime.

#![forbid(unsafe_code)]

use crate::telemetry::Labels;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::block_ownership::BlockOwnership;
use crate::layout::KvLayout;
use crate::messages::handshake::{BufferDesc, SegmentDescriptor};

use super::conn_shards::ConnShards;
use super::permits::PermitTable;
use super::server::{
    self, DataPlane, DataStats, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_DATA_CONNECTIONS,
    DEFAULT_MAX_DATA_CONNECTIONS_PER_ADDRESS,
};
use super::tcp_landing::TcpLanding;
use super::windows::{WindowError, WindowMap, DEFAULT_BASE};
use crate::rdma::audit::AuditCounters;
use crate::rdma::handshake_daemon::{
    self, Daemon, HandshakeStats, DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKES_PER_ADDRESS,
};
use crate::rdma::memory::{
    DeviceMemory, HostMemory, LandingId, MemoryError, MemoryKind, RegisteredMemory,
};

/// Default number of landing windows (epochs): pulls in flight at once, plus windows poisoned
/// by abandoned writers, plus the reserved one. Clamped to what fits below 2^53 for the layout.
pub const DEFAULT_WINDOWS: u32 = 16_384;

/// Default number of threads serving data connections ([`TargetConfig::data_threads`]): one,
/// as the Mooncake TE target's one `io_context` thread: it mostly finds each payload whole
/// (`dataplane_bench`, Rust writer: 0.76–0.84x the CPU per GiB of the two-worker runtime, the
/// floor's CPU, 0.86–0.90x the runtime's throughput at 1 MiB writes; docs/PERFORMANCE.md).
/// Raise it where a D must land more over TCP than one thread does: on the development VM one
/// landed 5.3–5.5 GB/s at 1 MiB writes where two landed 6.4 (and cost 1.2x the CPU per GiB).
pub const DEFAULT_DATA_THREADS: usize = 1;

/// How to start a target.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// The destination layout (the builder copies it from the config).
    pub layout: KvLayout,
    /// Handshake daemon listen address (port 0: any).
    pub handshake_bind: SocketAddr,
    /// Data server listen address (port 0: any).
    pub data_bind: SocketAddr,
    /// Host P must use to reach both listeners (segment name and `tcp_data_host`).
    pub advertise_host: String,
    /// Landing permits on (kvrecv) or off (upstream behaviour, for the detector tests).
    pub permits: bool,
    /// Landing windows (epochs), including the reserved one (ignored with permits off: one
    /// window). `None`: `DEFAULT_WINDOWS`, or as many as fit below 2^53 if fewer.
    pub windows: Option<u32>,
    /// The epoch rule (DESIGN.md §5): a window whose writer may still write is poisoned until
    /// the last-resort deadline. Off only to prove the rule matters (tests, `repro`).
    pub epoch_rule: bool,
    /// First advertised address (P writes to virtual addresses from here).
    pub base_addr: u64,
    /// A data connection silent for longer is closed.
    pub idle_timeout: Duration,
    /// What kvrecv allocates when `host_memory` is `None`.
    pub memory: MemoryKind,
    /// The host's own KV regions (one per layout region): kvrecv allocates no KV memory and
    /// lands every write in them; `memory` is then ignored.
    pub host_memory: Option<HostMemory>,
    /// The host's own CUDA device regions (one per layout region): kvrecv allocates no KV
    /// memory; TCP payloads reach them through a bounded staging buffer. Wins over
    /// `host_memory` and `memory`.
    pub device_memory: Option<DeviceMemory>,
    /// Open data connections at most (default `DEFAULT_MAX_DATA_CONNECTIONS`); more are
    /// closed at accept and counted (`kvrecv_connections_refused_total`).
    pub max_data_connections: usize,
    /// Open data connections from one peer address at most (default
    /// `DEFAULT_MAX_DATA_CONNECTIONS_PER_ADDRESS`, clamped to `max_data_connections`).
    pub max_data_connections_per_address: usize,
    /// Handshake connections open at most (default `DEFAULT_MAX_HANDSHAKES`); same treatment.
    pub max_handshakes: usize,
    /// Handshake connections from one peer address at most (default
    /// `DEFAULT_MAX_HANDSHAKES_PER_ADDRESS`, clamped to `max_handshakes`).
    pub max_handshakes_per_address: usize,
    /// Labels of the target's metrics: the coordinator's (engine, ranks), so two targets in one
    /// process keep distinct series. Set by the builder (from the configuration); not the
    /// host's to choose.
    pub(crate) labels: Labels,
    /// Answer the TE protocol's READ requests. Off by default: vLLM's P only writes into D, and
    /// nothing authenticates the data port, so a READ would let anyone who reaches it read the
    /// blocks of a pull in flight. Interop tests turn it on to read back what landed.
    pub serve_reads: bool,
    /// Threads that serve data connections (at least one; default one, see docs/PERFORMANCE.md,
    /// "One thread for the data connections"), each a current-thread runtime of kvrecv's own;
    /// a connection stays on the one that had the fewest when it came. `kvrecv serve
    /// --data-threads`.
    pub data_threads: usize,
}

impl TargetConfig {
    /// Loopback listeners on ephemeral ports, permits on, host memory.
    pub fn loopback(layout: KvLayout) -> Self {
        let lo: SocketAddr = ([127, 0, 0, 1], 0).into();
        TargetConfig {
            layout,
            handshake_bind: lo,
            data_bind: lo,
            advertise_host: "127.0.0.1".into(),
            permits: true,
            windows: None,
            epoch_rule: true,
            base_addr: DEFAULT_BASE,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            memory: MemoryKind::Host,
            host_memory: None,
            device_memory: None,
            max_data_connections: DEFAULT_MAX_DATA_CONNECTIONS,
            max_data_connections_per_address: DEFAULT_MAX_DATA_CONNECTIONS_PER_ADDRESS,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_address: DEFAULT_MAX_HANDSHAKES_PER_ADDRESS,
            labels: Labels::default(),
            serve_reads: false,
            data_threads: DEFAULT_DATA_THREADS,
        }
    }
}

#[derive(Debug, Error)]
/// Why the data target could not start.
#[non_exhaustive]
pub enum TargetError {
    #[error("address windows: {0}")]
    /// The address windows do not fit.
    Windows(#[from] WindowError),
    #[error("destination memory: {0}")]
    /// Destination memory could not be set up.
    Memory(#[from] MemoryError),
    #[error("cannot bind {what} on {addr}: {source}")]
    /// A listener could not bind.
    Bind {
        /// Which listener.
        what: &'static str,
        /// Where.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    #[error("the descriptor ({0} bytes) exceeds the 1 MiB handshake frame cap; use fewer windows")]
    /// The segment descriptor does not fit the handshake frame.
    DescriptorTooLarge(usize),
    #[error("cannot start the data connection threads: {0}")]
    /// A thread serving data connections could not be started.
    Threads(std::io::Error),
}

/// A running target. Dropping it stops accepting connections, closes the open ones and waits
/// for their device copies in flight; after it the host's device regions are no longer reached
/// (a later copy into them fails); kvrecv's own GPU allocation still is.
pub struct TcpTarget {
    plane: Arc<DataPlane>,
    landing: Arc<TcpLanding>,
    daemon: Arc<Daemon>,
    descriptor: SegmentDescriptor,
    handshake_addr: SocketAddr,
    data_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
    /// The threads serving the data connections, stopped by the drop (the accept task holds
    /// the other reference).
    shards: Arc<ConnShards>,
}

impl std::fmt::Debug for TcpTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTarget")
            .field("handshake_addr", &self.handshake_addr)
            .field("data_addr", &self.data_addr)
            .finish()
    }
}

/// How many windows the target advertises: one with permits off, else as configured (at least
/// 2: the last is reserved), else [`DEFAULT_WINDOWS`] or as many as fit.
fn window_count(cfg: &TargetConfig) -> Result<u32, TargetError> {
    Ok(match (cfg.permits, cfg.windows) {
        (false, _) => 1,
        (true, Some(n)) => n.max(2),
        (true, None) => {
            DEFAULT_WINDOWS.min(WindowMap::max_windows(&cfg.layout, cfg.base_addr)?.max(2))
        }
    })
}

/// A listener for `what` bound at `addr`.
async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, TargetError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| TargetError::Bind { what, addr, source })
}

/// The segment descriptor the handshake daemon serves: one buffer spanning every window, the
/// data server's address; refused if it would not fit in one handshake frame.
fn tcp_descriptor(
    cfg: &TargetConfig,
    map: &WindowMap,
    handshake_port: u16,
    data_port: u16,
) -> Result<SegmentDescriptor, TargetError> {
    let name = format!("{}:{}", cfg.advertise_host, handshake_port);
    let (addr, length) = map.advertised_span();
    let descriptor = SegmentDescriptor {
        buffers: vec![BufferDesc {
            addr,
            length,
            name: name.clone(),
            ..BufferDesc::default()
        }],
        devices: vec![],
        priority_matrix: Default::default(),
        name,
        protocol: "tcp".into(),
        rdma_server_name: String::new(),
        tcp_data_host: Some(cfg.advertise_host.clone()),
        tcp_data_port: data_port,
        tcp_proto_version: 2,
        timestamp: format!(
            "{:.6}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64()
        ),
    };
    let wire_len = descriptor.to_wire().len();
    if wire_len as u64 + 1 > handshake_daemon::MAX_FRAME {
        return Err(TargetError::DescriptorTooLarge(wire_len));
    }
    Ok(descriptor)
}

impl TcpTarget {
    /// Allocate memory (unless the host registered its own), bind both listeners and start serving (needs a tokio runtime).
    pub async fn start(cfg: TargetConfig) -> Result<Self, TargetError> {
        let windows = window_count(&cfg)?;
        let map = Arc::new(WindowMap::new(&cfg.layout, cfg.base_addr, windows)?);
        let landing_id = LandingId::fresh();
        let memory = Arc::new(match (&cfg.device_memory, &cfg.host_memory) {
            (Some(d), _) => RegisteredMemory::device_owned(d.clone(), &map.region_spans())?,
            (None, Some(h)) => {
                RegisteredMemory::host_owned(h.register(landing_id)?, &map.region_spans())?
            }
            (None, None) => RegisteredMemory::new(cfg.memory, map.span())?,
        });
        let mut table = PermitTable::new(map.clone(), cfg.permits).with_labels(cfg.labels.clone());
        if !cfg.epoch_rule {
            table = table.without_epoch_rule();
        }
        let permits = Arc::new(table);
        let hs = bind("handshake daemon", cfg.handshake_bind).await?;
        let data = bind("data server", cfg.data_bind).await?;
        let bind_err = |what, addr| move |source| TargetError::Bind { what, addr, source };
        let handshake_addr = hs
            .local_addr()
            .map_err(bind_err("handshake daemon", cfg.handshake_bind))?;
        let data_addr = data
            .local_addr()
            .map_err(bind_err("data server", cfg.data_bind))?;
        let descriptor = tcp_descriptor(&cfg, &map, handshake_addr.port(), data_addr.port())?;
        let daemon = Arc::new(
            Daemon::new(&descriptor)
                .with_max_concurrent(cfg.max_handshakes)
                .with_max_per_address(cfg.max_handshakes_per_address)
                .with_labels(cfg.labels.clone()),
        );
        let plane = Arc::new(
            DataPlane::new(permits.clone(), memory, cfg.idle_timeout)
                .with_max_connections(cfg.max_data_connections)
                .with_max_per_address(cfg.max_data_connections_per_address)
                .with_reads(cfg.serve_reads),
        );
        let landing = Arc::new(
            TcpLanding::new(permits, &cfg.advertise_host, handshake_addr.port())
                .with_memory(Arc::clone(plane.memory_slot()), landing_id),
        );
        let shards = Arc::new(
            ConnShards::start(cfg.data_threads).map_err(TargetError::Threads)?,
        );
        let tasks = vec![
            tokio::spawn(handshake_daemon::serve(hs, daemon.clone())),
            tokio::spawn(server::serve(data, plane.clone(), Arc::clone(&shards))),
        ];
        tracing::info!(%handshake_addr, %data_addr, permits = cfg.permits, windows,
            epoch_rule = cfg.epoch_rule, "TE target listening");
        Ok(TcpTarget {
            plane,
            landing,
            daemon,
            descriptor,
            handshake_addr,
            data_addr,
            tasks,
            shards,
        })
    }

    /// The core's view (pass to the BlockManager and Receiver).
    pub fn landing(&self) -> Arc<TcpLanding> {
        self.landing.clone()
    }

    /// Memory, windows, permits and counters.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn plane(&self) -> &Arc<DataPlane> {
        &self.plane
    }

    /// Data server counters.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn stats(&self) -> &Arc<DataStats> {
        &self.plane.stats
    }

    /// Handshake daemon counters.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn handshake_stats(&self) -> &Arc<HandshakeStats> {
        &self.daemon.stats
    }

    /// The handshake daemon (its caps and open connections).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn daemon(&self) -> &Arc<Daemon> {
        &self.daemon
    }

    /// Turn audit mode on.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn install_audit(&self, ownership: Arc<BlockOwnership>) -> Arc<AuditCounters> {
        self.plane.install_audit(ownership)
    }

    /// The descriptor served to Metadata requests.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// Segment name P uses (`host:port` of the handshake daemon).
    pub fn segment_name(&self) -> &str {
        &self.descriptor.name
    }

    /// Where the handshake daemon listens.
    pub fn handshake_addr(&self) -> SocketAddr {
        self.handshake_addr
    }

    /// Where the data server listens.
    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }
}

impl Drop for TcpTarget {
    /// Stops accepting, then stops the connection threads and waits for them: once the drop
    /// returns no connection of this target writes (`ConnShards::stop`), and nothing of
    /// kvrecv's is left in the host's device context (the host may destroy it next).
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.shards.stop();
        self.plane.memory().close_host_device();
    }
}
