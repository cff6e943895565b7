//! The front door from a plain multi-thread tokio host (no actix in this file): the builder
//! starts a whole D worker, the simulator's P writes real bytes through the Mooncake TE
//! initiator, and the host loads, drains and aborts through the `Send + Sync + Clone` handle.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use kvrecv::config::KvRecvConfig;
use kvrecv::embed::{EventStream, KvRecv, KvRecvBuilder, KvRecvError};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, ReqId, SettleOutcome, ABORTED_BY_HOST};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{KvWriter, PrefillSim, SimConfig, WriteJob};
use tokio::sync::{mpsc, Semaphore};

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);

/// P's writer: requests listed in `held` are never written and never answered by P (a stuck
/// write: P keeps them queued); the rest go through the real TE initiator. Every job is
/// reported to the test.
struct HoldingWriter {
    te: TeWriter,
    held: Vec<&'static str>,
    jobs: mpsc::UnboundedSender<WriteJob>,
    /// When given, each job waits for one permit before it writes.
    gate: Option<Arc<Semaphore>>,
}

impl KvWriter for HoldingWriter {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let _ = self.jobs.send(job.clone());
        if job.req_ids.iter().any(|r| self.held.contains(&r.as_str())) {
            return Box::pin(std::future::pending());
        }
        let write = self.te.write(job);
        match self.gate.clone() {
            None => write,
            Some(gate) => Box::pin(async move {
                gate.acquire().await.expect("gate open").forget();
                write.await
            }),
        }
    }
}

struct World {
    kv: KvRecv,
    events: EventStream,
    sim: PrefillSim,
    jobs: mpsc::UnboundedReceiver<WriteJob>,
}

/// How long D waits for P's answer to an aborted request, where P holds it for ever.
const SHORT_GRACE: Duration = Duration::from_millis(200);

async fn world(held: Vec<&'static str>) -> World {
    world_with(held, |b| b.events(true), None).await
}

async fn world_with(
    held: Vec<&'static str>,
    events: impl FnOnce(KvRecvBuilder) -> KvRecvBuilder,
    gate: Option<Arc<Semaphore>>,
) -> World {
    world_graced(held, events, gate, SHORT_GRACE).await
}

async fn world_graced(
    held: Vec<&'static str>,
    events: impl FnOnce(KvRecvBuilder) -> KvRecvBuilder,
    gate: Option<Arc<Semaphore>>,
    abort_grace: Duration,
) -> World {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        // Only an abort (after its grace) may settle a held request: no deadline inside the
        // test's time.
        pull_timeout: Duration::from_secs(3600),
        abort_grace,
        quarantine_deadline: Duration::from_secs(3600),
        ..KvRecvConfig::default()
    };
    let kv = events(KvRecv::builder(config)).start().unwrap();
    let events = kv.events().unwrap();
    let (tx, jobs) = mpsc::unbounded_channel();
    let writer = Arc::new(HoldingWriter {
        te: TeWriter::new(InitiatorConfig::default()),
        held,
        jobs: tx,
        gate,
    });
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();
    World {
        kv,
        events,
        sim,
        jobs,
    }
}

fn req(w: &World, id: &str, blocks: &[u32]) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some(w.sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(w.sim.bootstrap_url()),
        block_ids: vec![blocks.to_vec()],
    }
}

/// Events until (and including) the first that matches `pred`.
async fn until(events: &mut EventStream, pred: impl Fn(&KvEvent) -> bool) -> Vec<KvEvent> {
    let mut seen = vec![];
    loop {
        let ev = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .expect("an event in time")
            .expect("events open");
        let hit = pred(&ev);
        seen.push(ev);
        if hit {
            return seen;
        }
    }
}

fn released(id: &str) -> impl Fn(&KvEvent) -> bool + '_ {
    move |e| matches!(e, KvEvent::Released { req_id, .. } if &**req_id == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokio_host_loads_real_bytes_and_drains_through_the_front_door() {
    let mut w = world(vec![]).await;
    let reply = w.kv.load_kv(vec![req(&w, "r1", &[3, 5])]).await.unwrap();
    assert_eq!((reply.accepted, reply.awaiting), (1, 1), "{reply:?}");
    until(&mut w.events, released("r1")).await;
    // The handle is Clone + Send: another task of the host's runtime drains.
    let kv = w.kv.clone();
    let step = tokio::spawn(async move { kv.drain().await })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
    assert!(step.invalid_block_ids.is_empty(), "{step:?}");
    let stats = w.kv.stats().await.unwrap();
    let data = stats.data.expect("the builder started a data target");
    // 2 blocks x 2 regions x 4096 bytes, written by the real TE initiator.
    assert_eq!(data.bytes_landed, 2 * 2 * 4096, "{data:?}");
    assert_eq!(data.live_permits, 0, "the completion revoked the permit");
    w.kv.shutdown().await;
    assert!(matches!(w.kv.drain().await, Err(KvRecvError::Stopped)));
}

/// The host aborts a request P is still holding and never answers: once the abort's grace
/// passed without P's answer, its peer settles Uncertain ("aborted by the host"), the failure
/// is published, and the blocks are released only after that settle and with the fence (the
/// permit revoked, the window poisoned); P's late write is refused.
/// `completion_events()`: the stream carries each request's completion, once, and nothing
/// else (no settles, no releases), in the bursts kvrecv's thread hands over; it ends when the
/// worker stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_events_carry_every_completion_once_and_nothing_else() {
    let mut w = world_with(vec![], KvRecvBuilder::completion_events, None).await;
    let ids: Vec<String> = (0..6).map(|i| format!("c{i}")).collect();
    let batch = ids
        .iter()
        .enumerate()
        .map(|(i, id)| req(&w, id, &[2 * i as u32, 2 * i as u32 + 1]))
        .collect();
    let reply = w.kv.load_kv(batch).await.unwrap();
    assert_eq!(reply.awaiting, 6, "{reply:?}");
    let mut done = vec![];
    while done.len() < ids.len() {
        let ev = tokio::time::timeout(PATIENCE, w.events.recv())
            .await
            .expect("a completion in time")
            .expect("events open");
        match ev {
            KvEvent::Completion {
                req_id, outcome, ..
            } => {
                assert!(
                    matches!(outcome, kvrecv::messages::Outcome::Ok),
                    "{req_id}: {outcome:?}"
                );
                done.push(req_id.to_string());
            }
            other => panic!("only completions were asked for, got {other:?}"),
        }
    }
    done.sort();
    assert_eq!(done, ids, "each request completes exactly once");
    // Everything the worker emitted is in the stream by the time it stops: nothing else came.
    w.kv.shutdown().await;
    let rest = tokio::time::timeout(PATIENCE, w.events.recv())
        .await
        .expect("the stream ends with the worker");
    assert!(rest.is_none(), "an event after the completions: {rest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_settles_the_pending_peer_and_releases_only_once_fenced() {
    let mut w = world(vec!["a"]).await;
    let reply = w.kv.load_kv(vec![req(&w, "a", &[7])]).await.unwrap();
    assert_eq!(reply.awaiting, 1);
    // P has the addresses and is holding the write.
    let job_a = tokio::time::timeout(PATIENCE, w.jobs.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        w.kv.drain().await.unwrap().is_empty(),
        "nothing before the abort"
    );
    let ab = w.kv.abort("a").await.unwrap();
    assert_eq!(ab.peers_settled, 1, "{ab:?}");
    let seen = until(&mut w.events, released("a")).await;
    let at = |pred: &dyn Fn(&KvEvent) -> bool| seen.iter().position(pred);
    let settled = at(&|e| {
        matches!(e, KvEvent::Settled { req_id, outcome: SettleOutcome::Uncertain { reason: r, .. }, .. }
            if &**req_id == "a" && r == ABORTED_BY_HOST)
    })
    .expect("the pending peer settled Uncertain");
    let failure = at(&|e| matches!(e, KvEvent::FirstFailure { req_id, .. } if &**req_id == "a"))
        .expect("the failure is published");
    let completion = at(&|e| {
        matches!(e, KvEvent::Completion { req_id, uncertain_peers, .. }
            if &**req_id == "a" && uncertain_peers.len() == 1)
    })
    .expect("completion names the uncertain peer");
    assert!(settled < failure && failure < completion && completion < seen.len() - 1);
    let KvEvent::Released { fenced, blocks, .. } = seen.last().unwrap() else {
        unreachable!()
    };
    assert!(*fenced, "released by the fence, not by a deadline");
    assert_eq!(blocks, &vec![7]);
    let step = w.kv.drain().await.unwrap();
    assert_eq!(
        step.invalid_block_ids,
        vec![7],
        "the failure reaches the host"
    );
    assert_eq!(step.finished_recving, vec![ReqId::from("a")]);
    // P finally sends the held write: the fence refuses it.
    let late = TeWriter::new(InitiatorConfig::default()).write(job_a).await;
    assert!(late.is_err(), "a late write after release must be refused");
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.bytes_landed, 0);
    assert!(
        data.rejected_revoked + data.rejected_no_permit > 0,
        "{data:?}"
    );
    assert_eq!(data.poisoned_windows, 1, "the aborted pull's window");
    // A second abort finds nothing pending.
    assert_eq!(w.kv.abort("a").await.unwrap().peers_settled, 0);
    w.kv.shutdown().await;
}

/// The host aborts a request whose only pull P answers a moment later: P's write lands (the
/// blocks are still the request's, its permit open) and its ok proves P stopped writing, so
/// the request fails as aborted and is released without a fence, and its landing window is not
/// poisoned: an abort P answers costs no window. (Settled Uncertain at once, as before, every
/// such abort took a window out of rotation for the whole quarantine deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_p_then_answers_poisons_no_window() {
    let gate = Arc::new(Semaphore::new(0));
    let mut w = world_graced(vec![], |b| b.events(true), Some(gate.clone()), PATIENCE).await;
    let reply = w.kv.load_kv(vec![req(&w, "a", &[4])]).await.unwrap();
    assert_eq!(reply.awaiting, 1);
    tokio::time::timeout(PATIENCE, w.jobs.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(w.kv.abort("a").await.unwrap().peers_settled, 1);
    assert!(
        w.kv.drain().await.unwrap().is_empty(),
        "the blocks stay held while P may write"
    );
    gate.add_permits(1);
    let seen = until(&mut w.events, released("a")).await;
    assert!(
        seen.iter().any(|e| matches!(e, KvEvent::Settled { req_id, outcome: SettleOutcome::Failed { reason, .. }, .. }
            if &**req_id == "a" && reason == ABORTED_BY_HOST)),
        "P's ok settles it Failed, as aborted: {seen:?}"
    );
    assert!(
        seen.iter().any(
            |e| matches!(e, KvEvent::Completion { req_id, outcome, uncertain_peers, .. }
            if &**req_id == "a" && !outcome.is_ok() && uncertain_peers.is_empty())
        ),
        "it fails, with no peer uncertain: {seen:?}"
    );
    let KvEvent::Released { fenced, blocks, .. } = seen.last().unwrap() else {
        unreachable!()
    };
    assert!(!*fenced, "no suspect to fence");
    assert_eq!(blocks, &vec![4]);
    let step = w.kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("a")]);
    assert_eq!(step.invalid_block_ids, vec![4], "the abort fails it");
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.poisoned_windows, 0, "{data:?}");
    assert_eq!(
        data.bytes_landed,
        2 * 4096,
        "P's write landed in a's held block"
    );
    assert_eq!(data.live_permits, 0, "the completion revoked the permit");
    w.kv.shutdown().await;
}

/// Aborts that P answers take no window out of rotation, however many: with 4 landing windows
/// (3 usable), ten requests aborted in flight one after another, each answered by P, leave
/// none poisoned, and a healthy request after them still gets a clean window and lands. (Each
/// such abort poisoned a window for the whole quarantine deadline before, and from the fourth
/// on every pull got the reserved window and failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_p_answers_never_exhaust_the_landing_windows() {
    let gate = Arc::new(Semaphore::new(0));
    let mut w = world_graced(
        vec![],
        |b| b.events(true).target(|t| t.windows = Some(4)),
        Some(gate.clone()),
        PATIENCE,
    )
    .await;
    for i in 0..10 {
        let id = format!("x{i}");
        let reply = w.kv.load_kv(vec![req(&w, &id, &[2])]).await.unwrap();
        assert_eq!(reply.awaiting, 1, "{id}: {reply:?}");
        tokio::time::timeout(PATIENCE, w.jobs.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(w.kv.abort(&id).await.unwrap().peers_settled, 1, "{id}");
        gate.add_permits(1);
        until(&mut w.events, released(&id)).await;
        let step = w.kv.drain().await.unwrap();
        assert_eq!(step.finished_recving, vec![ReqId::from(id.as_str())]);
        let data = w.kv.stats().await.unwrap().data.unwrap();
        assert_eq!(data.poisoned_windows, 0, "after {id}: {data:?}");
    }
    let reply = w.kv.load_kv(vec![req(&w, "h", &[3])]).await.unwrap();
    assert_eq!(reply.awaiting, 1);
    gate.add_permits(1);
    let seen = until(&mut w.events, released("h")).await;
    assert!(
        seen.iter()
            .any(|e| matches!(e, KvEvent::Completion { req_id, outcome, .. }
            if &**req_id == "h" && outcome.is_ok())),
        "the healthy request lands: {seen:?}"
    );
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.bytes_landed, 11 * 2 * 4096, "{data:?}");
    w.kv.shutdown().await;
}

/// Only the aborted request settles: another request to the same peer, loaded after it (its
/// own pull), completes Ok with its bytes. (Within one pull, `PeerState::abort`'s unit test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_leaves_the_other_requests_of_the_peer_alone() {
    let mut w = world(vec!["a"]).await;
    assert_eq!(
        w.kv.load_kv(vec![req(&w, "a", &[1])])
            .await
            .unwrap()
            .awaiting,
        1
    );
    tokio::time::timeout(PATIENCE, w.jobs.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        w.kv.load_kv(vec![req(&w, "b", &[2])])
            .await
            .unwrap()
            .awaiting,
        1
    );
    until(&mut w.events, released("b")).await;
    assert_eq!(w.kv.abort("a").await.unwrap().peers_settled, 1);
    until(&mut w.events, released("a")).await;
    let step = w.kv.drain().await.unwrap();
    let mut finished: Vec<String> = step
        .finished_recving
        .iter()
        .map(|r| r.to_string())
        .collect();
    finished.sort();
    assert_eq!(finished, vec!["a", "b"], "{step:?}");
    assert_eq!(step.invalid_block_ids, vec![1], "only a failed");
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.bytes_landed, 2 * 4096, "b's block, both regions");
    w.kv.shutdown().await;
}

/// P writes a pull's ready requests in one transfer. Aborting one of them while that transfer
/// is on its way must not fail the others: the aborted request's permit stays open until its
/// pull has nothing else pending (its blocks stay held meanwhile), so the transfer lands whole,
/// the others complete ok, and only the aborted one fails. (Closing its permit at once failed
/// the whole transfer: P answered "transfer engine returned -1" for every request of it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_one_request_of_a_batch_leaves_the_rest_of_its_transfer_alone() {
    let gate = Arc::new(Semaphore::new(0));
    let mut w = world_with(vec![], |b| b.events(true), Some(gate.clone())).await;
    let batch = ["x", "y", "z"]
        .iter()
        .zip([1u32, 2, 3])
        .map(|(id, b)| req(&w, id, &[b]))
        .collect();
    assert_eq!(w.kv.load_kv(batch).await.unwrap().awaiting, 3);
    let job = tokio::time::timeout(PATIENCE, w.jobs.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.req_ids.len(), 3, "one transfer for the batch: {job:?}");
    assert_eq!(w.kv.abort("x").await.unwrap().peers_settled, 1);
    gate.add_permits(1);
    until(&mut w.events, released("x")).await;
    let mut finished = vec![];
    let mut invalid = vec![];
    while finished.len() < 3 {
        let step = w.kv.drain().await.unwrap();
        finished.extend(step.finished_recving.iter().map(|r| r.to_string()));
        invalid.extend(step.invalid_block_ids);
        if finished.len() < 3 {
            until(&mut w.events, |e| matches!(e, KvEvent::Released { .. })).await;
        }
    }
    finished.sort();
    assert_eq!(finished, ["x", "y", "z"]);
    assert_eq!(invalid, [1], "only the aborted request failed");
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.rejected_revoked, 0, "the transfer landed whole");
    assert_eq!(
        data.bytes_landed,
        3 * 2 * 4096,
        "three blocks, both regions"
    );
    w.kv.shutdown().await;
}

/// Many clones on many tasks share one worker; dropping them all stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_share_one_worker() {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(1, 64, 8),
        ..KvRecvConfig::default()
    };
    let kv = KvRecvBuilder::new(config).start().unwrap();
    assert!(
        matches!(kv.events(), Err(KvRecvError::NoEvents)),
        "events are opt-in"
    );
    let seen = Arc::new(Mutex::new(vec![]));
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (kv, seen) = (kv.clone(), seen.clone());
            tokio::spawn(async move {
                // The same request id from four tasks: exactly one is admitted.
                let r = KvRequest {
                    req_id: "x".into(),
                    transfer_id: Some("t".into()),
                    remote_engine_id: Some("e".into()),
                    remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
                    block_ids: vec![vec![i]],
                };
                let reply = kv.load_kv(vec![r]).await.unwrap();
                seen.lock().unwrap().push(reply.accepted);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(seen.lock().unwrap().iter().sum::<usize>(), 1);
    // Shutdown from two clones at once: both return only once the worker has stopped.
    let other = kv.clone();
    tokio::join!(kv.shutdown(), other.shutdown());
    assert!(matches!(kv.drain().await, Err(KvRecvError::Stopped)));
    assert!(matches!(
        other.load_kv(vec![]).await,
        Err(KvRecvError::Stopped)
    ));
}

/// A P engine that answers every pull with ERROR (here: its layers do not align with D's) is
/// a suspect each time (an ERROR does not prove its writers idle), but once half the windows
/// are poisoned its deployment (bootstrap server) holds at most its share: with 128 usable windows, 80 such requests poison 64
/// and the rest get no window, and a healthy engine's request still lands. (Unshared, such an
/// engine took all 16,384 windows out of rotation in about 20 s, and every engine's pulls
/// failed for 15 minutes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_errors_every_pull_cannot_take_every_window() {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        quarantine_deadline: Duration::from_secs(3600),
        ..KvRecvConfig::default()
    };
    let kv = KvRecvBuilder::new(config)
        .target(|t| t.windows = Some(129))
        .events(true)
        .start()
        .unwrap();
    let mut events = kv.events().unwrap();
    let bad = PrefillSim::start(SimConfig {
        engine_id: "misaligned".into(),
        layer_names: Some(vec!["other.0".into(), "other.1".into()]),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let good = PrefillSim::start(SimConfig::default()).await.unwrap();
    let request = |sim: &PrefillSim, id: &str, block: u32| KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some(sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(sim.bootstrap_url()),
        block_ids: vec![vec![block]],
    };
    for i in 0..80 {
        let id = format!("bad-{i}");
        let reply = kv.load_kv(vec![request(&bad, &id, 1)]).await.unwrap();
        assert_eq!(reply.awaiting, 1);
        until(
            &mut events,
            |e| matches!(e, KvEvent::Released { req_id, .. } if **req_id == *id),
        )
        .await;
        let step = kv.drain().await.unwrap();
        assert_eq!(step.invalid_block_ids, vec![1], "the ERROR fails it");
    }
    let data = kv.stats().await.unwrap().data.unwrap();
    assert_eq!(
        data.poisoned_windows, 64,
        "half of 128, then its share: {data:?}"
    );
    kv.load_kv(vec![request(&good, "good", 2)]).await.unwrap();
    until(
        &mut events,
        |e| matches!(e, KvEvent::Released { req_id, .. } if &**req_id == "good"),
    )
    .await;
    let step = kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("good")]);
    assert!(step.invalid_block_ids.is_empty(), "{step:?}");
    kv.shutdown().await;
}
