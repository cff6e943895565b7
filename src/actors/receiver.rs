//! Receiver: the actor shell of [`ReceiverState`]. It takes a batch from the host (`load_kv`),
//! lets the state validate and admit it and decide where each engine's requests go, and carries
//! out what the state decides: topology lookups, landing windows, registering every awaited
//! request with the RequestAggregator, and handing each Peer its pull.

#![forbid(unsafe_code)]

use crate::fast_hash::FastMap;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, MessageResult, ResponseActFuture,
    Supervisor, WeakAddr, WrapFuture,
};

use crate::config::KvRecvConfig;
use crate::messages::settle::Cause;
use crate::messages::tick::SweepDue;
use crate::messages::{
    Abort, AbortAtPeer, AbortReply, CountPeers, LoadKv, LoadKvReply, LoadKvTo, LoadMetas,
    PeerCount, PeerId, Pull, PullId, PullLayout, PullRequest, PullRequests, ReqBlocksRef, Retire,
    SharedRequest, UnsentPull,
};
use crate::rdma::{Landing, PullWindow, RegionBases};
use crate::telemetry::{self as m, Labels};

use super::aggregation_table::SharedAggregation;
use super::aggregator::{FailUnsent, RequestAggregator};
use super::aggregator_state::{AggregationRules, AggregatorState, BatchRules};
use super::alarm::Alarm;
use super::batch_plan::{self, Validated};
use super::block_manager::BlockManager;
use super::event_sink::EventSink;
use super::layout_acks::SharedLayoutAcks;
use super::live_set::SharedLiveSet;
use super::peer::{Peer, PeerConfig};
use super::pull_encoder::PullEncoder;
use super::receiver_state::{awaiting, Dispatch, Effect, FailWhy, ReceiverState};
use super::rediscovery::{PeerHealth, Rediscovery, RediscoveryConfig};
use super::topology::TopologySource;
use super::transport::PeerTransport;

/// Entry of the coordinator: validates `load_kv` batches, finds each P engine's peers and starts
/// one aggregator per awaited request before any pull is sent. The decisions are
/// a sans-IO core's (`actors/receiver_state.rs`); this actor performs them.
pub struct Receiver {
    cfg: KvRecvConfig,
    /// Validation, admission, grouping, rediscovery decisions, parked and aborted requests.
    state: ReceiverState,
    topology: Rc<dyn TopologySource>,
    transport: Rc<dyn PeerTransport>,
    landing: Arc<dyn Landing>,
    block_manager: Addr<BlockManager>,
    /// Live requests and their blocks: a batch is admitted here before any pull is sent.
    live: SharedLiveSet,
    /// Every awaited request's settles are aggregated there (started with the first Peer).
    aggregator: Option<Addr<RequestAggregator>>,
    /// The aggregator's table: a batch's awaited requests are registered there before any of
    /// its pulls is handed to a Peer.
    aggregation: SharedAggregation,
    events: EventSink,
    peers: FastMap<PeerId, PeerSlot>,
    /// Peers retired with pulls still in flight: they stop after the last, and an abort still
    /// reaches them meanwhile (weak: they do not keep the actor alive).
    retiring: Vec<WeakAddr<Peer>>,
    /// Peer health and lookup backoff, written by the Peers through [`PeerHealth`] handles.
    rediscovery: Rc<RefCell<Rediscovery>>,
    /// How every request's settles are aggregated: the same for each (one allocation, not one
    /// per batch).
    rules: Arc<AggregationRules>,
    /// Encodes each pull's metadata; holds this registration's layout ids.
    encoder: Arc<PullEncoder>,
    /// The layout ids each P worker echoed (written by the Peers).
    acks: SharedLayoutAcks,
    labels: Labels,
    /// The idle-peer sweep's next run.
    sweep: Option<Alarm>,
}

impl Receiver {
    /// A receiver that hands quarantines to `block_manager` and lands writes through `landing`.
    pub(crate) fn new(
        cfg: KvRecvConfig,
        topology: Rc<dyn TopologySource>,
        transport: Rc<dyn PeerTransport>,
        landing: Arc<dyn Landing>,
        block_manager: Addr<BlockManager>,
        live: SharedLiveSet,
        events: EventSink,
    ) -> Self {
        let rediscovery = Rediscovery::new(RediscoveryConfig {
            base: cfg.topology_retry_base,
            max: cfg.topology_retry_max,
        });
        // Everything but the requests and the bases is the same in every pull. A Receiver is
        // started per registration of the destination memory: a fresh nonce for its ids.
        let encoder = Arc::new(PullEncoder::new(&cfg, landing.endpoint()));
        let rules = Arc::new(AggregationRules {
            policy: cfg.policy,
            transport_failures_uncertain: cfg.mooncake_protocol
                == crate::config::MooncakeProtocol::Rdma,
            verifier: Some(landing.clone()),
        });
        Receiver {
            state: ReceiverState::new(cfg.layout.clone(), cfg.d_rank),
            cfg,
            topology,
            transport,
            landing,
            block_manager,
            live,
            aggregator: None,
            aggregation: SharedAggregation::default(),
            events,
            peers: FastMap::default(),
            retiring: Vec::new(),
            rediscovery: Rc::new(RefCell::new(rediscovery)),
            rules,
            encoder,
            acks: SharedLayoutAcks::default(),
            labels: Labels::default(),
            sweep: None,
        }
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub(crate) fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// The RequestAggregator, started on first use (on this arbiter, like the Receiver).
    /// (Borrowed: cloning an `Addr` allocates.)
    fn aggregator(&mut self) -> &Addr<RequestAggregator> {
        self.aggregator.get_or_insert_with(|| {
            RequestAggregator::new(
                self.aggregation.clone(),
                self.block_manager.clone(),
                self.events.clone(),
            )
            .with_labels(self.labels.clone())
            .start()
        })
    }

    /// Hand `msg` to the Peer of `id` (started if there is none), marking it used at `now`.
    fn hand_peer<M>(&mut self, id: &PeerId, now: tokio::time::Instant, msg: M)
    where
        M: actix::Message + Send + 'static,
        M::Result: Send,
        Peer: Handler<M>,
    {
        if let Some(slot) = self.peers.get_mut(id) {
            slot.used = now;
            return slot.addr.do_send(msg);
        }
        self.start_peer(id, now).do_send(msg);
    }

    fn start_peer(&mut self, id: &PeerId, now: tokio::time::Instant) -> Addr<Peer> {
        let (pid, transport, events) = (id.clone(), self.transport.clone(), self.events.clone());
        let aggregator = self.aggregator().clone().recipient();
        let cfg = PeerConfig {
            pull_timeout: self.cfg.pull_timeout,
            backoff_base: self.cfg.peer_backoff_base,
            backoff_max: self.cfg.peer_backoff_max,
            abort_grace: self.cfg.abort_grace,
        };
        let health = PeerHealth::new(self.rediscovery.clone());
        let labels = self.labels.clone();
        let acks = self.acks.clone();
        let addr = Supervisor::start(move |_| {
            Peer::new(pid, transport, cfg, events, aggregator, health)
                .with_labels(labels)
                .with_layout_acks(acks)
        });
        self.peers.insert(
            id.clone(),
            PeerSlot {
                addr: addr.clone(),
                used: now,
            },
        );
        self.labels.gauge(m::PEERS).set(self.peers.len() as f64);
        addr
    }

    /// Retire the Peers no pull was handed for `peer_retire_after`: forgotten here at once (a
    /// later pull to the address starts a new Peer), stopped once their pulls in flight ended.
    /// The engines no batch named as long are forgotten too.
    fn retire_idle_peers(&mut self) {
        let now = tokio::time::Instant::now();
        let after = self.cfg.peer_retire_after;
        let idle: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.used) >= after)
            .map(|(id, _)| id.clone())
            .collect();
        self.retiring.retain(|w| w.upgrade().is_some());
        // The engines no batch named as long: their records, and their cached topologies.
        let forgotten =
            self.state
                .forget_idle(&mut self.rediscovery.borrow_mut(), now.into_std(), after);
        for (bootstrap, engine) in &forgotten {
            self.topology.invalidate(bootstrap, engine);
        }
        if idle.is_empty() {
            return;
        }
        for id in &idle {
            if let Some(slot) = self.peers.remove(id) {
                // A later Peer of the address starts with the layout (P may have gone).
                self.acks.borrow_mut().forget(id);
                self.retiring.push(slot.addr.downgrade());
                slot.addr.do_send(Retire);
            }
        }
        self.labels
            .counter(m::PEERS_RETIRED)
            .increment(idle.len() as u64);
        self.labels.gauge(m::PEERS).set(self.peers.len() as f64);
        tracing::debug!(
            retired = idle.len(),
            left = self.peers.len(),
            "idle peers retired"
        );
    }

    /// Nothing is sent for this group (DESIGN.md §4 rule 7): its awaited requests fail now.
    fn fail(&mut self, group: batch_plan::RequestGroup, why: FailWhy) {
        match &why {
            FailWhy::Topology { key, error } => {
                self.labels.counter(m::TOPOLOGY_FAILURES).increment(1);
                tracing::warn!(%error, requests = group.len(), "topology failure; failing the batch");
                self.topology.invalidate(&key.0, &key.1);
            }
            // A peer it needs is known down, or bootstrap is in its backoff. Failing at once
            // (rule 7: no writer was given an address) beats waiting out a restart backoff of
            // seconds for an answer that is already known.
            FailWhy::Unreachable(u) => {
                let reason = match u {
                    super::rediscovery::Unreachable::PeerDown { .. } => "peer_down",
                    super::rediscovery::Unreachable::LookupBackoff { .. } => "lookup_backoff",
                };
                self.labels
                    .counter_by(m::UNREACHABLE_BATCHES, "reason", reason)
                    .increment(1);
                tracing::warn!(error = %u, requests = group.len(), "failing the batch at once");
            }
            FailWhy::AbortedBeforeDispatch => {
                self.labels
                    .counter_by(m::ABORTS, "stage", "before_dispatch")
                    .increment(1);
                if let Some(r) = group.first() {
                    tracing::info!(req_id = %r.req_id, "request aborted by the host before dispatch");
                }
            }
        }
        self.fail_awaiting(group, why.cause(), why.reason());
    }

    fn fail_awaiting(&mut self, group: batch_plan::RequestGroup, cause: Cause, reason: String) {
        let requests = awaiting(group);
        if !requests.is_empty() {
            self.aggregator().do_send(FailUnsent {
                requests,
                cause,
                reason,
            });
        }
    }

    /// Carry out what the state decided for one engine's requests. `at`: the time (one clock
    /// read for all the batch's engines and peers: the Peers' deadlines count from it);
    /// `since`: when the batch was taken (its completions' latency counts from there).
    fn perform(
        &mut self,
        effect: Option<Effect>,
        at: tokio::time::Instant,
        since: Instant,
        ctx: &mut Context<Self>,
    ) {
        match effect {
            None => {}
            Some(Effect::Fail { group, why }) => self.fail(group, why),
            Some(Effect::Send(d)) => self.send(d, at, since),
            Some(Effect::Lookup {
                key,
                group,
                refresh,
            }) => {
                if refresh {
                    // A peer of this engine failed: P may have restarted on new ports.
                    self.labels.counter(m::TOPOLOGY_REFRESHES).increment(1);
                    tracing::info!(bootstrap = %key.0, engine = %key.1, "a peer failed; asking bootstrap again");
                    self.topology.invalidate(&key.0, &key.1);
                }
                self.look_up(key, group, at, since, ctx);
            }
        }
    }

    /// Find the engine's peers, then perform what the state makes of them: at once when the
    /// source answers at once (cached, or a lookup that is ready: no abort can come in between),
    /// else once the lookup answers (the group parked meanwhile).
    fn look_up(
        &mut self,
        key: super::rediscovery::EngineKey,
        group: batch_plan::RequestGroup,
        at: tokio::time::Instant,
        since: Instant,
        ctx: &mut Context<Self>,
    ) {
        let now = at.into_std();
        if let Some(topo) = self.topology.cached(&key.0, &key.1) {
            let fx = {
                let rd = &mut self.rediscovery.borrow_mut();
                self.state.on_cached(rd, key, group, topo, now)
            };
            return self.perform(fx, at, since, ctx);
        }
        // Not through a future the context polls on its next turn when it is ready now.
        let mut lookup = self.topology.lookup(&key.0, &key.1);
        let ready = lookup.as_mut().poll(&mut std::task::Context::from_waker(
            futures::task::noop_waker_ref(),
        ));
        match ready {
            std::task::Poll::Ready(topo) => {
                let fx = {
                    let rd = &mut self.rediscovery.borrow_mut();
                    self.state.on_lookup(rd, key, group, topo, now)
                };
                self.perform(fx, at, since, ctx)
            }
            std::task::Poll::Pending => {
                self.state.park(&group);
                ctx.spawn(lookup.into_actor(self).map(move |topo, act, ctx| {
                    let at = tokio::time::Instant::now();
                    let fx = {
                        let rd = &mut act.rediscovery.borrow_mut();
                        act.state.resume(rd, key, group, topo, at.into_std())
                    };
                    act.perform(fx, at, since, ctx)
                }));
            }
        }
    }

    /// Every pull of the batch gets a clean landing window, or none is sent (DESIGN.md §5.5):
    /// P is never handed addresses whose writes would all be refused. `None`: refused, the
    /// awaited requests failed.
    fn open_windows(
        &mut self,
        d: &Dispatch,
        pulls: std::ops::Range<PullId>,
    ) -> Option<Vec<RegionBases>> {
        // The windows admit writes for the awaited requests: usually all of them.
        let some_not_awaited: Vec<SharedRequest>;
        let awaited: &[SharedRequest] = if d.all_awaiting() {
            &d.group
        } else {
            some_not_awaited = d
                .group
                .iter()
                .filter(|r| r.is_awaiting())
                .cloned()
                .collect();
            &some_not_awaited
        };
        let windows: SmallVec<[PullWindow<'_>; 4]> = d
            .peers
            .iter()
            .zip(pulls)
            .map(|(peer, pull_id)| PullWindow {
                pull_id,
                peer,
                requests: awaited,
            })
            .collect();
        let refused = match self.landing.open_pulls(&windows) {
            Ok(bases) => return Some(bases),
            Err(e) => e,
        };
        let requests = awaited.len();
        drop(windows);
        self.labels
            .counter_by(m::REQUESTS_REFUSED_NO_WINDOW, "reason", refused.why.label())
            .increment(requests as u64);
        tracing::warn!(error = %refused, requests, "batch refused: no clean landing window for its pulls; nothing sent");
        self.fail_awaiting(d.group.clone(), Cause::NotSent, refused.to_string());
        None
    }

    /// Send a batch's pulls: windows, then the aggregator's table, then one pull per peer.
    fn send(&mut self, d: Dispatch, at: tokio::time::Instant, since: Instant) {
        // The batch's pulls are the next ids, one per peer.
        let pulls = crate::messages::ids::next_pull_ids(d.peers.len() as u64);
        let Some(bases) = self.open_windows(&d, pulls.clone()) else {
            return;
        };
        // The aggregator's table has the requests before any Peer has their pull, so no settle
        // can arrive before its state exists.
        // One allocation per batch for what its requests' states share.
        let batch = BatchRules::new(d.peers.clone(), self.rules.clone());
        let states = d
            .group
            .iter()
            .filter(|r| r.is_awaiting())
            .map(|req| AggregatorState::in_batch(req.clone(), batch.clone()));
        self.aggregation
            .borrow_mut()
            .register(pulls.clone(), states, since);
        self.hand_pulls(d, pulls, bases, at);
    }

    /// One pull per peer: its metadata (layout omitted where the worker echoed it), handed to
    /// the Peer; a pull that cannot be encoded is handed as unsent.
    fn hand_pulls(
        &mut self,
        Dispatch { peers, group }: Dispatch,
        pulls: std::ops::Range<PullId>,
        bases: Vec<RegionBases>,
        used: tokio::time::Instant,
    ) {
        // One list, sorted as the pulls' pending sets keep it, shared by every pull.
        let requests = PullRequests::sorted_unique(group.iter().map(|req| PullRequest {
            meta: req.clone(),
        }));
        let req_blocks = batch_plan::req_blocks(&group);
        let req_blocks = ReqBlocksRef(&req_blocks);
        for ((peer, pull_id), bases) in peers.iter().zip(pulls).zip(bases) {
            let requests = requests.clone();
            // The window's layout id; a worker that echoed it already holds the layout.
            let id = self.encoder.layout_id(&bases);
            let carried = id == 0 || !self.acks.borrow().is_acked(peer, id);
            let layout = PullLayout { id, carried };
            let encoded = self.encoder.encode(&req_blocks, &bases, layout);
            let with_layout = (!carried).then(|| {
                self.labels.counter(m::LAYOUT_OMITTED).increment(1);
                self.encoder.resend(bases.clone(), id)
            });
            drop(bases);
            match encoded {
                Ok(payload) => {
                    let pull = Pull {
                        pull_id,
                        payload,
                        requests,
                        handed_at: used,
                        layout,
                        with_layout,
                    };
                    self.hand_peer(peer, used, pull)
                }
                Err(e) => {
                    // Nothing was sent, so nothing can be written: the peer settles the pull
                    // Failed and every aggregator still reaches zero.
                    self.labels.counter(m::UNSENT_PULLS).increment(1);
                    tracing::error!(error = %e, %peer, pull_id, "cannot encode metadata; failing the pull");
                    let reason = format!("pull not sent: cannot encode its metadata: {e}");
                    let unsent = UnsentPull {
                        pull_id,
                        requests,
                        reason,
                    };
                    self.hand_peer(peer, used, unsent);
                }
            }
        }
    }

    /// Admit the valid requests into the live set (under one lock for the whole batch: its
    /// admission is atomic with respect to releases, drains and other batches, and ends before
    /// any of its pulls is sent), then start the pulls of those admitted: one pull per engine
    /// and peer, requests in arrival order.
    fn admit_and_start(&mut self, validated: Validated, ctx: &mut Context<Self>) -> LoadKvReply {
        let alive = self.block_manager.connected();
        if !alive {
            // Nothing could release these requests' blocks or complete them.
            tracing::error!("block manager stopped; refusing the batch");
        }
        let admitted = self.state.admit(&mut self.live.lock(), validated, alive);
        for e in &admitted.reply.rejected {
            self.labels
                .counter_by(m::LOAD_KV_REJECTED, "reason", e.kind())
                .increment(1);
            tracing::warn!(error = %e, "request refused at load_kv");
        }
        let at = tokio::time::Instant::now();
        let now = at.into_std();
        for (key, group) in admitted.groups {
            let fx = self
                .state
                .plan(&mut self.rediscovery.borrow_mut(), key, group, now);
            self.perform(Some(fx), at, now, ctx);
        }
        admitted.reply
    }
}

/// A Peer the Receiver hands pulls to, and when it last did.
struct PeerSlot {
    addr: Addr<Peer>,
    used: tokio::time::Instant,
}

impl Actor for Receiver {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.arm_sweep(ctx);
    }
}

impl Receiver {
    /// The next sweep of idle peers and of the transport's idle channels: a few times per
    /// retirement period, at most every second (what a hostile peer queues on an idle channel
    /// is freed within that). An [`Alarm`], not `run_interval`: a timer in the context is
    /// polled at every turn of the Receiver (every batch).
    fn arm_sweep(&mut self, ctx: &mut Context<Self>) {
        let every = (self.cfg.peer_retire_after / 4).clamp(
            std::time::Duration::from_millis(1),
            std::time::Duration::from_secs(1),
        );
        let at = tokio::time::Instant::now() + every;
        self.sweep = Alarm::set(ctx.address().downgrade().recipient(), at, SweepDue);
    }
}

impl Handler<SweepDue> for Receiver {
    type Result = ();

    fn handle(&mut self, _: SweepDue, ctx: &mut Context<Self>) {
        self.retire_idle_peers();
        self.transport.sweep_idle();
        self.arm_sweep(ctx);
    }
}

impl Handler<CountPeers> for Receiver {
    type Result = PeerCount;

    fn handle(&mut self, _: CountPeers, _ctx: &mut Context<Self>) -> PeerCount {
        self.retiring.retain(|w| w.upgrade().is_some());
        PeerCount {
            serving: self.peers.len(),
            retiring: self.retiring.len(),
        }
    }
}

impl Handler<LoadKv> for Receiver {
    type Result = MessageResult<LoadKv>;

    /// Validate, admit what is valid into the live set, then start the pulls: all within this
    /// handler, so the host's reply follows at once.
    fn handle(&mut self, batch: LoadKv, ctx: &mut Context<Self>) -> Self::Result {
        let validated = self.state.validate(batch.requests);
        MessageResult(self.admit_and_start(validated, ctx))
    }
}

impl Handler<LoadKvTo> for Receiver {
    type Result = ();

    /// As [`LoadKv`]; the reply goes to the host's channel.
    fn handle(&mut self, msg: LoadKvTo, ctx: &mut Context<Self>) {
        let LoadKvTo {
            batch,
            reply,
            queued,
        } = msg;
        // Taken: its requests are no longer queued (admitted, they count as live instead).
        drop(queued);
        let MessageResult(r) = <Self as Handler<LoadKv>>::handle(self, batch, ctx);
        // The host may have dropped its ticket: the batch proceeds all the same.
        let _ = reply.send(r);
    }
}

impl Handler<LoadMetas> for Receiver {
    type Result = MessageResult<LoadMetas>;

    /// As [`LoadKv`], the requests already read by the host.
    fn handle(&mut self, batch: LoadMetas, ctx: &mut Context<Self>) -> Self::Result {
        let validated = self.state.validate_metas(batch.requests.into_iter());
        MessageResult(self.admit_and_start(validated, ctx))
    }
}

impl Handler<crate::messages::NewRegistration> for Receiver {
    type Result = ();

    /// The memory was registered again (a resume): pulls from now on carry ids of a fresh
    /// nonce, which no P has cached (DESIGN.md §5.4, §7).
    fn handle(&mut self, _: crate::messages::NewRegistration, _ctx: &mut Context<Self>) {
        self.encoder = Arc::new(PullEncoder::new(&self.cfg, self.landing.endpoint()));
        // Sent only by a resume, just before admission reopens.
        self.labels.gauge(m::PAUSED).set(0.0);
    }
}

impl Handler<Abort> for Receiver {
    type Result = ResponseActFuture<Self, AbortReply>;

    /// Downward only: a request not yet sent (its topology lookup in flight) fails at once and
    /// is never sent (no peer has its addresses: its blocks come back with the completion);
    /// otherwise every peer is asked to settle what it still owes for it (Uncertain). The
    /// aggregator then publishes the failure and completes, and the BlockManager holds the
    /// blocks until they are fenced.
    fn handle(&mut self, msg: Abort, ctx: &mut Context<Self>) -> Self::Result {
        if let Some(fx) = self.state.abort(&msg.req_id) {
            let at = tokio::time::Instant::now();
            self.perform(Some(fx), at, at.into_std(), ctx);
            return Box::pin(actix::fut::ready(AbortReply {
                peers_settled: 0,
                before_dispatch: true,
            }));
        }
        let retiring: Vec<Addr<Peer>> = self.retiring.iter().filter_map(|w| w.upgrade()).collect();
        let asks: Vec<_> = self
            .peers
            .values()
            .map(|s| &s.addr)
            .chain(&retiring)
            .map(|p| {
                p.send(AbortAtPeer {
                    req_id: msg.req_id.clone(),
                })
            })
            .collect();
        drop(retiring);
        let req_id = msg.req_id;
        Box::pin(futures::future::join_all(asks).into_actor(self).map(
            move |answers, act: &mut Self, _| {
                // A peer that is restarting settles everything it owed itself.
                let peers_settled = answers
                    .into_iter()
                    .filter(|a| matches!(a, Ok(n) if *n > 0))
                    .count();
                let stage = if peers_settled > 0 {
                    "in_flight"
                } else {
                    "unknown"
                };
                act.labels
                    .counter_by(m::ABORTS, "stage", stage)
                    .increment(1);
                tracing::info!(%req_id, peers_settled, "request aborted by the host");
                AbortReply {
                    peers_settled,
                    before_dispatch: false,
                }
            },
        ))
    }
}

#[cfg(test)]
#[path = "receiver_tests.rs"]
mod tests;
