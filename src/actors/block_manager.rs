//! BlockManager: one per D worker. Owns destination-block lifetime: revokes landing permits at
//! every completion, quarantines blocks that uncertain peers may still write until the data
//! plane fences them (or the last-resort deadline), and serves the host's per-step drain.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, Handler, MessageResult, WrapFuture};

use crate::config::Policy;
use crate::messages::tick::QuarantinesDue;
use crate::messages::{
    Allocate, Completion, Completions, Drain, FirstFailure, Free, GetLedgerStats, KvEvent,
    LedgerStats, ReqId,
};
use crate::messages::{BeginPause, PauseStarted};
use crate::rdma::Landing;
use crate::telemetry::{self as m, Labels};

use super::alarm::Alarm;
use super::block_ledger::{BlockLedger, Disposition};
use super::block_pool::PoolError;
use super::event_sink::EventSink;
use super::live_set::SharedLiveSet;
use super::pause_watch::PauseWatch;
use super::rediscovery::clock_now;
use super::revoke_release::{self, RevokedCompletion};

/// Owns the destination-block ledger: quarantines a failed request's blocks until its uncertain
/// peers are fenced, and hands released requests to the host's drain.
pub struct BlockManager {
    ledger: BlockLedger,
    landing: Arc<dyn Landing>,
    policy: Policy,
    events: EventSink,
    labels: Labels,
    /// Fires at the earliest quarantine deadline held: one alarm for all of them, not a timer
    /// per quarantine in the context (actix polls every context item at every turn, and a
    /// failure burst can hold thousands).
    deadlines: Option<Alarm>,
    /// A pause waiting for blocks to come back (sleep mode, DESIGN.md §7).
    pausing: Option<PauseWatch>,
}

impl BlockManager {
    /// A block manager over `ledger`, fencing through `landing`.
    pub(crate) fn new(
        ledger: BlockLedger,
        landing: Arc<dyn Landing>,
        policy: Policy,
        events: EventSink,
    ) -> Self {
        BlockManager {
            ledger,
            landing,
            policy,
            events,
            labels: Labels::default(),
            deadlines: None,
            pausing: None,
        }
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub(crate) fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// The live set its ledger releases blocks from (the Receiver admits into it, the host's
    /// drain hands requests over).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn live_set(&self) -> SharedLiveSet {
        self.ledger.live_set()
    }

    /// Make the deadline alarm fire no later than `at` (deadlines mostly come in order, so it
    /// is rarely set again).
    fn arm_deadlines(&mut self, at: Instant, ctx: &mut Context<Self>) {
        let at = tokio::time::Instant::from_std(at);
        if self
            .deadlines
            .as_ref()
            .is_some_and(|armed| armed.at() <= at)
        {
            return;
        }
        self.deadlines = Alarm::set(ctx.address().downgrade().recipient(), at, QuarantinesDue);
    }

    fn end_quarantine(&mut self, req_id: &ReqId, fenced: bool) {
        let now = clock_now();
        let Some(rel) = self.ledger.end_quarantine(req_id, now) else {
            return;
        };
        if fenced {
            self.labels
                .histogram(m::FENCE_LATENCY)
                .record(rel.held_for.as_secs_f64());
            tracing::info!(req_id = %req_id, held_ms = rel.held_for.as_millis() as u64, "fenced, released");
        } else {
            self.labels.counter(m::QUARANTINE_FORCED).increment(1);
            tracing::warn!(req_id = %req_id, held_ms = rel.held_for.as_millis() as u64,
                "quarantine deadline passed without a fence; releasing blocks a peer may still write");
        }
        self.labels
            .gauge(m::QUARANTINED_BLOCKS)
            .set(self.ledger.quarantined_blocks() as f64);
        self.note_release(req_id, || rel.blocks.clone(), fenced, !fenced);
        self.events.emit(KvEvent::Released {
            req_id: req_id.clone(),
            blocks: rel.blocks,
            fenced,
            forced: !fenced,
        });
    }

    /// Tell a pause waiting for `req_id` that its blocks came back; the pause resolves with
    /// the last one.
    fn note_release(
        &mut self,
        req_id: &ReqId,
        blocks: impl FnOnce() -> Vec<u32>,
        fenced: bool,
        forced: bool,
    ) {
        let Some(watch) = &mut self.pausing else {
            return;
        };
        watch.released(req_id, blocks(), fenced, forced);
        if watch.done() {
            if let Some(w) = self.pausing.take() {
                w.finish();
            }
        }
    }
}

impl Handler<BeginPause> for BlockManager {
    type Result = MessageResult<BeginPause>;

    /// Close admission and watch the requests that hold blocks. Both under the live set's
    /// lock, which every admission and every release takes: no request is admitted after it,
    /// and none released before it is missed (releases happen on this actor's turn).
    fn handle(&mut self, _: BeginPause, _ctx: &mut Context<Self>) -> Self::Result {
        let holders = {
            let live = self.ledger.live_set();
            let mut live = live.lock();
            live.set_paused(true);
            live.holders()
        };
        self.labels.gauge(m::PAUSED).set(1.0);
        let (tx, report) = tokio::sync::oneshot::channel();
        tracing::info!(
            holders = holders.len(),
            "pause: admission closed, waiting for every block to come back"
        );
        let mut watch = self.pausing.take().unwrap_or_default();
        watch.watch(&holders, tx);
        if watch.done() {
            watch.finish();
        } else {
            self.pausing = Some(watch);
        }
        MessageResult(PauseStarted { holders, report })
    }
}

impl Actor for BlockManager {
    type Context = Context<Self>;
}

impl Handler<QuarantinesDue> for BlockManager {
    type Result = ();

    /// Release every quarantine whose deadline passed, then wait for the earliest left.
    fn handle(&mut self, _: QuarantinesDue, ctx: &mut Context<Self>) {
        self.deadlines = None;
        // tokio's clock, the one the alarm sleeps on (a paused test clock included).
        for req_id in self.ledger.expired(clock_now()) {
            self.end_quarantine(&req_id, false);
        }
        if let Some(next) = self.ledger.next_deadline() {
            self.arm_deadlines(next, ctx);
        }
    }
}

impl Handler<FirstFailure> for BlockManager {
    type Result = ();

    fn handle(&mut self, ff: FirstFailure, _ctx: &mut Context<Self>) {
        self.ledger.on_first_failure(&ff);
    }
}

impl Handler<Completions> for BlockManager {
    type Result = ();

    fn handle(&mut self, cs: Completions, ctx: &mut Context<Self>) {
        self.complete_in_order(cs.completions.into_iter(), cs.at, ctx);
    }
}

impl BlockManager {
    /// Revoke and dispose of each completion in turn. Revoke first, whatever the outcome: an ok
    /// from a v1 writer or a timed-out TE batch is no proof that the bytes stopped moving
    /// (DESIGN.md §5). The windows of suspect peers are poisoned for as long as a quarantine
    /// may last. A revocation a landing read is still finishing holds this mailbox (not the
    /// thread) until it has, and the completions after it wait with it, so nothing is
    /// released or drained early.
    /// `now`: the time of the message's completions, one for them all (they are handled in
    /// one turn; a quarantine's deadline is a bound, microseconds do not matter to it).
    fn complete_in_order(
        &mut self,
        mut list: smallvec::IntoIter<[Completion; 1]>,
        now: Instant,
        ctx: &mut Context<Self>,
    ) {
        while let Some(c) = list.next() {
            let (revoked, quiesced) =
                revoke_release::revoke(&self.ledger, c, now, |r| self.landing.revoke(r));
            match quiesced {
                None => self.dispose(revoked, now, ctx),
                Some(quiet) => {
                    ctx.wait(quiet.into_actor(self).map(move |(), act, ctx| {
                        // The read held it: the rest count from now.
                        let now = clock_now();
                        act.dispose(revoked, now, ctx);
                        act.complete_in_order(list, now, ctx);
                    }));
                    return;
                }
            }
        }
    }
}

impl BlockManager {
    /// Release or quarantine a completion's blocks once its revocation is quiet.
    fn dispose(&mut self, revoked: RevokedCompletion, now: Instant, ctx: &mut Context<Self>) {
        let disposition = revoke_release::dispose(&mut self.ledger, self.policy, &revoked, now);
        // The exact revocation is what fenced the peers that may still write.
        let fenced = revoked.fenced();
        let c = revoked.completion;
        let req_id = c.req.req_id.clone();
        match disposition {
            Disposition::Released => {
                self.note_release(&req_id, || c.req.all_blocks().collect(), fenced, false);
                if self.events.wants_detail() {
                    self.events.emit(KvEvent::Released {
                        req_id,
                        blocks: c.req.all_blocks().collect(),
                        fenced,
                        forced: false,
                    });
                }
            }
            Disposition::Quarantined {
                blocks,
                peers,
                deadline,
            } => {
                tracing::info!(req_id = %req_id, blocks = blocks.len(), peers = ?peers, "quarantined until fenced");
                self.labels
                    .gauge(m::QUARANTINED_BLOCKS)
                    .set(self.ledger.quarantined_blocks() as f64);
                self.events.emit(KvEvent::Quarantined {
                    req_id: req_id.clone(),
                    blocks,
                    peers: peers.clone(),
                });
                let r = req_id.clone();
                ctx.spawn(self.landing.fence(&peers).into_actor(self).map(move |res, act, _ctx| {
                    match res {
                        Ok(()) => act.end_quarantine(&r, true),
                        Err(e) => tracing::warn!(req_id = %r, error = %e, "fence failed; holding blocks until the deadline"),
                    }
                }));
                self.arm_deadlines(deadline, ctx);
            }
        }
    }
}

impl Handler<Drain> for BlockManager {
    type Result = MessageResult<Drain>;

    fn handle(&mut self, _: Drain, _ctx: &mut Context<Self>) -> MessageResult<Drain> {
        MessageResult(self.ledger.drain())
    }
}

impl Handler<Allocate> for BlockManager {
    type Result = Result<Vec<u32>, PoolError>;

    fn handle(&mut self, a: Allocate, _ctx: &mut Context<Self>) -> Self::Result {
        match self.ledger.pool_mut() {
            Some(p) => p.allocate(&a.req_id, a.owner_tag, a.n),
            None => Err(PoolError::Exhausted {
                wanted: a.n,
                free: 0,
            }),
        }
    }
}

impl Handler<Free> for BlockManager {
    type Result = Vec<u32>;

    fn handle(&mut self, f: Free, _ctx: &mut Context<Self>) -> Vec<u32> {
        if self.ledger.is_quarantined(&f.req_id) {
            return vec![]; // still fenced off; the quarantine releases it
        }
        self.ledger
            .pool_mut()
            .map(|p| p.release(&f.req_id))
            .unwrap_or_default()
    }
}

impl Handler<GetLedgerStats> for BlockManager {
    type Result = LedgerStats;

    fn handle(&mut self, _: GetLedgerStats, _ctx: &mut Context<Self>) -> LedgerStats {
        LedgerStats {
            quarantined_requests: self.ledger.quarantined_requests(),
            quarantined_blocks: self.ledger.quarantined_blocks(),
            free_blocks: self.ledger.pool().map(|p| p.free_blocks()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use futures::FutureExt;
    use tokio::sync::oneshot;

    use super::*;
    use crate::messages::{Outcome, PeerId, RequestMeta, SharedRequest};
    use crate::rdma::{FenceError, PullWindow, Revocation, RevokeRequest, Revoked};

    /// A data plane where a read into `a`'s blocks is still copying when `a` is revoked: its
    /// revocation quiesces when the test says so.
    struct Copying {
        a_quiet: Mutex<Option<oneshot::Receiver<()>>>,
    }

    impl Landing for Copying {
        fn endpoint(&self) -> (&str, u32) {
            ("", 0)
        }
        fn open_pull(&self, _w: &PullWindow<'_>) -> crate::rdma::RegionBases {
            [].into()
        }
        fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
            let rx = (&*r.req.req_id == "a")
                .then(|| self.a_quiet.lock().unwrap().take())
                .flatten();
            Revoked {
                revocation: Revocation::Exact,
                poisoned: 0,
                quiesced: rx.map(|rx| rx.map(|_| ()).boxed()),
            }
        }
        fn fence(
            &self,
            _p: &[PeerId],
        ) -> futures::future::LocalBoxFuture<'static, Result<(), FenceError>> {
            Box::pin(async { Ok(()) })
        }
    }

    fn req(id: &str, block: u32) -> SharedRequest {
        Arc::new(RequestMeta::new(id, &format!("t-{id}"), "e", "http://b:1", &[vec![block]]))
    }

    fn ok(r: &SharedRequest) -> Completion {
        Completion {
            req: r.clone(),
            outcome: Outcome::Ok,
            uncertain_peers: vec![],
            unsettled_peers: vec![],
            transport_failed_peers: vec![],
        }
    }

    /// One message carries a batch's completions; a revocation a landing read is still
    /// finishing holds that completion's release and every one after it (in order), until the
    /// read is done: nothing is drained early.
    #[actix::test]
    async fn completions_after_a_quiescing_revocation_wait_for_it() {
        let (tx, rx) = oneshot::channel();
        let landing = Arc::new(Copying {
            a_quiet: Mutex::new(Some(rx)),
        });
        let ledger = BlockLedger::new(Duration::from_secs(60), None);
        let live = ledger.live_set();
        let bm = BlockManager::new(ledger, landing, Policy::Settle, EventSink::none()).start();
        let (a, b) = (req("a", 1), req("b", 2));
        for r in [&a, &b] {
            live.lock().admit(r).unwrap();
        }
        bm.do_send(Completions {
            completions: smallvec::smallvec![ok(&a), ok(&b)],
            at: Instant::now(),
        });
        // A drain queued behind the completions waits with them.
        let early = bm.send(Drain);
        let mut early = std::pin::pin!(early);
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        assert!(
            futures::poll!(early.as_mut()).is_pending(),
            "the drain is not answered while a's read is still copying"
        );
        tx.send(()).unwrap();
        let out = early.await.unwrap();
        let ids: Vec<&str> = out.finished_recving.iter().map(|r| &**r).collect();
        assert_eq!(ids, ["a", "b"], "released together, in order, once quiet");
    }
}
