//! kvrecv as a Mooncake RDMA target, assembled: the handshake daemon in RDMA mode, host memory
//! (or the host's GPU memory, through GPUDirect RDMA) registered for the KV layout, the RDMA
//! segment descriptor, and the [`RdmaLanding`] the core uses. Generic over the verbs backend,
//! so the whole wiring runs against `FakeVerbs` in tests.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::async_events;
use super::backend::{MrAccess, VerbsBackend, VerbsError};
use super::fence::{RdmaFence, SharedHandshake};
use super::gpudirect::{DeviceMemoryExport, GpuDirectError};
use super::passive::{RdmaHandshakeConfig, PassiveHandshake};
use super::peer_binding::PeerBinding;
use super::rdma_landing::{RdmaLanding, RdmaLandingError, WindowsConfig};
use super::window_registrations::{HostSpan, WindowRegisterError};
use crate::layout::KvLayout;
use crate::messages::handshake::SegmentDescriptor;
use crate::rdma::handshake_daemon::{self, Daemon, HandshakeStats};
use crate::rdma::memory::{DeviceMemory, DeviceRegion, HostMemory, LandingId, OwnedBytes};

/// How to start an RDMA target.
#[derive(Debug, Clone)]
pub struct RdmaTargetConfig {
    pub layout: KvLayout,
    /// Handshake daemon listen address (port 0: any).
    pub handshake_bind: SocketAddr,
    /// Host P must use to reach the daemon (the host part of the segment name).
    pub advertise_host: String,
    pub handshake: RdmaHandshakeConfig,
    /// Descriptor buffer name of the host memory (`cpu:<numa node>`).
    pub location: String,
    pub access: MrAccess,
    /// The host's own KV regions (one per layout region, layout order): registered in place,
    /// one descriptor buffer each, and kvrecv allocates no KV memory. `None`: one kvrecv-owned
    /// buffer holding every region back to back.
    pub host_memory: Option<HostMemory>,
    /// The host's own CUDA device regions (one per layout region, layout order): registered in
    /// place through GPUDirect RDMA (dma-buf, else nvidia-peermem), one `cuda:<ordinal>`
    /// descriptor buffer each; P writes straight into GPU memory. Wins over `host_memory`.
    pub device_memory: Option<DeviceMemory>,
    /// The GPU side of that registration; `None`: CUDA's (feature `cuda`), which checks the
    /// regions with the driver and exports dma-bufs. Tests pass a fake.
    pub device_export: Option<Arc<dyn DeviceMemoryExport>>,
    /// How the fence finds a peer's segments (by host unless told otherwise).
    pub peer_binding: PeerBinding,
    /// Landing windows kept registered (DESIGN.md §5: one per P host while they last).
    pub windows: usize,
    /// First IOVA slot; `None` draws one at random (tests fix it).
    pub first_slot: Option<u32>,
}

impl RdmaTargetConfig {
    /// Loopback daemon on an ephemeral port, Mooncake's defaults, host memory on `cpu:0`.
    pub fn loopback(layout: KvLayout) -> Self {
        RdmaTargetConfig {
            layout,
            handshake_bind: ([127, 0, 0, 1], 0).into(),
            advertise_host: "127.0.0.1".into(),
            handshake: RdmaHandshakeConfig::default(),
            location: "cpu:0".into(),
            access: MrAccess::default(),
            host_memory: None,
            device_memory: None,
            device_export: None,
            peer_binding: PeerBinding::default(),
            windows: WindowsConfig::default().windows,
            first_slot: None,
        }
    }
}

/// Why the RDMA target could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RdmaTargetError {
    /// The handshake daemon's listener.
    #[error("cannot bind the handshake daemon on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS's refusal.
        source: std::io::Error,
    },
    /// The layout does not fit the advertised address space.
    #[error("the KV layout needs more bytes than this host can address")]
    LayoutTooLarge,
    /// Checked before anything is registered, so a refused start leaves no registration.
    #[error("host regions: {0}")]
    HostRegions(String),
    /// Device memory that cannot be registered with the NIC (or fails the driver's checks).
    #[error("GPUDirect RDMA: {0}")]
    GpuDirect(#[from] GpuDirectError),
    /// A registration failed (RLIMIT_MEMLOCK, or another verbs failure).
    #[error("memory registration: {0}")]
    Register(#[from] VerbsError),
    /// The landing windows could not be set up.
    #[error("landing: {0}")]
    Landing(#[from] RdmaLandingError),
    /// The host memory is refused ([`MemoryError::InUse`](crate::MemoryError::InUse): another worker holds it).
    #[error("{0}")]
    Memory(#[from] crate::rdma::memory::MemoryError),
}

/// A running RDMA target. Dropping it stops the daemon and deregisters the memory (a buffer
/// whose deregistration fails is leaked, never freed).
pub struct RdmaTarget<B: VerbsBackend + 'static> {
    handshake: SharedHandshake<B>,
    /// kvrecv's own destination memory (`None` with the host's regions). Leaked, never freed,
    /// if a window cannot be deregistered. Held as a raw pointer, never a `Box`: the NIC
    /// writes it while the target runs.
    owned: Option<OwnedBytes>,
    landing: Arc<RdmaLanding<B>>,
    daemon: Arc<Daemon>,
    segment: String,
    handshake_addr: SocketAddr,
    task: JoinHandle<()>,
    /// Reads the devices' async events (`async_events::watch`).
    events_task: JoinHandle<()>,
    /// How many async events were handled so far.
    async_events: Arc<watch::Sender<u64>>,
}

impl<B: VerbsBackend + 'static> std::fmt::Debug for RdmaTarget<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTarget")
            .field("handshake_addr", &self.handshake_addr)
            .field("segment", &self.segment)
            .finish()
    }
}

impl<B: VerbsBackend + 'static> RdmaTarget<B> {
    /// Bind the daemon, register on every device of `backend` the host's regions (with
    /// `host_memory`) or else one kvrecv-owned buffer holding every layout region back to back,
    /// build the descriptor and start serving (needs a tokio runtime).
    pub async fn start(backend: B, cfg: RdmaTargetConfig) -> Result<Self, RdmaTargetError> {
        let (listener, handshake_addr) = bind_handshake(&cfg).await?;
        let name = format!("{}:{}", cfg.advertise_host, handshake_addr.port());
        let handshake: SharedHandshake<B> = Arc::new(Mutex::new(PassiveHandshake::new(
            backend,
            name.clone(),
            cfg.handshake.clone(),
        )));
        let len = layout_bytes(&cfg.layout).ok_or(RdmaTargetError::LayoutTooLarge)?;
        let device = match &cfg.device_memory {
            Some(dev) => Some(device_regions(&cfg, dev)?),
            None => None,
        };
        if let (None, Some(host)) = (&device, &cfg.host_memory) {
            check_host_regions(&cfg.layout, host)?;
        }
        // The kernel charges every registration of the same pages again: one per window.
        // Device memory is pinned by the GPU driver, not charged to RLIMIT_MEMLOCK.
        let bytes_per_nic = match (&device, &cfg.host_memory) {
            (Some(_), _) => 0,
            (None, Some(host)) => host.regions().iter().map(|r| r.len() as u64).sum(),
            (None, None) => len as u64,
        };
        handshake
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .backend_mut()
            .ensure_memlock(bytes_per_nic.saturating_mul(cfg.windows.max(1) as u64))?;
        // kvrecv's own buffer, or nothing when the host gave its regions.
        let owned = match (&device, &cfg.host_memory) {
            (None, None) => Some(OwnedBytes::zeroed(len)),
            _ => None,
        };
        // The host's regions, registered for this target before any window is on them: those
        // kvrecv owns (`HostRegion::owned`) are freed only after their deregistration (the
        // landing keeps the registration), and leaked like `owned` if it fails.
        let registration = match (&device, &cfg.host_memory) {
            (None, Some(host)) => Some(host.register(LandingId::fresh())?),
            _ => None,
        };
        let spans = destination_spans(&cfg, device.as_ref().map(|d| d.0), owned.as_ref());
        let landing = match open_landing(
            &cfg,
            handshake_addr.port(),
            spans,
            device.as_ref(),
            &handshake,
        ) {
            Ok(l) => Arc::new(l),
            Err(e) => {
                if matches!(e, RdmaTargetError::Landing(RdmaLandingError::Leaked { .. })) {
                    // The NIC may still write them: never freed, never registered again.
                    std::mem::forget(owned);
                    std::mem::forget(registration);
                }
                return Err(e);
            }
        };
        if let Some(registration) = registration {
            landing.keep_host(registration);
        }
        let nics = handshake
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .backend()
            .nics()
            .len();
        let daemon = Arc::new(Daemon::rdma(landing.published(), Arc::clone(&handshake)));
        let task = tokio::spawn(handshake_daemon::serve(listener, Arc::clone(&daemon)));
        let async_events = Arc::new(watch::channel(0u64).0);
        let events_task = tokio::spawn(async_events::watch(
            Arc::clone(&handshake),
            Arc::clone(&async_events),
        ));
        tracing::info!(%handshake_addr, segment = %name, devices = nics, windows = cfg.windows, "RDMA target listening");
        Ok(RdmaTarget {
            handshake,
            owned,
            landing,
            daemon,
            segment: name,
            handshake_addr,
            task,
            events_task,
            async_events,
        })
    }

    /// The core's view (pass to the coordinator as its `Landing`).
    pub fn landing(&self) -> Arc<RdmaLanding<B>> {
        Arc::clone(&self.landing)
    }

    /// The passive handshake and its endpoints (shared with the daemon and the fence).
    pub fn handshake(&self) -> &SharedHandshake<B> {
        &self.handshake
    }

    /// The descriptor served to Metadata requests now (it changes when a fence retires a
    /// landing window).
    pub fn descriptor(&self) -> SegmentDescriptor {
        serde_json::from_slice(&self.landing.published().wire())
            .expect("kvrecv wrote this descriptor itself")
    }

    /// Segment name P uses (`host:port` of the handshake daemon).
    pub fn segment_name(&self) -> &str {
        &self.segment
    }

    pub fn handshake_addr(&self) -> SocketAddr {
        self.handshake_addr
    }

    /// The number of device async events handled so far (QP fatal, port down, ...: their
    /// endpoints are marked Broken), as it changes.
    pub fn async_events_handled(&self) -> watch::Receiver<u64> {
        self.async_events.subscribe()
    }

    pub fn handshake_stats(&self) -> &Arc<HandshakeStats> {
        &self.daemon.stats
    }

    /// A copy of what P wrote into kvrecv's own buffer, every layout region back to back
    /// (`None` with `host_memory`: the host reads its own regions). A copy, never a view: the
    /// NIC may write the buffer at any time while the target runs, so a block still being
    /// written may come back half old, half new.
    pub fn snapshot(&self) -> Option<Vec<u8>> {
        self.owned.as_ref().map(OwnedBytes::to_vec)
    }
}

impl<B: VerbsBackend + 'static> Drop for RdmaTarget<B> {
    fn drop(&mut self) {
        self.task.abort();
        self.events_task.abort();
        if let Err(e) = self.landing.close() {
            tracing::warn!(error = %e, "RDMA deregistration failed; buffer leaked");
            std::mem::forget(self.owned.take());
            self.landing.leak_host();
        }
    }
}

/// What a region needs, as a reason says it (`None`: more than 2^64 bytes).
fn needed_bytes(needed: Option<u64>) -> String {
    needed.map_or_else(|| "more than 2^64 bytes".into(), |n| n.to_string())
}

/// One host region per layout region, each large enough for its blocks, none overlapping.
/// The handshake daemon's listener, bound, and the address it got.
async fn bind_handshake(
    cfg: &RdmaTargetConfig,
) -> Result<(TcpListener, SocketAddr), RdmaTargetError> {
    let bind_error = |source| RdmaTargetError::Bind {
        addr: cfg.handshake_bind,
        source,
    };
    let listener = TcpListener::bind(cfg.handshake_bind)
        .await
        .map_err(bind_error)?;
    let addr = listener.local_addr().map_err(bind_error)?;
    Ok((listener, addr))
}

/// The destination bytes, one span per layout region: the host's device regions, else the
/// host's regions, else kvrecv's own buffer cut in layout order.
fn destination_spans(
    cfg: &RdmaTargetConfig,
    device: Option<&[DeviceRegion]>,
    owned: Option<&OwnedBytes>,
) -> Vec<HostSpan> {
    match (device, &cfg.host_memory, owned) {
        (Some(regions), _, _) => regions.iter().map(|r| (r.ptr(), r.len())).collect(),
        (None, Some(host), _) => host
            .regions()
            .iter()
            .map(|r| (r.as_ptr() as u64, r.len() as u64))
            .collect(),
        (None, None, Some(buf)) => {
            let base = buf.as_ptr() as u64;
            let mut at = 0u64;
            cfg.layout
                .regions
                .iter()
                .map(|r| {
                    let n = r.block_len * u64::from(cfg.layout.num_blocks);
                    let span = (base + at, n);
                    at += n;
                    span
                })
                .collect()
        }
        (None, None, None) => unreachable!("allocated when the host gave no memory"),
    }
}

/// Register `spans` in every window on every device and build the landing over them.
fn open_landing<B: VerbsBackend + 'static>(
    cfg: &RdmaTargetConfig,
    handshake_port: u16,
    spans: Vec<HostSpan>,
    device: Option<&(&[DeviceRegion], Arc<dyn DeviceMemoryExport>)>,
    handshake: &SharedHandshake<B>,
) -> Result<RdmaLanding<B>, RdmaTargetError> {
    RdmaLanding::new(
        cfg.advertise_host.clone(),
        handshake_port,
        &cfg.layout,
        spans,
        WindowsConfig {
            windows: cfg.windows,
            location: match device {
                Some((regions, _)) => format!("cuda:{}", regions[0].ordinal()),
                None => cfg.location.clone(),
            },
            access: cfg.access,
            first_slot: cfg.first_slot,
            device: device.map(|(_, export)| Arc::clone(export)),
        },
        Arc::clone(handshake),
        RdmaFence::with_binding(Arc::clone(handshake), cfg.peer_binding),
    )
    .map_err(|e| match e {
        // Device memory the NIC cannot take: say so as GPUDirect's error, not a window's.
        RdmaLandingError::Register {
            error: WindowRegisterError::GpuDirect(g),
            ..
        } => RdmaTargetError::GpuDirect(g),
        e => RdmaTargetError::Landing(e),
    })
}

fn check_host_regions(layout: &KvLayout, host: &HostMemory) -> Result<(), RdmaTargetError> {
    let needed: Option<Vec<u64>> = layout
        .regions
        .iter()
        .map(|l| l.block_len.checked_mul(u64::from(layout.num_blocks)))
        .collect();
    let needed = needed.ok_or(RdmaTargetError::LayoutTooLarge)?;
    crate::rdma::memory_fit::check_fit(host, &needed)
        .map_err(|e| RdmaTargetError::HostRegions(e.to_string()))
}

/// The host's device regions, one per layout region and each large enough, and the GPU side
/// that registers them (the configured one, else CUDA's, which checks them with the driver).
fn device_regions<'a>(
    cfg: &RdmaTargetConfig,
    dev: &'a DeviceMemory,
) -> Result<(&'a [DeviceRegion], Arc<dyn DeviceMemoryExport>), RdmaTargetError> {
    let regions = dev.regions().ok_or_else(|| {
        GpuDirectError::Regions("a fake device cannot be registered with a NIC".into())
    })?;
    let layout = &cfg.layout;
    if regions.len() != layout.regions.len() {
        return Err(GpuDirectError::Regions(format!(
            "{} regions for a layout of {}",
            regions.len(),
            layout.regions.len()
        ))
        .into());
    }
    let mut used = Vec::with_capacity(regions.len());
    for (i, (d, l)) in regions.iter().zip(&layout.regions).enumerate() {
        let needed = l.block_len.checked_mul(u64::from(layout.num_blocks));
        match needed {
            Some(n) if d.len() >= n => used.push((d.ptr(), n)),
            _ => {
                return Err(GpuDirectError::Regions(format!(
                    "region {i} has {} bytes, the layout needs {}",
                    d.len(),
                    needed_bytes(needed)
                ))
                .into())
            }
        }
        if d.ordinal() != regions[0].ordinal() {
            return Err(GpuDirectError::Regions(format!(
                "region {i} is on GPU {}, region 0 on GPU {}",
                d.ordinal(),
                regions[0].ordinal()
            ))
            .into());
        }
    }
    let export = match &cfg.device_export {
        Some(e) => Arc::clone(e),
        None => cuda_export(regions[0].ordinal(), &used)?,
    };
    Ok((regions, export))
}

#[cfg(feature = "cuda")]
fn cuda_export(
    ordinal: usize,
    used: &[(u64, u64)],
) -> Result<Arc<dyn DeviceMemoryExport>, RdmaTargetError> {
    crate::rdma::cuda_device::CudaExport::new(ordinal, used)
        .map(|e| Arc::new(e) as Arc<dyn DeviceMemoryExport>)
        .map_err(|e| GpuDirectError::Regions(e.to_string()).into())
}

#[cfg(not(feature = "cuda"))]
fn cuda_export(
    _ordinal: usize,
    _used: &[(u64, u64)],
) -> Result<Arc<dyn DeviceMemoryExport>, RdmaTargetError> {
    Err(GpuDirectError::CudaNotBuilt.into())
}

/// Bytes of every layout region, without overflow.
fn layout_bytes(layout: &KvLayout) -> Option<usize> {
    layout.regions.iter().try_fold(0usize, |acc, r| {
        let n = r.block_len.checked_mul(u64::from(layout.num_blocks))?;
        acc.checked_add(usize::try_from(n).ok()?)
    })
}
