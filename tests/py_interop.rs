//! kvrecv's D against a P written in Python with pyzmq + msgspec (tests/py/p_peer.py): the
//! msgpack bytes and the ZMQ framing interoperate, and the ugly cases end in the right events.
//! Needs a Python with msgspec and pyzmq: `KVRECV_PYTHON`, default `.venv/bin/python`.

#[path = "net/mod.rs"]
mod common;

use kvrecv::messages::Cause;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use common::*;
use kvrecv::actors::peer_state::OMITTED;
use kvrecv::messages::{KvEvent, Outcome, SettleOutcome};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[path = "common/python.rs"]
mod python;
use python::python;

struct PyPeer {
    child: Child,
    stdin: ChildStdin,
    lines: UnboundedReceiver<Value>,
}

impl PyPeer {
    fn start(py: &PathBuf) -> PyPeer {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/p_peer.py");
        let mut child = Command::new(py)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python starts");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        // A reader thread: the actix test runtime has no process driver.
        let (tx, lines) = unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        PyPeer {
            child,
            stdin,
            lines,
        }
    }

    async fn line(&mut self) -> Value {
        tokio::time::timeout(SAFETY, self.lines.recv())
            .await
            .expect("python answers")
            .expect("python alive")
    }

    fn say(&mut self, s: &str) {
        writeln!(self.stdin, "{s}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for PyPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[actix::test]
async fn python_pyzmq_msgspec_peer_drives_the_ugly_cases() {
    let Some(py) = python() else { return };
    let mut p = PyPeer::start(&py);
    let ready = p.line().await;
    assert_eq!(ready["event"], "ready");
    let (engine, url) = (
        ready["engine_id"].as_str().unwrap().to_owned(),
        ready["bootstrap"].as_str().unwrap().to_owned(),
    );
    let w: Vec<String> = ready["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    let mut h = Harness::start(config(Duration::from_secs(60)));

    // 1. ERROR from worker 0 while worker 1 is still pending: the failure is reported at once,
    //    the completion waits for worker 1.
    h.load(vec![req("err-1", "t-err-1", &engine, &url, &[1, 2])])
        .await;
    let st = h.settle("err-1", &w[0]).await;
    assert!(
        is_uncertain(&st) && reason(&st).contains("simulated exception"),
        "{st:?}"
    );
    h.wait_for(
        "first failure",
        |e| matches!(e, KvEvent::FirstFailure { req_id, .. } if &**req_id == "err-1"),
    )
    .await;
    h.assert_no_completion("err-1", "while worker 1 may still write")
        .await;
    p.say("release");
    assert_eq!(h.settle("err-1", &w[1]).await, SettleOutcome::Ok);
    let (outcome, uncertain) = h.completion("err-1").await;
    assert!(!outcome.is_ok());
    assert_eq!(
        uncertain.iter().map(|p| p.addr()).collect::<Vec<_>>(),
        vec![w[0].as_str()]
    );

    // 2. FINISH that omits a request: it settles Failed, the other is Ok.
    h.load(vec![
        req("omit-a", "t-omit-a", &engine, &url, &[3]),
        req("omit-b", "t-omit-b", &engine, &url, &[4]),
    ])
    .await;
    assert_eq!(h.completion("omit-a").await.0, Outcome::Ok);
    assert_eq!(
        h.settle("omit-b", &w[0]).await,
        SettleOutcome::failed(Cause::Omitted, OMITTED)
    );
    assert!(!h.completion("omit-b").await.0.is_ok());

    // 3. Garbage instead of msgpack: malformed, Uncertain for that peer.
    h.load(vec![req("garb-1", "t-garb-1", &engine, &url, &[5])])
        .await;
    let st = h.settle("garb-1", &w[0]).await;
    assert!(
        is_uncertain(&st) && reason(&st).contains("malformed"),
        "{st:?}"
    );
    assert_eq!(h.settle("garb-1", &w[1]).await, SettleOutcome::Ok);
    assert!(!h.completion("garb-1").await.0.is_ok());

    // 4. A healthy batch still works, and P saw only well-formed pulls.
    h.load(vec![req("ok-1", "t-ok-1", &engine, &url, &[6, 7])])
        .await;
    assert_eq!(h.completion("ok-1").await.0, Outcome::Ok);

    // 5. Before its answer, worker 0 sends a FINISH naming only the previous pull's request
    //    (an earlier exchange's duplicate on the connection D reused): it is not this pull's
    //    answer, and the request completes Ok; that connection is not used again.
    h.load(vec![req("stray-1", "t-stray-1", &engine, &url, &[8])])
        .await;
    assert_eq!(h.settle("stray-1", &w[0]).await, SettleOutcome::Ok);
    assert_eq!(h.completion("stray-1").await.0, Outcome::Ok);
    h.load(vec![req("ok-2", "t-ok-2", &engine, &url, &[9])])
        .await;
    assert_eq!(h.completion("ok-2").await.0, Outcome::Ok);
    p.say("quit");
    let done = p.line().await;
    assert_eq!(done["event"], "done");
    assert_eq!(
        done["violations"],
        serde_json::json!([]),
        "P found protocol violations by D"
    );
    assert_eq!(done["pulls"], 12); // 6 batches x 2 workers
    assert!(
        done["reused"].as_u64().unwrap() > 0,
        "D reuses connections: {done}"
    );
    assert_eq!(done["reused_after_stray"], 0, "{done}");
}
