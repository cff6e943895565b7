//! Loopback data plane: kvrecv's TE target against the real Mooncake TE target and a raw floor,
//! each in its own process, written by the real TE (the PyPI wheel) and by kvrecv's Rust
//! initiator, each in its own process. Reports throughput and the **target's** CPU seconds per
//! GiB landed (user+sys from /proc/<pid>/stat over the write): medians over interleaved rounds
//! (one run into each target per round, the order rotating), and each target's ratio to the
//! floor as the median of its per-round ratios (with their range, to show the noise). Not a
//! test; the figures go in docs/PERFORMANCE.md.
//!
//! The floor (`raw`) is the least a receiver can do for the same bytes: it answers the
//! handshake with kvrecv's daemon (off the timed path) so that both writers connect to it
//! unchanged, then, on one thread (a current-thread tokio runtime, a task per connection), reads
//! each 24-byte header, reads the payload straight into one region at the header's offset,
//! waiting as kvrecv's data server does (`SO_RCVLOWAT` set to what the payload still lacks), and
//! answers the v2 status frame: a bounds check, nothing else (no permits, windows, audit or
//! counters). `KVRECV_FLOOR=threads` runs a blocking thread per connection instead (`recv` with
//! `MSG_WAITALL`), which measured more CPU per GiB than kvrecv's target here.
//!
//! `KVRECV_BENCH_BEFORE=<path>`: another build of this example, whose kvrecv target runs as a
//! fourth receiver in the same rounds (an A/B of a change in one invocation). One receiver
//! alone, under `perf`: `scripts/dataplane-profile`.
//!
//! kvrecv's target and the floor land on huge pages (`MADV_HUGEPAGE`, as kvrecv's own landing
//! memory does); the TE target in a ctypes buffer, as its Python users allocate one, or with
//! `KVRECV_BENCH_TE_HUGE=1` in an advised mapping like theirs. `KVRECV_BENCH_DATA_THREADS=N`:
//! this build's kvrecv target serves its connections on N threads (`TargetConfig::data_threads`,
//! default one).
//!
//! ```text
//! cargo run --release --example dataplane_bench -- [MiB per run, default 256] [rounds, default 5]
//! ```
//! Needs the Python venv (`KVRECV_PYTHON`, default `.venv/bin/python`) with
//! `mooncake-transfer-engine-non-cuda`. The example re-runs itself for its own roles:
//! `target <write size>` (kvrecv's target, one open pull over the region), `raw` (the floor)
//! and `write <handshake addr> <base> <write size> <total>` (the Rust writer).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use std::io::{Read, Write};
use std::net::TcpListener;

use kvrecv::layout::KvLayout;
use kvrecv::messages::handshake::{BufferDesc, SegmentDescriptor};
use kvrecv::messages::{PeerId, RequestMeta};
use kvrecv::rdma::handshake_daemon::{self, Daemon};
use kvrecv::rdma::tcp::wire::{Header, ProtoVersion, HEADER_LEN, OP_WRITE, STATUS_OK};
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

/// The receivers compared, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The raw floor (`raw` role).
    Floor,
    /// The real Mooncake TE target (the wheel).
    Te,
    /// kvrecv's TCP target.
    Kvrecv,
    /// Another build's `target` role (`KVRECV_BENCH_BEFORE`): an A/B in the same rounds.
    Before,
}

/// The receivers of this invocation, in table order.
fn kinds() -> Vec<Kind> {
    let mut k = vec![Kind::Floor, Kind::Te, Kind::Kvrecv];
    if before().is_some() {
        k.push(Kind::Before);
    }
    k
}

/// `KVRECV_BENCH_BEFORE`: the path of another build of this example, whose kvrecv target runs
/// as a fourth receiver in the same rounds.
fn before() -> Option<PathBuf> {
    std::env::var_os("KVRECV_BENCH_BEFORE").map(PathBuf::from)
}

async fn start_target(kind: Kind, size: u64) -> Target {
    let mut cmd = match kind {
        Kind::Kvrecv => {
            let mut c = Command::new(std::env::current_exe().expect("own path"));
            c.args(["target", &size.to_string()]);
            c
        }
        Kind::Before => {
            let mut c = Command::new(before().expect("KVRECV_BENCH_BEFORE"));
            c.args(["target", &size.to_string()]);
            c
        }
        Kind::Floor => {
            let mut c = Command::new(std::env::current_exe().expect("own path"));
            c.arg("raw");
            c
        }
        Kind::Te => {
            let mut c = Command::new(python());
            c.arg(script()).args(["target", &REGION.to_string()]);
            c
        }
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
    let mut cfg = TargetConfig::loopback(KvLayout::uniform(1, size, blocks));
    // `KVRECV_BENCH_DATA_THREADS`: the threads serving its connections (default one).
    if let Some(n) = std::env::var("KVRECV_BENCH_DATA_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        cfg.data_threads = n;
    }
    let t = TcpTarget::start(cfg).await.expect("target starts");
    let req = Arc::new(RequestMeta::new(
        "bench",
        "bench",
        "e",
        "b",
        &[(0..blocks).collect::<Vec<u32>>()],
    ));
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

/// Fill `dst` from `s` with `recv(MSG_WAITALL)`: the kernel copies each arrival into `dst`
/// without returning to user space in between (one syscall per payload in the common case;
/// plain `read_exact` measured more floor CPU than kvrecv's target with the TE wheel).
fn recv_all(s: &std::net::TcpStream, dst: &mut [u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0;
    while done < dst.len() {
        // SAFETY: `dst[done..]` is valid writable memory of the length passed.
        let n = unsafe {
            libc::recv(
                s.as_raw_fd(),
                dst[done..].as_mut_ptr().cast(),
                dst.len() - done,
                libc::MSG_WAITALL,
            )
        };
        match n {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => done += n as usize,
        }
    }
    Ok(())
}

/// One raw lane: header, payload straight into the region, v2 status; closes on anything that
/// is not an in-bounds WRITE. Returns on EOF or error.
fn raw_lane(mut s: std::net::TcpStream, base: u64, region_ptr: usize) {
    let _ = s.set_nodelay(true);
    let mut h = [0u8; HEADER_LEN];
    loop {
        if s.read_exact(&mut h).is_err() {
            return;
        }
        let h = Header::decode(&h);
        let Some(off) = h.addr.checked_sub(base) else {
            return;
        };
        if h.op() != OP_WRITE || off.saturating_add(h.size) > REGION {
            return;
        }
        // SAFETY: `region_ptr` points at REGION live bytes that are never freed (leaked below) and
        // [off, off + size) is inside them. Writers never write one slot from two lanes at once
        // (their lanes take distinct slots), so no two `&mut` overlap in practice; the bytes
        // are never read, so even a racing write could not be observed.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                (region_ptr as *mut u8).add(off as usize),
                h.size as usize,
            )
        };
        if recv_all(&s, dst).is_err() {
            return;
        }
        if h.version() == ProtoVersion::V2 && s.write_all(&STATUS_OK.to_le_bytes()).is_err() {
            return;
        }
    }
}

/// [`raw_lane`] on a tokio socket: `read_exact` straight into the region.
async fn raw_lane_async(mut s: tokio::net::TcpStream, base: u64, region_ptr: usize) {
    use tokio::io::AsyncWriteExt;
    let _ = s.set_nodelay(true);
    let mut h = [0u8; HEADER_LEN];
    loop {
        if s.read_exact(&mut h).await.is_err() {
            return;
        }
        let h = Header::decode(&h);
        let Some(off) = h.addr.checked_sub(base) else {
            return;
        };
        if h.op() != OP_WRITE || off.saturating_add(h.size) > REGION {
            return;
        }
        // SAFETY: as in `raw_lane`.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                (region_ptr as *mut u8).add(off as usize),
                h.size as usize,
            )
        };
        if read_payload(&s, dst).await.is_err() {
            return;
        }
        if h.version() == ProtoVersion::V2 && s.write_all(&STATUS_OK.to_le_bytes()).await.is_err() {
            return;
        }
    }
}

/// Fill `dst` from `s` as kvrecv's data server does: read what is queued, and while the rest
/// is not, ask to be woken only once it is (`SO_RCVLOWAT`, put back to one byte after), so a
/// writer's small pieces do not cost a wakeup each.
async fn read_payload(s: &tokio::net::TcpStream, dst: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    let mut lowat = false;
    while got < dst.len() {
        match s.try_read(&mut dst[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        set_lowat(s, (dst.len() - got).min(1 << 20))?;
        lowat = true;
        s.readable().await?;
    }
    if lowat {
        set_lowat(s, 1)?;
    }
    Ok(())
}

fn set_lowat(s: &tokio::net::TcpStream, bytes: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: the fd is the stream's open socket; `v` is a live c_int of the length passed.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Role `raw`: the floor. A REGION of touched memory, kvrecv's handshake daemon serving a
/// descriptor that advertises the region's real address, and a blocking thread per data
/// connection; until stdin closes.
async fn raw_sink() {
    // On huge pages, as kvrecv's own landing memory is (`rdma/host_buffer.rs`); touched
    // (non-zero fill), like the TE target's zeroed ctypes buffer: no page faults timed.
    let layout = std::alloc::Layout::from_size_align(REGION as usize, 2 << 20).expect("layout");
    // SAFETY: a fresh allocation of REGION bytes (non-zero size), advised and then filled
    // before any reference to it exists; leaked, so it lives as long as the process.
    let region: &'static mut [u8] = unsafe {
        let p = std::alloc::alloc(layout);
        assert!(!p.is_null(), "the floor's region");
        libc::madvise(p.cast(), REGION as usize, libc::MADV_HUGEPAGE);
        std::ptr::write_bytes(p, 1, REGION as usize);
        std::slice::from_raw_parts_mut(p, REGION as usize)
    };
    let base = region.as_mut_ptr() as u64;
    let addr = region.as_mut_ptr() as usize;
    let data = TcpListener::bind("127.0.0.1:0").expect("raw data listener");
    let hs = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("raw handshake listener");
    let name = format!("127.0.0.1:{}", hs.local_addr().expect("addr").port());
    let descriptor = SegmentDescriptor {
        buffers: vec![BufferDesc {
            addr: base,
            length: REGION,
            name: name.clone(),
            ..BufferDesc::default()
        }],
        devices: vec![],
        priority_matrix: Default::default(),
        name: name.clone(),
        protocol: "tcp".into(),
        rdma_server_name: String::new(),
        tcp_data_host: Some("127.0.0.1".into()),
        tcp_data_port: data.local_addr().expect("addr").port(),
        tcp_proto_version: 2,
        timestamp: String::new(),
    };
    tokio::spawn(handshake_daemon::serve(
        hs,
        Arc::new(Daemon::new(&descriptor)),
    ));
    if std::env::var("KVRECV_FLOOR").as_deref() == Ok("threads") {
        std::thread::spawn(move || {
            for s in data.incoming().flatten() {
                std::thread::spawn(move || raw_lane(s, base, addr));
            }
        });
    } else {
        // One thread for every lane (a current-thread runtime): with 4 lanes on 2 cores a
        // blocking thread per lane measured more CPU per GiB than kvrecv's target.
        data.set_nonblocking(true).expect("nonblocking listener");
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .expect("raw runtime");
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(data).expect("tokio listener");
                while let Ok((s, _)) = l.accept().await {
                    tokio::spawn(raw_lane_async(s, base, addr));
                }
            });
        });
    }
    println!("{}", serde_json::json!({"segment": name, "addr": base}));
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
        Some("raw") => return raw_sink().await,
        Some("write") => return rust_write(&args[2], num(3), num(4), num(5)).await,
        _ => {}
    }
    let total: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(256) << 20;
    let rounds: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    println!(
        "loopback, {LANES} lanes (Rust writer; the TE wheel: its own), {} MiB per run, {rounds} interleaved rounds (one run per target, order rotating), every party its own process",
        total >> 20
    );
    println!(
        "median per target; ratios: median of per-round target/floor ratios [min-max over rounds]"
    );
    let kinds = kinds();
    let names: Vec<&str> = kinds
        .iter()
        .map(|k| match k {
            Kind::Floor => "floor",
            Kind::Te => "TE",
            Kind::Kvrecv => "kvrecv",
            Kind::Before => "before",
        })
        .collect();
    let at = |k: Kind| kinds.iter().position(|&x| x == k).expect("kind");
    let (floor, te, kv) = (at(Kind::Floor), at(Kind::Te), at(Kind::Kvrecv));
    // Ratios: (numerator, denominator) by position.
    let mut ratios = vec![(te, floor), (kv, floor), (kv, te)];
    if kinds.contains(&Kind::Before) {
        ratios.push((kv, at(Kind::Before)));
    }
    let mut head = String::from("| write size | writer |");
    for n in &names {
        head += &format!(" {n} GB/s |");
    }
    head += &format!(" {}/floor GB/s |", names[kv]);
    for n in &names {
        head += &format!(" {n} CPU s/GiB |");
    }
    for &(a, b) in &ratios {
        head += &format!(" {}/{} CPU |", names[a], names[b]);
    }
    println!("{head}");
    println!("|{}", "---|".repeat(3 + 2 * names.len() + ratios.len()));
    for size in [256u64 << 10, 1 << 20] {
        let mut targets = Vec::new();
        for &kind in &kinds {
            targets.push(start_target(kind, size).await);
        }
        let n = kinds.len();
        for (te_writer, name) in [(true, "TE wheel"), (false, "Rust")] {
            // bw[k][round], cpu[k][round], k in `kinds` order.
            let mut bw = vec![vec![0f64; rounds]; n];
            let mut cpu = vec![vec![0f64; rounds]; n];
            for r in 0..rounds {
                for j in 0..n {
                    let k = (r + j) % n;
                    let (b, c) = write_run(te_writer, &targets[k], size, total).await;
                    bw[k][r] = b;
                    cpu[k][r] = c;
                }
            }
            let ratio = |v: &[Vec<f64>], k: usize, d: usize| -> String {
                let mut r: Vec<f64> = (0..rounds).map(|i| v[k][i] / v[d][i]).collect();
                let m = median(&mut r);
                format!("{m:.2}x [{:.2}-{:.2}]", r[0], r[rounds - 1])
            };
            let med = |v: &[Vec<f64>], k: usize| median(&mut v[k].clone());
            let mut row = format!("| {} KiB | {name} |", size >> 10);
            for k in 0..n {
                row += &format!(" {:.2} |", med(&bw, k) / 1e9);
            }
            row += &format!(" {} |", ratio(&bw, kv, floor));
            for k in 0..n {
                row += &format!(" {:.3} |", med(&cpu, k));
            }
            for &(a, b) in &ratios {
                row += &format!(" {} |", ratio(&cpu, a, b));
            }
            println!("{row}");
        }
        for mut t in targets {
            drop(t.child.stdin.take());
            let _ = t.child.wait().await;
        }
    }
}
