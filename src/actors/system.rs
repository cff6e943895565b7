//! Wiring: start the BlockManager and the Receiver on the current actix arbiter. Peers are
//! started lazily by the Receiver, each under its own `Supervisor`.

use std::rc::Rc;
use std::sync::Arc;

use actix::{Actor, Addr};

use crate::config::KvRecvConfig;
use crate::messages::{DrainTo, Handed, LoadKv, LoadKvReply, LoadMetas, StepOutput, Undrained};
use crate::rdma::Landing;

use super::block_ledger::BlockLedger;
use super::block_manager::BlockManager;
use super::block_pool::{BlockOwnership, BlockPool};
use super::event_sink::EventSink;
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
    pub ownership: Option<Arc<BlockOwnership>>,
    /// One drain at a time (see [`Coordinator::drain`]).
    drains: Arc<tokio::sync::Mutex<()>>,
}

impl Coordinator {
    /// Start on the current arbiter (inside an actix `System`).
    pub fn start(parts: CoordinatorParts) -> Coordinator {
        let cfg = parts.config;
        let labels = crate::telemetry::Labels::for_config(&cfg);
        let pool = parts
            .builtin_pool
            .then(|| BlockPool::new(cfg.layout.num_blocks));
        let ownership = pool.as_ref().map(|p| p.ownership());
        let ledger =
            BlockLedger::new(cfg.quarantine_deadline, pool).with_max_live(cfg.max_live_requests);
        let block_manager = BlockManager::new(
            ledger,
            parts.landing.clone(),
            cfg.policy,
            parts.events.clone(),
        )
        .with_labels(labels.clone())
        .start();
        let receiver = Receiver::new(
            cfg,
            parts.topology,
            parts.transport,
            parts.landing,
            block_manager.clone(),
            parts.events,
        )
        .with_labels(labels)
        .start();
        Coordinator {
            receiver,
            block_manager,
            ownership,
            drains: Arc::default(),
        }
    }

    /// `load_kv`: hand a batch over. Rejected requests come back in the reply.
    pub async fn load_kv(&self, batch: LoadKv) -> Result<LoadKvReply, actix::MailboxError> {
        self.receiver.send(batch).await
    }

    /// [`Self::load_kv`] for requests the host read itself ([`LoadMetas`]).
    pub async fn load_metas(&self, batch: LoadMetas) -> Result<LoadKvReply, actix::MailboxError> {
        self.receiver.send(batch).await
    }

    /// The per-step drain. Cancel-safe: a drain dropped before it returned (a `select!` branch
    /// that lost, a `timeout`) hands nothing over; what it took goes back to the ledger, ahead
    /// of anything newer, for the next drain. Drains run one at a time, so that a put-back is
    /// in the ledger before any later drain takes from it (a failure signal then never reaches
    /// the host after its request's completion): a second drain waits until the first
    /// returned or was dropped, so do not hold one pending while awaiting another.
    pub async fn drain(&self) -> Result<StepOutput, actix::MailboxError> {
        // Stopped: say so at once, without waiting for a turn a drain caught by the stop may
        // hold.
        if !self.block_manager.connected() {
            return Err(actix::MailboxError::Closed);
        }
        let turn = self.drains.clone().lock_owned().await;
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Not `send`: its reply would be lost with a dropped future. A closed mailbox drops the
        // message and with it `tx`: the receive below then fails.
        self.block_manager.do_send(DrainTo(tx));
        PendingDrain {
            reply: rx,
            block_manager: self.block_manager.clone(),
            done: false,
            _turn: turn,
        }
        .await
    }
}

/// A drain's reply on its way; dropped unread, it gives the output back (see
/// [`Coordinator::drain`]).
struct PendingDrain {
    reply: tokio::sync::oneshot::Receiver<StepOutput>,
    block_manager: Addr<BlockManager>,
    done: bool,
    /// Released after `drop` sent any put-back (fields drop after `Drop::drop`).
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

impl std::future::Future for PendingDrain {
    type Output = Result<StepOutput, actix::MailboxError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let r = std::task::ready!(std::pin::Pin::new(&mut self.reply).poll(cx));
        self.done = true;
        if let Ok(out) = &r {
            // The host has it: its finished ids may be loaded again (before this message
            // they stayed live, so a load of one was refused while the host might not have
            // read the drain). Sent before the turn is released.
            if !out.finished_recving.is_empty() {
                self.block_manager
                    .do_send(Handed(out.finished_recving.clone()));
            }
        }
        std::task::Poll::Ready(r.map_err(|_| actix::MailboxError::Closed))
    }
}

impl Drop for PendingDrain {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // After `close` the BlockManager's send fails and it puts the output back itself; a
        // reply sent before it is still here, and goes back by message.
        self.reply.close();
        if let Ok(out) = self.reply.try_recv() {
            if !out.is_empty() {
                self.block_manager.do_send(Undrained(out));
            }
        }
    }
}
