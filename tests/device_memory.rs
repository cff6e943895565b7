//! Host-registered device memory through the front door, on a fake device (host bytes reached
//! only through copies): the data server's staged path (bounded staging buffer, device copy
//! inside the permit gate) carries P's real TE writes into it. The CUDA implementation behind
//! the same path is only compiled here (`cargo check --features cuda`): no GPU.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_pool::owner_tag;
use kvrecv::layout::KvLayout;
use kvrecv::rdma::audit::stamp_write;
use kvrecv::rdma::memory::STAGING_CHUNK;
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{KvWriter, PrefillSim, SimConfig};
use kvrecv::{DeviceMemory, KvEvent, KvRecv, KvRecvConfig, KvRequest, ReqId};

/// Larger than the staging buffer, so one write takes several device copies.
const BLOCK: usize = 3 * STAGING_CHUNK + 4096;
const BLOCKS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_writes_reach_host_device_memory_through_bounded_staging() {
    let (dev, view) = DeviceMemory::fake(BLOCK * BLOCKS);
    let config = KvRecvConfig {
        layout: KvLayout::uniform(1, BLOCK as u64, BLOCKS as u32),
        ..KvRecvConfig::default()
    };
    let kv = KvRecv::builder(config)
        .device_memory(dev)
        .events(true)
        .start()
        .unwrap();
    let mut events = kv.events().unwrap();
    let sim = PrefillSim::start_with_writer(
        SimConfig::default(),
        Arc::new(TeWriter::new(InitiatorConfig::default())),
    )
    .await
    .unwrap();
    kv.load_kv(vec![KvRequest {
        req_id: "r1".into(),
        transfer_id: Some("t-r1".into()),
        remote_engine_id: Some(sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(sim.bootstrap_url()),
        block_ids: vec![vec![2]],
    }])
    .await
    .unwrap();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("released in time")
            .expect("events open");
        if matches!(&ev, KvEvent::Released { req_id, .. } if &**req_id == "r1") {
            break;
        }
    }
    let step = kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("r1")]);
    assert!(step.invalid_block_ids.is_empty());
    let tag = owner_tag("t-r1");
    let mut want = vec![(tag & 0xff) as u8; BLOCK];
    stamp_write(&mut want, 2 * BLOCK as u64, BLOCK as u64, tag, |_| 0);
    assert!(
        view.snapshot(2 * BLOCK, BLOCK) == want,
        "P's bytes on the device"
    );
    assert!(
        view.snapshot(0, 2 * BLOCK).iter().all(|&b| b == 0),
        "other blocks untouched"
    );
    let largest = view.largest_upload.load(Ordering::Relaxed);
    assert!(
        largest as usize <= STAGING_CHUNK,
        "staging is bounded: {largest}"
    );
    assert!(
        view.uploads.load(Ordering::Relaxed) >= 4,
        "one write, several copies"
    );
    kv.shutdown().await;
}

/// P's writer that holds the job of request `a` (P never answers it) and reports every job.
struct HoldingWriter {
    te: TeWriter,
    jobs: tokio::sync::mpsc::UnboundedSender<kvrecv::sim::WriteJob>,
}

impl KvWriter for HoldingWriter {
    fn write(
        &self,
        job: kvrecv::sim::WriteJob,
    ) -> futures::future::BoxFuture<'static, Result<(), String>> {
        let _ = self.jobs.send(job.clone());
        if job.req_ids.iter().any(|r| r == "a") {
            return Box::pin(std::future::pending());
        }
        self.te.write(job)
    }
}

/// The staged path honours the fence: after an abort released `a`'s block, P's held write is
/// refused and no byte of it reaches the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_never_reaches_host_device_memory() {
    const SMALL: usize = 64 * 1024;
    let (dev, view) = DeviceMemory::fake(SMALL * BLOCKS);
    let config = KvRecvConfig {
        layout: KvLayout::uniform(1, SMALL as u64, BLOCKS as u32),
        pull_timeout: Duration::from_secs(3600),
        // P never answers `a`: the abort settles it once this passed.
        abort_grace: Duration::from_millis(200),
        ..KvRecvConfig::default()
    };
    let kv = KvRecv::builder(config)
        .device_memory(dev)
        .events(true)
        .start()
        .unwrap();
    let mut events = kv.events().unwrap();
    let (tx, mut jobs) = tokio::sync::mpsc::unbounded_channel();
    let writer = Arc::new(HoldingWriter {
        te: TeWriter::new(InitiatorConfig::default()),
        jobs: tx,
    });
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();
    kv.load_kv(vec![KvRequest {
        req_id: "a".into(),
        transfer_id: Some("t-a".into()),
        remote_engine_id: Some(sim.engine_id().to_owned()),
        remote_bootstrap_addr: Some(sim.bootstrap_url()),
        block_ids: vec![vec![1]],
    }])
    .await
    .unwrap();
    let job = tokio::time::timeout(Duration::from_secs(30), jobs.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kv.abort("a").await.unwrap().peers_settled, 1);
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("released in time")
            .expect("events open");
        if let KvEvent::Released { req_id, fenced, .. } = &ev {
            if &**req_id == "a" {
                assert!(fenced, "released by the fence");
                break;
            }
        }
    }
    let late = TeWriter::new(InitiatorConfig::default()).write(job).await;
    assert!(late.is_err(), "the late write is refused");
    assert_eq!(
        view.uploads.load(Ordering::Relaxed),
        0,
        "nothing was copied"
    );
    assert!(view.snapshot(0, SMALL * BLOCKS).iter().all(|&b| b == 0));
    kv.shutdown().await;
}
