//! Destination-block lifetime, without actors or timers (DESIGN.md §5): failure signals at once,
//! completions only when no peer can write any more, quarantine until a fence or the last-resort
//! deadline, and the per-step drain a host scheduler calls.

#![forbid(unsafe_code)]

use crate::fast_hash::{FastMap, FastSet};
use std::time::{Duration, Instant};

use crate::messages::{
    BatchError, Completion, FirstFailure, PeerId, ReqId, SharedRequest, StepOutput,
};
use crate::rdma::Revocation;

use super::block_pool::BlockPool;
use super::live_set::{LiveSet, SharedLiveSet};
use super::outbox::Outbox;

/// What to do with a completion's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Released now. (The blocks are the request's own: a caller that reports them lists
    /// them, so a release nobody reports allocates nothing.)
    Released,
    /// Held until `peers` are fenced or the deadline passes.
    Quarantined {
        blocks: Vec<u32>,
        peers: Vec<PeerId>,
        deadline: Instant,
    },
}

#[derive(Clone)]
struct Held {
    req: SharedRequest,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    peers: Vec<PeerId>,
    since: Instant,
    deadline: Instant,
}

/// A quarantine that ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub req_id: ReqId,
    pub blocks: Vec<u32>,
    pub held_for: Duration,
}

#[derive(Clone)]
pub struct BlockLedger {
    /// Ready for the host's next drain (shared with `Coordinator::drain`).
    out: Outbox,
    /// Requests whose failure signal is queued or drained but whose completion is not yet out.
    failure_signalled: FastSet<ReqId>,
    held: FastMap<ReqId, Held>,
    quarantine_deadline: Duration,
    pool: Option<BlockPool>,
    /// Live requests and their blocks (shared with the Receiver, which admits, and the host's
    /// drain, which hands requests over): the ledger gives blocks back as it releases them.
    live: SharedLiveSet,
}

/// The default cap on live requests (a [`KvRecvConfig`](crate::config::KvRecvConfig) default).
pub use crate::config::DEFAULT_MAX_LIVE;

impl BlockLedger {
    pub fn new(quarantine_deadline: Duration, pool: Option<BlockPool>) -> Self {
        BlockLedger {
            out: Outbox::default(),
            failure_signalled: FastSet::default(),
            held: FastMap::default(),
            quarantine_deadline,
            pool,
            live: SharedLiveSet::new(LiveSet::new(DEFAULT_MAX_LIVE)),
        }
    }

    /// Let `req` start, or say why not ([`LiveSet::admit`]).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn admit(&mut self, req: &SharedRequest) -> Result<(), BatchError> {
        self.live.lock().admit(req)
    }

    /// Hash everything that decides the ledger's future (model checking); quarantine times are
    /// left out: the model decides when deadlines fire.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        fn sorted<T: Ord + Clone>(it: impl Iterator<Item = T>) -> Vec<T> {
            let mut v: Vec<T> = it.collect();
            v.sort();
            v
        }
        {
            let out = self.out.lock();
            out.finished_recving.hash(h);
            out.failed_recving.hash(h);
            out.invalid_block_ids.hash(h);
        }
        sorted(self.failure_signalled.iter()).hash(h);
        sorted(self.held.iter().map(|(r, x)| (r, &x.peers))).hash(h);
        self.live.lock().fingerprint(h);
        if let Some(p) = &self.pool {
            p.fingerprint(h);
        }
    }

    /// Refuse new requests while `n` are live (admitted and not yet drained).
    pub fn with_max_live(self, n: usize) -> Self {
        *self.live.lock() = LiveSet::new(n);
        self
    }

    /// Whether `req_id` was admitted and not yet drained.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn is_live(&self, req_id: &ReqId) -> bool {
        self.live.lock().is_live(req_id)
    }

    /// Requests admitted and not yet drained.
    #[cfg(test)]
    pub fn live_requests(&self) -> usize {
        self.live.lock().len()
    }

    /// The live set, shared ([`Shared::share`](super::shared::Shared::share)): the Receiver admits into it,
    /// the host's drain hands requests over.
    pub fn live_set(&self) -> SharedLiveSet {
        self.live.share()
    }

    pub fn pool(&self) -> Option<&BlockPool> {
        self.pool.as_ref()
    }

    pub fn pool_mut(&mut self) -> Option<&mut BlockPool> {
        self.pool.as_mut()
    }

    /// The last-resort deadline of a quarantine (and of a poisoned landing window).
    pub fn quarantine_deadline(&self) -> Duration {
        self.quarantine_deadline
    }

    pub fn quarantined_requests(&self) -> usize {
        self.held.len()
    }

    pub fn quarantined_blocks(&self) -> usize {
        self.held.values().map(|h| h.req.all_blocks().count()).sum()
    }

    pub fn is_quarantined(&self, req_id: &ReqId) -> bool {
        self.held.contains_key(req_id)
    }

    /// Queue the failure signal (once per request): request-level for multi-group caches,
    /// block-level otherwise (PROTOCOL.md §4).
    pub fn on_first_failure(&mut self, ff: &FirstFailure) {
        self.signal_failure(&ff.req);
    }

    fn signal_failure(&mut self, req: &SharedRequest) {
        if !self.failure_signalled.insert(req.req_id.clone()) {
            return;
        }
        let mut out = self.out.lock();
        if req.block_ids().len() > 1 {
            out.failed_recving.push(req.req_id.clone());
        } else {
            out.invalid_block_ids.extend(req.all_blocks());
        }
    }

    /// A completion arrived; its permits were already revoked with result `revocation`.
    /// `fence_needed_for` is the set of peers that may still write (empty: nothing to wait for).
    pub fn on_completion(
        &mut self,
        c: &Completion,
        fence_needed_for: Vec<PeerId>,
        now: Instant,
    ) -> Disposition {
        if !c.outcome.is_ok() {
            // A failure signal is never later than its completion.
            self.signal_failure(&c.req);
        }
        if fence_needed_for.is_empty() {
            self.release_now(&c.req);
            return Disposition::Released;
        }
        let blocks: Vec<u32> = c.req.all_blocks().collect();
        let deadline = now + self.quarantine_deadline;
        self.held.insert(
            c.req.req_id.clone(),
            Held {
                req: c.req.clone(),
                peers: fence_needed_for.clone(),
                since: now,
                deadline,
            },
        );
        Disposition::Quarantined {
            blocks,
            peers: fence_needed_for,
            deadline,
        }
    }

    fn release_now(&mut self, req: &SharedRequest) {
        self.live.lock().release_blocks(req);
        // Usually none failed: no hashing of the id for nothing.
        if !self.failure_signalled.is_empty() {
            self.failure_signalled.remove(&req.req_id);
        }
        self.out.lock().finished_recving.push(req.req_id.clone());
        if let Some(pool) = &mut self.pool {
            pool.release(&req.req_id);
        }
    }

    /// The fence for `req_id` is confirmed (or its deadline passed): release it.
    pub fn end_quarantine(&mut self, req_id: &ReqId, now: Instant) -> Option<Release> {
        let h = self.held.remove(req_id)?;
        self.release_now(&h.req);
        Some(Release {
            req_id: req_id.clone(),
            blocks: h.req.all_blocks().collect(),
            held_for: now.saturating_duration_since(h.since),
        })
    }

    /// The earliest last-resort deadline of a quarantine held, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.held.values().map(|h| h.deadline).min()
    }

    /// Quarantines whose last-resort deadline has passed.
    pub fn expired(&self, now: Instant) -> Vec<ReqId> {
        let mut v: Vec<ReqId> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(r, _)| r.clone())
            .collect();
        v.sort();
        v
    }

    /// The peers a quarantine waits for.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn held_peers(&self, req_id: &ReqId) -> Option<&[PeerId]> {
        self.held.get(req_id).map(|h| h.peers.as_slice())
    }

    /// The output the host drains ([`Outbox::share`]): everything ready since the last drain,
    /// its requests live until [`take_step`] hands them over.
    pub fn outbox(&self) -> Outbox {
        self.out.share()
    }

    /// Everything ready for the host since the last drain, handed over at once.
    pub fn drain(&mut self) -> StepOutput {
        take_step(&self.out, &self.live)
    }
}

/// A drain: everything ready for the host since the last one, its finished requests handed
/// over (their ids may be loaded again) before it returns, so before anything the host does
/// after it.
pub fn take_step(out: &Outbox, live: &SharedLiveSet) -> StepOutput {
    let step = out.take();
    if !step.finished_recving.is_empty() {
        live.lock().hand_over(&step.finished_recving);
    }
    step
}

/// Which peers must be fenced before a completion's blocks can go back (DESIGN.md §5).
pub fn peers_to_fence(c: &Completion, revocation: Revocation) -> Vec<PeerId> {
    if revocation == Revocation::Exact {
        return vec![]; // the permit refuses every later write: that is the fence
    }
    // Unsettled peers only exist under `naive`, which by design does not wait for them.
    c.uncertain_peers.clone()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::messages::{Outcome, RequestMeta};

    fn req(id: &str, groups: Vec<Vec<u32>>) -> SharedRequest {
        Arc::new(RequestMeta::new(id, id, "e", "b", &groups))
    }

    fn completion(r: &SharedRequest, failed: bool, uncertain: &[&str]) -> Completion {
        Completion {
            req: r.clone(),
            outcome: if failed {
                Outcome::Failed {
                    peer: None,
                    cause: crate::messages::Cause::Channel,
                    reason: "x".into(),
                }
            } else {
                Outcome::Ok
            },
            uncertain_peers: uncertain.iter().map(PeerId::new).collect(),
            unsettled_peers: vec![],
            transport_failed_peers: vec![],
        }
    }

    #[test]
    fn failure_signal_is_drained_no_later_than_its_completion() {
        let mut l = BlockLedger::new(Duration::from_secs(1), None);
        let r = req("r", vec![vec![3, 4]]);
        l.on_first_failure(&FirstFailure {
            cause: crate::messages::Cause::Channel,
            req: r.clone(),
            peer: None,
            reason: "x".into(),
        });
        let first = l.drain();
        assert_eq!(first.invalid_block_ids, vec![3, 4]);
        assert!(first.finished_recving.is_empty());
        l.on_completion(&completion(&r, true, &[]), vec![], Instant::now());
        let second = l.drain();
        assert_eq!(second.finished_recving, vec![ReqId::from("r")]);
        assert!(
            second.invalid_block_ids.is_empty(),
            "failure signalled once"
        );
    }

    #[test]
    fn multi_group_failures_are_request_level() {
        let mut l = BlockLedger::new(Duration::from_secs(1), None);
        let r = req("r", vec![vec![1], vec![2]]);
        l.on_completion(&completion(&r, true, &[]), vec![], Instant::now());
        let out = l.drain();
        assert_eq!(out.failed_recving, vec![ReqId::from("r")]);
        assert!(out.invalid_block_ids.is_empty());
        assert_eq!(out.finished_recving, vec![ReqId::from("r")]);
    }

    #[test]
    fn quarantine_holds_until_fence_or_deadline() {
        let t0 = Instant::now();
        let mut l = BlockLedger::new(Duration::from_secs(10), Some(BlockPool::new(4)));
        let r = req("r", vec![vec![]]);
        let c = completion(&r, true, &["p1"]);
        let fence = peers_to_fence(&c, Revocation::NotExact);
        assert!(matches!(
            l.on_completion(&c, fence, t0),
            Disposition::Quarantined { .. }
        ));
        assert!(
            l.drain().finished_recving.is_empty(),
            "no completion while quarantined"
        );
        assert!(l.expired(t0 + Duration::from_secs(9)).is_empty());
        assert_eq!(
            l.expired(t0 + Duration::from_secs(10)),
            vec![ReqId::from("r")]
        );
        let rel = l
            .end_quarantine(&"r".into(), t0 + Duration::from_secs(10))
            .unwrap();
        assert_eq!(rel.held_for, Duration::from_secs(10));
        assert_eq!(l.drain().finished_recving, vec![ReqId::from("r")]);
        assert!(l.end_quarantine(&"r".into(), t0).is_none(), "released once");
        assert!(peers_to_fence(&c, Revocation::Exact).is_empty());
    }

    #[test]
    fn a_request_id_is_live_until_its_completion_is_drained() {
        let mut l = BlockLedger::new(Duration::from_secs(1), None);
        let r = req("r", vec![vec![1]]);
        assert_eq!(l.admit(&r), Ok(()));
        let again = req("r", vec![vec![9]]);
        assert!(matches!(
            l.admit(&again),
            Err(BatchError::AlreadyLive { .. })
        ));
        l.on_completion(&completion(&r, false, &[]), vec![], Instant::now());
        assert!(
            matches!(l.admit(&again), Err(BatchError::AlreadyLive { .. })),
            "completed but not drained: the host has not seen it yet"
        );
        assert_eq!(l.drain().finished_recving, vec![ReqId::from("r")]);
        assert!(!l.is_live(&"r".into()));
        assert_eq!(l.admit(&again), Ok(()), "drained: may be loaded again");
    }

    #[test]
    fn requests_without_blocks_are_never_live() {
        let mut l = BlockLedger::new(Duration::from_secs(1), None);
        let cleanup = req("c", vec![vec![]]);
        assert_eq!(l.admit(&cleanup), Ok(()));
        assert_eq!(l.admit(&cleanup), Ok(()));
        assert_eq!(l.live_requests(), 0);
        // but a cleanup pull cannot reuse the id of a request still in flight
        assert_eq!(l.admit(&req("r", vec![vec![1]])), Ok(()));
        assert!(matches!(
            l.admit(&req("r", vec![])),
            Err(BatchError::AlreadyLive { .. })
        ));
    }

    #[test]
    fn a_block_is_owned_until_released_quarantine_included_and_per_group() {
        let t0 = Instant::now();
        let mut l = BlockLedger::new(Duration::from_secs(10), None);
        let a = req("a", vec![vec![1, 2], vec![7]]);
        assert_eq!(l.admit(&a), Ok(()));
        assert_eq!(
            l.admit(&req("b", vec![vec![3], vec![2]])),
            Ok(()),
            "block 2 of group 1 is not block 2 of group 0"
        );
        assert_eq!(
            l.admit(&req("c", vec![vec![5, 2], vec![]])),
            Err(BatchError::BlockInUse {
                req_id: "c".into(),
                group: 0,
                block: 2,
                owner: "a".into()
            })
        );
        assert!(!l.is_live(&"c".into()), "a refused request holds nothing");
        assert_eq!(l.admit(&req("c2", vec![vec![5], vec![]])), Ok(()));
        // a's completion with an uncertain peer: quarantined, still owns its blocks
        let c = completion(&a, true, &["p"]);
        l.on_completion(&c, vec![PeerId::new("p")], t0);
        let d = req("d", vec![vec![1], vec![]]);
        assert!(matches!(l.admit(&d), Err(BatchError::BlockInUse { .. })));
        l.end_quarantine(&"a".into(), t0);
        assert_eq!(l.admit(&d), Ok(()), "released: the block may be reused");
        assert!(l.is_live(&"a".into()), "the id stays live until drained");
    }

    #[test]
    fn a_host_that_never_drains_meets_backpressure() {
        let mut l = BlockLedger::new(Duration::from_secs(1), None).with_max_live(2);
        let (a, b, c) = (
            req("a", vec![vec![1]]),
            req("b", vec![vec![2]]),
            req("c", vec![vec![3]]),
        );
        l.admit(&a).unwrap();
        l.admit(&b).unwrap();
        assert!(matches!(
            l.admit(&c),
            Err(BatchError::Backpressure {
                live: 2,
                limit: 2,
                ..
            })
        ));
        assert!(
            l.admit(&req("cleanup", vec![])).is_ok(),
            "cleanup pulls never count"
        );
        // Completing and draining one makes room.
        l.on_completion(&completion(&a, false, &[]), vec![], Instant::now());
        l.drain();
        l.admit(&c).unwrap();
    }
}
