//! The Receiver's decisions, without actors, sockets or clocks (DESIGN.md §3, §4 rules 7–8):
//! validation, admission at the host boundary (one live load per request id), grouping by
//! engine, the rediscovery decisions before and after a topology lookup, the requests parked
//! while a lookup is in flight (and those the host aborted meanwhile), and which peers each
//! batch goes to. Each step returns an [`Effect`]; the Receiver actor carries it out (topology
//! source, landing windows, metadata, Peers, aggregator), and the model check
//! (`tests/model_check.rs`) feeds the same effects into the other cores.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use crate::config::DRank;
use crate::fast_hash::FastMap;
use crate::layout::KvLayout;
use crate::messages::settle::Cause;
use crate::messages::{
    BatchError, Interner, KvRequest, LoadKvReply, PeerId, ReqId, RequestMeta, SharedRequest,
    ABORTED_BY_HOST,
};

use super::batch_plan::{self, EngineGroups, RequestGroup, Validated};
use super::live_set::LiveSet;
use super::rediscovery::{EngineKey, Plan, Rediscovery, Unreachable};
use super::topology::{EngineTopology, TopologyError};

/// What the Receiver must do next for one engine's requests of a batch.
#[derive(Debug)]
pub enum Effect {
    /// Find the engine's peers: the source's cached topology if it holds one
    /// ([`ReceiverState::on_cached`]), else a lookup ([`ReceiverState::on_lookup`], or
    /// [`ReceiverState::park`] then [`ReceiverState::resume`] when it does not answer at once).
    Lookup {
        /// The engine.
        key: EngineKey,
        /// Its requests of the batch.
        group: RequestGroup,
        /// Drop the source's cached topology first: a peer it names failed, P may have moved.
        refresh: bool,
    },
    /// Send nothing; fail the group's awaited requests at once (no writer ever had their
    /// addresses, rule 7).
    Fail {
        /// The requests (the awaited ones fail; the others were never awaited).
        group: RequestGroup,
        /// Why.
        why: FailWhy,
    },
    /// Send the batch: one pull per peer, each carrying every request of the group.
    Send(Dispatch),
}

/// Why a group is failed without a pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailWhy {
    /// The lookup failed: drop the source's cached topology of `key` too (rule 7).
    Topology {
        /// The engine.
        key: EngineKey,
        /// What the source said.
        error: TopologyError,
    },
    /// A peer the batch needs is known down, or the bootstrap is in its backoff.
    Unreachable(Unreachable),
    /// The host aborted the request before any pull of it was sent.
    AbortedBeforeDispatch,
}

impl FailWhy {
    /// The failure's cause: nothing was sent (a lookup that failed, a peer known down), or
    /// the host aborted first.
    pub fn cause(&self) -> Cause {
        match self {
            FailWhy::Topology { .. } | FailWhy::Unreachable(_) => Cause::NotSent,
            FailWhy::AbortedBeforeDispatch => Cause::Aborted,
        }
    }

    /// The failure's reason, as the host reads it.
    pub fn reason(&self) -> String {
        match self {
            FailWhy::Topology { error, .. } => error.to_string(),
            FailWhy::Unreachable(u) => u.to_string(),
            FailWhy::AbortedBeforeDispatch => ABORTED_BY_HOST.into(),
        }
    }
}

/// A batch's requests of one engine, and the peers that each get one pull of them.
#[derive(Debug)]
pub struct Dispatch {
    /// This D worker's peers of the engine, one pull each.
    pub peers: Arc<[PeerId]>,
    /// The requests, in arrival order.
    pub group: RequestGroup,
}

impl Dispatch {
    /// Whether every request of the group is awaited (the usual case: no filtered copy).
    pub fn all_awaiting(&self) -> bool {
        self.group.iter().all(|r| r.is_awaiting())
    }
}

/// A batch admitted: the host's reply, and the admitted requests grouped by engine.
#[derive(Debug, Default)]
pub struct Admitted {
    /// What the host is told (rejections in batch order).
    pub reply: LoadKvReply,
    /// One group per engine, engines in order of first appearance.
    pub groups: EngineGroups,
}

/// The awaited requests of `group` (those a failure completes).
pub fn awaiting(group: RequestGroup) -> Vec<SharedRequest> {
    group.into_iter().filter(|r| r.is_awaiting()).collect()
}

/// The Receiver's state without I/O. See the module docs.
pub struct ReceiverState {
    layout: KvLayout,
    d_rank: DRank,
    /// Engine ids and bootstrap addresses, shared by every request that names them.
    interner: Interner,
    /// Awaited requests admitted but not yet dispatched (their topology lookup is in flight).
    undispatched: FastMap<ReqId, SharedRequest>,
    /// Requests the host aborted while undispatched: already failed, skipped when their lookup
    /// ends. Kept by identity, not id: once drained, the id may be loaded again before the
    /// first lookup ends, and that new request must go out.
    aborted: Vec<SharedRequest>,
    /// Per engine, the source's last cached topology and this worker's peers in it.
    derived: FastMap<EngineKey, (Arc<EngineTopology>, Arc<[PeerId]>)>,
    /// Mutation for the model check: admit an id that is still live.
    #[cfg(any(test, feature = "testing"))]
    admit_live_ids: bool,
}

/// A copy for a model checker to explore from. The interner is not copied: it only shares
/// strings, and a fresh one decides nothing differently.
impl Clone for ReceiverState {
    fn clone(&self) -> Self {
        ReceiverState {
            layout: self.layout.clone(),
            d_rank: self.d_rank,
            interner: Interner::default(),
            undispatched: self.undispatched.clone(),
            aborted: self.aborted.clone(),
            derived: self.derived.clone(),
            #[cfg(any(test, feature = "testing"))]
            admit_live_ids: self.admit_live_ids,
        }
    }
}

impl ReceiverState {
    /// A Receiver's state for D worker `d_rank` over `layout`.
    pub fn new(layout: KvLayout, d_rank: DRank) -> Self {
        ReceiverState {
            layout,
            d_rank,
            interner: Interner::default(),
            undispatched: FastMap::default(),
            aborted: Vec::new(),
            derived: FastMap::default(),
            #[cfg(any(test, feature = "testing"))]
            admit_live_ids: false,
        }
    }

    /// Mutation (model check only): a request whose id is still live is admitted anyway, which
    /// breaks exactly-once at the host boundary. The checker must find it.
    #[cfg(any(test, feature = "testing"))]
    pub fn admitting_live_ids(mut self) -> Self {
        self.admit_live_ids = true;
        self
    }

    /// Validate a `load_kv` batch ([`batch_plan::validate`]).
    pub fn validate(&mut self, requests: Vec<KvRequest>) -> Validated {
        batch_plan::validate(requests, &self.layout, &mut self.interner)
    }

    /// Validate requests the host already read ([`batch_plan::validate_metas`]).
    pub fn validate_metas(
        &self,
        requests: impl ExactSizeIterator<Item = Result<RequestMeta, BatchError>>,
    ) -> Validated {
        batch_plan::validate_metas(requests, &self.layout)
    }

    /// Admit the valid requests into `live` (the caller holds its lock for the whole batch, so
    /// the batch's admission is atomic with respect to releases, drains and other batches):
    /// an id still live, a block still owned, backpressure or a pause are refused. With no
    /// BlockManager (`manager_alive` false) nothing could ever release or complete them: all
    /// are refused. Rejections are reported in batch order.
    pub fn admit(&self, live: &mut LiveSet, v: Validated, manager_alive: bool) -> Admitted {
        let Validated {
            valid,
            mut rejected,
        } = v;
        let mut reply = LoadKvReply::default();
        let mut admitted = RequestGroup::with_capacity(valid.len());
        for (i, meta) in valid {
            let verdict = if manager_alive {
                live.admit(&meta)
            } else {
                Err(BatchError::Unavailable {
                    req_id: meta.req_id.to_string(),
                })
            };
            match verdict {
                Ok(()) => {}
                #[cfg(any(test, feature = "testing"))]
                Err(BatchError::AlreadyLive { .. }) if self.admit_live_ids => {}
                Err(e) => {
                    rejected.push((i, e));
                    continue;
                }
            }
            reply.accepted += 1;
            reply.awaiting += usize::from(meta.is_awaiting());
            admitted.push(meta);
        }
        rejected.sort_by_key(|(i, _)| *i);
        reply.rejected = rejected.into_iter().map(|(_, e)| e).collect();
        Admitted {
            reply,
            groups: batch_plan::group_by_engine(admitted),
        }
    }

    /// Before an engine's lookup: fail at once (a peer known down, the bootstrap in backoff),
    /// or look it up (afresh when a peer of it failed).
    pub fn plan(
        &self,
        rd: &mut Rediscovery,
        key: EngineKey,
        group: RequestGroup,
        now: Instant,
    ) -> Effect {
        let refresh = match rd.plan(&key, now) {
            Plan::Fail(why) => {
                return Effect::Fail {
                    group,
                    why: FailWhy::Unreachable(why),
                }
            }
            Plan::Refresh => true,
            Plan::Lookup => false,
        };
        Effect::Lookup {
            key,
            group,
            refresh,
        }
    }

    /// The source's cached topology of `key` answered at once: this worker's peers in it are
    /// derived again only when it is another topology than last time (by identity).
    pub fn on_cached(
        &mut self,
        rd: &mut Rediscovery,
        key: EngineKey,
        group: RequestGroup,
        topo: Arc<EngineTopology>,
        now: Instant,
    ) -> Option<Effect> {
        let peers = match self.derived.get(&key) {
            Some((known, peers)) if Arc::ptr_eq(known, &topo) => Ok(peers.clone()),
            _ => topo.peers_for(self.d_rank).map(|p| {
                let peers: Arc<[PeerId]> = p.into();
                self.derived.insert(key.clone(), (topo, peers.clone()));
                peers
            }),
        };
        self.on_peers(rd, key, group, peers, now)
    }

    /// A lookup of `key` answered (at once: the group was never parked).
    pub fn on_lookup(
        &mut self,
        rd: &mut Rediscovery,
        key: EngineKey,
        group: RequestGroup,
        topo: Result<EngineTopology, TopologyError>,
        now: Instant,
    ) -> Option<Effect> {
        let peers = topo.and_then(|t| t.peers_for(self.d_rank)).map(Arc::from);
        self.on_peers(rd, key, group, peers, now)
    }

    /// The lookup does not answer at once: until it does, an abort finds the group's awaited
    /// requests here ([`ReceiverState::abort`]).
    pub fn park(&mut self, group: &RequestGroup) {
        for r in group.iter().filter(|r| r.is_awaiting()) {
            self.undispatched.insert(r.req_id.clone(), r.clone());
        }
    }

    /// The lookup of a parked group answered: [`ReceiverState::on_lookup`] for what is left of
    /// the group (the requests the host aborted meanwhile were failed then, and are dropped).
    pub fn resume(
        &mut self,
        rd: &mut Rediscovery,
        key: EngineKey,
        group: RequestGroup,
        topo: Result<EngineTopology, TopologyError>,
        now: Instant,
    ) -> Option<Effect> {
        for r in &group {
            // Unless the id is now another request's (loaded again after this one was
            // aborted and drained).
            if self
                .undispatched
                .get(&r.req_id)
                .is_some_and(|u| Arc::ptr_eq(u, r))
            {
                self.undispatched.remove(&r.req_id);
            }
        }
        self.on_lookup(rd, key, group, topo, now)
    }

    /// The host aborts `req_id`: a request parked for its lookup fails now and is never sent
    /// (`Some`, to carry out at once); otherwise (`None`) it is in flight, or unknown, and the
    /// Peers must settle what they still owe for it.
    pub fn abort(&mut self, req_id: &ReqId) -> Option<Effect> {
        let r = self.undispatched.remove(req_id)?;
        self.aborted.push(r.clone());
        Some(Effect::Fail {
            group: smallvec::smallvec![r],
            why: FailWhy::AbortedBeforeDispatch,
        })
    }

    /// Forget the engines no batch named for `idle` (their records and derived peers); returns
    /// them, for the caller to drop the source's cached topologies.
    pub fn forget_idle(
        &mut self,
        rd: &mut Rediscovery,
        now: Instant,
        idle: std::time::Duration,
    ) -> Vec<EngineKey> {
        let gone = rd.forget_idle(now, idle);
        for key in &gone {
            self.derived.remove(key);
        }
        gone
    }

    /// Nothing parked, nothing aborted waiting for its lookup (model checking: a terminal
    /// state must hold nothing).
    #[cfg(any(test, feature = "testing"))]
    pub fn is_idle(&self) -> bool {
        self.undispatched.is_empty() && self.aborted.is_empty()
    }

    /// Hash what decides the state's future (model checking), in a canonical order: the parked
    /// and the aborted requests by id and transfer (each load's transfer id is its own).
    #[cfg(any(test, feature = "testing"))]
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        let mut parked: Vec<(&str, &str)> = self
            .undispatched
            .values()
            .map(|r| (&*r.req_id, r.transfer_id()))
            .collect();
        parked.sort_unstable();
        parked.hash(h);
        let mut aborted: Vec<(&str, &str)> = self
            .aborted
            .iter()
            .map(|r| (&*r.req_id, r.transfer_id()))
            .collect();
        aborted.sort_unstable();
        aborted.hash(h);
        let mut engines: Vec<&EngineKey> = self.derived.keys().collect();
        engines.sort_unstable();
        engines.hash(h);
    }

    /// The engine's peers are known (or the lookup failed): send, or fail at once.
    fn on_peers(
        &mut self,
        rd: &mut Rediscovery,
        key: EngineKey,
        mut group: RequestGroup,
        peers: Result<Arc<[PeerId]>, TopologyError>,
        now: Instant,
    ) -> Option<Effect> {
        if !self.aborted.is_empty() {
            // Aborted during the lookup: failed then, never sent.
            let aborted = &mut self.aborted;
            group.retain(|r| match aborted.iter().position(|a| Arc::ptr_eq(a, r)) {
                Some(i) => {
                    aborted.swap_remove(i);
                    false
                }
                None => true,
            });
            if group.is_empty() {
                return None;
            }
        }
        let peers = match peers {
            Ok(p) => p,
            Err(error) => {
                rd.lookup_failed(&key, error.to_string(), now);
                let why = FailWhy::Topology { key, error };
                return Some(Effect::Fail { group, why });
            }
        };
        if let Some(why) = rd.lookup_ok(&key, &peers, now) {
            let why = FailWhy::Unreachable(why);
            return Some(Effect::Fail { group, why });
        }
        Some(Effect::Send(Dispatch { peers, group }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::actors::rediscovery::RediscoveryConfig;
    use crate::actors::StaticTopology;

    fn state() -> ReceiverState {
        let d = DRank {
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
        };
        ReceiverState::new(KvLayout::uniform(1, 64, 8), d)
    }

    fn rd() -> Rediscovery {
        Rediscovery::new(RediscoveryConfig {
            base: Duration::from_secs(1),
            max: Duration::from_secs(8),
        })
    }

    fn kv(id: &str, blocks: &[u32]) -> KvRequest {
        KvRequest {
            req_id: id.into(),
            transfer_id: Some(format!("t-{id}")),
            remote_engine_id: Some("e0".into()),
            remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
            block_ids: vec![blocks.to_vec()],
        }
    }

    /// Validate and admit one batch.
    fn load(s: &mut ReceiverState, live: &mut LiveSet, batch: Vec<KvRequest>) -> Admitted {
        let v = s.validate(batch);
        s.admit(live, v, true)
    }

    /// The one group of a batch from one engine.
    fn only_group(a: Admitted) -> (EngineKey, RequestGroup) {
        let mut groups = a.groups.into_iter();
        let g = groups.next().expect("a group");
        assert!(groups.next().is_none(), "one engine");
        g
    }

    /// Exactly once at the host boundary: an id is refused while it is live (in flight, or
    /// completed and not drained), even once its blocks are back, and admitted again once the
    /// drain handed it over.
    #[test]
    fn a_live_id_is_refused_until_the_drain_hands_it_over() {
        let (mut s, mut live) = (state(), LiveSet::new(8));
        let first = load(&mut s, &mut live, vec![kv("a", &[1])]);
        assert_eq!((first.reply.accepted, first.reply.awaiting), (1, 1));
        let (_, group) = only_group(first);
        live.release_blocks(&group[0]);
        let again = load(&mut s, &mut live, vec![kv("a", &[2])]);
        assert_eq!(again.reply.accepted, 0);
        assert!(matches!(
            &again.reply.rejected[..],
            [BatchError::AlreadyLive { req_id }] if req_id == "a"
        ));
        assert!(again.groups.is_empty(), "nothing of it goes out");
        live.hand_over(&["a".into()]);
        let reload = load(&mut s, &mut live, vec![kv("a", &[2])]);
        assert_eq!(reload.reply.accepted, 1);
    }

    /// The mutation the model check must catch does what it says: it admits a live id.
    #[test]
    fn the_mutation_admits_a_live_id() {
        let (mut s, mut live) = (state().admitting_live_ids(), LiveSet::new(8));
        load(&mut s, &mut live, vec![kv("a", &[1])]);
        let again = load(&mut s, &mut live, vec![kv("a", &[2])]);
        assert_eq!(again.reply.accepted, 1);
    }

    /// Rejections come back in batch order, whichever step refused them; the admitted
    /// requests are grouped per engine in arrival order. Without a BlockManager nothing is
    /// admitted.
    #[test]
    fn rejections_in_batch_order_and_no_admission_without_a_manager() {
        let (mut s, mut live) = (state(), LiveSet::new(8));
        load(&mut s, &mut live, vec![kv("a", &[1])]);
        let batch = vec![kv("b", &[9]), kv("a", &[2]), kv("c", &[3]), kv("d", &[3])];
        let a = load(&mut s, &mut live, batch);
        let kinds: Vec<&str> = a.reply.rejected.iter().map(|e| e.kind()).collect();
        assert_eq!(kinds.len(), 3, "{:?}", a.reply.rejected);
        assert!(matches!(
            &a.reply.rejected[1],
            BatchError::AlreadyLive { .. }
        ));
        assert!(matches!(
            &a.reply.rejected[2],
            BatchError::BlockInUse { .. }
        ));
        let (_, group) = only_group(a);
        assert_eq!(&*group[0].req_id, "c");
        let v = s.validate(vec![kv("e", &[5])]);
        let none = s.admit(&mut live, v, false);
        assert!(matches!(
            &none.reply.rejected[..],
            [BatchError::Unavailable { .. }]
        ));
        assert!(!live.is_live(&"e".into()), "not admitted");
    }

    /// Aborted while its lookup is out: failed at once, and skipped when the lookup answers,
    /// by identity: the same id loaded again after a drain, before that lookup answered, goes
    /// out.
    #[test]
    fn an_abort_before_dispatch_fails_at_once_and_a_reload_still_goes_out() {
        let (mut s, mut live, mut rd) = (state(), LiveSet::new(8), rd());
        let now = Instant::now();
        let (key, first) = only_group(load(&mut s, &mut live, vec![kv("a", &[1])]));
        let Effect::Lookup { group, .. } = s.plan(&mut rd, key.clone(), first, now) else {
            panic!("a lookup");
        };
        s.park(&group);
        let Some(Effect::Fail { group: failed, why }) = s.abort(&"a".into()) else {
            panic!("failed before dispatch");
        };
        assert_eq!(why, FailWhy::AbortedBeforeDispatch);
        assert!(Arc::ptr_eq(&failed[0], &group[0]));
        assert!(s.abort(&"a".into()).is_none(), "failed once");
        // Completed (failed), released, drained: the id may be loaded again.
        live.release_blocks(&group[0]);
        live.hand_over(&["a".into()]);
        let (_, reload) = only_group(load(&mut s, &mut live, vec![kv("a", &[2])]));
        s.park(&reload);
        let topo = || Ok(StaticTopology::grid("e0", 1, 1));
        assert!(
            s.resume(&mut rd, key.clone(), group, topo(), now).is_none(),
            "the aborted request is never sent"
        );
        let Some(Effect::Send(d)) = s.resume(&mut rd, key, reload.clone(), topo(), now) else {
            panic!("the reload goes out");
        };
        assert!(Arc::ptr_eq(&d.group[0], &reload[0]));
        assert!(s.is_idle());
        assert!(
            s.abort(&"a".into()).is_none(),
            "in flight: the peers settle it"
        );
    }

    /// A failed lookup fails the batch and starts the engine's backoff: the next batch fails
    /// at once without asking. A down peer makes the next batch look up afresh.
    #[test]
    fn rediscovery_decides_fail_backoff_and_refresh() {
        let (mut s, mut live, mut rd) = (state(), LiveSet::new(8), rd());
        let now = Instant::now();
        let (key, g) = only_group(load(&mut s, &mut live, vec![kv("a", &[1])]));
        let err = Err(TopologyError::Bootstrap {
            bootstrap: "http://127.0.0.1:1".into(),
            reason: "down".into(),
        });
        let Some(Effect::Fail { why, .. }) = s.on_lookup(&mut rd, key.clone(), g, err, now) else {
            panic!("failed");
        };
        assert!(matches!(why, FailWhy::Topology { key: k, .. } if k == key));
        let (_, g) = only_group(load(&mut s, &mut live, vec![kv("b", &[2])]));
        assert!(matches!(
            s.plan(&mut rd, key.clone(), g, now),
            Effect::Fail {
                why: FailWhy::Unreachable(Unreachable::LookupBackoff { .. }),
                ..
            }
        ));
        let later = now + Duration::from_secs(2);
        let (_, g) = only_group(load(&mut s, &mut live, vec![kv("c", &[3])]));
        let topo = Arc::new(StaticTopology::grid("e0", 1, 1));
        let Some(Effect::Send(d)) = s.on_cached(&mut rd, key.clone(), g, topo.clone(), later)
        else {
            panic!("sent");
        };
        rd.peer_down(&d.peers[0], later + Duration::from_secs(5), "gone".into());
        let (_, g) = only_group(load(&mut s, &mut live, vec![kv("d", &[4])]));
        assert!(matches!(
            s.plan(&mut rd, key.clone(), g, later),
            Effect::Lookup { refresh: true, .. }
        ));
        let (_, g) = only_group(load(&mut s, &mut live, vec![kv("e", &[5])]));
        assert!(matches!(
            s.on_cached(&mut rd, key, g, topo, later),
            Some(Effect::Fail {
                why: FailWhy::Unreachable(Unreachable::PeerDown { .. }),
                ..
            })
        ));
    }

    /// Peers are derived once per cached topology (by identity) and again when the source
    /// holds another one.
    #[test]
    fn peers_follow_the_topology_the_source_holds() {
        let (mut s, mut live, mut rd) = (state(), LiveSet::new(8), rd());
        let now = Instant::now();
        let mut send = |s: &mut ReceiverState, id: &str, block: u32, t: &Arc<EngineTopology>| {
            let (key, g) = only_group(load(s, &mut live, vec![kv(id, &[block])]));
            match s.on_cached(&mut rd, key, g, t.clone(), now) {
                Some(Effect::Send(d)) => d.peers,
                other => panic!("{other:?}"),
            }
        };
        let first = Arc::new(StaticTopology::grid("e0", 1, 1));
        let p1 = send(&mut s, "a", 1, &first);
        let p2 = send(&mut s, "b", 2, &first);
        assert!(Arc::ptr_eq(&p1, &p2), "derived once");
        let moved = Arc::new(EngineTopology {
            workers: vec![vec![PeerId::new("tcp://moved-0-0")]],
            ..StaticTopology::grid("e0", 1, 1)
        });
        assert_eq!(
            send(&mut s, "c", 3, &moved)[0].to_string(),
            "tcp://moved-0-0"
        );
    }
}
