//! A vLLM-compatible prefill engine simulator (bootstrap server, one ROUTER per worker, P's
//! reply semantics of PROTOCOL.md §2.6, fault knobs), used by tests, the benchmark and
//! `kvrecv prefill-sim`. Runs on any tokio runtime.

#![forbid(unsafe_code)]

pub mod bootstrap_server;
pub mod engine;
pub mod faults;
pub mod initiator;
pub mod layout_cache;
pub mod readiness;
pub mod te_writer;
pub mod worker;
pub mod writer;

pub use bootstrap_server::BootstrapServer;
pub use engine::{PrefillSim, SimConfig};
pub use faults::{Faults, Malformed};
pub use readiness::Readiness;
pub use worker::{LayoutStats, Worker, WorkerConfig, READINESS_TIMEOUT_MSG};
pub use writer::{KvWriter, NoopWriter, SharedWriter, WorkerRank, WriteJob};

/// Why the simulator could not start or act.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("zmq: {0}")]
    Zmq(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad simulator config: {0}")]
    Config(String),
    #[error("worker registration failed: {0}")]
    Register(String),
}
