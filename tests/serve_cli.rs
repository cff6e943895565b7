//! `kvrecv serve` driven through its pipes, against the in-process simulator: the ready line,
//! a batch with one failing peer, the drain, bad input lines, shutdown; and serve's TE target
//! written by the simulator's workers with the Rust initiator (real bytes, permits on and off).

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{Faults, KvWriter, PrefillSim, SimConfig, WriteJob};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const SAFETY: Duration = Duration::from_secs(30);

/// A two-layer layout of 64 blocks of 4 KiB, warnings only.
const BASIC: &[&str] = &[
    "--layers",
    "2",
    "--block-len",
    "4096",
    "--num-blocks",
    "64",
    "--log-level",
    "warn",
];

struct Serve {
    child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    seen: Vec<Value>,
}

impl Serve {
    /// `serve` on a small one-layer layout (1 layer, 4 KiB blocks, 16 of them) plus `extra`.
    fn one_layer(extra: &[&str]) -> Serve {
        let layout = ["--layers", "1", "--block-len", "4096", "--num-blocks", "16"];
        Serve::start(&[&layout[..], extra].concat())
    }

    fn start(args: &[&str]) -> Serve {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
            .arg("serve")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("kvrecv binary");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        Serve {
            child,
            stdin,
            out,
            seen: vec![],
        }
    }

    async fn send(&mut self, v: &str) {
        self.send_bytes(format!("{v}\n").as_bytes()).await;
    }

    async fn send_bytes(&mut self, b: &[u8]) {
        self.stdin.write_all(b).await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// The next line matching `pred` (every line is checked to be one JSON object).
    async fn wait(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let fut = async {
            loop {
                let line = self
                    .out
                    .next_line()
                    .await
                    .unwrap()
                    .unwrap_or_else(|| panic!("stdout closed before {what}"));
                let v: Value =
                    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON: {line}: {e}"));
                assert!(
                    v["event"].is_string(),
                    "every line has an event tag: {line}"
                );
                self.seen.push(v.clone());
                if pred(&v) {
                    return v;
                }
            }
        };
        tokio::time::timeout(SAFETY, fut)
            .await
            .unwrap_or_else(|_| panic!("no {what}; seen {:#?}", self.seen))
    }
}

fn ev(v: &Value, name: &str) -> bool {
    v["event"] == name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_session_over_the_pipe() {
    let sim = PrefillSim::start(SimConfig {
        tp_size: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    sim.set_faults(
        1,
        0,
        Faults {
            failure_rate: 1.0,
            ..Faults::default()
        },
    );
    let mut s = Serve::start(BASIC);
    let ready = s.wait("ready", |v| ev(v, "ready")).await;
    assert_eq!(ready["regions"].as_array().unwrap().len(), 2);
    assert_eq!(ready["memory"], "host");
    assert_eq!(ready["regions"][0]["base_addr"], 0x7e00_0000_0000u64);
    assert_eq!(
        ready["regions"][1]["layer_name"],
        "model.layers.1.self_attn.attn"
    );

    // Bad lines: each gets an error line, the process keeps going.
    s.send("this is not json").await;
    assert_eq!(s.wait("error", |v| ev(v, "error")).await["line"], 1);
    s.send(r#"{"op":"fly"}"#).await;
    assert_eq!(s.wait("error", |v| ev(v, "error")).await["line"], 2);

    let req = |id: &str, blocks: Value| {
        json!({"req_id": id, "transfer_id": format!("t-{id}"), "remote_engine_id": sim.engine_id(),
               "remote_bootstrap_addr": sim.bootstrap_url(), "block_ids": blocks})
    };
    let batch = json!({"op": "load_kv", "requests": [req("d-1", json!([[1, 2]])), {"req_id": "d-bad", "block_ids": [[3]]}]});
    s.send(&batch.to_string()).await;
    let reply = s.wait("load_kv", |v| ev(v, "load_kv")).await;
    assert_eq!(reply["accepted"], 1);
    assert!(reply["rejected"][0]
        .as_str()
        .unwrap()
        .contains("transfer_id"));

    let ff = s.wait("first failure", |v| ev(v, "first_failure")).await;
    assert_eq!(ff["req_id"], "d-1");
    let c = s.wait("completion", |v| ev(v, "completion")).await;
    assert_eq!(
        (c["req_id"].as_str(), c["outcome"].as_str()),
        (Some("d-1"), Some("failed"))
    );
    s.wait("release", |v| ev(v, "released") || ev(v, "quarantined"))
        .await;
    s.send(r#"{"op":"drain"}"#).await;
    let d = s.wait("drain", |v| ev(v, "drain")).await;
    assert_eq!(d["finished_recving"], json!(["d-1"]));
    assert_eq!(d["invalid_block_ids"], json!([1, 2]));

    s.send(r#"{"op":"shutdown"}"#).await;
    s.wait("shutdown", |v| ev(v, "shutdown")).await;
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
}

/// stdin: a line that is not UTF-8 and a line over `--max-line-bytes` each get an `error` line
/// and serve keeps running (it used to end at the first invalid byte, abandoning every awaited
/// request). A request id loaded again while it is awaited is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bytes_and_overlong_lines_are_answered_and_awaited_requests_survive() {
    let sim = PrefillSim::start(SimConfig {
        tp_size: 1,
        ready_immediately: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut s = Serve::one_layer(&["--max-line-bytes", "4096", "--log-level", "warn"]);
    s.wait("ready", |v| ev(v, "ready")).await;
    let load = json!({"op": "load_kv", "requests": [{"req_id": "d-1", "transfer_id": "t-1",
        "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
        "block_ids": [[1, 2]]}]});
    s.send(&load.to_string()).await;
    let first = s.wait("load_kv", |v| ev(v, "load_kv")).await;
    assert_eq!(
        (first["line"].as_u64(), first["awaiting"].as_u64()),
        (Some(1), Some(1))
    );
    s.send(&load.to_string()).await;
    let again = s.wait("second load_kv", |v| ev(v, "load_kv")).await;
    assert_eq!(again["accepted"], 0);
    assert!(
        again["rejected"][0]
            .as_str()
            .unwrap()
            .contains("still in flight"),
        "{again}"
    );

    s.send_bytes(b"\xff\xfe{\"op\":\"drain\"}\n").await;
    let e = s.wait("error", |v| ev(v, "error")).await;
    assert_eq!(e["line"], 3, "{e}");
    assert!(e["error"].as_str().unwrap().contains("UTF-8"), "{e}");
    let mut long = vec![b' '; 100_000];
    long.push(b'\n');
    s.send_bytes(&long).await;
    let e = s.wait("error", |v| ev(v, "error")).await;
    assert_eq!(e["line"], 4, "{e}");
    assert!(e["error"].as_str().unwrap().contains("100000 bytes"), "{e}");
    // A misspelt key is refused, not taken for "no blocks to receive".
    let typo = json!({"op": "load_kv", "requests": [{"req_id": "d-9", "transfer_id": "t-9",
        "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
        "block_id": [[3]]}]});
    s.send(&typo.to_string()).await;
    let e = s.wait("error", |v| ev(v, "error")).await;
    assert_eq!(e["line"], 5, "{e}");
    assert!(e["error"].as_str().unwrap().contains("`block_ids`"), "{e}");
    s.send(r#"{"op":5}"#).await;
    let e = s.wait("error", |v| ev(v, "error")).await;
    assert!(
        e["error"].as_str().unwrap().contains("expected a string"),
        "{e}"
    );

    sim.mark_ready("t-1");
    let c = s.wait("completion", |v| ev(v, "completion")).await;
    assert_eq!(c["outcome"], "ok", "{c}");
    s.wait("release", |v| ev(v, "released")).await;
    s.send(r#"{"op":"drain"}"#).await;
    let d = s.wait("drain", |v| ev(v, "drain")).await;
    assert_eq!(
        (d["line"].as_u64(), &d["finished_recving"]),
        (Some(7), &json!(["d-1"]))
    );
    s.send(r#"{"op":"shutdown"}"#).await;
    s.wait("shutdown", |v| ev(v, "shutdown")).await;
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn bad_configuration_is_reported_as_an_error_line() {
    let mut s = Serve::start(&["--kv-transfer-config", r#"{"kv_role":"kv_producer"}"#]);
    let e = s.wait("error", |v| ev(v, "error")).await;
    assert!(e["error"].as_str().unwrap().contains("kv_consumer"));
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success());
}

/// A P whose transfers never finish; each job is reported to the test (P has the pull).
struct Stuck(tokio::sync::mpsc::UnboundedSender<WriteJob>);

impl KvWriter for Stuck {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        let _ = self.0.send(job);
        Box::pin(std::future::pending())
    }
}

/// serve with one request, `d-1` (block 5), that P has and never finishes writing.
async fn serve_with_one_request_p_holds() -> (Serve, PrefillSim) {
    let (tx, mut jobs) = tokio::sync::mpsc::unbounded_channel();
    let sim = PrefillSim::start_with_writer(SimConfig::default(), Arc::new(Stuck(tx)))
        .await
        .unwrap();
    // P never answers the held request: an abort settles it once its grace passed.
    let mut args = BASIC.to_vec();
    args.extend(["--abort-grace-ms", "200"]);
    let mut s = Serve::start(&args);
    s.wait("ready", |v| ev(v, "ready")).await;
    let load = json!({"op": "load_kv", "requests": [{"req_id": "d-1", "transfer_id": "t-1",
        "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
        "block_ids": [[5]]}]});
    s.send(&load.to_string()).await;
    assert_eq!(s.wait("load_kv", |v| ev(v, "load_kv")).await["awaiting"], 1);
    tokio::time::timeout(SAFETY, jobs.recv())
        .await
        .unwrap()
        .unwrap();
    (s, sim)
}

/// `{"op":"abort","req_id":..}`: the host's client went away while P is writing. The answer
/// says one peer owed it; P never answers, so once `--abort-grace-ms` passed it fails
/// ("aborted"), completes, its blocks come back through drain (fenced: the permit is closed). An unknown id settles nothing; a line without `req_id`, or
/// an op given a `req_id` it does not take, gets an error line and serve keeps going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_over_the_pipe_fails_the_request_and_hands_its_blocks_back() {
    let (mut s, _sim) = serve_with_one_request_p_holds().await;

    let too_long =
        json!({"op": "abort", "req_id": "x".repeat(kvrecv::messages::batch::MAX_ID_BYTES + 1)})
            .to_string();
    for bad in [r#"{"op":"abort"}"#, too_long.as_str()] {
        s.send(bad).await;
        let e = s.wait("error", |v| ev(v, "error")).await;
        assert!(e["error"].as_str().unwrap().contains("req_id"), "{e}");
    }
    for wrong in [
        r#"{"op":"drain","req_id":"d-1"}"#,
        r#"{"op":"load_kv","requests":[],"req_id":"d-1"}"#,
    ] {
        s.send(wrong).await;
        let e = s.wait("error", |v| ev(v, "error")).await;
        assert!(
            e["error"].as_str().unwrap().contains("only abort takes"),
            "{e}"
        );
    }
    s.send(r#"{"op":"abort","req_id":"nobody"}"#).await;
    let a = s.wait("abort", |v| ev(v, "abort")).await;
    assert_eq!(
        (a["req_id"].as_str(), a["peers_settled"].as_u64()),
        (Some("nobody"), Some(0))
    );

    s.send(r#"{"op":"abort","req_id":"d-1"}"#).await;
    let a = s.wait("abort", |v| ev(v, "abort")).await;
    assert_eq!(a["peers_settled"], 1, "{a}");
    assert_eq!(a["before_dispatch"], false, "{a}");
    let c = s.wait("completion", |v| ev(v, "completion")).await;
    assert_eq!(c["outcome"], "failed", "{c}");
    assert!(c["reason"].as_str().unwrap().contains("aborted"), "{c}");
    let r = s.wait("release", |v| ev(v, "released")).await;
    assert_eq!(r["fenced"], true, "{r}");
    s.send(r#"{"op":"drain"}"#).await;
    let d = s.wait("drain", |v| ev(v, "drain")).await;
    assert_eq!(d["finished_recving"], json!(["d-1"]));
    assert_eq!(d["invalid_block_ids"], json!([5]));
    s.send(r#"{"op":"shutdown"}"#).await;
    assert_eq!(
        s.wait("shutdown", |v| ev(v, "shutdown")).await["unreleased"],
        0
    );
}

/// SIGTERM (an operator's stop, a container runtime's): serve stops as at the end of its input,
/// so the host still reads the `shutdown` line with the requests abandoned in flight (here the
/// one P never finishes), and the exit status is success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_serve_as_the_end_of_input_does() {
    let (mut s, _sim) = serve_with_one_request_p_holds().await;
    let pid = s.child.id().expect("running") as libc::pid_t;
    // SAFETY: signals our own child, which is still running (not yet waited for).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let last = s.wait("shutdown", |v| ev(v, "shutdown")).await;
    assert_eq!(last["unreleased"], 1, "{last}");
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// The simulator's TE writer, remembering every job so the test can replay one late.
struct Recording {
    inner: TeWriter,
    jobs: Arc<Mutex<Vec<WriteJob>>>,
}

impl KvWriter for Recording {
    fn write(&self, job: WriteJob) -> BoxFuture<'static, Result<(), String>> {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(job.clone());
        self.inner.write(job)
    }
}

/// `{"op":"stats"}` and its answer's `data` object.
async fn data_stats(s: &mut Serve) -> Value {
    s.send(r#"{"op":"stats"}"#).await;
    s.wait("stats", |v| ev(v, "stats")).await["data"].clone()
}

/// A TP2 P writes two blocks of a request into serve's target (two regions, 4 KiB blocks:
/// each P rank writes its 2 KiB head slice of every block); then P rank 0's write is replayed
/// after the completion. Returns (replay result, data stats before it, after it).
async fn write_into_serve(extra: &[&str]) -> (Result<(), String>, Value, Value) {
    let te = TeWriter::new(InitiatorConfig::default());
    let written = te.stats();
    let jobs = Arc::new(Mutex::new(vec![]));
    let sim = PrefillSim::start_with_writer(
        SimConfig {
            tp_size: 2,
            ..SimConfig::default()
        },
        Arc::new(Recording {
            inner: te,
            jobs: jobs.clone(),
        }),
    )
    .await
    .unwrap();
    let mut args = BASIC.to_vec();
    args.extend_from_slice(extra);
    let mut s = Serve::start(&args);
    let ready = s.wait("ready", |v| ev(v, "ready")).await;
    // What P needs: remote_hostname:remote_port is the handshake daemon, which serves a
    // descriptor naming the data server.
    let port = ready["endpoint"]["port"].as_u64().unwrap();
    assert_eq!(ready["endpoint"]["host"], "127.0.0.1");
    assert_eq!(
        ready["handshake"]["listen"],
        format!("127.0.0.1:{port}").as_str()
    );
    assert_eq!(
        ready["handshake"]["segment_name"],
        format!("127.0.0.1:{port}").as_str()
    );
    assert_eq!(ready["data"]["host"], "127.0.0.1");
    assert!(ready["data"]["port"].as_u64().unwrap() > 0);
    assert_eq!(ready["data"]["proto_version"], 2);
    assert_eq!(ready["regions"].as_array().unwrap().len(), 2);

    let load = json!({"op": "load_kv", "requests": [{"req_id": "d-1", "transfer_id": "t-1",
        "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
        "block_ids": [[1, 2]]}]});
    s.send(&load.to_string()).await;
    let c = s.wait("completion", |v| ev(v, "completion")).await;
    assert_eq!(c["outcome"], "ok", "{c}");
    s.wait("release", |v| ev(v, "released")).await;

    // 2 P ranks x 2 blocks x 2 regions, 2 KiB each, every one acknowledged by serve.
    assert_eq!(written.writes.load(Ordering::Relaxed), 8);
    assert_eq!(written.bytes.load(Ordering::Relaxed), 8 * 2048);
    assert_eq!(written.requests.load(Ordering::Relaxed), 2);
    assert_eq!(written.failed_writes.load(Ordering::Relaxed), 0);
    let before = data_stats(&mut s).await;
    assert_eq!(before["bytes_landed"], 8 * 2048);
    assert_eq!(before["writes_landed"], 8);

    // A late writer: P rank 0's write again, after the request completed.
    let job = jobs.lock().unwrap()[0].clone();
    let late = TeWriter::new(InitiatorConfig::default()).write(job).await;
    let after = data_stats(&mut s).await;
    s.send(r#"{"op":"shutdown"}"#).await;
    s.wait("shutdown", |v| ev(v, "shutdown")).await;
    (late, before, after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_writes_land_in_serve_and_a_late_write_is_rejected() {
    let (late, before, after) = write_into_serve(&[]).await;
    assert!(late.is_err(), "the completion revoked the pull's permit");
    assert_eq!(after["bytes_landed"], before["bytes_landed"]);
    let rejected =
        after["rejected_revoked"].as_u64().unwrap() + after["rejected_no_permit"].as_u64().unwrap();
    assert_eq!(rejected, 4, "each of rank 0's 4 copies is refused: {after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_permits_a_late_write_lands() {
    let (late, before, after) = write_into_serve(&["--no-permits"]).await;
    assert_eq!(late, Ok(()));
    assert_eq!(
        after["bytes_landed"].as_u64().unwrap(),
        before["bytes_landed"].as_u64().unwrap() + 4 * 2048
    );
}

#[tokio::test]
async fn a_wildcard_bind_needs_an_advertised_host() {
    let mut s = Serve::start(&["--bind", "0.0.0.0"]);
    let e = s.wait("error", |v| ev(v, "error")).await;
    assert!(
        e["error"].as_str().unwrap().contains("--advertise-host"),
        "{e}"
    );
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success());
}

/// `mooncake_protocol = "rdma"` (or `--protocol rdma`) never silently serves TCP: on a host with
/// no RDMA device (this one, or a build without the `rdma` feature) serve says why and exits.
#[tokio::test]
async fn rdma_protocol_is_honoured_or_refused_never_served_over_tcp() {
    let cfg =
        r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"mooncake_protocol":"rdma"}}"#;
    for args in [
        &[
            "--protocol",
            "rdma",
            "--layers",
            "1",
            "--block-len",
            "64",
            "--num-blocks",
            "4",
        ][..],
        &[
            "--kv-transfer-config",
            cfg,
            "--layers",
            "1",
            "--block-len",
            "64",
            "--num-blocks",
            "4",
        ],
        // The device and QP options are accepted (and reach the device opening).
        &[
            "--protocol",
            "rdma",
            "--rdma-devices",
            "mlx5_0,mlx5_1",
            "--rdma-port",
            "1",
            "--rdma-gid-index",
            "3",
            "--rdma-traffic-class",
            "106",
            "--rdma-service-level",
            "3",
            "--layers",
            "1",
            "--block-len",
            "64",
            "--num-blocks",
            "4",
        ],
    ] {
        let mut s = Serve::start(args);
        let e = s.wait("error", |v| ev(v, "error") || ev(v, "ready")).await;
        assert!(ev(&e, "error"), "no RDMA device here, yet: {e}");
        assert!(
            e["error"].as_str().unwrap().to_lowercase().contains("rdma"),
            "{e}"
        );
        let status = tokio::time::timeout(SAFETY, s.child.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.code(), Some(2));
    }
}

/// `--events completions` prints only `completion` lines of the coordinator's events, `--events
/// none` none at all; answers to input lines are printed either way, and `drain` still reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_flag_limits_the_event_lines() {
    let sim = PrefillSim::start(SimConfig {
        tp_size: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    // One failing peer: with all events on this request prints settled, first_failure,
    // completion and released lines.
    sim.set_faults(
        1,
        0,
        Faults {
            failure_rate: 1.0,
            ..Faults::default()
        },
    );
    for (level, allowed) in [
        (
            "completions",
            &["ready", "load_kv", "completion", "drain", "shutdown"][..],
        ),
        ("none", &["ready", "load_kv", "drain", "shutdown"][..]),
    ] {
        let mut s = Serve::one_layer(&["--events", level, "--log-level", "warn"]);
        s.wait("ready", |v| ev(v, "ready")).await;
        let id = format!("d-{level}");
        let load = json!({"op": "load_kv", "requests": [{"req_id": id, "transfer_id": format!("t-{level}"),
            "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
            "block_ids": [[1, 2]]}]});
        s.send(&load.to_string()).await;
        assert_eq!(s.wait("load_kv", |v| ev(v, "load_kv")).await["accepted"], 1);
        if level == "completions" {
            let c = s.wait("completion", |v| ev(v, "completion")).await;
            assert_eq!(c["outcome"], "failed", "{c}");
        }
        // The host's loop: drain until the request is reported.
        loop {
            s.send(r#"{"op":"drain"}"#).await;
            let d = s.wait("drain", |v| ev(v, "drain")).await;
            if d["finished_recving"] == json!([id]) {
                break;
            }
        }
        s.send(r#"{"op":"shutdown"}"#).await;
        s.wait("shutdown", |v| ev(v, "shutdown")).await;
        let printed: Vec<&str> = s.seen.iter().filter_map(|v| v["event"].as_str()).collect();
        assert!(
            printed.iter().all(|e| allowed.contains(e)),
            "--events {level} printed {printed:?}"
        );
        assert!(tokio::time::timeout(SAFETY, s.child.wait())
            .await
            .unwrap()
            .unwrap()
            .success());
    }
}

/// `--answers failures`: a `load_kv` whose every request was accepted gets no answer line; one
/// with a rejection, a bad line, `drain` and `shutdown` are answered as always, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_failures_leaves_out_only_fully_accepted_load_kv_answers() {
    let sim = PrefillSim::start(SimConfig::default()).await.unwrap();
    let mut s = Serve::one_layer(&[
        "--events",
        "completions",
        "--answers",
        "failures",
        "--log-level",
        "warn",
    ]);
    s.wait("ready", |v| ev(v, "ready")).await;
    let req = |i: u32| {
        json!({"req_id": format!("d-{i}"), "transfer_id": format!("t-{i}"),
               "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
               "block_ids": [[i]]})
    };
    s.send(&json!({"op": "load_kv", "requests": [req(1)]}).to_string())
        .await;
    // The line was taken (its request completes) and nothing answered it: the next answer is
    // the stats line sent after it.
    let c = s.wait("completion", |v| ev(v, "completion")).await;
    assert_eq!(c["req_id"], "d-1");
    assert_eq!(c["outcome"], "ok", "{c}");
    s.send(r#"{"op":"stats"}"#).await;
    let stats = s.wait("stats", |v| !ev(v, "completion")).await;
    assert!(ev(&stats, "stats"), "the first answer printed: {stats}");
    assert_eq!(stats["line"], 2);
    // A rejection is answered, with what was accepted.
    let mut bad = req(3);
    bad["transfer_id"] = Value::Null;
    s.send(&json!({"op": "load_kv", "requests": [req(2), bad]}).to_string())
        .await;
    let a = s.wait("load_kv", |v| !ev(v, "completion")).await;
    assert!(ev(&a, "load_kv"), "{a}");
    assert_eq!(
        (a["line"].clone(), a["accepted"].clone()),
        (json!(3), json!(1))
    );
    assert_eq!(a["rejected"].as_array().map(Vec::len), Some(1), "{a}");
    s.send("not json").await;
    let e = s.wait("error", |v| !ev(v, "completion")).await;
    assert!(ev(&e, "error") && e["line"] == 4, "{e}");
    loop {
        s.send(r#"{"op":"drain"}"#).await;
        let d = s.wait("drain", |v| ev(v, "drain")).await;
        if d["finished_recving"] == json!(["d-2"]) || d["finished_recving"] == json!(["d-1", "d-2"])
        {
            break;
        }
    }
    s.send(r#"{"op":"shutdown"}"#).await;
    let end = s.wait("shutdown", |v| ev(v, "shutdown")).await;
    assert_eq!(end["unreleased"], 0, "{end}");
    let load_kv_lines = s.seen.iter().filter(|v| ev(v, "load_kv")).count();
    assert_eq!(
        load_kv_lines, 1,
        "only the batch with a rejection: {:#?}",
        s.seen
    );
}

/// The next stdout line of a child, as JSON.
async fn next_json(out: &mut Lines<BufReader<ChildStdout>>) -> Value {
    let line = tokio::time::timeout(SAFETY, out.next_line())
        .await
        .expect("a line in time")
        .unwrap()
        .expect("stdout still open");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON: {line}: {e}"))
}

/// The operator's pair of processes: `kvrecv prefill-sim --write` as P and `kvrecv serve` as D.
/// P writes every block it is asked for through serve's TE target before it answers; serve
/// reports the completion and counts the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_sim_with_write_lands_bytes_in_serve() {
    let mut p = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .args([
            "prefill-sim",
            "--bootstrap-port",
            "0",
            "--tp",
            "2",
            "--write",
        ])
        .args(["--log-level", "warn"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("kvrecv binary");
    let mut p_out = BufReader::new(p.stdout.take().unwrap()).lines();
    let ready = next_json(&mut p_out).await;
    assert_eq!(ready["event"], "ready", "{ready}");
    // Bytes that are not UTF-8 on P's stdin are answered, not taken for the end of its input
    // (which would shut P down and fail the pull below).
    let mut p_in = p.stdin.take().unwrap();
    p_in.write_all(b"\xff\xfe{\n").await.unwrap();
    p_in.flush().await.unwrap();
    let answer = next_json(&mut p_out).await;
    assert_eq!(answer["event"], "error", "{answer}");
    let mut s = Serve::start(&["--layers", "2", "--block-len", "4096", "--num-blocks", "16"]);
    s.wait("ready", |v| ev(v, "ready")).await;
    let req = json!({"op": "load_kv", "requests": [{"req_id": "r1", "transfer_id": "t1",
        "remote_engine_id": ready["engine_id"], "remote_bootstrap_addr": ready["bootstrap"],
        "block_ids": [[2, 5]]}]});
    s.send(&req.to_string()).await;
    let c = s
        .wait("completion", |v| ev(v, "completion") && v["req_id"] == "r1")
        .await;
    assert_eq!(c["outcome"], "ok", "{c}");
    let stats = data_stats(&mut s).await;
    // Two P ranks each write their half of 2 blocks x 2 layers x 4096 bytes.
    assert_eq!(stats["bytes_landed"], 2 * 2 * 4096, "{stats}");
    assert_eq!(stats["rejected_no_permit"], 0, "{stats}");
    s.send(r#"{"op":"shutdown"}"#).await;
    s.wait("shutdown", |v| ev(v, "shutdown")).await;
}

/// `serve` with a 64 KiB stdout backlog and warnings on stderr: stdin and stderr pipes, stdout
/// `stdout`.
fn serve_with_a_small_stdout_backlog(
    stdout: Stdio,
) -> (tokio::process::Child, tokio::process::ChildStdin) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .args([
            "serve",
            "--layers",
            "1",
            "--block-len",
            "4096",
            "--num-blocks",
            "16",
            "--max-output-backlog-bytes",
            "65536",
            "--log-level",
            "warn",
        ])
        .stdin(Stdio::piped())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("kvrecv binary");
    let stdin = child.stdin.take().unwrap();
    (child, stdin)
}

/// A host that keeps writing stdin but stops reading stdout: serve stops reading stdin once its
/// stdout backlog passes `--max-output-backlog-bytes` (the host's writes block), instead of
/// queueing answers without limit; once the host reads again, every line is answered, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_stops_reading_stdout_is_held_back_not_buffered_without_limit() {
    const LINES: usize = 20_000; // ~10 MB of answers for 300 KB of input
    let (mut child, mut stdin) = serve_with_a_small_stdout_backlog(Stdio::piped());
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    assert_eq!(next_json(&mut out).await["event"], "ready");

    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    let mut host = tokio::spawn(async move {
        let chunk = r#"{"op":"stats"}"#.to_owned() + "\n";
        for _ in 0..LINES {
            stdin.write_all(chunk.as_bytes()).await.unwrap();
            counter.fetch_add(1, Ordering::Relaxed);
        }
        stdin
    });
    // Nobody reads stdout now. serve must say it paused stdin before the host got all its
    // input in: without the bound it reads every line and queues every answer.
    let paused = async {
        while let Some(l) = err.next_line().await.unwrap() {
            if l.contains("stdin paused") {
                return l;
            }
        }
        panic!("stderr closed");
    };
    tokio::select! {
        l = paused => assert!(l.contains("WARN"), "{l}"),
        _ = &mut host => panic!("serve read all {LINES} lines while its stdout was not read"),
        _ = tokio::time::sleep(SAFETY) => panic!("no pause reported"),
    }
    assert!(sent.load(Ordering::Relaxed) < LINES);

    // The host reads again: nothing was lost, nothing reordered.
    for n in 1..=LINES as u64 {
        let v = next_json(&mut out).await;
        assert_eq!(
            (v["event"].as_str(), v["line"].as_u64()),
            (Some("stats"), Some(n))
        );
    }
    let mut stdin = tokio::time::timeout(SAFETY, host).await.unwrap().unwrap();
    stdin.write_all(b"{\"op\":\"shutdown\"}\n").await.unwrap();
    assert_eq!(next_json(&mut out).await["event"], "shutdown");
    let status = tokio::time::timeout(SAFETY, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
}

/// SIGTERM while the host reads nothing of stdout (its backlog full, stdin paused): serve
/// still stops, dropping the output nobody reads after a short grace and saying so, instead of
/// waiting for the host forever (a stop only SIGKILL could make). Over a pipe (written by a
/// task) and over a socket (written by a thread of its own, blocked in `write`: as Node.js
/// hosts give their children).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_serve_even_when_the_host_never_reads_stdout() {
    for socket in [false, true] {
        // The socket's other end is held, never read.
        let (stdout, _unread) = match socket {
            false => (Stdio::piped(), None),
            true => {
                let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
                (Stdio::from(std::os::fd::OwnedFd::from(theirs)), Some(ours))
            }
        };
        let (mut child, mut stdin) = serve_with_a_small_stdout_backlog(stdout);
        // A pipe is held too, never read past the ready line: it fills and serve's writes wait.
        let mut out = child.stdout.take().map(|o| BufReader::new(o).lines());
        if let Some(out) = out.as_mut() {
            assert_eq!(next_json(out).await["event"], "ready");
        }
        let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
        let host = tokio::spawn(async move {
            let chunk = r#"{"op":"stats"}"#.to_owned() + "\n";
            // Until serve stops reading (a write fails once it exited).
            while stdin.write_all(chunk.as_bytes()).await.is_ok() {}
        });
        tokio::time::timeout(SAFETY, said(&mut err, "stdin paused"))
            .await
            .expect("serve pauses stdin");
        let pid = child.id().expect("running") as libc::pid_t;
        // SAFETY: signals our own child, which is still running (not yet waited for).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let dropped = tokio::time::timeout(SAFETY, said(&mut err, "without writing the rest"))
            .await
            .expect("serve gives up on the unread backlog");
        assert!(dropped.contains("WARN"), "{dropped}");
        let status = tokio::time::timeout(SAFETY, child.wait())
            .await
            .unwrap_or_else(|_| panic!("serve exits with its stdout unread (socket: {socket})"))
            .unwrap();
        assert!(status.success(), "{status:?}");
        host.await.unwrap();
        drop(out);
    }
}

/// The next stderr line that contains `what`.
async fn said(
    err: &mut tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
    what: &str,
) -> String {
    while let Some(l) = err.next_line().await.unwrap() {
        if l.contains(what) {
            return l;
        }
    }
    panic!("stderr closed before {what:?}");
}

/// Shutdown hands over what completed since the host's last drain and says how many awaited
/// requests were never released (still in flight), instead of ending silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_reports_the_undrained_and_the_unreleased() {
    let sim = PrefillSim::start(SimConfig {
        tp_size: 1,
        ready_immediately: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut s = Serve::one_layer(&["--log-level", "error"]);
    s.wait("ready", |v| ev(v, "ready")).await;
    let req = |id: &str, t: &str, b: u32| {
        json!({"req_id": id, "transfer_id": t, "remote_engine_id": sim.engine_id(),
               "remote_bootstrap_addr": sim.bootstrap_url(), "block_ids": [[b]]})
    };
    let load = json!({"op": "load_kv", "requests": [req("d-1", "t-1", 1), req("d-2", "t-2", 2)]});
    s.send(&load.to_string()).await;
    let r = s.wait("load_kv", |v| ev(v, "load_kv")).await;
    assert_eq!(r["awaiting"], 2, "{r}");
    sim.mark_ready("t-1");
    s.wait("release of d-1", |v| {
        ev(v, "released") && v["req_id"] == "d-1"
    })
    .await;
    s.send(r#"{"op":"shutdown"}"#).await;
    let d = s.wait("final drain", |v| ev(v, "drain")).await;
    assert_eq!(d["finished_recving"], json!(["d-1"]), "{d}");
    let end = s.wait("shutdown", |v| ev(v, "shutdown")).await;
    assert_eq!(end["unreleased"], 1, "{end}");
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
}

/// Out of file descriptors, a pull fails saying so (not "connection refused"), the request still
/// completes (failed, with every peer settled) and serve keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_is_reported_as_such() {
    let sim = PrefillSim::start(SimConfig {
        tp_size: 96,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut child = Command::new("sh")
        .args([
            "-c",
            &format!(
                "ulimit -n 80 && exec {} serve --layers 1 --block-len 4096 --num-blocks 16 --log-level error",
                env!("CARGO_BIN_EXE_kvrecv")
            ),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(next_json(&mut out).await["event"], "ready");
    let load = json!({"op": "load_kv", "requests": [{"req_id": "d-1", "transfer_id": "t-1",
        "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
        "block_ids": [[1]]}]});
    stdin
        .write_all(format!("{load}\n").as_bytes())
        .await
        .unwrap();
    let mut failures = vec![];
    let completion = loop {
        let v = next_json(&mut out).await;
        // Either kind: a DEALER that cannot be created refuses the pull (failed); a connect
        // libzmq retries after its socket() failed leaves a queued pull in doubt (uncertain).
        if v["event"] == "settled"
            && (v["outcome"]["kind"] == "failed" || v["outcome"]["kind"] == "uncertain")
        {
            failures.push(v["outcome"]["reason"].as_str().unwrap().to_owned());
        }
        if v["event"] == "completion" {
            break v;
        }
    };
    assert_eq!(completion["outcome"], "failed", "{completion}");
    assert!(!failures.is_empty());
    for r in &failures {
        assert!(
            r.contains("Too many open files") || r.contains("file descriptor"),
            "{r}"
        );
    }
    stdin.write_all(b"{\"op\":\"shutdown\"}\n").await.unwrap();
    loop {
        if next_json(&mut out).await["event"] == "shutdown" {
            break;
        }
    }
    assert!(tokio::time::timeout(SAFETY, child.wait())
        .await
        .unwrap()
        .unwrap()
        .success());
}

/// `--metrics 127.0.0.1:0`: the ready line names the port bound; `/metrics` answers Prometheus
/// text; a client that never sends its request is closed, and past the connection cap new
/// connections are closed at once while the endpoint keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_reports_its_port_and_bounds_its_clients() {
    use tokio::io::AsyncReadExt;
    let mut s = Serve::one_layer(&["--metrics", "127.0.0.1:0", "--log-level", "warn"]);
    let ready = s.wait("ready", |v| ev(v, "ready")).await;
    let addr: std::net::SocketAddr = ready["metrics"].as_str().unwrap().parse().unwrap();
    assert_ne!(addr.port(), 0, "{ready}");
    let get = |path: &'static str| async move {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut body = String::new();
        tokio::time::timeout(SAFETY, c.read_to_string(&mut body))
            .await
            .unwrap()
            .unwrap();
        body
    };
    let m = get("/metrics").await;
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(m.contains("kvrecv_"), "{m}");
    assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
    // 64 silent clients take every slot; the next connection is closed without an answer.
    let mut silent = vec![];
    for _ in 0..64 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let mut over = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = over.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(SAFETY, over.read_to_end(&mut got))
        .await
        .expect("closed at once");
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    // The silent ones are closed at their timeout; then the endpoint answers again.
    for c in &mut silent {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(SAFETY, c.read(&mut b))
            .await
            .expect("a silent client is closed")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
    let m = get("/metrics").await;
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvrecv_connections_refused_total")
                && l.contains(r#"listener="metrics""#)
                && l.ends_with(" 1")),
        "the refusal is counted: {m}"
    );
    s.send(r#"{"op":"shutdown"}"#).await;
    s.wait("shutdown", |v| ev(v, "shutdown")).await;
}

/// Flag values serve cannot work with are refused at start with a message naming the flag,
/// rather than silently changed or accepted into a process that fails every request.
#[tokio::test]
async fn unusable_flag_values_are_refused_at_start() {
    let base = [
        "serve",
        "--layers",
        "1",
        "--block-len",
        "4096",
        "--num-blocks",
        "8",
    ];
    for (extra, says) in [
        (&["--windows", "1"][..], "--windows"),
        (&["--base-addr", "0"], "--base-addr"),
        (&["--max-line-bytes", "0"], "--max-line-bytes"),
        (&["--max-msg-size", "0"], "--max-msg-size"),
        (&["--layers", "4294967295"], "--layers"),
        (&["--expect-p-tp", "0"], "--expect-p-tp"),
        (&["--max-p-workers", "0"], "--max-p-workers"),
        (&["--advertise-host", "a b"], "--advertise-host"),
        (&["--gpu", "0", "--protocol", "rdma"], "--gpu"),
        // A build without CUDA says so instead of starting on host memory.
        #[cfg(not(feature = "cuda"))]
        (&["--gpu", "0"], "built without CUDA"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
            .args(base)
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{extra:?} was accepted");
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(text.contains(says), "{extra:?}: {text}");
    }
}

/// Run `kvrecv args`, read its ready line, close its stdout, send one line (whose answer is the
/// first write that fails) and return how the process ended. `stdin` stays open throughout, so
/// an exit is the closed stdout's doing, not the end of input.
async fn exit_after_stdout_closes(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(next_json(&mut out).await["event"], "ready");
    drop(out);
    stdin.write_all(b"{\"op\":\"stats\"}\n").await.unwrap();
    let done = tokio::time::timeout(SAFETY, child.wait_with_output())
        .await
        .expect("the process exits")
        .unwrap();
    drop(stdin);
    done
}

/// A host that closes serve's stdout can hear nothing more: serve stops as at the end of its
/// input (a non-zero exit, an error on stderr) instead of working on unheard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_stops_serve() {
    let done = exit_after_stdout_closes(&[
        "serve",
        "--layers",
        "1",
        "--block-len",
        "4096",
        "--num-blocks",
        "16",
    ])
    .await;
    assert!(!done.status.success());
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(stderr.contains("stdout is closed"), "{stderr}");
}

/// `prefill-sim` whose driver closed its stdout stops with an error, not a panic (exit 101).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_sim_stops_cleanly_when_its_stdout_closes() {
    let done = exit_after_stdout_closes(&["prefill-sim", "--log-level", "off"]).await;
    assert_eq!(done.status.code(), Some(1), "{done:?}");
    assert!(String::from_utf8_lossy(&done.stderr).contains("stdout closed"));
}

/// [`thread_cpus`] once `n` threads are named `name`, or after 10 s: a thread names itself when
/// it first runs, and the data runtime's workers need not have run yet (a pull without
/// writes never wakes them; under load the first time slice can come late).
fn named_threads(pid: u32, name: &str, n: usize) -> Vec<(String, String)> {
    let t0 = std::time::Instant::now();
    loop {
        let threads = thread_cpus(pid);
        if threads.iter().filter(|(t, _)| t == name).count() >= n
            || t0.elapsed() > Duration::from_secs(10)
        {
            return threads;
        }
        std::thread::yield_now();
    }
}

/// `--data-threads N`: N threads serve the data connections, P's writes land through them and
/// a late one is still refused; 0 is refused at the command line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_threads_sets_the_threads_serving_data_connections() {
    let mut args = BASIC.to_vec();
    args.extend(["--data-threads", "3"]);
    let mut s = Serve::start(&args);
    let ready = s.wait("ready", |v| ev(v, "ready")).await;
    let threads = named_threads(s.child.id().unwrap(), "kvrecv-conn-2", 1);
    let mut conn: Vec<&str> = threads
        .iter()
        .filter(|(n, _)| n.starts_with("kvrecv-conn-"))
        .map(|(n, _)| n.as_str())
        .collect();
    conn.sort_unstable();
    assert_eq!(conn, ["kvrecv-conn-0", "kvrecv-conn-1", "kvrecv-conn-2"]);
    // Three connections open at once go one to each thread: each thread, parked until then,
    // runs (its CPU time moves).
    let pid = s.child.id().unwrap();
    let ran = |name: &str| thread_run_ns(pid, name);
    let idle: Vec<u64> = (0..3).map(|i| ran(&format!("kvrecv-conn-{i}"))).collect();
    let data_port = ready["data"]["port"].as_u64().unwrap() as u16;
    let mut held = vec![];
    for _ in 0..3 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", data_port))
                .await
                .unwrap(),
        );
    }
    let t0 = std::time::Instant::now();
    while (0..3).any(|i| ran(&format!("kvrecv-conn-{i}")) == idle[i]) {
        assert!(
            t0.elapsed() < SAFETY,
            "a connection thread never ran: {idle:?}"
        );
        tokio::task::yield_now().await;
    }
    drop(held);
    s.send(r#"{"op":"shutdown"}"#).await;
    s.wait("shutdown", |v| ev(v, "shutdown")).await;

    // Two P ranks' lanes spread over the three threads: every write lands, a late one does not.
    let (late, before, after) = write_into_serve(&["--data-threads", "3"]).await;
    assert!(late.is_err(), "the completion revoked the pull's permit");
    assert_eq!(after["bytes_landed"], before["bytes_landed"]);

    let mut args = BASIC.to_vec();
    args.extend(["--data-threads", "0"]);
    let mut s = Serve::start(&args);
    let status = tokio::time::timeout(SAFETY, s.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(2), "--data-threads 0 is a usage error");
}

/// Nanoseconds the thread of `pid` named `name` has run (`schedstat`), 0 if there is none.
fn thread_run_ns(pid: u32, name: &str) -> u64 {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = t.unwrap().path();
        if std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == name) {
            let stat = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
            return stat
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
        }
    }
    0
}

/// Each thread of `pid`: its name and its `Cpus_allowed_list`.
fn thread_cpus(pid: u32) -> Vec<(String, String)> {
    let mut v = vec![];
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = t.unwrap().path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("status")),
        ) else {
            continue; // the thread ended meanwhile
        };
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_owned();
        v.push((comm.trim().to_owned(), cpus));
    }
    v
}

/// `--control-cpu`: by default the actors' thread and libzmq's threads (created by the first
/// pull) run on the one CPU the ready line names, while the data plane's threads keep every
/// CPU; `any`, or a CPU serve may not use, pins nothing (and serve still serves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_runs_on_one_cpu_and_the_data_plane_on_all() {
    let sim = PrefillSim::start(SimConfig::default()).await.unwrap();
    let all = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_owned();
    for placement in [None, Some("any"), Some("1000000")] {
        let mut args = BASIC.to_vec();
        if let Some(p) = placement {
            args.extend(["--control-cpu", p]);
        }
        let mut s = Serve::start(&args);
        let ready = s.wait("ready", |v| ev(v, "ready")).await;
        let load = json!({"op": "load_kv", "requests": [{"req_id": "d-1", "transfer_id": "t-1",
            "remote_engine_id": sim.engine_id(), "remote_bootstrap_addr": sim.bootstrap_url(),
            "block_ids": [[5]]}]});
        s.send(&load.to_string()).await;
        let c = s.wait("completion", |v| ev(v, "completion")).await;
        assert_eq!(c["outcome"], "ok", "{placement:?}");
        let threads = named_threads(s.child.id().unwrap(), "kvrecv-data", 2);
        // The data runtime's two workers and the thread serving data connections.
        let (data, control): (Vec<_>, Vec<_>) = threads
            .iter()
            .partition(|(name, _)| name == "kvrecv-data" || name.starts_with("kvrecv-conn-"));
        assert_eq!(data.len(), 3, "{threads:?}");
        assert!(data.iter().all(|(_, c)| *c == all), "{threads:?}");
        // The actors' thread, libzmq's I/O and reaper threads.
        assert!(control.len() >= 3, "{threads:?}");
        match placement {
            None => {
                let cpu = ready["control_cpu"].as_u64().expect("a CPU").to_string();
                assert!(control.iter().all(|(_, c)| *c == cpu), "{threads:?}");
            }
            Some(_) => {
                assert!(ready["control_cpu"].is_null(), "{ready}");
                assert!(control.iter().all(|(_, c)| *c == all), "{threads:?}");
            }
        }
        s.send(r#"{"op":"shutdown"}"#).await;
        s.wait("shutdown", |v| ev(v, "shutdown")).await;
    }
}
