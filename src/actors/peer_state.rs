//! The Peer's bookkeeping, without sockets or timers: which requests each in-flight pull still
//! owes, and how a reply, an error or a deadline settles them (DESIGN.md §4 rules 1-4).

use std::collections::{HashMap, HashSet};

use crate::messages::{
    MooncakeXferResponse, PeerId, Pull, PullId, PullRequest, ReqId, Settle, SettleOutcome,
    UnsentPull, XferStatus,
};

use super::transport::Frames;

/// What the Peer must do after an event.
#[derive(Default)]
pub struct Effects {
    /// Settles to send, each to its request's aggregator (if awaited).
    pub settles: Vec<(Option<actix::Recipient<Settle>>, Settle)>,
    /// Ids a reply named that were not pending for that pull.
    pub stale: Vec<ReqId>,
    /// The pull is over: close its channel, drop its deadline.
    pub pull_done: bool,
    /// The reply could not be decoded (counted separately).
    pub malformed: Option<String>,
    /// The pull ended with FINISH (a healthy peer).
    pub finished_cleanly: bool,
}

/// Reason used for requests a FINISH did not mention (rule 3).
pub const OMITTED: &str = "peer finished without reporting the request";

struct InFlight {
    pending: HashMap<ReqId, PullRequest>,
}

/// Pending requests of every in-flight pull of one peer.
pub struct PeerState {
    peer: PeerId,
    pulls: HashMap<PullId, InFlight>,
}

impl PeerState {
    pub fn new(peer: PeerId) -> Self {
        PeerState {
            peer,
            pulls: HashMap::new(),
        }
    }

    pub fn peer(&self) -> &PeerId {
        &self.peer
    }

    /// Requests still owed, all pulls.
    pub fn pending_count(&self) -> usize {
        self.pulls.values().map(|p| p.pending.len()).sum()
    }

    pub fn in_flight(&self) -> usize {
        self.pulls.len()
    }

    pub fn is_in_flight(&self, pull_id: PullId) -> bool {
        self.pulls.contains_key(&pull_id)
    }

    /// Track a new pull. A request listed twice in one pull is tracked once.
    pub fn start(&mut self, pull: &Pull) {
        let pending = pull
            .requests
            .iter()
            .map(|r| (r.meta.req_id.clone(), r.clone()))
            .collect();
        self.pulls.insert(pull.pull_id, InFlight { pending });
    }

    /// A pull that was never sent: settle each of its requests Failed at once. It is never
    /// tracked, so nothing about it can be settled twice.
    pub fn unsent(&self, pull: &UnsentPull) -> Effects {
        let mut fx = Effects::default();
        let mut seen = HashSet::new();
        for r in pull.requests.iter().filter(|r| seen.insert(&r.meta.req_id)) {
            fx.settles.push((
                r.aggregator.clone(),
                Settle {
                    peer: self.peer.clone(),
                    pull_id: pull.pull_id,
                    req_id: r.meta.req_id.clone(),
                    outcome: SettleOutcome::Failed(pull.reason.clone()),
                },
            ));
        }
        fx
    }

    fn settle(&mut self, fx: &mut Effects, pull_id: PullId, req_id: &str, outcome: SettleOutcome) {
        let Some(pull) = self.pulls.get_mut(&pull_id) else {
            return;
        };
        match pull.pending.remove(req_id) {
            Some(req) => fx.settles.push((
                req.aggregator,
                Settle {
                    peer: self.peer.clone(),
                    pull_id,
                    req_id: req.meta.req_id.clone(),
                    outcome,
                },
            )),
            None => fx.stale.push(ReqId::from(req_id)),
        }
    }

    /// Settle whatever is still pending for the pull and forget it.
    fn settle_rest(&mut self, fx: &mut Effects, pull_id: PullId, outcome: SettleOutcome) {
        if let Some(pull) = self.pulls.remove(&pull_id) {
            let mut rest: Vec<_> = pull.pending.into_values().collect();
            rest.sort_by(|a, b| a.meta.req_id.cmp(&b.meta.req_id));
            for req in rest {
                fx.settles.push((
                    req.aggregator,
                    Settle {
                        peer: self.peer.clone(),
                        pull_id,
                        req_id: req.meta.req_id.clone(),
                        outcome: outcome.clone(),
                    },
                ));
            }
        }
        fx.pull_done = true;
    }

    /// One reply off the pull's channel.
    pub fn on_reply(&mut self, pull_id: PullId, frames: Frames) -> Effects {
        let mut fx = Effects::default();
        if !self.pulls.contains_key(&pull_id) {
            return fx; // the pull is over; its channel is being closed
        }
        let decoded = match frames.as_slice() {
            [one] => MooncakeXferResponse::decode(one).map_err(|e| e.to_string()),
            _ => Err(format!("{}-frame reply", frames.len())),
        };
        let resp = match decoded {
            Ok(r) => r,
            Err(e) => {
                let reason = format!("malformed reply: {e}");
                fx.malformed = Some(reason.clone());
                self.settle_rest(&mut fx, pull_id, SettleOutcome::Uncertain(reason));
                return fx;
            }
        };
        for id in resp.ok() {
            self.settle(&mut fx, pull_id, id, SettleOutcome::Ok);
        }
        let err_reason = resp
            .err_msg
            .clone()
            .unwrap_or_else(|| "peer reported failure".into());
        for id in resp.err() {
            self.settle(
                &mut fx,
                pull_id,
                id,
                SettleOutcome::Failed(err_reason.clone()),
            );
        }
        match resp.status {
            // More subsets follow; the channel stays open until FINISH, ERROR or the deadline.
            XferStatus::Continue => {}
            XferStatus::Finish => {
                fx.finished_cleanly = true;
                self.settle_rest(&mut fx, pull_id, SettleOutcome::Failed(OMITTED.into()));
            }
            XferStatus::Error => {
                let msg = resp.err_msg.as_deref().unwrap_or("no message");
                self.settle_rest(
                    &mut fx,
                    pull_id,
                    SettleOutcome::Uncertain(format!("peer ERROR: {msg}")),
                );
            }
        }
        fx
    }

    /// The pull ended without FINISH/ERROR: channel error, channel closed, deadline (rule 4).
    pub fn abandon(&mut self, pull_id: PullId, reason: String) -> Effects {
        let mut fx = Effects::default();
        if self.pulls.contains_key(&pull_id) {
            self.settle_rest(&mut fx, pull_id, SettleOutcome::Uncertain(reason));
        }
        fx
    }

    /// Restart: settle everything of every pull Uncertain; returns the pulls that were dropped.
    pub fn abandon_all(&mut self, reason: &str) -> (Effects, Vec<PullId>) {
        let mut fx = Effects::default();
        let mut ids: Vec<PullId> = self.pulls.keys().copied().collect();
        ids.sort_unstable();
        for id in &ids {
            self.settle_rest(&mut fx, *id, SettleOutcome::Uncertain(reason.to_owned()));
        }
        (fx, ids)
    }
}
