//! Wiring: start the BlockManager and the Receiver on the current actix arbiter. Peers are
//! started lazily by the Receiver, each under its own `Supervisor`.

#![forbid(unsafe_code)]

use std::rc::Rc;
use std::sync::Arc;

use actix::{Actor, Addr};

use crate::config::KvRecvConfig;
use crate::messages::{LoadKv, LoadKvReply, LoadMetas, ReqId, StepOutput};
use crate::rdma::Landing;

use super::block_ledger::{take_step, BlockLedger};
use super::block_manager::BlockManager;
use super::block_pool::{BlockOwnership, BlockPool};
use super::event_sink::EventSink;
use super::live_set::SharedLiveSet;
use super::outbox::Outbox;
use super::receiver::Receiver;
use super::topology::TopologySource;
use super::transport::PeerTransport;

/// Everything a coordinator is made of.
pub struct CoordinatorParts {
    /// Timeouts, policy, layout and this worker's rank.
    pub config: KvRecvConfig,
    /// How P engines' peers are found (the HTTP bootstrap client in production).
    pub topology: Rc<dyn TopologySource>,
    /// The side channel to P's peers (ZMQ in production).
    pub transport: Rc<dyn PeerTransport>,
    /// The data plane: opens windows for pulls and fences uncertain peers.
    pub landing: Arc<dyn Landing>,
    /// Where events go (a channel, or nowhere).
    pub events: EventSink,
    /// Use kvrecv's built-in block pool (hosts without their own, the demo).
    pub builtin_pool: bool,
}

/// Running actors of one D worker.
#[derive(Clone)]
pub struct Coordinator {
    /// Takes `LoadKv`, `LoadMetas` and `Abort`.
    pub receiver: Addr<Receiver>,
    /// Takes `Drain`; owns the destination-block ledger.
    pub block_manager: Addr<BlockManager>,
    /// The built-in pool's ownership table, for the data plane's audit.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    ownership: Option<Arc<BlockOwnership>>,
    /// What the BlockManager has ready for the next drain (one for every clone: an `Outbox`'s
    /// own `clone` copies).
    outbox: Arc<Outbox>,
    /// The live set a drain hands finished requests over in (shared likewise).
    live: Arc<SharedLiveSet>,
    /// The most requests live at once (`KvRecvConfig::max_live_requests`): also the most a
    /// host may have queued with `KvRecv::submit` and not yet taken by the Receiver.
    pub(crate) max_live: usize,
    /// The data plane, closed and reopened by a pause and a resume (sleep mode).
    pub(crate) landing: Arc<dyn Landing>,
}

impl Coordinator {
    /// Start on the current arbiter (inside an actix `System`).
    pub fn start(parts: CoordinatorParts) -> Coordinator {
        let cfg = parts.config;
        let max_live = cfg.max_live_requests;
        let labels = crate::telemetry::Labels::for_config(&cfg);
        let pool = parts
            .builtin_pool
            .then(|| BlockPool::new(cfg.layout.num_blocks));
        let ownership = pool.as_ref().map(|p| p.ownership());
        let ledger =
            BlockLedger::new(cfg.quarantine_deadline, pool).with_max_live(cfg.max_live_requests);
        let outbox = Arc::new(ledger.outbox());
        let live = Arc::new(ledger.live_set());
        let block_manager = BlockManager::new(
            ledger,
            parts.landing.clone(),
            cfg.policy,
            parts.events.clone(),
        )
        .with_labels(labels.clone())
        .start();
        let landing = parts.landing.clone();
        let receiver = Receiver::new(
            cfg,
            parts.topology,
            parts.transport,
            parts.landing,
            block_manager.clone(),
            live.share(),
            parts.events,
        )
        .with_labels(labels)
        .start();
        Coordinator {
            receiver,
            block_manager,
            ownership,
            outbox,
            live,
            max_live,
            landing,
        }
    }

    /// The built-in pool's ownership table (what the repro's and this crate's tests' audits
    /// check writes against).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "cli"), allow(dead_code))] // the repro's, and the crate's tests'
    pub(crate) fn ownership(&self) -> Option<Arc<BlockOwnership>> {
        self.ownership.clone()
    }

    /// Whether admission is closed (sleep mode, DESIGN.md §7).
    pub fn is_paused(&self) -> bool {
        self.live.lock().is_paused()
    }

    /// Run `f` with the request that holds `block` of KV-cache `group` (if any) and whether
    /// admission is closed (a pause), under the live set's lock: no request is admitted (and
    /// so no landing permit opened), released, or paused while `f` runs.
    pub(crate) fn with_block_owner<R>(
        &self,
        group: u32,
        block: u32,
        f: impl FnOnce(Option<&ReqId>, bool) -> R,
    ) -> R {
        let live = self.live.lock();
        f(live.owner(group, block), live.is_paused())
    }

    /// Every request holding blocks now, with its blocks (per group, ascending).
    pub(crate) fn holdings(&self) -> Vec<(ReqId, Vec<u32>)> {
        self.live.lock().holdings()
    }

    /// Reopen admission after a resume.
    pub(crate) fn reopen_admission(&self) {
        self.live.lock().set_paused(false);
    }

    /// `load_kv`: hand a batch over. Rejected requests come back in the reply.
    pub async fn load_kv(&self, batch: LoadKv) -> Result<LoadKvReply, actix::MailboxError> {
        self.receiver.send(batch).await
    }

    /// [`Self::load_kv`] for requests the host read itself ([`LoadMetas`]).
    pub async fn load_metas(&self, batch: LoadMetas) -> Result<LoadKvReply, actix::MailboxError> {
        self.receiver.send(batch).await
    }

    /// The per-step drain: everything ready since the last one (failures never after their
    /// completion), taken where the BlockManager left it, without a message: the host waits for
    /// no other thread and wakes kvrecv's not at all (docs/PERFORMANCE.md, eighth and tenth
    /// rounds). The finished requests it hands over stop being live (a `load_kv` of their id
    /// is accepted again) before it returns. A drain that finds nothing yields to the runtime
    /// once before it returns, so that a host draining in a loop on the actors' own thread
    /// lets them run. Cancel-safe: what it takes it returns without awaiting (dropped at that
    /// yield, it had taken nothing).
    pub async fn drain(&self) -> Result<StepOutput, actix::MailboxError> {
        // Stopped: say so, as every other call does.
        if !self.block_manager.connected() {
            return Err(actix::MailboxError::Closed);
        }
        let out = take_step(&self.outbox, &self.live);
        if out.is_empty() {
            tokio::task::yield_now().await;
        }
        Ok(out)
    }
}
