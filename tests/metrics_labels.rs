//! Metrics for a host (issue 10, item 5): two D workers in one process, one recorder. Every
//! series kvrecv records carries the worker's `engine` and TP/PP rank labels, so the two
//! workers' series stay apart; and starting a worker installs no recorder of its own.
//!
//! The recorder is the process's global one (kvrecv's actors and data plane run on kvrecv's
//! own threads, out of reach of a thread-local recorder); this test binary holds this one test.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrecv::config::KvRecvConfig;
use kvrecv::embed::{EventStream, KvRecv};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{PrefillSim, SimConfig};
use kvrecv::telemetry as m;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);

/// Counters and gauges by key (a gauge's value as f64 bits); histograms only by key.
#[derive(Default)]
struct Store {
    values: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    histograms: Mutex<Vec<Key>>,
}

impl Store {
    fn cell(&self, key: &Key) -> Arc<AtomicU64> {
        let mut v = self.values.lock().unwrap();
        v.entry(key.clone()).or_default().clone()
    }

    fn keys(&self) -> Vec<Key> {
        let mut k: Vec<Key> = self.values.lock().unwrap().keys().cloned().collect();
        k.extend(self.histograms.lock().unwrap().iter().cloned());
        k
    }

    /// Counter `name` of engine `engine` (summed over its other labels).
    fn counter(&self, name: &str, engine: &str) -> u64 {
        self.values
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.name() == name && label(k, "engine") == Some(engine))
            .map(|(_, v)| v.load(Ordering::Relaxed))
            .sum()
    }
}

fn label<'a>(k: &'a Key, name: &str) -> Option<&'a str> {
    k.labels().find(|l| l.key() == name).map(|l| l.value())
}

struct TestRecorder(&'static Store);

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.0.cell(key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.0.cell(key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0.histograms.lock().unwrap().push(key.clone());
        Histogram::noop()
    }
}

fn worker(engine: &str) -> (KvRecv, EventStream) {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 16),
        engine_id: engine.into(),
        ..KvRecvConfig::default()
    };
    let kv = KvRecv::builder(config).events(true).start().unwrap();
    let events = kv.events().unwrap();
    (kv, events)
}

/// Wait until every request of `ids` was released (in whatever order).
async fn released(events: &mut EventStream, ids: &[&str]) {
    let mut left: Vec<&str> = ids.to_vec();
    while !left.is_empty() {
        let ev = tokio::time::timeout(PATIENCE, events.recv())
            .await
            .expect("an event in time")
            .expect("events open");
        if let KvEvent::Released { req_id, .. } = &ev {
            left.retain(|id| *id != &**req_id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_in_one_process_keep_their_series_apart() {
    let (a, mut a_events) = worker("d-a");
    let (b, mut b_events) = worker("d-b");
    // Both workers are running: had either installed a global recorder, this would fail.
    let store: &'static Store = Box::leak(Box::default());
    metrics::set_global_recorder(TestRecorder(store))
        .expect("starting kvrecv installs no global recorder");

    // P writes real bytes through the Mooncake TE initiator, so the data plane records too.
    let writer = Arc::new(TeWriter::new(InitiatorConfig::default()));
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();
    let req = |id: &str, blocks: Vec<u32>| KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some(sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(sim.bootstrap_url()),
        block_ids: vec![blocks],
    };
    // Different sizes, so a merged series could not pass for either worker's.
    // b's three requests go in one batch: P settles them in one reply, whose settles and
    // completions are counted together (one handle lookup per outcome), and must add up.
    a.load_kv(vec![req("ra", vec![1])]).await.unwrap();
    b.load_kv(vec![
        req("rb1", vec![2]),
        req("rb2", vec![3]),
        req("rb3", vec![4]),
    ])
    .await
    .unwrap();
    released(&mut a_events, &["ra"]).await;
    released(&mut b_events, &["rb1", "rb2", "rb3"]).await;

    let step = a.drain().await.unwrap();
    assert_eq!(step.finished_recving, [kvrecv::ReqId::from("ra")]);

    // 2 regions x 4096 bytes a block.
    assert_eq!(store.counter(m::BYTES_LANDED, "d-a"), 2 * 4096);
    assert_eq!(store.counter(m::BYTES_LANDED, "d-b"), 3 * 2 * 4096);
    for name in [m::PULLS, m::BOOTSTRAP_QUERIES] {
        assert_eq!(store.counter(name, "d-a"), 1, "{name} of d-a");
        assert_eq!(store.counter(name, "d-b"), 1, "{name} of d-b");
    }
    assert_eq!(store.counter(m::COMPLETIONS, "d-a"), 1);
    assert_eq!(store.counter(m::COMPLETIONS, "d-b"), 3);
    // One settle per request and peer (one peer, one pull each here).
    assert_eq!(store.counter(m::SETTLES, "d-a"), 1);
    assert_eq!(store.counter(m::SETTLES, "d-b"), 3);
    // Every series recorded (actors, bootstrap client, data plane, permits) is labelled.
    let keys = store.keys();
    assert!(keys.len() > 10, "{keys:?}");
    for k in &keys {
        assert!(
            matches!(label(k, "engine"), Some("d-a" | "d-b"))
                && label(k, "tp_rank") == Some("0")
                && label(k, "pp_rank") == Some("0"),
            "series without the worker's labels: {k:?}"
        );
    }
    a.shutdown().await;
    b.shutdown().await;

    // A worker whose config names no engine (`KvRecvConfig::default()`'s empty id) is given a
    // random UUID, as vLLM names one: never an `engine=""` series another such worker shares.
    let (c, mut c_events) = worker("");
    c.load_kv(vec![req("rc", vec![5])]).await.unwrap();
    released(&mut c_events, &["rc"]).await;
    let engines: std::collections::BTreeSet<String> = store
        .keys()
        .iter()
        .filter_map(|k| label(k, "engine").map(str::to_owned))
        .filter(|e| e != "d-a" && e != "d-b")
        .collect();
    assert_eq!(engines.len(), 1, "{engines:?}");
    let c_engine = engines.first().unwrap();
    assert!(uuid::Uuid::parse_str(c_engine).is_ok(), "{c_engine:?}");
    assert_eq!(store.counter(m::COMPLETIONS, c_engine), 1);
    c.shutdown().await;
}
