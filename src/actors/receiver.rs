//! Receiver: takes a batch from the host (`load_kv`), validates it, finds the peers of each P
//! engine, registers every awaited request with the RequestAggregator and hands each Peer its
//! pull.

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
use crate::messages::tick::SweepDue;
use crate::messages::{
    Abort, AbortAtPeer, AbortReply, BatchError, CountPeers, Interner, LoadKv, LoadKvReply,
    LoadKvTo, LoadMetas, PeerCount, PeerId, Pull, PullLayout, PullRequest, PullRequests,
    ReqBlocksRef, ReqId, Retire, SharedRequest, UnsentPull, ABORTED_BY_HOST,
};
use crate::rdma::{Landing, PullWindow};
use crate::telemetry::{self as m, Labels};

use super::aggregation_table::SharedAggregation;
use super::aggregator::{FailUnsent, RequestAggregator};
use super::aggregator_state::{AggregationRules, AggregatorState};
use super::alarm::Alarm;
use super::batch_plan;
use super::block_manager::BlockManager;
use super::event_sink::EventSink;
use super::layout_acks::SharedLayoutAcks;
use super::live_set::SharedLiveSet;
use super::peer::{Peer, PeerConfig};
use super::pull_encoder::PullEncoder;
use super::rediscovery::{
    clock_now, EngineKey, PeerHealth, Plan, Rediscovery, RediscoveryConfig, Unreachable,
};
use super::topology::{EngineTopology, TopologyError, TopologySource};
use super::transport::PeerTransport;

/// Entry of the coordinator: validates `load_kv` batches, finds each P engine's peers and starts
/// one aggregator per awaited request before any pull is sent.
pub struct Receiver {
    cfg: KvRecvConfig,
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
    /// Awaited requests admitted but not yet dispatched (their topology lookup is in flight).
    undispatched: FastMap<ReqId, SharedRequest>,
    /// Requests the host aborted while undispatched: already failed, skipped at dispatch. Kept
    /// by identity, not id: once drained, the id may be loaded again before the first lookup
    /// ends, and that new request must go out.
    aborted: Vec<SharedRequest>,
    /// Engine ids and bootstrap addresses, shared by every request that names them.
    interner: Interner,
    /// Per engine, the source's last cached topology and this worker's peers in it.
    derived: FastMap<EngineKey, (Arc<EngineTopology>, Arc<[PeerId]>)>,
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
    pub fn new(
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
            undispatched: FastMap::default(),
            aborted: Vec::new(),
            interner: Interner::default(),
            derived: FastMap::default(),
            rules,
            encoder,
            acks: SharedLayoutAcks::default(),
            labels: Labels::default(),
            sweep: None,
        }
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub fn with_labels(mut self, labels: Labels) -> Self {
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
        let forgotten = self
            .rediscovery
            .borrow_mut()
            .forget_idle(now.into_std(), after);
        for (bootstrap, engine) in &forgotten {
            self.topology.invalidate(bootstrap, engine);
            self.derived.remove(&(bootstrap.clone(), engine.clone()));
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

    /// No writer exists for this batch (DESIGN.md §4 rule 7).
    fn fail_batch(&mut self, key: &EngineKey, group: batch_plan::RequestGroup, err: TopologyError) {
        self.labels.counter(m::TOPOLOGY_FAILURES).increment(1);
        tracing::warn!(error = %err, requests = group.len(), "topology failure; failing the batch");
        self.rediscovery
            .borrow_mut()
            .lookup_failed(key, err.to_string(), clock_now());
        self.topology.invalidate(&key.0, &key.1);
        self.fail_awaiting(group, err.to_string());
    }

    /// Nothing is sent for this batch: a peer it needs is known down, or bootstrap is in its
    /// backoff. Failing at once (rule 7: no writer was given an address) beats waiting out a
    /// restart backoff of seconds for an answer that is already known.
    fn fail_unreachable(&mut self, group: batch_plan::RequestGroup, why: Unreachable) {
        let reason = match why {
            Unreachable::PeerDown { .. } => "peer_down",
            Unreachable::LookupBackoff { .. } => "lookup_backoff",
        };
        self.labels
            .counter_by(m::UNREACHABLE_BATCHES, "reason", reason)
            .increment(1);
        tracing::warn!(error = %why, requests = group.len(), "failing the batch at once");
        self.fail_awaiting(group, why.to_string());
    }

    /// `r` is being dispatched (or failed): no longer undispatched, unless the id is now another
    /// request's (loaded again after this one was aborted and drained).
    fn forget_undispatched(&mut self, r: &SharedRequest) {
        if self
            .undispatched
            .get(&r.req_id)
            .is_some_and(|u| Arc::ptr_eq(u, r))
        {
            self.undispatched.remove(&r.req_id);
        }
    }

    fn fail_awaiting(&mut self, group: batch_plan::RequestGroup, reason: String) {
        let requests: Vec<_> = group.into_iter().filter(|r| r.is_awaiting()).collect();
        if !requests.is_empty() {
            self.aggregator().do_send(FailUnsent { requests, reason });
        }
    }

    /// This worker's peers in a looked-up topology.
    fn derive_peers(
        &self,
        topo: Result<EngineTopology, TopologyError>,
    ) -> Result<Arc<[PeerId]>, TopologyError> {
        topo.and_then(|t| t.peers_for(self.cfg.d_rank))
            .map(Arc::from)
    }

    /// This worker's peers in the source's cached topology of `key`: derived again only when
    /// the source holds another topology than last time (compared by identity).
    fn peers_of(
        &mut self,
        key: &EngineKey,
        topo: Arc<EngineTopology>,
    ) -> Result<Arc<[PeerId]>, TopologyError> {
        if let Some((known, peers)) = self.derived.get(key) {
            if Arc::ptr_eq(known, &topo) {
                return Ok(peers.clone());
            }
        }
        let peers: Arc<[PeerId]> = topo.peers_for(self.cfg.d_rank)?.into();
        self.derived.insert(key.clone(), (topo, peers.clone()));
        Ok(peers)
    }

    /// `at`: the time (one clock read for all the batch's engines and peers: the Peers'
    /// deadlines count from it); `since`: when the batch was taken (its completions' latency
    /// counts from there, `load_kv` to completion).
    fn dispatch(
        &mut self,
        key: EngineKey,
        group: batch_plan::RequestGroup,
        peers: Result<Arc<[PeerId]>, TopologyError>,
        at: tokio::time::Instant,
        since: Instant,
    ) {
        let now = at.into_std();
        let mut group = group;
        if !self.aborted.is_empty() {
            // Aborted during the lookup: failed then, never sent.
            group.retain(
                |r| match self.aborted.iter().position(|a| Arc::ptr_eq(a, r)) {
                    Some(i) => {
                        self.aborted.swap_remove(i);
                        false
                    }
                    None => true,
                },
            );
            if group.is_empty() {
                return;
            }
        }
        let peers = match peers {
            Ok(p) => p,
            Err(e) => return self.fail_batch(&key, group, e),
        };
        let down = self.rediscovery.borrow_mut().lookup_ok(&key, &peers, now);
        if let Some(why) = down {
            return self.fail_unreachable(group, why);
        }
        // The batch's pulls are the next ids, one per peer.
        let pulls = crate::messages::ids::next_pull_ids(peers.len() as u64);
        // The windows admit writes for the awaited requests: usually all of them.
        let some_not_awaited: Vec<SharedRequest>;
        let awaiting: &[SharedRequest] = if group.iter().all(|r| r.is_awaiting()) {
            &group
        } else {
            some_not_awaited = group.iter().filter(|r| r.is_awaiting()).cloned().collect();
            &some_not_awaited
        };
        // Every pull of the batch gets a clean landing window, or none is sent (DESIGN.md
        // §5.5): P is never handed addresses whose writes would all be refused.
        let windows: SmallVec<[PullWindow<'_>; 4]> = peers
            .iter()
            .zip(pulls.clone())
            .map(|(peer, pull_id)| PullWindow {
                pull_id,
                peer,
                requests: awaiting,
            })
            .collect();
        let bases = match self.landing.open_pulls(&windows) {
            Ok(b) => b,
            Err(e) => {
                drop(windows);
                let requests = group.iter().filter(|r| r.is_awaiting()).count();
                self.labels
                    .counter_by(m::REQUESTS_REFUSED_NO_WINDOW, "reason", e.why.label())
                    .increment(requests as u64);
                tracing::warn!(error = %e, requests, "batch refused: no clean landing window for its pulls; nothing sent");
                return self.fail_awaiting(group, e.to_string());
            }
        };
        drop(windows);
        // The aggregator's table has the requests before any Peer has their pull, so no settle
        // can arrive before its state exists.
        let rules = &self.rules;
        let states = group
            .iter()
            .filter(|r| r.is_awaiting())
            .map(|req| AggregatorState::with_rules(req.clone(), peers.clone(), rules.clone()));
        self.aggregation
            .borrow_mut()
            .register(pulls.clone(), states, since);
        let mut requests: PullRequests = group
            .iter()
            .map(|req| PullRequest {
                meta: req.clone(),
                awaited: req.is_awaiting(),
            })
            .collect();
        let used = at;
        let req_blocks = batch_plan::req_blocks(&group);
        let req_blocks = ReqBlocksRef(&req_blocks);
        for (k, ((peer, pull_id), bases)) in peers.iter().zip(pulls.clone()).zip(bases).enumerate()
        {
            // Each pull owns its requests; the last one takes the list itself.
            let requests = if k + 1 == peers.len() {
                std::mem::take(&mut requests)
            } else {
                requests.clone()
            };
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
                Ok(payload) => self.hand_peer(
                    peer,
                    used,
                    Pull {
                        pull_id,
                        payload,
                        requests,
                        handed_at: used,
                        layout,
                        with_layout,
                    },
                ),
                Err(e) => {
                    // Nothing was sent, so nothing can be written: the peer settles the pull
                    // Failed and every aggregator still reaches zero.
                    self.labels.counter(m::UNSENT_PULLS).increment(1);
                    tracing::error!(error = %e, %peer, pull_id, "cannot encode metadata; failing the pull");
                    let reason = format!("pull not sent: cannot encode its metadata: {e}");
                    self.hand_peer(
                        peer,
                        used,
                        UnsentPull {
                            pull_id,
                            requests,
                            reason,
                        },
                    );
                }
            }
        }
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
    /// The next idle-peer sweep: a few times per retirement period, at most every 10 s. An
    /// [`Alarm`], not `run_interval`: a timer in the context is polled at every turn of the
    /// Receiver (every batch).
    fn arm_sweep(&mut self, ctx: &mut Context<Self>) {
        let every = (self.cfg.peer_retire_after / 4).clamp(
            std::time::Duration::from_millis(1),
            std::time::Duration::from_secs(10),
        );
        let at = tokio::time::Instant::now() + every;
        self.sweep = Alarm::set(ctx.address().downgrade().recipient(), at, SweepDue);
    }
}

impl Handler<SweepDue> for Receiver {
    type Result = ();

    fn handle(&mut self, _: SweepDue, ctx: &mut Context<Self>) {
        self.retire_idle_peers();
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
        let validated = batch_plan::validate(batch.requests, &self.cfg.layout, &mut self.interner);
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
        let validated = batch_plan::validate_metas(batch.requests.into_iter(), &self.cfg.layout);
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
    fn handle(&mut self, msg: Abort, _ctx: &mut Context<Self>) -> Self::Result {
        if let Some(r) = self.undispatched.remove(&msg.req_id) {
            self.aborted.push(r.clone());
            self.fail_awaiting(smallvec::smallvec![r], ABORTED_BY_HOST.into());
            self.labels
                .counter_by(m::ABORTS, "stage", "before_dispatch")
                .increment(1);
            tracing::info!(req_id = %msg.req_id, "request aborted by the host before dispatch");
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

impl Receiver {
    /// Admit the valid requests into the live set, then start the pulls of those admitted:
    /// one pull per engine and peer, requests in arrival order. Rejections are reported in
    /// batch order.
    fn admit_and_start(
        &mut self,
        batch_plan::Validated {
            valid,
            mut rejected,
        }: batch_plan::Validated,
        ctx: &mut Context<Self>,
    ) -> LoadKvReply {
        let mut reply = LoadKvReply::default();
        let mut admitted = batch_plan::RequestGroup::with_capacity(valid.len());
        if self.block_manager.connected() {
            // Under one lock for the whole batch: its admission is atomic with respect to
            // releases, drains and other batches, and ends before any of its pulls is sent.
            let mut live = self.live.lock();
            for (i, meta) in valid {
                match live.admit(&meta) {
                    Ok(()) => {
                        reply.accepted += 1;
                        reply.awaiting += usize::from(meta.is_awaiting());
                        admitted.push(meta);
                    }
                    Err(e) => rejected.push((i, e)),
                }
            }
        } else {
            // Nothing could release these requests' blocks or complete them.
            tracing::error!("block manager stopped; refusing the batch");
            rejected.extend(valid.into_iter().map(|(i, m)| {
                let req_id = m.req_id.to_string();
                (i, BatchError::Unavailable { req_id })
            }));
        }
        let groups = batch_plan::group_by_engine(admitted);
        rejected.sort_by_key(|(i, _)| *i);
        for (_, e) in &rejected {
            self.labels
                .counter_by(m::LOAD_KV_REJECTED, "reason", e.kind())
                .increment(1);
            tracing::warn!(error = %e, "request refused at load_kv");
        }
        reply.rejected = rejected.into_iter().map(|(_, e)| e).collect();
        let at = tokio::time::Instant::now();
        let now = at.into_std();
        for (key, group) in groups {
            let plan = self.rediscovery.borrow_mut().plan(&key, now);
            match plan {
                Plan::Fail(why) => {
                    self.fail_unreachable(group, why);
                    continue;
                }
                Plan::Refresh => {
                    // A peer of this engine failed: P may have restarted on new ports.
                    self.labels.counter(m::TOPOLOGY_REFRESHES).increment(1);
                    tracing::info!(bootstrap = %key.0, engine = %key.1, "a peer failed; asking bootstrap again");
                    self.topology.invalidate(&key.0, &key.1);
                }
                Plan::Lookup => {}
            }
            // A cached topology is ready at once: dispatched now (no abort can come in
            // between), its peers derived once per topology.
            if let Some(topo) = self.topology.cached(&key.0, &key.1) {
                let peers = self.peers_of(&key, topo);
                self.dispatch(key, group, peers, at, now);
                continue;
            }
            // Otherwise dispatched now if the lookup is ready at once, not through a future
            // the context polls on its next turn.
            let mut lookup = self.topology.lookup(&key.0, &key.1);
            let ready = lookup.as_mut().poll(&mut std::task::Context::from_waker(
                futures::task::noop_waker_ref(),
            ));
            match ready {
                // Dispatched within this handler: no abort can come in between.
                std::task::Poll::Ready(topo) => {
                    let peers = self.derive_peers(topo);
                    self.dispatch(key, group, peers, at, now)
                }
                // Until the lookup answers, an abort finds the request here.
                std::task::Poll::Pending => {
                    for r in group.iter().filter(|r| r.is_awaiting()) {
                        self.undispatched.insert(r.req_id.clone(), r.clone());
                    }
                    ctx.spawn(lookup.into_actor(self).map(move |topo, act, _ctx| {
                        for r in &group {
                            act.forget_undispatched(r);
                        }
                        let peers = act.derive_peers(topo);
                        act.dispatch(key, group, peers, tokio::time::Instant::now(), now)
                    }));
                }
            }
        }
        reply
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::actors::block_ledger::BlockLedger;
    use crate::actors::{ScriptedTransport, StaticTopology};
    use crate::layout::KvLayout;
    use crate::messages::{Drain, KvEvent, KvRequest, Outcome, ReqId, SettleOutcome};
    use crate::rdma::StaticLanding;

    /// A BlockManager, a scripted transport and the events, for a Receiver under test.
    struct Rig {
        events: EventSink,
        rx: tokio::sync::mpsc::UnboundedReceiver<KvEvent>,
        bm: Addr<BlockManager>,
        live: SharedLiveSet,
        transport: ScriptedTransport,
        opened: tokio::sync::mpsc::UnboundedReceiver<crate::actors::scripted_transport::OpenedPull>,
    }

    /// The layout of [`rig_receiver`]: one layer, 8 blocks.
    fn rig_config() -> KvRecvConfig {
        KvRecvConfig {
            layout: KvLayout::uniform(1, 64, 8),
            ..KvRecvConfig::default()
        }
    }

    fn rig_landing() -> Arc<dyn Landing> {
        Arc::new(StaticLanding::new("127.0.0.1", 1, vec![0x1000]))
    }

    /// Started on the current arbiter (inside an actix test).
    fn rig() -> Rig {
        let (events, rx) = EventSink::channel();
        let cfg = rig_config();
        let ledger = BlockLedger::new(cfg.quarantine_deadline, None);
        let live = ledger.live_set();
        let bm = BlockManager::new(ledger, rig_landing(), cfg.policy, events.clone()).start();
        let (transport, opened) = ScriptedTransport::new();
        Rig {
            events,
            rx,
            bm,
            live,
            transport,
            opened,
        }
    }

    fn rig_receiver(
        topology: Rc<dyn TopologySource>,
        transport: ScriptedTransport,
        bm: &Addr<BlockManager>,
        live: &SharedLiveSet,
        events: EventSink,
    ) -> Receiver {
        Receiver::new(
            rig_config(),
            topology,
            Rc::new(transport),
            rig_landing(),
            bm.clone(),
            live.share(),
            events,
        )
    }

    /// A pull whose metadata cannot be encoded is never sent, yet each of its awaited requests
    /// is settled Failed by that peer, so the request still completes exactly once.
    #[actix::test]
    async fn a_pull_that_cannot_be_encoded_settles_failed_and_completes() {
        let Rig {
            events,
            mut rx,
            bm,
            live,
            transport,
            mut opened,
        } = rig();
        let topology = StaticTopology::new([StaticTopology::grid("e0", 2, 1)]);
        let mut receiver = rig_receiver(Rc::new(topology), transport, &bm, &live, events);
        Arc::get_mut(&mut receiver.encoder).unwrap().encode = |_, _| {
            Err(crate::messages::WireError::Encode(
                rmp_serde::encode::Error::Syntax("simulated".into()),
            ))
        };
        let receiver = receiver.start();
        let reply = receiver
            .send(LoadKv {
                requests: vec![KvRequest {
                    req_id: "r1".into(),
                    transfer_id: Some("t1".into()),
                    remote_engine_id: Some("e0".into()),
                    remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
                    block_ids: vec![vec![3]],
                }],
            })
            .await
            .unwrap();
        assert_eq!(reply.awaiting, 1);
        let mut settles = vec![];
        let outcome = loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("the request completes")
                .expect("events open");
            match ev {
                KvEvent::Settled { outcome, .. } => settles.push(outcome),
                KvEvent::Completion { outcome, .. } => break outcome,
                _ => {}
            }
        };
        assert_eq!(settles.len(), 2, "both peers settled");
        assert!(settles.iter().all(
            |s| matches!(s, SettleOutcome::Failed { reason: r, .. } if r.contains("not sent"))
        ));
        assert!(matches!(outcome, Outcome::Failed { .. }));
        let step = bm.send(Drain).await.unwrap();
        assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
        assert_eq!(step.invalid_block_ids, vec![3]);
        assert!(opened.try_recv().is_err(), "nothing was sent");
    }

    /// A source that hands out whichever topology it holds now.
    struct Replaceable(RefCell<Arc<EngineTopology>>);

    impl TopologySource for Replaceable {
        fn lookup(
            &self,
            _bootstrap: &str,
            _engine_id: &str,
        ) -> futures::future::LocalBoxFuture<'static, Result<EngineTopology, TopologyError>>
        {
            let t = EngineTopology::clone(&self.0.borrow());
            Box::pin(async move { Ok(t) })
        }
        fn cached(&self, _bootstrap: &str, _engine_id: &str) -> Option<Arc<EngineTopology>> {
            Some(self.0.borrow().clone())
        }
        fn invalidate(&self, _bootstrap: &str, _engine_id: &str) {}
    }

    /// The Receiver keeps the peers it derived from a cached topology; when the source holds
    /// another one (P moved), the next batch goes to the new topology's peers.
    #[actix::test]
    async fn a_batch_goes_to_the_peers_of_the_topology_the_source_holds_now() {
        let Rig {
            events,
            bm,
            live,
            transport,
            mut opened,
            ..
        } = rig();
        let topology = Rc::new(Replaceable(RefCell::new(Arc::new(StaticTopology::grid(
            "e0", 1, 1,
        )))));
        let receiver = rig_receiver(topology.clone(), transport, &bm, &live, events).start();
        let load = |id: &str, block: u32| LoadKv {
            requests: vec![KvRequest {
                req_id: id.into(),
                transfer_id: Some(format!("t-{id}")),
                remote_engine_id: Some("e0".into()),
                remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
                block_ids: vec![vec![block]],
            }],
        };
        let mut next_peer = async || opened.recv().await.expect("a pull").peer.to_string();
        for (id, block) in [("r1", 1), ("r2", 2)] {
            assert_eq!(receiver.send(load(id, block)).await.unwrap().awaiting, 1);
            assert_eq!(next_peer().await, "tcp://e0-0-0");
        }
        let moved = EngineTopology {
            workers: vec![vec![PeerId::new("tcp://moved-0-0")]],
            ..StaticTopology::grid("e0", 1, 1)
        };
        *topology.0.borrow_mut() = Arc::new(moved);
        for (id, block) in [("r3", 3), ("r4", 4)] {
            assert_eq!(receiver.send(load(id, block)).await.unwrap().awaiting, 1);
            assert_eq!(next_peer().await, "tcp://moved-0-0");
        }
    }
}
