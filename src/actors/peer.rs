//! Peer: one per prefill worker, under an actix `Supervisor`. Sends each pull on a channel of its
//! own (marked reusable only when the pull ends with a clean FINISH),
//! turns replies into settles, enforces the per-pull deadline, and on a channel failure stops so
//! the supervisor restarts it, after settling everything it owed as Uncertain. Its health (down
//! until the restart backoff ends, up after a clean FINISH) goes to the Receiver's
//! [`Rediscovery`](super::rediscovery::Rediscovery) through a [`PeerHealth`] handle.

#![forbid(unsafe_code)]

use crate::fast_hash::FastMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::{
    Actor, ActorContext, AsyncContext, Context, Handler, Recipient, StreamHandler, Supervised,
};

use crate::messages::tick::DeadlinesDue;
use crate::messages::{
    AbortAtPeer, Cause, EncodeWithLayout, KvEvent, PeerId, Pull, PullId, Retire, Settles,
    UnsentPull, ABORTED_BY_HOST,
};
use crate::telemetry::{self as m, KeptHandles, Labels};

use super::alarm::Alarm;
use super::event_sink::EventSink;
use super::layout_acks::SharedLayoutAcks;
use super::peer_state::{Effects, PeerState, StaleIds};
use super::pull_mux::{PullHandle, PullMux, Tagged};
use super::rediscovery::{clock_now, PeerHealth};
use super::transport::{CleanFinish, Frames, PeerTransport, TransportError};

/// `stale` events one pull may emit; a peer that keeps naming ids that are not pending would
/// otherwise produce one per reply, without bound (a host not reading events then grows).
pub const STALE_EVENTS_PER_PULL: u32 = 8;

/// Timing knobs of a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerConfig {
    /// Longest silence tolerated during a pull: restarted by a reply that settles a request,
    /// and by at most as many replies that settle nothing as the pull has requests (P answers
    /// each subset that became ready, even one whose requests all expired on P meanwhile; a
    /// peer sending more cannot keep a pull alive with them).
    pub pull_timeout: Duration,
    /// Backoff after the first consecutive failure; doubled per failure.
    pub backoff_base: Duration,
    /// Cap of the doubled backoff.
    pub backoff_max: Duration,
    /// How long after the host aborts a request D still waits for P's answer to it, once the
    /// pull owes nothing else: an answer proves P stopped writing (its window is not
    /// poisoned); no answer by then settles it Uncertain (poisoned until the fence).
    pub abort_grace: Duration,
}

impl PeerConfig {
    /// Backoff before serving pulls again after the `n`-th consecutive failure (n >= 1).
    ///
    /// ```
    /// use std::time::Duration;
    /// let c = kvrecv::actors::PeerConfig { pull_timeout: Duration::from_secs(1),
    ///     backoff_base: Duration::from_millis(100), backoff_max: Duration::from_millis(250),
    ///     abort_grace: Duration::from_secs(30) };
    /// assert_eq!(c.backoff(1), Duration::from_millis(100));
    /// assert_eq!(c.backoff(2), Duration::from_millis(200));
    /// assert_eq!(c.backoff(9), Duration::from_millis(250));
    /// ```
    pub fn backoff(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
        self.backoff_base
            .saturating_mul(factor)
            .min(self.backoff_max)
    }
}

/// What came off one pull's channel.
pub enum ChannelEvent {
    /// A reply's frames.
    Reply(Frames),
    /// The channel failed; the pull's unsettled requests are decided by the state machine.
    Failed(TransportError),
    /// The channel ended (after its last reply, or without one).
    Ended,
}

/// What the merged reply streams yield: a reply or a failure of one pull's channel, or its
/// end (the Peer's stream item).
type PullEvent = Tagged<Result<Frames, TransportError>>;

impl ChannelEvent {
    fn of(item: Option<Result<Frames, TransportError>>) -> Self {
        match item {
            Some(Ok(frames)) => ChannelEvent::Reply(frames),
            Some(Err(e)) => ChannelEvent::Failed(e),
            None => ChannelEvent::Ended,
        }
    }
}

struct Live {
    /// Ends the pull's reply stream (dropping its channel).
    stream: PullHandle<Result<Frames, TransportError>>,
    /// When the pull is abandoned unless a reply comes first that restarts it (see
    /// [`PeerConfig::pull_timeout`]). On tokio's clock, the one the timer runs on.
    deadline: tokio::time::Instant,
    /// Replies that settled nothing may still restart the deadline this many more times.
    idle_restarts: usize,
    /// `stale` events emitted for this pull; past [`STALE_EVENTS_PER_PULL`] stale ids are only
    /// counted.
    stale_events: u32,
    started: tokio::time::Instant,
    span: tracing::Span,
    /// Set on a clean FINISH, so the transport may reuse the channel.
    finish: CleanFinish,
    /// A stray message reached the channel (see [`Effects::stray`]): never reuse it.
    stray: bool,
    /// The host aborted a request of this pull: once the pull owes nothing else, its deadline
    /// is no later than this (the abort's grace).
    abort_deadline: Option<tokio::time::Instant>,
    /// The pull omitted its layout: how to encode it with it, should P answer `LAYOUT_MISS`.
    with_layout: Option<EncodeWithLayout>,
}

/// One actor per prefill peer (ZMQ endpoint): sends pulls, matches replies to pending ids, and
/// settles every request it was given exactly once.
pub struct Peer {
    state: PeerState,
    transport: Rc<dyn PeerTransport>,
    cfg: PeerConfig,
    events: EventSink,
    /// Where settles of awaited requests go.
    aggregator: Recipient<Settles>,
    health: PeerHealth,
    live: FastMap<PullId, Live>,
    /// The live pulls' reply streams, merged into one stream of the actor's (added on the
    /// first pull; a restart drops the actor's streams, and this with them).
    mux: Option<PullMux<Result<Frames, TransportError>>>,
    /// One timer for the deadlines of all live pulls, armed for the earliest and never
    /// cancelled when a pull ends: when it fires, overdue pulls are abandoned and it is armed
    /// again for the earliest deadline left. A timer per pull cost a timer-wheel registration,
    /// a wake-up of the runtime's driver (an eventfd write) and a cancellation per pull.
    timer: Option<Alarm>,
    restarts: u32,
    consecutive_failures: u32,
    backoff_until: Option<Instant>,
    /// The channel error that stopped the previous incarnation (for the health record).
    last_failure: Option<String>,
    /// The Receiver retired this Peer: it stops once no pull is in flight.
    retiring: bool,
    labels: Labels,
    /// The per-pull and per-settle metrics, kept after their first use.
    kept: KeptHandles,
    /// The layout ids each P worker echoed, shared with the Receiver (which omits the layout
    /// of a pull whose window's id this worker acked).
    acks: SharedLayoutAcks,
}

impl Peer {
    /// A peer `id` talking through `transport`, settling into `aggregator`; `health` reports
    /// its failures to the Receiver's rediscovery.
    pub(crate) fn new(
        id: PeerId,
        transport: Rc<dyn PeerTransport>,
        cfg: PeerConfig,
        events: EventSink,
        aggregator: Recipient<Settles>,
        health: PeerHealth,
    ) -> Self {
        Peer {
            state: PeerState::new(id),
            transport,
            cfg,
            events,
            aggregator,
            health,
            live: FastMap::default(),
            mux: None,
            timer: None,
            restarts: 0,
            consecutive_failures: 0,
            backoff_until: None,
            last_failure: None,
            retiring: false,
            labels: Labels::default(),
            kept: KeptHandles::default(),
            acks: SharedLayoutAcks::default(),
        }
    }

    /// Record this worker's layout-id echoes in `acks` (the Receiver's table).
    pub(crate) fn with_layout_acks(mut self, acks: SharedLayoutAcks) -> Self {
        self.acks = acks;
        self
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub(crate) fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    fn id(&self) -> &PeerId {
        self.state.peer()
    }

    fn start_pull(&mut self, pull: Pull, ctx: &mut Context<Self>) {
        let Pull {
            pull_id,
            payload,
            requests,
            handed_at,
            layout,
            with_layout,
        } = pull;
        // The pull's requests by id, so a log line inside the pull finds its requests (listed
        // only when the span is enabled).
        let span = tracing::info_span!("pull", peer = %self.id(), pull_id,
            req_id = ?requests.iter().map(|r| &*r.meta.req_id).collect::<Vec<_>>());
        span.in_scope(|| tracing::debug!("sending pull"));
        self.kept.increment(&self.labels, m::PULLS, "", "", 1);
        let carried = requests.len();
        self.state.start(pull_id, requests);
        self.state.set_layout(pull_id, layout);
        let finish = CleanFinish::default();
        let replies = self.transport.pull(self.id(), payload, finish.clone());
        let mux = self.mux.get_or_insert_with(|| {
            let (mux, merged) = PullMux::new();
            ctx.add_stream(merged);
            mux
        });
        let stream = mux.add(pull_id, replies);
        let started = handed_at;
        let deadline = self.deadline_from(started, ctx);
        self.live.insert(
            pull_id,
            Live {
                stream,
                deadline,
                idle_restarts: carried,
                stale_events: 0,
                started,
                span,
                finish,
                stray: false,
                abort_deadline: None,
                with_layout,
            },
        );
    }

    /// P lost the layout the pull omitted (`LAYOUT_MISS`): the same pull, with its layout, on
    /// a new channel (P ended the old exchange). Same id, window and pending requests; the
    /// deadline restarts with the send. If it cannot be encoded, the pull fails as unsent (P
    /// wrote nothing for it).
    fn resend_with_layout(&mut self, pull_id: PullId, ctx: &mut Context<Self>) {
        let Some(encode) = self
            .live
            .get_mut(&pull_id)
            .and_then(|l| l.with_layout.take())
        else {
            return;
        };
        self.labels.counter(m::LAYOUT_RESENDS).increment(1);
        let payload = match encode(&self.state.pending_requests(pull_id)) {
            Ok(p) => p,
            Err(e) => {
                let fx = self
                    .state
                    .fail_unsent(pull_id, format!("pull not resent with its layout: {e}"));
                return self.apply(pull_id, fx);
            }
        };
        let Some(l) = self.live.get_mut(&pull_id) else {
            return;
        };
        l.span
            .in_scope(|| tracing::info!(peer = %self.state.peer(), "P lost the layout; resending the pull with it"));
        // The old exchange is over: its channel is not reused (it ended on a miss, not FINISH).
        let finish = CleanFinish::default();
        let old = std::mem::replace(&mut l.finish, finish.clone());
        drop(old);
        let replies = self.transport.pull(self.state.peer(), payload, finish);
        let Some(mux) = self.mux.as_mut() else {
            return;
        };
        let stream = mux.add(pull_id, replies);
        let old = std::mem::replace(&mut l.stream, stream);
        old.end();
        l.idle_restarts = self.state.pending_count();
        let deadline = self.deadline_from(tokio::time::Instant::now(), ctx);
        if let Some(l) = self.live.get_mut(&pull_id) {
            l.deadline = deadline;
        }
    }

    /// A deadline `pull_timeout` after `now`, with the timer armed to fire no later than it.
    fn deadline_from(
        &mut self,
        now: tokio::time::Instant,
        ctx: &mut Context<Self>,
    ) -> tokio::time::Instant {
        let at = now + self.cfg.pull_timeout;
        self.arm_timer(at, ctx);
        at
    }

    /// A pull that owes only aborted requests waits no longer than the abort's grace.
    fn cap_at_abort_grace(&mut self, pull_id: PullId, ctx: &mut Context<Self>) {
        if !self.state.only_aborted_pending(pull_id) {
            return;
        }
        let Some(l) = self.live.get_mut(&pull_id) else {
            return;
        };
        let Some(at) = l.abort_deadline.filter(|&at| at < l.deadline) else {
            return;
        };
        l.deadline = at;
        self.arm_timer(at, ctx);
    }

    /// Make the timer fire no later than `at`. Deadlines are `pull_timeout` after their start
    /// (only an abort's grace is sooner), so a new one is rarely earlier than the armed one
    /// and rarely re-registers the timer.
    fn arm_timer(&mut self, at: tokio::time::Instant, ctx: &mut Context<Self>) {
        if self.timer.as_ref().is_some_and(|armed| armed.at() <= at) {
            return;
        }
        // The one it replaces (if any) is cancelled as it drops.
        self.timer = Alarm::set(ctx.address().downgrade().recipient(), at, DeadlinesDue);
    }

    /// Abandon every pull whose deadline passed; arm the timer for the earliest one left.
    fn on_timer(&mut self, ctx: &mut Context<Self>) {
        self.timer = None;
        let now = tokio::time::Instant::now();
        let mut overdue: Vec<PullId> = self
            .live
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        overdue.sort_unstable();
        let timeout = self.cfg.pull_timeout;
        for pull_id in overdue {
            self.labels.counter(m::DEADLINE_EXPIRIES).increment(1);
            let fx = self.state.abandon(
                pull_id,
                Cause::Timeout,
                format!(
                    "no reply within the {} pull deadline",
                    crate::millis::Millis(timeout)
                ),
            );
            self.apply(pull_id, fx);
            // Nothing is owed once abandoned; the channel goes either way.
            self.close(pull_id);
        }
        if let Some(next) = self.live.values().map(|l| l.deadline).min() {
            self.arm_timer(next, ctx);
        }
        self.stop_if_retired(ctx);
    }

    /// Send settles, count, and close the pull's channel when it is over.
    fn apply(&mut self, pull_id: PullId, mut fx: Effects) {
        let span = self
            .live
            .get(&pull_id)
            .map(|l| l.span.clone())
            .unwrap_or_else(tracing::Span::none);
        let _g = span.enter();
        if let Some(reason) = &fx.malformed {
            self.labels.counter(m::MALFORMED_REPLIES).increment(1);
            tracing::warn!(%reason, "malformed reply");
        }
        if !fx.stale.is_empty() {
            let StaleIds { count, sample } = std::mem::take(&mut fx.stale);
            self.labels
                .counter(m::STALE_SETTLES)
                .increment(count as u64);
            tracing::debug!(count, ?sample, "stale ids in reply");
            let emitted = self.live.get_mut(&pull_id).map_or(0, |l| {
                l.stale_events += 1;
                l.stale_events
            });
            if emitted <= STALE_EVENTS_PER_PULL {
                self.events.emit(KvEvent::Stale {
                    peer: self.id().clone(),
                    pull_id,
                    count,
                    sample,
                });
            }
            if emitted == STALE_EVENTS_PER_PULL {
                tracing::warn!(
                    "peer keeps naming ids that are not pending: this pull's further stale \
                     replies are only counted (kvrecv_stale_settles_total)"
                );
            }
        }
        // Counted per outcome, and recorded once per reply (a handle lookup each, not one per
        // request).
        let mut by_outcome: smallvec::SmallVec<[(&'static str, u64); 2]> =
            smallvec::SmallVec::new();
        for s in &fx.settles {
            let label = s.outcome.label();
            match by_outcome.iter_mut().find(|(l, _)| *l == label) {
                Some((_, n)) => *n += 1,
                None => by_outcome.push((label, 1)),
            }
            tracing::debug!(req_id = %s.req_id, outcome = s.outcome.label(), reason = s.outcome.reason(), "settle");
            if self.events.wants_detail() {
                self.events.emit(KvEvent::Settled {
                    peer: s.peer.clone(),
                    pull_id: s.pull_id,
                    req_id: s.req_id.clone(),
                    outcome: s.outcome.clone(),
                });
            }
        }
        for (label, n) in by_outcome {
            self.kept
                .increment(&self.labels, m::SETTLES, "outcome", label, n);
        }
        let to_aggregate = fx.awaited();
        if !to_aggregate.is_empty() {
            self.aggregator.do_send(Settles(to_aggregate));
        }
        if let Some(id) = fx.layout_echoed {
            self.acks.borrow_mut().echoed(self.state.peer(), id);
        }
        if fx.layout_miss {
            self.acks.borrow_mut().forget(self.state.peer());
        }
        if fx.stray {
            self.labels.counter(m::STRAY_REPLIES).increment(1);
            tracing::warn!(pull_id, "a reply named none of the pull's requests (a stray of an earlier exchange); its channel will not be reused");
            if let Some(l) = self.live.get_mut(&pull_id) {
                l.stray = true;
            }
        }
        if fx.finished_cleanly {
            // Before `close` drops the stream: the transport reads it then.
            if let Some(l) = self.live.get(&pull_id).filter(|l| !l.stray) {
                l.finish.set();
            }
            self.consecutive_failures = 0;
            self.health.up(self.state.peer());
        }
        if fx.pull_done {
            self.close(pull_id);
        }
    }

    fn close(&mut self, pull_id: PullId) {
        if let Some(l) = self.live.remove(&pull_id) {
            l.stream.end(); // drops the channel: back to the pool, or closed with linger 0
            let took = l.started.elapsed().as_secs_f64();
            self.kept.record(&self.labels, m::PULL_LATENCY, took);
        }
    }

    /// A pull that reached us during the restart backoff (the Receiver checked our health
    /// before we failed). It is settled at once instead of waiting out the backoff; nothing was
    /// sent, so no peer can write for it: Failed, not Uncertain.
    fn refuse(&mut self, pull: Pull, until: Instant) {
        self.labels
            .counter_by(m::UNREACHABLE_BATCHES, "reason", "peer_backoff")
            .increment(1);
        let left = until.saturating_duration_since(clock_now());
        tracing::warn!(peer = %self.id(), pull_id = pull.pull_id, backoff_left_ms = left.as_millis() as u64,
            "pull refused: peer is in its restart backoff");
        self.state.start(pull.pull_id, pull.requests);
        let fx = self.state.fail_unsent(
            pull.pull_id,
            format!(
                "peer {} is down after a channel failure; not retried for {}",
                self.id(),
                crate::millis::Millis(left)
            ),
        );
        self.apply(pull.pull_id, fx);
    }
}

impl Actor for Peer {
    type Context = Context<Self>;
}

impl Supervised for Peer {
    /// Everything the old incarnation owed is settled Uncertain, exactly once, before the new one
    /// serves anything (DESIGN.md §6).
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.restarts += 1;
        self.consecutive_failures += 1;
        let reason = format!("peer {} restarted after a channel failure", self.id());
        self.abandon_all(&reason);
        // P may have restarted too, its layouts lost: the next pulls carry theirs.
        self.acks.borrow_mut().forget(self.state.peer());
        for (_, l) in self.live.drain() {
            l.stream.end();
        }
        // The restart dropped the actor's streams and timers: the merged stream and the
        // deadline timer are made again by the next pull.
        self.mux = None;
        self.timer = None;
        let backoff = self.cfg.backoff(self.consecutive_failures);
        let until = clock_now() + backoff;
        self.backoff_until = Some(until);
        // Marks the engines that list this peer stale: P may have come back elsewhere.
        let cause = self.last_failure.take().unwrap_or(reason);
        self.health.down(self.state.peer(), until, cause);
        self.labels.counter(m::PEER_RESTARTS).increment(1);
        tracing::warn!(peer = %self.id(), restarts = self.restarts, backoff_ms = backoff.as_millis() as u64, "peer restarted");
        self.events.emit(KvEvent::PeerRestarted {
            peer: self.id().clone(),
            restarts: self.restarts,
        });
    }
}

impl Handler<DeadlinesDue> for Peer {
    type Result = ();

    fn handle(&mut self, _: DeadlinesDue, ctx: &mut Context<Self>) {
        self.on_timer(ctx);
    }
}

impl Handler<Pull> for Peer {
    type Result = ();

    fn handle(&mut self, pull: Pull, ctx: &mut Context<Self>) {
        match self.backoff_until {
            Some(until) if until > clock_now() => self.refuse(pull, until),
            _ => self.start_pull(pull, ctx),
        }
    }
}

impl Handler<UnsentPull> for Peer {
    type Result = ();

    /// Nothing was sent, so there is no channel, deadline or backoff to respect.
    fn handle(&mut self, pull: UnsentPull, _ctx: &mut Context<Self>) {
        let fx = self.state.unsent(&pull);
        self.apply(pull.pull_id, fx);
    }
}

impl Handler<AbortAtPeer> for Peer {
    type Result = usize;

    /// The host stopped waiting: P still has the request's addresses and may be writing, so
    /// the request settles (as aborted) on P's answer, which proves P stopped, or Uncertain
    /// once the abort's grace passed without one; the blocks wait for that either way.
    fn handle(&mut self, msg: AbortAtPeer, ctx: &mut Context<Self>) -> usize {
        let pulls = self.state.abort(&msg.req_id, ABORTED_BY_HOST);
        if !pulls.is_empty() {
            tracing::info!(peer = %self.id(), req_id = %msg.req_id, pulls = pulls.len(),
                grace = ?self.cfg.abort_grace, "request aborted by the host; waiting for P's answer");
        }
        let at = tokio::time::Instant::now() + self.cfg.abort_grace;
        for &pull_id in &pulls {
            if let Some(l) = self.live.get_mut(&pull_id) {
                l.abort_deadline.get_or_insert(at);
            }
            self.cap_at_abort_grace(pull_id, ctx);
        }
        pulls.len()
    }
}

impl Handler<Retire> for Peer {
    type Result = ();

    fn handle(&mut self, _: Retire, ctx: &mut Context<Self>) {
        self.retiring = true;
        self.stop_if_retired(ctx);
    }
}

impl Peer {
    /// Settle Uncertain everything every pull still owes, and close those pulls.
    fn abandon_all(&mut self, reason: &str) {
        let (fx, pulls) = self.state.abandon_all(reason);
        self.apply(0, fx);
        for id in pulls {
            self.close(id);
        }
    }

    /// A retired Peer stops once no pull is in flight. With no address left (the Receiver
    /// dropped its own) the supervisor does not restart it.
    fn stop_if_retired(&mut self, ctx: &mut Context<Self>) {
        if self.retiring && self.live.is_empty() {
            tracing::debug!(peer = %self.id(), "retired: no pull for a while");
            ctx.stop();
        }
    }
}

impl StreamHandler<PullEvent> for Peer {
    fn handle(&mut self, ev: PullEvent, ctx: &mut Context<Self>) {
        let pull_id = ev.pull_id;
        if !self.state.is_in_flight(pull_id) {
            return;
        }
        match ChannelEvent::of(ev.item) {
            ChannelEvent::Reply(frames) => {
                let fx = self.state.on_reply(pull_id, frames);
                // P restarts its readiness wait after every subset; so does D's deadline. A
                // reply that settles nothing (every request of its subset expired on P, or a
                // peer naming only ids not pending) restarts it only while such replies are no
                // more than the pull's requests: each real subset takes one request from P.
                let restart = !fx.pull_done
                    && self.live.get_mut(&pull_id).is_some_and(|l| {
                        if !fx.settles.is_empty() {
                            return true;
                        }
                        let allowed = l.idle_restarts > 0;
                        l.idle_restarts = l.idle_restarts.saturating_sub(1);
                        allowed
                    });
                if restart {
                    let new = self.deadline_from(tokio::time::Instant::now(), ctx);
                    if let Some(l) = self.live.get_mut(&pull_id) {
                        l.deadline = new;
                    }
                }
                let resend = fx.resend_with_layout;
                self.apply(pull_id, fx);
                if resend {
                    self.resend_with_layout(pull_id, ctx);
                }
                self.cap_at_abort_grace(pull_id, ctx);
            }
            // Nothing left D: that pull fails (no writer has it), the peer is not restarted.
            ChannelEvent::Failed(
                e @ (TransportError::Local { .. } | TransportError::BadAddress { .. }),
            ) => {
                let fx = self.state.fail_unsent(pull_id, e.to_string());
                self.apply(pull_id, fx);
            }
            ChannelEvent::Failed(e) => {
                self.last_failure = Some(e.to_string());
                let fx = match e {
                    // The connection failed before the request was taken: P never got it, so
                    // it cannot write for it (no window to poison). The peer still restarts:
                    // its address may be stale.
                    TransportError::Connect { .. } => {
                        self.state.fail_unsent(pull_id, e.to_string())
                    }
                    _ => self.state.abandon(pull_id, Cause::Channel, e.to_string()),
                };
                self.apply(pull_id, fx);
                if self.retiring {
                    // Retired, nothing restarts us (the Receiver holds no address of ours):
                    // what the other pulls owe is settled here, as `restarting` would.
                    self.abandon_all(&format!("peer {} failed: {e}", self.id()));
                }
                ctx.stop(); // the supervisor restarts us; `restarting` settles the rest
                return;
            }
            ChannelEvent::Ended => {
                let fx = self.state.abandon(
                    pull_id,
                    Cause::Channel,
                    "channel closed before FINISH".into(),
                );
                self.apply(pull_id, fx);
            }
        }
        self.stop_if_retired(ctx);
    }

    /// One pull's channel ending is not the actor's end.
    fn finished(&mut self, _ctx: &mut Context<Self>) {}
}
