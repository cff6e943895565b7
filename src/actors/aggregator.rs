//! RequestAggregator: one per awaited request. Receives every peer's settle, publishes the first
//! failure once and the completion once, then stops.

use std::time::Instant;

use actix::{Actor, ActorContext, Addr, Context, Handler};

use crate::config::Policy;
use crate::messages::{KvEvent, PeerId, Settle, SharedRequest};
use crate::telemetry::{self as m, Labels};

use super::aggregator_state::{AggEffects, AggregatorState};
use super::block_manager::BlockManager;
use super::event_sink::EventSink;

/// One actor per awaited request: collects every peer's settle and publishes the first failure and
/// the completion exactly once.
pub struct RequestAggregator {
    state: AggregatorState,
    block_manager: Addr<BlockManager>,
    events: EventSink,
    /// Set for a request with no possible writer: fail and complete as soon as started.
    fail_on_start: Option<String>,
    since: Instant,
    labels: Labels,
}

impl RequestAggregator {
    /// An aggregator waiting for `peers` to settle `req` under `policy`.
    pub fn new(
        req: SharedRequest,
        peers: Vec<PeerId>,
        policy: Policy,
        block_manager: Addr<BlockManager>,
        events: EventSink,
    ) -> Self {
        Self::with_state(
            AggregatorState::new(req, peers, policy),
            block_manager,
            events,
        )
    }

    /// An aggregator around a configured state machine.
    pub fn with_state(
        state: AggregatorState,
        block_manager: Addr<BlockManager>,
        events: EventSink,
    ) -> Self {
        RequestAggregator {
            state,
            block_manager,
            events,
            fail_on_start: None,
            since: Instant::now(),
            labels: Labels::default(),
        }
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// A request whose batch has no writer (topology failure, DESIGN.md §4 rule 7).
    pub fn failed(
        req: SharedRequest,
        reason: String,
        block_manager: Addr<BlockManager>,
        events: EventSink,
    ) -> Self {
        let mut a = RequestAggregator::new(req, vec![], Policy::Settle, block_manager, events);
        a.fail_on_start = Some(reason);
        a
    }

    fn publish(&mut self, fx: AggEffects, ctx: &mut Context<Self>) {
        if let Some(ff) = fx.first_failure {
            tracing::warn!(req_id = %ff.req.req_id, peer = ?ff.peer, reason = %ff.reason, "first failure");
            self.labels.counter(m::FIRST_FAILURES).increment(1);
            let ev = KvEvent::FirstFailure {
                req_id: ff.req.req_id.clone(),
                peer: ff.peer.clone(),
                reason: ff.reason.clone(),
            };
            // Queue for the BlockManager before telling observers, so an observer's next
            // message to the BlockManager is handled after this one.
            self.block_manager.do_send(ff);
            self.events.emit(ev);
        }
        if let Some(c) = fx.completion {
            let label = if c.outcome.is_ok() { "ok" } else { "failed" };
            tracing::info!(req_id = %c.req.req_id, outcome = label, uncertain = c.uncertain_peers.len(), "completion");
            self.labels
                .counter_by(m::COMPLETIONS, "outcome", label)
                .increment(1);
            self.labels
                .histogram(m::COMPLETION_LATENCY)
                .record(self.since.elapsed().as_secs_f64());
            let ev = KvEvent::Completion {
                req_id: c.req.req_id.clone(),
                outcome: c.outcome.clone(),
                uncertain_peers: c.uncertain_peers.clone(),
                unsettled_peers: c.unsettled_peers.clone(),
            };
            self.block_manager.do_send(c);
            self.events.emit(ev);
            ctx.stop();
        }
    }
}

impl Actor for RequestAggregator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(reason) = self.fail_on_start.take() {
            let fx = self.state.fail_now(reason);
            self.publish(fx, ctx);
        }
    }
}

impl Handler<Settle> for RequestAggregator {
    type Result = ();

    fn handle(&mut self, s: Settle, ctx: &mut Context<Self>) {
        // Everything logged while handling a settle names the request and the peer it came from.
        let _span = tracing::info_span!("settle", req_id = %s.req_id, peer = %s.peer).entered();
        let fx = self.state.on_settle(&s);
        if fx.stale {
            self.labels.counter(m::STALE_SETTLES).increment(1);
            return;
        }
        self.publish(fx, ctx);
    }
}
