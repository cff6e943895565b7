//! Shared test harness: a coordinator on scripted transports, a controllable landing, and
//! helpers that await events instead of sleeping.
#![allow(dead_code)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::future::LocalBoxFuture;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::oneshot;

use kvrecv::actors::topology::{DRank, EngineTopology};
use kvrecv::actors::{
    Coordinator, CoordinatorParts, EventSink, OpenedPull, ScriptedTransport, StaticTopology,
};
use kvrecv::block_ownership::{owner_tag, BlockOwnership, BlockState};
use kvrecv::config::{KvRecvConfig, Policy};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{Allocate, KvEvent, KvRequest, LoadKv, PeerId};
use kvrecv::rdma::{FenceError, Landing, PullWindow, Revocation, RevokeRequest, Revoked};

/// Safety net only: every wait below ends on an event long before this.
pub const PATIENCE: Duration = Duration::from_secs(10);

type PendingFence = (Vec<PeerId>, oneshot::Sender<Result<(), FenceError>>);

/// A landing whose revocation result is chosen by the test and whose fences complete when the
/// test says so. It keeps the rule a real data plane lives by: a request's permits (granted at
/// `open_pull`) are revoked before its blocks are released. A revocation that finds a block of
/// the request already back in the pool, or a release announced while a permit is live, is
/// recorded as a violation; the harness fails the test on the first it sees.
#[derive(Default)]
pub struct ManualLanding {
    pub exact: bool,
    pub revoked: Mutex<Vec<String>>,
    fences: Mutex<Vec<PendingFence>>,
    /// The built-in pool's ownership table (set when the coordinator starts).
    ownership: OnceLock<Arc<BlockOwnership>>,
    /// Live permits: request -> its pool blocks, each with the ownership it had when the
    /// permit was granted (blocks outside the pool are not in the table).
    permits: Mutex<HashMap<String, Vec<(u32, BlockState)>>>,
    violations: Mutex<Vec<String>>,
}

impl ManualLanding {
    pub fn exact() -> Self {
        ManualLanding {
            exact: true,
            ..Default::default()
        }
    }

    /// Complete every fence requested so far.
    pub fn confirm_fences(&self) -> usize {
        let v: Vec<_> = self.fences.lock().unwrap().drain(..).collect();
        let n = v.len();
        for (_, tx) in v {
            let _ = tx.send(Ok(()));
        }
        n
    }

    pub fn pending_fences(&self) -> Vec<Vec<PeerId>> {
        self.fences
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Whether `req_id` holds a permit not yet revoked.
    pub fn permit_live(&self, req_id: &str) -> bool {
        self.permits.lock().unwrap().contains_key(req_id)
    }

    /// Order violations seen so far (see the type's doc).
    pub fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }

    fn violation(&self, v: String) {
        self.violations.lock().unwrap().push(v);
    }
}

impl Landing for ManualLanding {
    fn endpoint(&self) -> (&str, u32) {
        ("127.0.0.1", 15000)
    }

    fn open_pull(&self, w: &PullWindow<'_>) -> kvrecv::rdma::RegionBases {
        let mut permits = self.permits.lock().unwrap();
        for r in w.requests {
            let held = permits.entry(r.req_id.to_string()).or_default();
            let table = self.ownership.get();
            for b in r.block_ids().iter().flatten() {
                if let Some(st) = table.and_then(|t| t.get(*b)) {
                    if st.owner_tag.is_some() && !held.iter().any(|(h, _)| h == b) {
                        held.push((*b, st));
                    }
                }
            }
        }
        [0x7e00_0000_0000 + (w.pull_id << 32)].into()
    }

    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        let id = r.req.req_id.to_string();
        let held = self.permits.lock().unwrap().remove(&id).unwrap_or_default();
        let table = self.ownership.get();
        for (b, granted) in held {
            let now = table.and_then(|t| t.get(b));
            if now != Some(granted) {
                self.violation(format!(
                    "{id}'s permit revoked after its block {b} was released \
                     (owned {granted:?} when granted, {now:?} at the revocation)"
                ));
            }
        }
        self.revoked.lock().unwrap().push(id);
        Revoked {
            revocation: if self.exact {
                Revocation::Exact
            } else {
                Revocation::NotExact
            },
            poisoned: 0,
            quiesced: None,
        }
    }

    fn fence(&self, peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        let (tx, rx) = oneshot::channel();
        self.fences.lock().unwrap().push((peers.to_vec(), tx));
        Box::pin(async move {
            rx.await
                .unwrap_or(Err(FenceError::Unavailable("dropped".into())))
        })
    }
}

pub struct Harness {
    pub coord: Coordinator,
    pub opened: UnboundedReceiver<OpenedPull>,
    pub events: UnboundedReceiver<KvEvent>,
    pub seen: Rc<RefCell<Vec<KvEvent>>>,
    pub landing: Arc<ManualLanding>,
}

pub struct Setup {
    pub p_tp: u32,
    pub p_pp: u32,
    pub d: DRank,
    pub policy: Policy,
    pub pull_timeout: Duration,
    pub quarantine_deadline: Duration,
    pub abort_grace: Duration,
    pub peer_retire_after: Duration,
    pub landing: ManualLanding,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            p_tp: 2,
            p_pp: 1,
            d: DRank::default(),
            policy: Policy::Settle,
            pull_timeout: Duration::from_secs(60),
            quarantine_deadline: Duration::from_secs(60),
            abort_grace: Duration::from_secs(60),
            peer_retire_after: Duration::from_secs(3600),
            landing: ManualLanding::exact(),
        }
    }
}

pub fn engine(tp: u32, pp: u32) -> EngineTopology {
    StaticTopology::grid("e0", tp, pp)
}

impl Harness {
    pub fn start(s: Setup) -> Harness {
        let (transport, opened) = ScriptedTransport::new();
        let (events_tx, events) = EventSink::channel();
        let landing = Arc::new(s.landing);
        let config = KvRecvConfig {
            policy: s.policy,
            pull_timeout: s.pull_timeout,
            quarantine_deadline: s.quarantine_deadline,
            abort_grace: s.abort_grace,
            peer_retire_after: s.peer_retire_after,
            // No restart backoff: a pull during one fails at once (issue: rediscovery), and
            // these tests send the next pull right after a restart.
            peer_backoff_base: Duration::ZERO,
            peer_backoff_max: Duration::ZERO,
            d_rank: s.d,
            layout: KvLayout::uniform(2, 64, 64),
            ..KvRecvConfig::default()
        };
        let coord = Coordinator::start(CoordinatorParts {
            config,
            topology: Rc::new(StaticTopology::new([engine(s.p_tp, s.p_pp)])),
            transport: Rc::new(transport),
            landing: landing.clone(),
            events: events_tx,
            builtin_pool: true,
        });
        if let Some(table) = coord.ownership() {
            let _ = landing.ownership.set(table);
        }
        Harness {
            coord,
            opened,
            events,
            seen: Default::default(),
            landing,
        }
    }

    pub async fn load(&self, reqs: Vec<KvRequest>) -> kvrecv::messages::LoadKvReply {
        self.coord
            .load_kv(LoadKv { requests: reqs })
            .await
            .expect("receiver alive")
    }

    /// The next pull any peer opened, in order.
    pub async fn next_pull(&mut self) -> OpenedPull {
        tokio::time::timeout(PATIENCE, self.opened.recv())
            .await
            .expect("a pull was opened")
            .expect("open")
    }

    /// `n` pulls, sorted by peer address.
    pub async fn pulls(&mut self, n: usize) -> Vec<OpenedPull> {
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(self.next_pull().await);
        }
        v.sort_by(|a, b| a.peer.cmp(&b.peer));
        v
    }

    /// Wait until an event matching `pred` has happened (already recorded, or arriving); returns
    /// it. Every event is recorded in `seen`.
    pub async fn wait_for(&mut self, what: &str, pred: impl Fn(&KvEvent) -> bool) -> KvEvent {
        self.check_landing_order();
        if let Some(ev) = self.seen.borrow().iter().find(|e| pred(e)) {
            return ev.clone();
        }
        let fut = async {
            loop {
                let ev = self.events.recv().await.expect("event channel open");
                self.record(ev.clone());
                if pred(&ev) {
                    return ev;
                }
            }
        };
        match tokio::time::timeout(PATIENCE, fut).await {
            Ok(ev) => ev,
            Err(_) => panic!(
                "timed out waiting for {what}; saw {:#?}",
                self.seen.borrow()
            ),
        }
    }

    pub fn count(&self, pred: impl Fn(&KvEvent) -> bool) -> usize {
        self.seen.borrow().iter().filter(|e| pred(e)).count()
    }

    /// Record whatever is already queued, without waiting.
    pub fn soak_events(&mut self) {
        while let Ok(ev) = self.events.try_recv() {
            self.record(ev);
        }
    }

    /// Record an event; a release is checked against the landing's live permits (the
    /// BlockManager emits it after it released the blocks).
    fn record(&self, ev: KvEvent) {
        if let KvEvent::Released { req_id, .. } = &ev {
            if self.landing.permit_live(req_id) {
                self.landing
                    .violation(format!("{req_id}'s blocks released with a live permit"));
            }
        }
        self.seen.borrow_mut().push(ev);
        self.check_landing_order();
    }

    /// Fail on the first violation of revoke-before-release the landing saw.
    pub fn check_landing_order(&self) {
        let v = self.landing.violations();
        assert!(v.is_empty(), "landing order violated: {v:?}");
    }

    /// `n` blocks from the built-in pool for request `id` (transfer id `t-{id}`, as [`req`]).
    pub async fn allocate(&self, id: &str, n: usize) -> Vec<u32> {
        self.coord
            .block_manager
            .send(Allocate {
                req_id: id.into(),
                owner_tag: owner_tag(&format!("t-{id}")),
                n,
            })
            .await
            .expect("block manager alive")
            .expect("blocks free")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.soak_events();
        }
    }
}

pub fn req(id: &str, blocks: &[u32]) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some("e0".into()),
        remote_bootstrap_addr: Some("http://127.0.0.1:8998".into()),
        block_ids: vec![blocks.to_vec()],
    }
}

pub fn is_completion(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::Completion { req_id, .. } if &**req_id == id)
}

pub fn is_first_failure(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::FirstFailure { req_id, .. } if &**req_id == id)
}

pub fn is_settled<'a>(peer: &'a PeerId, id: &'a str) -> impl Fn(&KvEvent) -> bool + 'a {
    move |e| matches!(e, KvEvent::Settled { peer: p, req_id, .. } if p == peer && &**req_id == id)
}

pub fn is_released(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::Released { req_id, .. } if &**req_id == id)
}
