//! The simulator's write step, behind a trait so the data plane can plug in a real writer (a
//! Mooncake TE initiator writing into D's TCP target). The default writes nothing.

#![forbid(unsafe_code)]

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::messages::MooncakeXferMetadata;

/// Which P worker is writing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRank {
    pub engine_id: String,
    pub dp_rank: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub tp_size: u32,
    pub pp_size: u32,
}

/// One ready subset of a pull: P's single `batch_transfer_sync_write` for it.
#[derive(Debug, Clone)]
pub struct WriteJob {
    pub rank: WorkerRank,
    /// D's decoded metadata (host, handshake port, advertised bases, block lengths, layers).
    pub metadata: Arc<MooncakeXferMetadata>,
    /// D request ids of the subset whose blocks are written (each is a key of
    /// `metadata.req_blocks`; requests without blocks are not listed).
    pub req_ids: Vec<String>,
}

/// Writes a subset's KV bytes into D. An `Err` moves the whole subset to `err_reqs` with the
/// message (vLLM: "Mooncake transfer engine returned N").
pub trait KvWriter: Send + Sync + 'static {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>>;
}

/// Writes nothing and succeeds (control-plane tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopWriter;

impl KvWriter for NoopWriter {
    fn write(&self, _job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

/// A shared writer.
pub type SharedWriter = Arc<dyn KvWriter>;
