//! A vLLM-compatible prefill engine simulator (bootstrap server, one ROUTER per worker, P's
//! reply semantics of PROTOCOL.md §2.6, fault knobs), used by tests, the benchmark and
//! `kvrecv prefill-sim`. Runs on any tokio runtime.

#![forbid(unsafe_code)]

internal_mod!(bootstrap_server);
internal_mod!(engine);
internal_mod!(faults);
internal_mod!(initiator);
internal_mod!(layout_cache);
internal_mod!(readiness);
internal_mod!(te_writer);
internal_mod!(worker);
internal_mod!(writer);

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
