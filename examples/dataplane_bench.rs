//! Loopback write throughput of kvrecv's TE target vs the real Mooncake TE target, with raw
//! loopback TCP as the ceiling. Not a test; results go in docs/DECISIONS.md.
//!
//! ```text
//! cargo run --release --example dataplane_bench -- [total MiB per run, default 256] [reps, default 3]
//! ```
//! Needs the Python venv (`KVRECV_PYTHON`, default `.venv/bin/python`) with
//! `mooncake-transfer-engine-non-cuda`. The same writer (the real TE, 4 lanes, batches of 16)
//! writes into both targets; the best of `reps` runs is reported.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use kvrecv::layout::KvLayout;
use kvrecv::messages::{PeerId, RequestMeta};
use kvrecv::rdma::{Landing, PullWindow, TargetConfig, TcpTarget};
use kvrecv::sim::initiator::{InitiatorConfig, TeInitiator};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

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

/// Run the real TE writer; returns bytes/s.
async fn te_write(segment: &str, base: u64, size: u64, total: u64) -> f64 {
    let out = tokio::process::Command::new(python())
        .arg(script())
        .args([
            "write",
            segment,
            &base.to_string(),
            &REGION.to_string(),
            &size.to_string(),
            &total.to_string(),
        ])
        .env("MC_LOG_LEVEL", "WARNING")
        .stderr(Stdio::null())
        .output()
        .await
        .expect("python runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(text.lines().last().unwrap_or("{}")).expect("writer JSON");
    v["bytes"].as_f64().expect("bytes") / v["seconds"].as_f64().expect("seconds")
}

async fn kvrecv_target(size: u64) -> (TcpTarget, u64) {
    let blocks = (REGION / size) as u32;
    let t = TcpTarget::start(TargetConfig::loopback(KvLayout::uniform(1, size, blocks)))
        .await
        .unwrap();
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
    (t, bases[0])
}

/// Rust initiator into the target whose handshake daemon is at `hs`: bytes/s.
async fn rust_write(hs: std::net::SocketAddr, base: u64, size: u64, total: u64) -> f64 {
    let ini = Arc::new(
        TeInitiator::connect(
            hs,
            InitiatorConfig {
                lanes: LANES,
                ..Default::default()
            },
        )
        .await
        .unwrap(),
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
                    .unwrap();
                i += LANES as u64;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (n * size) as f64 / t0.elapsed().as_secs_f64()
}

/// Raw loopback TCP, `LANES` streams, no protocol: the ceiling. bytes/s.
async fn raw_tcp(size: u64, total: u64) -> f64 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let per_lane = total / LANES as u64;
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..LANES {
            let (mut s, _) = l.accept().await.unwrap();
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; size as usize];
                let mut got = 0u64;
                while got < per_lane {
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0);
                    got += n as u64;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..LANES {
        clients.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            let buf = vec![0x5Au8; size as usize];
            for _ in 0..per_lane / size {
                s.write_all(&buf).await.unwrap();
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    server.await.unwrap();
    (per_lane / size * size * LANES as u64) as f64 / t0.elapsed().as_secs_f64()
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let total: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(256) << 20;
    let reps: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    // The real TE as target, in its own process.
    let mut te_target = tokio::process::Command::new(python())
        .arg(script())
        .args(["target", &REGION.to_string()])
        .env("MC_LOG_LEVEL", "WARNING")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("python runs");
    let mut line = String::new();
    BufReader::new(te_target.stdout.take().unwrap())
        .read_line(&mut line)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).expect("target JSON");
    let (te_seg, te_base) = (
        v["segment"].as_str().unwrap().to_owned(),
        v["addr"].as_u64().unwrap(),
    );

    println!(
        "loopback, {LANES} lanes, {} MiB per run, best of {reps}",
        total >> 20
    );
    let te_hs: std::net::SocketAddr = te_seg.parse().expect("TE segment name is ip:port");
    println!("| write size | raw TCP | writer: TE wheel -> TE target | TE wheel -> kvrecv | Rust -> TE target | Rust -> kvrecv | kvrecv/TE (TE writer) | kvrecv/TE (Rust writer) | kvrecv/raw (Rust writer) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for size in [256u64 << 10, 1 << 20] {
        let (t, base) = kvrecv_target(size).await;
        let (mut raw, mut te, mut kv, mut rte, mut rkv) = (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..reps {
            raw.push(raw_tcp(size, total).await);
            te.push(te_write(&te_seg, te_base, size, total).await);
            kv.push(te_write(t.segment_name(), base, size, total).await);
            rte.push(rust_write(te_hs, te_base, size, total).await);
            rkv.push(rust_write(t.handshake_addr(), base, size, total).await);
        }
        let g = |v: &[f64]| best(v) / 1e9;
        println!(
            "| {} KiB | {:.2} GB/s | {:.2} GB/s | {:.2} GB/s | {:.2} GB/s | {:.2} GB/s | {:.2}x | {:.2}x | {:.0}% |",
            size >> 10,
            g(&raw),
            g(&te),
            g(&kv),
            g(&rte),
            g(&rkv),
            best(&kv) / best(&te),
            best(&rkv) / best(&rte),
            100.0 * best(&rkv) / best(&raw)
        );
    }
    drop(te_target.stdin.take());
    let _ = te_target.wait().await;
}
