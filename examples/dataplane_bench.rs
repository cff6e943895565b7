//! Loopback data plane: kvrecv's TE target against the real Mooncake TE target, each in its own
//! process, written by the real TE (the PyPI wheel) and by kvrecv's Rust initiator, each in its
//! own process. Reports throughput and the **target's** CPU seconds per GiB landed (user+sys
//! from /proc/<pid>/stat over the write), medians of interleaved pairs. Not a test; the figures
//! go in docs/PERFORMANCE.md.
//!
//! ```text
//! cargo run --release --example dataplane_bench -- [MiB per run, default 256] [pairs, default 5]
//! ```
//! Needs the Python venv (`KVRECV_PYTHON`, default `.venv/bin/python`) with
//! `mooncake-transfer-engine-non-cuda`. The example re-runs itself for its own roles:
//! `target <write size>` (kvrecv's target, one open pull over the region) and
//! `write <handshake addr> <base> <write size> <total>` (the Rust writer).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use kvrecv::layout::KvLayout;
use kvrecv::messages::{PeerId, RequestMeta};
use kvrecv::rdma::{Landing, PullWindow, TargetConfig, TcpTarget};
use kvrecv::sim::initiator::{InitiatorConfig, TeInitiator};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

const REGION: u64 = 64 << 20;
const LANES: usize = 4;

fn python() -> PathBuf {
    std::env::var_os("KVRECV_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"))
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/te_bench.py")
}

/// user + sys CPU seconds of process `pid` so far.
fn cpu_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    let rest = &s[s.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

/// A target process: its pid, the segment (`host:port` of its handshake daemon) and the base
/// address of the region writers fill.
struct Target {
    child: Child,
    pid: u32,
    segment: String,
    base: u64,
}

async fn read_json(child: &mut Child) -> serde_json::Value {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped stdout"))
        .read_line(&mut line)
        .await
        .expect("target line");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("target JSON {line:?}: {e}"))
}

async fn start_target(kvrecv: bool, size: u64) -> Target {
    let mut cmd = if kvrecv {
        let mut c = Command::new(std::env::current_exe().expect("own path"));
        c.args(["target", &size.to_string()]);
        c
    } else {
        let mut c = Command::new(python());
        c.arg(script()).args(["target", &REGION.to_string()]);
        c
    };
    let mut child = cmd
        .env("MC_LOG_LEVEL", "WARNING")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("target starts");
    let pid = child.id().expect("pid");
    let v = read_json(&mut child).await;
    Target {
        child,
        pid,
        segment: v["segment"].as_str().expect("segment").to_owned(),
        base: v["addr"].as_u64().expect("addr"),
    }
}

/// One write run into `t` by the TE wheel (`te`) or the Rust writer, each its own process:
/// (bytes/s, target CPU seconds per GiB).
async fn write_run(te: bool, t: &Target, size: u64, total: u64) -> (f64, f64) {
    let mut cmd = if te {
        let mut c = Command::new(python());
        c.arg(script()).args([
            "write",
            &t.segment,
            &t.base.to_string(),
            &REGION.to_string(),
            &size.to_string(),
            &total.to_string(),
        ]);
        c
    } else {
        let mut c = Command::new(std::env::current_exe().expect("own path"));
        c.args([
            "write",
            &t.segment,
            &t.base.to_string(),
            &size.to_string(),
            &total.to_string(),
        ]);
        c
    };
    let c0 = cpu_s(t.pid);
    let out = cmd
        .env("MC_LOG_LEVEL", "WARNING")
        .stderr(Stdio::null())
        .output()
        .await
        .expect("writer runs");
    let cpu = cpu_s(t.pid) - c0;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(text.lines().last().unwrap_or("{}")).expect("writer JSON");
    let bytes = v["bytes"].as_f64().expect("bytes");
    (
        bytes / v["seconds"].as_f64().expect("seconds"),
        cpu / (bytes / f64::from(1u32 << 30)),
    )
}

/// Role `target`: kvrecv's TCP target with one pull open over the whole region (permits on),
/// until stdin closes.
async fn serve_target(size: u64) {
    let blocks = (REGION / size) as u32;
    let t = TcpTarget::start(TargetConfig::loopback(KvLayout::uniform(1, size, blocks)))
        .await
        .expect("target starts");
    let req = Arc::new(RequestMeta {
        req_id: "bench".into(),
        transfer_id: "bench".into(),
        engine_id: "e".into(),
        bootstrap_addr: "b".into(),
        block_ids: vec![(0..blocks).collect()],
    });
    let peer = PeerId::new("tcp://127.0.0.1:1");
    let bases = t.landing().open_pull(&PullWindow {
        pull_id: 1,
        peer: &peer,
        requests: &[req],
    });
    println!(
        "{}",
        serde_json::json!({"segment": t.segment_name(), "addr": bases[0]})
    );
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
}

/// Role `write`: the Rust initiator, `LANES` lanes, `total` bytes in `size` writes.
async fn rust_write(segment: &str, base: u64, size: u64, total: u64) {
    let hs: std::net::SocketAddr = segment.parse().expect("segment is ip:port");
    let ini = Arc::new(
        TeInitiator::connect(
            hs,
            InitiatorConfig {
                lanes: LANES,
                ..Default::default()
            },
        )
        .await
        .expect("handshake"),
    );
    let payload = Arc::new(vec![0x5Au8; size as usize]);
    let slots = REGION / size;
    let n = total / size;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for lane in 0..LANES as u64 {
        let (ini, payload) = (ini.clone(), payload.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = lane;
            while i < n {
                ini.write(base + (i % slots) * size, &payload)
                    .await
                    .expect("write lands");
                i += LANES as u64;
            }
        }));
    }
    for t in tasks {
        t.await.expect("lane");
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({"seconds": secs, "bytes": n * size})
    );
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let num = |i: usize| -> u64 { args[i].parse().expect("a number") };
    match args.get(1).map(String::as_str) {
        Some("target") => return serve_target(num(2)).await,
        Some("write") => return rust_write(&args[2], num(3), num(4), num(5)).await,
        _ => {}
    }
    let total: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(256) << 20;
    let pairs: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    println!(
        "loopback, {LANES} lanes, {} MiB per run, medians of {pairs} interleaved pairs, every party its own process",
        total >> 20
    );
    println!("| write size | writer | TE target GB/s | kvrecv GB/s | kvrecv/TE | TE target CPU s/GiB | kvrecv CPU s/GiB | kvrecv/TE CPU |");
    println!("|---|---|---|---|---|---|---|---|");
    for size in [256u64 << 10, 1 << 20] {
        let te_t = start_target(false, size).await;
        let kv_t = start_target(true, size).await;
        for (te_writer, name) in [(true, "TE wheel"), (false, "Rust")] {
            let (mut te_bw, mut kv_bw, mut te_cpu, mut kv_cpu) = (vec![], vec![], vec![], vec![]);
            for i in 0..pairs {
                // Interleaved, the order alternating.
                let order: [bool; 2] = if i % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                };
                for kvrecv in order {
                    let t = if kvrecv { &kv_t } else { &te_t };
                    let (bw, cpu) = write_run(te_writer, t, size, total).await;
                    if kvrecv {
                        kv_bw.push(bw);
                        kv_cpu.push(cpu);
                    } else {
                        te_bw.push(bw);
                        te_cpu.push(cpu);
                    }
                }
            }
            let (tb, kb, tc, kc) = (
                median(&mut te_bw),
                median(&mut kv_bw),
                median(&mut te_cpu),
                median(&mut kv_cpu),
            );
            println!(
                "| {} KiB | {name} | {:.2} | {:.2} | {:.2}x | {:.3} | {:.3} | {:.2}x |",
                size >> 10,
                tb / 1e9,
                kb / 1e9,
                kb / tb,
                tc,
                kc,
                kc / tc
            );
        }
        for mut t in [te_t, kv_t] {
            drop(t.child.stdin.take());
            let _ = t.child.wait().await;
        }
    }
}
