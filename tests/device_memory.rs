//! Host-registered device memory through the front door, on a fake device (host bytes reached
//! only through copies, which complete only when their staging slot is synchronised, as on a
//! CUDA stream): the data server's staged path (bounded staging buffer, device copy inside the
//! permit gate, off the async runtime) carries P's real TE writes into it, acknowledges a write
//! only once the device holds it, and a revocation waits for a copy in flight. The CUDA
//! implementation behind the same path is only compiled here (`cargo check --features cuda`):
//! no GPU.

#[path = "common/data_plane.rs"]
mod data_plane;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_pool::owner_tag;
use kvrecv::layout::KvLayout;
use kvrecv::rdma::audit::stamp_write;
use kvrecv::rdma::memory::STAGING_CHUNK;
use kvrecv::rdma::tcp::wire::{Header, ProtoVersion, STATUS_OK};
use kvrecv::rdma::{Landing, RevokeRequest, TargetConfig, TcpTarget};
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{KvWriter, PrefillSim, SimConfig};
use kvrecv::{DeviceMemory, KvEvent, KvRecv, KvRecvConfig, KvRequest, ReqId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
    // DeviceRegion's contract: once shutdown returned the host may destroy the memory's
    // context, so nothing of kvrecv's may be left in it then (on CUDA each staging slot holds a
    // stream, an event and page-locked memory there), though the handle is still alive.
    assert!(view.live_slots.load(Ordering::SeqCst) > 0);
    kv.shutdown().await;
    assert_eq!(
        view.live_slots.load(Ordering::SeqCst),
        0,
        "staging slots outlived shutdown"
    );
    drop(kv);
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

/// A TCP target on a fake device of one region of `BLOCKS` blocks of `BLOCK` bytes, a pull open
/// for request `a` on block 1; returns the target, the device, the request and the block's
/// advertised address.
async fn staged_target() -> (
    TcpTarget,
    Arc<kvrecv::rdma::fake_device::FakeDevice>,
    Arc<kvrecv::messages::RequestMeta>,
    u64,
) {
    let (dev, view) = DeviceMemory::fake(BLOCK * BLOCKS);
    let mut cfg = TargetConfig::loopback(KvLayout::uniform(1, BLOCK as u64, BLOCKS as u32));
    cfg.windows = Some(8);
    cfg.device_memory = Some(dev);
    let t = TcpTarget::start(cfg).await.unwrap();
    let a = data_plane::req("a", &[1]);
    let bases = data_plane::open(&t, 1, std::slice::from_ref(&a));
    (t, view, a, bases[0] + BLOCK as u64)
}

/// The v2 OK goes out after the write counted as landed (permit `landed`), so it must never
/// precede the device holding the bytes. The fake's copies complete only when synchronised:
/// with a copy that was merely enqueued when the write counted as landed (the old order) the
/// device would not hold the block here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_acknowledged_only_once_the_device_holds_every_byte() {
    let (t, view, _a, addr) = staged_target().await;
    let payload = data_plane::pattern(7, BLOCK);
    let mut s = tokio::net::TcpStream::connect(t.data_addr()).await.unwrap();
    s.write_all(&Header::new(true, addr, BLOCK as u64, ProtoVersion::V2).encode())
        .await
        .unwrap();
    s.write_all(&payload).await.unwrap();
    let ok = tokio::time::timeout(Duration::from_secs(30), s.read_u64_le())
        .await
        .expect("acknowledged")
        .unwrap();
    assert_eq!(ok, STATUS_OK);
    assert!(
        view.snapshot(BLOCK, BLOCK) == payload,
        "acknowledged before the device held the bytes"
    );
    assert_eq!(t.stats().writes_landed.load(Ordering::Relaxed), 1);
    assert!(
        view.uploads.load(Ordering::Relaxed) >= 4,
        "several staged copies"
    );
}

/// A revocation's quiescence (after which the block may be released and reused) waits for a
/// device copy in flight: the copy holds the permit's gate until its slot synchronised, on the
/// blocking thread, not only while the connection's task polls it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_waits_for_the_device_copy_in_flight() {
    use futures::FutureExt;
    let (t, view, a, addr) = staged_target().await;
    view.hold();
    // A failed assertion must not leave a copy held: the runtime waits for blocking tasks.
    struct ReleaseOnDrop(Arc<kvrecv::rdma::fake_device::FakeDevice>);
    impl Drop for ReleaseOnDrop {
        fn drop(&mut self) {
            self.0.release();
        }
    }
    let _release = ReleaseOnDrop(view.clone());
    let payload = data_plane::pattern(9, BLOCK);
    let mut s = tokio::net::TcpStream::connect(t.data_addr()).await.unwrap();
    s.write_all(&Header::new(true, addr, BLOCK as u64, ProtoVersion::V2).encode())
        .await
        .unwrap();
    let writer = tokio::spawn(async move {
        // Cut off once the revocation refuses the rest: the server closes the connection.
        let _ = s.write_all(&payload).await;
        s
    });
    tokio::time::timeout(Duration::from_secs(30), view.sync_held())
        .await
        .expect("a copy reaches its synchronisation");
    let mut revoked = t.landing().revoke(&RevokeRequest {
        req: &a,
        suspects: &[],
        poison_until: std::time::Instant::now() + Duration::from_secs(3600),
    });
    let mut quiesced = revoked.quiesced.take().expect("a copy is in flight");
    assert!(
        (&mut quiesced).now_or_never().is_none(),
        "quiescent while a device copy was still in flight"
    );
    let copied = view.uploads.load(Ordering::Relaxed);
    view.release();
    tokio::time::timeout(Duration::from_secs(30), quiesced)
        .await
        .expect("quiescent once the copy completed");
    // The held copy completed before quiescence; nothing lands after it.
    let after = view.uploads.load(Ordering::Relaxed);
    assert_eq!(after, copied + 1, "exactly the copy in flight completed");
    let mut s = writer.await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut rest)).await;
    assert_eq!(
        view.uploads.load(Ordering::Relaxed),
        after,
        "a copy after quiescence"
    );
    assert_eq!(t.stats().writes_landed.load(Ordering::Relaxed), 0);
}
