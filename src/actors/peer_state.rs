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
                r.awaited,
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
                fx.push(req.awaited, s);
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
                fx.push(req.awaited, settle_of(&self.peer, pull_id, id, outcome));
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
        let decoded = match frames.as_slice() {
            [one] => {
                XferReplyRef::decode_bounded(one, max_reply_ids(carried)).map_err(|e| e.to_string())
            }
            _ => Err(format!("{}-frame reply", frames.len())),
        };
        let resp = match decoded {
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
            // P wrote nothing and the pull is over on its side (vLLM 0.33).
            fx.layout_miss = true;
            if layout.id != 0 && !layout.carried {
                // It lost the layout it had echoed: the same pull again, with the layout. Once
                // only: the resend carries it, so a second miss fails the pull below.
                if let Some(p) = self.pulls.get_mut(&pull_id) {
                    p.layout.carried = true;
                }
                fx.resend_with_layout = true;
                return fx;
            }
            // A miss for a pull that carried its layout breaks the protocol: P's word that it
            // wrote nothing is then worth what an ERROR's is.
            let msg = resp.err_msg.unwrap_or("no message");
            self.settle_rest(&mut fx, pull_id, || {
                SettleOutcome::uncertain(
                    Cause::PeerWideError,
                    format!(
                        "peer answered LAYOUT_MISS to a pull that carried its layout: {}",
                        peer_text(msg)
                    ),
                )
            });
            return fx;
        }
        // A reply that names requests, none of them this pull's, does not answer this pull (on
        // a fresh DEALER per pull, as vLLM's D has, it could not arrive here at all): its FINISH
        // must not end the pull, or P's real answer would be dropped as stale.
        let names_any = !(resp.ok().is_empty() && resp.err().is_empty());
        if names_any
            && self.pulls.get(&pull_id).is_some_and(|p| {
                resp.err()
                    .iter()
                    .chain(resp.ok())
                    .all(|id| !p.pending.carries(id))
            })
        {
            for id in resp.err().iter().chain(resp.ok()) {
                fx.stale.note(id);
            }
            fx.stray = true;
            return fx;
        }
        // err_reqs first: an id in both lists is a failure (its ok entry is then stale).
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
                    &mut fx,
                    pull_id,
                    id,
                    SettleOutcome::failed(err_cause, err_reason.clone()),
                );
            }
        }
        for id in resp.ok() {
            self.settle(&mut fx, pull_id, id, SettleOutcome::Ok);
        }
        if resp.layout_id != 0
            && resp.layout_id == layout.id
            && matches!(resp.status, XferStatus::Continue | XferStatus::Finish)
        {
            fx.layout_echoed = Some(resp.layout_id);
        }
        match resp.status {
            // More subsets follow; the channel stays open until FINISH, ERROR or the deadline.
            XferStatus::Continue => {}
            XferStatus::Finish => {
                fx.finished_cleanly = true;
                self.settle_rest(&mut fx, pull_id, || {
                    SettleOutcome::failed(Cause::Omitted, OMITTED)
                });
            }
            // (LAYOUT_MISS was answered above.)
            XferStatus::Error | XferStatus::LayoutMiss => {
                let msg = resp.err_msg.unwrap_or("no message");
                self.settle_rest(&mut fx, pull_id, || {
                    SettleOutcome::uncertain(
                        Cause::PeerWideError,
                        format!("peer ERROR: {}", peer_text(msg)),
                    )
                });
            }
        }
        fx
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
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::messages::{MooncakeXferResponse, Pull, RequestMeta};

    impl PeerState {
        fn start_pull(&mut self, p: Pull) {
            self.start(p.pull_id, p.requests);
        }
    }

    fn pull(id: PullId, reqs: &[&str]) -> Pull {
        Pull {
            pull_id: id,
            payload: vec![],
            handed_at: tokio::time::Instant::now(),
            layout: crate::messages::PullLayout::default(),
            with_layout: None,
            requests: reqs
                .iter()
                .map(|r| crate::messages::PullRequest {
                    meta: Arc::new(RequestMeta {
                        req_id: (*r).into(),
                        transfer_id: format!("t-{r}").into(),
                        engine_id: "e".into(),
                        bootstrap_addr: "http://b:1".into(),
                        block_ids: vec![vec![1]],
                    }),
                    awaited: true,
                })
                .collect(),
        }
    }

    fn reply(status: XferStatus, ok: Vec<String>, err: Vec<String>) -> Frames {
        let r = MooncakeXferResponse {
            status,
            ok_reqs: Some(ok),
            err_reqs: Some(err),
            err_msg: None,
            layout_id: 0,
        };
        vec![r.encode().unwrap()]
    }

    /// Every settle is an event; only those an aggregator awaits go to it, in order, whether
    /// the reply names them or the FINISH settles the rest.
    #[test]
    fn only_awaited_settles_go_to_the_aggregator() {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        let mut p = pull(1, &["a", "cleanup", "b", "c"]);
        p.requests[1].awaited = false;
        st.start_pull(p);
        let ok = vec!["cleanup".to_string(), "a".to_string(), "c".to_string()];
        let mut fx = st.on_reply(1, reply(XferStatus::Finish, ok, vec![]));
        let all: Vec<String> = fx.settles.iter().map(|s| s.req_id.to_string()).collect();
        assert_eq!(all, ["cleanup", "a", "c", "b"], "every settle, in order");
        let sent: Vec<(String, bool)> = fx
            .awaited()
            .iter()
            .map(|s| (s.req_id.to_string(), s.outcome.is_ok()))
            .collect();
        assert_eq!(
            sent,
            [("a".into(), true), ("c".into(), true), ("b".into(), false)],
            "the aggregator gets the awaited ones: b omitted by the FINISH"
        );
    }

    fn outcomes(fx: &Effects) -> Vec<(String, SettleOutcome)> {
        fx.settles
            .iter()
            .map(|s| (s.req_id.to_string(), s.outcome.clone()))
            .collect()
    }

    fn aborted() -> SettleOutcome {
        SettleOutcome::uncertain(Cause::Aborted, "aborted by the host")
    }

    /// P answered an aborted request ok: its writes are done, so it is Failed, not Uncertain.
    fn aborted_answered() -> SettleOutcome {
        SettleOutcome::failed(Cause::Aborted, "aborted by the host")
    }

    /// P's words are bounded and escaped before they are repeated per request: a FINISH failing
    /// every request with a 4 MB message holding a newline and an escape sequence, an ERROR
    /// with one, and a megabyte-long id D never sent.
    #[test]
    fn a_peers_text_is_bounded_and_escaped_before_it_reaches_every_request() {
        use crate::messages::peer_text::MAX_PEER_TEXT;
        let printable = |r: &str| r.len() < MAX_PEER_TEXT + 64 && !r.chars().any(char::is_control);
        let ids: Vec<String> = (0..64).map(|i| format!("r{i}")).collect();
        let names: Vec<&str> = ids.iter().map(String::as_str).collect();
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(1, &names));
        let huge = MooncakeXferResponse {
            status: XferStatus::Finish,
            ok_reqs: Some(vec!["x".repeat(1 << 20)]),
            err_reqs: Some(ids.clone()),
            err_msg: Some(format!("line1\nforged\x1b[31m{}", "E".repeat(4 << 20))),
            layout_id: 0,
        };
        let fx = st.on_reply(1, vec![huge.encode().unwrap()]);
        assert_eq!(fx.settles.len(), 64);
        for s in &fx.settles {
            let SettleOutcome::Failed { cause, reason } = &s.outcome else {
                panic!("{:?}", s.outcome);
            };
            assert_eq!(*cause, Cause::PeerError);
            assert!(printable(reason), "{} bytes: {reason:?}", reason.len());
            assert!(
                reason.starts_with("line1\\nforged\\u{1b}[31mEEE"),
                "{reason:?}"
            );
        }
        assert_eq!(fx.stale.count, 1);
        assert!(
            printable(&fx.stale.sample[0]),
            "the stale id is sampled bounded"
        );

        st.start_pull(pull(2, &["a"]));
        let error = MooncakeXferResponse {
            status: XferStatus::Error,
            ok_reqs: Some(vec![]),
            err_reqs: Some(vec![]),
            err_msg: Some(format!("\r{}", "boom".repeat(1 << 18))),
            layout_id: 0,
        };
        let fx = st.on_reply(2, vec![error.encode().unwrap()]);
        let reason = fx.settles[0].outcome.reason().unwrap();
        assert!(printable(reason), "{reason:?}");
        assert!(reason.starts_with("peer ERROR: \\rboom"), "{reason:?}");
    }

    /// An abort settles nothing by itself: P's answer does, as aborted, keeping what the
    /// answer proves (ok: Failed; a transfer-engine failure keeps its cause).
    #[test]
    fn an_abort_waits_for_p_and_its_answer_settles_the_request_as_aborted() {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(1, &["a", "b"]));
        st.start_pull(pull(2, &["a"]));
        assert_eq!(
            st.abort("a", "aborted by the host"),
            vec![1, 2],
            "both pulls owed it"
        );
        assert!(
            st.only_aborted_pending(2),
            "pull 2 owes only the aborted request"
        );
        assert!(!st.only_aborted_pending(1), "pull 1 still owes b");
        assert_eq!(st.pending_count(), 3, "nothing settled: a twice, and b");
        assert_eq!(st.abort("a", "again"), vec![1, 2]);
        let fx = st.on_reply(
            1,
            reply(XferStatus::Continue, vec!["a".into(), "b".into()], vec![]),
        );
        assert_eq!(
            outcomes(&fx),
            vec![
                ("a".into(), aborted_answered()),
                ("b".into(), SettleOutcome::Ok)
            ]
        );
        assert!(fx.stale.is_empty(), "{:?}", fx.stale);
        let te = MooncakeXferResponse {
            status: XferStatus::Finish,
            ok_reqs: Some(vec![]),
            err_reqs: Some(vec!["a".into()]),
            err_msg: Some(format!("{TE_FAILURE} -1")),
            layout_id: 0,
        };
        let fx = st.on_reply(2, vec![te.encode().unwrap()]);
        assert_eq!(
            outcomes(&fx),
            vec![(
                "a".into(),
                SettleOutcome::failed(
                    Cause::TransportEngine,
                    format!("aborted by the host (P: {TE_FAILURE} -1)")
                )
            )]
        );
        // Settled once: a later ok for it is stale.
        let late = st.on_reply(1, reply(XferStatus::Continue, vec!["a".into()], vec![]));
        assert!(late.settles.is_empty());
        assert_eq!(late.stale.count, 1);
    }

    /// On a reused channel, P's answer to an earlier pull (sent again after its FINISH) can
    /// arrive first: it names only requests this pull never carried, so it is stale and does
    /// not end the pull; P's real FINISH then settles the pull's request.
    #[test]
    fn a_reply_naming_none_of_the_pulls_requests_does_not_end_it() {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(2, &["r1"]));
        let fx = st.on_reply(2, reply(XferStatus::Finish, vec![], vec!["r0".into()]));
        assert!(fx.stray && !fx.pull_done && !fx.finished_cleanly);
        assert!(fx.settles.is_empty());
        assert_eq!(fx.stale.count, 1);
        let fx = st.on_reply(2, reply(XferStatus::Finish, vec!["r1".into()], vec![]));
        assert_eq!(outcomes(&fx), vec![("r1".into(), SettleOutcome::Ok)]);
        assert!(fx.finished_cleanly && fx.pull_done && !fx.stray);
        // A reply naming one of the pull's requests is the pull's, whatever else it names;
        // one naming nothing at all is a FINISH that omitted everything.
        st.start_pull(pull(3, &["r2", "r3"]));
        let fx = st.on_reply(
            3,
            reply(XferStatus::Continue, vec!["r2".into(), "zz".into()], vec![]),
        );
        assert!(!fx.stray);
        assert_eq!(outcomes(&fx), vec![("r2".into(), SettleOutcome::Ok)]);
        // Settled already, still the pull's own: a repeat is stale but not stray.
        let fx = st.on_reply(3, reply(XferStatus::Continue, vec!["r2".into()], vec![]));
        assert!(!fx.stray && fx.stale.count == 1);
        let fx = st.on_reply(3, reply(XferStatus::Finish, vec![], vec![]));
        assert!(!fx.stray && fx.pull_done);
        assert_eq!(
            outcomes(&fx),
            vec![("r3".into(), SettleOutcome::failed(Cause::Omitted, OMITTED))]
        );
    }

    fn layout_reply(status: XferStatus, ok: &[&str], layout_id: u64) -> Frames {
        let mut r = MooncakeXferResponse::new(status);
        r.ok_reqs = Some(ok.iter().map(|s| s.to_string()).collect());
        r.layout_id = layout_id;
        r.err_msg = (status == XferStatus::LayoutMiss).then(|| "not cached".into());
        vec![r.encode().unwrap()]
    }

    /// vLLM 0.33: an echo of the pull's own id acks it; LAYOUT_MISS on a pull that omitted
    /// its layout settles nothing and asks for one resend with it (the pull stays in flight);
    /// a second miss, or a miss on a pull that carried it, fails the pull.
    #[test]
    fn layout_miss_resends_an_omitted_layout_once_and_fails_a_carried_one() {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(1, &["a", "b"]));
        st.set_layout(
            1,
            PullLayout {
                id: 7,
                carried: true,
            },
        );
        let fx = st.on_reply(1, layout_reply(XferStatus::Continue, &["a"], 9));
        assert_eq!(fx.layout_echoed, None, "not this pull's id");
        let fx = st.on_reply(1, layout_reply(XferStatus::Finish, &["b"], 7));
        assert_eq!(fx.layout_echoed, Some(7));

        st.start_pull(pull(2, &["c"]));
        st.set_layout(
            2,
            PullLayout {
                id: 7,
                carried: false,
            },
        );
        let fx = st.on_reply(2, layout_reply(XferStatus::LayoutMiss, &[], 0));
        assert!(fx.layout_miss && fx.resend_with_layout);
        assert!(
            fx.settles.is_empty() && !fx.pull_done,
            "nothing reaches the host"
        );
        assert_eq!(st.pending_requests(2).len(), 1, "the same request, resent");
        // The resend carried the layout: another miss breaks the protocol and fails it.
        let fx = st.on_reply(2, layout_reply(XferStatus::LayoutMiss, &[], 0));
        assert!(fx.layout_miss && !fx.resend_with_layout && fx.pull_done);
        let [(id, SettleOutcome::Uncertain { cause, reason })] = &outcomes(&fx)[..] else {
            panic!("{:?}", outcomes(&fx));
        };
        assert_eq!((id.as_str(), *cause), ("c", Cause::PeerWideError));
        assert!(
            reason.contains("LAYOUT_MISS") && reason.contains("not cached"),
            "{reason}"
        );
        // A pull without an id (layout ids off) is never resent.
        st.start_pull(pull(3, &["d"]));
        let fx = st.on_reply(3, layout_reply(XferStatus::LayoutMiss, &[], 0));
        assert!(!fx.resend_with_layout && fx.pull_done && fx.settles.len() == 1);
    }

    #[test]
    fn an_aborted_request_p_answered_is_not_settled_again() {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(1, &["a", "b", "c"]));
        st.abort("a", "aborted by the host");
        let fx = st.on_reply(1, reply(XferStatus::Continue, vec!["a".into()], vec![]));
        assert_eq!(outcomes(&fx), vec![("a".into(), aborted_answered())]);
        let fx = st.on_reply(1, reply(XferStatus::Continue, vec!["b".into()], vec![]));
        assert_eq!(outcomes(&fx), vec![("b".into(), SettleOutcome::Ok)]);
        assert!(fx.stale.is_empty(), "{:?}", fx.stale);
        // Aborting the last one leaves it to P's answer, which settles it with nothing stale.
        assert_eq!(st.abort("c", "aborted by the host"), vec![1]);
        assert!(st.only_aborted_pending(1));
        let fx = st.on_reply(1, reply(XferStatus::Finish, vec!["c".into()], vec![]));
        assert_eq!(outcomes(&fx), vec![("c".into(), aborted_answered())]);
        assert!(fx.stale.is_empty() && fx.pull_done && fx.finished_cleanly);
    }

    #[test]
    fn a_pull_left_with_only_aborted_requests_waits_for_p_or_its_deadline() {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(1, &["a", "b", "c"]));
        assert!(st.abort("a", "aborted by the host").len() == 1);
        let fx = st.on_reply(1, reply(XferStatus::Continue, vec!["b".into()], vec![]));
        assert_eq!(outcomes(&fx), vec![("b".into(), SettleOutcome::Ok)]);
        assert!(!st.only_aborted_pending(1));
        let fx = st.on_reply(1, reply(XferStatus::Continue, vec![], vec!["c".into()]));
        assert_eq!(
            outcomes(&fx),
            vec![(
                "c".into(),
                SettleOutcome::failed(Cause::PeerError, "peer reported failure")
            )]
        );
        assert!(st.only_aborted_pending(1), "only a is left");
        assert_eq!(st.pending_count(), 1, "a waits for P");
        // No answer before the deadline: D cannot know P stopped.
        let fx = st.abandon(1, Cause::Timeout, "deadline".into());
        assert_eq!(outcomes(&fx), vec![("a".into(), aborted())]);
        assert_eq!(st.pending_count(), 0);
    }

    #[test]
    fn an_aborted_request_still_held_settles_as_aborted_when_the_pull_ends() {
        for end in ["deadline", "finish", "error"] {
            let mut st = PeerState::new(PeerId::new("tcp://p:1"));
            st.start_pull(pull(1, &["a", "b"]));
            st.abort("a", "aborted by the host");
            let fx = match end {
                "deadline" => st.abandon(1, Cause::Timeout, "deadline".into()),
                "finish" => st.on_reply(1, reply(XferStatus::Finish, vec!["b".into()], vec![])),
                _ => st.on_reply(1, reply(XferStatus::Error, vec![], vec![])),
            };
            let a: Vec<_> = outcomes(&fx)
                .into_iter()
                .filter(|(id, _)| id == "a")
                .collect();
            // A FINISH that omits it is P's answer (rule 3: it did not write it).
            let want = match end {
                "finish" => SettleOutcome::failed(
                    Cause::Omitted,
                    format!("aborted by the host (P: {OMITTED})"),
                ),
                _ => aborted(),
            };
            assert_eq!(a, vec![("a".into(), want)], "{end}");
            assert!(fx.pull_done, "{end}");
            assert_eq!(st.pending_count(), 0, "{end}");
        }
    }

    #[test]
    fn an_id_in_both_lists_of_one_reply_settles_failed() {
        let mut st = PeerState::new(PeerId::new("p"));
        st.start_pull(pull(1, &["r1", "r2"]));
        let fx = st.on_reply(
            1,
            reply(
                XferStatus::Continue,
                vec!["r1".into(), "r2".into()],
                vec!["r1".into()],
            ),
        );
        assert_eq!(
            outcomes(&fx),
            vec![
                (
                    "r1".into(),
                    SettleOutcome::failed(Cause::PeerError, "peer reported failure")
                ),
                ("r2".into(), SettleOutcome::Ok),
            ]
        );
        assert_eq!(fx.stale.count, 1, "the ok entry of r1 is a duplicate");
    }

    #[test]
    fn stale_ids_are_counted_with_a_short_sample() {
        let mut st = PeerState::new(PeerId::new("p"));
        st.start_pull(pull(1, &["r1"]));
        // 2 x 1 + slack: the most a reply to this pull may name
        let mut ids: Vec<String> = (0..max_reply_ids(1) - 1).map(|i| format!("x{i}")).collect();
        ids.push("r1".into());
        let fx = st.on_reply(1, reply(XferStatus::Continue, ids, vec![]));
        assert!(fx.malformed.is_none());
        assert_eq!(outcomes(&fx), vec![("r1".into(), SettleOutcome::Ok)]);
        assert_eq!(fx.stale.count, max_reply_ids(1) - 1);
        assert_eq!(fx.stale.sample.len(), STALE_SAMPLE);
        assert_eq!(&*fx.stale.sample[0], "x0");
    }

    #[test]
    fn a_reply_naming_a_million_ids_is_refused_as_malformed_without_decoding_them() {
        let mut st = PeerState::new(PeerId::new("p"));
        st.start_pull(pull(1, &["r1", "r2"]));
        let ids: Vec<String> = (0..1_000_000).map(|i| format!("id-{i:07}")).collect();
        let frames = reply(XferStatus::Continue, ids, vec![]);
        assert!(frames[0].len() < 16 << 20, "under the frame cap");
        let t = Instant::now();
        let fx = st.on_reply(1, frames);
        // Informational only (not asserted): the refusal reads list headers, not the ids.
        eprintln!("1,000,000-id reply refused in {:?}", t.elapsed());
        let reason = fx.malformed.as_deref().expect("malformed");
        assert!(
            reason.contains("1000000") && reason.contains("more than the 20"),
            "{reason}"
        );
        assert!(fx.stale.is_empty(), "nothing was decoded, nothing echoed");
        assert!(fx.pull_done);
        assert!(outcomes(&fx)
            .iter()
            .all(|(_, o)| matches!(o, SettleOutcome::Uncertain { .. })));
        assert_eq!(
            fx.settles.len(),
            2,
            "the pull's pending requests settle Uncertain"
        );
    }

    #[test]
    fn an_unsent_pull_settles_each_request_failed_once() {
        let st = PeerState::new(PeerId::new("p"));
        let p = pull(3, &["r1", "r1", "r2"]);
        let fx = st.unsent(&UnsentPull {
            pull_id: 3,
            requests: p.requests,
            reason: "not sent".into(),
        });
        assert_eq!(
            outcomes(&fx),
            vec![
                (
                    "r1".into(),
                    SettleOutcome::failed(Cause::NotSent, "not sent")
                ),
                (
                    "r2".into(),
                    SettleOutcome::failed(Cause::NotSent, "not sent")
                ),
            ]
        );
        assert_eq!(st.in_flight(), 0);
    }
}
