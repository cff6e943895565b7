//! Shared fixtures for the data-plane tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrecv::layout::KvLayout;
use kvrecv::messages::{PeerId, RequestMeta};
use kvrecv::rdma::{Landing, PullWindow, RevokeRequest, Revoked, TargetConfig, TcpTarget};

pub const BLOCK: u64 = 4096;
pub const BLOCKS: u32 = 16;
pub const LAYERS: u32 = 2;

pub fn layout() -> KvLayout {
    KvLayout::uniform(LAYERS, BLOCK, BLOCKS)
}

/// A loopback target with 8 windows, READs off as in production.
pub async fn target(permits: bool) -> TcpTarget {
    start(permits, false).await
}

/// [`target`] answering READs too, for the tests that read back what landed (reads are off by
/// default: `reads_are_refused_unless_turned_on`).
pub async fn target_reading(permits: bool) -> TcpTarget {
    start(permits, true).await
}

async fn start(permits: bool, reads: bool) -> TcpTarget {
    let mut cfg = TargetConfig::loopback(layout());
    cfg.permits = permits;
    cfg.windows = Some(8);
    cfg.serve_reads = reads;
    TcpTarget::start(cfg).await.expect("target starts")
}

pub fn req(id: &str, blocks: &[u32]) -> Arc<RequestMeta> {
    Arc::new(RequestMeta::new(
        id,
        &format!("xfer-{id}"),
        "engine",
        "http://127.0.0.1:1",
        &[blocks.to_vec()],
    ))
}

pub fn peer() -> PeerId {
    PeerId::new("tcp://127.0.0.1:5555")
}

/// Open a pull for `reqs`; returns the advertised base of every region.
pub fn open(t: &TcpTarget, pull_id: u64, reqs: &[Arc<RequestMeta>]) -> Vec<u64> {
    open_as(t, &peer(), pull_id, reqs)
}

/// [`open`] for the pull of peer `p` (a peer's pulls prefer the windows it used last).
#[allow(dead_code)] // not every test binary that includes this module uses it
pub fn open_as(t: &TcpTarget, p: &PeerId, pull_id: u64, reqs: &[Arc<RequestMeta>]) -> Vec<u64> {
    t.landing()
        .open_pull(&PullWindow {
            pull_id,
            peer: p,
            requests: reqs,
        })
        .to_vec()
}

/// Revoke `req` as the BlockManager does at a completion (no suspect peer), and wait until no
/// admitted read can still copy into its blocks.
pub async fn revoke(t: &TcpTarget, req: &RequestMeta) -> Revoked {
    revoke_suspects(t, req, &[]).await
}

/// Revoke `req` with `suspects` (peers that may still write: their windows are poisoned for an
/// hour), waiting for quiescence.
pub async fn revoke_suspects(t: &TcpTarget, req: &RequestMeta, suspects: &[PeerId]) -> Revoked {
    let mut r = t.landing().revoke(&RevokeRequest {
        req,
        suspects,
        poison_until: Instant::now() + Duration::from_secs(3600),
    });
    if let Some(q) = r.quiesced.take() {
        q.await;
    }
    r
}

/// Deterministic, position-dependent bytes.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            seed.wrapping_mul(31)
                .wrapping_add((i % 251) as u8)
                .wrapping_add((i / 251) as u8)
        })
        .collect()
}

/// Offset in registered memory of (region, block).
pub fn mem_off(region: usize, block: u32) -> u64 {
    region as u64 * BLOCK * u64::from(BLOCKS) + u64::from(block) * BLOCK
}
