//! Landing permits (DESIGN.md §5): each pull gets its own address window (an epoch), and the
//! data server admits a write only while the permit of the pull owning that window is open for
//! the request that owns the target block. `revoke(req)` closes the request in every pull that
//! carried it; the writes already copying into its blocks finish their current socket read, and
//! `Revoked::quiesced` resolves when they have, so once it resolves no byte of a later write can
//! land: the revocation is the fence.
//!
//! Epochs are recycled round-robin over a large fixed count (the descriptor covers them all in
//! one buffer, since P caches it). A window is reused only once every request of its previous
//! pull was revoked **and** it is not poisoned: the window of a pull whose peer may still be
//! writing (it settled Uncertain, failed in its transfer engine, or never settled) admits nothing
//! and stays out of rotation until the last-resort deadline the revocation carried, so an
//! abandoned writer's late write can never be admitted into a newer pull that reuses the window
//! for the same block. When no clean window is free a pull gets the reserved last window, which
//! admits nothing: its writes fail at P (err_reqs) rather than land unguarded.
//!
//! With permits off (upstream behaviour) every pull shares window 0, every in-range write is
//! admitted, and `revoke` proves nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use futures::future::LocalBoxFuture;
use tokio::sync::Notify;

use crate::messages::{PeerId, PullId, ReqId};
use crate::metrics as m;

use super::landing::{FenceError, Landing, PullWindow, Revocation, RevokeRequest, Revoked};
use super::windows::{Resolved, WindowMap};

/// Why a request was refused (the `reason` label of `WRITES_REJECTED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Empty, overflowing, or not inside one region of one advertised window.
    OutOfRange,
    /// Opcode other than READ/WRITE.
    BadOpcode,
    /// The window has no pull, or the block is not one of the pull's.
    NoPermit,
    /// The block's request was revoked (a late write).
    Revoked,
}

impl RejectReason {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            RejectReason::OutOfRange => "out_of_range",
            RejectReason::BadOpcode => "bad_opcode",
            RejectReason::NoPermit => "no_permit",
            RejectReason::Revoked => "revoked",
        }
    }
}

/// One pull's permit.
#[derive(Debug)]
pub struct Permit {
    pub pull_id: PullId,
    pub peer: PeerId,
    pub window: u32,
    /// Per KV-cache group: block id -> index of the owning request in `reqs`.
    blocks: Vec<HashMap<u32, usize>>,
    reqs: Vec<ReqId>,
    open: Vec<AtomicBool>,
    open_count: AtomicUsize,
    /// Socket reads currently copying into this window's blocks.
    inflight: AtomicU64,
    /// Set by a revocation that waits for `inflight` to reach zero.
    draining: AtomicBool,
    /// Woken when `inflight` reaches zero while draining.
    quiet: Notify,
    /// Bytes landed through this permit.
    pub bytes_landed: AtomicU64,
    /// Writes landed through this permit.
    pub writes_landed: AtomicU64,
}

impl Permit {
    fn is_closed(&self) -> bool {
        self.open_count.load(Ordering::Acquire) == 0
    }
}

/// A write admitted at header time; every socket read into destination memory must happen
/// inside [`Admitted::enter`].
#[derive(Debug)]
pub struct Admitted {
    permit: Option<Arc<Permit>>,
    /// Indices of the requests whose blocks the write touches.
    reqs: Vec<usize>,
}

/// Held while one socket read copies into destination memory.
pub struct GateGuard<'a> {
    permit: Option<&'a Permit>,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.permit {
            // SeqCst pairs with `quiesce`: either it sees this decrement, or this sees `draining`.
            if p.inflight.fetch_sub(1, Ordering::SeqCst) == 1 && p.draining.load(Ordering::SeqCst) {
                p.quiet.notify_waiters();
            }
        }
    }
}

/// Wait until no admitted read is copying through any of `permits` (they are already closed).
async fn quiesce(permits: Vec<Arc<Permit>>) {
    for p in permits {
        loop {
            let woken = p.quiet.notified();
            tokio::pin!(woken);
            // Register before checking, so a decrement between the check and the await still
            // wakes us.
            woken.as_mut().enable();
            if p.inflight.load(Ordering::SeqCst) == 0 {
                break;
            }
            woken.await;
        }
    }
}

impl Admitted {
    /// Enter the gate: `None` if a request of this write was revoked since admission (the write
    /// must be aborted without copying another byte).
    pub fn enter(&self) -> Option<GateGuard<'_>> {
        let Some(p) = &self.permit else {
            return Some(GateGuard { permit: None });
        };
        // SeqCst on both sides (here: inflight then open; revoke: open then inflight) means
        // either this read sees the revocation or revoke sees this read and waits for it.
        p.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = GateGuard { permit: Some(p) };
        if self.reqs.iter().all(|&i| p.open[i].load(Ordering::SeqCst)) {
            Some(guard)
        } else {
            None
        }
    }

    /// Account a landed write to its pull.
    pub fn landed(&self, bytes: u64) {
        if let Some(p) = &self.permit {
            p.bytes_landed.fetch_add(bytes, Ordering::Relaxed);
            p.writes_landed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The pull this write belongs to (`None` with permits off).
    pub fn pull_id(&self) -> Option<PullId> {
        self.permit.as_ref().map(|p| p.pull_id)
    }
}

/// Byte accounting of one pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullBytes {
    pub window: u32,
    pub bytes_landed: u64,
    pub writes_landed: u64,
    /// Whether some request of the pull is still open.
    pub open: bool,
}

#[derive(Default)]
struct Inner {
    /// Every pull a request is in, with its index in that permit.
    by_req: HashMap<ReqId, Vec<(Arc<Permit>, usize)>>,
    /// Pulls whose window has not been reused yet (accounting stays readable until then).
    by_pull: HashMap<PullId, Arc<Permit>>,
    /// Poisoned windows and when each may return to rotation (DESIGN.md §5).
    poisoned: HashMap<u32, Instant>,
    cursor: u32,
}

/// Counters of the epoch rule, readable while the target runs.
#[derive(Debug, Default)]
pub struct EpochStats {
    /// Windows poisoned by a revocation (a writer of their pull may still be writing).
    pub poisoned: AtomicU64,
    /// Poisoned windows that went back into rotation at their last-resort deadline.
    pub poison_expired: AtomicU64,
    /// Pulls that found no clean window and got the reserved one (their writes are refused).
    pub exhausted: AtomicU64,
}

/// Every permit of one target.
pub struct PermitTable {
    enabled: bool,
    /// The epoch rule: poison the windows of suspect pulls. Off only to prove it matters.
    poison: bool,
    map: Arc<WindowMap>,
    /// Current permit of each window (the last window is the reserved, never-admitting one).
    slots: Vec<RwLock<Option<Arc<Permit>>>>,
    inner: Mutex<Inner>,
    live: AtomicU64,
    epochs: EpochStats,
}

impl std::fmt::Debug for PermitTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitTable")
            .field("enabled", &self.enabled)
            .field("windows", &self.map.windows())
            .field("poison", &self.poison)
            .finish()
    }
}

impl PermitTable {
    /// With `enabled`, `map` needs at least 2 windows (the last is reserved).
    pub fn new(map: Arc<WindowMap>, enabled: bool) -> Self {
        let n = if enabled { map.windows() as usize } else { 0 };
        PermitTable {
            enabled,
            map,
            slots: (0..n).map(|_| RwLock::new(None)).collect(),
            inner: Mutex::new(Inner::default()),
            live: AtomicU64::new(0),
            poison: true,
            epochs: EpochStats::default(),
        }
    }

    /// Turn the epoch rule off: a window whose writer may still write is reused as soon as it
    /// is closed. Unsafe by design; only for the tests and the repro variant that prove the rule
    /// matters.
    pub fn without_epoch_rule(mut self) -> Self {
        self.poison = false;
        self
    }

    /// Whether suspect windows are poisoned.
    pub fn epoch_rule(&self) -> bool {
        self.poison
    }

    /// Epoch counters.
    pub fn epochs(&self) -> &EpochStats {
        &self.epochs
    }

    /// Windows poisoned now (including expired ones not yet swept).
    pub fn poisoned_windows(&self) -> usize {
        self.lock().poisoned.len()
    }

    /// Whether permits are enforced.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The window geometry.
    pub fn map(&self) -> &Arc<WindowMap> {
        &self.map
    }

    /// Open permits now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave `Inner` half-updated in a way that
        // matters more than refusing every later pull would, so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reserved(&self) -> u32 {
        self.map.windows() - 1
    }

    /// Open a window for `pull`; returns the window index.
    pub fn open(&self, pull: &PullWindow<'_>) -> u32 {
        if !self.enabled {
            return 0;
        }
        let reserved = self.reserved();
        if pull.requests.is_empty() || reserved == 0 {
            return reserved;
        }
        let mut inner = self.lock();
        let now = Instant::now();
        let cursor = inner.cursor;
        let free = (0..reserved).map(|i| (cursor + i) % reserved).find(|&w| {
            let closed = self.slots[w as usize]
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .is_none_or(|p| p.is_closed());
            closed && self.clean(&mut inner, w, now)
        });
        let Some(window) = free else {
            self.epochs.exhausted.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::WINDOWS_EXHAUSTED).increment(1);
            tracing::error!(pull_id = pull.pull_id, peer = %pull.peer,
                poisoned = inner.poisoned.len(),
                "no clean landing window is free; this pull gets the window that admits nothing");
            return reserved;
        };
        inner.cursor = (window + 1) % reserved;
        let groups = pull
            .requests
            .iter()
            .map(|r| r.block_ids.len())
            .max()
            .unwrap_or(0);
        let mut blocks: Vec<HashMap<u32, usize>> = vec![HashMap::new(); groups];
        for (i, r) in pull.requests.iter().enumerate() {
            for (g, ids) in r.block_ids.iter().enumerate() {
                for &b in ids {
                    blocks[g].insert(b, i);
                }
            }
        }
        let n = pull.requests.len();
        let permit = Arc::new(Permit {
            pull_id: pull.pull_id,
            peer: pull.peer.clone(),
            window,
            blocks,
            reqs: pull.requests.iter().map(|r| r.req_id.clone()).collect(),
            open: (0..n).map(|_| AtomicBool::new(true)).collect(),
            open_count: AtomicUsize::new(n),
            inflight: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            quiet: Notify::new(),
            bytes_landed: AtomicU64::new(0),
            writes_landed: AtomicU64::new(0),
        });
        let old = self.slots[window as usize]
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .replace(permit.clone());
        if let Some(old) = old {
            inner.by_pull.remove(&old.pull_id);
        }
        for (i, r) in permit.reqs.iter().enumerate() {
            inner
                .by_req
                .entry(r.clone())
                .or_default()
                .push((permit.clone(), i));
        }
        inner.by_pull.insert(pull.pull_id, permit);
        let live = self.live.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::gauge!(m::LIVE_PERMITS).set(live as f64);
        window
    }

    /// Whether closed window `w` may be handed out: not poisoned, or its poison expired.
    fn clean(&self, inner: &mut Inner, w: u32, now: Instant) -> bool {
        match inner.poisoned.get(&w) {
            None => true,
            Some(&until) if until <= now => {
                inner.poisoned.remove(&w);
                self.epochs.poison_expired.fetch_add(1, Ordering::Relaxed);
                metrics::gauge!(m::POISONED_WINDOWS).set(inner.poisoned.len() as f64);
                tracing::warn!(
                    window = w,
                    "poisoned landing window back in rotation at its last-resort deadline"
                );
                true
            }
            Some(_) => false,
        }
    }

    /// Close `r.req` in every pull that carries it and poison the windows of the pulls of
    /// `r.suspects`. No write is admitted into the request's blocks after this returns; reads
    /// admitted before it may still be finishing: wait for [`Revoked::quiesced`].
    pub fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        if !self.enabled {
            return Revoked::not_exact();
        }
        let mut inner = self.lock();
        let entries = inner.by_req.remove(&r.req.req_id).unwrap_or_default();
        let mut poisoned = 0;
        for (p, i) in &entries {
            if p.open[*i].swap(false, Ordering::SeqCst)
                && p.open_count.fetch_sub(1, Ordering::AcqRel) == 1
            {
                let live = self.live.fetch_sub(1, Ordering::Relaxed) - 1;
                metrics::gauge!(m::LIVE_PERMITS).set(live as f64);
            }
            if self.poison && r.suspects.contains(&p.peer) {
                let until = inner.poisoned.entry(p.window).or_insert(r.poison_until);
                *until = (*until).max(r.poison_until);
                poisoned += 1;
                tracing::info!(window = p.window, pull_id = p.pull_id, peer = %p.peer,
                    req_id = %r.req.req_id, "landing window poisoned: its writer may still write");
            }
        }
        if poisoned > 0 {
            self.epochs
                .poisoned
                .fetch_add(poisoned as u64, Ordering::Relaxed);
            metrics::counter!(m::WINDOWS_POISONED).increment(poisoned as u64);
            metrics::gauge!(m::POISONED_WINDOWS).set(inner.poisoned.len() as f64);
        }
        drop(inner);
        // Reads admitted before the swap finish their current socket read (bounded: one
        // non-blocking read syscall, or one device copy); every later one sees the closed permit.
        let busy: Vec<Arc<Permit>> = entries
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| {
                p.draining.store(true, Ordering::SeqCst);
                p.inflight.load(Ordering::SeqCst) != 0
            })
            .collect();
        Revoked {
            revocation: Revocation::Exact,
            poisoned,
            quiesced: (!busy.is_empty())
                .then(|| Box::pin(quiesce(busy)) as futures::future::BoxFuture<'static, ()>),
        }
    }

    /// Admission check for `[addr, addr + size)` already resolved to `r`.
    pub fn admit(&self, r: &Resolved, size: u64) -> Result<Admitted, RejectReason> {
        if !self.enabled {
            return Ok(Admitted {
                permit: None,
                reqs: vec![],
            });
        }
        let permit = self
            .slots
            .get(r.window as usize)
            .and_then(|s| s.read().unwrap_or_else(|e| e.into_inner()).clone())
            .ok_or(RejectReason::NoPermit)?;
        let group = self.map.group(r.region) as usize;
        let (first, last) = self.map.blocks(r.region, r.offset, size);
        let owners = permit.blocks.get(group).ok_or(RejectReason::NoPermit)?;
        let mut reqs: Vec<usize> = Vec::with_capacity(1);
        for b in first..=last {
            let i = *owners.get(&b).ok_or(RejectReason::NoPermit)?;
            if !reqs.contains(&i) {
                reqs.push(i);
            }
        }
        if reqs.iter().any(|&i| !permit.open[i].load(Ordering::SeqCst)) {
            return Err(RejectReason::Revoked);
        }
        Ok(Admitted {
            permit: Some(permit),
            reqs,
        })
    }

    /// Byte accounting of `pull` while its window has not been reused.
    pub fn pull_bytes(&self, pull: PullId) -> Option<PullBytes> {
        let inner = self.lock();
        let p = inner.by_pull.get(&pull)?;
        Some(PullBytes {
            window: p.window,
            bytes_landed: p.bytes_landed.load(Ordering::Relaxed),
            writes_landed: p.writes_landed.load(Ordering::Relaxed),
            open: !p.is_closed(),
        })
    }
}

/// The core's [`Landing`] over kvrecv's own TCP target.
#[derive(Debug, Clone)]
pub struct TcpLanding {
    permits: Arc<PermitTable>,
    host: String,
    port: u32,
}

impl TcpLanding {
    /// `host:port` is the handshake daemon P's TE contacts.
    pub fn new(permits: Arc<PermitTable>, host: &str, port: u16) -> Self {
        TcpLanding {
            permits,
            host: host.to_owned(),
            port: u32::from(port),
        }
    }

    /// The permit table.
    pub fn permits(&self) -> &Arc<PermitTable> {
        &self.permits
    }
}

impl Landing for TcpLanding {
    fn endpoint(&self) -> (String, u32) {
        (self.host.clone(), self.port)
    }

    fn open_pull(&self, window: &PullWindow<'_>) -> Vec<u64> {
        let w = self.permits.open(window);
        self.permits.map().region_bases(w)
    }

    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        self.permits.revoke(r)
    }

    fn fence(&self, _peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        let enabled = self.permits.enabled();
        Box::pin(async move {
            if enabled {
                // The revocation closed every permit of the request and the BlockManager waited
                // for its quiescence: nothing more can land.
                Ok(())
            } else {
                Err(FenceError::Unavailable(
                    "TCP target without landing permits cannot refuse writes".into(),
                ))
            }
        })
    }
}
