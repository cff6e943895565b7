//! Host -> BlockManager requests about the built-in block pool and the ledger.

#![forbid(unsafe_code)]

use actix::Message;

use thiserror::Error;

use super::ids::ReqId;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub enum PoolError {
    #[error("pool exhausted: {wanted} blocks wanted, {free} free")]
    Exhausted { wanted: usize, free: usize },
    #[error("request {0} already holds blocks")]
    AlreadyAllocated(ReqId),
}

/// Take `n` destination blocks for a request from the built-in pool.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Vec<u32>, PoolError>")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Allocate {
    pub req_id: ReqId,
    /// The writer-visible owner tag (`block_ownership::owner_tag(transfer_id)`), checked by the audit.
    pub owner_tag: u32,
    pub n: usize,
}

/// Give back blocks of a request that was never loaded (the host changed its mind).
#[derive(Debug, Clone, Message)]
#[rtype(result = "Vec<u32>")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Free {
    pub req_id: ReqId,
}

/// A snapshot of the ledger, for operators and tests.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "LedgerStats")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct GetLedgerStats;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, actix::MessageResponse)]
/// The block ledger's counts ([`Stats::ledger`](crate::Stats::ledger)).
pub struct LedgerStats {
    /// Requests whose blocks wait in quarantine (a peer may still write into them).
    pub quarantined_requests: usize,
    /// Blocks those requests hold.
    pub quarantined_blocks: usize,
    /// `None` without a built-in pool.
    pub free_blocks: Option<usize>,
}
