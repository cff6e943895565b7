//! The Peer's bookkeeping, without sockets or timers: which requests each in-flight pull still
//! owes, and how a reply, an error or a deadline settles them (DESIGN.md §4 rules 1-4).

#![forbid(unsafe_code)]

use crate::fast_hash::{FastMap, FastSet};

use crate::messages::peer_text::peer_text;
use crate::messages::{
    Cause, PeerId, PullId, PullLayout, PullRequests, ReqId, Settle, SettleList, SettleOutcome,
    UnsentPull, XferReplyRef, XferStatus,
};

use super::pending_set::PendingSet;
use super::transport::Frames;

/// What the Peer must do after an event.
#[derive(Default)]
pub struct Effects {
    /// Settles, in order (each one an event; the awaited ones go to the aggregator, this
    /// list itself when every one is: no second list per reply).
    pub settles: SettleList,
    /// Indices in `settles` of those no aggregator awaits (requests loaded without blocks).
    pub unawaited: Vec<usize>,
    /// Ids a reply named that were not pending for that pull: counted, a few kept as a sample.
    pub stale: StaleIds,
    /// The pull is over: close its channel, drop its deadline.
    pub pull_done: bool,
    /// The reply could not be decoded (counted separately).
    pub malformed: Option<String>,
    /// The pull ended with FINISH (a healthy peer).
    pub finished_cleanly: bool,
    /// A reply named only requests the pull never carried: a message of an earlier exchange
    /// that reached a reused channel (P answered a pull again after its FINISH). Ignored for
    /// this pull (its ids count as stale), and the channel is not reused.
    pub stray: bool,
    /// The peer echoed the pull's layout id in a CONTINUE or FINISH: it holds that layout.
    pub layout_echoed: Option<u64>,
    /// The peer answered `LAYOUT_MISS`: it holds none of D's layouts it was thought to.
    pub layout_miss: bool,
    /// Send the pull again, with its layout (it had omitted it and P answered `LAYOUT_MISS`):
    /// nothing was written, nothing settled; the pull stays in flight on the same window.
    pub resend_with_layout: bool,
}

/// Ids a reply named that were not pending (rule 1): one summary per reply, so a reply naming a
/// million unknown ids costs a counter, not a million events.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StaleIds {
    pub count: usize,
    /// The first [`STALE_SAMPLE`] of them, in reply order.
    pub sample: Vec<ReqId>,
}

/// How many stale ids a summary names.
pub const STALE_SAMPLE: usize = 8;

impl StaleIds {
    fn note(&mut self, id: &str) {
        self.count += 1;
        if self.sample.len() < STALE_SAMPLE {
            // P's text: an id D never sent may be megabytes long.
            self.sample.push(ReqId::from(&*peer_text(id)));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// How P words a transfer-engine failure in `err_reqs` (PROTOCOL.md §2.6).
pub const TE_FAILURE: &str = "Mooncake transfer engine returned";

/// Reason used for requests a FINISH did not mention (rule 3).
pub const OMITTED: &str = "peer finished without reporting the request";

/// Ids a reply may name beyond twice the pull's requests (each id at most once in each list)
/// before it is refused as malformed.
pub const REPLY_ID_SLACK: usize = 16;

/// The most ids one reply to a pull of `carried` requests may name, both lists together.
pub fn max_reply_ids(carried: usize) -> usize {
    carried.saturating_mul(2).saturating_add(REPLY_ID_SLACK)
}

#[derive(Clone)]
struct InFlight {
    pending: PendingSet,
    /// Requests the pull carried (the bound on what a reply may name).
    carried: usize,
    /// Pending requests the host aborted, with the abort's reason: they settle as aborted when
    /// P answers them or the pull ends (see [`PeerState::abort`]).
    aborted: Vec<(ReqId, String)>,
    /// The pull's layout id and whether its metadata carried the layout.
    layout: PullLayout,
}

impl InFlight {
    fn abort_reason(&self, req_id: &str) -> Option<&str> {
        self.aborted
            .iter()
            .find(|(id, _)| &**id == req_id)
            .map(|(_, why)| why.as_str())
    }

    /// How `req_id` settles: as aborted if the host aborted it, keeping what P's answer proves.
    /// P's ok (its writes for the request are done: the landed bytes are checked as for any ok)
    /// settles Failed `Aborted`; P's failure keeps its cause (a transfer-engine failure still
    /// makes the peer a suspect); no answer stays Uncertain. Only an Uncertain or
    /// transfer-engine settle poisons the pull's landing window (DESIGN.md §5).
    fn outcome_of(&self, req_id: &str, said: SettleOutcome) -> SettleOutcome {
        let Some(why) = self.abort_reason(req_id) else {
            return said;
        };
        match said {
            SettleOutcome::Ok => SettleOutcome::failed(Cause::Aborted, why),
            SettleOutcome::Failed { cause, reason } => {
                SettleOutcome::failed(cause, format!("{why} (P: {reason})"))
            }
            SettleOutcome::Uncertain { .. } => SettleOutcome::uncertain(Cause::Aborted, why),
        }
    }
}

impl Effects {
    /// Add `settle`, which an aggregator awaits or not.
    fn push(&mut self, awaited: bool, settle: Settle) {
        if !awaited {
            self.unawaited.push(self.settles.len());
        }
        self.settles.push(settle);
    }

    /// The settles an aggregator awaits (the others leave the list).
    pub fn awaited(&mut self) -> SettleList {
        let mut settles = std::mem::take(&mut self.settles);
        if !self.unawaited.is_empty() {
            let mut i = 0;
            settles.retain(|_| {
                i += 1;
                self.unawaited.binary_search(&(i - 1)).is_err()
            });
        }
        settles
    }
}

/// A reply's one frame decoded, refusing more ids than a pull carrying `carried` requests
/// may name ([`max_reply_ids`]), or why it is malformed.
fn decode_reply(frames: &Frames, carried: usize) -> Result<XferReplyRef<'_>, String> {
    match frames.as_slice() {
        [one] => {
            XferReplyRef::decode_bounded(one, max_reply_ids(carried)).map_err(|e| e.to_string())
        }
        _ => Err(format!("{}-frame reply", frames.len())),
    }
}

/// A settle to send.
fn settle_of(peer: &PeerId, pull_id: PullId, req_id: &ReqId, outcome: SettleOutcome) -> Settle {
    Settle {
        peer: peer.clone(),
        pull_id,
        req_id: req_id.clone(),
        outcome,
    }
}

/// Pending requests of every in-flight pull of one peer.
#[derive(Clone)]
pub struct PeerState {
    peer: PeerId,
    pulls: FastMap<PullId, InFlight>,
}

impl PeerState {
    pub fn new(peer: PeerId) -> Self {
        PeerState {
            peer,
            pulls: FastMap::default(),
        }
    }

    pub fn peer(&self) -> &PeerId {
        &self.peer
    }

    #[cfg(any(test, feature = "testing"))]
    /// Hash what decides this peer's future behaviour (pending requests per pull), in a
    /// canonical order: lets a model checker recognise equal states.
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        self.peer.hash(h);
        let mut pulls: Vec<_> = self.pulls.iter().collect();
        pulls.sort_by_key(|(id, _)| **id);
        for (id, p) in pulls {
            id.hash(h);
            p.carried.hash(h);
            p.layout.hash(h);
            let ids: Vec<&ReqId> = p.pending.iter().map(|r| &r.meta.req_id).collect();
            ids.hash(h);
            let mut aborted: Vec<&ReqId> = p.aborted.iter().map(|(id, _)| id).collect();
            aborted.sort();
            aborted.hash(h);
        }
    }

    /// Requests still owed, all pulls.
    pub fn pending_count(&self) -> usize {
        self.pulls.values().map(|p| p.pending.len()).sum()
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn in_flight(&self) -> usize {
        self.pulls.len()
    }

    pub fn is_in_flight(&self, pull_id: PullId) -> bool {
        self.pulls.contains_key(&pull_id)
    }

    /// Track a new pull. A request listed twice in one pull is tracked once.
    pub fn start(&mut self, pull_id: PullId, requests: PullRequests) {
        let pending = PendingSet::new(requests);
        let carried = pending.len();
        self.pulls.insert(
            pull_id,
            InFlight {
                pending,
                carried,
                aborted: Vec::new(),
                layout: PullLayout::default(),
            },
        );
    }

    /// The pull's layout id, and whether its metadata omitted the layout (vLLM 0.33). A pull
    /// is tracked as carrying it until told otherwise.
    pub fn set_layout(&mut self, pull_id: PullId, layout: PullLayout) {
        if let Some(p) = self.pulls.get_mut(&pull_id) {
            p.layout = layout;
        }
    }

    /// The requests the pull still owes (what a resend asks for again).
    pub fn pending_requests(&self, pull_id: PullId) -> PullRequests {
        self.pulls
            .get(&pull_id)
            .map(|p| p.pending.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// A pull that was never sent: settle each of its requests Failed at once. It is never
    /// tracked, so nothing about it can be settled twice.
    pub fn unsent(&self, pull: &UnsentPull) -> Effects {
        let mut fx = Effects::default();
        let mut seen = FastSet::default();
        for r in pull.requests.iter().filter(|r| seen.insert(&r.meta.req_id)) {
            fx.push(
                r.awaited(),
                Settle {
                    peer: self.peer.clone(),
                    pull_id: pull.pull_id,
                    req_id: r.meta.req_id.clone(),
                    outcome: SettleOutcome::failed(Cause::NotSent, pull.reason.clone()),
                },
            );
        }
        fx
    }

    fn settle(&mut self, fx: &mut Effects, pull_id: PullId, req_id: &str, outcome: SettleOutcome) {
        let Some(pull) = self.pulls.get_mut(&pull_id) else {
            return;
        };
        let outcome = pull.outcome_of(req_id, outcome);
        match pull.pending.remove(req_id) {
            Some(req) => {
                pull.aborted.retain(|(id, _)| &**id != req_id);
                let s = settle_of(&self.peer, pull_id, &req.meta.req_id, outcome);
                fx.push(req.awaited(), s);
            }
            None => fx.stale.note(req_id),
        }
    }

    /// Settle whatever is still pending for the pull and forget it.
    fn settle_rest(
        &mut self,
        fx: &mut Effects,
        pull_id: PullId,
        outcome: impl FnOnce() -> SettleOutcome,
    ) {
        // The outcome is made only if something is still pending: a FINISH has usually
        // settled everything, and an outcome's reason is an allocation.
        if let Some(pull) = self
            .pulls
            .remove(&pull_id)
            .filter(|p| !p.pending.is_empty())
        {
            let outcome = outcome();
            for req in pull.pending.iter() {
                let id = &req.meta.req_id;
                let outcome = pull.outcome_of(id, outcome.clone());
                fx.push(req.awaited(), settle_of(&self.peer, pull_id, id, outcome));
            }
        }
        fx.pull_done = true;
    }

    /// Whether everything the pull still owes was aborted by the host: nothing it may still
    /// answer concerns a request anyone waits for (the Peer then shortens its deadline to the
    /// abort's grace).
    pub fn only_aborted_pending(&self, pull_id: PullId) -> bool {
        self.pulls.get(&pull_id).is_some_and(|p| {
            !p.aborted.is_empty()
                && p.pending
                    .iter()
                    .all(|r| p.abort_reason(&r.meta.req_id).is_some())
        })
    }

    /// One reply off the pull's channel. Its cost is linear in the pull's size: a reply naming
    /// more than [`max_reply_ids`] ids is refused before they are decoded.
    pub fn on_reply(&mut self, pull_id: PullId, frames: Frames) -> Effects {
        let mut fx = Effects::default();
        let Some((carried, layout)) = self.pulls.get(&pull_id).map(|p| (p.carried, p.layout))
        else {
            return fx; // the pull is over; its channel is being closed
        };
        let resp = match decode_reply(&frames, carried) {
            Ok(r) => r,
            Err(e) => {
                // A decoder's complaint may quote the reply (a string where a number belongs).
                let reason = format!("malformed reply: {}", peer_text(&e));
                fx.malformed = Some(reason.clone());
                self.settle_rest(&mut fx, pull_id, || {
                    SettleOutcome::uncertain(Cause::Malformed, reason)
                });
                return fx;
            }
        };
        if resp.status == XferStatus::LayoutMiss {
            self.on_layout_miss(&mut fx, pull_id, layout, &resp);
            return fx;
        }
        if self.is_stray(pull_id, &resp) {
            for id in resp.err().iter().chain(resp.ok()) {
                fx.stale.note(id);
            }
            fx.stray = true;
            return fx;
        }
        self.settle_named(&mut fx, pull_id, &resp);
        if resp.layout_id != 0
            && resp.layout_id == layout.id
            && matches!(resp.status, XferStatus::Continue | XferStatus::Finish)
        {
            fx.layout_echoed = Some(resp.layout_id);
        }
        self.on_status(&mut fx, pull_id, &resp);
        fx
    }

    /// P answered `LAYOUT_MISS`: it wrote nothing and the pull is over on its side (vLLM 0.33).
    fn on_layout_miss(
        &mut self,
        fx: &mut Effects,
        pull_id: PullId,
        layout: PullLayout,
        resp: &XferReplyRef<'_>,
    ) {
        fx.layout_miss = true;
        if layout.id != 0 && !layout.carried {
            // It lost the layout it had echoed: the same pull again, with the layout. Once
            // only: the resend carries it, so a second miss fails the pull below.
            if let Some(p) = self.pulls.get_mut(&pull_id) {
                p.layout.carried = true;
            }
            fx.resend_with_layout = true;
            return;
        }
        // A miss for a pull that carried its layout breaks the protocol: P's word that it
        // wrote nothing is then worth what an ERROR's is.
        let msg = resp.err_msg.unwrap_or("no message");
        self.settle_rest(fx, pull_id, || {
            SettleOutcome::uncertain(
                Cause::PeerWideError,
                format!(
                    "peer answered LAYOUT_MISS to a pull that carried its layout: {}",
                    peer_text(msg)
                ),
            )
        });
    }

    /// Whether a reply names requests, none of them this pull's. It does not answer this pull
    /// (on a fresh DEALER per pull, as vLLM's D has, it could not arrive here at all): its
    /// FINISH must not end the pull, or P's real answer would be dropped as stale.
    fn is_stray(&self, pull_id: PullId, resp: &XferReplyRef<'_>) -> bool {
        let names_any = !(resp.ok().is_empty() && resp.err().is_empty());
        names_any
            && self.pulls.get(&pull_id).is_some_and(|p| {
                resp.err()
                    .iter()
                    .chain(resp.ok())
                    .all(|id| !p.pending.carries(id))
            })
    }

    /// Settle the requests a reply names: `err_reqs` first, so an id in both lists is a failure
    /// (its ok entry is then stale).
    fn settle_named(&mut self, fx: &mut Effects, pull_id: PullId, resp: &XferReplyRef<'_>) {
        if !resp.err().is_empty() {
            let err_msg = resp.err_msg.unwrap_or("peer reported failure");
            // Repeated for every request it fails: bounded and escaped first.
            let err_reason = peer_text(err_msg).into_owned();
            // Classified once, here: P's transfer-engine failures are told apart by their text.
            let err_cause = if err_msg.contains(TE_FAILURE) {
                Cause::TransportEngine
            } else {
                Cause::PeerError
            };
            for id in resp.err() {
                self.settle(
                    fx,
                    pull_id,
                    id,
                    SettleOutcome::failed(err_cause, err_reason.clone()),
                );
            }
        }
        for id in resp.ok() {
            self.settle(fx, pull_id, id, SettleOutcome::Ok);
        }
    }

    /// What the reply's status says of the requests it did not name.
    fn on_status(&mut self, fx: &mut Effects, pull_id: PullId, resp: &XferReplyRef<'_>) {
        match resp.status {
            // More subsets follow; the channel stays open until FINISH, ERROR or the deadline.
            XferStatus::Continue => {}
            XferStatus::Finish => {
                fx.finished_cleanly = true;
                self.settle_rest(fx, pull_id, || {
                    SettleOutcome::failed(Cause::Omitted, OMITTED)
                });
            }
            // (LAYOUT_MISS was answered before.)
            XferStatus::Error | XferStatus::LayoutMiss => {
                let msg = resp.err_msg.unwrap_or("no message");
                self.settle_rest(fx, pull_id, || {
                    SettleOutcome::uncertain(
                        Cause::PeerWideError,
                        format!("peer ERROR: {}", peer_text(msg)),
                    )
                });
            }
        }
    }

    /// The pull ended without FINISH/ERROR: channel error, channel closed, deadline (rule 4).
    pub fn abandon(&mut self, pull_id: PullId, cause: Cause, reason: String) -> Effects {
        let mut fx = Effects::default();
        if self.pulls.contains_key(&pull_id) {
            self.settle_rest(&mut fx, pull_id, || SettleOutcome::uncertain(cause, reason));
        }
        fx
    }

    /// The pull's request never left D (its socket could not be created): no peer can write
    /// for it, so its pending requests settle Failed, not Uncertain.
    pub fn fail_unsent(&mut self, pull_id: PullId, reason: String) -> Effects {
        let mut fx = Effects::default();
        if self.pulls.contains_key(&pull_id) {
            self.settle_rest(&mut fx, pull_id, || {
                SettleOutcome::failed(Cause::NotSent, reason)
            });
        }
        fx
    }

    /// The host aborted `req_id`: it is marked aborted in every pull that still owes it, and
    /// settles as aborted when P answers it or the pull ends ([`InFlight::outcome_of`]). Nothing
    /// settles here: the peer has the request's block addresses and may be writing them, and
    /// its answer is what proves it stopped. Settling at once (Uncertain) poisoned the pull's
    /// landing window for the whole quarantine deadline even when P then answered ok, and an
    /// abort rate of a few per second filled a deployment's share of windows. Closing the
    /// permit at once also failed P's whole transfer, and with it the batch's other requests.
    /// The blocks stay held meanwhile; the Peer bounds the wait ([`Self::only_aborted_pending`]).
    /// Returns the pulls that hold it.
    pub fn abort(&mut self, req_id: &str, reason: &str) -> Vec<PullId> {
        let mut ids: Vec<PullId> = self
            .pulls
            .iter_mut()
            .filter(|(_, p)| p.pending.contains(req_id))
            .map(|(id, p)| {
                if p.abort_reason(req_id).is_none() {
                    p.aborted.push((ReqId::from(req_id), reason.to_owned()));
                }
                *id
            })
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Restart: settle everything of every pull Uncertain; returns the pulls that were dropped.
    pub fn abandon_all(&mut self, reason: &str) -> (Effects, Vec<PullId>) {
        let mut fx = Effects::default();
        let mut ids: Vec<PullId> = self.pulls.keys().copied().collect();
        ids.sort_unstable();
        for id in &ids {
            self.settle_rest(&mut fx, *id, || {
                SettleOutcome::uncertain(Cause::Channel, reason)
            });
        }
        (fx, ids)
    }
}

#[cfg(test)]
#[path = "peer_state_tests.rs"]
mod tests;
