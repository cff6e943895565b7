//! `kvrecv serve`'s stdin under hostile input: a stream of valid lines, valid lines with random
//! byte and JSON-token edits (escapes, lone surrogates, huge and negative numbers, stray
//! brackets), random bytes, blank and over-long lines, against a real P (the in-process
//! simulator, TP2). The request parser reads ids in place from the line (`KvRequestRef`), so
//! this is where a borrowed-versus-owned mistake or a panic on odd input would show.
//!
//! What must hold: the process survives and stops cleanly on `shutdown`, prints only JSON
//! lines, answers every non-blank input line exactly once and in order (`line`), completes
//! every request it said it awaits exactly once, and afterwards still serves valid requests
//! to completion; nothing on stderr reports a panic.

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use kvrecv::sim::{PrefillSim, SimConfig};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

#[path = "common/edits.rs"]
mod edits;

/// Safety net only: every wait ends on a line long before this.
const SAFETY: Duration = Duration::from_secs(60);
const MAX_LINE: usize = 4096;
const NUM_BLOCKS: u64 = 256;
/// Lines of hostile input.
const LINES: usize = 1500;

/// JSON fragments that stress a parser reading strings in place.
const TOKENS: &[&str] = &[
    "\"",
    "\\",
    "\\\"",
    "\\u0000",
    "\\ud800",
    "\\udc00\\ud800",
    "\\u00e9",
    "\\n",
    "é",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "null",
    "true",
    "-1",
    "1.5",
    "1e999",
    "4294967296",
    "18446744073709551616",
    "[]",
    "{}",
    "[[]]",
    "\"req_id\":\"x\",",
    "\"op\":\"drain\",",
    "\"block_ids\":[[1,1]],",
];

#[derive(Debug, Clone)]
enum LineEdit {
    Byte(edits::Edit),
    Token(usize, &'static str),
}

fn line_edit() -> impl Strategy<Value = LineEdit> {
    prop_oneof![
        edits::edit().prop_map(LineEdit::Byte),
        (any::<usize>(), prop::sample::select(TOKENS)).prop_map(|(i, t)| LineEdit::Token(i, t)),
    ]
}

fn apply(mut v: Vec<u8>, es: &[LineEdit]) -> Vec<u8> {
    for e in es {
        match e {
            LineEdit::Byte(b) => v = edits::apply(v, std::slice::from_ref(b)),
            LineEdit::Token(i, t) => {
                let at = i % (v.len() + 1);
                v.splice(at..at, t.bytes());
            }
        }
    }
    v
}

/// A line serve takes as it is: a `load_kv` of 0-4 requests (ids drawn from a small set so that
/// duplicates and requests still in flight occur; blocks from a small range, some out of it),
/// or one of the other ops.
fn valid_line(engine: String, bootstrap: String) -> impl Strategy<Value = Vec<u8>> + Clone {
    let id = prop_oneof![
        (0u32..40).prop_map(|i| format!("r-{i}")),
        Just("r-é\"q".to_owned()),
        "[a-z]{0,12}",
    ];
    let bootstrap = prop_oneof![
        8 => Just(bootstrap),
        1 => Just("127.0.0.1:1".to_owned()),
        1 => Just("not an address".to_owned()),
    ];
    let engine = prop_oneof![6 => Just(engine), 1 => Just("nope".to_owned())];
    let block = 0u64..NUM_BLOCKS / 2 + 8;
    let blocks = prop_oneof![
        4 => prop::collection::vec(prop::collection::vec(block.clone(), 1..4), 1..=1),
        1 => prop::collection::vec(prop::collection::vec(block, 0..4), 0..3),
    ];
    let request = (id.clone(), id.clone(), engine, bootstrap, blocks).prop_map(
        |(req, transfer, engine, bootstrap, blocks)| {
            json!({"req_id": req, "transfer_id": transfer, "remote_engine_id": engine,
                   "remote_bootstrap_addr": bootstrap, "block_ids": blocks})
        },
    );
    prop_oneof![
        6 => prop::collection::vec(request, 0..5).prop_map(|r| json!({"op": "load_kv", "requests": r})),
        1 => id.prop_map(|r| json!({"op": "abort", "req_id": r})),
        1 => Just(json!({"op": "drain"})),
        1 => Just(json!({"op": "stats"})),
    ]
    .prop_map(|v| v.to_string().into_bytes())
}

/// One input line (without its newline).
fn hostile_line(engine: String, bootstrap: String) -> impl Strategy<Value = Vec<u8>> {
    let valid = valid_line(engine, bootstrap);
    prop_oneof![
        3 => valid.clone(),
        6 => (valid, prop::collection::vec(line_edit(), 1..6)).prop_map(|(v, e)| apply(v, &e)),
        1 => prop::collection::vec(any::<u8>(), 0..200),
        1 => prop::sample::select(vec!["", " ", "\r", "\t \r", "\u{a0}"]).prop_map(|s| s.as_bytes().to_vec()),
        1 => Just(vec![b'{'; MAX_LINE * 2]),
    ]
    // A newline inside would make two lines: the count of answers would no longer be known.
    .prop_map(|mut v| {
        v.iter_mut().filter(|b| **b == b'\n').for_each(|b| *b = b' ');
        v
    })
}

/// Whether serve answers the line: every line but a blank one (as serve reads it: an over-long
/// or non-UTF-8 line is answered with an error; a trailing `\r` is dropped).
fn answered(line: &[u8]) -> bool {
    if line.len() > MAX_LINE {
        return true;
    }
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    match std::str::from_utf8(line) {
        Ok(s) => !s.trim().is_empty(),
        Err(_) => true,
    }
}

/// Every number anywhere in the line, if it is JSON: a superset of the blocks it may hold.
fn numbers(line: &[u8], into: &mut HashSet<u64>) {
    fn walk(v: &Value, into: &mut HashSet<u64>) {
        match v {
            Value::Number(n) => {
                if let Some(n) = n.as_u64() {
                    into.insert(n);
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, into)),
            Value::Object(o) => o.values().for_each(|v| walk(v, into)),
            _ => {}
        }
    }
    if let Ok(v) = serde_json::from_slice::<Value>(line) {
        walk(&v, into);
    }
}

/// What serve printed so far, and how many of each thing.
#[derive(Default)]
struct Tally {
    answered_lines: Vec<u64>,
    awaiting: u64,
    completions: u64,
}

impl Tally {
    fn take(&mut self, v: &Value) {
        if let Some(n) = v.get("line").and_then(Value::as_u64) {
            self.answered_lines.push(n);
        }
        match v["event"].as_str() {
            Some("load_kv") => self.awaiting += v["awaiting"].as_u64().expect("awaiting"),
            Some("completion") => self.completions += 1,
            _ => {}
        }
    }
}

/// The next line serve printed.
async fn next(rx: &mut mpsc::UnboundedReceiver<Value>) -> Value {
    tokio::time::timeout(SAFETY, rx.recv())
        .await
        .expect("serve printed nothing for too long")
        .expect("serve's stdout ended early")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_stdin_is_answered_line_by_line_and_loses_nothing() {
    let sim = PrefillSim::start(SimConfig {
        tp_size: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let (engine, bootstrap) = (sim.engine_id().to_owned(), sim.bootstrap_url());

    let mut runner = TestRunner::deterministic();
    let lines = prop::collection::vec(hostile_line(engine.clone(), bootstrap.clone()), LINES)
        .new_tree(&mut runner)
        .unwrap()
        .current();
    let expected: Vec<u64> = (1..=lines.len() as u64)
        .filter(|&n| answered(&lines[n as usize - 1]))
        .collect();
    let mut seen_numbers = HashSet::new();
    lines.iter().for_each(|l| numbers(l, &mut seen_numbers));

    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .args([
            "serve",
            "--layers",
            "2",
            "--block-len",
            "64",
            "--num-blocks",
        ])
        .arg(NUM_BLOCKS.to_string())
        .args(["--max-line-bytes", &MAX_LINE.to_string()])
        .args([
            "--bootstrap-timeout-ms",
            "2000",
            "--pull-timeout-ms",
            "5000",
        ])
        .args(["--log-level", "warn"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("kvrecv binary");
    let mut stdin = child.stdin.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let stderr_text = tokio::spawn(async move {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s).await;
        s
    });
    // Every stdout line, parsed; read on its own task so that serve never waits on its output
    // while the test writes its input.
    let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::spawn(async move {
        while let Ok(Some(line)) = out.next_line().await {
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("serve printed a line that is not JSON ({e}): {line}"));
            assert!(v.is_object(), "not a JSON object: {line}");
            if tx.send(v).is_err() {
                return;
            }
        }
    });
    assert_eq!(next(&mut rx).await["event"], "ready");

    let input: Vec<u8> = lines
        .iter()
        .flat_map(|l| l.iter().chain(b"\n"))
        .copied()
        .collect();
    let writer = tokio::spawn(async move {
        stdin.write_all(&input).await.unwrap();
        stdin.flush().await.unwrap();
        stdin
    });
    let mut tally = Tally::default();
    while tally.answered_lines.len() < expected.len() {
        let v = next(&mut rx).await;
        tally.take(&v);
    }
    let mut stdin = writer.await.unwrap();
    assert_eq!(
        tally.answered_lines, expected,
        "every non-blank line is answered once, in order"
    );
    // Every request serve said it awaits completes, once.
    while tally.completions < tally.awaiting {
        let v = next(&mut rx).await;
        tally.take(&v);
    }
    assert!(
        tally.awaiting > 0,
        "some hostile lines still loaded requests"
    );

    // serve still works: valid requests on blocks no earlier line could have named complete.
    let free: Vec<u64> = (0..NUM_BLOCKS)
        .filter(|b| !seen_numbers.contains(b))
        .take(8)
        .collect();
    assert_eq!(free.len(), 8, "blocks left for the check");
    let requests: Vec<Value> = free
        .iter()
        .map(|b| {
            json!({"req_id": format!("after-{b}"), "transfer_id": format!("t-after-{b}"),
                   "remote_engine_id": engine, "remote_bootstrap_addr": bootstrap,
                   "block_ids": [[b]]})
        })
        .collect();
    let load = json!({"op": "load_kv", "requests": requests}).to_string() + "\n";
    stdin.write_all(load.as_bytes()).await.unwrap();
    let mut ok = HashSet::new();
    loop {
        let v = next(&mut rx).await;
        match v["event"].as_str() {
            Some("load_kv") => assert_eq!(
                (
                    v["accepted"].as_u64(),
                    v["rejected"].as_array().map(Vec::len)
                ),
                (Some(8), Some(0)),
                "{v}"
            ),
            Some("completion") => {
                let id = v["req_id"].as_str().unwrap_or_default();
                if id.starts_with("after-") {
                    assert_eq!(v["outcome"], "ok", "{v}");
                    ok.insert(id.to_owned());
                }
            }
            _ => {}
        }
        if ok.len() == 8 {
            break;
        }
    }
    stdin.write_all(b"{\"op\":\"shutdown\"}\n").await.unwrap();
    loop {
        if next(&mut rx).await["event"] == "shutdown" {
            break;
        }
    }
    let status = tokio::time::timeout(SAFETY, child.wait())
        .await
        .expect("serve exits after shutdown")
        .unwrap();
    assert!(status.success(), "{status}");
    let err = stderr_text.await.unwrap();
    assert!(!err.contains("panicked"), "serve panicked:\n{err}");
}
