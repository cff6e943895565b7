#![forbid(unsafe_code)]

use std::time::Duration;

use super::*;
use crate::layout::KvLayout;
use crate::messages::RequestMeta;

/// A deployment past its share refuses every pull: the error line comes at most every
/// 10 s, with how many refusals went unlogged since the last one.
#[test]
fn refusals_are_logged_at_most_every_ten_seconds() {
    let mut inner = Inner::default();
    let t0 = Instant::now();
    let s = Duration::from_secs;
    assert_eq!(inner.log_refusal(t0), Some(0));
    assert_eq!(inner.log_refusal(t0 + s(1)), None);
    assert_eq!(inner.log_refusal(t0 + s(9)), None);
    assert_eq!(inner.log_refusal(t0 + s(10)), Some(2));
    assert_eq!(inner.log_refusal(t0 + s(11)), None);
}

fn table(windows: u32) -> PermitTable {
    let map = WindowMap::new(&KvLayout::uniform(1, 4096, 4), 0x7e00_0000_0000, windows);
    PermitTable::new(Arc::new(map.unwrap()), true)
}

fn req(id: &str) -> Arc<RequestMeta> {
    Arc::new(RequestMeta::new(id, id, "e", "http://127.0.0.1:1", &[vec![0]]))
}

fn open(t: &PermitTable, pull_id: PullId, peer: &PeerId, r: &Arc<RequestMeta>) -> u32 {
    t.open(&PullWindow {
        pull_id,
        peer,
        requests: std::slice::from_ref(r),
    })
}

fn revoke(t: &PermitTable, r: &RequestMeta, suspects: &[PeerId], until: Instant) -> Revoked {
    t.revoke(&RevokeRequest {
        req: r,
        suspects,
        poison_until: until,
    })
}

/// A batch's pulls get their windows all or none: one that cannot leaves every window as
/// it was (nothing opened, nothing marked windowless) and says how many are held.
#[test]
fn a_batch_gets_a_window_for_every_pull_or_none_at_all() {
    let t = table(4); // windows 0..=2 usable, 3 reserved
    let (p, q) = (PeerId::new("p"), PeerId::new("q"));
    let (a, b) = (req("a"), req("b"));
    let batch = |id: PullId, r: &Arc<RequestMeta>| {
        t.open_all_at(
            &[
                PullWindow {
                    pull_id: id,
                    peer: &p,
                    requests: std::slice::from_ref(r),
                },
                PullWindow {
                    pull_id: id + 1,
                    peer: &q,
                    requests: std::slice::from_ref(r),
                },
            ],
            Instant::now(),
        )
    };
    assert_eq!(batch(1, &a), Ok(vec![0, 1]));
    let e = batch(3, &b).unwrap_err();
    assert_eq!(
        (e.needed, e.in_use, e.poisoned, e.usable, e.why),
        (2, 2, 0, 3, NoWindowReason::Exhausted)
    );
    assert!(
        e.to_string().starts_with(crate::rdma::NO_CLEAN_WINDOW),
        "{e}"
    );
    assert!(!t.windowless(&b.req_id), "nothing was sent for it");
    // Window 2 was not taken by the refused batch: a single pull still gets it.
    assert_eq!(open(&t, 5, &PeerId::new("r"), &req("c")), 2);
    // Once `a` completes, its windows come back and `b`'s batch goes through.
    revoke(&t, &a, &[], Instant::now());
    assert_eq!(batch(6, &b), Ok(vec![0, 1]));
}

#[test]
fn a_suspect_window_stays_out_of_rotation_until_its_deadline() {
    let t = table(4); // windows 0..=2 usable, 3 reserved
    let (p, q) = (PeerId::new("p"), PeerId::new("q"));
    let (a, b) = (req("a"), req("b"));
    assert_eq!(open(&t, 1, &p, &a), 0);
    assert_eq!(open(&t, 2, &q, &a), 1);
    let soon = Instant::now() + Duration::from_secs(3600);
    // Only the suspect peer's pull is poisoned; the other closes clean.
    let r = revoke(&t, &a, std::slice::from_ref(&p), soon);
    assert_eq!((r.revocation, r.poisoned), (Revocation::Exact, 1));
    assert!(r.quiesced.is_none(), "nothing was copying");
    assert_eq!(t.poisoned_windows(), 1);
    // Round robin continues at 2, then skips poisoned 0 for the clean 1 (pulls of peers
    // without a ring of windows: the cursor's rotation; the rings are tested below).
    let q = PeerId::new("q2");
    assert_eq!(open(&t, 3, &q, &b), 2);
    assert_eq!(open(&t, 4, &PeerId::new("q3"), &req("c")), 1);
    // Every clean window busy, 0 poisoned: fail safe, never reuse it.
    assert_eq!(
        open(&t, 5, &PeerId::new("q4"), &req("d")),
        3,
        "the reserved window"
    );
    assert_eq!(t.epochs().exhausted.load(Ordering::Relaxed), 1);
    // Past the last-resort deadline the window returns.
    let e = req("e");
    let pull = PullWindow {
        pull_id: 6,
        peer: &q,
        requests: std::slice::from_ref(&e),
    };
    assert_eq!(t.open_at(&pull, soon - Duration::from_millis(1)), 3);
    assert_eq!(t.open_at(&pull, soon), 0);
    assert_eq!(t.epochs().poison_expired.load(Ordering::Relaxed), 1);
    assert_eq!(t.poisoned_windows(), 0);
}

/// A write into request `r`'s block 0 through window `w` (one block of group 0).
fn admits(t: &PermitTable, w: u32) -> bool {
    let r = Resolved {
        window: w,
        region: 0,
        offset: 0,
        mem_offset: 0,
    };
    t.admit(&r, 4096, Access::Write { acknowledged: true })
        .is_ok()
}

/// Permits are found by pull id: an id that already names an open permit (two coordinators
/// numbering their pulls alike over one landing) must not take it over. The second pull gets
/// the window that admits nothing, and the first request is still revoked exactly.
#[test]
fn a_pull_id_with_an_open_permit_is_refused_a_window() {
    let t = table(4);
    let (p, q) = (PeerId::new("p"), PeerId::new("q"));
    let (a, b) = (req("a"), req("b"));
    let wa = open(&t, 7, &p, &a);
    assert_eq!(wa, 0);
    assert_eq!(open(&t, 7, &q, &b), 3, "the reserved window");
    assert!(t.windowless(&b.req_id));
    assert!(
        t.verify_ok(&b).is_err(),
        "b's writes were refused: no ok for it"
    );
    assert!(admits(&t, wa), "a's window still admits a's writes");
    revoke(&t, &a, &[], Instant::now());
    assert!(!admits(&t, wa), "revoking a closes a's own permit");
}

/// A closed permit's id may be taken again; reusing the old permit's window later must not
/// drop the new permit from the index, or revoking its request would miss it.
#[test]
fn reusing_a_window_keeps_a_newer_permit_of_the_same_pull_id() {
    let t = table(3); // windows 0 and 1, 2 reserved
    let p = PeerId::new("p");
    let (a, b, c) = (req("a"), req("b"), req("c"));
    assert_eq!(open(&t, 5, &p, &a), 0);
    revoke(&t, &a, &[], Instant::now());
    // Other peers: the cursor's rotation (p's ring would give it window 0 again).
    let wb = open(&t, 5, &PeerId::new("p2"), &b);
    assert_eq!(wb, 1, "id 5 again, its old permit being closed");
    assert_eq!(
        open(&t, 6, &PeerId::new("p3"), &c),
        0,
        "window 0 reused: the old permit of id 5 leaves"
    );
    assert!(admits(&t, wb));
    assert_eq!(
        revoke(&t, &b, &[], Instant::now()).revocation,
        Revocation::Exact
    );
    assert!(
        !admits(&t, wb),
        "b's permit was still found by its pull id and closed"
    );
}

fn blocks_of(t: &PermitTable, w: u32) -> Arc<PullBlocks> {
    match &*t.slots[w as usize].read().unwrap() {
        Slot::Open(p) => p.blocks.clone(),
        _ => panic!("window {w} is not open"),
    }
}

/// The pulls of one batch (the same requests) share one set of blocks and span caps, and
/// each admits writes into them; a pull of other requests has its own.
#[test]
fn a_batchs_pulls_share_their_blocks() {
    let t = table(8);
    let (p, q) = (PeerId::new("p"), PeerId::new("q"));
    let reqs = [req("a")];
    let w = t
        .open_all_at(
            &[
                PullWindow {
                    pull_id: 1,
                    peer: &p,
                    requests: &reqs,
                },
                PullWindow {
                    pull_id: 2,
                    peer: &q,
                    requests: &reqs,
                },
            ],
            Instant::now(),
        )
        .unwrap();
    assert!(Arc::ptr_eq(&blocks_of(&t, w[0]), &blocks_of(&t, w[1])));
    assert_eq!(blocks_of(&t, w[0]).span_cap.len(), 1);
    assert_eq!(write_into(&t, w[0], 0), Ok(()));
    assert_eq!(write_into(&t, w[1], 0), Ok(()));
    assert_eq!(write_into(&t, w[1], 1), Err(RejectReason::NoPermit));
    let other = open(&t, 3, &p, &req("b"));
    assert!(!Arc::ptr_eq(&blocks_of(&t, w[0]), &blocks_of(&t, other)));
}

/// A write into block `block` through window `w`: admitted, or why not.
fn write_into(t: &PermitTable, w: u32, block: u64) -> Result<(), RejectReason> {
    let r = Resolved {
        window: w,
        region: 0,
        offset: block * 4096,
        mem_offset: block * 4096,
    };
    t.admit(&r, 4096, Access::Write { acknowledged: true })
        .map(|_| ())
}

/// Once a pull's last request is revoked its window admits nothing and calls every write
/// into it late, its pull's blocks or not, until the window's next pull; its permit leaves
/// the index (its accounting with it). A window never opened, and a block an open pull does
/// not own, have no permit.
#[test]
fn a_closed_window_refuses_every_write_as_late_until_its_next_pull() {
    let t = table(3); // windows 0 and 1, 2 reserved
    let p = PeerId::new("p");
    let (a, b) = (req("a"), req("b")); // block 0 each
    assert_eq!(open(&t, 1, &p, &a), 0);
    assert_eq!(write_into(&t, 0, 0), Ok(()));
    assert_eq!(
        write_into(&t, 0, 1),
        Err(RejectReason::NoPermit),
        "not a's block"
    );
    assert_eq!(
        write_into(&t, 1, 0),
        Err(RejectReason::NoPermit),
        "never opened"
    );
    assert!(t.pull_bytes(1).is_some_and(|b| b.open));
    revoke(&t, &a, &[], Instant::now());
    for block in 0..4 {
        assert_eq!(
            write_into(&t, 0, block),
            Err(RejectReason::Revoked),
            "block {block}"
        );
    }
    assert!(
        t.pull_bytes(1).is_none(),
        "a closed permit leaves the index"
    );
    // Another peer: the cursor's rotation (p's ring would give it window 0 again).
    assert_eq!(
        open(&t, 2, &PeerId::new("p2"), &b),
        1,
        "round robin: window 1 next"
    );
    assert_eq!(
        write_into(&t, 0, 0),
        Err(RejectReason::Revoked),
        "0 still closed"
    );
    revoke(&t, &b, &[], Instant::now());
    let c = req("c");
    assert_eq!(
        open(&t, 3, &PeerId::new("p3"), &c),
        0,
        "window 0 comes round again"
    );
    assert_eq!(write_into(&t, 0, 0), Ok(()), "c's pull admits its block");
    assert_eq!(write_into(&t, 0, 1), Err(RejectReason::NoPermit));
}

#[test]
fn without_the_epoch_rule_a_suspect_window_is_reused_at_once() {
    let t = table(3).without_epoch_rule();
    let p = PeerId::new("p");
    let a = req("a");
    assert_eq!(open(&t, 1, &p, &a), 0);
    let far = Instant::now() + Duration::from_secs(3600);
    assert_eq!(revoke(&t, &a, std::slice::from_ref(&p), far).poisoned, 0);
    assert_eq!(open(&t, 2, &PeerId::new("p2"), &req("b")), 1);
    assert_eq!(open(&t, 3, &PeerId::new("p3"), &req("c")), 0, "reissued");
}

/// A peer's pulls reuse the windows of its ring (oldest first) while they are closed and
/// clean, instead of the cursor's next: its layout ids recur. A poisoned window leaves the
/// ring for good; a window still open is skipped.
#[test]
fn a_peers_ring_reuses_its_closed_windows_and_never_a_poisoned_one() {
    let t = table(17); // 16 usable
    let (p, q) = (PeerId::new("p"), PeerId::new("q"));
    let (a, b) = (req("a"), req("b"));
    assert_eq!(open(&t, 1, &p, &a), 0);
    assert_eq!(open(&t, 2, &p, &b), 1, "0 is open: the cursor's next");
    assert_eq!(open(&t, 3, &q, &req("x")), 2);
    revoke(&t, &a, &[], Instant::now());
    revoke(&t, &b, &[], Instant::now());
    assert_eq!(t.ring_of(&p), [0, 1]);
    // Round robin would say 3; p's ring has 0 and 1, closed and clean: the oldest first.
    for n in 0..20 {
        let r = req(&format!("r{n}"));
        let w = open(&t, 10 + n, &p, &r);
        assert!(w == 0 || w == 1, "pull {n} got window {w}");
        revoke(&t, &r, &[], Instant::now());
    }
    // p's pull made a suspect: its window is poisoned and leaves the ring.
    let c = req("c");
    let wc = open(&t, 40, &p, &c);
    let far = Instant::now() + Duration::from_secs(3600);
    assert_eq!(revoke(&t, &c, std::slice::from_ref(&p), far).poisoned, 1);
    for n in 0..20 {
        let r = req(&format!("s{n}"));
        let w = open(&t, 50 + n, &p, &r);
        assert_ne!(w, wc, "never the poisoned window");
        revoke(&t, &r, &[], Instant::now());
    }
    assert!(!t.ring_of(&p).contains(&wc));
    // Even once its poison expired the ring does not take it back; only the cursor can.
    let d = req("d");
    let pull = PullWindow {
        pull_id: 80,
        peer: &p,
        requests: std::slice::from_ref(&d),
    };
    assert_ne!(t.open_at(&pull, far), wc);
    // A ring is bounded, and a peer with every ring window open takes the cursor's.
    let open_ones: Vec<_> = (0..PEER_RING as u64 + 2)
        .map(|n| {
            let r = req(&format!("o{n}"));
            (open(&t, 100 + n, &q, &r), r)
        })
        .collect();
    let mut got: Vec<u32> = open_ones.iter().map(|(w, _)| *w).collect();
    got.sort();
    got.dedup();
    assert_eq!(
        got.len(),
        PEER_RING + 2,
        "distinct windows while all are open"
    );
    assert_eq!(t.ring_of(&q).len(), PEER_RING);
}

fn req_of(id: &str, engine: &str, bootstrap: &str) -> Arc<RequestMeta> {
    let mut m = (*req(id)).clone();
    m.engine_id = engine.into();
    m.bootstrap_addr = bootstrap.into();
    Arc::new(m)
}

/// Once half the windows are poisoned, a P deployment whose writers keep ending up suspects
/// (through any of its DP ranks' engine ids) gets no window past its share: other
/// deployments (the same engine id behind another bootstrap server included) keep theirs,
/// and it gets windows again once enough poison expired, not before.
#[test]
fn under_pressure_a_deployment_holds_at_most_its_share_of_poisoned_windows() {
    let t = table(129); // 128 usable: a share of 16, pressure from 64 poisoned
    assert_eq!(t.deployment_poison_cap(), 16);
    let reserved = 128;
    let (p, q) = (PeerId::new("p"), PeerId::new("q"));
    let now = Instant::now();
    let (first, second) = (
        now + Duration::from_secs(60),
        now + Duration::from_secs(120),
    );
    // Twelve DP ranks behind one bootstrap server: one deployment.
    let bad = |i: u64| req_of(&format!("bad-{i}"), &format!("bad{}", i % 12), "http://b:1");
    let open_at = |pull_id, peer: &PeerId, r: &Arc<RequestMeta>, at| {
        t.open_at(
            &PullWindow {
                pull_id,
                peer,
                requests: std::slice::from_ref(r),
            },
            at,
        )
    };
    // Past its share but under pressure-free conditions it keeps getting windows.
    for i in 0..64u64 {
        let r = bad(i);
        assert_ne!(open_at(i + 1, &p, &r, now), reserved, "pull {i}");
        revoke(
            &t,
            &r,
            std::slice::from_ref(&p),
            if i < 32 { first } else { second },
        );
    }
    assert_eq!(t.poisoned_windows(), 64);
    let next = bad(64);
    assert_eq!(
        open_at(100, &p, &next, now),
        reserved,
        "at its share, under pressure"
    );
    assert!(t.windowless(&next.req_id));
    let good = req_of("good", "good", "http://g:1");
    assert_ne!(open_at(101, &q, &good, now), reserved, "another engine");
    let twin = req_of("twin", "bad0", "http://other:1");
    assert_ne!(
        open_at(102, &q, &twin, now),
        reserved,
        "same id, other bootstrap"
    );
    // Nothing expires early.
    let early = first - Duration::from_millis(1);
    assert_eq!(open_at(103, &p, &bad(65), early), reserved);
    assert_eq!(t.poisoned_windows(), 64);
    // The first half of its poison expires: no pressure, windows again (no rotation needed).
    let later = first + Duration::from_millis(1);
    assert_ne!(open_at(104, &p, &bad(66), later), reserved);
    assert_eq!(t.poisoned_windows(), 32);
}

/// A window poisoned again (another request of the same pull) counts once for its engine.
#[test]
fn a_window_poisoned_twice_counts_once() {
    let t = table(3);
    let p = PeerId::new("p");
    let (a, b) = (
        req_of("a", "e", "http://b:1"),
        req_of("b", "e", "http://b:1"),
    );
    t.open(&PullWindow {
        pull_id: 1,
        peer: &p,
        requests: &[a.clone(), b.clone()],
    });
    let far = Instant::now() + Duration::from_secs(60);
    revoke(&t, &a, std::slice::from_ref(&p), far);
    revoke(&t, &b, std::slice::from_ref(&p), far);
    let inner = t.lock();
    assert_eq!(inner.poisoned.len(), 1);
    assert_eq!(
        inner
            .poisoned_by_deployment
            .values()
            .copied()
            .collect::<Vec<_>>(),
        vec![1]
    );
}

/// What a permit keeps to back an ok goes at the revocation, not when its window is reused
/// (which may be thousands of pulls later).
#[test]
fn a_revoked_requests_coverage_is_dropped() {
    let t = table(3);
    let p = PeerId::new("p");
    let a = req("a");
    let w = open(&t, 1, &p, &a);
    let r = Resolved {
        window: w,
        region: 0,
        offset: 0,
        mem_offset: 0,
    };
    let admitted = t
        .admit(&r, 4096, Access::Write { acknowledged: true })
        .unwrap();
    admitted.landed(4096);
    drop(admitted);
    let permit = t.lock().by_pull.get(&1).cloned().unwrap();
    assert_eq!(*permit.coverage.lock().unwrap(), vec![vec![(0, 0, 4096)]]);
    revoke(&t, &a, &[], Instant::now());
    assert!(permit.coverage.lock().unwrap().is_empty());
}

/// Bytes written into a block's padding (past its `kv_block_len`) do not back an ok; a
/// request's contiguous writes keep one span.
#[test]
fn padding_bytes_back_no_ok_and_contiguous_writes_merge() {
    let mut layout = KvLayout::uniform(1, 4096, 4);
    layout.regions[0].kv_block_len = 2048;
    let map = WindowMap::new(&layout, 0x7e00_0000_0000, 3).unwrap();
    let t = PermitTable::new(Arc::new(map), true);
    let p = PeerId::new("p");
    let a = req("a");
    let w = open(&t, 1, &p, &a);
    let at = |offset| Resolved {
        window: w,
        region: 0,
        offset,
        mem_offset: offset,
    };
    let v1 = Access::Write {
        acknowledged: false,
    };
    // A v1 writer fills block 0's padding only: 2048 bytes landed, none of them KV data.
    t.admit(&at(2048), 2048, v1).unwrap().landed(2048);
    let err = t.verify_ok(&a).expect_err("padding is no KV data");
    assert!(err.contains("0 of 2048"), "{err}");
    // Then the data, in two contiguous writes: one span, the ok is backed.
    t.admit(&at(0), 1024, v1).unwrap().landed(1024);
    t.admit(&at(1024), 1024, v1).unwrap().landed(1024);
    assert_eq!(t.verify_ok(&a), Ok(()));
    let permit = t.lock().by_pull.get(&1).cloned().unwrap();
    assert_eq!(*permit.coverage.lock().unwrap(), vec![vec![(0, 0, 2048)]]);
}

proptest::proptest! {
    /// Spans stay sorted, apart and exactly the union of what was added, whatever order
    /// and overlap the pieces come in.
    #[test]
    fn spans_are_the_sorted_union_of_the_pieces(
        pieces in proptest::collection::vec((0u32..3, 0u64..64, 1u64..16), 0..40)
    ) {
        let mut spans = Vec::new();
        let mut all = Vec::new();
        for (region, start, len) in pieces {
            add_span(&mut spans, (region, start, start + len), usize::MAX);
            all.push((region, start, start + len));
        }
        for w in spans.windows(2) {
            proptest::prop_assert!(
                w[0].0 < w[1].0 || w[0].2 < w[1].1,
                "sorted and apart: {:?}", spans
            );
        }
        let total: u64 = spans.iter().map(|s| s.2 - s.1).sum();
        proptest::prop_assert_eq!(total, union_len(all));
    }
}

/// A writer that scatters bytes (1-byte writes, every other byte) cannot grow a permit's
/// coverage past its cap; what was dropped is under-counted, so the ok fails.
#[test]
fn scattered_writes_are_capped_and_fail_the_ok() {
    let t = table(3);
    let p = PeerId::new("p");
    let a = req("a");
    let w = open(&t, 1, &p, &a);
    let v1 = Access::Write {
        acknowledged: false,
    };
    for off in (0..4096).step_by(2) {
        let r = Resolved {
            window: w,
            region: 0,
            offset: off,
            mem_offset: off,
        };
        t.admit(&r, 1, v1).unwrap().landed(1);
    }
    let permit = t.lock().by_pull.get(&1).cloned().unwrap();
    // One block of one region: 2 * 1 + 16.
    assert_eq!(permit.coverage.lock().unwrap()[0].len(), 18);
    assert!(t.verify_ok(&a).is_err());
    // Filling the gaps merges the kept spans back into one, and proves the ok.
    let r = Resolved {
        window: w,
        region: 0,
        offset: 0,
        mem_offset: 0,
    };
    t.admit(&r, 4096, v1).unwrap().landed(4096);
    assert_eq!(*permit.coverage.lock().unwrap(), vec![vec![(0, 0, 4096)]]);
    assert_eq!(t.verify_ok(&a), Ok(()));
}

#[test]
fn coverage_counts_overlapping_and_repeated_ranges_once_per_region() {
    assert_eq!(union_len(vec![]), 0);
    assert_eq!(
        union_len(vec![(0, 0, 10), (0, 0, 10), (0, 5, 15), (0, 20, 30)]),
        25
    );
    assert_eq!(union_len(vec![(1, 0, 10), (0, 0, 10)]), 20, "regions apart");
    assert_eq!(union_len(vec![(0, 10, 20), (0, 0, 10)]), 20, "adjacent");
}

#[tokio::test]
async fn revocation_waits_for_a_read_in_the_gate_without_spinning() {
    let t = table(3);
    let p = PeerId::new("p");
    let a = req("a");
    let w = open(&t, 1, &p, &a);
    let r = Resolved {
        window: w,
        region: 0,
        offset: 0,
        mem_offset: 0,
    };
    let admitted = t
        .admit(&r, 16, Access::Write { acknowledged: true })
        .unwrap();
    let gate = admitted.enter().expect("open");
    let far = Instant::now() + Duration::from_secs(3600);
    let mut rev = revoke(&t, &a, &[], far);
    let quiet = rev.quiesced.take().expect("a read is copying");
    assert!(admitted.enter().is_none(), "no new read after revocation");
    let waiter = tokio::spawn(quiet);
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished(), "still copying");
    drop(gate);
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken when the read left the gate")
        .unwrap();
}
