//! Never send a pull that cannot land (issue 39, DESIGN.md §5.5): with fewer clean landing
//! windows than pulls in flight (`--windows 4`: three usable and the reserved one), eight
//! one-request batches to a TP2 P (two pulls each) must not hand P a single address whose
//! writes would be refused. Each request either completes ok, or fails with the window reason
//! before any of its pulls goes out. Real actors, real ZMQ, the simulator's P over HTTP
//! bootstrap writing through the Rust TE initiator; P's writes wait for the test's go-ahead so
//! every batch is dispatched while the first one's pulls still hold their windows.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use kvrecv::actors::block_pool::owner_tag;
use kvrecv::actors::{Coordinator, CoordinatorParts, EventSink};
use kvrecv::config::KvRecvConfig;
use kvrecv::control::{BootstrapConfig, HttpTopology, ZmqTransport, ZmqTransportConfig};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{Allocate, KvEvent, KvRequest, LoadKv, Outcome};
use kvrecv::rdma::{TargetConfig, TcpTarget, NO_CLEAN_WINDOW};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{KvWriter, PrefillSim, SimConfig, WriteJob};
use tokio::sync::{mpsc, Semaphore};

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);

/// P's writer: every job P computes is reported to the test (the requests it names), then
/// waits for a permit of `gate` before it is written through the TE initiator.
struct GatedWriter {
    te: TeWriter,
    gate: Arc<Semaphore>,
    jobs: Mutex<Vec<Vec<String>>>,
}

impl KvWriter for GatedWriter {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        self.jobs
            .lock()
            .unwrap()
            .push(job.req_ids.iter().map(|r| r.to_string()).collect());
        let (gate, write) = (self.gate.clone(), self.te.write(job));
        Box::pin(async move {
            gate.acquire().await.expect("gate open").forget();
            write.await
        })
    }
}

async fn completion(
    events: &mut mpsc::UnboundedReceiver<KvEvent>,
    what: &str,
) -> (String, Outcome) {
    loop {
        let ev = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .expect(what)
            .expect("events open");
        if let KvEvent::Completion {
            req_id, outcome, ..
        } = ev
        {
            return (req_id.to_string(), outcome);
        }
    }
}

#[actix::test]
async fn with_four_windows_eight_tp2_requests_send_no_pull_that_cannot_land() {
    let layout = KvLayout::uniform(1, 4096, 32);
    let mut tcfg = TargetConfig::loopback(layout.clone());
    tcfg.windows = Some(4); // `kvrecv serve --windows 4`: three usable, one reserved
    let target = TcpTarget::start(tcfg).await.unwrap();
    let (sink, mut events) = EventSink::channel();
    let coord = Coordinator::start(CoordinatorParts {
        config: KvRecvConfig {
            layout,
            pull_timeout: Duration::from_secs(3600),
            quarantine_deadline: Duration::from_secs(3600),
            ..KvRecvConfig::default()
        },
        topology: Rc::new(HttpTopology::new(BootstrapConfig::default())),
        transport: Rc::new(ZmqTransport::new(ZmqTransportConfig::default())),
        landing: target.landing(),
        events: sink,
        builtin_pool: true,
    });
    let writer = Arc::new(GatedWriter {
        te: TeWriter::new(InitiatorConfig::default()),
        gate: Arc::new(Semaphore::new(0)),
        jobs: Mutex::default(),
    });
    let sim = PrefillSim::start_with_writer(
        SimConfig {
            tp_size: 2,
            ..SimConfig::default()
        },
        writer.clone(),
    )
    .await
    .unwrap();
    let load = |id: String| {
        let (coord, engine, url) = (
            coord.clone(),
            sim.engine_id().to_owned(),
            sim.bootstrap_url(),
        );
        async move {
            let blocks = coord
                .block_manager
                .send(Allocate {
                    req_id: id.as_str().into(),
                    owner_tag: owner_tag(&format!("t-{id}")),
                    n: 2,
                })
                .await
                .unwrap()
                .unwrap();
            coord
                .load_kv(LoadKv {
                    requests: vec![KvRequest {
                        req_id: id.as_str().into(),
                        transfer_id: Some(format!("t-{id}")),
                        remote_engine_id: Some(engine),
                        remote_bootstrap_addr: Some(url),
                        block_ids: vec![blocks],
                    }],
                })
                .await
                .unwrap()
        }
    };
    // A first request through both P workers: the engine's topology is cached, so each later
    // batch is dispatched (its windows opened, or refused) inside its `load_kv`.
    writer.gate.add_permits(2);
    load("warm".into()).await;
    let (id, outcome) = completion(&mut events, "warm completes").await;
    assert_eq!(id, "warm");
    assert!(matches!(outcome, Outcome::Ok), "{outcome:?}");
    let warm_jobs = writer.jobs.lock().unwrap().len();
    assert_eq!(warm_jobs, 2, "one pull per P worker");

    // Eight batches of one request each: 16 pulls for 3 usable windows. P writes nothing yet.
    let ids: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
    for id in &ids {
        let reply = load(id.clone()).await;
        assert_eq!(reply.awaiting, 1, "{reply:?}");
    }
    // The batches that got no windows complete failed at once, before P writes a byte.
    let mut refused = vec![];
    let mut ok = vec![];
    let mut seen = 0;
    // The first batch always gets two of the three windows, the second then finds one: so at
    // least seven are refused before any write is let through.
    while refused.len() < 7 {
        // Sent with a window that admits nothing, they would wait for P's writes and fail late.
        let (id, outcome) = completion(&mut events, "refused before P writes anything").await;
        seen += 1;
        match outcome {
            Outcome::Failed { cause, reason, .. } => {
                assert!(reason.starts_with(NO_CLEAN_WINDOW), "{id}: {reason}");
                assert_eq!(cause, kvrecv::Cause::NotSent, "{id}: nothing was sent");
                refused.push(id);
            }
            other => panic!("{id} completed before P wrote anything: {other:?}"),
        }
    }
    // Now P writes what it was sent.
    writer.gate.add_permits(1000);
    while seen < ids.len() {
        let (id, outcome) = completion(&mut events, "the rest complete").await;
        seen += 1;
        match outcome {
            Outcome::Ok => ok.push(id),
            Outcome::Failed { reason, .. } if reason.starts_with(NO_CLEAN_WINDOW) => {
                refused.push(id)
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(ok.len() + refused.len(), 8);
    assert_eq!(ok, vec!["r0".to_owned()], "the first batch got its windows");
    // P was handed pulls only for the request that completed: two (one per worker), none for
    // the refused ones; and not one write was refused at the data server.
    let jobs = writer.jobs.lock().unwrap()[warm_jobs..].to_vec();
    assert_eq!(jobs, vec![vec!["r0".to_owned()]; 2], "pulls P received");
    let data = target.stats();
    assert_eq!(data.rejected_total(), 0, "writes refused");
    assert_eq!(data.rejected_no_permit.load(Ordering::Relaxed), 0);
    // Both blocks of `warm` and of `r0`, every byte.
    assert_eq!(data.bytes_landed.load(Ordering::Relaxed), 2 * 2 * 4096);
    // The windows were only lent: none is left open or poisoned.
    let landing = target.landing();
    assert_eq!(
        landing.permits().epochs().poisoned.load(Ordering::Relaxed),
        0
    );
}
