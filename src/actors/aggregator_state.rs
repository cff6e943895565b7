//! One request's receive as a tiny state machine (DESIGN.md §4 rules 5, 8, 9): outstanding
//! peers, the first failure (once), the completion (once), nothing after.

#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::config::Policy;
use crate::messages::{
    Cause, Completion, FirstFailure, Outcome, PeerId, Settle, SettleOutcome, SharedRequest,
};
use crate::rdma::Landing;

/// What to publish after a settle.
#[derive(Debug, Default)]
pub struct AggEffects {
    pub first_failure: Option<FirstFailure>,
    pub completion: Option<Completion>,
    /// The settle was not expected (peer not in the request, or already settled, or after the
    /// completion).
    pub stale: bool,
}

/// What every request of a coordinator is judged by: shared (through its batch's
/// [`BatchRules`]), so a request in flight pays nothing of its own for it (this state is kept per
/// in-flight request; DESIGN.md §8's memory figure).
#[derive(Clone)]
pub struct AggregationRules {
    /// `settle` waits for every peer; `naive` completes at the first failure (the upstream bug).
    pub policy: Policy,
    /// See [`AggregatorState::transport_failures_uncertain`].
    pub transport_failures_uncertain: bool,
    /// See [`AggregatorState::verified_by`].
    pub verifier: Option<Arc<dyn Landing>>,
}

impl AggregationRules {
    /// Rules with no verifier, TE failures taken at their word.
    pub fn new(policy: Policy) -> Self {
        AggregationRules {
            policy,
            transport_failures_uncertain: false,
            verifier: None,
        }
    }
}

/// Non-Ok settles by peer index.
type NotOk = Vec<(usize, Option<SettleOutcome>)>;

/// What every request of a batch is judged by and awaits: the coordinator's rules and the
/// batch's peers, one allocation per batch (a request in flight pays one pointer for both).
#[derive(Clone)]
pub struct BatchRules {
    /// The peers, in protocol order.
    peers: Arc<[PeerId]>,
    rules: Arc<AggregationRules>,
}

impl BatchRules {
    /// The rules and peers of one batch, for each of its requests' states to share.
    pub fn new(peers: Arc<[PeerId]>, rules: Arc<AggregationRules>) -> Arc<Self> {
        Arc::new(BatchRules { peers, rules })
    }
}

/// What only a failing request, or one awaiting more than 64 peers, needs: boxed, so that a
/// healthy request of up to 64 peers pays one pointer for it.
#[derive(Clone, Default)]
struct Rare {
    /// Settled bits of the peers past the 64th.
    high: Vec<u64>,
    /// The settles that were not Ok, by peer index.
    not_ok: NotOk,
    /// The first failure (peer, reason), once.
    first_failure: Option<(Option<PeerId>, Cause, String)>,
}

/// Kept per request in flight, so kept small (40 bytes): the rules and the peer list are
/// shared by the batch, the first 64 peers' settled bits are inline, and what only a failing
/// request (or one of more than 64 peers) needs is boxed.
#[derive(Clone)]
pub struct AggregatorState {
    req: SharedRequest,
    batch: Arc<BatchRules>,
    /// Settled bits of the first 64 peers (the rest in `rare`).
    settled: u64,
    rare: Option<Box<Rare>>,
    outstanding: u32,
    completed: bool,
}

#[cfg(feature = "testing")]
pub use super::peer_state::TE_FAILURE;

impl AggregatorState {
    /// `outstanding` starts at the number of peers.
    pub fn new(req: SharedRequest, peers: Vec<PeerId>, policy: Policy) -> Self {
        Self::with_peers(req, peers.into(), policy)
    }

    /// [`Self::new`] with the peer list shared.
    pub fn with_peers(req: SharedRequest, peers: Arc<[PeerId]>, policy: Policy) -> Self {
        Self::with_rules(req, peers, Arc::new(AggregationRules::new(policy)))
    }

    /// [`Self::with_peers`] with the rules shared too. Each call makes its own [`BatchRules`];
    /// the Receiver makes one per batch ([`Self::in_batch`]).
    pub fn with_rules(
        req: SharedRequest,
        peers: Arc<[PeerId]>,
        rules: Arc<AggregationRules>,
    ) -> Self {
        Self::in_batch(req, BatchRules::new(peers, rules))
    }

    /// A request of a batch whose rules and peers are `batch` (the Receiver makes one per
    /// batch: no allocation per request but the state's own).
    pub fn in_batch(req: SharedRequest, batch: Arc<BatchRules>) -> Self {
        let peers = batch.peers.len();
        // More peers than u32 counts cannot be paired with one D worker (their pulls alone
        // would exhaust any socket limit); saturate rather than wrap.
        let outstanding = u32::try_from(peers).unwrap_or(u32::MAX);
        AggregatorState {
            req,
            batch,
            settled: 0,
            rare: (peers > 64).then(|| {
                Box::new(Rare {
                    high: vec![0; (peers - 64).div_ceil(64)],
                    ..Rare::default()
                })
            }),
            outstanding,
            completed: false,
        }
    }

    fn rules(&self) -> &AggregationRules {
        &self.batch.rules
    }

    fn rare_mut(&mut self) -> &mut Rare {
        self.rare.get_or_insert_default()
    }

    fn not_ok(&self) -> &[(usize, Option<SettleOutcome>)] {
        self.rare.as_ref().map_or(&[], |r| &r.not_ok)
    }

    fn first_failure(&self) -> Option<&(Option<PeerId>, Cause, String)> {
        self.rare.as_ref().and_then(|r| r.first_failure.as_ref())
    }

    /// Check an all-Ok request against what `landing` saw land before completing it Ok
    /// (PROTOCOL.md §5.3: a v1 writer's ok proves nothing). An unbacked ok fails the request,
    /// and its peers count as uncertain: their bytes may still be in flight.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn verified_by(mut self, landing: Arc<dyn Landing>) -> Self {
        Arc::make_mut(&mut Arc::make_mut(&mut self.batch).rules).verifier = Some(landing);
        self
    }

    /// On RDMA nothing can be revoked per request, and a TE failure does not prove the
    /// transport stopped touching D's memory (PROTOCOL.md §5.3): treat such a Failed settle as
    /// Uncertain when deciding what to fence (DESIGN.md §5).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn transport_failures_uncertain(mut self, yes: bool) -> Self {
        Arc::make_mut(&mut Arc::make_mut(&mut self.batch).rules).transport_failures_uncertain = yes;
        self
    }

    /// The peers this request awaits, in protocol order.
    pub fn peers(&self) -> &[PeerId] {
        &self.batch.peers
    }

    /// Hash the state that decides what this request publishes next (model checking).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn fingerprint<H: std::hash::Hasher>(&self, h: &mut H) {
        use std::hash::Hash;
        self.req.req_id.hash(h);
        self.outstanding.hash(h);
        self.completed.hash(h);
        self.first_failure().hash(h);
        for (p, o) in self.slots() {
            p.hash(h);
            o.as_ref().map(|o| (o.label(), o.reason())).hash(h);
        }
    }

    pub fn req(&self) -> &SharedRequest {
        &self.req
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn outstanding(&self) -> usize {
        self.outstanding as usize
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn is_complete(&self) -> bool {
        self.completed
    }

    /// No writer can exist (topology failure, rule 7): fail and complete at once.
    pub fn fail_now(&mut self, cause: Cause, reason: String) -> AggEffects {
        if self.completed {
            return AggEffects {
                stale: true,
                ..Default::default()
            };
        }
        self.rare_mut().first_failure = Some((None, cause, reason.clone()));
        self.completed = true;
        AggEffects {
            first_failure: Some(FirstFailure {
                req: self.req.clone(),
                peer: None,
                cause,
                reason: reason.clone(),
            }),
            completion: Some(Completion {
                req: self.req.clone(),
                outcome: Outcome::Failed {
                    peer: None,
                    cause,
                    reason,
                },
                uncertain_peers: vec![],
                unsettled_peers: vec![],
                transport_failed_peers: vec![],
            }),
            stale: false,
        }
    }

    pub fn on_settle(&mut self, s: &Settle) -> AggEffects {
        let mut fx = AggEffects::default();
        if self.completed {
            fx.stale = true;
            return fx;
        }
        let peers = self.peers();
        let Some(i) = (0..peers.len()).find(|&i| peers[i] == s.peer && !self.is_settled(i)) else {
            fx.stale = true;
            return fx;
        };
        self.set_settled(i);
        if s.outcome != SettleOutcome::Ok {
            self.rare_mut().not_ok.push((i, Some(s.outcome.clone())));
        }
        self.outstanding -= 1;
        if let (Some(reason), Some(cause)) = (s.outcome.reason(), s.outcome.cause()) {
            if self.first_failure().is_none() {
                // The peer's words, plus what D's data plane knows of the cause.
                let reason = match self
                    .rules()
                    .verifier
                    .as_ref()
                    .and_then(|l| l.failure_context(&self.req))
                {
                    Some(ctx) => format!("{reason} ({ctx})"),
                    None => reason.to_owned(),
                };
                self.rare_mut().first_failure =
                    Some((Some(s.peer.clone()), cause, reason.clone()));
                fx.first_failure = Some(FirstFailure {
                    req: self.req.clone(),
                    peer: Some(s.peer.clone()),
                    cause,
                    reason,
                });
            }
        }
        let naive_stop = self.rules().policy == Policy::Naive && self.first_failure().is_some();
        if self.outstanding == 0 && self.first_failure().is_none() {
            if let Some(Err(reason)) = self
                .rules()
                .verifier
                .as_ref()
                .map(|l| l.verify_ok(&self.req))
            {
                tracing::warn!(req_id = %self.req.req_id, %reason, "peers' ok not backed by landed bytes");
                let peers = self.peers().len();
                let rare = self.rare_mut();
                rare.not_ok = (0..peers)
                    .map(|i| {
                        (
                            i,
                            Some(SettleOutcome::uncertain(Cause::Unbacked, reason.clone())),
                        )
                    })
                    .collect();
                rare.first_failure = Some((None, Cause::Unbacked, reason.clone()));
                fx.first_failure = Some(FirstFailure {
                    req: self.req.clone(),
                    peer: None,
                    cause: Cause::Unbacked,
                    reason,
                });
            }
        }
        if self.outstanding == 0 {
            self.check_aborted_oks();
        }
        if self.outstanding == 0 || naive_stop {
            fx.completion = Some(self.complete());
        }
        fx
    }

    /// A peer that answered ok for a request the host had aborted settled Failed `Aborted`
    /// (`PeerState`): like any ok, it proves P's writes stopped only if what landed backs it
    /// (PROTOCOL.md §5.3). If it does not, such peers count as uncertain, and their pulls'
    /// windows are poisoned.
    fn check_aborted_oks(&mut self) {
        let answered_abort = |o: &Option<SettleOutcome>| {
            matches!(
                o,
                Some(SettleOutcome::Failed {
                    cause: Cause::Aborted,
                    ..
                })
            )
        };
        if !self.not_ok().iter().any(|(_, o)| answered_abort(o)) {
            return;
        }
        let Some(Err(reason)) = self
            .rules()
            .verifier
            .as_ref()
            .map(|l| l.verify_ok(&self.req))
        else {
            return;
        };
        tracing::warn!(req_id = %self.req.req_id, %reason, "ok for an aborted request not backed by landed bytes");
        let not_ok = &mut self.rare_mut().not_ok;
        for (_, o) in not_ok.iter_mut().filter(|(_, o)| answered_abort(o)) {
            *o = Some(SettleOutcome::uncertain(Cause::Unbacked, reason.clone()));
        }
    }

    /// Each peer with its settle so far.
    fn slots(&self) -> impl Iterator<Item = (&PeerId, &Option<SettleOutcome>)> {
        static OK: Option<SettleOutcome> = Some(SettleOutcome::Ok);
        static NOT_YET: Option<SettleOutcome> = None;
        self.peers().iter().enumerate().map(move |(i, p)| {
            let o = if !self.is_settled(i) {
                &NOT_YET
            } else {
                self.not_ok()
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map_or(&OK, |(_, o)| o)
            };
            (p, o)
        })
    }

    fn is_settled(&self, i: usize) -> bool {
        match i.checked_sub(64) {
            None => self.settled & (1 << i) != 0,
            Some(j) => self
                .rare
                .as_ref()
                .and_then(|r| r.high.get(j / 64))
                .is_some_and(|w| w & (1 << (j % 64)) != 0),
        }
    }

    fn set_settled(&mut self, i: usize) {
        match i.checked_sub(64) {
            None => self.settled |= 1 << i,
            Some(j) => {
                if let Some(w) = self.rare_mut().high.get_mut(j / 64) {
                    *w |= 1 << (j % 64);
                }
            }
        }
    }

    fn complete(&mut self) -> Completion {
        self.completed = true;
        let outcome = match self.first_failure() {
            None => Outcome::Ok,
            Some((peer, cause, reason)) => Outcome::Failed {
                peer: peer.clone(),
                cause: *cause,
                reason: reason.clone(),
            },
        };
        let te_uncertain = self.rules().transport_failures_uncertain;
        let uncertain_peers = self
            .slots()
            .filter(|(_, o)| match o {
                Some(SettleOutcome::Uncertain { .. }) => true,
                Some(SettleOutcome::Failed {
                    cause: Cause::TransportEngine,
                    ..
                }) => te_uncertain,
                _ => false,
            })
            .map(|(p, _)| p.clone())
            .collect();
        let unsettled_peers = self
            .slots()
            .filter(|(_, o)| o.is_none())
            .map(|(p, _)| p.clone())
            .collect();
        let transport_failed_peers = self
            .slots()
            .filter(|(_, o)| {
                matches!(
                    o,
                    Some(SettleOutcome::Failed {
                        cause: Cause::TransportEngine,
                        ..
                    })
                )
            })
            .map(|(p, _)| p.clone())
            .collect();
        Completion {
            req: self.req.clone(),
            outcome,
            uncertain_peers,
            unsettled_peers,
            transport_failed_peers,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::messages::RequestMeta;

    /// The size the type's doc claims: a request in flight keeps one state of 40 bytes (72
    /// before the rules and peers were one pointer per batch and the rarely needed parts one
    /// box), so that its aggregation entry fits mimalloc's 48-byte class.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_state_is_as_small_as_its_doc_says() {
        assert_eq!(std::mem::size_of::<AggregatorState>(), 40);
    }

    fn req() -> SharedRequest {
        Arc::new(RequestMeta::new("r", "t", "e", "b", &[vec![1]]))
    }

    fn settle(peer: &str, outcome: SettleOutcome) -> Settle {
        Settle {
            peer: PeerId::new(peer),
            pull_id: 1,
            req_id: "r".into(),
            outcome,
        }
    }

    /// Peers past the 64th are tracked too: each settles once, and the request completes only
    /// when the last of them has.
    #[test]
    fn more_than_64_peers_each_settle_once() {
        let peers: Vec<PeerId> = (0..130).map(|i| PeerId::new(format!("p{i}"))).collect();
        let mut a = AggregatorState::new(req(), peers.clone(), Policy::Settle);
        for (i, p) in peers.iter().enumerate() {
            let fx = a.on_settle(&settle(p.addr(), SettleOutcome::Ok));
            assert!(!fx.stale, "peer {i} settled for the first time");
            assert!(
                a.on_settle(&settle(p.addr(), SettleOutcome::Ok)).stale,
                "peer {i} settling twice is stale"
            );
            assert_eq!(fx.completion.is_some(), i == peers.len() - 1);
        }
    }

    #[test]
    fn failure_is_reported_at_once_and_completion_waits_for_every_peer() {
        let mut a = AggregatorState::new(
            req(),
            vec![PeerId::new("a"), PeerId::new("b")],
            Policy::Settle,
        );
        let fx = a.on_settle(&settle("a", SettleOutcome::uncertain(Cause::Timeout, "x")));
        assert!(fx.first_failure.is_some() && fx.completion.is_none());
        let fx = a.on_settle(&settle("a", SettleOutcome::Ok));
        assert!(fx.stale, "a second settle from the same peer is stale");
        let fx = a.on_settle(&settle("b", SettleOutcome::failed(Cause::PeerError, "y")));
        assert!(fx.first_failure.is_none(), "first failure once");
        let c = fx.completion.unwrap();
        assert_eq!(c.uncertain_peers, vec![PeerId::new("a")]);
        assert!(matches!(c.outcome, Outcome::Failed { reason, .. } if reason == "x"));
        assert!(a.on_settle(&settle("b", SettleOutcome::Ok)).stale);
    }

    #[test]
    fn naive_completes_on_first_failure_and_names_the_peers_still_writing() {
        let mut a = AggregatorState::new(
            req(),
            vec![PeerId::new("a"), PeerId::new("b")],
            Policy::Naive,
        );
        let fx = a.on_settle(&settle("a", SettleOutcome::failed(Cause::PeerError, "x")));
        let c = fx.completion.unwrap();
        assert_eq!(c.unsettled_peers, vec![PeerId::new("b")]);
        assert!(a.on_settle(&settle("b", SettleOutcome::Ok)).stale);
    }

    #[test]
    fn te_failures_count_as_uncertain_only_when_asked() {
        let te = || {
            settle(
                "a",
                SettleOutcome::failed(Cause::TransportEngine, format!("{TE_FAILURE} -1")),
            )
        };
        let mut plain = AggregatorState::new(req(), vec![PeerId::new("a")], Policy::Settle);
        assert!(plain
            .on_settle(&te())
            .completion
            .unwrap()
            .uncertain_peers
            .is_empty());
        let mut rdma = AggregatorState::new(req(), vec![PeerId::new("a")], Policy::Settle)
            .transport_failures_uncertain(true);
        assert_eq!(
            rdma.on_settle(&te()).completion.unwrap().uncertain_peers,
            vec![PeerId::new("a")]
        );
        let mut other = AggregatorState::new(req(), vec![PeerId::new("a")], Policy::Settle)
            .transport_failures_uncertain(true);
        let f = settle(
            "a",
            SettleOutcome::failed(Cause::PeerError, "KV group count mismatch"),
        );
        assert!(other
            .on_settle(&f)
            .completion
            .unwrap()
            .uncertain_peers
            .is_empty());
    }

    #[test]
    fn a_peer_listed_twice_must_settle_twice() {
        let p = PeerId::new("a");
        let mut a = AggregatorState::new(req(), vec![p.clone(), p], Policy::Settle);
        assert!(a
            .on_settle(&settle("a", SettleOutcome::Ok))
            .completion
            .is_none());
        assert!(a
            .on_settle(&settle("a", SettleOutcome::Ok))
            .completion
            .is_some());
    }

    /// A data plane whose byte accounting refuses every ok.
    struct Unbacked;

    impl Landing for Unbacked {
        fn endpoint(&self) -> (&str, u32) {
            ("", 0)
        }
        fn open_pull(&self, _w: &crate::rdma::PullWindow<'_>) -> crate::rdma::RegionBases {
            [].into()
        }
        fn revoke(&self, _r: &crate::rdma::RevokeRequest<'_>) -> crate::rdma::Revoked {
            crate::rdma::Revoked::not_exact()
        }
        fn verify_ok(&self, _req: &RequestMeta) -> Result<(), String> {
            Err("v1: 0 of 8 bytes landed".into())
        }
        fn fence(
            &self,
            _p: &[PeerId],
        ) -> futures::future::LocalBoxFuture<'static, Result<(), crate::rdma::FenceError>> {
            Box::pin(async { Ok(()) })
        }
    }

    /// P answered ok for a request the host aborted (`PeerState` settles it Failed `Aborted`):
    /// the peer is no suspect when what landed backs the ok, and uncertain when it does not.
    #[test]
    fn an_aborted_request_p_answered_ok_is_no_suspect_unless_the_bytes_say_otherwise() {
        let peers = vec![PeerId::new("a"), PeerId::new("b")];
        let answered = || SettleOutcome::failed(Cause::Aborted, "aborted by the host");
        let mut plain = AggregatorState::new(req(), peers.clone(), Policy::Settle);
        let fx = plain.on_settle(&settle("a", answered()));
        assert!(fx.first_failure.is_some(), "the abort is the failure");
        let c = plain
            .on_settle(&settle("b", answered()))
            .completion
            .unwrap();
        assert!(!c.outcome.is_ok());
        assert!(c.suspects().is_empty(), "{c:?}");
        let mut checked = AggregatorState::new(req(), peers.clone(), Policy::Settle)
            .verified_by(Arc::new(Unbacked));
        checked.on_settle(&settle("a", answered()));
        let c = checked
            .on_settle(&settle(
                "b",
                SettleOutcome::failed(Cause::PeerError, "expired"),
            ))
            .completion
            .unwrap();
        assert_eq!(
            c.uncertain_peers,
            vec![PeerId::new("a")],
            "a's ok is not backed: its bytes may still be in flight; b wrote nothing"
        );
    }

    #[test]
    fn an_ok_the_landed_bytes_do_not_back_fails_with_every_peer_uncertain() {
        let peers = vec![PeerId::new("a"), PeerId::new("b")];
        let mut a = AggregatorState::new(req(), peers.clone(), Policy::Settle)
            .verified_by(Arc::new(Unbacked));
        assert!(a
            .on_settle(&settle("a", SettleOutcome::Ok))
            .first_failure
            .is_none());
        let fx = a.on_settle(&settle("b", SettleOutcome::Ok));
        let ff = fx
            .first_failure
            .expect("failure published with the completion");
        assert!(ff.reason.contains("0 of 8"), "{}", ff.reason);
        let c = fx.completion.unwrap();
        assert!(!c.outcome.is_ok());
        assert_eq!(c.uncertain_peers, peers, "bytes may still be in flight");
        // Without a verifier the same settles complete Ok.
        let mut plain = AggregatorState::new(req(), peers, Policy::Settle);
        plain.on_settle(&settle("a", SettleOutcome::Ok));
        assert!(plain
            .on_settle(&settle("b", SettleOutcome::Ok))
            .completion
            .unwrap()
            .outcome
            .is_ok());
    }
}
