//! Property test of the settle rules over random topologies, batches and interleavings
//! (DESIGN.md §9). It drives the same plain structs the actors own (PeerState ->
//! AggregatorState -> BlockLedger), one event at a time, and checks the invariants after every
//! step, so a failing case shrinks to a short, readable sequence.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use kvrecv::actors::aggregator_state::AggregatorState;
use kvrecv::actors::block_ledger::{peers_to_fence, BlockLedger, Disposition};
use kvrecv::actors::block_pool::BlockPool;
use kvrecv::actors::peer_state::{Effects, PeerState};
use kvrecv::config::Policy;
use kvrecv::messages::{
    MooncakeXferResponse, PeerId, Pull, PullRequest, ReqId, RequestMeta, XferStatus,
};
use kvrecv::rdma::Revocation;

#[derive(Debug, Clone)]
enum Ev {
    /// CONTINUE or FINISH from a peer with ok/err subsets (indexes into the batch, may repeat).
    Reply {
        peer: usize,
        finish: bool,
        ok: Vec<usize>,
        err: Vec<usize>,
    },
    Error {
        peer: usize,
        err: Vec<usize>,
    },
    Deadline {
        peer: usize,
    },
    Restart {
        peer: usize,
    },
    Garbage {
        peer: usize,
    },
    Unknown {
        peer: usize,
    },
    /// The data plane confirms one pending fence.
    Fence {
        pick: usize,
    },
    /// Time passes beyond the quarantine deadline.
    QuarantineDeadline,
    Drain,
}

fn ev(n_peers: usize, n_reqs: usize) -> impl Strategy<Value = Ev> {
    let p = 0..n_peers;
    let ids = prop::collection::vec(0..n_reqs + 1, 0..4); // n_reqs = an id never sent
    prop_oneof![
        4 => (p.clone(), any::<bool>(), ids.clone(), ids.clone())
            .prop_map(|(peer, finish, ok, err)| Ev::Reply { peer, finish, ok, err }),
        1 => (p.clone(), ids).prop_map(|(peer, err)| Ev::Error { peer, err }),
        1 => p.clone().prop_map(|peer| Ev::Deadline { peer }),
        1 => p.clone().prop_map(|peer| Ev::Restart { peer }),
        1 => p.clone().prop_map(|peer| Ev::Garbage { peer }),
        1 => p.prop_map(|peer| Ev::Unknown { peer }),
        1 => (0..8usize).prop_map(|pick| Ev::Fence { pick }),
        1 => Just(Ev::QuarantineDeadline),
        1 => Just(Ev::Drain),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    n_peers: usize,
    blocks: Vec<usize>, // per request: number of blocks (0 = not awaited)
    exact: bool,
    policy: Policy,
    events: Vec<Ev>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1..5usize,
        prop::collection::vec(0..3usize, 1..6),
        any::<bool>(),
        prop_oneof![4 => Just(Policy::Settle), 1 => Just(Policy::Naive)],
    )
        .prop_flat_map(|(n_peers, blocks, exact, policy)| {
            let n = blocks.len();
            prop::collection::vec(ev(n_peers, n), 0..40).prop_map(move |events| Case {
                n_peers,
                blocks: blocks.clone(),
                exact,
                policy,
                events,
            })
        })
}

struct World {
    policy: Policy,
    exact: bool,
    peers: Vec<PeerState>,
    pull_of: Vec<u64>,
    reqs: Vec<Arc<RequestMeta>>,
    aggs: HashMap<ReqId, AggregatorState>,
    ledger: BlockLedger,
    now: Instant,
    // observations
    settled: BTreeMap<(usize, ReqId), usize>,
    first_failures: BTreeMap<ReqId, usize>,
    completions: BTreeMap<ReqId, usize>,
    uncertain_at_completion: BTreeMap<ReqId, Vec<PeerId>>,
    fenced: BTreeSet<ReqId>,
    deadline_passed: bool,
    drained_finished: Vec<ReqId>,
    drained_failed_reqs: BTreeSet<ReqId>,
    drained_invalid_blocks: BTreeSet<u32>,
}

fn resp(finish: bool, ok: Vec<String>, err: Vec<String>) -> Vec<Vec<u8>> {
    let mut r = MooncakeXferResponse::new(if finish {
        XferStatus::Finish
    } else {
        XferStatus::Continue
    });
    r.ok_reqs = (!ok.is_empty()).then_some(ok);
    r.err_reqs = (!err.is_empty()).then_some(err);
    vec![r.encode().unwrap()]
}

impl World {
    fn new(c: &Case) -> World {
        let mut pool = BlockPool::new(64);
        let reqs: Vec<Arc<RequestMeta>> = c
            .blocks
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let id: ReqId = format!("r{i}").into();
                let blocks = if n == 0 {
                    vec![]
                } else {
                    pool.allocate(&id, 1, n).unwrap()
                };
                Arc::new(RequestMeta {
                    req_id: id,
                    transfer_id: format!("t{i}").into(),
                    engine_id: "e".into(),
                    bootstrap_addr: "b".into(),
                    block_ids: vec![blocks],
                })
            })
            .collect();
        let peer_ids: Vec<PeerId> = (0..c.n_peers)
            .map(|i| PeerId::new(format!("tcp://p{i}")))
            .collect();
        let mut peers = Vec::new();
        let mut pull_of = Vec::new();
        for (i, pid) in peer_ids.iter().enumerate() {
            let mut st = PeerState::new(pid.clone());
            let pull = Pull {
                pull_id: i as u64 + 1,
                payload: vec![],
                handed_at: tokio::time::Instant::now(),
                layout: Default::default(),
                with_layout: None,
                requests: reqs
                    .iter()
                    .map(|m| PullRequest {
                        meta: m.clone(),
                        awaited: true,
                    })
                    .collect(),
            };
            pull_of.push(pull.pull_id);
            st.start(pull.pull_id, pull.requests);
            peers.push(st);
        }
        let aggs = reqs
            .iter()
            .filter(|r| r.is_awaiting())
            .map(|r| {
                (
                    r.req_id.clone(),
                    AggregatorState::new(r.clone(), peer_ids.clone(), c.policy),
                )
            })
            .collect();
        World {
            policy: c.policy,
            exact: c.exact,
            peers,
            pull_of,
            reqs,
            aggs,
            ledger: BlockLedger::new(Duration::from_secs(60), Some(pool)),
            now: Instant::now(),
            settled: BTreeMap::new(),
            first_failures: BTreeMap::new(),
            completions: BTreeMap::new(),
            uncertain_at_completion: BTreeMap::new(),
            fenced: BTreeSet::new(),
            deadline_passed: false,
            drained_finished: vec![],
            drained_failed_reqs: BTreeSet::new(),
            drained_invalid_blocks: BTreeSet::new(),
        }
    }

    fn id(&self, i: usize) -> String {
        format!("r{i}") // i == n is an id that was never sent
    }

    fn route(&mut self, peer: usize, fx: Effects) {
        for s in fx.settles {
            *self.settled.entry((peer, s.req_id.clone())).or_default() += 1;
            assert_eq!(
                self.settled[&(peer, s.req_id.clone())],
                1,
                "a peer settled {} twice",
                s.req_id
            );
            let Some(agg) = self.aggs.get_mut(&s.req_id) else {
                continue;
            };
            let afx = agg.on_settle(&s);
            if let Some(ff) = afx.first_failure {
                assert!(
                    !self.completions.contains_key(&ff.req.req_id),
                    "first failure after completion"
                );
                *self
                    .first_failures
                    .entry(ff.req.req_id.clone())
                    .or_default() += 1;
                self.ledger.on_first_failure(&ff);
            }
            if let Some(c) = afx.completion {
                let id = c.req.req_id.clone();
                if self.policy == Policy::Settle {
                    for p in 0..self.peers.len() {
                        assert!(
                            self.settled.contains_key(&(p, id.clone())),
                            "{id} completed before peer {p} settled"
                        );
                    }
                }
                *self.completions.entry(id.clone()).or_default() += 1;
                let rev = if self.exact {
                    Revocation::Exact
                } else {
                    Revocation::NotExact
                };
                let fence = if self.policy == Policy::Settle {
                    peers_to_fence(&c, rev)
                } else {
                    vec![]
                };
                self.uncertain_at_completion.insert(id, fence.clone());
                match self.ledger.on_completion(&c, fence.clone(), self.now) {
                    Disposition::Released => assert!(fence.is_empty()),
                    Disposition::Quarantined { peers, .. } => assert_eq!(peers, fence),
                }
            }
        }
    }

    fn drain(&mut self) {
        let out = self.ledger.drain();
        self.drained_failed_reqs
            .extend(out.failed_recving.iter().cloned());
        self.drained_invalid_blocks
            .extend(out.invalid_block_ids.iter().copied());
        for id in out.finished_recving {
            // A failure signal is never drained after its completion.
            let req = self.reqs.iter().find(|r| r.req_id == id).unwrap();
            if self.first_failures.contains_key(&id) {
                assert!(
                    req.all_blocks()
                        .all(|b| self.drained_invalid_blocks.contains(&b)),
                    "{id}: completion before its failure signal"
                );
            }
            // Never out of quarantine before its fence or deadline.
            if !self.uncertain_at_completion[&id].is_empty() {
                assert!(
                    self.fenced.contains(&id) || self.deadline_passed,
                    "{id} released before fence"
                );
            }
            self.drained_finished.push(id);
        }
    }

    fn step(&mut self, e: &Ev) {
        match e.clone() {
            Ev::Reply {
                peer,
                finish,
                ok,
                err,
            } => {
                let ok = ok.into_iter().map(|i| self.id(i)).collect();
                let err = err.into_iter().map(|i| self.id(i)).collect();
                let fx = self.peers[peer].on_reply(self.pull_of[peer], resp(finish, ok, err));
                self.route(peer, fx);
            }
            Ev::Error { peer, err } => {
                let mut r = MooncakeXferResponse::new(XferStatus::Error);
                let err: Vec<String> = err.into_iter().map(|i| self.id(i)).collect();
                r.err_reqs = (!err.is_empty()).then_some(err);
                let fx = self.peers[peer].on_reply(self.pull_of[peer], vec![r.encode().unwrap()]);
                self.route(peer, fx);
            }
            Ev::Deadline { peer } => {
                let fx = self.peers[peer].abandon(
                    self.pull_of[peer],
                    kvrecv::messages::Cause::Timeout,
                    "deadline".into(),
                );
                self.route(peer, fx);
            }
            Ev::Restart { peer } => {
                let (fx, _) = self.peers[peer].abandon_all("restart");
                self.route(peer, fx);
            }
            Ev::Garbage { peer } => {
                let fx = self.peers[peer].on_reply(self.pull_of[peer], vec![vec![0xc1, 0x00]]);
                self.route(peer, fx);
            }
            Ev::Unknown { peer } => {
                let n = self.reqs.len();
                let frames = resp(false, vec![self.id(n)], vec![]);
                let live = self.peers[peer].is_in_flight(self.pull_of[peer]);
                let fx = self.peers[peer].on_reply(self.pull_of[peer], frames);
                assert!(fx.settles.is_empty() && fx.stale.count == usize::from(live));
                self.route(peer, fx);
            }
            Ev::Fence { pick } => {
                let held: Vec<ReqId> = self
                    .reqs
                    .iter()
                    .map(|r| r.req_id.clone())
                    .filter(|id| self.ledger.is_quarantined(id))
                    .collect();
                if !held.is_empty() {
                    let id = held[pick % held.len()].clone();
                    self.fenced.insert(id.clone());
                    assert!(self.ledger.end_quarantine(&id, self.now).is_some());
                }
            }
            Ev::QuarantineDeadline => {
                self.now += Duration::from_secs(61);
                self.deadline_passed = true;
                for id in self.ledger.expired(self.now) {
                    self.ledger.end_quarantine(&id, self.now);
                }
            }
            Ev::Drain => self.drain(),
        }
    }

    /// Every peer eventually ends its pull (FINISH with nothing more to say).
    fn finish_all(&mut self) {
        for p in 0..self.peers.len() {
            let fx = self.peers[p].on_reply(self.pull_of[p], resp(true, vec![], vec![]));
            self.route(p, fx);
            assert_eq!(self.peers[p].pending_count(), 0);
        }
        self.drain();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn settle_invariants_hold_under_any_interleaving(c in case()) {
        let mut w = World::new(&c);
        for e in &c.events {
            w.step(e);
        }
        w.finish_all();
        for r in &w.reqs {
            let id = &r.req_id;
            if r.is_awaiting() {
                prop_assert_eq!(w.completions.get(id).copied(), Some(1), "exactly one completion for {}", id);
                prop_assert!(w.first_failures.get(id).copied().unwrap_or(0) <= 1);
                let released = w.drained_finished.iter().filter(|x| *x == id).count();
                let held = w.ledger.is_quarantined(id);
                // Either handed back to the host once, or still held with the peers it waits for.
                prop_assert!(released == 1 && !held || released == 0 && held && !w.ledger.held_peers(id).unwrap().is_empty(),
                    "{} released {} times, held {}", id, released, held);
                // Failed requests were signalled (single group: block-level).
                if w.first_failures.contains_key(id) {
                    prop_assert!(r.all_blocks().all(|b| w.drained_invalid_blocks.contains(&b)));
                }
                if held {
                    prop_assert!(!w.exact && c.policy == Policy::Settle);
                }
            } else {
                prop_assert!(!w.completions.contains_key(id) && !w.first_failures.contains_key(id));
            }
        }
        // Every (peer, request) settled exactly once.
        prop_assert_eq!(w.settled.len(), c.n_peers * w.reqs.len());
        prop_assert!(w.drained_failed_reqs.is_empty(), "single-group cache: no request-level failures");
    }
}
