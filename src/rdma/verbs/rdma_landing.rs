//! The core's view of an RDMA data plane ([`Landing`], DESIGN.md §5):
//!
//! - `endpoint()`: the handshake daemon's host and port (the segment name P connects to);
//! - `open_pull`: the base addresses of the pull's **landing window**: the destination memory
//!   registered at an IOVA slot of the window's own, with rkeys of its own
//!   ([`KeyWindows`](super::key_windows::KeyWindows) decides which; one window per P host);
//! - `revoke`: nothing is revocable per request ([`Revocation::NotExact`](crate::rdma::Revocation::NotExact)),
//!   but the windows of the completion's suspects are poisoned: no pull gets them again;
//! - `fence`: the suspects' queue pairs to ERR ([`RdmaFence`]: stops writes in flight), then
//!   every poisoned window **retired**: its registrations destroyed on every NIC (a write with
//!   its keys gets a remote access error, whatever QP it arrives on) and its buffers dropped
//!   from the descriptor (Mooncake, re-posting a slice after re-handshaking, reloads the
//!   descriptor, finds no buffer for the address and fails the slice). A clean window is
//!   registered in its place at a slot not advertised before. The fence holds once none of a
//!   peer's windows is registered, whether or not its queue pairs could be found.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::LocalBoxFuture;
use thiserror::Error;

use super::backend::{MrAccess, VerbsBackend};
use super::descriptor::{DescriptorError, PublishedDescriptor};
use super::fence::{RdmaFence, SharedHandshake};
use super::gpudirect::DeviceMemoryExport;
use super::key_windows::KeyWindows;
use super::peer_binding::peer_host;
use super::window_registrations::{HostSpan, WindowRegisterError, WindowRegistrations};
use crate::layout::KvLayout;
use crate::rdma::memory::{HostRegistration, LandingId};
use crate::messages::PeerId;
use crate::rdma::tcp::windows::{WindowError, WindowMap, DEFAULT_BASE};
use crate::rdma::{
    FenceError, Landing, NoWindow, NoWindowReason, PullWindow, RegionBases, Revocation,
    RevokeRequest, Revoked,
};

/// IOVA slots at most (fewer when the layout is large: every slot fits below 2^53). A slot is
/// reused only after all others were, so this many fences pass before an IOVA returns.
pub const MAX_SLOTS: u32 = 1 << 16;

/// Why the landing cannot be set up.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RdmaLandingError {
    /// Nothing to land in.
    #[error("the KV layout has no region")]
    EmptyLayout,
    /// A region's bytes (blocks x block length) do not fit in a u64.
    #[error("KV region {region} needs {needed} bytes, which overflows u64")]
    Overflow {
        /// The region, in layout order.
        region: usize,
        /// What it was computed to need before overflowing.
        needed: u64,
    },
    /// Not one memory region per layout region.
    #[error("{regions} memory regions for {layout} layout regions: give one per layout region")]
    RegionCount {
        /// Memory regions given.
        regions: usize,
        /// Layout regions.
        layout: usize,
    },
    /// A memory region shorter than its layout region.
    #[error("KV region {region} needs {needed} bytes at {addr:#x}; the memory holds {have}")]
    TooSmall {
        /// The region, in layout order.
        region: usize,
        /// Its start.
        addr: u64,
        /// Bytes the layout needs.
        needed: u64,
        /// Bytes the memory has.
        have: u64,
    },
    /// The windows cannot be laid out.
    #[error("landing windows: {0}")]
    Windows(#[from] WindowError),
    /// A window's registration with a NIC failed.
    #[error("registering landing window {slot}: {error}")]
    Register {
        /// The window's IOVA slot.
        slot: u32,
        /// Why.
        error: WindowRegisterError,
    },
    /// The descriptor P would read is not one it accepts.
    #[error("RDMA descriptor: {0}")]
    Descriptor(#[from] DescriptorError),
    /// The start failed (`error`), and a window registered on the way could not be deregistered
    /// (`deregister`): the NIC may still write the memory, which is therefore never freed.
    #[error("{error}; a window could not be deregistered ({deregister}): its memory is leaked")]
    Leaked {
        /// Why the start failed.
        error: Box<RdmaLandingError>,
        /// Why the deregistration failed.
        deregister: super::backend::VerbsError,
    },
    /// The descriptor does not fit in one handshake frame.
    #[error(
        "the descriptor ({bytes} bytes: {windows} windows x {regions} regions) exceeds the 1 MiB \
         handshake frame cap; use fewer windows"
    )]
    DescriptorTooLarge {
        /// Its size.
        bytes: usize,
        /// Windows advertised.
        windows: usize,
        /// Regions per window.
        regions: usize,
    },
}

/// How the landing registers its windows.
#[derive(Debug, Clone)]
pub struct WindowsConfig {
    /// Windows kept registered (each one registration of the whole layout per NIC). P hosts
    /// beyond this share windows, and a fence of one also fails the others' writes in flight.
    pub windows: usize,
    /// Descriptor buffer name (`cpu:<numa node>` or `cuda:<ordinal>`).
    pub location: String,
    pub access: MrAccess,
    /// First IOVA slot. `None`: drawn at random, so that a restarted D does not advertise the
    /// addresses (and rkeys) of its previous life.
    pub first_slot: Option<u32>,
    /// The memory is the GPU's: registered through GPUDirect RDMA with this export.
    pub device: Option<Arc<dyn DeviceMemoryExport>>,
}

impl Default for WindowsConfig {
    fn default() -> Self {
        WindowsConfig {
            windows: 4,
            location: "cpu:0".into(),
            access: MrAccess::default(),
            first_slot: None,
            device: None,
        }
    }
}

/// Windows and their registrations, under one lock.
struct Windows {
    keys: KeyWindows,
    regs: WindowRegistrations,
    /// The target stopped: nothing registered any more.
    closed: bool,
    /// Sleep mode: every window retired, none registered until resume.
    paused: bool,
}

/// [`Landing`] for the RDMA target. Cheap to share (`Arc`); the fence is shared with whoever
/// binds peers to segments.
pub struct RdmaLanding<B> {
    host: String,
    port: u32,
    core: Arc<Core<B>>,
}

/// What the fence needs, shared with the blocking task it runs on.
struct Core<B> {
    segment: String,
    handshake: SharedHandshake<B>,
    fence: RdmaFence<B>,
    windows: Mutex<Windows>,
    published: PublishedDescriptor,
    /// The host memory the windows are on now (`None`: kvrecv's own or device memory), kept
    /// registered while they may be.
    host: Mutex<Option<HostRegistration>>,
}

impl<B> std::fmt::Debug for RdmaLanding<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaLanding")
            .field("host", &self.host)
            .field("port", &self.port)
            .finish()
    }
}

/// A failed start's windows deregistered, and its error; if one cannot be deregistered, the NIC
/// may still write the memory: [`RdmaLandingError::Leaked`], which says the memory must never
/// be freed.
fn undo<B: VerbsBackend>(
    regs: &mut WindowRegistrations,
    backend: &mut B,
    error: RdmaLandingError,
) -> RdmaLandingError {
    match regs.deregister_all(backend) {
        Ok(()) => error,
        Err(deregister) => RdmaLandingError::Leaked {
            error: Box::new(error),
            deregister,
        },
    }
}

/// Bytes of layout region `i` (every block of it).
fn region_len(layout: &KvLayout, i: usize) -> Result<u64, RdmaLandingError> {
    let block_len = layout.regions[i].block_len;
    block_len
        .checked_mul(u64::from(layout.num_blocks))
        .ok_or(RdmaLandingError::Overflow {
            region: i,
            needed: block_len,
        })
}

/// Each layout region's bytes in `memory` (one span per region, each long enough).
fn check_memory(layout: &KvLayout, memory: &[HostSpan]) -> Result<(), RdmaLandingError> {
    let n = layout.regions.len();
    if n == 0 {
        return Err(RdmaLandingError::EmptyLayout);
    }
    if memory.len() != n {
        return Err(RdmaLandingError::RegionCount {
            regions: memory.len(),
            layout: n,
        });
    }
    for (i, &(addr, have)) in memory.iter().enumerate() {
        let needed = region_len(layout, i)?;
        if needed > have {
            return Err(RdmaLandingError::TooSmall {
                region: i,
                addr,
                needed,
                have,
            });
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The host a pull's peer is on (its window is the host's).
fn host_of(p: &PullWindow<'_>) -> String {
    let addr = p.peer.addr();
    peer_host(addr).unwrap_or_else(|| addr.to_owned())
}

/// The bases of the clean window `p`'s host lands through (assigned now if it has none);
/// `None` when no window is clean.
fn assign(w: &mut Windows, p: &PullWindow<'_>) -> Option<RegionBases> {
    let slot = w.keys.assign(p.peer.addr(), &host_of(p))?;
    Some(
        w.regs
            .bases(slot)
            .unwrap_or_else(|| w.regs.unregistered_bases()),
    )
}

impl<B: VerbsBackend + 'static> RdmaLanding<B> {
    /// `host`/`port`: where P reaches D's handshake daemon (the segment name). `memory`: where
    /// each layout region's bytes are (one span per region, each at least the region's size;
    /// they must stay mapped until [`close`](Self::close) returned). Registers the first
    /// windows on every device of the handshake's backend and publishes the descriptor.
    pub fn new(
        host: impl Into<String>,
        port: u16,
        layout: &KvLayout,
        memory: Vec<HostSpan>,
        cfg: WindowsConfig,
        handshake: SharedHandshake<B>,
        fence: RdmaFence<B>,
    ) -> Result<Self, RdmaLandingError> {
        check_memory(layout, &memory)?;
        let want = cfg.windows.max(1);
        // One slot is kept unregistered (`unregistered_bases`).
        let slots = WindowMap::max_windows(layout, DEFAULT_BASE)?
            .saturating_sub(1)
            .min(MAX_SLOTS);
        if (slots as usize) < want {
            return Err(WindowError::TooLarge {
                base: DEFAULT_BASE,
                stride: 0,
                windows: want as u32,
            }
            .into());
        }
        let regs = WindowRegistrations::new(
            layout,
            memory,
            DEFAULT_BASE,
            slots,
            cfg.location,
            cfg.access,
            cfg.device,
        )?;
        let first = cfg.first_slot.unwrap_or_else(rand::random);
        let host = host.into();
        let landing = RdmaLanding {
            core: Arc::new(Core {
                host: Mutex::new(None),
                segment: format!("{host}:{port}"),
                handshake,
                fence,
                windows: Mutex::new(Windows {
                    keys: KeyWindows::new(slots, want, first),
                    regs,
                    closed: false,
                    paused: false,
                }),
                published: PublishedDescriptor::default(),
            }),
            host,
            port: u32::from(port),
        };
        {
            let core = &landing.core;
            let mut w = lock(&core.windows);
            let mut hs = lock(&core.handshake);
            while w.keys.missing() > 0 {
                let Some(slot) = w.keys.fresh_slot() else {
                    break;
                };
                if let Err(error) = w.regs.register(hs.backend_mut(), slot) {
                    let e = RdmaLandingError::Register { slot, error };
                    return Err(undo(&mut w.regs, hs.backend_mut(), e));
                }
                w.keys.added(slot);
            }
            let d = super::descriptor::build(
                &core.segment,
                hs.backend().nics(),
                &w.regs.regions(),
                timestamp(),
            );
            let d = match d {
                Ok(d) => d,
                Err(e) => return Err(undo(&mut w.regs, hs.backend_mut(), e.into())),
            };
            let bytes = d.to_wire().len();
            if bytes as u64 + 1 > crate::rdma::handshake_daemon::MAX_FRAME {
                let e = RdmaLandingError::DescriptorTooLarge {
                    bytes,
                    windows: want,
                    regions: layout.regions.len(),
                };
                return Err(undo(&mut w.regs, hs.backend_mut(), e));
            }
            core.published.set(&d);
        }
        Ok(landing)
    }

    /// Record that `peer` writes from Mooncake segment `segment` (`host:port`).
    pub fn bind_peer(&self, peer: PeerId, segment: impl Into<String>) {
        self.core.fence.bind_peer(peer, segment);
    }

    /// The descriptor the handshake daemon serves (it changes as windows are retired).
    pub fn published(&self) -> PublishedDescriptor {
        self.core.published.clone()
    }

    /// IOVA slots of the registered windows.
    pub fn live_windows(&self) -> Vec<u32> {
        lock(&self.core.windows).keys.live()
    }

    /// The advertised base of every layout region of registered window `slot`.
    pub fn window_bases(&self, slot: u32) -> Option<crate::rdma::RegionBases> {
        lock(&self.core.windows).regs.bases(slot)
    }

    /// Keep the host memory the windows are on registered for this landing (the target's
    /// start registered it, before any window).
    pub(crate) fn keep_host(&self, registration: HostRegistration) {
        *lock(&self.core.host) = Some(registration);
    }

    /// Never end the host memory's registration: a window on it could not be deregistered,
    /// so the NIC may still write it (the memory is leaked with it).
    pub(crate) fn leak_host(&self) {
        std::mem::forget(lock(&self.core.host).take());
    }

    /// Deregister every window (the target stops; nothing registers again). On an error the
    /// memory must not be released: the NIC may still write into it.
    pub fn close(&self) -> Result<(), super::backend::VerbsError> {
        let mut w = lock(&self.core.windows);
        w.closed = true;
        let mut hs = lock(&self.core.handshake);
        w.regs.deregister_all(hs.backend_mut())
    }
}

impl<B: VerbsBackend + 'static> Landing for RdmaLanding<B> {
    fn endpoint(&self) -> (&str, u32) {
        (&self.host, self.port)
    }

    fn open_pull(&self, window: &PullWindow<'_>) -> crate::rdma::RegionBases {
        // The peer's host becomes a known one: segments there are its, not orphans.
        self.core.fence.note_peer(window.peer);
        let mut w = lock(&self.core.windows);
        match assign(&mut w, window) {
            Some(bases) => bases,
            None => {
                metrics::counter!("kvrecv_rdma_pulls_without_window_total").increment(1);
                tracing::warn!(peer = %window.peer, "no clean RDMA landing window: the pull's writes will be refused");
                w.regs.unregistered_bases()
            }
        }
    }

    /// Every window retired (its registrations destroyed on every NIC: any write with any of
    /// its rkeys gets a remote access error) and the descriptor published with no buffer.
    /// A deregistration that fails leaves its window poisoned and fails the pause: the memory
    /// must not be released (a later pause retries it).
    fn pause(&self) -> Result<(), crate::rdma::LandingPauseError> {
        {
            let mut w = lock(&self.core.windows);
            w.paused = true;
            w.keys.poison_all();
        }
        if let Some(e) = self.core.retire_poisoned() {
            return Err(crate::rdma::LandingPauseError::Failed(e));
        }
        tracing::info!("RDMA landing paused: every window deregistered");
        Ok(())
    }

    /// As many windows as before registered again, each at an IOVA slot not advertised since
    /// the last wrap (fresh rkeys), and published.
    fn resume(&self) -> Result<(), crate::rdma::LandingPauseError> {
        {
            let mut w = lock(&self.core.windows);
            if !w.paused {
                return Ok(());
            }
            w.paused = false;
        }
        self.core.register_again()
    }

    /// The old memory's windows are all deregistered while paused (a pause that failed to
    /// deregister one is retried here first, and refuses the swap if it fails again); then
    /// the registrations take the new spans, and windows are registered on them at fresh IOVA
    /// slots with fresh rkeys: no key ever reaches the old memory again.
    fn resume_on(
        &self,
        memory: &crate::rdma::memory::HostMemory,
    ) -> Result<(), crate::rdma::LandingPauseError> {
        use crate::rdma::LandingPauseError as E;
        {
            let w = lock(&self.core.windows);
            if !w.paused {
                return Err(E::Failed(
                    "not paused: the memory is swapped only while paused".into(),
                ));
            }
            if w.regs.is_device() {
                return Err(E::Unsupported(
                    "the worker lands in device memory; new host memory is not supported".into(),
                ));
            }
            crate::rdma::memory_fit::check_fit(memory, &w.regs.region_lens())?;
        }
        if let Some(e) = self.core.retire_poisoned() {
            return Err(E::Failed(format!(
                "a window on the old memory is still registered: {e}"
            )));
        }
        {
            let mut w = lock(&self.core.windows);
            if w.regs.any_live() {
                return Err(E::Failed(
                    "a window on the old memory is still registered".into(),
                ));
            }
            let mut host = lock(&self.core.host);
            // Under the id of the memory it is on (a resume onto that memory is its own).
            let id = host
                .as_ref()
                .map_or_else(LandingId::fresh, HostRegistration::landing);
            let registration = memory.register(id).map_err(|_| E::InUse)?;
            let spans = memory
                .regions()
                .iter()
                .map(|r| (r.as_ptr() as u64, r.len() as u64))
                .collect();
            w.regs.replace_memory(spans);
            // No window is on the old memory any more (checked above): its registration ends.
            *host = Some(registration);
            w.paused = false;
        }
        tracing::info!("RDMA landing resuming on new memory");
        self.core.register_again()
    }

    fn open_pulls(&self, windows: &[PullWindow<'_>]) -> Result<Vec<RegionBases>, NoWindow> {
        for p in windows {
            self.core.fence.note_peer(p.peer);
        }
        // Checked and assigned under one lock: all or none.
        let mut w = lock(&self.core.windows);
        if windows.iter().all(|p| w.keys.can_assign(&host_of(p))) {
            return Ok(windows
                .iter()
                .map(|p| assign(&mut w, p).unwrap_or_else(|| w.regs.unregistered_bases()))
                .collect());
        }
        metrics::counter!("kvrecv_rdma_pulls_without_window_total").increment(windows.len() as u64);
        let (usable, poisoned) = (w.keys.live().len(), w.keys.poisoned());
        Err(NoWindow {
            needed: windows.len(),
            // RDMA windows are shared by hosts: every one that is not poisoned is open.
            in_use: usable.saturating_sub(poisoned),
            poisoned,
            usable,
            why: NoWindowReason::Exhausted,
        })
    }

    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        let poisoned = if r.suspects.is_empty() {
            0
        } else {
            let suspects: Vec<&str> = r.suspects.iter().map(PeerId::addr).collect();
            lock(&self.core.windows).keys.poison(&suspects)
        };
        Revoked {
            revocation: Revocation::NotExact,
            poisoned,
            quiesced: None,
        }
    }

    fn fence(&self, peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        // Firmware calls (QPs to ERR, deregistration, a replacement registration of the whole
        // layout) run on the blocking pool, never on the actor's thread; inside no runtime
        // (plain executors in tests) when first polled.
        let core = Arc::clone(&self.core);
        super::fence::off_runtime(peers, move |peers| core.fence_now(peers))
    }
}

impl<B: VerbsBackend + 'static> Core<B> {
    /// After a resume: register as many windows as before at fresh slots, and publish.
    fn register_again(&self) -> Result<(), crate::rdma::LandingPauseError> {
        if let Some(e) = self.retire_poisoned() {
            return Err(crate::rdma::LandingPauseError::Failed(e));
        }
        let missing = lock(&self.windows).keys.missing();
        if missing > 0 {
            return Err(crate::rdma::LandingPauseError::Failed(format!(
                "{missing} RDMA landing windows could not be registered again"
            )));
        }
        tracing::info!("RDMA landing resumed at fresh IOVA slots");
        Ok(())
    }

    /// Retire every poisoned window and register clean ones in their place; then publish the
    /// descriptor. Returns the first deregistration error.
    fn retire_poisoned(&self) -> Option<String> {
        let mut w = lock(&self.windows);
        let w = &mut *w;
        let mut hs = lock(&self.handshake);
        let mut error = None;
        for slot in w.keys.to_retire() {
            match w.regs.deregister(hs.backend_mut(), slot) {
                Ok(()) => {
                    w.keys.retired(slot);
                    metrics::counter!("kvrecv_rdma_windows_retired_total").increment(1);
                    tracing::info!(
                        slot,
                        "RDMA landing window retired: its keys and addresses are gone"
                    );
                }
                Err(e) => {
                    tracing::error!(slot, error = %e, "cannot deregister a poisoned RDMA window");
                    error.get_or_insert_with(|| format!("deregistering window {slot}: {e}"));
                }
            }
        }
        while !w.closed && !w.paused && w.keys.missing() > 0 {
            let Some(slot) = w.keys.fresh_slot() else {
                break;
            };
            match w.regs.register(hs.backend_mut(), slot) {
                Ok(()) => w.keys.added(slot),
                Err(e) => {
                    metrics::counter!("kvrecv_rdma_window_registration_failures_total")
                        .increment(1);
                    tracing::error!(slot, error = %e, "cannot register a replacement RDMA window");
                    break;
                }
            }
        }
        match super::descriptor::build_live(
            &self.segment,
            hs.backend().nics(),
            &w.regs.regions(),
            timestamp(),
        ) {
            Ok(d) => self.published.set(&d),
            Err(e) => tracing::error!(error = %e, "cannot rebuild the RDMA descriptor"),
        }
        error
    }

    /// The fence, synchronously: the peers' queue pairs to ERR (writes in flight stop), then
    /// every poisoned window retired. A peer whose queue pairs cannot be found is still fenced
    /// once its windows' keys are all destroyed.
    fn fence_now(&self, peers: &[PeerId]) -> Result<(), FenceError> {
        // Queue pairs first: writes in flight stop now. A peer whose queue pairs cannot be
        // found is still fenced below if its windows' keys are all destroyed.
        let qp_results: Vec<Result<(), FenceError>> = peers
            .iter()
            .map(|p| self.fence.fence_now(std::slice::from_ref(p)))
            .collect();
        {
            let addrs: Vec<&str> = peers.iter().map(PeerId::addr).collect();
            lock(&self.windows).keys.poison(&addrs);
        }
        let dereg_error = self.retire_poisoned();
        let w = lock(&self.windows);
        let mut result = Ok(());
        for (peer, qp) in peers.iter().zip(qp_results) {
            if w.keys.fenced(peer.addr()) {
                if let Err(e) = qp {
                    tracing::info!(%peer, reason = %e, "queue pairs not found; fenced by its windows' keys");
                }
                continue;
            }
            let reason = match (&dereg_error, qp) {
                (Some(d), _) => d.clone(),
                (None, Err(FenceError::Failed { reason, .. })) => reason,
                (None, Err(e)) => e.to_string(),
                (None, Ok(())) => "its landing window is still registered".into(),
            };
            result = Err(FenceError::Failed {
                peer: peer.clone(),
                reason,
            });
            break;
        }
        result
    }
}

fn timestamp() -> String {
    format!(
        "{:.6}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
    )
}

#[cfg(test)]
#[path = "rdma_landing_tests.rs"]
mod tests;
