//! Shared test harness: a coordinator on scripted transports, a controllable landing, and
//! helpers that await events instead of sleeping.
#![allow(dead_code)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::LocalBoxFuture;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::oneshot;

use kvrecv::actors::topology::{DRank, EngineTopology};
use kvrecv::actors::{
    Coordinator, CoordinatorParts, EventSink, OpenedPull, ScriptedTransport, StaticTopology,
};
use kvrecv::config::{KvRecvConfig, Policy};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, LoadKv, PeerId};
use kvrecv::rdma::{FenceError, Landing, PullWindow, Revocation, RevokeRequest, Revoked};

/// Safety net only: every wait below ends on an event long before this.
pub const PATIENCE: Duration = Duration::from_secs(10);

type PendingFence = (Vec<PeerId>, oneshot::Sender<Result<(), FenceError>>);

/// A landing whose revocation result is chosen by the test and whose fences complete when the
/// test says so.
#[derive(Default)]
pub struct ManualLanding {
    pub exact: bool,
    pub revoked: Mutex<Vec<String>>,
    fences: Mutex<Vec<PendingFence>>,
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
}

impl Landing for ManualLanding {
    fn endpoint(&self) -> (&str, u32) {
        ("127.0.0.1", 15000)
    }

    fn open_pull(&self, w: &PullWindow<'_>) -> kvrecv::rdma::RegionBases {
        [0x7e00_0000_0000 + (w.pull_id << 32)].into()
    }

    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        self.revoked.lock().unwrap().push(r.req.req_id.to_string());
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
        if let Some(ev) = self.seen.borrow().iter().find(|e| pred(e)) {
            return ev.clone();
        }
        let fut = async {
            loop {
                let ev = self.events.recv().await.expect("event channel open");
                self.seen.borrow_mut().push(ev.clone());
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
            self.seen.borrow_mut().push(ev);
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
