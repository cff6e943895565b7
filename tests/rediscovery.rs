//! A P engine that restarts behind the same bootstrap URL on NEW worker ports is rediscovered,
//! end to end: kvrecv's D (Coordinator + ZmqTransport + HTTP bootstrap client) against the
//! in-process prefill simulator over real loopback sockets.
//!
//! The peers' restart backoff is set far beyond the hang guard (`SAFETY`, 30 s): a request
//! parked behind a dead peer's backoff would never complete inside the test, so every completion
//! awaited during the outage proves the failure was reported at once, without a wall-clock
//! assertion.

#[path = "net/mod.rs"]
mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use kvrecv::config::KvRecvConfig;
use kvrecv::messages::{Cause, KvEvent, LoadKv, Outcome, SettleOutcome};
use kvrecv::sim::{PrefillSim, SimConfig};

const LONG: Duration = Duration::from_secs(60);
/// Longer than any test may run.
const FOREVER: Duration = Duration::from_secs(600);

fn addrs(s: &PrefillSim) -> Vec<String> {
    s.workers().iter().map(|w| w.addr().to_owned()).collect()
}

fn cfg(topology_retry: Duration) -> KvRecvConfig {
    KvRecvConfig {
        peer_backoff_base: FOREVER,
        peer_backoff_max: FOREVER,
        topology_retry_base: topology_retry,
        topology_retry_max: topology_retry,
        ..config(LONG)
    }
}

/// Settled events seen for `req`.
fn settles_of(h: &Harness, req: &str) -> Vec<(String, SettleOutcome)> {
    h.seen
        .iter()
        .filter_map(|e| match e {
            KvEvent::Settled {
                req_id,
                peer,
                outcome,
                ..
            } if &**req_id == req => Some((peer.addr().to_owned(), outcome.clone())),
            _ => None,
        })
        .collect()
}

/// A healthy TP2 engine, then the engine crashes (workers and its bootstrap server), comes back
/// on new ports, and D finds it again.
#[actix::test]
async fn p_engine_restarted_on_new_ports_is_rediscovered() {
    let mut s = PrefillSim::start(SimConfig {
        tp_size: 2,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let url = s.bootstrap_url();
    let engine = s.engine_id().to_owned();
    let old = addrs(&s);
    // Lookups of an unhealthy engine are not rate limited here, so when D asks again is decided
    // by events, not by the clock (the backoff has its own tests, below and in rediscovery.rs).
    let mut h = Harness::start(cfg(Duration::ZERO));

    h.load(vec![req("ok-1", "t-1", &engine, &url, &[1])]).await;
    assert_eq!(h.completion("ok-1").await.0, Outcome::Ok);
    assert_eq!(s.bootstrap().query_count(), 1);

    // The whole engine dies. The cached topology still names the old workers: the first
    // request after the crash finds them gone and fails. Each peer's settle depends on when
    // libzmq notices: a pooled connection that took the request before it dropped is
    // Uncertain; a request that was never taken (the connection already gone, or refused) is
    // Failed, never sent. Never Ok.
    s.crash_engine().await;
    h.load(vec![req("down-1", "t-2", &engine, &url, &[2])])
        .await;
    let (outcome, uncertain) = h.completion("down-1").await;
    assert!(!outcome.is_ok());
    let settles = settles_of(&h, "down-1");
    assert_eq!(settles.len(), 2, "{settles:?}");
    for (peer, st) in &settles {
        assert!(old.contains(peer), "{peer}");
        let lost = matches!(st, SettleOutcome::Uncertain { .. });
        let unsent = matches!(
            st,
            SettleOutcome::Failed {
                cause: Cause::NotSent,
                ..
            }
        );
        assert!(lost || unsent, "{peer}: {st:?}");
        assert_eq!(
            lost,
            uncertain.iter().any(|u| u.addr() == peer),
            "{peer}: only a peer that may have the request is a suspect"
        );
    }
    for a in &old {
        h.restarted(a).await;
    }

    // Outage: the old peers are in a restart backoff longer than the test. Each batch drops the
    // stale topology, asks bootstrap (down too) and fails at once; no pull is sent.
    for i in 0..3 {
        let id = format!("outage-{i}");
        h.load(vec![req(&id, &format!("t-o{i}"), &engine, &url, &[3])])
            .await;
        let (outcome, _) = h.completion(&id).await;
        assert!(
            matches!(&outcome, Outcome::Failed { peer: None, cause: kvrecv::Cause::NotSent, reason } if reason.contains("bootstrap")),
            "{id}: {outcome:?}"
        );
        assert!(settles_of(&h, &id).is_empty(), "{id} was sent to a peer");
    }

    // P comes back: same bootstrap URL, new worker ports.
    let new = s.restart_engine_on_new_ports().await.expect("restart");
    assert!(new.iter().all(|a| !old.contains(a)), "{old:?} -> {new:?}");
    let queries = s.bootstrap().query_count();
    let mut attempts = 0;
    let ok_id = loop {
        attempts += 1;
        assert!(
            attempts <= 3,
            "not rediscovered after {} attempts",
            attempts - 1
        );
        let id = format!("back-{attempts}");
        // Two batches issued together: one `GET /query` serves both.
        let twin = format!("{id}-twin");
        let (a, b) = futures::join!(
            h.coord.load_kv(LoadKv {
                requests: vec![req(&id, &format!("t-{id}"), &engine, &url, &[4])],
            }),
            h.coord.load_kv(LoadKv {
                requests: vec![req(&twin, &format!("t-{twin}"), &engine, &url, &[5])],
            }),
        );
        assert!(a.unwrap().rejected.is_empty() && b.unwrap().rejected.is_empty());
        let first = h.completion(&id).await.0;
        let second = h.completion(&twin).await.0;
        if first.is_ok() {
            assert!(second.is_ok());
            break id;
        }
    };
    assert_eq!(attempts, 1, "the first batch after P is back finds it");
    assert_eq!(
        s.bootstrap().query_count(),
        queries + 1,
        "concurrent lookups share one query"
    );
    let settled_by: HashSet<String> = settles_of(&h, &ok_id).into_iter().map(|(p, _)| p).collect();
    assert_eq!(settled_by, new.iter().cloned().collect::<HashSet<_>>());
    // The dead incarnation's workers were never asked again after the crash.
    let after_crash: Vec<_> = h
        .seen
        .iter()
        .skip_while(|e| !matches!(e, KvEvent::Completion { req_id, .. } if &**req_id == "down-1"))
        .filter(
            |e| matches!(e, KvEvent::Settled { peer, .. } if old.contains(&peer.addr().to_owned())),
        )
        .collect();
    assert!(after_crash.is_empty(), "{after_crash:?}");
}

/// Workers die but the bootstrap server stays up (an external one) and still lists them: D
/// fails batches at once naming the dead peer, and asks bootstrap again at most once per backoff
/// step instead of on every batch.
#[actix::test]
async fn dead_workers_still_registered_fail_at_once_without_hammering_bootstrap() {
    let mut s = PrefillSim::start(SimConfig {
        tp_size: 2,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let url = s.bootstrap_url();
    let engine = s.engine_id().to_owned();
    let old = addrs(&s);
    let mut h = Harness::start(cfg(FOREVER));

    h.load(vec![req("ok-1", "t-1", &engine, &url, &[1])]).await;
    assert_eq!(h.completion("ok-1").await.0, Outcome::Ok);
    s.crash_worker(0, 0).await;
    s.crash_worker(1, 0).await;
    h.load(vec![req("down-1", "t-2", &engine, &url, &[2])])
        .await;
    assert!(!h.completion("down-1").await.0.is_ok());
    for a in &old {
        h.restarted(a).await;
    }
    assert_eq!(s.bootstrap().query_count(), 1);

    for i in 0..4 {
        let id = format!("outage-{i}");
        h.load(vec![req(&id, &format!("t-o{i}"), &engine, &url, &[3])])
            .await;
        let (outcome, _) = h.completion(&id).await;
        assert!(
            matches!(&outcome, Outcome::Failed { peer: None, cause: kvrecv::Cause::NotSent, reason }
                if reason.contains("is down") && old.iter().any(|a| reason.contains(a.as_str()))),
            "{id}: {outcome:?}"
        );
        assert!(settles_of(&h, &id).is_empty(), "{id} was sent to a peer");
    }
    // One refresh after the failure; the rest within its backoff use the cached view.
    assert_eq!(s.bootstrap().query_count(), 2);
}
