//! Sleep mode through the front door over TCP (DESIGN.md §7, "pause and resume"): a pause
//! with a request in flight ends it (failed, its blocks released fenced), refuses every load
//! and every write while paused (the write lands nothing: the host's bytes are untouched), and
//! after resume a new request lands every byte, with a layout id P has never seen.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kvrecv::actors::block_pool::owner_tag;
use kvrecv::config::KvRecvConfig;
use kvrecv::embed::{KvRecv, KvRecvError, PauseError, ResumeMemory};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{BatchError, KvEvent, KvRequest, ReqId};
use kvrecv::rdma::audit::stamp_write;
use kvrecv::rdma::memory::{HostMemory, HostRegion};
use kvrecv::rdma::memory_fit::MemoryFitError;
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{KvWriter, PrefillSim, SimConfig, WriteJob};
use tokio::sync::mpsc;

/// Safety net only: every wait ends on an event long before this.
const PATIENCE: Duration = Duration::from_secs(30);
const BLOCK: usize = 4096;
const BLOCKS: usize = 16;
const REGIONS: usize = 2;
/// What the host's memory holds before anything lands: distinct from any written byte.
const FILL: u8 = 0xEE;

/// P's writer: requests listed in `held` are never written and never answered (P keeps them
/// queued: a pull in flight for as long as the test wants); the rest go through the real TE
/// initiator. Every job is reported to the test.
struct HoldingWriter {
    te: TeWriter,
    held: Vec<&'static str>,
    jobs: mpsc::UnboundedSender<WriteJob>,
}

impl KvWriter for HoldingWriter {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let _ = self.jobs.send(job.clone());
        if job.req_ids.iter().any(|r| self.held.contains(&r.as_str())) {
            return Box::pin(std::future::pending());
        }
        self.te.write(job)
    }
}

struct World {
    kv: KvRecv,
    events: kvrecv::embed::EventStream,
    sim: PrefillSim,
    jobs: mpsc::UnboundedReceiver<WriteJob>,
}

/// `memory` as the host's regions.
///
/// # Safety
/// Each Vec stays allocated and unresized while the worker may land in it: until its
/// shutdown, or until a resume onto other memory returned.
unsafe fn regions(memory: &mut [Vec<u8>]) -> HostMemory {
    HostMemory::new(
        memory
            .iter_mut()
            // SAFETY: the caller's contract.
            .map(|v| unsafe { HostRegion::new(v.as_mut_ptr(), v.len()) }.unwrap())
            .collect(),
    )
}

/// A worker landing in `memory` (the host's), P holding `held`.
async fn world(memory: &mut [Vec<u8>], held: Vec<&'static str>) -> World {
    // SAFETY: each test shuts the worker down before reading the memory while it could be
    // written, and before dropping it.
    let regions = unsafe { regions(memory) };
    let config = KvRecvConfig {
        layout: KvLayout::uniform(REGIONS as u32, BLOCK as u64, BLOCKS as u32),
        // Only the pause's abort (after its grace) settles a held request.
        pull_timeout: Duration::from_secs(3600),
        abort_grace: Duration::from_millis(200),
        quarantine_deadline: Duration::from_secs(3600),
        ..KvRecvConfig::default()
    };
    let kv = KvRecv::builder(config)
        .host_memory(regions)
        .events(true)
        .start()
        .unwrap();
    let events = kv.events().unwrap();
    let (tx, jobs) = mpsc::unbounded_channel();
    let writer = Arc::new(HoldingWriter {
        te: TeWriter::new(InitiatorConfig::default()),
        held,
        jobs: tx,
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

fn host_memory() -> Vec<Vec<u8>> {
    (0..REGIONS).map(|_| vec![FILL; BLOCK * BLOCKS]).collect()
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

/// The bytes the simulator's TE writer sends for `block` of a request with `transfer_id`.
fn expected_block(transfer_id: &str, block: u32) -> Vec<u8> {
    let tag = owner_tag(transfer_id);
    let mut p = vec![(tag & 0xff) as u8; BLOCK];
    stamp_write(
        &mut p,
        u64::from(block) * BLOCK as u64,
        BLOCK as u64,
        tag,
        |_| 0,
    );
    p
}

fn block(memory: &[Vec<u8>], region: usize, b: u32) -> &[u8] {
    &memory[region][b as usize * BLOCK..(b as usize + 1) * BLOCK]
}

async fn next_job(w: &mut World) -> WriteJob {
    tokio::time::timeout(PATIENCE, w.jobs.recv())
        .await
        .expect("P got the pull in time")
        .expect("P runs")
}

/// Wait until `id`'s blocks are released.
async fn released(w: &mut World, id: &str) {
    loop {
        let ev = tokio::time::timeout(PATIENCE, w.events.recv())
            .await
            .expect("released in time")
            .expect("events open");
        if matches!(&ev, KvEvent::Released { req_id, .. } if &**req_id == id) {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_while_paused_and_everything_lands_after_resume() {
    let mut memory = host_memory();
    let mut w = world(&mut memory, vec!["a"]).await;
    let reply = w.kv.load_kv(vec![req(&w, "a", &[7])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    // P has a's block addresses and holds its write: a pull in flight.
    let job_a = next_job(&mut w).await;

    let report = tokio::time::timeout(PATIENCE, w.kv.pause())
        .await
        .expect("the pause resolves once a's blocks came back")
        .unwrap();
    assert_eq!(report.abandoned.len(), 1, "{report:?}");
    let a = &report.abandoned[0];
    assert_eq!((&*a.req_id, &a.blocks[..]), ("a", &[7][..]));
    assert!(
        a.fenced && !a.forced,
        "P never answered: released on the fence (the revocation), not the deadline: {a:?}"
    );
    assert!(w.kv.is_paused());
    // The request in flight did not survive: it failed, and the host gets it back.
    let step = w.kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("a")]);
    assert_eq!(step.invalid_block_ids, vec![7], "a failed: {step:?}");

    // Paused: loads are refused with the typed error, submitted ones request by request.
    assert!(matches!(
        w.kv.load_kv(vec![req(&w, "b", &[8])]).await,
        Err(KvRecvError::Paused)
    ));
    let ticket = w.kv.submit(vec![req(&w, "b", &[8])]).await.unwrap();
    assert!(
        matches!(&ticket.rejected[..], [BatchError::Paused { req_id }] if req_id == "b"),
        "{ticket:?}"
    );

    // P finally sends a's held write while D is paused: refused, nothing lands.
    let late = TeWriter::new(InitiatorConfig::default()).write(job_a).await;
    assert!(late.is_err(), "a write while paused must be refused");
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert!(data.rejected_paused > 0, "refused as paused: {data:?}");
    assert_eq!(data.bytes_landed, 0, "{data:?}");
    assert_eq!(data.live_permits, 0, "every permit is closed: {data:?}");
    for r in 0..REGIONS {
        // Paused, nothing writes into the host's memory: reading it races with nothing.
        assert!(
            block(&memory, r, 7).iter().all(|&x| x == FILL),
            "region {r} block 7: nothing landed while paused"
        );
    }

    // New memory that does not fit the layout is refused (typed), and the worker stays paused.
    let other = HostMemory::new(vec![]);
    assert!(matches!(
        w.kv.resume(ResumeMemory::Host(other)).await,
        Err(PauseError::MemoryDoesNotFit(MemoryFitError::RegionCount {
            regions: 0,
            layout: REGIONS
        }))
    ));
    assert!(w.kv.is_paused());

    w.kv.resume(ResumeMemory::Same).await.unwrap();
    assert!(!w.kv.is_paused());
    assert!(matches!(
        w.kv.resume(ResumeMemory::Same).await,
        Err(PauseError::NotPaused)
    ));
    let reply = w.kv.load_kv(vec![req(&w, "b", &[7, 8])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    released(&mut w, "b").await;
    let step = w.kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from("b")]);
    assert!(step.invalid_block_ids.is_empty(), "b is ok: {step:?}");
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.bytes_landed, (2 * REGIONS * BLOCK) as u64, "{data:?}");
    w.kv.shutdown().await;
    for r in 0..REGIONS {
        for b in [7, 8] {
            assert_eq!(
                block(&memory, r, b),
                &expected_block("t-b", b)[..],
                "region {r} block {b}: every byte of b after resume"
            );
        }
    }
}

/// Load `id` into block 1 and wait for its release; P's job for it.
async fn pull(w: &mut World, id: &str) -> WriteJob {
    let reply = w.kv.load_kv(vec![req(w, id, &[1])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    let job = next_job(w).await;
    released(w, id).await;
    job
}

/// A resume is a new registration: P, which cached the layout under the old ids, is sent it
/// again under an id it has never seen, for the very same window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_resume_pulls_carry_a_new_layout_id() {
    let mut memory = host_memory();
    let mut w = world(&mut memory, vec![]).await;
    let first = pull(&mut w, "w1").await;
    let warm = pull(&mut w, "w2").await;
    let stats = w.sim.workers()[0].layout_stats();
    assert_eq!(
        (stats.with_layout, stats.without_layout),
        (1, 1),
        "warm: the second pull through the same window omitted its layout"
    );
    assert_eq!(warm.metadata.layout_id, first.metadata.layout_id);

    let report = w.kv.pause().await.unwrap();
    assert!(report.abandoned.is_empty(), "nothing held: {report:?}");
    w.kv.resume(ResumeMemory::Same).await.unwrap();

    let after = pull(&mut w, "w3").await;
    assert_eq!(
        after.metadata.kv_caches_base_addr, first.metadata.kv_caches_base_addr,
        "the same window (its ring brings it back)"
    );
    assert_ne!(
        after.metadata.layout_id, first.metadata.layout_id,
        "a new registration: a new id for the same window"
    );
    let stats = w.sim.workers()[0].layout_stats();
    assert_eq!(
        (stats.with_layout, stats.without_layout, stats.misses),
        (2, 1, 0),
        "the pull after resume carried its layout"
    );
    let step = w.kv.drain().await.unwrap();
    assert!(step.invalid_block_ids.is_empty(), "{step:?}");
    w.kv.shutdown().await;
}

/// Load `id` into `blocks`, wait for its release and drain it: it completed ok.
async fn load_ok(w: &mut World, id: &str, blocks: &[u32]) {
    let reply = w.kv.load_kv(vec![req(w, id, blocks)]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    released(w, id).await;
    let step = w.kv.drain().await.unwrap();
    assert_eq!(step.finished_recving, vec![ReqId::from(id)]);
    assert!(step.invalid_block_ids.is_empty(), "{id} is ok: {step:?}");
}

/// Pause with `a` in flight (P holds its write): `a` is abandoned, fenced. P's job for it.
async fn pause_with_a_held(w: &mut World) -> WriteJob {
    let reply = w.kv.load_kv(vec![req(w, "a", &[3])]).await.unwrap();
    assert_eq!(reply.awaiting, 1, "{reply:?}");
    let job_a = next_job(w).await;
    let report = tokio::time::timeout(PATIENCE, w.kv.pause())
        .await
        .expect("the pause resolves once a's blocks came back")
        .unwrap();
    assert!(
        matches!(&report.abandoned[..], [a] if &*a.req_id == "a" && a.fenced),
        "{report:?}"
    );
    let step = w.kv.drain().await.unwrap();
    assert_eq!(step.invalid_block_ids, vec![3], "a failed: {step:?}");
    job_a
}

/// Sleep mode with new host memory: after a pause, the worker resumes on a second buffer
/// (memory that does not fit the layout is refused first, typed, and it stays paused). A late
/// write of a pull from before the pause is refused; a new request lands every byte in the
/// new memory, and not one byte of anything lands in the old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_on_new_memory_lands_there_and_never_in_the_old() {
    let mut old = host_memory();
    let mut new = host_memory();
    let mut w = world(&mut old, vec!["a"]).await;
    load_ok(&mut w, "warm", &[5]).await;
    let warm_landed = w.kv.stats().await.unwrap().data.unwrap().bytes_landed;
    let job_a = pause_with_a_held(&mut w).await;
    // The warm-up landed in the old memory: the test sees where writes go.
    for r in 0..REGIONS {
        assert_eq!(block(&old, r, 5), &expected_block("t-warm", 5)[..]);
    }

    let mut short = vec![vec![0u8; BLOCK * BLOCKS]; REGIONS];
    short[1].truncate(BLOCK * BLOCKS - 1);
    // SAFETY: refused before anything could land in it; dropped after the worker's shutdown.
    let short_memory = unsafe { regions(&mut short) };
    assert!(matches!(
        w.kv.resume(ResumeMemory::Host(short_memory)).await,
        Err(PauseError::MemoryDoesNotFit(MemoryFitError::TooSmall {
            region: 1,
            ..
        }))
    ));
    assert!(
        w.kv.is_paused(),
        "a refused resume leaves the worker paused"
    );

    // SAFETY: `new` outlives the worker (shut down below, before it is read or dropped).
    let new_memory = unsafe { regions(&mut new) };
    w.kv.resume(ResumeMemory::Host(new_memory)).await.unwrap();
    assert!(!w.kv.is_paused());

    // P finally sends a's write, through a's window of before the pause: refused.
    let late = TeWriter::new(InitiatorConfig::default()).write(job_a).await;
    assert!(
        late.is_err(),
        "a write of a pull from before the pause must be refused"
    );

    load_ok(&mut w, "b", &[7, 8]).await;
    let data = w.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(
        data.bytes_landed - warm_landed,
        (2 * REGIONS * BLOCK) as u64,
        "only b landed after the warm-up: {data:?}"
    );
    // The host's safe read goes to the new memory too (the old may be freed by now).
    let read = w.kv.read_block(0, 7).unwrap();
    for (r, bytes) in read.iter().enumerate() {
        assert_eq!(bytes[..], block(&new, r, 7)[..], "read_block region {r}");
    }
    w.kv.shutdown().await;
    for r in 0..REGIONS {
        for b in [7, 8] {
            assert_eq!(
                block(&new, r, b),
                &expected_block("t-b", b)[..],
                "new memory, region {r} block {b}: every byte of b"
            );
        }
        for b in (0..BLOCKS as u32).filter(|b| ![7, 8].contains(b)) {
            assert!(
                block(&new, r, b).iter().all(|&x| x == FILL),
                "new memory, region {r} block {b}: nothing but b landed"
            );
        }
        for b in (0..BLOCKS as u32).filter(|&b| b != 5) {
            assert!(
                block(&old, r, b).iter().all(|&x| x == FILL),
                "old memory, region {r} block {b}: nothing landed after the pause"
            );
        }
    }
}

/// Page-aligned anonymous memory the test unmaps: any access after `unmap` faults (the test
/// process dies), so an unmapped buffer proves nothing touches it any more.
struct Mapped {
    ptr: *mut u8,
    len: usize,
}

impl Mapped {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh private anonymous mapping; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        Mapped {
            ptr: ptr.cast(),
            len,
        }
    }

    fn unmap(self) {
        // SAFETY: mapped by `new`, unmapped once.
        assert_eq!(unsafe { libc::munmap(self.ptr.cast(), self.len) }, 0);
    }
}

/// The host frees the old memory right after `resume` returned (here: unmaps it, so a single
/// byte written or read there kills the test), with a pull from before the pause still held by
/// P and sent after: every byte of the next request lands in the new memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_memory_can_be_freed_right_after_resume() {
    let old: Vec<Mapped> = (0..REGIONS).map(|_| Mapped::new(BLOCK * BLOCKS)).collect();
    let mut new = host_memory();
    // SAFETY: mapped until the resume onto `new` returned (unmapped only after it).
    let old_memory = HostMemory::new(
        old.iter()
            .map(|m| unsafe { HostRegion::new(m.ptr, m.len) }.unwrap())
            .collect(),
    );
    let config = KvRecvConfig {
        layout: KvLayout::uniform(REGIONS as u32, BLOCK as u64, BLOCKS as u32),
        pull_timeout: Duration::from_secs(3600),
        abort_grace: Duration::from_millis(200),
        quarantine_deadline: Duration::from_secs(3600),
        ..KvRecvConfig::default()
    };
    let kv = KvRecv::builder(config)
        .host_memory(old_memory)
        .events(true)
        .start()
        .unwrap();
    let events = kv.events().unwrap();
    let (tx, jobs) = mpsc::unbounded_channel();
    let writer = Arc::new(HoldingWriter {
        te: TeWriter::new(InitiatorConfig::default()),
        held: vec!["a"],
        jobs: tx,
    });
    let sim = PrefillSim::start_with_writer(SimConfig::default(), writer)
        .await
        .unwrap();
    let mut w = World {
        kv,
        events,
        sim,
        jobs,
    };
    load_ok(&mut w, "warm", &[5]).await;
    let job_a = pause_with_a_held(&mut w).await;

    // SAFETY: `new` outlives the worker (shut down below, before it is read or dropped).
    let new_memory = unsafe { regions(&mut new) };
    w.kv.resume(ResumeMemory::Host(new_memory)).await.unwrap();
    for m in old {
        m.unmap();
    }

    let late = TeWriter::new(InitiatorConfig::default()).write(job_a).await;
    assert!(
        late.is_err(),
        "a write of a pull from before the pause must be refused"
    );
    load_ok(&mut w, "b", &[3, 4]).await;
    w.kv.shutdown().await;
    for r in 0..REGIONS {
        for b in [3, 4] {
            assert_eq!(
                block(&new, r, b),
                &expected_block("t-b", b)[..],
                "new memory, region {r} block {b}: every byte of b"
            );
        }
    }
}
