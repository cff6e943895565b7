//! A simulated vLLM prefill engine (one DP rank): a bootstrap server, `tp x pp` workers that
//! register through `POST /register` like P's, shared readiness, per-worker faults.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::{Method, StatusCode};

use crate::control::http::{request, BaseUrl};
use crate::messages::bootstrap::RegisterWorker;

use super::bootstrap_server::BootstrapServer;
use super::faults::Faults;
use super::readiness::Readiness;
use super::worker::{Worker, WorkerConfig, WorkerShared};
use super::writer::{NoopWriter, SharedWriter, WorkerRank};
use super::SimError;

/// How to build a simulated engine.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub engine_id: String,
    pub dp_rank: u32,
    pub tp_size: u32,
    pub pp_size: u32,
    /// Interface the ROUTERs and the bootstrap server bind.
    pub host: String,
    /// Bootstrap port (0: any).
    pub bootstrap_port: u16,
    /// Pulls served at once per worker (P: 20).
    pub serving_tasks: usize,
    pub readiness_timeout: Duration,
    /// Every transfer id is ready at once (otherwise the driver marks them).
    pub ready_immediately: bool,
    /// Faults of every worker at start.
    pub faults: Faults,
    pub seed: u64,
    pub num_groups: Option<usize>,
    pub layer_names: Option<Vec<String>>,
    /// Register the workers (false: the test registers what it wants).
    pub register: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            engine_id: "prefill-0".into(),
            dp_rank: 0,
            tp_size: 1,
            pp_size: 1,
            host: "127.0.0.1".into(),
            bootstrap_port: 0,
            serving_tasks: 20,
            readiness_timeout: Duration::from_secs(480),
            ready_immediately: true,
            faults: Faults::default(),
            seed: 0,
            num_groups: None,
            layer_names: None,
            register: true,
        }
    }
}

/// A running simulated engine. Dropping it stops everything.
pub struct PrefillSim {
    cfg: SimConfig,
    bootstrap: BootstrapServer,
    /// Index `tp * pp_size + pp`.
    workers: Vec<Worker>,
    readiness: Arc<Readiness>,
}

impl PrefillSim {
    /// Start with the no-op writer.
    pub async fn start(cfg: SimConfig) -> Result<Self, SimError> {
        Self::start_with_writer(cfg, Arc::new(NoopWriter)).await
    }

    /// Start on the current tokio runtime; `writer` does each subset's write.
    pub async fn start_with_writer(cfg: SimConfig, writer: SharedWriter) -> Result<Self, SimError> {
        let ip: std::net::IpAddr = cfg
            .host
            .parse()
            .map_err(|e| SimError::Config(format!("host: {e}")))?;
        let bootstrap = BootstrapServer::start(SocketAddr::new(ip, cfg.bootstrap_port)).await?;
        let readiness = Arc::new(Readiness::new(cfg.ready_immediately));
        let ctx = zmq::Context::new();
        let mut workers = Vec::new();
        for tp in 0..cfg.tp_size {
            for pp in 0..cfg.pp_size {
                let rank = WorkerRank {
                    engine_id: cfg.engine_id.clone(),
                    dp_rank: cfg.dp_rank,
                    tp_rank: tp,
                    pp_rank: pp,
                    tp_size: cfg.tp_size,
                    pp_size: cfg.pp_size,
                };
                let wcfg = WorkerConfig {
                    rank,
                    serving_tasks: cfg.serving_tasks,
                    readiness_timeout: cfg.readiness_timeout,
                    num_groups: cfg.num_groups,
                    layer_names: cfg.layer_names.clone(),
                };
                let seed = cfg.seed.wrapping_add(u64::from(tp * cfg.pp_size + pp));
                let shared = Arc::new(WorkerShared::new(
                    wcfg,
                    cfg.faults.clone(),
                    seed,
                    readiness.clone(),
                    writer.clone(),
                    ctx.clone(),
                ));
                workers.push(Worker::start(shared, &format!("tcp://{}:0", cfg.host)).await?);
            }
        }
        let sim = PrefillSim {
            cfg,
            bootstrap,
            workers,
            readiness,
        };
        if sim.cfg.register {
            for w in &sim.workers {
                sim.register(w.rank(), w.addr()).await?;
            }
        }
        Ok(sim)
    }

    /// `POST /register` as a P worker does.
    pub async fn register(&self, rank: &WorkerRank, addr: &str) -> Result<(), SimError> {
        let body = serde_json::to_vec(&RegisterWorker {
            engine_id: rank.engine_id.clone(),
            dp_rank: rank.dp_rank,
            tp_rank: rank.tp_rank,
            pp_rank: rank.pp_rank,
            addr: addr.to_owned(),
        })
        .map_err(|e| SimError::Config(e.to_string()))?;
        let base =
            BaseUrl::parse(&self.bootstrap.url()).map_err(|e| SimError::Register(e.to_string()))?;
        let (status, body) = request(
            Method::POST,
            &base,
            "/register",
            Some(body),
            Duration::from_secs(5),
            1 << 20,
        )
        .await
        .map_err(|e| SimError::Register(e.to_string()))?;
        if status != StatusCode::OK {
            return Err(SimError::Register(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body)
            )));
        }
        Ok(())
    }

    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    pub fn engine_id(&self) -> &str {
        &self.cfg.engine_id
    }

    /// `http://ip:port`: D's `remote_bootstrap_addr`.
    pub fn bootstrap_url(&self) -> String {
        self.bootstrap.url()
    }

    pub fn bootstrap(&self) -> &BootstrapServer {
        &self.bootstrap
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    fn index(&self, tp: u32, pp: u32) -> usize {
        (tp * self.cfg.pp_size + pp) as usize
    }

    /// Worker `(tp, pp)`. Panics on a rank outside the engine (a test bug).
    pub fn worker(&self, tp: u32, pp: u32) -> &Worker {
        &self.workers[self.index(tp, pp)]
    }

    pub fn set_faults(&self, tp: u32, pp: u32, f: Faults) {
        self.worker(tp, pp).set_faults(f);
    }

    /// Mark a transfer id prefilled on every worker.
    pub fn mark_ready(&self, transfer_id: &str) {
        self.readiness.mark(transfer_id);
    }

    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Kill worker `(tp, pp)`: its ROUTER closes, its pulls are abandoned.
    pub async fn crash_worker(&mut self, tp: u32, pp: u32) {
        let i = self.index(tp, pp);
        self.workers[i].stop().await;
    }

    /// Bring worker `(tp, pp)` back on its address (the registration stays valid).
    pub async fn restart_worker(&mut self, tp: u32, pp: u32) -> Result<(), SimError> {
        let i = self.index(tp, pp);
        self.workers[i].restart().await
    }

    /// Kill the whole engine: every worker's ROUTER and the bootstrap server, which runs inside
    /// P's TP0/PP0 worker and loses its registry with it.
    pub async fn crash_engine(&mut self) {
        for w in &mut self.workers {
            w.stop().await;
        }
        self.bootstrap.stop().await;
    }

    /// Bring a crashed engine back as a restarted P does: the bootstrap server on the same
    /// address (D's `remote_bootstrap_addr` stays valid), every worker on a NEW port, registered
    /// again. Returns the new side-channel addresses, in worker order.
    pub async fn restart_engine_on_new_ports(&mut self) -> Result<Vec<String>, SimError> {
        for w in &mut self.workers {
            w.stop().await;
        }
        self.bootstrap.restart().await?;
        let host = self.cfg.host.clone();
        for w in &mut self.workers {
            w.restart_on_new_port(&host).await?;
        }
        let mut addrs = Vec::with_capacity(self.workers.len());
        for w in &self.workers {
            self.register(w.rank(), w.addr()).await?;
            addrs.push(w.addr().to_owned());
        }
        Ok(addrs)
    }

    /// Pulls received by all workers.
    pub fn pulls_received(&self) -> usize {
        self.workers.iter().map(Worker::pulls_received).sum()
    }
}
