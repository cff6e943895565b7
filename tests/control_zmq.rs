//! kvrecv's D (Coordinator + ZmqTransport + HTTP bootstrap client) against the in-process
//! prefill simulator over real loopback sockets: every way a peer can misbehave (issue 3, item 2)
//! ends in the settle DESIGN.md §4 prescribes, with exactly one completion per request.

#[path = "net/mod.rs"]
mod common;

use kvrecv::messages::Cause;
use std::time::Duration;

use common::*;
use kvrecv::actors::peer_state::OMITTED;
use kvrecv::control::ZmqTransportConfig;
use kvrecv::messages::{KvEvent, Outcome, SettleOutcome};
use kvrecv::sim::{Faults, Malformed, PrefillSim, SimConfig, READINESS_TIMEOUT_MSG};

const LONG: Duration = Duration::from_secs(60);

async fn sim(tp: u32, ready_immediately: bool) -> PrefillSim {
    PrefillSim::start(SimConfig {
        tp_size: tp,
        ready_immediately,
        ..SimConfig::default()
    })
    .await
    .expect("simulator")
}

fn addrs(s: &PrefillSim) -> Vec<String> {
    s.workers().iter().map(|w| w.addr().to_owned()).collect()
}

#[actix::test]
async fn tp2_to_tp1_healthy_pull_completes_ok_from_both_peers() {
    let s = sim(2, true).await;
    let mut h = Harness::start(config(LONG));
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[1, 2, 3],
    )])
    .await;
    let (outcome, uncertain) = h.completion("d-1").await;
    assert_eq!(outcome, Outcome::Ok);
    assert!(uncertain.is_empty());
    for a in addrs(&s) {
        assert_eq!(h.settle("d-1", &a).await, SettleOutcome::Ok);
    }
    let out = h.coord.drain().await.unwrap();
    assert_eq!(&*out.finished_recving[0], "d-1");
    assert!(out.invalid_block_ids.is_empty());
}

#[actix::test]
async fn err_reqs_from_one_peer_fail_the_request_after_both_settle() {
    let s = sim(2, true).await;
    s.set_faults(
        1,
        0,
        Faults {
            failure_rate: 1.0,
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(LONG));
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[4, 5],
    )])
    .await;
    let (outcome, uncertain) = h.completion("d-1").await;
    let a = addrs(&s);
    assert!(
        matches!(&outcome, Outcome::Failed { reason, .. } if reason.contains("transfer engine")),
        "{outcome:?}"
    );
    assert!(
        uncertain.is_empty(),
        "err_reqs is an answer, not uncertainty"
    );
    assert_eq!(h.settle("d-1", &a[0]).await, SettleOutcome::Ok);
    assert!(matches!(
        h.settle("d-1", &a[1]).await,
        SettleOutcome::Failed { .. }
    ));
    h.wait_for("first failure", |e| {
        matches!(e, KvEvent::FirstFailure { .. })
    })
    .await;
    let out = h.coord.drain().await.unwrap();
    assert_eq!(out.invalid_block_ids, vec![4, 5]);
    assert_eq!(h.completions_seen("d-1"), 1);
}

#[actix::test]
async fn peer_wide_error_without_err_reqs_is_uncertain() {
    let s = sim(1, true).await;
    s.set_faults(
        0,
        0,
        Faults {
            reject_pulls: Some("This D tp_rank 0 is not paired".into()),
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(LONG));
    h.load(vec![
        req("d-1", "t-1", s.engine_id(), &s.bootstrap_url(), &[1]),
        req("d-2", "t-2", s.engine_id(), &s.bootstrap_url(), &[2]),
    ])
    .await;
    let a = &addrs(&s)[0];
    for r in ["d-1", "d-2"] {
        let st = h.settle(r, a).await;
        assert!(
            is_uncertain(&st) && reason(&st).contains("not paired"),
            "{st:?}"
        );
        let (outcome, uncertain) = h.completion(r).await;
        assert!(!outcome.is_ok());
        assert_eq!(uncertain.len(), 1);
    }
}

#[actix::test]
async fn error_naming_the_subset_fails_those_and_leaves_the_rest_uncertain() {
    let s = sim(1, false).await;
    s.set_faults(
        0,
        0,
        Faults {
            error_after_subsets: Some(0),
            error_names_subset: true,
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(LONG));
    h.load(vec![
        req("d-1", "t-1", s.engine_id(), &s.bootstrap_url(), &[1]),
        req("d-2", "t-2", s.engine_id(), &s.bootstrap_url(), &[2]),
    ])
    .await;
    // Only t-1 becomes ready: the ERROR names d-1 and never answers d-2.
    s.mark_ready("t-1");
    let a = &addrs(&s)[0];
    assert!(matches!(
        h.settle("d-1", a).await,
        SettleOutcome::Failed { .. }
    ));
    assert!(is_uncertain(&h.settle("d-2", a).await));
}

#[actix::test]
async fn error_after_continue_keeps_earlier_outcomes() {
    let s = sim(1, false).await;
    s.set_faults(
        0,
        0,
        Faults {
            error_after_subsets: Some(1),
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(LONG));
    h.load(vec![
        req("d-1", "t-1", s.engine_id(), &s.bootstrap_url(), &[1]),
        req("d-2", "t-2", s.engine_id(), &s.bootstrap_url(), &[2]),
    ])
    .await;
    let a = &addrs(&s)[0];
    s.mark_ready("t-1");
    assert_eq!(h.settle("d-1", a).await, SettleOutcome::Ok); // CONTINUE ok_reqs=[d-1]
    assert_eq!(h.completion("d-1").await.0, Outcome::Ok);
    s.mark_ready("t-2");
    let st = h.settle("d-2", a).await;
    assert!(
        is_uncertain(&st) && reason(&st).contains("simulated exception"),
        "{st:?}"
    );
    assert!(!h.completion("d-2").await.0.is_ok());
    assert_eq!(h.completions_seen("d-1"), 1);
}

#[actix::test]
async fn finish_omitting_a_request_settles_it_failed() {
    let s = sim(1, true).await;
    s.set_faults(
        0,
        0,
        Faults {
            omission_rate: 1.0,
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(LONG));
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[1],
    )])
    .await;
    assert_eq!(
        h.settle("d-1", &addrs(&s)[0]).await,
        SettleOutcome::failed(Cause::Omitted, OMITTED)
    );
    let (outcome, uncertain) = h.completion("d-1").await;
    assert!(!outcome.is_ok() && uncertain.is_empty());
}

#[actix::test]
async fn readiness_timeout_finish_fails_the_pending_requests() {
    let s = PrefillSim::start(SimConfig {
        ready_immediately: false,
        readiness_timeout: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut h = Harness::start(config(LONG));
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[1],
    )])
    .await;
    assert_eq!(
        h.settle("d-1", &addrs(&s)[0]).await,
        SettleOutcome::failed(Cause::PeerError, READINESS_TIMEOUT_MSG)
    );
}

#[actix::test]
async fn unknown_and_duplicate_ids_are_stale_and_change_nothing() {
    let s = sim(1, false).await;
    s.set_faults(
        0,
        0,
        Faults {
            unknown_ids: true,
            duplicate_ids: true,
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(LONG));
    h.load(vec![
        req("d-1", "t-1", s.engine_id(), &s.bootstrap_url(), &[1]),
        req("d-2", "t-2", s.engine_id(), &s.bootstrap_url(), &[2]),
    ])
    .await;
    s.mark_ready("t-1");
    assert_eq!(h.completion("d-1").await.0, Outcome::Ok);
    s.mark_ready("t-2");
    assert_eq!(h.completion("d-2").await.0, Outcome::Ok);
    // The second answer repeats d-1 (duplicate) and both name an id never asked for.
    let named = |id: &'static str| move |e: &KvEvent| matches!(e, KvEvent::Stale { sample, pull_id, .. } if *pull_id > 0 && sample.iter().any(|s| &**s == id));
    h.wait_for("stale duplicate", named("d-1")).await;
    h.wait_for("stale unknown", named("never-asked-for")).await;
    assert_eq!(h.completions_seen("d-1"), 1);
    assert_eq!(h.completions_seen("d-2"), 1);
}

async fn malformed_case(
    m: Malformed,
    zmq: ZmqTransportConfig,
) -> (SettleOutcome, Harness, PrefillSim) {
    let s = sim(1, true).await;
    s.set_faults(
        0,
        0,
        Faults {
            malformed: Some(m),
            ..Faults::default()
        },
    );
    let mut h = Harness::start_with(config(LONG), zmq);
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[1],
    )])
    .await;
    let st = h.settle("d-1", &addrs(&s)[0]).await;
    let (outcome, uncertain) = h.completion("d-1").await;
    assert!(!outcome.is_ok());
    assert_eq!(
        uncertain.len(),
        1,
        "a malformed reply says nothing about the peer's writes"
    );
    (st, h, s)
}

#[actix::test]
async fn garbage_multi_frame_and_bad_status_replies_are_malformed() {
    for m in [
        Malformed::Garbage,
        Malformed::MultiFrame,
        Malformed::BadStatus,
    ] {
        let (st, _h, _s) = malformed_case(m.clone(), ZmqTransportConfig::default()).await;
        assert!(
            is_uncertain(&st) && reason(&st).contains("malformed reply"),
            "{m:?}: {st:?}"
        );
    }
}

#[actix::test]
async fn oversized_reply_drops_the_connection_and_restarts_the_peer() {
    let zmq = ZmqTransportConfig {
        max_msg_size: 64 * 1024,
        ..ZmqTransportConfig::default()
    };
    let (st, mut h, s) = malformed_case(Malformed::Oversized(256 * 1024), zmq).await;
    assert!(
        is_uncertain(&st) && reason(&st).contains("connection lost"),
        "{st:?}"
    );
    h.restarted(&addrs(&s)[0]).await;
}

/// A P that never answers is settled Uncertain at the pull's deadline, over real ZMQ. The only
/// peer is the silent one, so the deadline races nothing (a healthy peer's answer within it is
/// `each_pull_expires_at_its_own_deadline` in tests/actors.rs, on a paused clock) and may be
/// short.
#[actix::test]
async fn silent_peer_hits_the_deadline() {
    let s = sim(1, true).await;
    s.set_faults(
        0,
        0,
        Faults {
            hang: true,
            ..Faults::default()
        },
    );
    let mut h = Harness::start(config(Duration::from_millis(20)));
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[1],
    )])
    .await;
    let a = addrs(&s);
    let st = h.settle("d-1", &a[0]).await;
    assert!(
        is_uncertain(&st) && reason(&st).contains("deadline"),
        "{st:?}"
    );
    let (_, uncertain) = h.completion("d-1").await;
    assert_eq!(
        uncertain
            .iter()
            .map(|p| p.addr().to_owned())
            .collect::<Vec<_>>(),
        vec![a[0].clone()]
    );
}

#[actix::test]
async fn peer_dying_mid_pull_is_uncertain_then_restart_and_next_pull_works() {
    let mut s = sim(1, false).await;
    s.set_faults(
        0,
        0,
        Faults {
            crash_after_subsets: Some(1),
            ..Faults::default()
        },
    );
    // No restart backoff: a pull during one fails at once, and P is back before the next one.
    let mut h = Harness::start(kvrecv::config::KvRecvConfig {
        peer_backoff_base: Duration::ZERO,
        peer_backoff_max: Duration::ZERO,
        ..config(LONG)
    });
    let url = s.bootstrap_url();
    h.load(vec![
        req("d-1", "t-1", s.engine_id(), &url, &[1]),
        req("d-2", "t-2", s.engine_id(), &url, &[2]),
    ])
    .await;
    let a = addrs(&s)[0].clone();
    s.mark_ready("t-1");
    assert_eq!(h.settle("d-1", &a).await, SettleOutcome::Ok);
    s.mark_ready("t-2"); // the worker dies instead of answering this subset
    let st = h.settle("d-2", &a).await;
    assert!(
        is_uncertain(&st) && reason(&st).contains("connection lost"),
        "{st:?}"
    );
    h.restarted(&a).await;
    assert!(!s.worker(0, 0).is_running());
    // P comes back on the same address; the restarted Peer's next pull goes through.
    s.set_faults(0, 0, Faults::default());
    s.restart_worker(0, 0).await.unwrap();
    s.readiness().set_all(true);
    h.load(vec![req("d-3", "t-3", s.engine_id(), &url, &[3])])
        .await;
    assert_eq!(h.completion("d-3").await.0, Outcome::Ok);
}

/// A refused connection never took the pull's request (`ZMQ_IMMEDIATE`: a DEALER takes a
/// message only into a connection): P cannot write for it, so it fails as never sent, with no
/// uncertain peer (whose landing window would be poisoned for the quarantine deadline), and the
/// peer restarts (its address may be stale).
#[actix::test]
async fn connection_refused_fails_as_never_sent_and_restarts_the_peer() {
    let s = PrefillSim::start(SimConfig {
        register: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    // Register an address nobody listens on: a port this test holds bound, not listening, for
    // its whole life (a released one could be taken by another test meanwhile).
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let dead = format!("tcp://{}", held.local_addr().unwrap());
    s.register(s.worker(0, 0).rank(), &dead).await.unwrap();
    let mut h = Harness::start(config(LONG));
    h.load(vec![req(
        "d-1",
        "t-1",
        s.engine_id(),
        &s.bootstrap_url(),
        &[1],
    )])
    .await;
    let st = h.settle("d-1", &dead).await;
    assert!(
        matches!(&st, SettleOutcome::Failed { cause: Cause::NotSent, reason }
            if reason.contains("refused")),
        "{st:?}"
    );
    let (outcome, uncertain) = h.completion("d-1").await;
    assert!(
        !outcome.is_ok() && uncertain.is_empty(),
        "{outcome:?} {uncertain:?}"
    );
    h.restarted(&dead).await;
}

#[actix::test]
async fn empty_pull_is_sent_and_settled_but_never_completes() {
    let s = sim(1, true).await;
    let mut h = Harness::start(config(LONG));
    let url = s.bootstrap_url();
    h.load(vec![req("d-0", "t-0", s.engine_id(), &url, &[])])
        .await;
    assert_eq!(h.settle("d-0", &addrs(&s)[0]).await, SettleOutcome::Ok);
    h.load(vec![req("d-1", "t-1", s.engine_id(), &url, &[1])])
        .await;
    assert_eq!(h.completion("d-1").await.0, Outcome::Ok);
    assert_eq!(h.completions_seen("d-0"), 0);
    assert!(!h
        .seen
        .iter()
        .any(|e| matches!(e, KvEvent::FirstFailure { .. })));
    assert_eq!(s.pulls_received(), 2);
}

#[actix::test]
async fn unknown_engine_fails_the_batch_at_once() {
    let s = sim(1, true).await;
    let mut h = Harness::start(config(LONG));
    h.load(vec![req(
        "d-1",
        "t-1",
        "no-such-engine",
        &s.bootstrap_url(),
        &[1],
    )])
    .await;
    let (outcome, _) = h.completion("d-1").await;
    assert!(
        matches!(&outcome, Outcome::Failed { peer: None, cause: Cause::NotSent, reason } if reason.contains("not registered")),
        "{outcome:?}"
    );
    assert_eq!(s.pulls_received(), 0);
}

/// Loads `ids` ("d-N", into block N) one at a time on engine `s`, each to its completion, and
/// returns the outcomes.
async fn one_at_a_time(h: &mut Harness, s: &PrefillSim, ids: &[&str]) -> Vec<Outcome> {
    let mut out = vec![];
    for id in ids {
        let tid = format!("t-{id}");
        let block: u32 = id.trim_start_matches("d-").parse().expect("d-N");
        h.load(vec![req(
            id,
            &tid,
            s.engine_id(),
            &s.bootstrap_url(),
            &[block],
        )])
        .await;
        out.push(h.completion(id).await.0);
    }
    out
}

#[actix::test]
async fn pulls_that_finish_cleanly_reuse_one_connection_per_peer() {
    let s = sim(2, true).await;
    let mut h = Harness::start(config(LONG));
    let ids = ["d-1", "d-2", "d-3", "d-4", "d-5"];
    let outcomes = one_at_a_time(&mut h, &s, &ids).await;
    assert!(outcomes.iter().all(|o| *o == Outcome::Ok), "{outcomes:?}");
    for w in s.workers() {
        assert_eq!(w.pulls_received(), ids.len());
        assert_eq!(w.connections_seen(), 1, "one DEALER per peer, reused");
    }
}

/// A pull that ends at its deadline closes its connection: the next pull dials a new one. The
/// deadline is d-2's own, brought forward by the host's abort (zero grace) once P has d-2 and
/// sits on it: the pulls' deadlines are long, so no healthy pull races a clock.
#[actix::test]
async fn a_socket_is_not_reused_after_a_deadline() {
    let (has_it, mut p_has) = tokio::sync::mpsc::unbounded_channel();
    let s = PrefillSim::start_with_writer(
        SimConfig {
            tp_size: 1,
            ready_immediately: true,
            ..SimConfig::default()
        },
        std::sync::Arc::new(HoldingWriter {
            held: "d-2",
            has_it,
        }),
    )
    .await
    .expect("simulator");
    let mut h = Harness::start(kvrecv::config::KvRecvConfig {
        abort_grace: Duration::ZERO,
        ..config(LONG)
    });
    assert_eq!(one_at_a_time(&mut h, &s, &["d-1"]).await, [Outcome::Ok]);
    // Reuses d-1's connection, which finished cleanly; then the deadline closes it.
    h.load(vec![req(
        "d-2",
        "t-2",
        s.engine_id(),
        &s.bootstrap_url(),
        &[2],
    )])
    .await;
    tokio::time::timeout(SAFETY, p_has.recv())
        .await
        .expect("P has d-2 in time");
    let abort = h
        .coord
        .receiver
        .send(kvrecv::messages::Abort {
            req_id: "d-2".into(),
        })
        .await
        .unwrap();
    assert_eq!(abort.peers_settled, 1, "{abort:?}");
    // No answer by the (abort's) deadline: Uncertain, the pull abandoned.
    let st = h.settle("d-2", s.worker(0, 0).addr()).await;
    assert!(
        matches!(
            st,
            SettleOutcome::Uncertain {
                cause: Cause::Aborted,
                ..
            }
        ),
        "{st:?}"
    );
    assert!(!h.completion("d-2").await.0.is_ok());
    assert_eq!(one_at_a_time(&mut h, &s, &["d-3"]).await, [Outcome::Ok]);
    let w = s.worker(0, 0);
    assert_eq!(w.pulls_received(), 3);
    assert_eq!(w.connections_seen(), 2, "d-3 went over a new connection");
}

#[actix::test]
async fn a_socket_is_not_reused_after_a_peer_error() {
    let s = sim(1, true).await;
    let mut h = Harness::start(config(LONG));
    s.set_faults(
        0,
        0,
        Faults {
            reject_pulls: Some("This D tp_rank 0 is not paired".into()),
            ..Faults::default()
        },
    );
    assert!(!one_at_a_time(&mut h, &s, &["d-1"]).await[0].is_ok());
    s.set_faults(0, 0, Faults::default());
    let outcomes = one_at_a_time(&mut h, &s, &["d-2", "d-3"]).await;
    assert_eq!(outcomes, [Outcome::Ok, Outcome::Ok]);
    let w = s.worker(0, 0);
    assert_eq!(w.pulls_received(), 3);
    assert_eq!(
        w.connections_seen(),
        2,
        "ERROR closed d-1's connection; d-3 reused d-2's"
    );
}
