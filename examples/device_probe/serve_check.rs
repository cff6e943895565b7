//! `gpu.serve_cuda`: the operator's path onto the GPU. `kvrecv serve --gpu N` (kvrecv allocates
//! the landing memory on the device) receives every block from the same P TP2 process, over
//! the stdin/stdout protocol an operator drives; the same run into `kvrecv serve` on host
//! memory is the baseline its figures are compared with. The bytes on the device belong to
//! serve's process, so the probe checks what serve reports: every completion Ok, every byte
//! landed (a write counts as landed once the device holds it), no broken connection, a clean
//! exit.
//! The embedded checks read the same staged path's bytes back from the device.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::gpu_checks::{cpu_seconds, GpuOpts};
use crate::prefill::Prefill;
use crate::report::Report;

pub const CHECK: &str = "gpu.serve_cuda";

/// What one serve run measured.
struct Run {
    gib_per_s: f64,
    cpu_s_per_gib: f64,
    bytes_landed: u64,
}

/// A `kvrecv serve` child, driven over its pipes.
struct Serve {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Serve {
    fn start(bin: &str, args: &[String]) -> Result<Serve, String> {
        let mut child = Command::new(bin)
            .arg("serve")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {bin} serve: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let out = child.stdout.take().ok_or("no stdout")?;
        Ok(Serve {
            child,
            stdin,
            lines: BufReader::new(out).lines(),
        })
    }

    async fn send(&mut self, v: &Value) -> Result<(), String> {
        let line = format!("{v}\n");
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| format!("serve's stdin: {e}"))
    }

    /// The next line whose `event` is one of `events`; an `error` line is an error.
    async fn next(&mut self, events: &[&str], deadline: Instant) -> Result<Value, String> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = tokio::time::timeout(left, self.lines.next_line())
                .await
                .map_err(|_| format!("serve: no {events:?} line in time"))?
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("serve exited before a {events:?} line"))?;
            let v: Value = serde_json::from_str(&line).map_err(|e| format!("{line:?}: {e}"))?;
            let ev = v["event"].as_str().unwrap_or_default();
            if ev == "error" {
                return Err(format!("serve: {line}"));
            }
            if events.contains(&ev) {
                return Ok(v);
            }
        }
    }
}

/// Every block of every layer from P into `serve [extra]`, timed, then serve's own counters.
async fn one_run(bin: &str, o: &GpuOpts, p: &Prefill, extra: &[&str]) -> Result<Run, String> {
    let mut args: Vec<String> = [
        "--layers",
        &o.layers.to_string(),
        "--block-len",
        &o.block_len.to_string(),
        "--num-blocks",
        &o.blocks.to_string(),
        "--pull-timeout-ms",
        "120000",
        "--events",
        "completions",
        "--log-level",
        "warn",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut s = Serve::start(bin, &args)?;
    let deadline = Instant::now() + Duration::from_secs(150);
    let ready = s.next(&["ready"], deadline).await?;
    let want = if extra.contains(&"--gpu") {
        format!("cuda:{}", o.ordinal)
    } else {
        "host".into()
    };
    if ready["memory"] != want.as_str() {
        return Err(format!(
            "ready line says memory {}, not {want}",
            ready["memory"]
        ));
    }
    let pid = s
        .child
        .id()
        .map(|p| p.to_string())
        .ok_or("serve has no pid")?;
    let bpr = o.blocks_per_req;
    let requests: Vec<Value> = (0..o.blocks / bpr)
        .map(|r| {
            let id = format!("sv-{r}");
            json!({"req_id": id, "transfer_id": id, "remote_engine_id": p.engine_id,
                   "remote_bootstrap_addr": p.bootstrap,
                   "block_ids": [((r * bpr)..((r + 1) * bpr)).collect::<Vec<u32>>()]})
        })
        .collect();
    let n = requests.len();
    let c0 = cpu_seconds(&pid).ok_or("serve's /proc stat")?;
    let t0 = Instant::now();
    s.send(&json!({"op": "load_kv", "requests": requests}))
        .await?;
    let answer = s.next(&["load_kv"], deadline).await?;
    let rejected = answer["rejected"].as_array().map_or(0, Vec::len);
    if answer["accepted"].as_u64() != Some(n as u64) || rejected != 0 {
        return Err(format!("serve did not accept every request: {answer}"));
    }
    // A completion Ok means every peer's bytes landed (on the GPU: the device holds them).
    for _ in 0..n {
        let v = s.next(&["completion"], deadline).await?;
        if v["outcome"] != "ok" {
            return Err(format!("a request failed: {v}"));
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&pid).ok_or("serve's /proc stat")? - c0;
    s.send(&json!({"op": "stats"})).await?;
    let stats = s.next(&["stats"], deadline).await?;
    let data = &stats["data"];
    let bytes_landed = data["bytes_landed"]
        .as_u64()
        .ok_or("stats without bytes_landed")?;
    let broken = data["broken"].as_u64().unwrap_or(0);
    s.send(&json!({"op": "shutdown"})).await?;
    s.next(&["shutdown"], deadline).await?;
    drop(s.stdin);
    let status = tokio::time::timeout(Duration::from_secs(30), s.child.wait())
        .await
        .map_err(|_| "serve did not exit within 30 s of its shutdown line".to_string())?
        .map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("serve exited with {status}"));
    }
    if broken != 0 {
        return Err(format!("{broken} broken data connections: {data}"));
    }
    let gib = o.requested_bytes() as f64 / f64::from(1u32 << 30);
    Ok(Run {
        gib_per_s: gib / wall,
        cpu_s_per_gib: cpu / gib,
        bytes_landed,
    })
}

/// The rehearsal's check: the host-memory half, which needs no GPU.
pub const REHEARSAL: &str = "rehearsal.serve_host";

/// The dry run's rehearsal of this check's pipe-driving: the host-memory run alone.
pub async fn rehearse(report: &mut Report, o: &GpuOpts, p: &Prefill, bin: &str) {
    match one_run(bin, o, p, &[]).await {
        Ok(h) if h.bytes_landed == o.requested_bytes() => report.pass(
            REHEARSAL,
            format!(
                "kvrecv serve (host memory) driven over its pipes: every request ok, {} bytes landed, clean exit (no GPU: not a throughput figure)",
                h.bytes_landed
            ),
        ),
        Ok(h) => report.fail(
            REHEARSAL,
            format!("{} bytes landed of {}", h.bytes_landed, o.requested_bytes()),
        ),
        Err(e) => report.fail(REHEARSAL, e),
    }
}

/// `gpu.serve_cuda`: serve on host memory (the baseline), then `serve --gpu ORDINAL`.
pub async fn run(report: &mut Report, o: &GpuOpts, p: &Prefill, bin: &str) {
    let host = one_run(bin, o, p, &[]).await;
    let ordinal = o.ordinal.to_string();
    let gpu = one_run(bin, o, p, &["--gpu", &ordinal]).await;
    let total = o.requested_bytes();
    let fig = |r: &Run| {
        format!(
            "gib_per_s={:.2} serve_cpu_s_per_gib={:.3}",
            r.gib_per_s, r.cpu_s_per_gib
        )
    };
    let baseline = match &host {
        Ok(h) => format!("host memory, same run: {}", fig(h)),
        Err(e) => format!("host memory baseline failed: {e}"),
    };
    match gpu {
        Ok(g) if g.bytes_landed == total => report.pass(
            CHECK,
            format!(
                "serve --gpu {ordinal}: {} requests ok, {total} bytes landed on the device, clean exit; {}; {baseline}{}",
                o.blocks / o.blocks_per_req,
                fig(&g),
                host.as_ref()
                    .map(|h| format!("; ratio gpu/host gib_per_s={:.2} cpu={:.2}",
                        g.gib_per_s / h.gib_per_s, g.cpu_s_per_gib / h.cpu_s_per_gib))
                    .unwrap_or_default()
            ),
        ),
        Ok(g) => report.fail(
            CHECK,
            format!("serve --gpu {ordinal}: {} bytes landed of {total}", g.bytes_landed),
        ),
        Err(e) => report.fail(CHECK, format!("serve --gpu {ordinal}: {e}; {baseline}")),
    }
}
