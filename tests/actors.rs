//! Actor-level tests of the settle rules (DESIGN.md §4-§6), through the actors' mailboxes with
//! a scripted peer transport. Each test names the rule it protects.

mod common;

use kvrecv::messages::Cause;
use std::time::Duration;

use common::*;
use kvrecv::actors::peer_state::OMITTED;
use kvrecv::actors::topology::DRank;
use kvrecv::config::Policy;
use kvrecv::messages::{
    BatchError, GetLedgerStats, KvEvent, MooncakeXferResponse, Outcome, PeerId, ReqId,
    SettleOutcome, XferStatus,
};
use XferStatus::{Continue, Error, Finish};

fn peer(t: u32, p: u32) -> PeerId {
    PeerId::new(format!("tcp://e0-{t}-{p}"))
}

fn settled_outcome(h: &Harness, peer: &PeerId, id: &str) -> Vec<SettleOutcome> {
    h.seen
        .borrow()
        .iter()
        .filter_map(|e| match e {
            KvEvent::Settled {
                peer: p,
                req_id,
                outcome,
                ..
            } if p == peer && &**req_id == id => Some(outcome.clone()),
            _ => None,
        })
        .collect()
}

/// A harness on tokio's paused clock (deadlines exact, nothing waits on the wall clock).
fn paused_harness(pull_timeout: Duration) -> Harness {
    tokio::time::pause();
    Harness::start(Setup {
        pull_timeout,
        ..Setup::default()
    })
}

/// Let every message queued so far be handled, moving the paused clock by 1 ms.
async fn settle_down(h: &mut Harness) {
    tokio::time::sleep(Duration::from_millis(1)).await;
    h.soak_events();
}

/// No completion of `id` so far, neither drained nor announced. The drain is a round trip
/// through the BlockManager: everything the peers and the aggregator had to handle when it was
/// sent (single-threaded system, FIFO wake-ups) was handled and published first, so a
/// premature completion is in the drain or among the events soaked after it. Returns the drain.
async fn assert_no_completion(
    h: &mut Harness,
    id: &str,
    why: &str,
) -> kvrecv::messages::StepOutput {
    let step = h.coord.drain().await.unwrap();
    assert!(
        !step.finished_recving.iter().any(|r| &**r == id),
        "{id} drained {why}"
    );
    h.soak_events();
    assert_eq!(h.count(is_completion(id)), 0, "{id} completed {why}");
    step
}

/// Rule 4+5: A ERROR while B is pending publishes the failure at once and nothing else; B's
/// FINISH then completes the request exactly once.
#[actix::test]
async fn error_from_one_peer_while_another_is_pending_completes_only_after_both() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1, 2])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Error, &[], &[], Some("boom"));
    h.wait_for("first failure", is_first_failure("r1")).await;
    let step = assert_no_completion(&mut h, "r1", "while B may still write").await;
    assert_eq!(
        step.invalid_block_ids,
        vec![1, 2],
        "failure signalled at once, block-level"
    );
    assert!(b.is_open());
    b.respond(Finish, &["r1"], &[], None);
    let c = h.wait_for("completion", is_completion("r1")).await;
    match c {
        KvEvent::Completion {
            outcome:
                Outcome::Failed {
                    peer: p,
                    cause,
                    reason,
                },
            uncertain_peers,
            ..
        } => {
            assert_eq!(p, Some(peer(0, 0)));
            assert_eq!(cause, kvrecv::Cause::PeerWideError, "an ERROR reply");
            assert!(reason.contains("boom"));
            assert_eq!(uncertain_peers, vec![peer(0, 0)]);
        }
        other => panic!("unexpected {other:?}"),
    }
    h.wait_for("release", is_released("r1")).await;
    assert_eq!(
        h.coord.drain().await.unwrap().finished_recving,
        vec![ReqId::from("r1")]
    );
    assert_eq!(h.count(is_first_failure("r1")), 1);
    assert_eq!(h.count(is_completion("r1")), 1);
}

/// Rule 4 (deadline) + §6: a silent peer is settled Uncertain at the D-side deadline; a peer
/// whose replies settle requests is not. (Tokio's clock is paused: the deadlines are exact.)
#[actix::test]
async fn peer_timing_out_is_uncertain_and_completion_waits_for_the_other() {
    let ms = Duration::from_millis;
    let mut h = paused_harness(ms(150));
    h.load(vec![req("r1", &[3]), req("r2", &[4])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    // t=100: B answers a subset (r2), which restarts its deadline (t=250); A stays silent.
    tokio::time::advance(ms(100)).await;
    b.respond(Continue, &["r2"], &[], None);
    h.wait_for("B settles r2", is_settled(&b.peer, "r2")).await;
    tokio::time::advance(ms(60)).await; // t=160
    h.wait_for("A uncertain", is_settled(&a.peer, "r1")).await;
    assert!(
        matches!(&settled_outcome(&h, &a.peer, "r1")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("deadline"))
    );
    assert!(!a.is_open(), "the abandoned pull's channel is closed");
    assert!(b.is_open(), "B's reply moved its deadline");
    assert_no_completion(&mut h, "r1", "while B may still write").await;
    b.respond(Finish, &["r1"], &[], None);
    h.wait_for("completion", is_completion("r1")).await;
}

/// Rule 4 (deadline): replies that settle nothing (an empty CONTINUE: P answers a subset whose
/// requests all expired on P; or one naming only ids that are not pending) restart the deadline
/// at most as many times as the pull has requests: a peer sending more cannot keep a pull, and
/// its blocks, held for ever. (Tokio's clock is paused: the deadlines are exact.)
#[actix::test]
async fn replies_that_settle_nothing_do_not_keep_a_pull_alive() {
    let ms = Duration::from_millis;
    let mut h = paused_harness(ms(150));
    h.load(vec![req("r1", &[3])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Finish, &["r1"], &[], None);
    // t=59: the one restart a one-request pull allows (deadline t=209); later ones do not.
    for _ in 0..4 {
        tokio::time::advance(ms(59)).await;
        b.respond(Continue, &[], &[], None);
        b.respond(Continue, &["nobody"], &[], None);
        settle_down(&mut h).await;
    }
    // t=240: past t=209 (had every reply restarted it, the deadline would be t=389).
    assert_eq!(h.count(is_settled(&b.peer, "r1")), 1, "B expired at t=209");
    assert!(
        matches!(&settled_outcome(&h, &b.peer, "r1")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("deadline"))
    );
    h.wait_for("completion", is_completion("r1")).await;
}

/// An empty CONTINUE is what P sends for a subset whose requests all expired on P meanwhile
/// (PROTOCOL.md §2.6): it restarts the deadline like any subset, within the pull's requests.
#[actix::test]
async fn an_empty_continue_within_the_pulls_requests_restarts_the_deadline() {
    let ms = Duration::from_millis;
    let mut h = paused_harness(ms(150));
    h.load(vec![req("r1", &[3]), req("r2", &[4])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Finish, &["r1", "r2"], &[], None);
    tokio::time::advance(ms(100)).await;
    b.respond(Continue, &[], &[], None); // deadline t=250
    settle_down(&mut h).await;
    tokio::time::advance(ms(99)).await; // t=200
    settle_down(&mut h).await;
    assert!(
        b.is_open(),
        "the empty CONTINUE moved B's deadline past t=150"
    );
    b.respond(Finish, &["r1", "r2"], &[], None);
    h.wait_for("r2 completion", is_completion("r2")).await;
    assert_eq!(settled_outcome(&h, &b.peer, "r2"), vec![SettleOutcome::Ok]);
}

/// Rule 4 (deadline): every pull has a deadline of its own, `pull_timeout` after it was sent
/// or after its latest reply, although one timer serves them all. A pull sent later is not
/// abandoned with an earlier one, a pull that ended leaves nothing armed against the others,
/// and a reply moves only its own pull's deadline. (Tokio's clock is paused: the deadlines
/// are exact, and nothing here waits on the wall clock.)
#[actix::test]
async fn each_pull_expires_at_its_own_deadline() {
    tokio::time::pause();
    let ms = Duration::from_millis;
    let mut h = Harness::start(Setup {
        pull_timeout: ms(1000),
        ..Setup::default()
    });
    let settled = |h: &Harness, id: &str| {
        h.seen
            .borrow()
            .iter()
            .filter(|e| matches!(e, KvEvent::Settled { req_id, .. } if &**req_id == id))
            .count()
    };
    // t=0: r1's pulls. t=600: r2's and r3's pulls; r1 finishes on both peers.
    h.load(vec![req("r1", &[1])]).await;
    let [a1, b1]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    tokio::time::advance(ms(600)).await;
    h.load(vec![req("r2", &[2]), req("r3", &[3])]).await;
    let [a2, b2]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a1.respond(Finish, &["r1"], &[], None);
    b1.respond(Finish, &["r1"], &[], None);
    h.wait_for("r1 completion", is_completion("r1")).await;
    // t=1200: r1's deadline (t=1000) has passed, but r2's pulls are due only at t=1600.
    tokio::time::advance(ms(600)).await;
    settle_down(&mut h).await;
    assert_eq!(
        settled(&h, "r2"),
        0,
        "nothing of r2 expired with r1's deadline"
    );
    assert!(a2.is_open() && b2.is_open());
    // B's reply at t=1200 (a subset: r3) moves B's deadline to t=2200; A's stays at t=1600.
    b2.respond(Continue, &["r3"], &[], None);
    settle_down(&mut h).await;
    tokio::time::advance(ms(450)).await; // t=1650
    h.wait_for("A's deadline", is_settled(&a2.peer, "r2")).await;
    assert!(
        matches!(&settled_outcome(&h, &a2.peer, "r2")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("deadline"))
    );
    assert!(!a2.is_open(), "the expired pull's channel is closed");
    assert!(b2.is_open(), "B replied at t=1200: its deadline is t=2200");
    assert_eq!(settled(&h, "r2"), 1);
    tokio::time::advance(ms(500)).await; // t=2150
    settle_down(&mut h).await;
    assert!(b2.is_open(), "still before B's deadline");
    assert_eq!(h.count(is_completion("r2")), 0);
    tokio::time::advance(ms(100)).await; // t=2250
    h.wait_for("r2 completion", is_completion("r2")).await;
    assert!(
        matches!(&settled_outcome(&h, &b2.peer, "r2")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("deadline"))
    );
    assert!(!b2.is_open());
}

/// Rule 2: `err_reqs` in a CONTINUE is an explicit Failed for that peer.
#[actix::test]
async fn err_reqs_in_continue_fails_the_request_for_that_peer_only() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(
        Continue,
        &[],
        &["r1"],
        Some("Mooncake transfer engine returned -1"),
    );
    h.wait_for("first failure", is_first_failure("r1")).await;
    a.respond(Finish, &["r2"], &[], None);
    b.respond(Finish, &["r1", "r2"], &[], None);
    h.wait_for("r1 completion", is_completion("r1")).await;
    h.wait_for("r2 completion", is_completion("r2")).await;
    assert!(
        matches!(&settled_outcome(&h, &a.peer, "r1")[..], [SettleOutcome::Failed { reason: m, .. }] if m.contains("returned -1"))
    );
    assert_eq!(h.count(is_first_failure("r2")), 0);
}

/// Rule 4: an ERROR after CONTINUEs keeps earlier answers; only what is still pending becomes
/// Uncertain.
#[actix::test]
async fn continue_ok_then_error_keeps_ok_and_makes_the_rest_uncertain() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Continue, &["r1"], &[], None);
    a.respond(Error, &[], &[], Some("exception while serving"));
    h.wait_for("r2 failure", is_first_failure("r2")).await;
    assert_eq!(settled_outcome(&h, &a.peer, "r1"), vec![SettleOutcome::Ok]);
    assert!(matches!(
        &settled_outcome(&h, &a.peer, "r2")[..],
        [SettleOutcome::Uncertain { .. }]
    ));
    b.respond(Finish, &["r1", "r2"], &[], None);
    let c1 = h.wait_for("r1", is_completion("r1")).await;
    assert!(matches!(
        c1,
        KvEvent::Completion {
            outcome: Outcome::Ok,
            ..
        }
    ));
    h.wait_for("r2", is_completion("r2")).await;
    assert_eq!(h.count(is_first_failure("r1")), 0);
}

/// Rule 3: FINISH settles whatever it omitted as Failed (no leak).
#[actix::test]
async fn finish_omitting_a_request_fails_it_for_that_peer() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Finish, &["r1"], &[], None);
    b.respond(Finish, &["r1", "r2"], &[], None);
    h.wait_for("r2 completion", is_completion("r2")).await;
    assert_eq!(
        settled_outcome(&h, &a.peer, "r2"),
        vec![SettleOutcome::failed(Cause::Omitted, OMITTED)]
    );
    assert_eq!(h.count(is_first_failure("r2")), 1);
}

/// Rules 1+8: duplicate, unknown and after-completion ids are stale, summed up in one event per
/// reply: no second completion.
#[actix::test]
async fn duplicate_unknown_and_late_ids_are_stale() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Continue, &["r1", "r1", "nobody"], &[], None);
    let st = h
        .wait_for("stale summary", |e| matches!(e, KvEvent::Stale { .. }))
        .await;
    assert!(
        matches!(&st, KvEvent::Stale { count: 2, sample, .. } if sample.iter().map(|s| &**s).eq(["r1", "nobody"])),
        "{st:?}"
    );
    b.respond(Finish, &["r1"], &[], None);
    h.wait_for("r1 completion", is_completion("r1")).await;
    a.respond(Finish, &["r2", "r1"], &["r1"], None);
    h.wait_for("a's FINISH", is_settled(&a.peer, "r2")).await;
    let stale: Vec<usize> = h
        .seen
        .borrow()
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stale { count, .. } => Some(*count),
            _ => None,
        })
        .collect();
    // r1 in err_reqs and in ok_reqs after it was settled: one event counting both.
    assert_eq!(stale, vec![2, 2], "one stale event per reply");
    assert_eq!(h.count(is_completion("r1")), 1);
    assert_eq!(
        h.count(is_first_failure("r1")),
        0,
        "a late err for a settled id is stale"
    );
    assert!(!b.is_open());
}

/// A peer that keeps naming ids that are not pending gets a `stale` event for its first
/// replies only: a host that does not read events must not grow with the peer's replies.
#[actix::test]
async fn a_pull_emits_a_bounded_number_of_stale_events() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    for _ in 0..20 {
        a.respond(Continue, &["nobody"], &[], None);
    }
    a.respond(Finish, &["r1"], &[], None);
    b.respond(Finish, &["r1"], &[], None);
    h.wait_for("completion", is_completion("r1")).await;
    assert_eq!(
        h.count(|e| matches!(e, KvEvent::Stale { .. })),
        kvrecv::actors::peer::STALE_EVENTS_PER_PULL as usize
    );
}

/// Rule 2: an id in both `ok_reqs` and `err_reqs` of one reply is a failure, not a success.
#[actix::test]
async fn an_id_in_both_lists_of_one_reply_settles_failed() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Finish, &["r1"], &["r1"], Some("te failed"));
    h.wait_for("first failure", is_first_failure("r1")).await;
    assert_eq!(
        settled_outcome(&h, &a.peer, "r1"),
        vec![SettleOutcome::failed(Cause::PeerError, "te failed")]
    );
    b.respond(Finish, &["r1"], &[], None);
    let c = h.wait_for("completion", is_completion("r1")).await;
    assert!(matches!(
        c,
        KvEvent::Completion {
            outcome: Outcome::Failed { .. },
            ..
        }
    ));
}

/// A hostile reply naming 1,000,000 ids (9 MB, under the frame cap) is refused at the list
/// header as malformed: the pull's pending request settles Uncertain, no id is echoed, and
/// the receiver keeps serving (the other peer's pull and the next batch complete).
#[actix::test]
async fn a_reply_naming_a_million_ids_is_refused_and_the_receiver_keeps_serving() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    let ids: Vec<String> = (0..1_000_000).map(|i| format!("id-{i:07}")).collect();
    let hostile = MooncakeXferResponse {
        status: Continue,
        ok_reqs: Some(ids),
        err_reqs: None,
        err_msg: None,
        layout_id: 0,
    };
    let t = std::time::Instant::now();
    a.reply(&hostile);
    h.wait_for("a's settle", is_settled(&a.peer, "r1")).await;
    // Informational only, never asserted.
    eprintln!("1,000,000-id reply settled in {:?}", t.elapsed());
    assert!(
        matches!(&settled_outcome(&h, &a.peer, "r1")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("malformed") && r.contains("1000000")),
        "{:?}",
        settled_outcome(&h, &a.peer, "r1")
    );
    b.respond(Finish, &["r1"], &[], None);
    let c = h.wait_for("r1 completion", is_completion("r1")).await;
    assert!(
        matches!(&c, KvEvent::Completion { uncertain_peers, .. } if *uncertain_peers == [a.peer.clone()])
    );
    h.load(vec![req("r2", &[2])]).await;
    for p in h.pulls(2).await {
        p.respond(Finish, &["r2"], &[], None);
    }
    let c2 = h.wait_for("r2 completion", is_completion("r2")).await;
    assert!(matches!(
        c2,
        KvEvent::Completion {
            outcome: Outcome::Ok,
            ..
        }
    ));
    assert!(!a.is_open(), "the hostile pull's channel is closed");
    assert_eq!(
        h.count(|e| matches!(e, KvEvent::Stale { .. })),
        0,
        "no id of the refused reply is echoed"
    );
}

/// Rule 6: an empty pull is sent to every peer and settled, but never published.
#[actix::test]
async fn empty_pull_asks_every_peer_and_publishes_nothing() {
    let mut h = Harness::start(Setup::default());
    let reply = h.load(vec![req("gone", &[]), req("r1", &[5])]).await;
    assert_eq!((reply.accepted, reply.awaiting), (2, 1));
    let pulls = h.pulls(2).await;
    for p in &pulls {
        let md = p.metadata();
        assert_eq!(
            md.req_blocks["gone"],
            ("t-gone".to_string(), vec![]),
            "empty outer list, as vLLM"
        );
        assert_eq!(md.req_blocks["r1"].1, vec![vec![5]]);
    }
    pulls[0].respond(Finish, &[], &[], None); // omits both
    pulls[1].respond(Finish, &["gone", "r1"], &[], None);
    h.wait_for("r1 completion", is_completion("r1")).await;
    h.wait_for("gone settled", is_settled(&pulls[0].peer, "gone"))
        .await;
    assert_eq!(
        h.count(is_first_failure("gone")) + h.count(is_completion("gone")),
        0
    );
    let step = h.coord.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
}

/// Rule 7: no writer (unknown engine) completes awaited requests Failed at once, empty ones never.
#[actix::test]
async fn topology_failure_fails_awaiting_requests_once() {
    let mut h = Harness::start(Setup::default());
    let mut r = req("r1", &[1]);
    r.remote_engine_id = Some("nope".into());
    let mut empty = req("e1", &[]);
    empty.remote_engine_id = Some("nope".into());
    h.load(vec![r, empty]).await;
    let c = h.wait_for("completion", is_completion("r1")).await;
    assert!(matches!(
        c,
        KvEvent::Completion {
            outcome: Outcome::Failed { peer: None, .. },
            ..
        }
    ));
    h.wait_for("release", is_released("r1")).await;
    let step = h.coord.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
    assert_eq!(step.invalid_block_ids, vec![1]);
    assert_eq!(h.count(is_first_failure("r1")), 1);
    assert_eq!(
        h.count(is_completion("e1")) + h.count(is_first_failure("e1")),
        0
    );
    assert!(h.opened.try_recv().is_err(), "no pull without a topology");
}

/// §6: a channel failure restarts the peer; what it owed is settled Uncertain exactly once and
/// the restarted peer serves the next pull.
#[actix::test]
async fn restart_mid_pull_settles_once_and_next_pull_works() {
    let mut h = Harness::start(Setup {
        p_tp: 1,
        ..Setup::default()
    });
    h.load(vec![req("r1", &[1])]).await;
    h.load(vec![req("r2", &[2])]).await;
    let p1 = h.next_pull().await;
    let p2 = h.next_pull().await;
    p1.fail("socket error");
    h.wait_for("restart", |e| matches!(e, KvEvent::PeerRestarted { .. }))
        .await;
    h.wait_for("r1", is_completion("r1")).await;
    h.wait_for("r2", is_completion("r2")).await;
    let me = peer(0, 0);
    assert!(
        matches!(&settled_outcome(&h, &me, "r1")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("socket error"))
    );
    assert!(
        matches!(&settled_outcome(&h, &me, "r2")[..], [SettleOutcome::Uncertain { reason: r, .. }] if r.contains("restarted"))
    );
    assert!(!p2.is_open(), "the old incarnation's channels are closed");
    // The same peer serves the next batch.
    h.load(vec![req("r3", &[3])]).await;
    let p3 = h.next_pull().await;
    assert_eq!(p3.peer, me);
    p3.respond(Finish, &["r3"], &[], None);
    let c = h.wait_for("r3", is_completion("r3")).await;
    assert!(matches!(
        c,
        KvEvent::Completion {
            outcome: Outcome::Ok,
            ..
        }
    ));
    assert_eq!(h.count(is_completion("r1")), 1);
    assert_eq!(h.count(is_completion("r2")), 1);
}

/// §5: a completion with an uncertain peer and no exact revocation is quarantined until the
/// data plane confirms the fence.
#[actix::test]
async fn quarantine_is_held_until_the_fence_is_confirmed() {
    let mut h = Harness::start(Setup {
        landing: ManualLanding::default(),
        p_tp: 1,
        ..Setup::default()
    });
    h.load(vec![req("r1", &[7, 8])]).await;
    let a = h.next_pull().await;
    a.respond(Error, &[], &[], Some("x"));
    h.wait_for("quarantine", |e| matches!(e, KvEvent::Quarantined { .. }))
        .await;
    assert_eq!(
        h.landing.revoked.lock().unwrap().as_slice(),
        ["r1"],
        "permits revoked first"
    );
    let stats = h.coord.block_manager.send(GetLedgerStats).await.unwrap();
    assert_eq!(stats.quarantined_blocks, 2);
    assert!(
        h.coord.drain().await.unwrap().finished_recving.is_empty(),
        "held: no completion to the host"
    );
    assert_eq!(h.landing.pending_fences(), vec![vec![peer(0, 0)]]);
    assert_eq!(h.landing.confirm_fences(), 1);
    let rel = h.wait_for("release", is_released("r1")).await;
    assert!(matches!(
        rel,
        KvEvent::Released {
            fenced: true,
            forced: false,
            ..
        }
    ));
    assert_eq!(
        h.coord.drain().await.unwrap().finished_recving,
        vec![ReqId::from("r1")]
    );
}

/// Whether `id` is released, as the host sees it: drained, and announced by a `Released`
/// event (returned). Two round trips through the BlockManager: an alarm the last clock move
/// fired was woken before the first drain was sent, so what it tells the BlockManager is
/// queued before the second.
async fn released_now(h: &mut Harness, id: &str) -> (bool, Option<KvEvent>) {
    let mut drained = false;
    for _ in 0..2 {
        let step = h.coord.drain().await.unwrap();
        drained |= step.finished_recving.iter().any(|r| &**r == id);
    }
    h.soak_events();
    let ev = h.seen.borrow().iter().find(|e| is_released(id)(e)).cloned();
    (drained, ev)
}

/// `id` is still quarantined: neither drained nor released.
async fn assert_still_held(h: &mut Harness, id: &str, when: &str) {
    let (drained, ev) = released_now(h, id).await;
    assert!(!drained && ev.is_none(), "{id} released {when}: {ev:?}");
}

/// `id` was released by its deadline, forced (no fence), and drained.
async fn assert_forced_release(h: &mut Harness, id: &str, when: &str) {
    let (drained, ev) = released_now(h, id).await;
    assert!(drained, "{id} not drained {when}");
    assert!(
        matches!(
            ev,
            Some(KvEvent::Released {
                fenced: false,
                forced: true,
                ..
            })
        ),
        "{id} not released forced {when}: {ev:?}"
    );
}

/// A request whose one peer fails it (an uncertain peer) on a landing that cannot revoke
/// exactly: quarantined now, at the paused clock's current instant.
async fn quarantine_now(h: &mut Harness, id: &str, block: u32) {
    h.load(vec![req(id, &[block])]).await;
    h.next_pull().await.respond(Error, &[], &[], None);
    h.wait_for(
        "quarantine",
        |e| matches!(e, KvEvent::Quarantined { req_id, .. } if &**req_id == id),
    )
    .await;
}

/// §5: a quarantine nobody can fence is held until its last-resort deadline, not a moment
/// less, and released then, flagged forced. Tokio's clock is paused and moved by hand
/// (`advance`: exact, and the runtime never moves it on its own while the test looks), so
/// the deadline is exact; the alarm's timer may round up to the next millisecond tick.
#[actix::test]
async fn quarantine_without_fence_is_released_at_the_deadline() {
    let ms = Duration::from_millis;
    tokio::time::pause();
    let mut h = Harness::start(Setup {
        landing: ManualLanding::default(),
        p_tp: 1,
        quarantine_deadline: ms(100),
        ..Setup::default()
    });
    quarantine_now(&mut h, "r1", 7).await; // t=0
    tokio::time::advance(ms(99)).await;
    assert_still_held(&mut h, "r1", "at t=99 (due at t=100)").await;
    tokio::time::advance(ms(2)).await;
    assert_forced_release(&mut h, "r1", "at t=101 (due at t=100)").await;
    assert_eq!(
        h.landing.confirm_fences(),
        1,
        "the fence was asked for; confirming late is harmless"
    );
}

/// Quarantines taken one after another are each held until their own deadline and released
/// then: the BlockManager's one alarm, armed for the earliest, is armed again for the next.
/// (Tokio's clock is paused and moved by hand: the deadlines are exact.)
#[actix::test]
async fn successive_quarantines_are_each_released_at_their_deadline() {
    let ms = Duration::from_millis;
    tokio::time::pause();
    let mut h = Harness::start(Setup {
        landing: ManualLanding::default(),
        p_tp: 1,
        quarantine_deadline: ms(100),
        ..Setup::default()
    });
    quarantine_now(&mut h, "r1", 7).await; // t=0: due at t=100
    tokio::time::advance(ms(50)).await;
    quarantine_now(&mut h, "r2", 8).await; // t=50: due at t=150
    tokio::time::advance(ms(49)).await;
    assert_still_held(&mut h, "r1", "at t=99 (due at t=100)").await;
    tokio::time::advance(ms(2)).await;
    assert_forced_release(&mut h, "r1", "at t=101 (due at t=100)").await;
    assert_still_held(&mut h, "r2", "at t=101 (due at t=150)").await;
    tokio::time::advance(ms(48)).await;
    assert_still_held(&mut h, "r2", "at t=149 (due at t=150)").await;
    tokio::time::advance(ms(2)).await;
    assert_forced_release(&mut h, "r2", "at t=151 (due at t=150)").await;
}

/// §5: a clean completion (no uncertain peer) is released at once, permits revoked first
/// (the landing finds the blocks still the request's when it revokes, and the harness finds no
/// live permit when the release is announced).
#[actix::test]
async fn ok_completion_revokes_then_releases() {
    let mut h = Harness::start(Setup {
        landing: ManualLanding::default(),
        ..Setup::default()
    });
    let blocks = h.allocate("r1", 2).await;
    h.load(vec![req("r1", &blocks)]).await;
    for p in h.pulls(2).await {
        p.respond(Finish, &["r1"], &[], None);
    }
    h.wait_for("release", is_released("r1")).await;
    assert_eq!(h.landing.revoked.lock().unwrap().as_slice(), ["r1"]);
    assert!(h.landing.pending_fences().is_empty());
}

async fn fan_out(p_tp: u32, p_pp: u32, d: DRank, expect: &[PeerId]) {
    let mut h = Harness::start(Setup {
        p_tp,
        p_pp,
        d,
        ..Setup::default()
    });
    h.load(vec![req("r1", &[1])]).await;
    let pulls = h.pulls(expect.len()).await;
    assert_eq!(
        pulls.iter().map(|p| p.peer.clone()).collect::<Vec<_>>(),
        expect
    );
    for p in &pulls {
        let md = p.metadata();
        assert_eq!(
            (md.remote_tp_size, md.remote_tp_rank, md.remote_pp_size),
            (d.tp_size, d.tp_rank, d.pp_size)
        );
    }
    let (last, rest) = pulls.split_last().unwrap();
    for p in rest {
        p.respond(Finish, &["r1"], &[], None);
        h.wait_for("settle", is_settled(&p.peer, "r1")).await;
    }
    // A round trip through the BlockManager lets the aggregator run first (single-threaded
    // system, FIFO wake-ups); a premature completion would show up here.
    assert!(h.coord.drain().await.unwrap().finished_recving.is_empty());
    h.soak_events();
    assert_eq!(
        h.count(is_completion("r1")),
        0,
        "no completion before every peer settled"
    );
    last.respond(Finish, &["r1"], &[], None);
    h.wait_for("completion", is_completion("r1")).await;
    // Peers publish Settled before the aggregator can see the settle, so in the event order the
    // completion must come after every peer's settle.
    let seen = h.seen.borrow();
    let done = seen.iter().position(is_completion("r1")).unwrap();
    for p in &pulls {
        let s = seen.iter().position(is_settled(&p.peer, "r1"));
        assert!(
            s.is_some_and(|s| s < done),
            "completion before {} settled",
            p.peer
        );
    }
    drop(seen);
    assert!(h.opened.try_recv().is_err(), "no extra peer asked");
}

#[actix::test]
async fn fan_out_p_tp2_to_d_tp1() {
    fan_out(2, 1, DRank::default(), &[peer(0, 0), peer(1, 0)]).await;
}

#[actix::test]
async fn fan_out_p_tp4_to_d_tp2() {
    let d = DRank {
        tp_size: 2,
        tp_rank: 1,
        pp_size: 1,
        pp_rank: 0,
    };
    fan_out(4, 1, d, &[peer(2, 0), peer(3, 0)]).await;
}

#[actix::test]
async fn fan_out_p_tp2_pp2_to_d_tp1_pp1() {
    fan_out(
        2,
        2,
        DRank::default(),
        &[peer(0, 0), peer(0, 1), peer(1, 0), peer(1, 1)],
    )
    .await;
}

/// Rule 9: `naive` completes on the first failure, naming the peer that can still write.
#[actix::test]
async fn naive_policy_completes_on_first_failure() {
    let mut h = Harness::start(Setup {
        policy: Policy::Naive,
        ..Setup::default()
    });
    h.load(vec![req("r1", &[1])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Finish, &[], &["r1"], Some("fail"));
    let c = h.wait_for("completion", is_completion("r1")).await;
    assert!(
        matches!(c, KvEvent::Completion { ref unsettled_peers, .. } if *unsettled_peers == vec![b.peer.clone()])
    );
    h.wait_for("release", is_released("r1")).await;
    assert_eq!(
        h.coord.drain().await.unwrap().finished_recving,
        vec![ReqId::from("r1")]
    );
    b.respond(Finish, &["r1"], &[], None);
    h.wait_for("b settles into nothing", is_settled(&b.peer, "r1"))
        .await;
    assert_eq!(h.count(is_completion("r1")), 1);
}

/// PROTOCOL.md §4: a request missing one of the three keys is refused at load_kv; the rest go on.
#[actix::test]
async fn load_kv_refuses_incomplete_requests_and_keeps_the_rest() {
    let mut h = Harness::start(Setup {
        p_tp: 1,
        ..Setup::default()
    });
    let mut bad = req("bad", &[1]);
    bad.transfer_id = None;
    let mut port = req("port", &[4]);
    port.remote_bootstrap_addr = Some("http://127.0.0.1:99999".into());
    let reply = h
        .load(vec![
            bad,
            req("ok", &[2]),
            req("ok", &[3]),
            req("far", &[999]),
            port,
        ])
        .await;
    assert_eq!(reply.accepted, 1);
    assert_eq!(reply.rejected.len(), 4);
    assert!(matches!(
        &reply.rejected[0],
        BatchError::MissingField {
            field: "transfer_id",
            ..
        }
    ));
    assert!(matches!(&reply.rejected[1], BatchError::Duplicate { .. }));
    assert!(matches!(
        &reply.rejected[2],
        BatchError::BlockOutOfRange { block: 999, .. }
    ));
    assert!(matches!(
        &reply.rejected[3],
        BatchError::BadBootstrapAddr { reason, .. } if reason.contains("65535")
    ));
    assert_eq!(h.next_pull().await.req_ids(), vec!["ok".to_string()]);
}

/// Rule 8 at the host boundary: a request id that is awaiting, or completed but not drained, is
/// refused in every later load_kv (also when two batches race for it); once drained it may be
/// loaded again. Without this the host sees `finished_recving: [d-1, d-1]`.
#[actix::test]
async fn a_live_request_id_is_refused_until_its_completion_is_drained() {
    let mut h = Harness::start(Setup::default());
    let (x, y) = futures::join!(
        h.load(vec![req("d-1", &[1])]),
        h.load(vec![req("d-1", &[2])])
    );
    assert_eq!(x.accepted + y.accepted, 1, "{x:?} {y:?}");
    let refused = if x.accepted == 1 { &y } else { &x };
    assert!(
        matches!(&refused.rejected[..], [BatchError::AlreadyLive { req_id }] if req_id == "d-1")
    );
    let pulls = h.pulls(2).await;
    let live = h.load(vec![req("d-1", &[3])]).await;
    assert!(matches!(
        &live.rejected[..],
        [BatchError::AlreadyLive { .. }]
    ));
    for p in &pulls {
        p.respond(Finish, &["d-1"], &[], None);
    }
    h.wait_for("release", is_released("d-1")).await;
    let undrained = h.load(vec![req("d-1", &[3])]).await;
    assert!(
        matches!(&undrained.rejected[..], [BatchError::AlreadyLive { .. }]),
        "completed but not drained is still live"
    );
    assert_eq!(
        h.coord.drain().await.unwrap().finished_recving,
        vec![ReqId::from("d-1")]
    );
    let again = h.load(vec![req("d-1", &[3])]).await;
    assert_eq!(
        (again.accepted, again.awaiting),
        (1, 1),
        "drained: loadable again"
    );
    let pulls = h.pulls(2).await;
    assert_eq!(pulls[0].metadata().req_blocks["d-1"].1, vec![vec![3]]);
    for p in &pulls {
        p.respond(Finish, &["d-1"], &[], None);
    }
    h.wait_for("second release", |e| {
        matches!(e, KvEvent::Released { req_id, blocks, .. } if &**req_id == "d-1" && *blocks == [3])
    })
    .await;
    assert_eq!(
        h.coord.drain().await.unwrap().finished_recving,
        vec![ReqId::from("d-1")],
        "one completion per accepted load"
    );
    assert_eq!(h.count(is_completion("d-1")), 2);
    assert!(h.opened.try_recv().is_err(), "no refused load was pulled");
}

/// A destination block belongs to one live request at a time (per KV-cache group): another
/// request naming it is refused until its blocks are released, quarantine included. A block
/// listed twice in one request is refused too. Requests without blocks are never live.
#[actix::test]
async fn a_block_of_a_live_request_is_refused_until_released() {
    let mut h = Harness::start(Setup {
        landing: ManualLanding::default(),
        p_tp: 1,
        ..Setup::default()
    });
    let r = h
        .load(vec![
            req("a", &[1, 2]),
            req("b", &[2, 3]),
            req("c", &[4, 4]),
        ])
        .await;
    assert_eq!(r.accepted, 1);
    assert!(
        matches!(&r.rejected[..], [
            BatchError::BlockInUse { req_id, block: 2, owner, .. },
            BatchError::DuplicateBlock { block: 4, .. },
        ] if req_id == "b" && owner == "a"),
        "{:?}",
        r.rejected
    );
    let pull = h.next_pull().await;
    assert_eq!(pull.req_ids(), vec!["a".to_string()]);
    pull.respond(Error, &[], &[], Some("x"));
    h.wait_for("quarantine", |e| matches!(e, KvEvent::Quarantined { .. }))
        .await;
    let held = h.load(vec![req("b", &[2])]).await;
    assert!(
        matches!(&held.rejected[..], [BatchError::BlockInUse { owner, .. }] if owner == "a"),
        "quarantined blocks are still owned"
    );
    assert_eq!(h.landing.confirm_fences(), 1);
    h.wait_for("release", is_released("a")).await;
    let reused = h.load(vec![req("b", &[2])]).await;
    assert_eq!(reused.accepted, 1, "released blocks may be loaded again");
    h.next_pull().await.respond(Finish, &["b"], &[], None);
    h.wait_for("b", is_completion("b")).await;
    for _ in 0..2 {
        let cleanup = h.load(vec![req("gone", &[])]).await;
        assert_eq!((cleanup.accepted, cleanup.awaiting), (1, 0));
        h.next_pull().await.respond(Finish, &["gone"], &[], None);
    }
}

/// PROTOCOL.md §2.1: the Peer lets the transport reuse a channel only after a clean FINISH; an
/// ERROR, a malformed reply or a CONTINUE left hanging keeps it from the pool.
#[actix::test]
async fn only_a_clean_finish_marks_the_channel_reusable() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Continue, &["r1"], &[], None);
    b.respond(Error, &[], &[], Some("boom"));
    h.wait_for("B settled r2", is_settled(&b.peer, "r2")).await;
    assert!(!b.finished_cleanly(), "ERROR: never reused");
    assert!(!a.finished_cleanly(), "CONTINUE: the pull is not over");
    a.respond(Finish, &["r2"], &[], None);
    h.wait_for("A settled r2", is_settled(&a.peer, "r2")).await;
    assert!(a.finished_cleanly());

    h.load(vec![req("r3", &[3])]).await;
    let [c, d]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    c.reply_frames(vec![b"\xc1 not msgpack".to_vec()]);
    d.respond(Finish, &["r3"], &[], None);
    h.wait_for("completion", is_completion("r3")).await;
    assert!(!c.finished_cleanly(), "malformed: never reused");
    assert!(d.finished_cleanly());
}

/// Two requests loaded, answered by both peers and released: ready in the next drain.
async fn two_released(h: &mut Harness) {
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    for p in h.pulls(2).await {
        p.respond(Finish, &["r1", "r2"], &[], None);
    }
    h.wait_for("release r1", is_released("r1")).await;
    h.wait_for("release r2", is_released("r2")).await;
}

fn sorted(ids: &[ReqId]) -> Vec<String> {
    let mut v: Vec<String> = ids.iter().map(|r| r.to_string()).collect();
    v.sort();
    v
}

/// A host drains inside `select!` or `timeout`: a drain is done at its first poll (it waits for
/// nothing), so it cannot be dropped halfway and lose a step's completions. Until drained, a
/// finished id stays live; what a drain handed over it hands over once, and its ids may be
/// loaded again at once (the drain hands them over before it returns).
#[actix::test]
async fn a_drain_is_done_at_its_first_poll_and_frees_its_ids_for_the_next_load() {
    let mut h = Harness::start(Setup::default());
    two_released(&mut h).await;
    let early = h.load(vec![req("r1", &[7])]).await;
    assert!(
        matches!(early.rejected.as_slice(), [BatchError::AlreadyLive { .. }]),
        "not drained yet: {early:?}"
    );
    let step = {
        let mut drain = std::pin::pin!(h.coord.drain());
        match futures::poll!(drain.as_mut()) {
            std::task::Poll::Ready(step) => step.unwrap(),
            std::task::Poll::Pending => panic!("a drain waits for nothing"),
        }
    };
    assert_eq!(sorted(&step.finished_recving), ["r1", "r2"]);
    assert!(
        h.coord.drain().await.unwrap().is_empty(),
        "handed over once"
    );
    let again = h.load(vec![req("r1", &[7])]).await;
    assert!(again.rejected.is_empty(), "{again:?}");
}

/// A host on the actors' own thread that drains in a loop until its requests finished: an
/// empty drain yields, so the actors run and the loop ends (without the yield it would spin on
/// an outbox nothing can fill).
#[actix::test]
async fn a_host_draining_in_a_loop_on_the_actors_thread_lets_them_finish() {
    let mut h = Harness::start(Setup::default());
    h.load(vec![req("r1", &[1]), req("r2", &[2])]).await;
    for p in h.pulls(2).await {
        p.respond(Finish, &["r1", "r2"], &[], None);
    }
    let mut finished = vec![];
    for _ in 0..1_000 {
        finished.extend(h.coord.drain().await.unwrap().finished_recving);
        if finished.len() == 2 {
            break;
        }
    }
    assert_eq!(sorted(&finished), ["r1", "r2"]);
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn aborted_uncertain() -> SettleOutcome {
    SettleOutcome::uncertain(Cause::Aborted, kvrecv::messages::ABORTED_BY_HOST)
}

fn aborted_answered() -> SettleOutcome {
    SettleOutcome::failed(Cause::Aborted, kvrecv::messages::ABORTED_BY_HOST)
}

async fn abort(h: &Harness, id: &str) -> kvrecv::messages::AbortReply {
    h.coord
        .receiver
        .send(kvrecv::messages::Abort { req_id: id.into() })
        .await
        .expect("receiver alive")
}

/// An abort settles nothing by itself: P's answer does (Failed, aborted: P stopped), and a peer
/// that does not answer settles Uncertain once the abort's grace has passed (its pull owes
/// nothing else), not at the pull deadline. (Tokio's clock is paused: the grace is exact.)
#[actix::test]
async fn an_abort_waits_for_ps_answer_for_at_most_its_grace() {
    tokio::time::pause();
    let mut h = Harness::start(Setup {
        pull_timeout: ms(60_000),
        abort_grace: ms(500),
        ..Setup::default()
    });
    h.load(vec![req("r1", &[1])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    assert_eq!(abort(&h, "r1").await.peers_settled, 2);
    tokio::time::sleep(ms(400)).await;
    h.soak_events();
    assert_eq!(
        h.count(|e| matches!(e, KvEvent::Settled { .. })),
        0,
        "nothing settles before P answers or the grace passes"
    );
    a.respond(Finish, &["r1"], &[], None);
    h.wait_for("a's settle", is_settled(&a.peer, "r1")).await;
    assert_eq!(settled_outcome(&h, &a.peer, "r1"), vec![aborted_answered()]);
    assert!(b.is_open());
    tokio::time::sleep(ms(150)).await;
    let c = h.wait_for("completion", is_completion("r1")).await;
    assert_eq!(
        settled_outcome(&h, &b.peer, "r1"),
        vec![aborted_uncertain()]
    );
    let KvEvent::Completion {
        uncertain_peers, ..
    } = c
    else {
        unreachable!()
    };
    assert_eq!(
        uncertain_peers,
        vec![b.peer.clone()],
        "only the silent peer is a suspect"
    );
}

/// A Peer no pull was handed for `peer_retire_after` is retired: the Receiver forgets it (a
/// bootstrap server listing peers that come and go leaves nothing behind), and a later pull to
/// the same address gets a new Peer that serves it. (Tokio's clock is paused.)
#[actix::test]
async fn idle_peers_are_retired_and_a_later_pull_gets_a_new_one() {
    tokio::time::pause();
    let mut h = Harness::start(Setup {
        peer_retire_after: ms(1000),
        ..Setup::default()
    });
    let receiver = h.coord.receiver.clone();
    let peers = || async { receiver.send(kvrecv::messages::CountPeers).await.unwrap() };
    h.load(vec![req("r1", &[1])]).await;
    for p in h.pulls(2).await {
        p.respond(Finish, &["r1"], &[], None);
    }
    h.wait_for("completion", is_completion("r1")).await;
    assert_eq!(peers().await, count(2, 0));
    tokio::time::sleep(ms(3000)).await;
    assert_eq!(
        peers().await,
        count(0, 0),
        "both retired and stopped (nothing was in flight)"
    );
    h.coord.drain().await.unwrap();
    h.load(vec![req("r2", &[2])]).await;
    for p in h.pulls(2).await {
        p.respond(Finish, &["r2"], &[], None);
    }
    let c = h.wait_for("completion", is_completion("r2")).await;
    assert!(
        matches!(
            c,
            KvEvent::Completion {
                outcome: Outcome::Ok,
                ..
            }
        ),
        "{c:?}"
    );
    assert_eq!(peers().await, count(2, 0));
}

/// A Peer retired while a pull is still in flight serves that pull to its end, and an abort
/// still reaches it; it is gone from the Receiver at once. (Tokio's clock is paused.)
#[actix::test]
async fn a_peer_retired_mid_pull_serves_it_and_still_hears_aborts() {
    tokio::time::pause();
    let mut h = Harness::start(Setup {
        peer_retire_after: ms(1000),
        ..Setup::default()
    });
    h.load(vec![req("r1", &[1])]).await;
    let [a, b]: [_; 2] = h.pulls(2).await.try_into().ok().unwrap();
    a.respond(Finish, &["r1"], &[], None);
    tokio::time::sleep(ms(3000)).await;
    let receiver = h.coord.receiver.clone();
    let peers = || async { receiver.send(kvrecv::messages::CountPeers).await.unwrap() };
    assert_eq!(
        peers().await,
        count(0, 1),
        "both forgotten by the Receiver; a stopped, b still serving its pull"
    );
    assert!(b.is_open(), "b's pull is still served");
    assert_eq!(
        abort(&h, "r1").await.peers_settled,
        1,
        "the abort reached b"
    );
    b.respond(Finish, &["r1"], &[], None);
    h.wait_for("completion", is_completion("r1")).await;
    assert_eq!(settled_outcome(&h, &b.peer, "r1"), vec![aborted_answered()]);
    settle_down(&mut h).await;
    assert_eq!(peers().await, count(0, 0), "b stopped after its last pull");
}

fn count(serving: usize, retiring: usize) -> kvrecv::messages::PeerCount {
    kvrecv::messages::PeerCount { serving, retiring }
}

/// A host that drops its actix system without stopping it (the runtime goes with it, and actix
/// polls every actor once more from its drop, outside any runtime) must not panic there: the
/// Receiver's periodic sweep is armed only while a runtime is there. Both a coordinator never
/// polled (started from its drop) and one that served are dropped so.
#[test]
fn a_system_dropped_without_stopping_drops_the_coordinator_quietly() {
    // tokio catches a panic in a task's drop and prints it: count the ones on this thread.
    thread_local!(static PANICS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) });
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.with(|p| p.set(p.get() + 1));
        prev(info)
    }));
    let sys = actix::System::new();
    let h = sys.block_on(async { Harness::start(Setup::default()) });
    drop(h);
    drop(sys);
    let sys = actix::System::new();
    let mut h = sys.block_on(async { Harness::start(Setup::default()) });
    sys.block_on(async {
        h.load(vec![req("a", &[1])]).await;
        h.pulls(2).await;
    });
    drop(h);
    drop(sys);
    assert_eq!(
        PANICS.with(|p| p.get()),
        0,
        "a panic while dropping the actors"
    );
}
