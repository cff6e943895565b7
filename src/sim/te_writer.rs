//! A [`KvWriter`] that writes real, audit-stamped bytes into D's TCP target with kvrecv's Rust
//! Mooncake TE initiator, at the addresses a vLLM prefill worker would compute (PROTOCOL.md
//! §2.3): D region base + block id x D `block_len`, plus this P rank's head-slice offset when
//! several P TP ranks fill one D block.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::Mutex;

use crate::block_ownership::owner_tag;
use crate::messages::MooncakeXferMetadata;
use crate::rdma::audit::stamp_write;
use crate::sim::initiator::{InitiatorConfig, TeInitiator};

use super::writer::{KvWriter, WorkerRank, WriteJob};

/// Counters of everything a [`TeWriter`] wrote.
#[derive(Debug, Default)]
pub struct TeWriterStats {
    pub writes: AtomicU64,
    pub bytes: AtomicU64,
    pub failed_writes: AtomicU64,
    /// Requests whose every copy landed (one per request and job: a P rank's share of it).
    pub requests: AtomicU64,
}

/// Writes through one initiator per D segment (descriptor fetched once, lanes kept open).
pub struct TeWriter {
    cfg: InitiatorConfig,
    segments: Arc<Mutex<HashMap<SocketAddr, Arc<TeInitiator>>>>,
    stats: Arc<TeWriterStats>,
}

impl TeWriter {
    pub fn new(cfg: InitiatorConfig) -> Self {
        TeWriter {
            cfg,
            segments: Arc::default(),
            stats: Arc::default(),
        }
    }

    pub fn stats(&self) -> Arc<TeWriterStats> {
        self.stats.clone()
    }
}

/// One copy P would issue: destination address, length, where it falls in its region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copy {
    pub addr: u64,
    pub len: u64,
    /// Byte offset inside the region (for the audit stamp).
    pub region_offset: u64,
    pub block_len: u64,
    pub owner_tag: u32,
}

/// The most bytes one copy may carry (a block slice of one region: real ones are KBs to MBs).
/// The simulator builds every payload before writing, so a D's metadata must not make it
/// allocate without bound: 2^40-byte blocks grew it by GBs a second, 2^63 panicked.
pub const MAX_COPY_BYTES: u64 = 64 << 20;
/// The most bytes one pull may make the simulator write (the payloads it allocates).
pub const MAX_PULL_BYTES: u64 = 1 << 30;
/// The most copies one pull may make (each costs its plan and payload's bookkeeping, ~100 B,
/// whatever its length: 2^30 one-byte slices are under the byte cap).
pub const MAX_PULL_COPIES: usize = 1 << 20;

/// The copies `rank` makes for `req_ids` (one per block, region and head slice), as P computes
/// them from D's metadata. Regions belong to this P PP stage when D lists the layer and the
/// layer falls in the stage's share of the layers.
pub fn plan_copies(
    md: &MooncakeXferMetadata,
    rank: &WorkerRank,
    req_ids: &[String],
) -> Result<Vec<Copy>, String> {
    let n = md.kv_caches_base_addr.len();
    if md.block_lens.len() != n || md.kv_block_lens.len() != n {
        return Err("region arrays of different lengths".into());
    }
    let d_tp = md.remote_tp_size.max(1);
    // P TP > D TP: each P rank writes its head slice of every D block.
    let (slices, slice) = if rank.tp_size > d_tp && rank.tp_size % d_tp == 0 {
        let r = rank.tp_size / d_tp;
        (u64::from(r), u64::from(rank.tp_rank % r))
    } else {
        (1, 0)
    };
    let layers = md
        .registered_layer_indices
        .iter()
        .copied()
        .max()
        .map_or(n as u32, |m| m + 1)
        .max(1);
    let mine = |i: usize| -> bool {
        if rank.pp_size <= 1 || md.remote_pp_size == rank.pp_size {
            return true;
        }
        let layer = md
            .registered_layer_indices
            .get(i)
            .copied()
            .unwrap_or(i as u32);
        layer * rank.pp_size / layers == rank.pp_rank
    };
    let mut out = Vec::new();
    let mut total = 0u64;
    for id in req_ids {
        let Some((transfer_id, groups)) = md.req_blocks.get(id) else {
            continue;
        };
        let tag = owner_tag(transfer_id);
        for i in (0..n).filter(|&i| mine(i)) {
            let g = md.registered_group_indices.get(i).copied().unwrap_or(0) as usize;
            let Some(blocks) = groups.get(g).or_else(|| groups.first()) else {
                continue;
            };
            let (base, block_len, kv_len) = (
                md.kv_caches_base_addr[i],
                md.block_lens[i],
                md.kv_block_lens[i],
            );
            let len = kv_len / slices;
            if len == 0 {
                return Err(format!(
                    "region {i}: {kv_len} bytes per block cannot be split {slices} ways"
                ));
            }
            if len > MAX_COPY_BYTES {
                return Err(format!(
                    "region {i}: {len} bytes per block slice, over the simulator's {MAX_COPY_BYTES}"
                ));
            }
            for &b in blocks {
                total = total.saturating_add(len);
                if total > MAX_PULL_BYTES || out.len() >= MAX_PULL_COPIES {
                    return Err(format!(
                        "the pull asks for over {MAX_PULL_BYTES} bytes or {MAX_PULL_COPIES} \
                         copies, the simulator's most"
                    ));
                }
                let region_offset = b
                    .checked_mul(block_len)
                    .and_then(|o| o.checked_add(slice * len))
                    .ok_or("block offset overflows")?;
                let addr = base.checked_add(region_offset).ok_or("address overflows")?;
                out.push(Copy {
                    addr,
                    len,
                    region_offset,
                    block_len,
                    owner_tag: tag,
                });
            }
        }
    }
    Ok(out)
}

impl KvWriter for TeWriter {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let (cfg, segments, stats) = (self.cfg.clone(), self.segments.clone(), self.stats.clone());
        Box::pin(async move {
            let copies = plan_copies(&job.metadata, &job.rank, &job.req_ids)?;
            let target = format!(
                "{}:{}",
                job.metadata.remote_hostname, job.metadata.remote_port
            );
            let addr = tokio::net::lookup_host(&target)
                .await
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| format!("cannot resolve D segment {target}"))?;
            let init = {
                let mut seg = segments.lock().await;
                match seg.get(&addr) {
                    Some(i) => i.clone(),
                    None => {
                        let i = Arc::new(
                            TeInitiator::connect(addr, cfg)
                                .await
                                .map_err(|e| e.to_string())?,
                        );
                        seg.insert(addr, i.clone());
                        i
                    }
                }
            };
            // Payload: a recognisable fill, stamped at every block slice for the audit.
            let payloads: Vec<Vec<u8>> = copies
                .iter()
                .map(|c| {
                    let mut p = vec![(c.owner_tag & 0xff) as u8; c.len as usize];
                    stamp_write(&mut p, c.region_offset, c.block_len, c.owner_tag, |_| 0);
                    p
                })
                .collect();
            let writes: Vec<(u64, &[u8])> = copies
                .iter()
                .zip(&payloads)
                .map(|(c, p)| (c.addr, p.as_slice()))
                .collect();
            let results = init.write_batch(&writes).await;
            let failed = results.iter().filter(|r| r.is_err()).count() as u64;
            stats
                .writes
                .fetch_add(writes.len() as u64 - failed, Ordering::Relaxed);
            stats.failed_writes.fetch_add(failed, Ordering::Relaxed);
            stats.bytes.fetch_add(
                results
                    .iter()
                    .zip(&copies)
                    .filter(|(r, _)| r.is_ok())
                    .map(|(_, c)| c.len)
                    .sum(),
                Ordering::Relaxed,
            );
            if failed == 0 {
                stats
                    .requests
                    .fetch_add(job.req_ids.len() as u64, Ordering::Relaxed);
            }
            if failed > 0 {
                // What vLLM reports when batch_transfer_sync_write fails.
                return Err("Mooncake transfer engine returned -1".into());
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(d_tp: u32) -> MooncakeXferMetadata {
        let mut m = MooncakeXferMetadata::minimal("127.0.0.1", 1, d_tp, 0);
        m.req_blocks
            .insert("r".into(), ("t".into(), vec![vec![2, 5]]));
        m.kv_caches_base_addr = vec![0x1000_0000, 0x2000_0000];
        m.block_lens = vec![1024, 1024];
        m.kv_block_lens = vec![1024, 1024];
        m.registered_layer_indices = vec![0, 1];
        m.registered_group_indices = vec![0, 0];
        m
    }

    fn rank(tp_rank: u32, tp_size: u32, pp_rank: u32, pp_size: u32) -> WorkerRank {
        WorkerRank {
            engine_id: "e".into(),
            dp_rank: 0,
            tp_rank,
            pp_rank,
            tp_size,
            pp_size,
        }
    }

    #[test]
    fn tp2_to_tp1_ranks_write_disjoint_halves_of_the_same_blocks() {
        let a = plan_copies(&md(1), &rank(0, 2, 0, 1), &["r".into()]).unwrap();
        let b = plan_copies(&md(1), &rank(1, 2, 0, 1), &["r".into()]).unwrap();
        assert_eq!(a.len(), 4);
        assert_eq!(a[0].addr, 0x1000_0000 + 2 * 1024);
        assert_eq!(b[0].addr, 0x1000_0000 + 2 * 1024 + 512);
        assert!(a
            .iter()
            .chain(&b)
            .all(|c| c.len == 512 && c.owner_tag == owner_tag("t")));
    }

    #[test]
    fn pp_stages_write_only_their_layers_and_unknown_ids_nothing() {
        let s0 = plan_copies(&md(1), &rank(0, 1, 0, 2), &["r".into(), "zz".into()]).unwrap();
        let s1 = plan_copies(&md(1), &rank(0, 1, 1, 2), &["r".into()]).unwrap();
        assert!(s0.iter().all(|c| c.addr < 0x2000_0000) && s0.len() == 2);
        assert!(s1.iter().all(|c| c.addr >= 0x2000_0000) && s1.len() == 2);
    }

    /// A D's metadata never makes the simulator allocate without bound (it builds every
    /// payload before writing): an absurd block length, or a pull of too many blocks, is
    /// refused (P answers the pull with an error) before anything is allocated.
    #[test]
    fn absurd_block_lengths_and_pulls_over_the_byte_cap_are_refused() {
        let one = |f: &dyn Fn(&mut MooncakeXferMetadata)| {
            let mut m = md(1);
            f(&mut m);
            plan_copies(&m, &rank(0, 1, 0, 1), &["r".into()])
        };
        for len in [MAX_COPY_BYTES + 1, 1 << 40, 1 << 63] {
            let e = one(&|m| {
                m.block_lens = vec![len, len];
                m.kv_block_lens = vec![len, len];
            })
            .expect_err("an absurd block length");
            assert!(e.contains("per block slice"), "{e}");
        }
        let blocks = MAX_PULL_BYTES / (1 << 20); // 1 MiB blocks: two regions go over
        let e = one(&|m| {
            m.block_lens = vec![1 << 20; 2];
            m.kv_block_lens = vec![1 << 20; 2];
            m.req_blocks
                .insert("r".into(), ("t".into(), vec![(0..blocks).collect()]));
        })
        .expect_err("a pull over the cap");
        assert!(e.contains("the simulator's most"), "{e}");
        // One-byte slices: few bytes, but each copy costs its bookkeeping.
        let e = one(&|m| {
            m.block_lens = vec![1; 2];
            m.kv_block_lens = vec![1; 2];
            m.req_blocks.insert(
                "r".into(),
                ("t".into(), vec![vec![0; MAX_PULL_COPIES]]),
            );
        })
        .expect_err("a pull of too many copies");
        assert!(e.contains("copies"), "{e}");
        assert!(one(&|_| {}).is_ok());
    }
}
