//! Reading a block of host memory back, safely: the bytes of one block of one KV-cache group,
//! from every layout region of that group, copied out only while no request holds the block
//! (no writer can reach it: writes need a landing permit, and permits go only to admitted
//! requests, which the copy holds off).

#![forbid(unsafe_code)]

use thiserror::Error;

use crate::layout::KvLayout;
use crate::messages::ReqId;
use crate::rdma::memory::{HostMemory, MemoryError};

/// Why [`KvRecv::read_block`](crate::KvRecv::read_block) read nothing.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BlockReadError {
    /// The worker was not started on host memory ([`KvRecvBuilder::host_memory`](crate::KvRecvBuilder::host_memory)):
    /// kvrecv's own allocation, device memory, or parts of the host's
    /// ([`KvRecv::from_parts`](crate::KvRecv::from_parts)).
    #[error("no host memory to read: the worker was not started with KvRecvBuilder::host_memory")]
    NoHostMemory,
    /// No such block in the layout.
    #[error(
        "group {group} block {block} is not in the layout ({groups} groups of {blocks} blocks)"
    )]
    OutOfRange {
        /// The KV-cache group asked for.
        group: u32,
        /// The block asked for.
        block: u32,
        /// Groups in the layout.
        groups: u32,
        /// Blocks per group.
        blocks: u32,
    },
    /// A request holds the block (in flight, or completed and not yet released: a peer may
    /// still write it). Read it once it is in `finished_recving`.
    #[error(
        "group {group} block {block} is held by request {req_id}: not the host's until released"
    )]
    Held {
        /// The KV-cache group asked for.
        group: u32,
        /// The block asked for.
        block: u32,
        /// The request holding it.
        req_id: ReqId,
    },
    /// The memory was handed over as pointers ([`HostRegion::new`](crate::HostRegion::new)) and the worker is
    /// paused or shut down: the host may have released it (its contract ends there), so
    /// kvrecv reads none of it. Memory kvrecv owns ([`HostMemory::owned`](crate::HostMemory::owned)) is read
    /// then too.
    #[error("host memory given by pointer is not read while the worker is paused or shut down")]
    NotValid,
    /// A region shorter than the layout says (refused at start, so never seen).
    #[error("{0}")]
    Memory(#[from] MemoryError),
}

/// `block` of `group` as bytes: one `Vec` per layout region of the group, in layout order,
/// each the block's whole stride (`block_len`: its KV bytes, `kv_block_len`, first). The
/// caller makes sure no writer can reach the block while this runs.
pub(crate) fn copy_block(
    memory: &HostMemory,
    layout: &KvLayout,
    group: u32,
    block: u32,
) -> Result<Vec<Vec<u8>>, BlockReadError> {
    check_in_range(layout, group, block)?;
    let mut out = Vec::new();
    for (region, r) in memory.regions().iter().zip(&layout.regions) {
        if r.group_index != group {
            continue;
        }
        let stride = usize::try_from(r.block_len).map_err(|_| MemoryError::Alloc(r.block_len))?;
        let mut bytes = vec![0u8; stride];
        region.copy_out(stride * block as usize, &mut bytes)?;
        out.push(bytes);
    }
    Ok(out)
}

/// A block the layout has, or why not.
pub(crate) fn check_in_range(
    layout: &KvLayout,
    group: u32,
    block: u32,
) -> Result<(), BlockReadError> {
    if group >= layout.num_groups || block >= layout.num_blocks {
        return Err(BlockReadError::OutOfRange {
            group,
            block,
            groups: layout.num_groups,
            blocks: layout.num_blocks,
        });
    }
    Ok(())
}
