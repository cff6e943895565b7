//! Shared harness: a kvrecv coordinator (ZmqTransport + HTTP bootstrap client + StaticLanding)
//! in the test's actix System, talking over loopback to an in-process prefill simulator.
#![allow(dead_code)]

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::{Coordinator, CoordinatorParts, EventSink};
use kvrecv::config::KvRecvConfig;
use kvrecv::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, LoadKv, Outcome, PeerId, SettleOutcome};
use kvrecv::rdma::StaticLanding;
use tokio::sync::mpsc::UnboundedReceiver;

/// Safety net only: every wait is on an event; this bounds a broken test.
pub const SAFETY: Duration = Duration::from_secs(30);

pub fn config(pull_timeout: Duration) -> KvRecvConfig {
    KvRecvConfig {
        pull_timeout,
        peer_backoff_base: Duration::from_millis(10),
        peer_backoff_max: Duration::from_millis(50),
        quarantine_deadline: Duration::from_secs(60),
        layout: KvLayout::uniform(2, 4096, 64),
        ..KvRecvConfig::default()
    }
}

pub struct Harness {
    pub coord: Coordinator,
    pub events: UnboundedReceiver<KvEvent>,
    /// Every event seen so far (waits consume from the channel and record here).
    pub seen: Vec<KvEvent>,
}

impl Harness {
    /// Start with the default transport; call inside an actix System.
    pub fn start(cfg: KvRecvConfig) -> Harness {
        Self::start_with(cfg, ZmqTransportConfig::default())
    }

    pub fn start_with(cfg: KvRecvConfig, zmq: ZmqTransportConfig) -> Harness {
        let (events, rx) = EventSink::channel();
        let coord = Coordinator::start(CoordinatorParts {
            config: cfg,
            topology: Rc::new(HttpTopology::new(BootstrapConfig::default())),
            transport: Rc::new(ZmqTransport::new(zmq)),
            landing: Arc::new(StaticLanding::new(
                "127.0.0.1",
                15000,
                vec![0x7e00_0000_0000, 0x7f00_0000_0000],
            )),
            events,
            builtin_pool: false,
        });
        Harness {
            coord,
            events: rx,
            seen: vec![],
        }
    }

    pub async fn load(&self, requests: Vec<KvRequest>) {
        let reply = self
            .coord
            .load_kv(LoadKv { requests })
            .await
            .expect("receiver alive");
        assert!(reply.rejected.is_empty(), "rejected: {:?}", reply.rejected);
    }

    /// Wait for the first event matching `pred`.
    pub async fn wait_for(&mut self, what: &str, pred: impl Fn(&KvEvent) -> bool) -> KvEvent {
        if let Some(e) = self.seen.iter().find(|e| pred(e)) {
            return e.clone();
        }
        let fut = async {
            loop {
                let ev = self.events.recv().await.expect("event channel open");
                self.seen.push(ev.clone());
                if pred(&ev) {
                    return ev;
                }
            }
        };
        match tokio::time::timeout(SAFETY, fut).await {
            Ok(e) => e,
            Err(_) => panic!("no {what} event; seen: {:#?}", self.seen),
        }
    }

    /// The request's completion: (outcome, uncertain peers).
    pub async fn completion(&mut self, req: &str) -> (Outcome, Vec<PeerId>) {
        let ev = self
            .wait_for(
                &format!("completion of {req}"),
                |e| matches!(e, KvEvent::Completion { req_id, .. } if &**req_id == req),
            )
            .await;
        match ev {
            KvEvent::Completion {
                outcome,
                uncertain_peers,
                unsettled_peers,
                ..
            } => {
                assert!(
                    unsettled_peers.is_empty(),
                    "policy settle never completes with unsettled peers"
                );
                (outcome, uncertain_peers)
            }
            _ => unreachable!(),
        }
    }

    /// The settle of `req` by `peer`.
    pub async fn settle(&mut self, req: &str, peer: &str) -> SettleOutcome {
        let ev = self
            .wait_for(&format!("settle of {req} by {peer}"), |e| {
                matches!(e, KvEvent::Settled { req_id, peer: p, .. } if &**req_id == req && p.addr() == peer)
            })
            .await;
        match ev {
            KvEvent::Settled { outcome, .. } => outcome,
            _ => unreachable!(),
        }
    }

    pub async fn restarted(&mut self, peer: &str) {
        self.wait_for(
            &format!("restart of {peer}"),
            |e| matches!(e, KvEvent::PeerRestarted { peer: p, .. } if p.addr() == peer),
        )
        .await;
    }

    /// No completion of `req` so far, neither drained nor announced. The drain is a round trip
    /// through the BlockManager: what the aggregator had handled when it was sent was published
    /// first (completions go to the BlockManager before their events are emitted), so a
    /// premature completion is in the drain or among the events recorded after it.
    pub async fn assert_no_completion(&mut self, req: &str, why: &str) {
        let step = self.coord.drain().await.expect("block manager alive");
        assert!(
            !step.finished_recving.iter().any(|r| &**r == req),
            "{req} drained {why}"
        );
        while let Ok(ev) = self.events.try_recv() {
            self.seen.push(ev);
        }
        assert_eq!(self.completions_seen(req), 0, "{req} completed {why}");
    }

    /// Number of completions seen for `req` so far.
    pub fn completions_seen(&self, req: &str) -> usize {
        self.seen
            .iter()
            .filter(|e| matches!(e, KvEvent::Completion { req_id, .. } if &**req_id == req))
            .count()
    }
}

/// One request of `engine` at `bootstrap`, blocks `blocks` in the single group.
pub fn req(id: &str, tid: &str, engine: &str, bootstrap: &str, blocks: &[u32]) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(tid.into()),
        remote_engine_id: Some(engine.into()),
        remote_bootstrap_addr: Some(bootstrap.into()),
        block_ids: if blocks.is_empty() {
            vec![]
        } else {
            vec![blocks.to_vec()]
        },
    }
}

pub fn is_uncertain(s: &SettleOutcome) -> bool {
    matches!(s, SettleOutcome::Uncertain { .. })
}

pub fn reason(s: &SettleOutcome) -> String {
    s.reason().unwrap_or_default().to_owned()
}

/// P's writer: holds `held`'s write for ever, telling the test it has it; writes nothing else.
pub struct HoldingWriter {
    /// The request whose write is held.
    pub held: &'static str,
    /// Told once P has that write.
    pub has_it: tokio::sync::mpsc::UnboundedSender<()>,
}

impl kvrecv::sim::KvWriter for HoldingWriter {
    fn write(
        &self,
        job: kvrecv::sim::WriteJob,
    ) -> futures::future::BoxFuture<'static, Result<(), String>> {
        if job.req_ids.iter().any(|r| r == self.held) {
            let _ = self.has_it.send(());
            return Box::pin(std::future::pending());
        }
        Box::pin(async { Ok(()) })
    }
}
