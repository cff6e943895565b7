//! Landing permits (DESIGN.md §5) and the audit that proves they matter: with permits off a
//! late write lands in a freed / reallocated block and the audit counts it; with permits on it
//! is rejected and the audit sees nothing.

#[path = "common/data_plane.rs"]
mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{mem_off, open, pattern, req, revoke, target, BLOCK};
use kvrecv::actors::block_pool::{owner_tag, BlockPool};
use kvrecv::rdma::audit::{stamp_write, AuditSnapshot};
use kvrecv::rdma::tcp::wire::{Header, ProtoVersion, STATUS_OK, STATUS_REJECT};
use kvrecv::rdma::{FenceError, Landing, Revocation};
use kvrecv::sim::initiator::{InitiatorConfig, TeInitiator, WriteError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn initiator(t: &kvrecv::rdma::TcpTarget) -> TeInitiator {
    TeInitiator::connect(t.handshake_addr(), InitiatorConfig::default())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pull_gets_its_own_window_and_revocation_rejects_late_writes_exactly() {
    let t = target(true).await;
    let l = t.landing();
    let a = req("a", &[1, 2]);
    let b = req("b", &[3]);
    // One pull with both requests, and a second pull (another peer's share) with `a` again.
    let p1 = open(&t, 1, &[a.clone(), b.clone()]);
    let p2 = open(&t, 2, std::slice::from_ref(&a));
    assert_ne!(p1, p2, "each pull has its own window");
    assert_eq!(l.permits().live(), 2);
    let ini = initiator(&t).await;
    ini.write(p1[0] + BLOCK, &[1; 64]).await.unwrap();
    ini.write(p2[1] + 2 * BLOCK, &[2; 64]).await.unwrap();
    // A pull's window only admits its own blocks.
    assert!(matches!(
        ini.write(p2[0] + 3 * BLOCK, &[9; 64]).await,
        Err(WriteError::Rejected)
    ));

    assert_eq!(revoke(&t, &a).await.revocation, Revocation::Exact);
    assert_eq!(
        l.permits().live(),
        1,
        "pull 2 had only `a`; pull 1 still has `b`"
    );
    l.fence(&[common::peer()]).await.unwrap();
    let before = t
        .plane()
        .memory()
        .snapshot(0, t.plane().memory().len())
        .unwrap();
    for addr in [p1[0] + BLOCK, p1[1] + 2 * BLOCK, p2[0] + BLOCK] {
        assert!(
            matches!(
                ini.write(addr, &[0xEE; 64]).await,
                Err(WriteError::Rejected)
            ),
            "{addr:#x}"
        );
    }
    assert_eq!(t.stats().rejected_revoked.load(Ordering::Relaxed), 3);
    assert_eq!(
        t.plane()
            .memory()
            .snapshot(0, t.plane().memory().len())
            .unwrap(),
        before,
        "a late write landed"
    );
    // `b` in the same pull is unaffected.
    ini.write(p1[1] + 3 * BLOCK, &[3; 64]).await.unwrap();
    assert_eq!(revoke(&t, &b).await.revocation, Revocation::Exact);
    assert_eq!(l.permits().live(), 0);
    assert!(matches!(
        ini.write(p1[1] + 3 * BLOCK, &[4; 64]).await,
        Err(WriteError::Rejected)
    ));
    assert_eq!(
        t.plane().memory().snapshot(mem_off(1, 3), 64).unwrap(),
        vec![3; 64]
    );
}

#[tokio::test]
async fn windows_are_recycled_and_exhaustion_admits_nothing() {
    let t = target(true).await; // 8 windows: 7 usable + the reserved one
    let mut bases = Vec::new();
    for i in 0..7u64 {
        bases.push(open(&t, i, &[req(&format!("r{i}"), &[0])]));
    }
    let all: std::collections::BTreeSet<_> = bases.iter().map(|b| b[0]).collect();
    assert_eq!(all.len(), 7);
    // Every window busy: the eighth pull gets the window that admits nothing.
    let full = open(&t, 7, &[req("r7", &[0])]);
    let ini = initiator(&t).await;
    assert!(matches!(
        ini.write(full[0], &[1; 16]).await,
        Err(WriteError::Rejected)
    ));
    assert_eq!(t.stats().rejected_no_permit.load(Ordering::Relaxed), 1);
    // Revoking frees a window, which the next pull reuses.
    revoke(&t, &req("r3", &[0])).await;
    let again = open(&t, 8, &[req("r8", &[0])]);
    assert_eq!(again, bases[3]);
    ini.write(again[0], &[5; 16]).await.unwrap();
    // A pull with nothing to receive holds no window.
    assert_eq!(open(&t, 9, &[]), full);
}

#[tokio::test]
async fn without_permits_every_pull_shares_window_zero_and_nothing_is_exact() {
    let t = target(false).await;
    let l = t.landing();
    let a = req("a", &[1]);
    assert_eq!(
        open(&t, 1, std::slice::from_ref(&a)),
        open(&t, 2, &[req("b", &[2])])
    );
    let bases = open(&t, 3, std::slice::from_ref(&a));
    assert_eq!(revoke(&t, &a).await.revocation, Revocation::NotExact);
    assert!(matches!(
        l.fence(&[common::peer()]).await,
        Err(FenceError::Unavailable(_))
    ));
    // Anything in range is admitted, revoked or not.
    let ini = initiator(&t).await;
    ini.write(bases[0] + 9 * BLOCK, &[1; 16]).await.unwrap();
    assert_eq!(t.descriptor().buffers.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_during_a_payload_stops_the_rest_from_landing() {
    let t = target(true).await;
    let a = req("a", &[0]);
    let bases = open(&t, 1, std::slice::from_ref(&a));
    let mut s = TcpStream::connect(t.data_addr()).await.unwrap();
    let payload = pattern(9, BLOCK as usize);
    let half = BLOCK as usize / 2;
    s.write_all(&Header::new(true, bases[0], BLOCK, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&payload[..half]).await.unwrap();
    // Whether the server is still at the header or already copying, after `revoke` returns no
    // byte sent from now on may land.
    assert_eq!(revoke(&t, &a).await.revocation, Revocation::Exact);
    let _ = s.write_all(&payload[half..]).await;
    let mut f = [0u8; 8];
    let answer = tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut f))
        .await
        .expect("server answers");
    // A reset after the reject is also a refusal; a frame must be the reject.
    if answer.is_ok() {
        assert_eq!(u64::from_le_bytes(f), STATUS_REJECT);
    }
    assert_ne!(u64::from_le_bytes(f), STATUS_OK);
    assert_eq!(
        t.plane()
            .memory()
            .snapshot(half as u64, half as u64)
            .unwrap(),
        vec![0; half]
    );
    assert_eq!(t.stats().writes_landed.load(Ordering::Relaxed), 0);
    assert_eq!(t.stats().rejected_revoked.load(Ordering::Relaxed), 1);
}

/// The scenario behind DESIGN.md §1: request A's blocks are released while a peer is still
/// writing for A; the blocks are then reallocated to B. Returns what the audit saw and whether
/// the late writes were refused.
async fn late_write_scenario(permits: bool) -> (AuditSnapshot, u64, Vec<bool>) {
    let t = target(permits).await;
    let mut pool = BlockPool::new(common::BLOCKS);
    let audit = t.install_audit(pool.ownership());
    let (ra, rb) = ("req-a", "req-b");
    let tag_a = owner_tag("xfer-req-a");
    let blocks = pool.allocate(&ra.into(), tag_a, 2).unwrap();
    let a = req(ra, &blocks);
    let bases = open(&t, 1, std::slice::from_ref(&a));
    let ini = initiator(&t).await;
    let write_for_a = |block: u32| {
        let mut p = pattern(block as u8, BLOCK as usize);
        stamp_write(&mut p, u64::from(block) * BLOCK, BLOCK, tag_a, |_| 0);
        (bases[0] + u64::from(block) * BLOCK, p)
    };
    // On-time writes: audited, clean.
    for &b in &blocks {
        let (addr, p) = write_for_a(b);
        ini.write(addr, &p).await.unwrap();
    }
    // Completion (e.g. another peer failed): revoke, then release, as the BlockManager does.
    revoke(&t, &a).await;
    pool.release(&ra.into());
    let mut refused = Vec::new();
    let (addr, p) = write_for_a(blocks[0]);
    refused.push(ini.write(addr, &p).await.is_err()); // write after free
    pool.allocate(&rb.into(), owner_tag("xfer-req-b"), 2)
        .unwrap();
    let (addr, p) = write_for_a(blocks[1]);
    refused.push(ini.write(addr, &p).await.is_err()); // write after reallocation
    (
        audit.snapshot(),
        t.stats().rejected_revoked.load(Ordering::Relaxed),
        refused,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_catches_writes_after_free_and_realloc_without_permits() {
    let (audit, revoked, refused) = late_write_scenario(false).await;
    assert_eq!(
        refused,
        vec![false, false],
        "without permits the late writes land"
    );
    assert_eq!(revoked, 0);
    assert_eq!(audit.audited, 4);
    assert_eq!(audit.writes_after_free, 1);
    assert_eq!(audit.writes_after_realloc, 1);
    assert_eq!(audit.misdirected, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_sees_no_late_write_with_permits() {
    let (audit, revoked, refused) = late_write_scenario(true).await;
    assert_eq!(refused, vec![true, true], "late writes are refused");
    assert_eq!(revoked, 2);
    assert_eq!(audit.audited, 2, "only the on-time writes landed");
    assert_eq!(audit.writes_after_free + audit.writes_after_realloc, 0);
}
