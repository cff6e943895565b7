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

use tokio::sync::Notify;

use crate::messages::{PeerId, PullId, ReqId, RequestMeta, SharedRequest};
use crate::telemetry as m;

use super::request_pulls::{Pairs, RequestPulls};
use super::windows::{Resolved, WindowMap};
use crate::rdma::landing::{
    NoWindow, NoWindowReason, PullWindow, Revocation, RevokeRequest, Revoked,
};

mod admission;
mod opening;
mod revocation;
#[cfg(test)]
mod tests;

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
pub(super) const NO_WINDOW: &str =
    "D had no clean landing window for a pull of this request (all poisoned, \
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

/// A pull's blocks by group and its requests' span caps: the same for every pull of a batch
/// (one per peer, the same requests), so its pulls' permits share one (at TP2 12 bytes a
/// request less, at TP8 84; docs/PERFORMANCE.md, "Where the bytes per in-flight request go").
#[derive(Debug, Default)]
struct PullBlocks {
    /// Per KV-cache group: block id -> index of the owning request in the pull.
    groups: Vec<BlockOwners>,
    /// Most spans kept per request: two per block and region (pieces of a block landing out
    /// of order, apart until the gap between them lands) and some slack. Spans past it are not
    /// recorded, so a writer that scatters bytes cannot grow this without bound; what it wrote
    /// is then under-counted, which can only fail an ok, never pass one.
    span_cap: Box<[u32]>,
}

/// A P deployment: its bootstrap server's address. Every DP rank (engine id) of a deployment is
/// listed by one bootstrap server and shares its configuration, and its mistakes: a misaligned
/// layout makes every rank error, so the ranks share one share of poisoned windows.
type Deployment = crate::messages::SharedStr;

/// One pull's permit.
#[derive(Debug)]
pub struct Permit {
    pub pull_id: PullId,
    pub peer: PeerId,
    /// The P deployment of the pull's requests (one pull, one engine, one deployment).
    deployment: Deployment,
    pub window: u32,
    /// The pull's blocks and span caps, shared with the other pulls of its batch.
    blocks: Arc<PullBlocks>,
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
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
                let cap = p.blocks.span_cap.get(i).map_or(0, |&c| c as usize);
                add_span(&mut cov[i], piece.span, cap);
            }
            drop(cov);
            if self.open_write.swap(false, Ordering::AcqRel) {
                p.open_writes.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// The pull this write belongs to (`None` with permits off).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn pull_id(&self) -> Option<PullId> {
        self.permit.as_ref().map(|p| p.pull_id)
    }
}

/// Byte accounting of one pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
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
                    for g in &p.blocks.groups {
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn epoch_rule(&self) -> bool {
        self.poison
    }

    /// Epoch counters.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
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
}
