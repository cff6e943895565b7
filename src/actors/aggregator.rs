//! RequestAggregator: receives every peer's settle for every awaited request, publishes each
//! request's first failure once and its completion once.
//!
//! One actor per coordinator, settling the [`AggregatorState`] of each awaited request (the
//! per-request state machine of DESIGN.md §4 rules 5, 8, 9, unchanged) in a table keyed by
//! request id. It was one actor per request; at 100k requests in flight the actor (task,
//! context, mailbox, one boxed recipient per pull that named it) cost more memory and CPU than
//! the request itself (docs/PERFORMANCE.md has the figures), while the table gives the same
//! guarantees: the Receiver registers a batch's states in it before it hands any Peer the pull
//! ([`super::aggregation_table`]), so no settle can arrive before its state exists. A settle
//! counts only for the attempt whose pulls it came from (each attempt knows its pull ids), so
//! a late settle of an earlier attempt of the same id (possible under the naive policy, which
//! completes before every peer settled) is stale.

#![forbid(unsafe_code)]

use std::time::Instant;

use actix::{Actor, Addr, Context, Handler, Message};

use crate::messages::settle::Cause;
use crate::messages::{CompletionList, Completions, KvEvent, Settle, Settles, SharedRequest};
use crate::telemetry::{self as m, KeptHandles, Labels};

use super::aggregation_table::SharedAggregation;
use super::aggregator_state::{AggEffects, AggregatorState};
use super::block_manager::BlockManager;
use super::event_sink::EventSink;
use super::rediscovery::clock_now;

/// Receiver -> RequestAggregator: these requests have no possible writer (topology failure,
/// DESIGN.md §4 rule 7, or aborted before anything was sent): fail and complete them now.
#[derive(Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct FailUnsent {
    /// The requests.
    pub requests: Vec<SharedRequest>,
    /// Why no writer exists.
    pub cause: Cause,
    /// The same, in words.
    pub reason: String,
}

/// Collects every peer's settle of every awaited request and publishes the first failure and
/// the completion of each exactly once.
pub struct RequestAggregator {
    /// The awaited requests, registered there by the Receiver.
    table: SharedAggregation,
    block_manager: Addr<BlockManager>,
    events: EventSink,
    labels: Labels,
    /// The completions' metrics, kept after their first use.
    kept: KeptHandles,
}

impl RequestAggregator {
    /// An aggregator of the requests registered in `table`, that hands failures and
    /// completions to `block_manager`.
    pub(crate) fn new(
        table: SharedAggregation,
        block_manager: Addr<BlockManager>,
        events: EventSink,
    ) -> Self {
        RequestAggregator {
            table,
            block_manager,
            events,
            labels: Labels::default(),
            kept: KeptHandles::default(),
        }
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub(crate) fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// Take what a request's state machine said; `since` is when aggregation started. It is
    /// published by [`Self::flush`].
    fn publish(&self, fx: AggEffects, since: Instant, out: &mut Outbox) {
        if let Some(ff) = fx.first_failure {
            tracing::warn!(req_id = %ff.req.req_id, peer = ?ff.peer, reason = %ff.reason, "first failure");
            self.labels.counter(m::FIRST_FAILURES).increment(1);
            if self.events.wants_detail() {
                out.events.push(KvEvent::FirstFailure {
                    req_id: ff.req.req_id.clone(),
                    peer: ff.peer.clone(),
                    cause: ff.cause,
                    reason: ff.reason.clone(),
                });
            }
            // A request's first failure reaches the BlockManager before its completion.
            self.block_manager.do_send(ff);
        }
        if let Some(c) = fx.completion {
            if out.completions.capacity() == 0 {
                out.completions.reserve_exact(out.settles);
                out.started.reserve_exact(out.settles);
                if self.events.is_on() {
                    out.events.reserve_exact(out.settles);
                }
            }
            let ok = c.outcome.is_ok();
            tracing::debug!(req_id = %c.req.req_id, outcome = if ok { "ok" } else { "failed" }, uncertain = c.uncertain_peers.len(), "completion");
            out.started.push(since);
            out.failed += usize::from(!ok);
            if self.events.is_on() {
                out.events.push(KvEvent::Completion {
                    req_id: c.req.req_id.clone(),
                    outcome: c.outcome.clone(),
                    uncertain_peers: c.uncertain_peers.clone(),
                    unsettled_peers: c.unsettled_peers.clone(),
                });
            }
            out.completions.push(c);
        }
    }

    /// Hand the completions to the BlockManager (one message), then tell observers: an
    /// observer's next message to the BlockManager (a drain) is handled after them. The
    /// completions' metrics are recorded here, each handle looked up once per message.
    fn flush(&self, out: Outbox) {
        if !out.completions.is_empty() {
            let failed = out.failed as u64;
            let ok = out.completions.len() as u64 - failed;
            for (label, n) in [("ok", ok), ("failed", failed)] {
                if n > 0 {
                    self.kept
                        .increment(&self.labels, m::COMPLETIONS, "outcome", label, n);
                }
            }
            // Tokio's clock, the one quarantine deadlines are kept on (the BlockManager's alarm
            // sleeps on it and compares with it; a paused test clock governs them all).
            let now = clock_now();
            for since in out.started {
                let took = now.saturating_duration_since(since).as_secs_f64();
                self.kept.record(&self.labels, m::COMPLETION_LATENCY, took);
            }
            self.block_manager.do_send(Completions {
                completions: out.completions,
                at: now,
            });
        }
        for ev in out.events {
            self.events.emit(ev);
        }
    }
}

/// What one message's settles produced, published together by [`RequestAggregator::flush`].
#[derive(Default)]
struct Outbox {
    /// Allocated at the first completion (with `started` and `events`), for as many as the
    /// message had settles: a peer's settles complete nothing until the last peer's (most
    /// messages, with several peers).
    completions: CompletionList,
    settles: usize,
    /// When each completion's aggregation started (its latency is taken at the flush).
    started: smallvec::SmallVec<[Instant; 2]>,
    /// Of `completions`, how many failed.
    failed: usize,
    /// Inline for a reply that settles one request (no allocation).
    events: smallvec::SmallVec<[KvEvent; 2]>,
}

impl Outbox {
    /// For a message of `settles` settles (sized at its first completion).
    fn for_settles(settles: usize) -> Self {
        Outbox {
            settles,
            ..Outbox::default()
        }
    }
}

impl Actor for RequestAggregator {
    type Context = Context<Self>;
}

impl Handler<FailUnsent> for RequestAggregator {
    type Result = ();

    fn handle(&mut self, msg: FailUnsent, _ctx: &mut Context<Self>) {
        let since = clock_now();
        let mut out = Outbox::default();
        for req in msg.requests {
            let mut state = AggregatorState::new(req, vec![], crate::config::Policy::Settle);
            let fx = state.fail_now(msg.cause, msg.reason.clone());
            self.publish(fx, since, &mut out);
        }
        self.flush(out);
    }
}

impl Handler<Settles> for RequestAggregator {
    type Result = ();

    fn handle(&mut self, msg: Settles, _ctx: &mut Context<Self>) {
        // A reply usually completes every request it settles: sized for that at once.
        let mut out = Outbox::for_settles(msg.0.len());
        for s in msg.0 {
            self.settle(s, &mut out);
        }
        self.flush(out);
    }
}

impl RequestAggregator {
    fn settle(&mut self, s: Settle, out: &mut Outbox) {
        // Everything logged while handling a settle names the request and the peer it came from.
        let _span = tracing::debug_span!("settle", req_id = %s.req_id, peer = %s.peer).entered();
        let mut table = self.table.borrow_mut();
        let Some(entry) = table.counting(&s.req_id, s.pull_id) else {
            // Its attempt completed already (the naive policy completes early).
            self.labels.counter(m::STALE_SETTLES).increment(1);
            return;
        };
        let fx = entry.state.on_settle(&s);
        if fx.stale {
            self.labels.counter(m::STALE_SETTLES).increment(1);
            return;
        }
        let since = entry.since();
        if fx.completion.is_some() {
            table.remove(&s.req_id);
        }
        drop(table);
        self.publish(fx, since, out);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::actors::block_ledger::BlockLedger;
    use crate::config::Policy;
    use crate::messages::{PeerId, PullId, RequestMeta, SettleOutcome};
    use crate::rdma::StaticLanding;

    fn settle(pull_id: PullId) -> Settle {
        Settle {
            peer: PeerId::new("tcp://p:1"),
            pull_id,
            req_id: "r".into(),
            outcome: SettleOutcome::Ok,
        }
    }

    /// A late settle of an earlier attempt of the same id (its pull is not one of this
    /// attempt's) is stale: it cannot complete the new attempt.
    #[actix::test]
    async fn a_settle_counts_only_for_the_attempt_whose_pull_it_came_from() {
        let (events, mut rx) = EventSink::channel();
        let landing = Arc::new(StaticLanding::new("h", 1, vec![0]));
        let bm = BlockManager::new(
            BlockLedger::new(Duration::from_secs(60), None),
            landing,
            Policy::Settle,
            events.clone(),
        )
        .start();
        let table = SharedAggregation::default();
        let agg = RequestAggregator::new(table.clone(), bm, events).start();
        let req = Arc::new(RequestMeta::new("r", "t", "e", "b", &[vec![1]]));
        let state = AggregatorState::new(req, vec![PeerId::new("tcp://p:1")], Policy::Settle);
        table
            .borrow_mut()
            .register(7..8, [state].into_iter(), Instant::now());
        // As a Peer sends them: one `Settles` per reply.
        agg.send(Settles([settle(3)].into_iter().collect()))
            .await
            .unwrap(); // an earlier attempt's pull
        assert!(rx.try_recv().is_err(), "the stale settle published nothing");
        agg.send(Settles([settle(7)].into_iter().collect()))
            .await
            .unwrap();
        let ev = rx.recv().await.unwrap();
        assert!(
            matches!(ev, KvEvent::Completion { ref req_id, .. } if &**req_id == "r"),
            "{ev:?}"
        );
    }
}
