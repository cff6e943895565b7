//! `device_probe gpu --fake-device`: the first GPU check's whole pipeline without a GPU, for
//! the dry run. The same P process, requests, event loop and expected bytes as on hardware,
//! into kvrecv's fake device (host bytes reached only through the staged copy path), so a
//! device run does not spend its minutes on a mistake of the probe's own.

use std::time::{Duration, Instant};

use kvrecv::DeviceMemory;

use crate::expected;
use crate::gpu_checks::{describe_bad, host_baseline, receive, request, start, GpuOpts, P_TP};
use crate::prefill::Prefill;
use crate::report::Report;

/// The check this reports.
pub const CHECK: &str = "rehearsal.fake_device.write_verified";
/// `gpu.throughput`'s host-memory baseline, run as on hardware.
pub const BASELINE: &str = "rehearsal.host_baseline";

pub async fn run(report: &mut Report, o: &GpuOpts, p: &Prefill) {
    let region = u64::from(o.blocks) * o.block_len;
    let (mem, view) = DeviceMemory::fake((region * u64::from(o.layers)) as usize);
    let (kv, mut events) = match start(o, o.blocks, mem) {
        Ok(s) => s,
        Err(e) => return report.fail(CHECK, format!("kvrecv did not start: {e}")),
    };
    let bpr = o.blocks_per_req;
    let n_reqs = o.blocks / bpr;
    let reqs = (0..n_reqs)
        .map(|r| request(p, &format!("dc-a-{r}"), r * bpr..(r + 1) * bpr))
        .collect();
    let t0 = Instant::now();
    let run = receive(&kv, &mut events, reqs, Duration::from_secs(120), |_| {}).await;
    let wall = t0.elapsed().as_secs_f64();
    kv.shutdown().await;
    if let Err(e) = run {
        return report.fail(CHECK, e);
    }
    let mut bad = Vec::new();
    for layer in 0..o.layers as usize {
        for r in 0..n_reqs {
            for b in r * bpr..(r + 1) * bpr {
                let at = layer as u64 * region + u64::from(b) * o.block_len;
                let got = view.snapshot(at as usize, o.block_len as usize);
                let want = expected::block(&format!("dc-a-{r}"), u64::from(b), o.block_len, P_TP);
                if got != want {
                    bad.push((layer, b));
                }
            }
        }
    }
    let all = (n_reqs * bpr * o.layers) as usize;
    if bad.is_empty() {
        report.pass(
            CHECK,
            format!("{all} blocks written by P TP2 through the staged device path, every one as expected ({wall:.1} s, no GPU: not a throughput figure)"),
        );
    } else {
        report.fail(CHECK, describe_bad(&bad, all));
    }
    match host_baseline(o, p).await {
        Ok((rate, d, p)) => report.pass(
            BASELINE,
            format!("every request released Ok into host memory (gib_per_s={rate:.2} d_cpu_s_per_gib={d:.3} p_cpu_s_per_gib={p:.3}; no GPU: not a figure)"),
        ),
        Err(e) => report.fail(BASELINE, e),
    }
}
