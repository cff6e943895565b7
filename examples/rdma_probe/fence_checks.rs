//! The RDMA checks of `scripts/device-check` that need more than `serve` offers
//! (docs/HARDWARE.md): kvrecv embedded as a host would embed it, the host's own memory
//! registered on this node's RDMA devices, P a simulated prefill engine whose transfer engine is
//! the real Mooncake TE wheel, so that every landed byte can be read in the host's memory and
//! the fence is triggered the way production triggers it (P reports a transfer failed).
//!
//! - `<p>.embed_target`: the target starts on the devices with the host's memory.
//! - `<p>.te_write_verified`: P's TE writes a request's blocks; every byte is in host memory.
//! - `<p>.fence`: P reports a written request failed; kvrecv releases it fenced.
//! - `<p>.fence.retry_exceeded`: P's TE reposts the same writes on its endpoint: the TE logs
//!   `transport retry counter exceeded` (the fenced QP drops packets, it does not NAK).
//! - `<p>.fence.rehandshake`: D answered more handshakes after that (Mooncake re-establishes
//!   the endpoint and redispatches the slice).
//! - `<p>.fence.late_write_refused`: the released blocks still hold the first write: the
//!   retried write, through a new handshake, did not land (issue 41 defect 1).
//!
//! `<p>` is `rdma`, or `rehearsal.tcp` for the dry run's rehearsal (the same steps over kvrecv's
//! TCP target and the TE's TCP transport, where the fence is the permit revocation).

use std::sync::Arc;
use std::time::Duration;

use kvrecv::sim::{PrefillSim, SimConfig};
use kvrecv::{HostMemory, HostRegion, KvLayout, KvRecv, KvRecvConfig};
use tokio::sync::{mpsc, Mutex};

use crate::loads;
use crate::report::Report;
use crate::session_writer::{Sent, SessionWriter};
use crate::te_session::{pattern, TeSession, Write};

const BLOCK: u64 = 64 * 1024;
const BLOCKS: u32 = 16;

/// What the checks run with.
pub struct Opts {
    /// `rdma` or `tcp`.
    pub protocol: String,
    pub device: String,
    pub python: String,
    pub te_script: String,
    pub te_log: String,
}

impl Opts {
    fn prefix(&self) -> &'static str {
        if self.protocol == "rdma" {
            "rdma"
        } else {
            "rehearsal.tcp"
        }
    }
}

/// The check names, without their prefix (the dry run lists them).
pub const CHECKS: [&str; 6] = [
    "embed_target",
    "te_write_verified",
    "fence",
    "fence.retry_exceeded",
    "fence.rehandshake",
    "fence.late_write_refused",
];

/// The host's KV region: kvrecv's writers and this probe share it through raw pointers only.
struct Region {
    ptr: *mut u8,
    len: usize,
}

impl Region {
    fn new(len: usize) -> Region {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        Region {
            len: b.len(),
            ptr: Box::into_raw(b).cast(),
        }
    }

    /// A copy of `len` bytes at `off` (the probe reads a block only after kvrecv released it).
    fn read(&self, off: u64, len: u64) -> Vec<u8> {
        assert!(off + len <= self.len as u64, "read past the region");
        let mut v = vec![0u8; len as usize];
        // SAFETY: inside the allocation; the bytes are plain u8 that a NIC or the data server
        // may write, which a copy through raw pointers tolerates.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(off as usize), v.as_mut_ptr(), v.len())
        };
        v
    }

    /// Writes whose bytes in the region are not `pattern(seed)` (`seed_of` picks the seed).
    fn differing(&self, writes: &[Write], seed_of: impl Fn(&Write) -> u8) -> usize {
        writes
            .iter()
            .filter(|w| self.read(w.region_offset, w.len) != pattern(seed_of(w), w.len as usize))
            .count()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` in `new`, with this length; dropped after kvrecv.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

fn start_kv(o: &Opts, region: &Region) -> Result<KvRecv, String> {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(1, BLOCK, BLOCKS),
        pull_timeout: Duration::from_secs(120),
        ..KvRecvConfig::default()
    };
    // SAFETY: the region outlives kvrecv (dropped after its shutdown) and the probe reads a
    // block only after kvrecv released it.
    let host = unsafe { HostRegion::new(region.ptr, region.len) }.map_err(|e| e.to_string())?;
    let b = KvRecv::builder(config)
        .host_memory(HostMemory::new(vec![host]))
        .events(true);
    let b = if o.protocol == "rdma" {
        b.rdma_devices(kvrecv::rdma::verbs::RdmaDeviceConfig::default())
    } else {
        b
    };
    b.start().map_err(|e| e.to_string())
}

async fn handshakes(kv: &KvRecv) -> Option<u64> {
    Some(kv.stats().await.ok()?.data?.handshakes)
}

fn sent_for(sent: &mut mpsc::UnboundedReceiver<Sent>, id: &str) -> Vec<Sent> {
    let mut v = Vec::new();
    while let Ok(s) = sent.try_recv() {
        if s.req_ids.iter().any(|r| r == id) {
            v.push(s);
        }
    }
    v
}

pub async fn run(report: &mut Report, o: &Opts) {
    let p = o.prefix();
    let name = |c: &str| format!("{p}.{c}");
    let skip_from = |report: &mut Report, from: usize, why: &str| {
        for c in &CHECKS[from..] {
            report.skip(&format!("{p}.{c}"), why);
        }
    };
    let region = Region::new((BLOCK * u64::from(BLOCKS)) as usize);
    let kv = match start_kv(o, &region) {
        Ok(kv) => kv,
        Err(e) => {
            report.fail(&name("embed_target"), format!("kvrecv did not start: {e}"));
            return skip_from(report, 1, "no target");
        }
    };
    report.pass(
        &name("embed_target"),
        format!(
            "segment {}, the host's {} KiB region registered ({})",
            kv.segment_name().unwrap_or("?"),
            region.len / 1024,
            o.protocol
        ),
    );
    let mut events = match kv.events() {
        Ok(e) => e,
        Err(e) => {
            report.fail(&name("te_write_verified"), e);
            return skip_from(report, 2, "no events");
        }
    };
    let log = match std::fs::File::create(&o.te_log) {
        Ok(f) => f,
        Err(e) => {
            report.fail(
                &name("te_write_verified"),
                format!("TE log {}: {e}", o.te_log),
            );
            return skip_from(report, 2, "no TE");
        }
    };
    let te = match TeSession::start(&o.python, &o.te_script, &o.protocol, &o.device, log).await {
        Ok(t) => Arc::new(Mutex::new(t)),
        Err(e) => {
            report.fail(&name("te_write_verified"), e);
            kv.shutdown().await;
            return skip_from(report, 2, "no TE");
        }
    };
    let (tx, mut sent) = mpsc::unbounded_channel();
    let writer = SessionWriter {
        te: te.clone(),
        sent: tx,
    };
    let sim = match PrefillSim::start_with_writer(
        SimConfig {
            engine_id: "rdma-probe-p".into(),
            ..SimConfig::default()
        },
        Arc::new(writer),
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            report.fail(&name("te_write_verified"), format!("P simulator: {e}"));
            kv.shutdown().await;
            return skip_from(report, 2, "no P");
        }
    };
    let req = |id: &str, blocks: Vec<u32>| {
        loads::request(sim.engine_id(), &sim.bootstrap_url(), id, blocks)
    };
    let wait = Duration::from_secs(150);

    // 1. A request written by P's TE, every byte compared in the host's memory.
    let first = loads::receive(
        &kv,
        &mut events,
        vec![req("write-1", vec![1, 2, 3])],
        wait,
        |_| {},
    )
    .await
    .and_then(|e| loads::all_ok(&e));
    let writes: Vec<Write> = sent_for(&mut sent, "write-1")
        .into_iter()
        .flat_map(|s| s.writes)
        .collect();
    match first {
        Err(e) => {
            report.fail(&name("te_write_verified"), e);
            return finish(kv, sim, te, report, p, "the first write failed").await;
        }
        Ok(()) if writes.is_empty() => {
            report.fail(&name("te_write_verified"), "released, but P's writer never ran");
            return finish(kv, sim, te, report, p, "the first write failed").await;
        }
        Ok(()) => match region.differing(&writes, |w| w.seed) {
            0 => report.pass(
                &name("te_write_verified"),
                format!(
                    "{} writes ({} bytes) by the TE over {} from {:?}, every byte in the host's memory",
                    writes.len(),
                    writes.iter().map(|w| w.len).sum::<u64>(),
                    o.protocol,
                    o.device
                ),
            ),
            n => report.fail(
                &name("te_write_verified"),
                format!("{n} of {} writes differ in the host's memory", writes.len()),
            ),
        },
    }

    // 2. P writes, then reports the transfer failed: kvrecv must fence before releasing.
    let fenced = loads::receive(
        &kv,
        &mut events,
        vec![req("fence-1", vec![5, 6])],
        wait,
        |_| {},
    )
    .await;
    let fence_sent = sent_for(&mut sent, "fence-1");
    let Some(first_write) = fence_sent.first().cloned() else {
        report.fail(
            &name("fence"),
            format!("P's writer never ran for fence-1 ({fenced:?})"),
        );
        return finish(kv, sim, te, report, p, "no write to repost").await;
    };
    match fenced.map(|mut e| e.remove("fence-1").unwrap_or_default()) {
        Err(e) => {
            report.fail(&name("fence"), e);
            return finish(kv, sim, te, report, p, "fence-1 was not released").await;
        }
        Ok(e) if e.fenced && !e.forced && first_write.rc == 0 => report.pass(
            &name("fence"),
            format!(
                "P wrote blocks 5-6 then reported the transfer failed ({}); kvrecv released them fenced",
                e.failure.as_deref().unwrap_or("no failure?")
            ),
        ),
        Ok(e) => {
            report.fail(
                &name("fence"),
                format!(
                    "released with fenced={} forced={} (first write rc {})",
                    e.fenced, e.forced, first_write.rc
                ),
            );
            return finish(kv, sim, te, report, p, "no fence to test").await;
        }
    }
    let landed_first = region.differing(&first_write.writes, |w| w.seed) == 0;

    // 3. P reposts the same slices after the fence, on its existing endpoint, other bytes.
    let late: Vec<Write> = first_write
        .writes
        .iter()
        .map(|w| Write {
            seed: w.seed ^ 0x55,
            ..*w
        })
        .collect();
    let hs0 = handshakes(&kv).await;
    let repost = te.lock().await.write(&first_write.target, &late).await;
    let hs1 = handshakes(&kv).await;
    let te_log = std::fs::read_to_string(&o.te_log).unwrap_or_default();
    let (rc, secs) = match repost {
        Ok(r) => r,
        Err(e) => {
            report.fail(
                &name("fence.late_write_refused"),
                format!("the repost: {e}"),
            );
            skip_from(report, 3, "the repost did not complete");
            return finish(kv, sim, te, report, p, "").await;
        }
    };
    let retry_exc = te_log.matches("retry counter exceeded").count();
    if retry_exc > 0 {
        report.pass(
            &name("fence.retry_exceeded"),
            format!("P's TE logged 'transport retry counter exceeded' {retry_exc} time(s); repost rc {rc} after {secs:.1} s"),
        );
    } else if o.protocol != "rdma" {
        report.skip(
            &name("fence.retry_exceeded"),
            format!("no queue pairs over TCP (repost rc {rc} after {secs:.1} s)"),
        );
    } else {
        report.skip(
            &name("fence.retry_exceeded"),
            format!("no 'transport retry counter exceeded' in the TE's log (repost rc {rc} after {secs:.1} s; see {})", o.te_log),
        );
    }
    match (hs0, hs1) {
        (Some(a), Some(b)) if b > a => report.pass(
            &name("fence.rehandshake"),
            format!(
                "D answered {} more handshake(s) during the repost: P re-established its endpoint",
                b - a
            ),
        ),
        (Some(a), Some(_)) => report.skip(
            &name("fence.rehandshake"),
            format!("P did not re-handshake during the repost (handshakes stayed {a})"),
        ),
        _ => report.skip(
            &name("fence.rehandshake"),
            "no handshake counter from kvrecv's stats",
        ),
    }
    let still_first = region.differing(&first_write.writes, |w| w.seed) == 0;
    let now_late = region.differing(&late, |w| w.seed) < late.len();
    if now_late {
        report.fail(
            &name("fence.late_write_refused"),
            format!("the write P reposted after the fence landed in released blocks (rc {rc} after {secs:.1} s; issue 41 defect 1)"),
        );
    } else if rc == 0 {
        report.fail(
            &name("fence.late_write_refused"),
            "the TE reported the repost written, yet the blocks do not hold it: inconclusive",
        );
    } else if !landed_first || !still_first {
        report.fail(
            &name("fence.late_write_refused"),
            format!("refused (rc {rc}), but blocks 5-6 hold neither write (first write landed: {landed_first})"),
        );
    } else {
        report.pass(
            &name("fence.late_write_refused"),
            format!("the repost failed (rc {rc} after {secs:.1} s) and blocks 5-6 still hold P's first write"),
        );
    }
    finish(kv, sim, te, report, p, "").await;
}

/// Shut everything down; `skipped` (when not empty) marks the checks not reached yet.
async fn finish(
    kv: KvRecv,
    sim: PrefillSim,
    te: Arc<Mutex<TeSession>>,
    report: &mut Report,
    prefix: &str,
    skipped: &str,
) {
    if !skipped.is_empty() {
        for c in &CHECKS[2..] {
            let n = format!("{prefix}.{c}");
            if !report.reported(&n) {
                report.skip(&n, skipped);
            }
        }
    }
    kv.shutdown().await;
    drop(sim);
    if let Ok(te) = Arc::try_unwrap(te) {
        te.into_inner().stop().await;
    }
}
