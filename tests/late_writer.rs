//! The write-after-free through a recycled landing window (DESIGN.md §5, the epoch rule), end to
//! end and deterministic: real actors, real ZMQ, the simulator's P over HTTP bootstrap, kvrecv's
//! TCP target in audit mode, and the Rust TE initiator as the late writer.
//!
//! P never answers request `a` (its write is queued, as a real TE re-sends queued writes after a
//! reconnect); the host aborts `a` and P stays silent past the abort's grace (zero here: no
//! clock is raced, every pull's own deadline is an hour), so `a` settles Uncertain, its permit is
//! revoked and its block released.
//! `b` and then `c` reuse that block (the pool is LIFO); with only two usable windows, `c`'s pull
//! is the one that would get `a`'s window back. While `c` is being written, `a`'s queued write
//! arrives. With the epoch rule `a`'s window is poisoned: `c` gets the other one and the late
//! write is refused. With the rule off (the bug), the write is admitted and lands in `c`'s block.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use kvrecv::actors::block_pool::owner_tag;
use kvrecv::actors::{Coordinator, CoordinatorParts, EventSink};
use kvrecv::config::KvRecvConfig;
use kvrecv::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{Abort, Allocate, KvEvent, KvRequest, LoadKv, Outcome};
use kvrecv::rdma::audit::AuditSnapshot;
use kvrecv::rdma::{TargetConfig, TcpTarget};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{KvWriter, PrefillSim, SimConfig, WriteJob};
use tokio::sync::{mpsc, oneshot};

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);

/// P's writer: `a`'s write is queued and never sent by P itself; `c`'s waits for the test's
/// go-ahead; everything else is written at once. Every job is reported to the test.
struct QueuingWriter {
    te: TeWriter,
    jobs: mpsc::UnboundedSender<WriteJob>,
    gates: Mutex<HashMap<String, oneshot::Receiver<()>>>,
}

impl KvWriter for QueuingWriter {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let _ = self.jobs.send(job.clone());
        let id = job.req_ids.first().cloned().unwrap_or_default();
        if id == "a" {
            return Box::pin(std::future::pending());
        }
        let gate = self.gates.lock().unwrap().remove(&id);
        let write = self.te.write(job);
        Box::pin(async move {
            if let Some(g) = gate {
                let _ = g.await;
            }
            write.await
        })
    }
}

struct Outcomes {
    late_write: Result<(), String>,
    audit: AuditSnapshot,
    same_window: bool,
    poisoned: u64,
    a_released_fenced: bool,
    c_outcome: Outcome,
    /// Pulls P got without their layout (vLLM 0.33 layout ids, on by default).
    omitted_layouts: u64,
}

async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>) -> T {
    tokio::time::timeout(PATIENCE, rx.recv())
        .await
        .expect("an event in time")
        .expect("channel open")
}

/// Skip events until one matches `pred`; return it.
async fn until(
    events: &mut mpsc::UnboundedReceiver<KvEvent>,
    pred: impl Fn(&KvEvent) -> bool,
) -> KvEvent {
    loop {
        let ev = next(events).await;
        if pred(&ev) {
            return ev;
        }
    }
}

async fn run(epoch_rule: bool) -> Outcomes {
    let layout = KvLayout::uniform(1, 4096, 8);
    let mut tcfg = TargetConfig::loopback(layout.clone());
    tcfg.windows = Some(3); // two usable windows and the reserved one: recycling is forced
    tcfg.epoch_rule = epoch_rule;
    let target = TcpTarget::start(tcfg).await.unwrap();
    let (sink, mut events) = EventSink::channel();
    let coord = Coordinator::start(CoordinatorParts {
        config: KvRecvConfig {
            pull_timeout: Duration::from_secs(3600),
            abort_grace: Duration::ZERO,
            quarantine_deadline: Duration::from_secs(3600),
            layout,
            ..KvRecvConfig::default()
        },
        topology: Rc::new(HttpTopology::new(BootstrapConfig::default())),
        transport: Rc::new(ZmqTransport::new(ZmqTransportConfig::default())),
        landing: target.landing(),
        events: sink,
        builtin_pool: true,
    });
    let audit = target.install_audit(coord.ownership().unwrap());
    let (jobs_tx, mut jobs) = mpsc::unbounded_channel();
    let (go_c, gate_c) = oneshot::channel();
    let writer = Arc::new(QueuingWriter {
        te: TeWriter::new(InitiatorConfig::default()),
        jobs: jobs_tx,
        gates: Mutex::new(HashMap::from([("c".to_owned(), gate_c)])),
    });
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();

    let load = |id: &'static str| {
        let (coord, engine, url) = (
            coord.clone(),
            sim.engine_id().to_owned(),
            sim.bootstrap_url(),
        );
        async move {
            let blocks = coord
                .block_manager
                .send(Allocate {
                    req_id: id.into(),
                    owner_tag: owner_tag(&format!("t-{id}")),
                    n: 1,
                })
                .await
                .unwrap()
                .unwrap();
            let reply = coord
                .load_kv(LoadKv {
                    requests: vec![KvRequest {
                        req_id: id.into(),
                        transfer_id: Some(format!("t-{id}")),
                        remote_engine_id: Some(engine),
                        remote_bootstrap_addr: Some(url),
                        block_ids: vec![blocks.clone()],
                    }],
                })
                .await
                .unwrap();
            assert_eq!(reply.accepted, 1, "{reply:?}");
            blocks
        }
    };
    let released = |id: &'static str| move |e: &KvEvent| matches!(e, KvEvent::Released { req_id, .. } if &**req_id == id);

    let block_a = load("a").await;
    let job_a = next(&mut jobs).await;
    // P has a's pull and never answers: aborted, `a` settles Uncertain at once (no grace); the
    // exact revocation fences it.
    let abort = coord
        .receiver
        .send(Abort { req_id: "a".into() })
        .await
        .unwrap();
    assert_eq!(abort.peers_settled, 1, "{abort:?}");
    let rel_a = until(&mut events, released("a")).await;
    let KvEvent::Released { fenced, .. } = rel_a else {
        unreachable!()
    };
    // `b` reuses the block and completes cleanly, releasing it again.
    assert_eq!(load("b").await, block_a, "the pool is LIFO");
    next(&mut jobs).await;
    until(&mut events, released("b")).await;
    // `c` reuses it too, and its write waits: its permit is open when `a`'s write arrives.
    assert_eq!(load("c").await, block_a);
    let job_c = next(&mut jobs).await;
    let same_window = job_a.metadata.kv_caches_base_addr == job_c.metadata.kv_caches_base_addr;
    let late_write = TeWriter::new(InitiatorConfig::default()).write(job_a).await;
    go_c.send(()).unwrap();
    let c_outcome = match until(
        &mut events,
        |e: &KvEvent| matches!(e, KvEvent::Completion { req_id, .. } if &**req_id == "c"),
    )
    .await
    {
        KvEvent::Completion { outcome, .. } => outcome,
        _ => unreachable!(),
    };
    Outcomes {
        late_write,
        audit: audit.snapshot(),
        same_window,
        poisoned: target
            .landing()
            .permits()
            .epochs()
            .poisoned
            .load(std::sync::atomic::Ordering::Relaxed),
        a_released_fenced: fenced,
        c_outcome,
        omitted_layouts: sim.worker(0, 0).layout_stats().without_layout,
    }
}

#[actix::test]
async fn a_late_write_from_an_abandoned_pull_never_lands_through_a_recycled_window() {
    let o = run(true).await;
    assert_eq!(o.poisoned, 1, "a's window was poisoned at its revocation");
    assert!(!o.same_window, "c never gets a's poisoned window");
    assert!(o.late_write.is_err(), "the late write is refused at P");
    assert_eq!(o.audit.writes_after_free, 0);
    assert_eq!(o.audit.writes_after_realloc, 0);
    assert!(
        o.a_released_fenced,
        "released reports the revocation's fence"
    );
    assert_eq!(o.c_outcome, Outcome::Ok, "c's own write is untouched");
    // With layout ids on (the default): c reused b's window, whose id P echoed, and went
    // without its layout; the window, its permit and the poison are per pull all the same.
    assert_eq!(o.omitted_layouts, 1, "c's pull omitted its layout");
}

/// The same scenario with the epoch rule off: proof that the test can see the bug.
#[actix::test]
async fn without_the_epoch_rule_the_late_write_lands_in_the_new_owners_block() {
    let o = run(false).await;
    assert_eq!(o.poisoned, 0);
    assert!(o.same_window, "recycling handed a's window to c");
    assert_eq!(o.late_write, Ok(()), "admitted into c's open permit");
    assert!(
        o.audit.writes_after_realloc > 0,
        "the audit saw a's bytes in c's block: {:?}",
        o.audit
    );
}
