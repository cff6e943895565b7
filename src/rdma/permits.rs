//! Landing permits (DESIGN.md §5): each pull gets its own address window, and the data server
//! admits a write only while the permit of the pull owning that window is open for the request
//! that owns the target block. `revoke(req)` closes the request in every pull that carried it
//! and waits for writes already copying into its blocks to finish their current socket read, so
//! when it returns no byte of a later write can land: the revocation is the fence.
//!
//! Windows are recycled round-robin over a fixed count (the descriptor covers them all, since P
//! caches it). A window is reused only once every request of its previous pull was revoked, and
//! round-robin reuse maximises the time before an old pull's address range admits anything
//! again. When every window is busy a pull gets the reserved last window, which admits nothing:
//! its writes fail at P (err_reqs) rather than land unguarded.
//!
//! With permits off (upstream behaviour) every pull shares window 0, every in-range write is
//! admitted, and `revoke` proves nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use futures::future::LocalBoxFuture;

use crate::messages::{PeerId, PullId, ReqId, RequestMeta};
use crate::metrics as m;

use super::landing::{FenceError, Landing, PullWindow, Revocation};
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
            p.inflight.fetch_sub(1, Ordering::SeqCst);
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
    cursor: u32,
}

/// Every permit of one target.
pub struct PermitTable {
    enabled: bool,
    map: Arc<WindowMap>,
    /// Current permit of each window (the last window is the reserved, never-admitting one).
    slots: Vec<RwLock<Option<Arc<Permit>>>>,
    inner: Mutex<Inner>,
    live: AtomicU64,
}

impl std::fmt::Debug for PermitTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitTable")
            .field("enabled", &self.enabled)
            .field("windows", &self.map.windows())
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
        }
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
        let free = (0..reserved)
            .map(|i| (inner.cursor + i) % reserved)
            .find(|&w| {
                self.slots[w as usize]
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .is_none_or(|p| p.is_closed())
            });
        let Some(window) = free else {
            tracing::error!(pull_id = pull.pull_id, peer = %pull.peer,
                "every landing window is in use; this pull gets the window that admits nothing");
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

    /// Close `req` in every pull that carries it; returns once no socket read can still copy
    /// into its blocks.
    pub fn revoke(&self, req: &ReqId) -> Revocation {
        if !self.enabled {
            return Revocation::NotExact;
        }
        let entries = self.lock().by_req.remove(req).unwrap_or_default();
        for (p, i) in &entries {
            if p.open[*i].swap(false, Ordering::SeqCst)
                && p.open_count.fetch_sub(1, Ordering::AcqRel) == 1
            {
                let live = self.live.fetch_sub(1, Ordering::Relaxed) - 1;
                metrics::gauge!(m::LIVE_PERMITS).set(live as f64);
            }
        }
        // Reads admitted before the swap finish their current socket read (bounded: one
        // non-blocking read syscall); every later one sees the closed permit.
        for (p, _) in &entries {
            let mut spins = 0u32;
            while p.inflight.load(Ordering::SeqCst) != 0 {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        Revocation::Exact
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

    fn revoke(&self, req: &RequestMeta) -> Revocation {
        self.permits.revoke(&req.req_id)
    }

    fn fence(&self, _peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        let enabled = self.permits.enabled();
        Box::pin(async move {
            if enabled {
                // `revoke` already waited out every admitted read: nothing more can land.
                Ok(())
            } else {
                Err(FenceError::Unavailable(
                    "TCP target without landing permits cannot refuse writes".into(),
                ))
            }
        })
    }
}
