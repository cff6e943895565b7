//! Property test of the settle rules over random topologies, batches and interleavings
//! (DESIGN.md §9). It drives the same plain structs the actors own (PeerState ->
//! AggregatorState -> BlockLedger), one event at a time, and checks the invariants after every
//! step, so a failing case shrinks to a short, readable sequence.
//!
//! What each peer said about each request, which peers may therefore still write, which
//! completions must be held and until when, is kept by an [`Oracle`] of the test's own, from
//! the events alone (DESIGN.md §4-§5 read plainly): the code under test is checked against it,
//! never against itself. Time moves in random steps, so quarantines start at different times
//! and each is checked against its own deadline.

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
    MooncakeXferResponse, PeerId, Pull, PullRequest, ReqId, RequestMeta, SettleOutcome, XferStatus,
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
    /// Time passes (`secs` seconds; a quarantine's deadline is 60 s after it started).
    Tick {
        secs: u64,
    },
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
        1 => (1..45u64).prop_map(|secs| Ev::Tick { secs }),
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

/// The quarantine's last-resort deadline in these cases.
const QUARANTINE: Duration = Duration::from_secs(60);

/// What a peer has said about a request (DESIGN.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    /// Nothing yet: the peer may be writing.
    Pending,
    /// Done (`ok_reqs`).
    Ok,
    /// An answer that it failed (`err_reqs`, or left out of a FINISH): it does not write.
    Failed,
    /// The pull ended without an answer (ERROR, malformed reply, deadline, restart): D does
    /// not know whether it still writes.
    Uncertain,
}

/// The test's own account, kept from the events alone: what each peer said about each request,
/// and which requests must be held (and since when).
struct Oracle {
    /// `[peer][request]`.
    said: Vec<Vec<Said>>,
    /// Whether the peer's pull is still open (an ended pull's replies change nothing).
    open: Vec<bool>,
    /// Requests whose blocks must not go back yet, with when their quarantine started.
    held: BTreeMap<ReqId, Instant>,
}

impl Oracle {
    fn new(n_peers: usize, n_reqs: usize) -> Self {
        Oracle {
            said: vec![vec![Said::Pending; n_reqs]; n_peers],
            open: vec![true; n_peers],
            held: BTreeMap::new(),
        }
    }

    /// A reply naming requests `ok` and `err` (index `n_reqs`: an id never sent).
    fn reply(&mut self, peer: usize, status: XferStatus, ok: &[usize], err: &[usize]) {
        if !self.open[peer] {
            return;
        }
        let n_reqs = self.said[peer].len();
        let named = ok.iter().chain(err);
        // Naming ids, none of them this pull's: not an answer to this pull at all.
        if ok.len() + err.len() > 0 && named.clone().all(|&i| i >= n_reqs) {
            return;
        }
        // An id in both lists is a failure.
        for &i in err.iter().filter(|&&i| i < n_reqs) {
            if self.said[peer][i] == Said::Pending {
                self.said[peer][i] = Said::Failed;
            }
        }
        for &i in ok.iter().filter(|&&i| i < n_reqs) {
            if self.said[peer][i] == Said::Pending {
                self.said[peer][i] = Said::Ok;
            }
        }
        match status {
            XferStatus::Continue => {}
            XferStatus::Finish => self.end(peer, Said::Failed),
            _ => self.end(peer, Said::Uncertain),
        }
    }

    /// The peer's pull ends; what it had not answered becomes `rest`.
    fn end(&mut self, peer: usize, rest: Said) {
        if !std::mem::replace(&mut self.open[peer], false) {
            return;
        }
        for s in &mut self.said[peer] {
            if *s == Said::Pending {
                *s = rest;
            }
        }
    }

    /// Peers that may still write into request `r`'s blocks: not answered yet, or ended
    /// without an answer.
    fn may_write(&self, r: usize) -> Vec<usize> {
        (0..self.said.len())
            .filter(|&p| matches!(self.said[p][r], Said::Pending | Said::Uncertain))
            .collect()
    }
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
    oracle: Oracle,
    peer_ids: Vec<PeerId>,
    /// When each request that was ever quarantined went in.
    quarantined_at: BTreeMap<ReqId, Instant>,
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
                Arc::new(RequestMeta::new(id, &format!("t{i}"), "e", "b", &[blocks]))
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
                    .map(|m| PullRequest { meta: m.clone() })
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
            ledger: BlockLedger::new(QUARANTINE, Some(pool)),
            now: Instant::now(),
            settled: BTreeMap::new(),
            first_failures: BTreeMap::new(),
            completions: BTreeMap::new(),
            uncertain_at_completion: BTreeMap::new(),
            fenced: BTreeSet::new(),
            oracle: Oracle::new(c.n_peers, c.blocks.len()),
            peer_ids: peer_ids.clone(),
            quarantined_at: BTreeMap::new(),
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
            let r = self.index(&s.req_id);
            let said = self.oracle.said[peer][r];
            let agrees = match &s.outcome {
                SettleOutcome::Ok => said == Said::Ok,
                SettleOutcome::Failed { .. } => said == Said::Failed,
                SettleOutcome::Uncertain { .. } => said == Said::Uncertain,
            };
            assert!(
                agrees,
                "peer {peer} settled {} {:?}; it said {said:?}",
                s.req_id, s.outcome
            );
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
                // The BlockManager's glue, as it is: the peers it asks the ledger to wait for.
                let fence = if self.policy == Policy::Settle {
                    peers_to_fence(&c, rev)
                } else {
                    vec![]
                };
                // What must be waited for: every peer that may still write, unless the
                // revocation stopped them all (exact permits) or the policy does not wait.
                let r = self.index(&id);
                let may_write = self.oracle.may_write(r);
                if self.policy == Policy::Settle {
                    assert!(
                        may_write
                            .iter()
                            .all(|&p| self.oracle.said[p][r] == Said::Uncertain),
                        "{id} completed while a peer had not answered"
                    );
                }
                let expected: Vec<PeerId> = if self.policy == Policy::Settle && !self.exact {
                    may_write
                        .iter()
                        .map(|&p| self.peer_ids[p].clone())
                        .collect()
                } else {
                    vec![]
                };
                let mut got = fence.clone();
                got.sort();
                assert_eq!(got, expected, "{id}: peers to fence");
                self.uncertain_at_completion
                    .insert(id.clone(), fence.clone());
                match self.ledger.on_completion(&c, fence.clone(), self.now) {
                    Disposition::Released => assert!(expected.is_empty(), "{id} released"),
                    Disposition::Quarantined { peers, .. } => {
                        let mut peers = peers;
                        peers.sort();
                        assert_eq!(peers, expected, "{id} quarantined");
                        self.oracle.held.insert(id.clone(), self.now);
                        self.quarantined_at.insert(id, self.now);
                    }
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
            // Never out of quarantine before its fence or its own deadline.
            assert!(
                !self.oracle.held.contains_key(&id),
                "{id} drained while it must be held"
            );
            if let Some(&at) = self.quarantined_at.get(&id) {
                assert!(
                    self.fenced.contains(&id) || self.now >= at + QUARANTINE,
                    "{id} released before its fence or deadline"
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
                let status = if finish {
                    XferStatus::Finish
                } else {
                    XferStatus::Continue
                };
                self.oracle.reply(peer, status, &ok, &err);
                let ok = ok.into_iter().map(|i| self.id(i)).collect();
                let err = err.into_iter().map(|i| self.id(i)).collect();
                let fx = self.peers[peer].on_reply(self.pull_of[peer], resp(finish, ok, err));
                self.route(peer, fx);
            }
            Ev::Error { peer, err } => {
                self.oracle.reply(peer, XferStatus::Error, &[], &err);
                let mut r = MooncakeXferResponse::new(XferStatus::Error);
                let err: Vec<String> = err.into_iter().map(|i| self.id(i)).collect();
                r.err_reqs = (!err.is_empty()).then_some(err);
                let fx = self.peers[peer].on_reply(self.pull_of[peer], vec![r.encode().unwrap()]);
                self.route(peer, fx);
            }
            Ev::Deadline { peer } => {
                self.oracle.end(peer, Said::Uncertain);
                let fx = self.peers[peer].abandon(
                    self.pull_of[peer],
                    kvrecv::messages::Cause::Timeout,
                    "deadline".into(),
                );
                self.route(peer, fx);
            }
            Ev::Restart { peer } => {
                self.oracle.end(peer, Said::Uncertain);
                let (fx, _) = self.peers[peer].abandon_all("restart");
                self.route(peer, fx);
            }
            Ev::Garbage { peer } => {
                self.oracle.end(peer, Said::Uncertain);
                let fx = self.peers[peer].on_reply(self.pull_of[peer], vec![vec![0xc1, 0x00]]);
                self.route(peer, fx);
            }
            Ev::Unknown { peer } => {
                let n = self.reqs.len();
                self.oracle.reply(peer, XferStatus::Continue, &[n], &[]);
                let frames = resp(false, vec![self.id(n)], vec![]);
                let live = self.peers[peer].is_in_flight(self.pull_of[peer]);
                let fx = self.peers[peer].on_reply(self.pull_of[peer], frames);
                assert!(fx.settles.is_empty() && fx.stale.count == usize::from(live));
                self.route(peer, fx);
            }
            Ev::Fence { pick } => {
                let held: Vec<ReqId> = self.oracle.held.keys().cloned().collect();
                if !held.is_empty() {
                    let id = held[pick % held.len()].clone();
                    self.fenced.insert(id.clone());
                    self.oracle.held.remove(&id);
                    assert!(self.ledger.end_quarantine(&id, self.now).is_some());
                }
            }
            Ev::Tick { secs } => {
                self.now += Duration::from_secs(secs);
                let due: Vec<ReqId> = self
                    .oracle
                    .held
                    .iter()
                    .filter(|(_, &at)| self.now >= at + QUARANTINE)
                    .map(|(id, _)| id.clone())
                    .collect();
                assert_eq!(self.ledger.expired(self.now), due, "expired at a tick");
                for id in due {
                    self.oracle.held.remove(&id);
                    assert!(self.ledger.end_quarantine(&id, self.now).is_some());
                }
            }
            Ev::Drain => self.drain(),
        }
        // The ledger holds exactly what the oracle says must be held; every peer settled
        // exactly what it answered or left without an answer.
        for r in &self.reqs {
            assert_eq!(
                self.ledger.is_quarantined(&r.req_id),
                self.oracle.held.contains_key(&r.req_id),
                "{} held",
                r.req_id
            );
        }
        let answered = self
            .oracle
            .said
            .iter()
            .flatten()
            .filter(|s| **s != Said::Pending);
        assert_eq!(self.settled.len(), answered.count(), "settles");
    }

    fn index(&self, id: &ReqId) -> usize {
        self.reqs.iter().position(|r| &r.req_id == id).unwrap()
    }

    /// Every peer eventually ends its pull (FINISH with nothing more to say).
    fn finish_all(&mut self) {
        for p in 0..self.peers.len() {
            self.oracle.reply(p, XferStatus::Finish, &[], &[]);
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
