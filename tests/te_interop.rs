//! Interop with the real Mooncake Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`):
//! its Python `TransferEngine`, as P, writes into kvrecv's target running in this process.
//! The venv is found through `KVRECV_PYTHON` (default `.venv/bin/python` in the crate root);
//! without it these tests are skipped loudly.

#[path = "common/data_plane.rs"]
mod common;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{mem_off, open, pattern, req, target, target_reading, BLOCK};
use kvrecv::rdma::TcpTarget;
use serde_json::{json, Value};

#[path = "common/python.rs"]
mod python;
use python::python;

/// Run `te_writer.py` against `t`; returns its JSON answer.
async fn te(py: &PathBuf, t: &TcpTarget, cmd: Value, v1: bool) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/te_writer.py");
    let mut c = tokio::process::Command::new(py);
    c.arg(script)
        .arg(t.segment_name())
        .arg(cmd.to_string())
        .kill_on_drop(true);
    // Keep the TE on loopback and quiet; a short transfer timeout keeps failure cases quick.
    c.env("MC_LOG_LEVEL", "WARNING")
        .env("MC_TRANSFER_TIMEOUT", "20");
    if v1 {
        c.env("MC_TCP_PROTO", "1");
    }
    let out = tokio::time::timeout(Duration::from_secs(120), c.output())
        .await
        .expect("te_writer.py finished before the safety timeout")
        .expect("te_writer.py runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| {
            panic!(
                "no JSON from te_writer.py; status {:?}\nstdout: {stdout}\nstderr: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let v: Value = serde_json::from_str(line).unwrap();
    assert!(
        v.get("error").is_none(),
        "te_writer.py: {v}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    v
}

fn all_zero(t: &TcpTarget) -> bool {
    let m = t.plane().memory();
    m.snapshot(0, m.len()).unwrap().iter().all(|&b| b == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_te_batch_write_lands_every_byte_and_reads_back() {
    let Some(py) = python() else { return };
    let t = target_reading(true).await;
    let bases = open(&t, 1, &[req("a", &[1, 2, 3, 5])]);
    // Whole blocks, a coalesced two-block write, and head slices (P TP2 -> D TP1).
    let writes = [
        (bases[0] + BLOCK, BLOCK, 1u8),
        (bases[1] + 2 * BLOCK, 2 * BLOCK, 2),
        (bases[0] + 5 * BLOCK, BLOCK / 2, 3),
        (bases[0] + 5 * BLOCK + BLOCK / 2, BLOCK / 2, 4),
    ];
    let cmd = json!({
        "writes": writes.iter().map(|&(a, l, s)| json!({"addr": a, "len": l, "seed": s})).collect::<Vec<_>>(),
        "batch": true,
        "read_back": true,
    });
    let v = te(&py, &t, cmd, false).await;
    assert_eq!(v["results"], json!([0]), "{v}");
    assert_eq!(v["read_back_ok"], json!(true), "{v}");
    let m = t.plane().memory();
    assert_eq!(
        m.snapshot(mem_off(0, 1), BLOCK).unwrap(),
        pattern(1, BLOCK as usize)
    );
    assert_eq!(
        m.snapshot(mem_off(1, 2), 2 * BLOCK).unwrap(),
        pattern(2, 2 * BLOCK as usize)
    );
    assert_eq!(
        m.snapshot(mem_off(0, 5), BLOCK / 2).unwrap(),
        pattern(3, BLOCK as usize / 2)
    );
    assert_eq!(
        m.snapshot(mem_off(0, 5) + BLOCK / 2, BLOCK / 2).unwrap(),
        pattern(4, BLOCK as usize / 2)
    );
    let st = t.stats();
    assert_eq!(st.writes_landed.load(Ordering::Relaxed), 4);
    assert_eq!(st.bytes_landed.load(Ordering::Relaxed), 4 * BLOCK);
    assert_eq!(st.v1_requests.load(Ordering::Relaxed), 0);
    assert_eq!(st.rejected_total(), 0);
    assert_eq!(
        t.handshake_stats().metadata.load(Ordering::Relaxed),
        1,
        "P fetched the descriptor once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_te_out_of_range_write_fails_at_p_and_lands_nothing() {
    let Some(py) = python() else { return };
    let t = target(true).await;
    let bases = open(&t, 1, &[req("a", &[0])]);
    let past = bases[1] + u64::from(common::BLOCKS) * BLOCK - 8; // runs off the last region
    let cmd = json!({"writes": [{"addr": past, "len": 64, "seed": 1}], "batch": true});
    let v = te(&py, &t, cmd, false).await;
    assert_ne!(
        v["results"][0],
        json!(0),
        "an out-of-range write must fail at P: {v}"
    );
    assert!(all_zero(&t), "bytes landed");
    assert!(t.stats().rejected_out_of_range.load(Ordering::Relaxed) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_te_write_into_a_revoked_window_is_rejected_and_lands_nothing() {
    let Some(py) = python() else { return };
    let t = target(true).await;
    let a = req("a", &[4]);
    let bases = open(&t, 1, std::slice::from_ref(&a));
    common::revoke(&t, &a).await;
    let cmd =
        json!({"writes": [{"addr": bases[0] + 4 * BLOCK, "len": BLOCK, "seed": 1}], "batch": true});
    let v = te(&py, &t, cmd, false).await;
    assert_ne!(
        v["results"][0],
        json!(0),
        "a late write must fail at P: {v}"
    );
    assert!(all_zero(&t), "a late write landed");
    assert!(t.stats().rejected_revoked.load(Ordering::Relaxed) >= 1);
    assert_eq!(t.stats().writes_landed.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_te_v1_mode_lands_correctly() {
    let Some(py) = python() else { return };
    let t = target(true).await;
    let bases = open(&t, 1, &[req("a", &[0, 7])]);
    let cmd = json!({
        "writes": [
            {"addr": bases[0], "len": BLOCK, "seed": 5},
            {"addr": bases[1] + 7 * BLOCK, "len": BLOCK, "seed": 6},
        ],
        "batch": false,
    });
    let v = te(&py, &t, cmd, true).await;
    assert_eq!(v["results"], json!([0, 0]), "{v}");
    // v1 has no acks: P may exit before the last bytes are copied. Wait (bounded) for them.
    let st = t.stats().clone();
    tokio::time::timeout(Duration::from_secs(10), async {
        while st.writes_landed.load(Ordering::Relaxed) < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("both v1 writes land");
    assert!(
        st.v1_requests.load(Ordering::Relaxed) >= 2,
        "P did not use v1 framing"
    );
    let m = t.plane().memory();
    assert_eq!(
        m.snapshot(mem_off(0, 0), BLOCK).unwrap(),
        pattern(5, BLOCK as usize)
    );
    assert_eq!(
        m.snapshot(mem_off(1, 7), BLOCK).unwrap(),
        pattern(6, BLOCK as usize)
    );
}

/// The descriptor advertises one buffer spanning every epoch (thousands of windows, far beyond
/// the registered bytes); the real TE accepts it and writes into the last window exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_te_accepts_one_span_of_thousands_of_epochs() {
    let Some(py) = python() else { return };
    let mut cfg = kvrecv::rdma::TargetConfig::loopback(common::layout());
    cfg.windows = None; // the default: 16384 epochs
    let t = TcpTarget::start(cfg).await.unwrap();
    let windows = t.landing().permits().map().windows();
    assert!(windows >= 4096, "{windows}");
    assert_eq!(t.descriptor().buffers.len(), 1);
    let span = t.descriptor().buffers[0].length;
    assert!(span >= u64::from(windows) * t.plane().map.span());
    // Walk the round-robin cursor to the last usable window: a peer per pull (a peer's own
    // pulls reuse the windows it used last, which keeps P's layout cache warm).
    for i in 0..u64::from(windows) - 2 {
        let r = req(&format!("w{i}"), &[0]);
        let p = kvrecv::messages::PeerId::new(format!(
            "tcp://127.0.0.{}:{}",
            1 + i / 60000,
            1024 + i % 60000
        ));
        common::open_as(&t, &p, i, std::slice::from_ref(&r));
        common::revoke(&t, &r).await;
    }
    let a = req("a", &[3]);
    let bases = open(&t, 1 << 40, std::slice::from_ref(&a));
    let (first, _) = t.plane().map.advertised_span();
    assert_eq!(
        t.plane().map.resolve(bases[0], 1).unwrap().window,
        windows - 2
    );
    assert!(bases[1] - first > span / 2, "far into the span");
    let cmd =
        json!({"writes": [{"addr": bases[1] + 3 * BLOCK, "len": BLOCK, "seed": 7}], "batch": true});
    let v = te(&py, &t, cmd, false).await;
    assert_eq!(v["results"], json!([0]), "{v}");
    assert_eq!(
        t.plane().memory().snapshot(mem_off(1, 3), BLOCK).unwrap(),
        pattern(7, BLOCK as usize)
    );
}

/// PROTOCOL.md §5.3: a v1 (unacknowledged) writer's rejected write looks successful at P, so an
/// ok is checked against the bytes that landed in the request's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_te_v1_ok_is_checked_against_landed_bytes() {
    let Some(py) = python() else { return };
    let t = target(true).await;
    let permits = t.landing().permits().clone();
    // `a`: every byte of its two blocks (both regions) lands.
    let a = req("a", &[1, 2]);
    let bases = open(&t, 1, std::slice::from_ref(&a));
    let whole: Vec<Value> = (0..2)
        .flat_map(|r| (1..3).map(move |b| (r, b)))
        .map(|(r, b)| json!({"addr": bases[r] + b * BLOCK, "len": BLOCK, "seed": 1}))
        .collect();
    let v = te(&py, &t, json!({"writes": whole, "batch": true}), true).await;
    assert_eq!(v["results"], json!([0]), "{v}");
    // v1 has no acks: until the last byte is in, the ok is not backed.
    settle_on(&t, |s| s.writes_landed.load(Ordering::Relaxed) >= 4).await;
    assert!(t.stats().v1_requests.load(Ordering::Relaxed) >= 4);
    assert_eq!(permits.verify_ok(&a), Ok(()));
    // `b`: region 1's write goes to a block that is not b's; v1 P still sees success.
    let b = req("b", &[3]);
    let bases = open(&t, 2, std::slice::from_ref(&b));
    let cmd = json!({"writes": [
        {"addr": bases[0] + 3 * BLOCK, "len": BLOCK, "seed": 2},
        {"addr": bases[1] + 4 * BLOCK, "len": BLOCK, "seed": 2},
    ], "batch": true});
    let v = te(&py, &t, cmd, true).await;
    assert_eq!(v["results"], json!([0]), "v1 cannot see the refusal: {v}");
    settle_on(&t, |s| {
        s.writes_landed.load(Ordering::Relaxed) >= 5
            && s.rejected_no_permit.load(Ordering::Relaxed) >= 1
    })
    .await;
    let err = permits.verify_ok(&b).unwrap_err();
    assert!(err.contains("4096 of 8192"), "{err}");
}

/// Wait (bounded) until the data server's counters satisfy `cond`: v1 bytes can still be on
/// their way when P's call returns.
async fn settle_on(t: &TcpTarget, cond: impl Fn(&kvrecv::rdma::tcp::server::DataStats) -> bool) {
    let st = t.stats().clone();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !cond(&st) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the data server caught up");
}
