//! The model's glue for the Receiver's core: what the host does at `load_kv` and what the
//! Receiver actor does with `ReceiverState`'s effects (fail unsent, open the windows and hand
//! the pulls, park a lookup), fed into the other cores as the actors feed them.

use kvrecv::actors::aggregator_state::AggregatorState;
use kvrecv::actors::block_pool::owner_tag;
use kvrecv::actors::receiver_state::{Dispatch, Effect};
use kvrecv::actors::rediscovery::{Rediscovery, RediscoveryConfig};
use kvrecv::config::{DRank, Policy};
use kvrecv::messages::{KvRequest, PullRequest, ReqId, SharedRequest};
use kvrecv::rdma::PullWindow;

use super::{peer_id, transfer, Attempt, Kv, State, Write, HOLD};

/// The D worker: TP 1, so it pulls from every P TP rank.
pub(super) const D_RANK: DRank = DRank {
    tp_size: 1,
    tp_rank: 0,
    pp_size: 1,
    pp_rank: 0,
};

/// Peer health and lookup backoff as a Receiver starts with them: no peer is ever reported
/// down to it in this model (the Peers' health reports are not modelled), so its decisions are
/// always "look up" and "send".
pub(super) fn rediscovery() -> Rediscovery {
    Rediscovery::new(RediscoveryConfig {
        base: HOLD,
        max: HOLD,
    })
}

impl Kv {
    /// The attempt a request of the Receiver's effects is (each load has its own transfer id).
    pub(super) fn attempt_of(s: &State, r: &SharedRequest) -> u8 {
        let i = (0..s.attempts.len())
            .find(|&i| transfer(s.attempts[i].id, i as u8) == *r.transfer_id())
            .expect("every request the Receiver names was loaded");
        i as u8
    }

    /// Carry out what the Receiver's core decided, as the Receiver actor does.
    pub(super) fn perform(&self, s: &mut State, fx: Option<Effect>) {
        match fx {
            None => {}
            // The aggregator's `FailUnsent`: no peer had the addresses, none settles.
            Some(Effect::Fail { group, why }) => {
                for r in group.into_iter().filter(|r| r.is_awaiting()) {
                    let attempt = Kv::attempt_of(s, &r);
                    let mut agg = AggregatorState::new(r, vec![], Policy::Settle);
                    let fx = agg.fail_now(why.cause(), why.reason());
                    self.publish(s, attempt, fx, 0);
                }
            }
            Some(Effect::Send(d)) => self.send(s, d),
            Some(Effect::Lookup { .. }) => unreachable!("looked up by the caller"),
        }
    }

    /// Send a dispatched batch: its aggregator, then one pull per peer on its own window.
    fn send(&self, s: &mut State, d: Dispatch) {
        let now = self.now(s);
        for meta in d.group {
            let attempt = Kv::attempt_of(s, &meta);
            let block = s.attempts[attempt as usize].block;
            s.aggs[attempt as usize] = Some(AggregatorState::new(
                meta.clone(),
                d.peers.to_vec(),
                self.cfg.policy,
            ));
            for pid in d.peers.iter() {
                let p = (0..self.cfg.peers).find(|&p| peer_id(p) == *pid).unwrap();
                let pull = s.next_pull;
                s.next_pull += 1;
                let window = s.permits.open_at(
                    &PullWindow {
                        pull_id: pull,
                        peer: pid,
                        requests: std::slice::from_ref(&meta),
                    },
                    now,
                );
                s.peers[p].start(
                    pull,
                    [PullRequest { meta: meta.clone() }].into_iter().collect(),
                );
                s.pulls.insert(pull, (attempt, p));
                s.writes.push(Write {
                    peer: p,
                    pull,
                    attempt,
                    window,
                    block,
                    abandoned_at: None,
                });
            }
        }
    }

    /// The host loads `id` (into a block it allocated); the Receiver's core validates and
    /// admits it, and its engine is looked up: cached, or `parked` until the lookup answers.
    pub(super) fn load(&self, s: &mut State, id: &'static str, parked: bool) -> Option<()> {
        let attempt = s.attempts.len() as u8;
        let rid = ReqId::from(id);
        let host_awaits = s.awaited.contains(&id);
        if host_awaits {
            s.dups += 1;
        }
        let pool = s.ledger.pool_mut().unwrap();
        let block = pool
            .allocate(&rid, owner_tag(&transfer(id, attempt)), 1)
            .ok()?[0];
        let validated = s.receiver.validate(vec![KvRequest {
            req_id: id.into(),
            transfer_id: Some(transfer(id, attempt)),
            remote_engine_id: Some("e".into()),
            remote_bootstrap_addr: Some("http://p:1".into()),
            block_ids: vec![vec![block]],
        }]);
        let admitted = {
            let live = s.ledger.live_set();
            let mut live = live.lock();
            s.receiver.admit(&mut live, validated, true)
        };
        if admitted.reply.accepted == 0 {
            // Refused: the host frees the block it allocated for it.
            s.ledger.pool_mut().unwrap().release(&rid);
            return Some(());
        }
        if host_awaits && s.host_violation.is_none() {
            s.host_violation = Some(format!("{id} accepted while the host still awaited it"));
        }
        s.awaited.push(id);
        s.awaited.sort_unstable();
        s.attempts.push(Attempt {
            id,
            block,
            completions: 0,
            first_failures: 0,
            failure_after_completion: false,
            completed_before_all_settled: false,
            drained: false,
        });
        s.settled.push(0);
        s.aggs.push(None);
        let now = self.now(s);
        let mut rd = rediscovery();
        for (key, group) in admitted.groups {
            let Effect::Lookup { key, group, .. } = s.receiver.plan(&mut rd, key, group, now)
            else {
                unreachable!("nothing is down in this model");
            };
            if parked {
                s.lookups += 1;
                s.receiver.park(&group);
                s.parked.push((key, group));
            } else {
                let topo = self.topology.clone();
                let fx = s.receiver.on_cached(&mut rd, key, group, topo, now);
                self.perform(s, fx);
            }
        }
        Some(())
    }
}
