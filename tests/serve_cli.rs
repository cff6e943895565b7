//! `kvrecv serve` driven through its pipes, against the in-process simulator: the ready line,
//! a batch with one failing peer, the drain, bad input lines, shutdown.

use std::process::Stdio;
use std::time::Duration;

use kvrecv::sim::{Faults, PrefillSim, SimConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const SAFETY: Duration = Duration::from_secs(30);

struct Serve {
    child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    seen: Vec<Value>,
}

impl Serve {
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
        self.stdin
            .write_all(format!("{v}\n").as_bytes())
            .await
            .unwrap();
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
    let mut s = Serve::start(&[
        "--layers",
        "2",
        "--block-len",
        "4096",
        "--num-blocks",
        "64",
        "--log-level",
        "warn",
    ]);
    let ready = s.wait("ready", |v| ev(v, "ready")).await;
    assert_eq!(ready["regions"].as_array().unwrap().len(), 2);
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
