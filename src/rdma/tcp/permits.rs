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

#![forbid(unsafe_code)]

use crate::fast_hash::{FastMap, FastSet};
use crate::telemetry::Labels;

use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use futures::future::LocalBoxFuture;
use tokio::sync::Notify;

use crate::messages::{PeerId, PullId, ReqId, RequestMeta};
use crate::telemetry as m;

use super::request_pulls::{Pairs, RequestPulls};
use super::windows::{Resolved, WindowMap};
use crate::rdma::landing::{
    FenceError, Landing, NoWindow, NoWindowReason, PullWindow, RegionBases, Revocation,
    RevokeRequest, Revoked,
};

/// Why a request was refused (the `reason` label of `WRITES_REJECTED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Empty, overflowing, or not inside one region of one advertised window.
    OutOfRange,
    /// Opcode other than READ/WRITE.
    BadOpcode,
    /// A READ while reads are off (the default: vLLM never reads from D).
    ReadsOff,
    /// The window has no pull (never opened, or the reserved window), or the block is not one
    /// of its open pull's.
    NoPermit,
    /// A late write: the block's request was revoked, or the window's last pull closed (every
    /// request of it revoked), whichever block of the window it targets.
    Revoked,
    /// The target is paused (sleep mode, DESIGN.md §7): nothing lands, whatever the window.
    Paused,
}

impl RejectReason {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            RejectReason::OutOfRange => "out_of_range",
            RejectReason::BadOpcode => "bad_opcode",
            RejectReason::ReadsOff => "reads_off",
            RejectReason::NoPermit => "no_permit",
            RejectReason::Revoked => "revoked",
            RejectReason::Paused => "paused",
        }
    }
}

/// Why a request whose pull got the reserved window fails.
const NO_WINDOW: &str = "D had no clean landing window for a pull of this request (all poisoned, \
     or its P deployment's share of them): its writes were refused";

/// One KV-cache group's blocks of a pull: (block id, index of the owning request), sorted by
/// block. Eight bytes a block (a hash map and its slack cost four times that, per request in
/// flight).
#[derive(Debug, Clone, Default)]
struct BlockOwners(Vec<(u32, u32)>);

impl BlockOwners {
    fn get(&self, block: u32) -> Option<usize> {
        self.0
            .binary_search_by_key(&block, |&(b, _)| b)
            .ok()
            .map(|i| self.0[i].1 as usize)
    }
}

/// A P deployment: its bootstrap server's address. Every DP rank (engine id) of a deployment is
/// listed by one bootstrap server and shares its configuration, and its mistakes: a misaligned
/// layout makes every rank error, so the ranks share one share of poisoned windows.
type Deployment = Arc<str>;

/// One pull's permit.
#[derive(Debug)]
pub struct Permit {
    pub pull_id: PullId,
    pub peer: PeerId,
    /// The P deployment of the pull's requests (one pull, one engine, one deployment).
    deployment: Deployment,
    pub window: u32,
    /// Per KV-cache group: block id -> index of the owning request in the pull.
    blocks: Vec<BlockOwners>,
    open: Vec<AtomicBool>,
    open_count: AtomicUsize,
    /// Socket reads currently copying into this window's blocks.
    inflight: AtomicU64,
    /// Set by a revocation that waits for `inflight` to reach zero.
    draining: AtomicBool,
    /// Woken when `inflight` reaches zero while draining.
    quiet: Notify,
    /// Where landed writes put their bytes, per request (index as in `reqs`, grown on first
    /// landing): what proves an unproven ok. Ranges, not a byte count, so a write landed twice
    /// counts once; contiguous writes merge into one range as they land.
    coverage: Mutex<Vec<Vec<Span>>>,
    /// Set before anything is first added to `coverage`: until then a revocation has no
    /// coverage to drop and does not take its lock.
    covered: AtomicBool,
    /// Most spans kept per request: two per block and region (pieces of a block landing out
    /// of order, apart until the gap between them lands) and some slack. Spans past it are not
    /// recorded, so
    /// a writer that scatters bytes cannot grow this without bound; what it wrote is then
    /// under-counted, which can only fail an ok, never pass one.
    span_cap: Box<[u32]>,
    /// P's `ok_reqs` is no proof of placement for this window's requests, the byte count is
    /// (PROTOCOL.md §5.3): a v1 (unacknowledged) write was admitted or refused here, or an
    /// acknowledged write was admitted and ended before its last byte (its writer got no
    /// acknowledgement, so an ok after it is a lie or a mistake).
    unproven: AtomicBool,
    /// Writes admitted into this window that have neither landed nor ended: an ok while one is
    /// open came before its acknowledgement.
    open_writes: AtomicU64,
    /// Bytes landed through this permit.
    pub bytes_landed: AtomicU64,
    /// Writes landed through this permit.
    pub writes_landed: AtomicU64,
}

impl Permit {
    fn is_closed(&self) -> bool {
        self.open_count.load(Ordering::Acquire) == 0
    }

    /// A copy with the same values (no read in the gate: forks happen between events).
    fn fork(&self) -> Permit {
        Permit {
            pull_id: self.pull_id,
            peer: self.peer.clone(),
            deployment: self.deployment.clone(),
            window: self.window,
            blocks: self.blocks.clone(),
            open: self
                .open
                .iter()
                .map(|a| AtomicBool::new(a.load(Ordering::SeqCst)))
                .collect(),
            open_count: AtomicUsize::new(self.open_count.load(Ordering::SeqCst)),
            inflight: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            quiet: Notify::new(),
            coverage: Mutex::new(
                self.coverage
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone(),
            ),
            covered: AtomicBool::new(self.covered.load(Ordering::SeqCst)),
            span_cap: self.span_cap.clone(),
            unproven: AtomicBool::new(self.unproven.load(Ordering::SeqCst)),
            open_writes: AtomicU64::new(0),
            bytes_landed: AtomicU64::new(self.bytes_landed.load(Ordering::SeqCst)),
            writes_landed: AtomicU64::new(self.writes_landed.load(Ordering::SeqCst)),
        }
    }
}

/// Bytes `[start, end)` of a region (the same offsets in every window) written for the
/// request at index `req` of a permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    req: u32,
    span: Span,
}

/// `(region, start, end)`: bytes `[start, end)` of a region.
type Span = (u32, u64, u64);

/// Add `s` to a request's landed spans, kept sorted by (region, start) with touching spans
/// merged, so rewrites and out-of-order pieces of the same bytes take no more room. A span that
/// would be the `cap + 1`-th is dropped (under-counting only fails an ok).
fn add_span(spans: &mut Vec<Span>, s: Span, cap: usize) {
    let (region, mut start, mut end) = s;
    // Where `s` goes: after every span of an earlier region or starting before it.
    let at = spans.partition_point(|x| (x.0, x.1) < (region, start));
    let mut lo = at;
    if lo > 0 && spans[lo - 1].0 == region && spans[lo - 1].2 >= start {
        lo -= 1;
        start = spans[lo].1;
        end = end.max(spans[lo].2);
    }
    let mut hi = at;
    while hi < spans.len() && spans[hi].0 == region && spans[hi].1 <= end {
        end = end.max(spans[hi].2);
        hi += 1;
    }
    if lo == hi && spans.len() >= cap {
        return;
    }
    spans.splice(lo..hi, [(region, start, end)]);
}

/// Bytes covered by the union of `(region, start, end)` ranges.
fn union_len(mut ranges: Vec<Span>) -> u64 {
    ranges.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u32, u64, u64)> = None;
    for (region, start, end) in ranges {
        match &mut cur {
            Some((g, _, e)) if *g == region && start <= *e => *e = (*e).max(end),
            _ => {
                if let Some((_, s, e)) = cur {
                    total += e - s;
                }
                cur = Some((region, start, end));
            }
        }
    }
    total + cur.map_or(0, |(_, s, e)| e - s)
}

/// What a data-plane request does with the window it is admitted into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A READ (nothing lands).
    Read,
    /// A WRITE; `acknowledged` for v2 framing (D acknowledges it once every byte landed).
    Write { acknowledged: bool },
}

/// A write admitted at header time; every socket read into destination memory must happen
/// inside [`Admitted::enter`].
#[derive(Debug)]
pub struct Admitted {
    permit: Option<Arc<Permit>>,
    /// Indices of the requests whose blocks the write touches.
    reqs: Vec<usize>,
    /// The write's bytes inside each request's blocks.
    pieces: SmallVec<[Piece; 1]>,
    /// A write counted in the permit's `open_writes` until it lands or ends.
    open_write: AtomicBool,
}

impl Drop for Admitted {
    /// A write that ends without landing (connection lost, payload cut short, refused midway)
    /// leaves its window's oks unproven.
    fn drop(&mut self) {
        if let Some(p) = &self.permit {
            if self.open_write.load(Ordering::Acquire) {
                p.unproven.store(true, Ordering::Release);
                p.open_writes.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// Held while one socket read copies into destination memory.
pub struct GateGuard<'a> {
    permit: Option<&'a Permit>,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.permit {
            leave_gate(p);
        }
    }
}

/// [`GateGuard`] owning its permit, so it can travel with a device copy to a blocking thread:
/// the copy holds the gate until the device has the bytes, even if the connection's task is
/// dropped meanwhile, and a revocation's quiescence waits for it.
pub struct OwnedGateGuard {
    permit: Option<Arc<Permit>>,
}

impl Drop for OwnedGateGuard {
    fn drop(&mut self) {
        if let Some(p) = &self.permit {
            leave_gate(p);
        }
    }
}

fn leave_gate(p: &Permit) {
    // SeqCst pairs with `quiesce`: either it sees this decrement, or this sees `draining`.
    if p.inflight.fetch_sub(1, Ordering::SeqCst) == 1 && p.draining.load(Ordering::SeqCst) {
        p.quiet.notify_waiters();
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

    /// [`Self::enter`], with a guard that owns its permit (for a copy finished on another
    /// thread).
    pub fn enter_owned(&self) -> Option<OwnedGateGuard> {
        let Some(p) = &self.permit else {
            return Some(OwnedGateGuard { permit: None });
        };
        p.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = OwnedGateGuard {
            permit: Some(Arc::clone(p)),
        };
        // As in `enter`.
        if self.reqs.iter().all(|&i| p.open[i].load(Ordering::SeqCst)) {
            Some(guard)
        } else {
            None
        }
    }

    /// Account a landed write to its pull and requests (before it is acknowledged). With
    /// device memory, only once the device holds every byte (the copy's stream synchronised).
    pub fn landed(&self, bytes: u64) {
        if let Some(p) = &self.permit {
            p.bytes_landed.fetch_add(bytes, Ordering::Relaxed);
            p.writes_landed.fetch_add(1, Ordering::Relaxed);
            p.covered.store(true, Ordering::Release);
            let mut cov = p.coverage.lock().unwrap_or_else(|e| e.into_inner());
            for piece in &self.pieces {
                let i = piece.req as usize;
                if cov.len() <= i {
                    cov.resize_with(i + 1, Vec::new);
                }
                let cap = p.span_cap.get(i).map_or(0, |&c| c as usize);
                add_span(&mut cov[i], piece.span, cap);
            }
            drop(cov);
            if self.open_write.swap(false, Ordering::AcqRel) {
                p.open_writes.fetch_sub(1, Ordering::AcqRel);
            }
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
    /// Every pull an open request is in, with its index there. Each of those pulls is in
    /// `by_pull`: a window is reused only once every request of its permit was revoked.
    by_req: RequestPulls,
    /// Pulls whose permit is open. A permit leaves when its last request is revoked, and its
    /// window is marked [`Slot::Closed`] (late writes are still refused): kept until the
    /// window's reuse, every window's last permit stayed here, 16,384 cache-cold permits one of
    /// which each pull's open dropped.
    by_pull: FastMap<PullId, Arc<Permit>>,
    /// Poisoned windows, when each may return to rotation (DESIGN.md §5), and the deployment
    /// whose pull's writer made it a suspect.
    poisoned: FastMap<u32, (Instant, Deployment)>,
    /// Poisoned windows per deployment: under pressure a deployment at
    /// [`PermitTable::deployment_poison_cap`] gets no more windows until some of its poison
    /// expires.
    poisoned_by_deployment: FastMap<Deployment, usize>,
    /// No poison expires before this (a sweep of expired entries is due from then).
    next_expiry: Option<Instant>,
    /// Requests with a pull that got the reserved window (its writes were all refused).
    windowless: FastSet<ReqId>,
    cursor: u32,
    /// Per peer, the last [`PEER_RING`] windows its pulls got, oldest first: a pull prefers one
    /// of them (closed and clean) to the cursor's, so the peer's windows, and their layout
    /// ids, recur and P's layout cache stays warm (DESIGN.md §5.4). A poisoned window leaves
    /// the ring when met; it comes back only through the cursor.
    rings: FastMap<PeerId, SmallVec<[u32; PEER_RING]>>,
    /// When a refused pull was last logged, and the refusals since (counted by the metrics
    /// either way): a deployment past its share, or a flood of suspects, refuses every pull,
    /// and an error line per pull flooded the log.
    refusals_logged: Option<Instant>,
    refusals_unlogged: u64,
}

/// Windows a peer's ring holds: enough for the pulls one P worker usually has in flight, few
/// enough that its layout ids (one per window) stay far inside P's cache of 1,024 layouts.
pub const PEER_RING: usize = 8;

/// Peers with a ring at most; past it the rings start over (a cold cache, never a fault).
const MAX_RINGS: usize = 4096;

/// Refused pulls are logged at most once per this, with the count of those not logged.
const REFUSAL_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl Inner {
    /// Whether to log a refusal now; `Some(n)`: log it, with `n` refusals left unlogged since
    /// the last line.
    fn log_refusal(&mut self, now: Instant) -> Option<u64> {
        if self
            .refusals_logged
            .is_some_and(|t| now.saturating_duration_since(t) < REFUSAL_LOG_EVERY)
        {
            self.refusals_unlogged += 1;
            return None;
        }
        self.refusals_logged = Some(now);
        Some(std::mem::take(&mut self.refusals_unlogged))
    }
}

impl Inner {
    /// Whether a pull of `req` got the reserved window (no hash while none did).
    fn is_windowless(&self, req: &ReqId) -> bool {
        !self.windowless.is_empty() && self.windowless.contains(req)
    }

    /// The permits of a request's (pull, index) pairs.
    fn permits_of(&self, pairs: Pairs) -> SmallVec<[(Arc<Permit>, usize); 2]> {
        pairs
            .into_iter()
            .filter_map(|(pull, i)| match self.by_pull.get(&pull) {
                Some(p) => Some((p.clone(), i)),
                None => {
                    // Cannot happen (see `by_req`); were it to, that pull's permit is gone
                    // with its window, and nothing of it can admit a write.
                    tracing::error!(pull_id = pull, "request indexed in a pull with no permit");
                    None
                }
            })
            .collect()
    }
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

/// A window's state.
#[derive(Clone, Default)]
enum Slot {
    /// Never opened (or the reserved window): a write here targets no pull.
    #[default]
    Unused,
    /// The permit of the pull that owns the window.
    Open(Arc<Permit>),
    /// Its last pull's permit closed: every request revoked, so a write here is late (refused
    /// as revoked) until the window's next pull. The permit itself is gone: freed while its
    /// memory was still in cache, not 16,383 pulls later when its window comes round again.
    Closed,
}

impl Slot {
    fn permit(&self) -> Option<&Arc<Permit>> {
        match self {
            Slot::Open(p) => Some(p),
            Slot::Unused | Slot::Closed => None,
        }
    }
}

/// Every permit of one target.
pub struct PermitTable {
    enabled: bool,
    /// The epoch rule: poison the windows of suspect pulls. Off only to prove it matters.
    poison: bool,
    map: Arc<WindowMap>,
    /// What each window admits now (the last window is the reserved, never-admitting one).
    slots: Vec<RwLock<Slot>>,
    inner: Mutex<Inner>,
    live: AtomicU64,
    epochs: EpochStats,
    labels: Labels,
    /// Sleep mode: every write and read refused before its window is looked at.
    paused: AtomicBool,
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
            slots: (0..n).map(|_| RwLock::new(Slot::Unused)).collect(),
            inner: Mutex::new(Inner::default()),
            live: AtomicU64::new(0),
            poison: true,
            epochs: EpochStats::default(),
            labels: Labels::default(),
            paused: AtomicBool::new(false),
        }
    }

    /// Refuse every access (`true`, sleep mode) or admit by permit again (`false`). Checked
    /// at every admission, before the window: with permits off too.
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    /// Whether every access is refused (sleep mode).
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// The advertised bases of the reserved window, which admits nothing.
    pub fn reserved_bases(&self) -> crate::rdma::RegionBases {
        self.map.region_bases(self.map.windows().saturating_sub(1))
    }

    /// Record metrics under `labels` (the data plane records under the same ones).
    pub fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// The labels this table's target records metrics under.
    pub fn labels(&self) -> &Labels {
        &self.labels
    }

    /// Turn the epoch rule off: a window whose writer may still write is reused as soon as it
    /// is closed. Unsafe by design; only for the tests and the repro variant that prove the rule
    /// matters.
    pub fn without_epoch_rule(mut self) -> Self {
        self.poison = false;
        self
    }

    /// A deep copy of the whole table (model checking forks states). Permits shared between
    /// the window slots and the indexes stay shared in the copy. Not for a live target.
    pub fn fork(&self) -> PermitTable {
        let inner = self.lock();
        let mut copies: FastMap<*const Permit, Arc<Permit>> = FastMap::default();
        let mut copy = |p: &Arc<Permit>| {
            copies
                .entry(Arc::as_ptr(p))
                .or_insert_with(|| Arc::new(p.fork()))
                .clone()
        };
        let slots = self
            .slots
            .iter()
            .map(|s| {
                RwLock::new(match &*s.read().unwrap_or_else(|e| e.into_inner()) {
                    Slot::Open(p) => Slot::Open(copy(p)),
                    other => other.clone(),
                })
            })
            .collect();
        let by_req = inner.by_req.clone();
        let by_pull = inner.by_pull.iter().map(|(id, p)| (*id, copy(p))).collect();
        PermitTable {
            enabled: self.enabled,
            poison: self.poison,
            map: self.map.clone(),
            slots,
            inner: Mutex::new(Inner {
                by_req,
                by_pull,
                poisoned: inner.poisoned.clone(),
                poisoned_by_deployment: inner.poisoned_by_deployment.clone(),
                next_expiry: inner.next_expiry,
                windowless: inner.windowless.clone(),
                cursor: inner.cursor,
                rings: inner.rings.clone(),
                refusals_logged: inner.refusals_logged,
                refusals_unlogged: inner.refusals_unlogged,
            }),
            live: AtomicU64::new(self.live.load(Ordering::SeqCst)),
            epochs: EpochStats::default(),
            labels: self.labels.clone(),
            paused: AtomicBool::new(self.is_paused()),
        }
    }

    /// Hash what decides admission and window choice (model checking): each window's pull,
    /// peer, blocks and open requests, the poisoned windows, the cursor, the windowless
    /// requests. Poison deadlines are left out: the model decides when they pass.
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        for s in &self.slots {
            match &*s.read().unwrap_or_else(|e| e.into_inner()) {
                Slot::Unused => 0u8.hash(h),
                Slot::Closed => 2u8.hash(h),
                Slot::Open(p) => {
                    1u8.hash(h);
                    p.pull_id.hash(h);
                    p.peer.hash(h);
                    for a in &p.open {
                        a.load(Ordering::SeqCst).hash(h);
                    }
                    for g in &p.blocks {
                        g.0.hash(h);
                    }
                }
            }
        }
        let inner = self.lock();
        inner.by_req.sorted().hash(h);
        let mut poisoned: Vec<u32> = inner.poisoned.keys().copied().collect();
        poisoned.sort();
        poisoned.hash(h);
        inner.cursor.hash(h);
        let mut rings: Vec<_> = inner.rings.iter().collect();
        rings.sort_by(|a, b| a.0.cmp(b.0));
        for (peer, ring) in rings {
            peer.hash(h);
            ring[..].hash(h);
        }
        let mut wl: Vec<&ReqId> = inner.windowless.iter().collect();
        wl.sort();
        wl.hash(h);
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
        self.open_at(pull, Instant::now())
    }

    /// [`PermitTable::open`] at time `now` (poison deadlines are compared with it): for
    /// deterministic drivers such as the model checker. A pull refused a window gets the
    /// reserved one, which admits nothing; the Receiver uses [`PermitTable::open_all_at`]
    /// instead, which refuses, so that no such pull is ever sent.
    pub fn open_at(&self, pull: &PullWindow<'_>, now: Instant) -> u32 {
        match self.open_all_at(std::slice::from_ref(pull), now) {
            Ok(w) => w[0],
            Err(_) => Self::refuse(&mut self.lock(), pull, self.reserved()),
        }
    }

    /// Open a window for each of one batch's pulls, all or none, under one lock: `Err` (and
    /// nothing opened) when any pull would get no clean window. A pull with no request to
    /// admit gets the reserved window (nothing is expected through it).
    pub fn open_all_at(
        &self,
        pulls: &[PullWindow<'_>],
        now: Instant,
    ) -> Result<Vec<u32>, NoWindow> {
        if !self.enabled {
            return Ok(vec![0; pulls.len()]);
        }
        let reserved = self.reserved();
        let mut inner = self.lock();
        let mut chosen: SmallVec<[Option<u32>; 4]> = SmallVec::with_capacity(pulls.len());
        for (i, pull) in pulls.iter().enumerate() {
            if pull.requests.is_empty() || reserved == 0 {
                chosen.push(None);
                continue;
            }
            let repeated = pulls[..i].iter().any(|p| p.pull_id == pull.pull_id);
            match self.select(&mut inner, pull, repeated, &chosen, now) {
                Ok(w) => chosen.push(Some(w)),
                Err(why) => {
                    return Err(NoWindow {
                        needed: pulls.iter().filter(|p| !p.requests.is_empty()).count(),
                        in_use: self.live.load(Ordering::Relaxed) as usize,
                        poisoned: inner.poisoned.len(),
                        usable: reserved as usize,
                        why,
                    })
                }
            }
        }
        Ok(pulls
            .iter()
            .zip(chosen)
            .map(|(pull, w)| match w {
                Some(w) => self.install(&mut inner, pull, w),
                None => reserved,
            })
            .collect())
    }

    /// The clean window `pull` would get, none of `taken`; moves the cursor past it. Refusals
    /// are counted and logged (rate-limited) here.
    fn select(
        &self,
        inner: &mut Inner,
        pull: &PullWindow<'_>,
        repeated: bool,
        taken: &[Option<u32>],
        now: Instant,
    ) -> Result<u32, NoWindowReason> {
        let reserved = self.reserved();
        // A request's permits are found through their pull ids (`by_req`), so an id must name
        // one open permit at a time. Pull ids are process-unique (`messages::next_pull_ids`); a
        // caller of this table that repeats one while its permit is open gets no window, as
        // does a pull of more than u32::MAX requests (the index is a u32; the live-request cap
        // is far lower).
        let duplicate = repeated
            || inner
                .by_pull
                .get(&pull.pull_id)
                .is_some_and(|p| !p.is_closed());
        if duplicate || u32::try_from(pull.requests.len()).is_err() {
            tracing::error!(pull_id = pull.pull_id, duplicate, requests = pull.requests.len(),
                "pull refused a landing window: its id already has an open permit, or it is too large");
            return Err(NoWindowReason::InvalidPull);
        }
        // One P deployment whose writers keep ending up suspects (one that times out or
        // garbles every pull, whatever its DP ranks) may hold at most its share of the windows
        // poisoned once half of them are; past it its pulls get none, and every other
        // deployment keeps its windows.
        let deployment = &pull.requests[0].bootstrap_addr;
        let cap = self.deployment_poison_cap();
        let over = |inner: &Inner| {
            inner.poisoned.len() >= reserved as usize / 2
                && inner
                    .poisoned_by_deployment
                    .get(deployment)
                    .copied()
                    .unwrap_or(0)
                    >= cap
        };
        if over(inner) {
            self.expire(inner, now);
        }
        if over(inner) {
            self.labels.counter(m::WINDOWS_REFUSED_SHARE).increment(1);
            if let Some(unlogged) = inner.log_refusal(now) {
                tracing::error!(pull_id = pull.pull_id, peer = %pull.peer,
                    engine = %pull.requests[0].engine_id, bootstrap = %deployment, share = cap,
                    refused_unlogged = unlogged,
                    "P deployment holds its share of poisoned landing windows; this pull gets no window (further refusals logged at most every 10 s)");
            }
            return Err(NoWindowReason::DeploymentShare);
        }
        let free = |w: u32| {
            !taken.contains(&Some(w))
                && self.slots[w as usize]
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .permit()
                    .is_none_or(|p| p.is_closed())
        };
        // The peer's own windows first, oldest first: closed (the previous permit gone) and
        // clean, the cursor's test, except that a poisoned one leaves the ring even once its
        // poison expired. Cost: at most PEER_RING slot reads and one hash lookup per pull.
        let held = &mut *inner;
        let from_ring = match held.rings.get_mut(pull.peer) {
            Some(ring) => {
                let poisoned = &held.poisoned;
                ring.retain(|w| !poisoned.contains_key(w));
                ring.iter().copied().find(|&w| free(w))
            }
            None => None,
        };
        if let Some(w) = from_ring {
            return Ok(w);
        }
        let cursor = inner.cursor;
        let Some(window) = (0..reserved)
            .map(|i| (cursor + i) % reserved)
            .find(|&w| free(w) && self.clean(inner, w, now))
        else {
            self.epochs.exhausted.fetch_add(1, Ordering::Relaxed);
            self.labels.counter(m::WINDOWS_EXHAUSTED).increment(1);
            if let Some(unlogged) = inner.log_refusal(now) {
                tracing::error!(pull_id = pull.pull_id, peer = %pull.peer,
                    poisoned = inner.poisoned.len(), refused_unlogged = unlogged,
                    "no clean landing window is free; this pull gets none (further refusals logged at most every 10 s)");
            }
            return Err(NoWindowReason::Exhausted);
        };
        inner.cursor = (window + 1) % reserved;
        Ok(window)
    }

    /// Open `pull`'s permit in `window` (chosen by [`PermitTable::select`]).
    fn install(&self, inner: &mut Inner, pull: &PullWindow<'_>, window: u32) -> u32 {
        let deployment: Deployment = pull.requests[0].bootstrap_addr.clone();
        Self::ring_used(inner, pull.peer, window);
        let groups = pull
            .requests
            .iter()
            .map(|r| r.block_ids.len())
            .max()
            .unwrap_or(0);
        // Each group's list allocated once at its length (grown push by push, then shrunk, it
        // was four allocations per group and pull).
        let mut blocks: Vec<BlockOwners> = (0..groups)
            .map(|g| {
                let n = pull
                    .requests
                    .iter()
                    .filter_map(|r| r.block_ids.get(g))
                    .map(Vec::len);
                BlockOwners(Vec::with_capacity(n.sum()))
            })
            .collect();
        for (i, r) in pull.requests.iter().enumerate() {
            for (g, ids) in r.block_ids.iter().enumerate() {
                blocks[g].0.extend(ids.iter().map(|&b| (b, i as u32)));
            }
        }
        for g in &mut blocks {
            // The ledger admits a block to one live request at a time; were it listed twice,
            // the first owner keeps it.
            g.0.sort_by_key(|&(b, _)| b);
            let n = g.0.len();
            g.0.dedup_by_key(|&mut (b, _)| b);
            if g.0.len() < n {
                g.0.shrink_to_fit();
            }
        }
        let n = pull.requests.len();
        let span_cap = pull
            .requests
            .iter()
            .map(|r| {
                let pieces: u64 = (0u32..)
                    .zip(&r.block_ids)
                    .map(|(g, ids)| ids.len() as u64 * self.map.regions_in_group(g))
                    .sum();
                u32::try_from(pieces.saturating_mul(2).saturating_add(16)).unwrap_or(u32::MAX)
            })
            .collect();
        let permit = Arc::new(Permit {
            pull_id: pull.pull_id,
            peer: pull.peer.clone(),
            deployment: deployment.clone(),
            window,
            blocks,
            open: (0..n).map(|_| AtomicBool::new(true)).collect(),
            open_count: AtomicUsize::new(n),
            inflight: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            quiet: Notify::new(),
            coverage: Mutex::new(Vec::new()),
            covered: AtomicBool::new(false),
            span_cap,
            unproven: AtomicBool::new(false),
            open_writes: AtomicU64::new(0),
            bytes_landed: AtomicU64::new(0),
            writes_landed: AtomicU64::new(0),
        });
        // The window's previous permit closed and went then (`revoke`).
        *self.slots[window as usize]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Slot::Open(permit.clone());
        for (i, r) in (0u32..).zip(pull.requests) {
            inner.by_req.add(&r.req_id, pull.pull_id, i);
        }
        inner.by_pull.insert(pull.pull_id, permit);
        let live = self.live.fetch_add(1, Ordering::Relaxed) + 1;
        self.labels.gauge(m::LIVE_PERMITS).set(live as f64);
        window
    }

    /// `peer`'s pull got `window`: the newest of its ring.
    fn ring_used(inner: &mut Inner, peer: &PeerId, window: u32) {
        if !inner.rings.contains_key(peer) && inner.rings.len() >= MAX_RINGS {
            inner.rings.clear();
        }
        let ring = inner.rings.entry(peer.clone()).or_default();
        ring.retain(|&mut w| w != window);
        if ring.len() == PEER_RING {
            ring.remove(0);
        }
        ring.push(window);
    }

    /// The windows in `peer`'s ring, oldest first (tests).
    pub fn ring_of(&self, peer: &PeerId) -> Vec<u32> {
        self.lock()
            .rings
            .get(peer)
            .map(|r| r.to_vec())
            .unwrap_or_default()
    }

    /// Give `pull` the reserved window (it admits nothing): its requests' writes are refused
    /// and they fail with the reason [`NO_WINDOW`].
    fn refuse(inner: &mut Inner, pull: &PullWindow<'_>, reserved: u32) -> u32 {
        for r in pull.requests {
            inner.windowless.insert(r.req_id.clone());
        }
        reserved
    }

    /// Whether closed window `w` may be handed out: not poisoned, or its poison expired.
    fn clean(&self, inner: &mut Inner, w: u32, now: Instant) -> bool {
        match inner.poisoned.get(&w) {
            None => true,
            Some((until, _)) if *until <= now => {
                self.unpoison(inner, w);
                tracing::warn!(
                    window = w,
                    "poisoned landing window back in rotation at its last-resort deadline"
                );
                true
            }
            Some(_) => false,
        }
    }

    /// Window `w`'s poison has expired: back in rotation, off its deployment's count.
    fn unpoison(&self, inner: &mut Inner, w: u32) {
        let Some((_, deployment)) = inner.poisoned.remove(&w) else {
            return;
        };
        if let Some(n) = inner.poisoned_by_deployment.get_mut(&deployment) {
            *n -= 1;
            if *n == 0 {
                inner.poisoned_by_deployment.remove(&deployment);
            }
        }
        self.epochs.poison_expired.fetch_add(1, Ordering::Relaxed);
        self.labels
            .gauge(m::POISONED_WINDOWS)
            .set(inner.poisoned.len() as f64);
    }

    /// Unpoison every window whose poison has expired, if one is due (windows are otherwise
    /// unpoisoned when the rotation reaches them, which a capped engine's pulls never do).
    fn expire(&self, inner: &mut Inner, now: Instant) {
        if inner.next_expiry.is_none_or(|t| t > now) {
            return;
        }
        let due: Vec<u32> = inner
            .poisoned
            .iter()
            .filter(|(_, (until, _))| *until <= now)
            .map(|(w, _)| *w)
            .collect();
        if !due.is_empty() {
            tracing::warn!(
                windows = due.len(),
                "poisoned landing windows back in rotation at their last-resort deadline"
            );
        }
        for w in due {
            self.unpoison(inner, w);
        }
        inner.next_expiry = inner.poisoned.values().map(|(until, _)| *until).min();
    }

    /// Most windows one P deployment (bootstrap server) may hold poisoned before its pulls get
    /// no window, once half of all windows are poisoned: an eighth of the usable ones (2,047 of
    /// the default 16,384), all of them in tables too small to share (under 64 usable: tests,
    /// `repro`). Pulls already open when it is reached may still add theirs.
    pub fn deployment_poison_cap(&self) -> usize {
        let usable = self.reserved() as usize;
        if usable >= 64 {
            usable / 8
        } else {
            usable
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
        let pairs = inner.by_req.remove(&r.req.req_id);
        if !inner.windowless.is_empty() {
            inner.windowless.remove(&r.req.req_id);
        }
        // The permits are looked at in place under the lock (no `Arc` clone each); only one
        // with a socket read still copying is kept, to wait for.
        let Inner {
            by_pull,
            poisoned: poisoned_windows,
            poisoned_by_deployment,
            next_expiry,
            ..
        } = &mut *inner;
        let mut poisoned = 0;
        let mut busy: Vec<Arc<Permit>> = Vec::new();
        let mut closed: SmallVec<[PullId; 2]> = SmallVec::new();
        for (pull, i) in pairs {
            let Some(p) = by_pull.get(&pull) else {
                // Cannot happen (see `by_req`); were it to, that pull's permit is gone with its
                // window, and nothing of it can admit a write.
                tracing::error!(pull_id = pull, "request indexed in a pull with no permit");
                continue;
            };
            if p.open[i].swap(false, Ordering::SeqCst)
                && p.open_count.fetch_sub(1, Ordering::AcqRel) == 1
            {
                let live = self.live.fetch_sub(1, Ordering::Relaxed) - 1;
                self.labels.gauge(m::LIVE_PERMITS).set(live as f64);
                closed.push(pull);
            }
            // Coverage only backs an ok before the revocation: a closed permit keeps none of it
            // (a write still copying may hold the permit a while). Nothing to drop, and no lock
            // to take, while nothing has landed through the permit.
            if p.covered.load(Ordering::Acquire) {
                let mut cov = p.coverage.lock().unwrap_or_else(|e| e.into_inner());
                if p.is_closed() {
                    *cov = Vec::new();
                } else if let Some(spans) = cov.get_mut(i) {
                    *spans = Vec::new();
                }
            }
            if self.poison && r.suspects.contains(&p.peer) {
                match poisoned_windows.get_mut(&p.window) {
                    Some((until, _)) => *until = (*until).max(r.poison_until),
                    None => {
                        poisoned_windows.insert(p.window, (r.poison_until, p.deployment.clone()));
                        *poisoned_by_deployment
                            .entry(p.deployment.clone())
                            .or_default() += 1;
                    }
                }
                *next_expiry = Some(next_expiry.map_or(r.poison_until, |t| t.min(r.poison_until)));
                poisoned += 1;
                tracing::info!(window = p.window, pull_id = p.pull_id, peer = %p.peer,
                    req_id = %r.req.req_id, "landing window poisoned: its writer may still write");
            }
            // Reads admitted before the swap finish their current socket read (bounded: one
            // non-blocking read syscall, or one device copy); every later one sees the closed
            // permit.
            p.draining.store(true, Ordering::SeqCst);
            if p.inflight.load(Ordering::SeqCst) != 0 {
                busy.push(p.clone());
            }
        }
        // No request indexes a closed pull any more: it leaves the table, and its window
        // refuses what comes late without it (a write still copying holds its own reference).
        for pull in closed {
            if let Some(p) = by_pull.remove(&pull) {
                let mut slot = self.slots[p.window as usize]
                    .write()
                    .unwrap_or_else(|e| e.into_inner());
                if matches!(&*slot, Slot::Open(q) if Arc::ptr_eq(q, &p)) {
                    *slot = Slot::Closed;
                }
            }
        }
        if poisoned > 0 {
            self.epochs
                .poisoned
                .fetch_add(poisoned as u64, Ordering::Relaxed);
            self.labels
                .counter(m::WINDOWS_POISONED)
                .increment(poisoned as u64);
            self.labels
                .gauge(m::POISONED_WINDOWS)
                .set(inner.poisoned.len() as f64);
        }
        drop(inner);
        Revoked {
            revocation: Revocation::Exact,
            poisoned,
            quiesced: (!busy.is_empty())
                .then(|| Box::pin(quiesce(busy)) as futures::future::BoxFuture<'static, ()>),
        }
    }

    /// Admission check for `[addr, addr + size)` already resolved to `r`, for `access`. A v1
    /// write (no acknowledgement) makes its pull's oks checked against the byte count; so does
    /// a write that ends without [`Admitted::landed`].
    pub fn admit(&self, r: &Resolved, size: u64, access: Access) -> Result<Admitted, RejectReason> {
        if self.paused.load(Ordering::SeqCst) {
            return Err(RejectReason::Paused);
        }
        if !self.enabled {
            return Ok(Admitted {
                permit: None,
                reqs: vec![],
                pieces: SmallVec::new(),
                open_write: AtomicBool::new(false),
            });
        }
        let permit = match self
            .slots
            .get(r.window as usize)
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).clone())
        {
            Some(Slot::Open(p)) => p,
            // A late write: its pull's every request was revoked.
            Some(Slot::Closed) => return Err(RejectReason::Revoked),
            Some(Slot::Unused) | None => return Err(RejectReason::NoPermit),
        };
        if access
            == (Access::Write {
                acknowledged: false,
            })
        {
            permit.unproven.store(true, Ordering::Release);
        }
        let group = self.map.group(r.region) as usize;
        let (first, last) = self.map.blocks(r.region, r.offset, size);
        let owners = permit.blocks.get(group).ok_or(RejectReason::NoPermit)?;
        let bl = self.map.block_len(r.region);
        // Only the first `kv_block_len` bytes of a block are KV data: bytes written into the
        // padding after them back nothing.
        let kv = self.map.kv_block_len(r.region).min(bl);
        let mut reqs: Vec<usize> = Vec::with_capacity(1);
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        for b in first..=last {
            let i = owners.get(b).ok_or(RejectReason::NoPermit)?;
            let lo = u64::from(b) * bl;
            if !reqs.contains(&i) {
                reqs.push(i);
            }
            let (start, end) = (r.offset.max(lo), (r.offset + size).min(lo + kv));
            if start < end {
                pieces.push(Piece {
                    req: i as u32,
                    span: (r.region as u32, start, end),
                });
            }
        }
        if reqs.iter().any(|&i| !permit.open[i].load(Ordering::SeqCst)) {
            return Err(RejectReason::Revoked);
        }
        let write = matches!(access, Access::Write { .. });
        if write {
            permit.open_writes.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Admitted {
            permit: Some(permit),
            reqs,
            pieces,
            open_write: AtomicBool::new(write),
        })
    }

    /// Whether a pull of `req` got the reserved window (its writes are all refused).
    pub fn windowless(&self, req: &ReqId) -> bool {
        self.lock().is_windowless(req)
    }

    /// Whether every peer's ok for `req` is backed by what landed (PROTOCOL.md §5.3): a pull
    /// that got no window landed nothing, and where an ok is unproven (a v1 write was seen, or
    /// a write ended before its last byte, or one is still open) the bytes landed in the
    /// request's blocks must add up to what its blocks receive. Otherwise v2 acknowledgements
    /// already prove placement, so the request passes. Call before the request is revoked.
    pub fn verify_ok(&self, req: &RequestMeta) -> Result<(), String> {
        if !self.enabled || !req.is_awaiting() {
            return Ok(());
        }
        let inner = self.lock();
        if inner.is_windowless(&req.req_id) {
            return Err(
                "a pull of this request got no landing window: its writes were refused".into(),
            );
        }
        let pairs = inner.by_req.get(&req.req_id);
        // `open_writes` first: a write that ends unlanded sets `unproven` before it leaves
        // `open_writes`, so reading them the other way round could miss both. Looked at in
        // place (no permit is cloned) for the common case: every ok already proven.
        if !pairs.iter().any(|(pull, _)| {
            inner.by_pull.get(pull).is_some_and(|p| {
                p.open_writes.load(Ordering::Acquire) > 0 || p.unproven.load(Ordering::Acquire)
            })
        }) {
            return Ok(());
        }
        let entries = inner.permits_of(pairs);
        // Offsets within a region are the same in every window: the union over every pull of
        // the request is what physically landed in its blocks.
        let mut ranges: Vec<Span> = Vec::new();
        for (p, i) in &entries {
            let cov = p.coverage.lock().unwrap_or_else(|e| e.into_inner());
            ranges.extend(cov.get(*i).into_iter().flatten());
        }
        drop(inner);
        let landed = union_len(ranges);
        let expected: u64 = req
            .block_ids
            .iter()
            .enumerate()
            .map(|(g, ids)| ids.len() as u64 * self.map.kv_bytes_per_block(g as u32))
            .sum();
        if landed < expected {
            return Err(format!(
                "peers reported ok but {landed} of {expected} bytes landed (a v1 \
                 unacknowledged write, or a write cut short or still open)"
            ));
        }
        Ok(())
    }

    /// Byte accounting of `pull` while its permit is open.
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
    /// The data server's memory, swapped by a resume on new memory (`None`: not swappable).
    memory: Option<Arc<super::memory_slot::MemorySlot>>,
}

impl TcpLanding {
    /// `host:port` is the handshake daemon P's TE contacts.
    pub fn new(permits: Arc<PermitTable>, host: &str, port: u16) -> Self {
        TcpLanding {
            permits,
            host: host.to_owned(),
            port: u32::from(port),
            memory: None,
        }
    }

    /// The data server's memory slot, which [`Landing::resume_on`] swaps.
    pub fn with_memory(mut self, slot: Arc<super::memory_slot::MemorySlot>) -> Self {
        self.memory = Some(slot);
        self
    }

    /// The permit table.
    pub fn permits(&self) -> &Arc<PermitTable> {
        &self.permits
    }
}

impl Landing for TcpLanding {
    fn endpoint(&self) -> (&str, u32) {
        (&self.host, self.port)
    }

    fn open_pull(&self, window: &PullWindow<'_>) -> crate::rdma::RegionBases {
        if self.permits.is_paused() {
            // Admission is closed while paused; a pull that got here anyway lands nothing.
            return self.permits.reserved_bases();
        }
        let w = self.permits.open(window);
        self.permits.map().region_bases(w)
    }

    fn open_pulls(&self, windows: &[PullWindow<'_>]) -> Result<Vec<RegionBases>, NoWindow> {
        let map = self.permits.map();
        Ok(self
            .permits
            .open_all_at(windows, Instant::now())?
            .into_iter()
            .map(|w| map.region_bases(w))
            .collect())
    }

    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        self.permits.revoke(r)
    }

    fn verify_ok(&self, req: &RequestMeta) -> Result<(), String> {
        self.permits.verify_ok(req)
    }

    fn failure_context(&self, req: &RequestMeta) -> Option<String> {
        self.permits
            .windowless(&req.req_id)
            .then(|| NO_WINDOW.to_owned())
    }

    /// Every permit is closed already (each request's completion revoked its own before the
    /// pause was called); from now on the data server refuses every write as `paused`.
    fn pause(&self) -> Result<(), crate::rdma::LandingPauseError> {
        self.permits.set_paused(true);
        Ok(())
    }

    fn resume(&self) -> Result<(), crate::rdma::LandingPauseError> {
        self.permits.set_paused(false);
        Ok(())
    }

    /// The data server's memory swapped while every write is refused and no permit is open
    /// (each request's completion revoked its own, and quiesced, before the pause): no write
    /// admitted before the pause passes its gate again, so none touches the old memory, and
    /// every write admitted after the unpause takes the new one (`MemorySlot`).
    fn resume_on(
        &self,
        memory: &crate::rdma::memory::HostMemory,
    ) -> Result<(), crate::rdma::LandingPauseError> {
        use crate::rdma::LandingPauseError as E;
        let Some(slot) = &self.memory else {
            return Err(E::Unsupported("no swappable memory".into()));
        };
        if !self.permits.is_paused() {
            return Err(E::Failed(
                "not paused: the memory is swapped only while paused".into(),
            ));
        }
        if !self.permits.enabled() {
            // Nothing gates a write in flight: one admitted before the pause may still copy.
            return Err(E::Unsupported(
                "landing permits are off: a write in flight cannot be kept out of the old memory"
                    .into(),
            ));
        }
        if slot.current().is_staged() {
            return Err(E::Unsupported(
                "the worker lands in device memory; new host memory is not supported".into(),
            ));
        }
        if self.permits.live() > 0 {
            return Err(E::Failed(format!(
                "{} landing permits still open while paused",
                self.permits.live()
            )));
        }
        let spans = self.permits.map().region_spans();
        let needed: Vec<u64> = spans.iter().map(|&(_, len)| len).collect();
        crate::rdma::memory_fit::check_fit(memory, &needed)?;
        let fresh = crate::rdma::memory::RegisteredMemory::host_owned(memory.clone(), &spans)
            .map_err(|e| E::Failed(e.to_string()))?;
        // The old memory goes when the last revoked write holding it ends; none reads it.
        drop(slot.replace(Arc::new(fresh)));
        self.permits.set_paused(false);
        tracing::info!("TCP landing resumed on new memory");
        Ok(())
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::layout::KvLayout;
    use crate::messages::RequestMeta;

    /// A deployment past its share refuses every pull: the error line comes at most every
    /// 10 s, with how many refusals went unlogged since the last one.
    #[test]
    fn refusals_are_logged_at_most_every_ten_seconds() {
        let mut inner = Inner::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(inner.log_refusal(t0), Some(0));
        assert_eq!(inner.log_refusal(t0 + s(1)), None);
        assert_eq!(inner.log_refusal(t0 + s(9)), None);
        assert_eq!(inner.log_refusal(t0 + s(10)), Some(2));
        assert_eq!(inner.log_refusal(t0 + s(11)), None);
    }

    fn table(windows: u32) -> PermitTable {
        let map = WindowMap::new(&KvLayout::uniform(1, 4096, 4), 0x7e00_0000_0000, windows);
        PermitTable::new(Arc::new(map.unwrap()), true)
    }

    fn req(id: &str) -> Arc<RequestMeta> {
        Arc::new(RequestMeta {
            req_id: id.into(),
            transfer_id: id.into(),
            engine_id: "e".into(),
            bootstrap_addr: "http://127.0.0.1:1".into(),
            block_ids: vec![vec![0]],
        })
    }

    fn open(t: &PermitTable, pull_id: PullId, peer: &PeerId, r: &Arc<RequestMeta>) -> u32 {
        t.open(&PullWindow {
            pull_id,
            peer,
            requests: std::slice::from_ref(r),
        })
    }

    fn revoke(t: &PermitTable, r: &RequestMeta, suspects: &[PeerId], until: Instant) -> Revoked {
        t.revoke(&RevokeRequest {
            req: r,
            suspects,
            poison_until: until,
        })
    }

    /// A batch's pulls get their windows all or none: one that cannot leaves every window as
    /// it was (nothing opened, nothing marked windowless) and says how many are held.
    #[test]
    fn a_batch_gets_a_window_for_every_pull_or_none_at_all() {
        let t = table(4); // windows 0..=2 usable, 3 reserved
        let (p, q) = (PeerId::new("p"), PeerId::new("q"));
        let (a, b) = (req("a"), req("b"));
        let batch = |id: PullId, r: &Arc<RequestMeta>| {
            t.open_all_at(
                &[
                    PullWindow {
                        pull_id: id,
                        peer: &p,
                        requests: std::slice::from_ref(r),
                    },
                    PullWindow {
                        pull_id: id + 1,
                        peer: &q,
                        requests: std::slice::from_ref(r),
                    },
                ],
                Instant::now(),
            )
        };
        assert_eq!(batch(1, &a), Ok(vec![0, 1]));
        let e = batch(3, &b).unwrap_err();
        assert_eq!(
            (e.needed, e.in_use, e.poisoned, e.usable, e.why),
            (2, 2, 0, 3, NoWindowReason::Exhausted)
        );
        assert!(
            e.to_string().starts_with(crate::rdma::NO_CLEAN_WINDOW),
            "{e}"
        );
        assert!(!t.windowless(&b.req_id), "nothing was sent for it");
        // Window 2 was not taken by the refused batch: a single pull still gets it.
        assert_eq!(open(&t, 5, &PeerId::new("r"), &req("c")), 2);
        // Once `a` completes, its windows come back and `b`'s batch goes through.
        revoke(&t, &a, &[], Instant::now());
        assert_eq!(batch(6, &b), Ok(vec![0, 1]));
    }

    #[test]
    fn a_suspect_window_stays_out_of_rotation_until_its_deadline() {
        let t = table(4); // windows 0..=2 usable, 3 reserved
        let (p, q) = (PeerId::new("p"), PeerId::new("q"));
        let (a, b) = (req("a"), req("b"));
        assert_eq!(open(&t, 1, &p, &a), 0);
        assert_eq!(open(&t, 2, &q, &a), 1);
        let soon = Instant::now() + Duration::from_secs(3600);
        // Only the suspect peer's pull is poisoned; the other closes clean.
        let r = revoke(&t, &a, std::slice::from_ref(&p), soon);
        assert_eq!((r.revocation, r.poisoned), (Revocation::Exact, 1));
        assert!(r.quiesced.is_none(), "nothing was copying");
        assert_eq!(t.poisoned_windows(), 1);
        // Round robin continues at 2, then skips poisoned 0 for the clean 1 (pulls of peers
        // without a ring of windows: the cursor's rotation; the rings are tested below).
        let q = PeerId::new("q2");
        assert_eq!(open(&t, 3, &q, &b), 2);
        assert_eq!(open(&t, 4, &PeerId::new("q3"), &req("c")), 1);
        // Every clean window busy, 0 poisoned: fail safe, never reuse it.
        assert_eq!(
            open(&t, 5, &PeerId::new("q4"), &req("d")),
            3,
            "the reserved window"
        );
        assert_eq!(t.epochs().exhausted.load(Ordering::Relaxed), 1);
        // Past the last-resort deadline the window returns.
        let e = req("e");
        let pull = PullWindow {
            pull_id: 6,
            peer: &q,
            requests: std::slice::from_ref(&e),
        };
        assert_eq!(t.open_at(&pull, soon - Duration::from_millis(1)), 3);
        assert_eq!(t.open_at(&pull, soon), 0);
        assert_eq!(t.epochs().poison_expired.load(Ordering::Relaxed), 1);
        assert_eq!(t.poisoned_windows(), 0);
    }

    /// A write into request `r`'s block 0 through window `w` (one block of group 0).
    fn admits(t: &PermitTable, w: u32) -> bool {
        let r = Resolved {
            window: w,
            region: 0,
            offset: 0,
            mem_offset: 0,
        };
        t.admit(&r, 4096, Access::Write { acknowledged: true })
            .is_ok()
    }

    /// Permits are found by pull id: an id that already names an open permit (two coordinators
    /// numbering their pulls alike over one landing) must not take it over. The second pull gets
    /// the window that admits nothing, and the first request is still revoked exactly.
    #[test]
    fn a_pull_id_with_an_open_permit_is_refused_a_window() {
        let t = table(4);
        let (p, q) = (PeerId::new("p"), PeerId::new("q"));
        let (a, b) = (req("a"), req("b"));
        let wa = open(&t, 7, &p, &a);
        assert_eq!(wa, 0);
        assert_eq!(open(&t, 7, &q, &b), 3, "the reserved window");
        assert!(t.windowless(&b.req_id));
        assert!(
            t.verify_ok(&b).is_err(),
            "b's writes were refused: no ok for it"
        );
        assert!(admits(&t, wa), "a's window still admits a's writes");
        revoke(&t, &a, &[], Instant::now());
        assert!(!admits(&t, wa), "revoking a closes a's own permit");
    }

    /// A closed permit's id may be taken again; reusing the old permit's window later must not
    /// drop the new permit from the index, or revoking its request would miss it.
    #[test]
    fn reusing_a_window_keeps_a_newer_permit_of_the_same_pull_id() {
        let t = table(3); // windows 0 and 1, 2 reserved
        let p = PeerId::new("p");
        let (a, b, c) = (req("a"), req("b"), req("c"));
        assert_eq!(open(&t, 5, &p, &a), 0);
        revoke(&t, &a, &[], Instant::now());
        // Other peers: the cursor's rotation (p's ring would give it window 0 again).
        let wb = open(&t, 5, &PeerId::new("p2"), &b);
        assert_eq!(wb, 1, "id 5 again, its old permit being closed");
        assert_eq!(
            open(&t, 6, &PeerId::new("p3"), &c),
            0,
            "window 0 reused: the old permit of id 5 leaves"
        );
        assert!(admits(&t, wb));
        assert_eq!(
            revoke(&t, &b, &[], Instant::now()).revocation,
            Revocation::Exact
        );
        assert!(
            !admits(&t, wb),
            "b's permit was still found by its pull id and closed"
        );
    }

    /// A write into block `block` through window `w`: admitted, or why not.
    fn write_into(t: &PermitTable, w: u32, block: u64) -> Result<(), RejectReason> {
        let r = Resolved {
            window: w,
            region: 0,
            offset: block * 4096,
            mem_offset: block * 4096,
        };
        t.admit(&r, 4096, Access::Write { acknowledged: true })
            .map(|_| ())
    }

    /// Once a pull's last request is revoked its window admits nothing and calls every write
    /// into it late, its pull's blocks or not, until the window's next pull; its permit leaves
    /// the index (its accounting with it). A window never opened, and a block an open pull does
    /// not own, have no permit.
    #[test]
    fn a_closed_window_refuses_every_write_as_late_until_its_next_pull() {
        let t = table(3); // windows 0 and 1, 2 reserved
        let p = PeerId::new("p");
        let (a, b) = (req("a"), req("b")); // block 0 each
        assert_eq!(open(&t, 1, &p, &a), 0);
        assert_eq!(write_into(&t, 0, 0), Ok(()));
        assert_eq!(
            write_into(&t, 0, 1),
            Err(RejectReason::NoPermit),
            "not a's block"
        );
        assert_eq!(
            write_into(&t, 1, 0),
            Err(RejectReason::NoPermit),
            "never opened"
        );
        assert!(t.pull_bytes(1).is_some_and(|b| b.open));
        revoke(&t, &a, &[], Instant::now());
        for block in 0..4 {
            assert_eq!(
                write_into(&t, 0, block),
                Err(RejectReason::Revoked),
                "block {block}"
            );
        }
        assert!(
            t.pull_bytes(1).is_none(),
            "a closed permit leaves the index"
        );
        // Another peer: the cursor's rotation (p's ring would give it window 0 again).
        assert_eq!(
            open(&t, 2, &PeerId::new("p2"), &b),
            1,
            "round robin: window 1 next"
        );
        assert_eq!(
            write_into(&t, 0, 0),
            Err(RejectReason::Revoked),
            "0 still closed"
        );
        revoke(&t, &b, &[], Instant::now());
        let c = req("c");
        assert_eq!(
            open(&t, 3, &PeerId::new("p3"), &c),
            0,
            "window 0 comes round again"
        );
        assert_eq!(write_into(&t, 0, 0), Ok(()), "c's pull admits its block");
        assert_eq!(write_into(&t, 0, 1), Err(RejectReason::NoPermit));
    }

    #[test]
    fn without_the_epoch_rule_a_suspect_window_is_reused_at_once() {
        let t = table(3).without_epoch_rule();
        let p = PeerId::new("p");
        let a = req("a");
        assert_eq!(open(&t, 1, &p, &a), 0);
        let far = Instant::now() + Duration::from_secs(3600);
        assert_eq!(revoke(&t, &a, std::slice::from_ref(&p), far).poisoned, 0);
        assert_eq!(open(&t, 2, &PeerId::new("p2"), &req("b")), 1);
        assert_eq!(open(&t, 3, &PeerId::new("p3"), &req("c")), 0, "reissued");
    }

    /// A peer's pulls reuse the windows of its ring (oldest first) while they are closed and
    /// clean, instead of the cursor's next: its layout ids recur. A poisoned window leaves the
    /// ring for good; a window still open is skipped.
    #[test]
    fn a_peers_ring_reuses_its_closed_windows_and_never_a_poisoned_one() {
        let t = table(17); // 16 usable
        let (p, q) = (PeerId::new("p"), PeerId::new("q"));
        let (a, b) = (req("a"), req("b"));
        assert_eq!(open(&t, 1, &p, &a), 0);
        assert_eq!(open(&t, 2, &p, &b), 1, "0 is open: the cursor's next");
        assert_eq!(open(&t, 3, &q, &req("x")), 2);
        revoke(&t, &a, &[], Instant::now());
        revoke(&t, &b, &[], Instant::now());
        assert_eq!(t.ring_of(&p), [0, 1]);
        // Round robin would say 3; p's ring has 0 and 1, closed and clean: the oldest first.
        for n in 0..20 {
            let r = req(&format!("r{n}"));
            let w = open(&t, 10 + n, &p, &r);
            assert!(w == 0 || w == 1, "pull {n} got window {w}");
            revoke(&t, &r, &[], Instant::now());
        }
        // p's pull made a suspect: its window is poisoned and leaves the ring.
        let c = req("c");
        let wc = open(&t, 40, &p, &c);
        let far = Instant::now() + Duration::from_secs(3600);
        assert_eq!(revoke(&t, &c, std::slice::from_ref(&p), far).poisoned, 1);
        for n in 0..20 {
            let r = req(&format!("s{n}"));
            let w = open(&t, 50 + n, &p, &r);
            assert_ne!(w, wc, "never the poisoned window");
            revoke(&t, &r, &[], Instant::now());
        }
        assert!(!t.ring_of(&p).contains(&wc));
        // Even once its poison expired the ring does not take it back; only the cursor can.
        let d = req("d");
        let pull = PullWindow {
            pull_id: 80,
            peer: &p,
            requests: std::slice::from_ref(&d),
        };
        assert_ne!(t.open_at(&pull, far), wc);
        // A ring is bounded, and a peer with every ring window open takes the cursor's.
        let open_ones: Vec<_> = (0..PEER_RING as u64 + 2)
            .map(|n| {
                let r = req(&format!("o{n}"));
                (open(&t, 100 + n, &q, &r), r)
            })
            .collect();
        let mut got: Vec<u32> = open_ones.iter().map(|(w, _)| *w).collect();
        got.sort();
        got.dedup();
        assert_eq!(
            got.len(),
            PEER_RING + 2,
            "distinct windows while all are open"
        );
        assert_eq!(t.ring_of(&q).len(), PEER_RING);
    }

    fn req_of(id: &str, engine: &str, bootstrap: &str) -> Arc<RequestMeta> {
        Arc::new(RequestMeta {
            engine_id: engine.into(),
            bootstrap_addr: bootstrap.into(),
            ..(*req(id)).clone()
        })
    }

    /// Once half the windows are poisoned, a P deployment whose writers keep ending up suspects
    /// (through any of its DP ranks' engine ids) gets no window past its share: other
    /// deployments (the same engine id behind another bootstrap server included) keep theirs,
    /// and it gets windows again once enough poison expired, not before.
    #[test]
    fn under_pressure_a_deployment_holds_at_most_its_share_of_poisoned_windows() {
        let t = table(129); // 128 usable: a share of 16, pressure from 64 poisoned
        assert_eq!(t.deployment_poison_cap(), 16);
        let reserved = 128;
        let (p, q) = (PeerId::new("p"), PeerId::new("q"));
        let now = Instant::now();
        let (first, second) = (
            now + Duration::from_secs(60),
            now + Duration::from_secs(120),
        );
        // Twelve DP ranks behind one bootstrap server: one deployment.
        let bad = |i: u64| req_of(&format!("bad-{i}"), &format!("bad{}", i % 12), "http://b:1");
        let open_at = |pull_id, peer: &PeerId, r: &Arc<RequestMeta>, at| {
            t.open_at(
                &PullWindow {
                    pull_id,
                    peer,
                    requests: std::slice::from_ref(r),
                },
                at,
            )
        };
        // Past its share but under pressure-free conditions it keeps getting windows.
        for i in 0..64u64 {
            let r = bad(i);
            assert_ne!(open_at(i + 1, &p, &r, now), reserved, "pull {i}");
            revoke(
                &t,
                &r,
                std::slice::from_ref(&p),
                if i < 32 { first } else { second },
            );
        }
        assert_eq!(t.poisoned_windows(), 64);
        let next = bad(64);
        assert_eq!(
            open_at(100, &p, &next, now),
            reserved,
            "at its share, under pressure"
        );
        assert!(t.windowless(&next.req_id));
        let good = req_of("good", "good", "http://g:1");
        assert_ne!(open_at(101, &q, &good, now), reserved, "another engine");
        let twin = req_of("twin", "bad0", "http://other:1");
        assert_ne!(
            open_at(102, &q, &twin, now),
            reserved,
            "same id, other bootstrap"
        );
        // Nothing expires early.
        let early = first - Duration::from_millis(1);
        assert_eq!(open_at(103, &p, &bad(65), early), reserved);
        assert_eq!(t.poisoned_windows(), 64);
        // The first half of its poison expires: no pressure, windows again (no rotation needed).
        let later = first + Duration::from_millis(1);
        assert_ne!(open_at(104, &p, &bad(66), later), reserved);
        assert_eq!(t.poisoned_windows(), 32);
    }

    /// A window poisoned again (another request of the same pull) counts once for its engine.
    #[test]
    fn a_window_poisoned_twice_counts_once() {
        let t = table(3);
        let p = PeerId::new("p");
        let (a, b) = (
            req_of("a", "e", "http://b:1"),
            req_of("b", "e", "http://b:1"),
        );
        t.open(&PullWindow {
            pull_id: 1,
            peer: &p,
            requests: &[a.clone(), b.clone()],
        });
        let far = Instant::now() + Duration::from_secs(60);
        revoke(&t, &a, std::slice::from_ref(&p), far);
        revoke(&t, &b, std::slice::from_ref(&p), far);
        let inner = t.lock();
        assert_eq!(inner.poisoned.len(), 1);
        assert_eq!(
            inner
                .poisoned_by_deployment
                .values()
                .copied()
                .collect::<Vec<_>>(),
            vec![1]
        );
    }

    /// What a permit keeps to back an ok goes at the revocation, not when its window is reused
    /// (which may be thousands of pulls later).
    #[test]
    fn a_revoked_requests_coverage_is_dropped() {
        let t = table(3);
        let p = PeerId::new("p");
        let a = req("a");
        let w = open(&t, 1, &p, &a);
        let r = Resolved {
            window: w,
            region: 0,
            offset: 0,
            mem_offset: 0,
        };
        let admitted = t
            .admit(&r, 4096, Access::Write { acknowledged: true })
            .unwrap();
        admitted.landed(4096);
        drop(admitted);
        let permit = t.lock().by_pull.get(&1).cloned().unwrap();
        assert_eq!(*permit.coverage.lock().unwrap(), vec![vec![(0, 0, 4096)]]);
        revoke(&t, &a, &[], Instant::now());
        assert!(permit.coverage.lock().unwrap().is_empty());
    }

    /// Bytes written into a block's padding (past its `kv_block_len`) do not back an ok; a
    /// request's contiguous writes keep one span.
    #[test]
    fn padding_bytes_back_no_ok_and_contiguous_writes_merge() {
        let mut layout = KvLayout::uniform(1, 4096, 4);
        layout.regions[0].kv_block_len = 2048;
        let map = WindowMap::new(&layout, 0x7e00_0000_0000, 3).unwrap();
        let t = PermitTable::new(Arc::new(map), true);
        let p = PeerId::new("p");
        let a = req("a");
        let w = open(&t, 1, &p, &a);
        let at = |offset| Resolved {
            window: w,
            region: 0,
            offset,
            mem_offset: offset,
        };
        let v1 = Access::Write {
            acknowledged: false,
        };
        // A v1 writer fills block 0's padding only: 2048 bytes landed, none of them KV data.
        t.admit(&at(2048), 2048, v1).unwrap().landed(2048);
        let err = t.verify_ok(&a).expect_err("padding is no KV data");
        assert!(err.contains("0 of 2048"), "{err}");
        // Then the data, in two contiguous writes: one span, the ok is backed.
        t.admit(&at(0), 1024, v1).unwrap().landed(1024);
        t.admit(&at(1024), 1024, v1).unwrap().landed(1024);
        assert_eq!(t.verify_ok(&a), Ok(()));
        let permit = t.lock().by_pull.get(&1).cloned().unwrap();
        assert_eq!(*permit.coverage.lock().unwrap(), vec![vec![(0, 0, 2048)]]);
    }

    proptest::proptest! {
        /// Spans stay sorted, apart and exactly the union of what was added, whatever order
        /// and overlap the pieces come in.
        #[test]
        fn spans_are_the_sorted_union_of_the_pieces(
            pieces in proptest::collection::vec((0u32..3, 0u64..64, 1u64..16), 0..40)
        ) {
            let mut spans = Vec::new();
            let mut all = Vec::new();
            for (region, start, len) in pieces {
                add_span(&mut spans, (region, start, start + len), usize::MAX);
                all.push((region, start, start + len));
            }
            for w in spans.windows(2) {
                proptest::prop_assert!(
                    w[0].0 < w[1].0 || w[0].2 < w[1].1,
                    "sorted and apart: {:?}", spans
                );
            }
            let total: u64 = spans.iter().map(|s| s.2 - s.1).sum();
            proptest::prop_assert_eq!(total, union_len(all));
        }
    }

    /// A writer that scatters bytes (1-byte writes, every other byte) cannot grow a permit's
    /// coverage past its cap; what was dropped is under-counted, so the ok fails.
    #[test]
    fn scattered_writes_are_capped_and_fail_the_ok() {
        let t = table(3);
        let p = PeerId::new("p");
        let a = req("a");
        let w = open(&t, 1, &p, &a);
        let v1 = Access::Write {
            acknowledged: false,
        };
        for off in (0..4096).step_by(2) {
            let r = Resolved {
                window: w,
                region: 0,
                offset: off,
                mem_offset: off,
            };
            t.admit(&r, 1, v1).unwrap().landed(1);
        }
        let permit = t.lock().by_pull.get(&1).cloned().unwrap();
        // One block of one region: 2 * 1 + 16.
        assert_eq!(permit.coverage.lock().unwrap()[0].len(), 18);
        assert!(t.verify_ok(&a).is_err());
        // Filling the gaps merges the kept spans back into one, and proves the ok.
        let r = Resolved {
            window: w,
            region: 0,
            offset: 0,
            mem_offset: 0,
        };
        t.admit(&r, 4096, v1).unwrap().landed(4096);
        assert_eq!(*permit.coverage.lock().unwrap(), vec![vec![(0, 0, 4096)]]);
        assert_eq!(t.verify_ok(&a), Ok(()));
    }

    #[test]
    fn coverage_counts_overlapping_and_repeated_ranges_once_per_region() {
        assert_eq!(union_len(vec![]), 0);
        assert_eq!(
            union_len(vec![(0, 0, 10), (0, 0, 10), (0, 5, 15), (0, 20, 30)]),
            25
        );
        assert_eq!(union_len(vec![(1, 0, 10), (0, 0, 10)]), 20, "regions apart");
        assert_eq!(union_len(vec![(0, 10, 20), (0, 0, 10)]), 20, "adjacent");
    }

    #[tokio::test]
    async fn revocation_waits_for_a_read_in_the_gate_without_spinning() {
        let t = table(3);
        let p = PeerId::new("p");
        let a = req("a");
        let w = open(&t, 1, &p, &a);
        let r = Resolved {
            window: w,
            region: 0,
            offset: 0,
            mem_offset: 0,
        };
        let admitted = t
            .admit(&r, 16, Access::Write { acknowledged: true })
            .unwrap();
        let gate = admitted.enter().expect("open");
        let far = Instant::now() + Duration::from_secs(3600);
        let mut rev = revoke(&t, &a, &[], far);
        let quiet = rev.quiesced.take().expect("a read is copying");
        assert!(admitted.enter().is_none(), "no new read after revocation");
        let waiter = tokio::spawn(quiet);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "still copying");
        drop(gate);
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("woken when the read left the gate")
            .unwrap();
    }
}
