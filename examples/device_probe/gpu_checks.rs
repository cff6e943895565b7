//! The GPU checks of `scripts/device-check` (docs/HARDWARE.md): kvrecv receives P's TP2 writes
//! into device memory the probe allocated as a host would, and the probe reads every block back
//! from the device.
//!
//! - `gpu.primary_ctx.write_verified`: the KV regions live in the GPU's primary context,
//!   retained by the probe itself (as PyTorch does), not by kvrecv; every block is compared.
//! - `gpu.throughput`: the same run's GiB/s and CPU seconds per GiB of D (this process) and P
//!   (the prefill-sim process), from /proc.
//! - `gpu.ordering.bytes_at_completion` / `gpu.ordering.legacy_stream`: a kernel keeps the
//!   host's legacy default stream busy while kvrecv receives a request; the moment kvrecv says
//!   it landed, the probe reads it through a non-blocking stream (never queued behind anything)
//!   and notes whether the host's queued work had finished (kvrecv waited behind it).
//! - `gpu.primary_ctx.survives_kvrecv`: the host's context and memory still work once kvrecv
//!   shut down (kvrecv released only its own retain of the primary context).
//! - `gpu.nonprimary_ctx`: regions allocated in a context of the host's own (`cuCtxCreate`):
//!   kvrecv must refuse them at start with a typed error naming the context, or land every
//!   byte; accepting them and then failing (or landing wrong bytes) is the defect.

use std::time::{Duration, Instant};

use kvrecv::{
    DeviceMemory, DeviceRegion, EventStream, HostMemory, KvLayout, KvRecv, KvRecvBuilder,
    KvRecvConfig, KvRequest,
};

use crate::cuda::{Busy, Ctx, DevBuf, Pinned, Stream};
use crate::expected;
use crate::loads;
use crate::prefill::Prefill;
use crate::report::Report;

/// P's TP size (D is TP1: each P rank writes its half of every block).
pub const P_TP: u64 = 2;

/// What the GPU checks run on.
#[derive(Debug, Clone)]
pub struct GpuOpts {
    pub ordinal: i32,
    pub layers: u32,
    pub block_len: u64,
    pub blocks: u32,
    pub blocks_per_req: u32,
    pub busy: Duration,
}

impl GpuOpts {
    /// Bytes P writes in the throughput run (every block of every layer).
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.layers) * u64::from(self.blocks) * self.block_len
    }

    /// Bytes of the blocks whole requests of `blocks_per_req` blocks cover, every layer.
    pub fn requested_bytes(&self) -> u64 {
        let blocks = self.blocks / self.blocks_per_req * self.blocks_per_req;
        u64::from(self.layers) * u64::from(blocks) * self.block_len
    }
}

/// Every check name this module reports, in order (the dry run lists them).
pub const CHECKS: [&str; 6] = [
    "gpu.primary_ctx.write_verified",
    "gpu.throughput",
    "gpu.ordering.bytes_at_completion",
    "gpu.ordering.legacy_stream",
    "gpu.primary_ctx.survives_kvrecv",
    "gpu.nonprimary_ctx",
];

/// CPU seconds (user + system) of process `pid` so far, from /proc/<pid>/stat.
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks / hz as f64)
}

fn regions(ordinal: i32, bufs: &[DevBuf]) -> Result<DeviceMemory, String> {
    let regions = bufs
        .iter()
        // SAFETY: each buffer outlives every KvRecv built on it (dropped after its shutdown),
        // and the probe reads a block only once kvrecv said it landed or released it.
        .map(|b| unsafe { DeviceRegion::new(ordinal as usize, b.ptr, b.len as u64) })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    Ok(DeviceMemory::new(regions))
}

pub fn start(o: &GpuOpts, blocks: u32, mem: DeviceMemory) -> Result<(KvRecv, EventStream), String> {
    start_with(o, blocks, |b| b.device_memory(mem))
}

/// kvrecv on `o`'s layout with `blocks` blocks per region, its memory given by `memory`.
fn start_with(
    o: &GpuOpts,
    blocks: u32,
    memory: impl FnOnce(KvRecvBuilder) -> KvRecvBuilder,
) -> Result<(KvRecv, EventStream), String> {
    let config = KvRecvConfig {
        layout: KvLayout::uniform(o.layers, o.block_len, blocks),
        pull_timeout: Duration::from_secs(120),
        ..KvRecvConfig::default()
    };
    let kv = memory(KvRecv::builder(config))
        .events(true)
        .start()
        .map_err(|e| e.to_string())?;
    let events = kv.events().map_err(|e| e.to_string())?;
    Ok((kv, events))
}

/// The same run as the timed GPU one (every block of every layer, the same P, the same request
/// sizes) into host memory: the throughput check's baseline, measured in the same invocation.
/// Returns `(GiB/s, D CPU s/GiB, P CPU s/GiB)`.
pub async fn host_baseline(o: &GpuOpts, p: &Prefill) -> Result<(f64, f64, f64), String> {
    let region = (u64::from(o.blocks) * o.block_len) as usize;
    let mem =
        HostMemory::owned(vec![vec![0u8; region]; o.layers as usize]).map_err(|e| e.to_string())?;
    let (kv, mut events) = start_with(o, o.blocks, |b| b.host_memory(mem))?;
    let bpr = o.blocks_per_req;
    let reqs = (0..o.blocks / bpr)
        .map(|r| request(p, &format!("dc-h-{r}"), r * bpr..(r + 1) * bpr))
        .collect();
    let pid = p.pid().map(|p| p.to_string()).ok_or("P has no pid")?;
    let (d0, p0) = (cpu_seconds("self"), cpu_seconds(&pid));
    let t0 = Instant::now();
    let run = receive(&kv, &mut events, reqs, Duration::from_secs(150), |_| {}).await;
    let wall = t0.elapsed().as_secs_f64();
    let (d1, p1) = (cpu_seconds("self"), cpu_seconds(&pid));
    kv.shutdown().await;
    run?;
    let gib = o.requested_bytes() as f64 / f64::from(1u32 << 30);
    match (d0, d1, p0, p1) {
        (Some(d0), Some(d1), Some(p0), Some(p1)) => {
            Ok((gib / wall, (d1 - d0) / gib, (p1 - p0) / gib))
        }
        _ => Err("no /proc CPU figures".into()),
    }
}

pub fn request(p: &Prefill, id: &str, blocks: std::ops::Range<u32>) -> KvRequest {
    loads::request(&p.engine_id, &p.bootstrap, id, blocks.collect())
}

/// Load `reqs` and wait until every one is released; a failed completion is an error.
pub async fn receive(
    kv: &KvRecv,
    events: &mut EventStream,
    reqs: Vec<KvRequest>,
    timeout: Duration,
    on_landed: impl FnMut(&str),
) -> Result<(), String> {
    loads::all_ok(&loads::receive(kv, events, reqs, timeout, on_landed).await?)
}

/// Compare blocks `blocks` of every layer, written for `transfer_id`, with what is on the
/// device; returns the blocks that differ as `(layer, block)`.
fn verify(
    bufs: &[DevBuf],
    stream: &Stream,
    pinned: &Pinned,
    transfer_id: &str,
    blocks: std::ops::Range<u32>,
    block_len: u64,
) -> Result<Vec<(usize, u32)>, String> {
    let n = blocks.len() * block_len as usize;
    let first = u64::from(blocks.start);
    let mut bad = Vec::new();
    for (layer, buf) in bufs.iter().enumerate() {
        stream.read(pinned, buf.ptr + first * block_len, n)?;
        let got = pinned.to_vec(n);
        for b in blocks.clone() {
            let at = (u64::from(b) - first) as usize * block_len as usize;
            let want = expected::block(transfer_id, u64::from(b), block_len, P_TP);
            if got[at..at + block_len as usize] != want[..] {
                bad.push((layer, b));
            }
        }
    }
    Ok(bad)
}

/// The first `n` bytes of every layer, read on the probe's non-blocking stream.
fn snapshot(
    bufs: &[DevBuf],
    stream: &Stream,
    pinned: &Pinned,
    n: usize,
) -> Result<Vec<Vec<u8>>, String> {
    bufs.iter()
        .map(|b| {
            stream.read(pinned, b.ptr, n)?;
            Ok(pinned.to_vec(n))
        })
        .collect()
}

pub fn describe_bad(bad: &[(usize, u32)], of: usize) -> String {
    let first = bad
        .iter()
        .take(4)
        .map(|(l, b)| format!("layer {l} block {b}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "{} of {of} block(s) differ on the device (first: {first})",
        bad.len()
    )
}

/// Run every GPU check against P; one report line each.
pub async fn run(report: &mut Report, o: &GpuOpts, p: &Prefill) {
    match Ctx::retain_primary(o.ordinal) {
        Ok(ctx) => primary(report, o, p, ctx).await,
        Err(e) => {
            for c in &CHECKS[..5] {
                report.fail(c, format!("cannot retain the primary context: {e}"));
            }
        }
    }
    nonprimary(report, o, p).await;
}

async fn primary(report: &mut Report, o: &GpuOpts, p: &Prefill, ctx: Ctx) {
    let bpr = o.blocks_per_req;
    let bufs = match (0..o.layers)
        .map(|_| DevBuf::alloc_zeroed((u64::from(o.blocks) * o.block_len) as usize))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(b) => b,
        Err(e) => {
            for c in &CHECKS[..5] {
                report.fail(c, format!("device allocation: {e}"));
            }
            return;
        }
    };
    let pinned = Pinned::alloc(bpr as usize * o.block_len as usize);
    let stream = Stream::non_blocking();
    let (pinned, stream) = match (pinned, stream) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            for c in &CHECKS[..5] {
                report.fail(c, format!("probe setup: {e}"));
            }
            return;
        }
    };
    let started = regions(o.ordinal, &bufs).and_then(|m| start(o, o.blocks, m));
    let (kv, mut events) = match started {
        Ok(s) => s,
        Err(e) => {
            for c in &CHECKS[..5] {
                report.fail(
                    c,
                    format!("kvrecv did not start on the host's primary-context memory: {e}"),
                );
            }
            return;
        }
    };
    // kvrecv's start may leave its own binding on this thread: the probe reads in its context.
    let _ = ctx.bind();

    // 1. Every block, P TP2, timed; then every block read back from the device.
    let reqs: Vec<KvRequest> = (0..o.blocks / bpr)
        .map(|r| request(p, &format!("dc-a-{r}"), r * bpr..(r + 1) * bpr))
        .collect();
    let n_reqs = reqs.len();
    let pid = p.pid().map(|p| p.to_string());
    let (d0, p0) = (cpu_seconds("self"), pid.as_deref().and_then(cpu_seconds));
    let t0 = Instant::now();
    let run = receive(&kv, &mut events, reqs, Duration::from_secs(150), |_| {}).await;
    let wall = t0.elapsed().as_secs_f64();
    let (d1, p1) = (cpu_seconds("self"), pid.as_deref().and_then(cpu_seconds));
    let verified = run.and_then(|()| {
        let mut bad = Vec::new();
        for r in 0..n_reqs as u32 {
            bad.extend(verify(
                &bufs,
                &stream,
                &pinned,
                &format!("dc-a-{r}"),
                r * bpr..(r + 1) * bpr,
                o.block_len,
            )?);
        }
        let all = n_reqs * bpr as usize * o.layers as usize;
        if bad.is_empty() {
            Ok(all)
        } else {
            Err(describe_bad(&bad, all))
        }
    });
    let gib = o.total_bytes() as f64 / f64::from(1u32 << 30);
    match &verified {
        Ok(all) => {
            report.pass(
                "gpu.primary_ctx.write_verified",
                format!(
                    "{all} blocks of {} KiB ({n_reqs} requests, {} layers) written by P TP2, every one equal on the device",
                    o.block_len / 1024,
                    o.layers
                ),
            );
            let per_gib = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => format!("{:.3}", (b - a) / gib),
                _ => "n/a".into(),
            };
            // Host memory, the same run shape, right after: what the GPU's staging costs.
            let baseline = match host_baseline(o, p).await {
                Ok((h_rate, h_d, h_p)) => {
                    let ratio = match (d0, d1) {
                        (Some(a), Some(b)) => format!("{:.2}", (b - a) / gib / h_d),
                        _ => "n/a".into(),
                    };
                    format!(
                        " host_gib_per_s={h_rate:.2} host_d_cpu_s_per_gib={h_d:.3} host_p_cpu_s_per_gib={h_p:.3} gpu/host gib_per_s={:.2} d_cpu={ratio}",
                        gib / wall / h_rate
                    )
                }
                Err(e) => format!(" host baseline failed: {e}"),
            };
            report.pass(
                "gpu.throughput",
                format!(
                    "gib={gib:.2} seconds={wall:.2} gib_per_s={:.2} d_cpu_s_per_gib={} p_cpu_s_per_gib={} build={};{baseline}",
                    gib / wall,
                    per_gib(d0, d1),
                    per_gib(p0, p1),
                    if cfg!(debug_assertions) { "debug" } else { "release" }
                ),
            );
        }
        Err(e) => {
            report.fail("gpu.primary_ctx.write_verified", e);
            report.skip("gpu.throughput", "the run it measures failed");
        }
    }

    // 2. Ordering against a busy legacy default stream.
    ordering(report, o, p, &kv, &mut events, &bufs, &stream, &pinned).await;

    // 3. kvrecv gone: the host's context and bytes are still usable.
    let n = bpr as usize * o.block_len as usize;
    let before = snapshot(&bufs, &stream, &pinned, n);
    kv.shutdown().await;
    drop(events);
    let survived = before.and_then(|before| {
        ctx.bind()?;
        let after = snapshot(&bufs, &stream, &pinned, n)?;
        let _scratch = DevBuf::alloc_zeroed(4096)?;
        ctx.synchronize()?;
        Ok(before == after)
    });
    match survived {
        Ok(true) => report.pass(
            "gpu.primary_ctx.survives_kvrecv",
            "after kvrecv's shutdown the host's primary context allocates, synchronises and still holds the landed bytes",
        ),
        Ok(false) => report.fail(
            "gpu.primary_ctx.survives_kvrecv",
            "the first blocks of the host's regions changed across kvrecv's shutdown",
        ),
        Err(e) => report.fail(
            "gpu.primary_ctx.survives_kvrecv",
            format!("the host's context is unusable after kvrecv's shutdown: {e}"),
        ),
    }
    drop(bufs);
    drop(ctx);
}

/// What the probe saw the moment kvrecv reported a request landed: time since the busy
/// kernel was queued, whether that kernel had finished, the blocks that differed.
type AtLanding = (
    Duration,
    Result<bool, String>,
    Result<Vec<(usize, u32)>, String>,
);

#[allow(clippy::too_many_arguments)]
async fn ordering(
    report: &mut Report,
    o: &GpuOpts,
    p: &Prefill,
    kv: &KvRecv,
    events: &mut EventStream,
    bufs: &[DevBuf],
    stream: &Stream,
    pinned: &Pinned,
) {
    let bpr = o.blocks_per_req;
    let mut busy = match Busy::start(o.busy) {
        Ok(b) => b,
        Err(e) => {
            let why = format!("cannot queue the busy kernel on the legacy stream: {e}");
            report.skip("gpu.ordering.bytes_at_completion", &why);
            report.skip("gpu.ordering.legacy_stream", why);
            return;
        }
    };
    let t0 = Instant::now();
    // What was true the moment kvrecv said the bytes landed: read before anything else.
    let mut at_landing: Option<AtLanding> = None;
    let run = receive(
        kv,
        events,
        vec![request(p, "dc-b-0", 0..bpr)],
        Duration::from_secs(60) + o.busy,
        |_| {
            let elapsed = t0.elapsed();
            let busy_done = busy.done();
            let bad = verify(bufs, stream, pinned, "dc-b-0", 0..bpr, o.block_len);
            at_landing = Some((elapsed, busy_done, bad));
        },
    )
    .await;
    // What stopped the kernel: a release before the landing means the copies waited for it.
    let outcome = busy.finish();
    let blocks = bpr as usize * o.layers as usize;
    match (run, at_landing) {
        (Err(e), _) => {
            report.fail("gpu.ordering.bytes_at_completion", &e);
            report.skip(
                "gpu.ordering.legacy_stream",
                format!("the request failed: {e}"),
            );
        }
        (Ok(()), None) => {
            report.fail(
                "gpu.ordering.bytes_at_completion",
                "released without an Ok completion",
            );
            report.skip("gpu.ordering.legacy_stream", "no completion to time");
        }
        (Ok(()), Some((elapsed, busy_done, bad))) => {
            match bad {
                Ok(b) if b.is_empty() => report.pass(
                    "gpu.ordering.bytes_at_completion",
                    format!("all {blocks} blocks on the device when kvrecv reported them landed (read on a non-blocking stream)"),
                ),
                Ok(b) => report.fail(
                    "gpu.ordering.bytes_at_completion",
                    format!("reported landed before the bytes were on the device: {}", describe_bad(&b, blocks)),
                ),
                Err(e) => report.fail("gpu.ordering.bytes_at_completion", format!("read-back: {e}")),
            }
            let ms = elapsed.as_millis();
            let busy_ms = o.busy.as_millis();
            let how = match &outcome {
                Ok(b) if b.released => format!(
                    "the kernel spun {} ms by %globaltimer until released",
                    b.spun.as_millis()
                ),
                Ok(b) => format!(
                    "the kernel stopped at its cap after {} ms by %globaltimer",
                    b.spun.as_millis()
                ),
                Err(e) => format!("waiting for the kernel: {e}"),
            };
            match busy_done {
                Ok(false) => report.pass(
                    "gpu.ordering.legacy_stream",
                    format!("landed after {ms} ms while the host's legacy stream was still busy (kernel held up to {busy_ms} ms; {how}): kvrecv's copies did not queue behind it"),
                ),
                Ok(true) => report.fail(
                    "gpu.ordering.legacy_stream",
                    format!("landed only after {ms} ms, once the host's legacy-stream kernel (held up to {busy_ms} ms) had finished ({how}): kvrecv's copies waited behind the host's GPU work"),
                ),
                Err(e) => report.fail("gpu.ordering.legacy_stream", e),
            }
        }
    }
}

async fn nonprimary(report: &mut Report, o: &GpuOpts, p: &Prefill) {
    const CHECK: &str = "gpu.nonprimary_ctx";
    let bpr = o.blocks_per_req;
    let ctx = match Ctx::create(o.ordinal) {
        Ok(c) => c,
        Err(e) => return report.fail(CHECK, format!("cannot create a context: {e}")),
    };
    let setup = (0..o.layers)
        .map(|_| DevBuf::alloc_zeroed((u64::from(bpr) * o.block_len) as usize))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|bufs| {
            Ok((
                bufs,
                Stream::non_blocking()?,
                Pinned::alloc(bpr as usize * o.block_len as usize)?,
            ))
        });
    let (bufs, stream, pinned) = match setup {
        Ok(s) => s,
        Err(e) => return report.fail(CHECK, format!("probe setup: {e}")),
    };
    let started = regions(o.ordinal, &bufs).and_then(|m| start(o, bpr, m));
    let (kv, mut events) = match started {
        Err(e) if e.to_lowercase().contains("context") => {
            return report.pass(CHECK, format!("refused at start: {e}"));
        }
        Err(e) => {
            return report.fail(
                CHECK,
                format!("start failed without naming the context: {e}"),
            )
        }
        Ok(s) => s,
    };
    let run = receive(
        &kv,
        &mut events,
        vec![request(p, "dc-c-0", 0..bpr)],
        Duration::from_secs(60),
        |_| {},
    )
    .await;
    kv.shutdown().await;
    let _ = ctx.bind();
    let blocks = bpr as usize * o.layers as usize;
    match run.and_then(|()| verify(&bufs, &stream, &pinned, "dc-c-0", 0..bpr, o.block_len)) {
        Ok(bad) if bad.is_empty() => report.pass(
            CHECK,
            format!("accepted; all {blocks} blocks landed in the non-primary context's memory"),
        ),
        Ok(bad) => report.fail(
            CHECK,
            format!("accepted, then {}", describe_bad(&bad, blocks)),
        ),
        Err(e) => report.fail(CHECK, format!("accepted at start, then: {e}")),
    }
    drop((bufs, stream, pinned));
    // DeviceRegion's contract: the context may go once shutdown returned, before the handle.
    // kvrecv's staging slots lived in it; had they outlived shutdown, dropping the handle
    // below would use a destroyed context (device-check's `gpu.clean_exit` sees the crash).
    drop(ctx);
    drop(events);
    drop(kv);
}
