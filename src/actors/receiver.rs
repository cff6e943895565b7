//! Receiver: takes a batch from the host (`load_kv`), validates it, finds the peers of each P
//! engine, starts one RequestAggregator per awaited request and hands each Peer its pull.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Supervisor, WrapFuture};

use crate::config::KvRecvConfig;
use crate::messages::{
    BatchError, LoadKv, LoadKvReply, MooncakeXferMetadata, PeerId, Pull, PullId, PullRequest,
    RequestMeta, SharedRequest,
};
use crate::metrics as m;
use crate::rdma::{Landing, PullWindow};

use super::aggregator::RequestAggregator;
use super::aggregator_state::AggregatorState;
use super::block_manager::BlockManager;
use super::event_sink::EventSink;
use super::peer::{Peer, PeerConfig};
use super::rediscovery::{
    EngineKey, PeerHealth, Plan, Rediscovery, RediscoveryConfig, Unreachable,
};
use super::topology::{EngineTopology, TopologyError, TopologySource};
use super::transport::PeerTransport;

pub struct Receiver {
    cfg: KvRecvConfig,
    topology: Rc<dyn TopologySource>,
    transport: Rc<dyn PeerTransport>,
    landing: Arc<dyn Landing>,
    block_manager: Addr<BlockManager>,
    events: EventSink,
    peers: HashMap<PeerId, Addr<Peer>>,
    /// Peer health and lookup backoff, written by the Peers through [`PeerHealth`] handles.
    rediscovery: Rc<RefCell<Rediscovery>>,
    next_pull: PullId,
}

impl Receiver {
    pub fn new(
        cfg: KvRecvConfig,
        topology: Rc<dyn TopologySource>,
        transport: Rc<dyn PeerTransport>,
        landing: Arc<dyn Landing>,
        block_manager: Addr<BlockManager>,
        events: EventSink,
    ) -> Self {
        let rediscovery = Rediscovery::new(RediscoveryConfig {
            base: cfg.topology_retry_base,
            max: cfg.topology_retry_max,
        });
        Receiver {
            cfg,
            topology,
            transport,
            landing,
            block_manager,
            events,
            peers: HashMap::new(),
            rediscovery: Rc::new(RefCell::new(rediscovery)),
            next_pull: 1,
        }
    }

    /// Layout-level checks on top of [`crate::messages::KvRequest::validate`].
    fn check_blocks(&self, r: &RequestMeta) -> Result<(), BatchError> {
        let l = &self.cfg.layout;
        if r.is_awaiting() && r.block_ids.len() != l.num_groups as usize {
            return Err(BatchError::GroupCount {
                req_id: r.req_id.to_string(),
                groups: r.block_ids.len(),
                expected: l.num_groups as usize,
            });
        }
        match r.all_blocks().find(|b| *b >= l.num_blocks) {
            Some(block) => Err(BatchError::BlockOutOfRange {
                req_id: r.req_id.to_string(),
                block,
                num_blocks: l.num_blocks,
            }),
            None => Ok(()),
        }
    }

    fn peer(&mut self, id: &PeerId) -> Addr<Peer> {
        if let Some(a) = self.peers.get(id) {
            return a.clone();
        }
        let (pid, transport, events) = (id.clone(), self.transport.clone(), self.events.clone());
        let cfg = PeerConfig {
            pull_timeout: self.cfg.pull_timeout,
            backoff_base: self.cfg.peer_backoff_base,
            backoff_max: self.cfg.peer_backoff_max,
        };
        let health = PeerHealth::new(self.rediscovery.clone());
        let addr = Supervisor::start(move |_| Peer::new(pid, transport, cfg, events, health));
        self.peers.insert(id.clone(), addr.clone());
        addr
    }

    /// No writer exists for this batch (DESIGN.md §4 rule 7).
    fn fail_batch(&mut self, key: &EngineKey, group: Vec<SharedRequest>, err: TopologyError) {
        metrics::counter!(m::TOPOLOGY_FAILURES).increment(1);
        tracing::warn!(error = %err, requests = group.len(), "topology failure; failing the batch");
        self.rediscovery
            .borrow_mut()
            .lookup_failed(key, err.to_string(), Instant::now());
        self.topology.invalidate(&key.0, &key.1);
        self.fail_awaiting(group, err.to_string());
    }

    /// Nothing is sent for this batch: a peer it needs is known down, or bootstrap is in its
    /// backoff. Failing at once (rule 7: no writer was given an address) beats waiting out a
    /// restart backoff of seconds for an answer that is already known.
    fn fail_unreachable(&mut self, group: Vec<SharedRequest>, why: Unreachable) {
        let reason = match why {
            Unreachable::PeerDown { .. } => "peer_down",
            Unreachable::LookupBackoff { .. } => "lookup_backoff",
        };
        metrics::counter!(m::UNREACHABLE_BATCHES, "reason" => reason).increment(1);
        tracing::warn!(error = %why, requests = group.len(), "failing the batch at once");
        self.fail_awaiting(group, why.to_string());
    }

    fn fail_awaiting(&mut self, group: Vec<SharedRequest>, reason: String) {
        for req in group.into_iter().filter(|r| r.is_awaiting()) {
            RequestAggregator::failed(
                req,
                reason.clone(),
                self.block_manager.clone(),
                self.events.clone(),
            )
            .start();
        }
    }

    fn dispatch(
        &mut self,
        key: EngineKey,
        group: Vec<SharedRequest>,
        topo: Result<EngineTopology, TopologyError>,
    ) {
        let peers = match topo.and_then(|t| t.peers_for(self.cfg.d_rank)) {
            Ok(p) => p,
            Err(e) => return self.fail_batch(&key, group, e),
        };
        let down = self
            .rediscovery
            .borrow_mut()
            .lookup_ok(&key, &peers, Instant::now());
        if let Some(why) = down {
            return self.fail_unreachable(group, why);
        }
        // Aggregators first, so no settle can arrive before its aggregator exists.
        let requests: Vec<PullRequest> = group
            .iter()
            .map(|req| PullRequest {
                meta: req.clone(),
                aggregator: req.is_awaiting().then(|| {
                    let state = AggregatorState::new(req.clone(), peers.clone(), self.cfg.policy)
                        .transport_failures_uncertain(self.cfg.mooncake_protocol == "rdma");
                    RequestAggregator::with_state(
                        state,
                        self.block_manager.clone(),
                        self.events.clone(),
                    )
                    .start()
                    .recipient()
                }),
            })
            .collect();
        let awaiting: Vec<SharedRequest> =
            group.iter().filter(|r| r.is_awaiting()).cloned().collect();
        let (host, port) = self.landing.endpoint();
        for peer in &peers {
            let pull_id = self.next_pull;
            self.next_pull += 1;
            let bases = self.landing.open_pull(&PullWindow {
                pull_id,
                peer,
                requests: &awaiting,
            });
            let payload = self.metadata(&host, port, &group, bases).encode();
            let payload = match payload {
                Ok(p) => p,
                Err(e) => {
                    // Encoding our own struct cannot fail; if it ever does, nothing was sent.
                    tracing::error!(error = %e, "cannot encode metadata");
                    continue;
                }
            };
            self.peer(peer).do_send(Pull {
                pull_id,
                payload,
                requests: requests.clone(),
            });
        }
    }

    fn metadata(
        &self,
        host: &str,
        port: u32,
        group: &[SharedRequest],
        bases: Vec<u64>,
    ) -> MooncakeXferMetadata {
        let l = &self.cfg.layout;
        let d = self.cfg.d_rank;
        let mut md = MooncakeXferMetadata::minimal(host, port, d.tp_size, d.tp_rank);
        md.remote_pp_size = d.pp_size;
        for r in group {
            // Cleanup pulls and full prefix hits send an empty outer list, as vLLM does.
            let blocks = if r.is_awaiting() {
                r.block_ids
                    .iter()
                    .map(|g| g.iter().map(|&b| u64::from(b)).collect())
                    .collect()
            } else {
                vec![]
            };
            md.req_blocks
                .insert(r.req_id.to_string(), (r.transfer_id.clone(), blocks));
        }
        md.kv_caches_base_addr = bases;
        md.block_lens = l.regions.iter().map(|r| r.block_len).collect();
        md.kv_block_lens = l.regions.iter().map(|r| r.kv_block_len).collect();
        md.registered_layer_names = l.regions.iter().map(|r| r.layer_name.clone()).collect();
        md.registered_layer_indices = l.regions.iter().map(|r| r.layer_index).collect();
        md.registered_group_indices = l.regions.iter().map(|r| r.group_index).collect();
        md
    }
}

impl Actor for Receiver {
    type Context = Context<Self>;
}

impl Handler<LoadKv> for Receiver {
    type Result = LoadKvReply;

    fn handle(&mut self, batch: LoadKv, ctx: &mut Context<Self>) -> LoadKvReply {
        let mut reply = LoadKvReply::default();
        let mut seen = HashSet::new();
        // (bootstrap, engine) -> requests, in arrival order: one pull per engine and peer.
        let mut groups: Vec<((String, String), Vec<SharedRequest>)> = Vec::new();
        for kv in batch.requests {
            let meta = match kv.validate().and_then(|m| self.check_blocks(&m).map(|_| m)) {
                Ok(m) => m,
                Err(e) => {
                    reply.rejected.push(e);
                    continue;
                }
            };
            if !seen.insert(meta.req_id.clone()) {
                reply.rejected.push(BatchError::Duplicate {
                    req_id: meta.req_id.to_string(),
                });
                continue;
            }
            reply.accepted += 1;
            reply.awaiting += usize::from(meta.is_awaiting());
            let key = (meta.bootstrap_addr.clone(), meta.engine_id.clone());
            let meta = Arc::new(meta);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(meta),
                None => groups.push((key, vec![meta])),
            }
        }
        for e in &reply.rejected {
            tracing::warn!(error = %e, "request refused at load_kv");
        }
        for (key, group) in groups {
            let plan = self.rediscovery.borrow_mut().plan(&key, Instant::now());
            match plan {
                Plan::Fail(why) => {
                    self.fail_unreachable(group, why);
                    continue;
                }
                Plan::Refresh => {
                    // A peer of this engine failed: P may have restarted on new ports.
                    metrics::counter!(m::TOPOLOGY_REFRESHES).increment(1);
                    tracing::info!(bootstrap = %key.0, engine = %key.1, "a peer failed; asking bootstrap again");
                    self.topology.invalidate(&key.0, &key.1);
                }
                Plan::Lookup => {}
            }
            let lookup = self.topology.lookup(&key.0, &key.1);
            ctx.spawn(
                lookup
                    .into_actor(self)
                    .map(move |topo, act, _ctx| act.dispatch(key, group, topo)),
            );
        }
        reply
    }
}
