//! `benches/baseline.py` at CI scale: kvrecv's D (library, embedding handle, `serve`) and the
//! Python D that follows vLLM's receive loop, against `kvrecv prefill-sim` in its own process.
//! Asserts only that it runs and reports every figure, and that no completion failed against a
//! healthy P; timing is never a test. Needs the venv's Python (msgspec, pyzmq).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

#[path = "common/python.rs"]
mod python;

#[test]
fn baseline_runs_and_reports_every_d() {
    let Some(py) = python::python() else { return };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(py)
        .arg(root.join("benches/baseline.py"))
        .args([
            "--kvrecv",
            env!("CARGO_BIN_EXE_kvrecv"),
            "--small",
            "--json",
        ])
        .output()
        .expect("python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "baseline.py failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("not one JSON report: {e}: {stdout}"));
    let rows = report["rows"].as_array().expect("rows");
    // --small: TP2, batch 1 and 16, 16 in flight.
    assert_eq!(rows.len(), 2, "{report}");
    for row in rows {
        for d in ["python", "lib", "embed", "serve"] {
            let r = &row[d];
            for k in ["cpu_us_per_request", "pulls_per_s", "p50_us", "p99_us"] {
                assert!(r[k].is_number(), "{d} has no {k}: {row}");
            }
            assert_eq!(
                r["failed"], 0,
                "{d} failed completions against a healthy P: {row}"
            );
        }
        for d in ["lib", "embed", "serve"] {
            assert!(row[d]["pulls_ratio"].is_number(), "{d} has no ratio: {row}");
        }
        for k in ["after_settle_p99_us", "after_settle_observed_p99_us"] {
            assert!(
                row["lib"][k].is_number(),
                "no latency after the last settle ({k}): {row}"
            );
        }
    }
    // The memory phase: every D held the requests in flight and reported its RSS growth.
    let memory = &report["memory"];
    for d in ["python", "lib", "serve"] {
        let m = &memory[d];
        assert!(m["requests"].as_u64().unwrap_or(0) >= 1000, "{memory}");
        assert!(
            m["bytes_per_request"].as_f64().is_some(),
            "{d} reported no memory per request: {memory}"
        );
    }
}

/// `kvrecv bench` on its built-in defaults (P simulated in process, on threads of its own),
/// on the actors' thread and through the embedding handle: every request completes, none
/// failed, and the figures are reported. Timing is not tested.
#[test]
fn bench_with_its_own_simulator_completes_every_request() {
    for via in ["actors", "handle"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
            .args(["bench", "--requests", "300", "--batch", "4", "--json"])
            .args(["--via", via])
            .output()
            .expect("kvrecv runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "kvrecv bench --via {via} failed: {stderr}"
        );
        let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON report");
        assert_eq!(r["failed_completions"], 0, "{r}");
        assert_eq!(r["config"]["requests"], 300, "{r}");
        assert_eq!(r["config"]["via"], via, "{r}");
        for k in ["pulls_per_s", "completion_p50_us", "completion_p99_us"] {
            assert!(r[k].as_f64().is_some_and(|v| v > 0.0), "no {k}: {r}");
        }
        // Emission stamps exist only on the actors' thread.
        assert_eq!(
            r["after_last_settle_p99_us"].is_number(),
            via == "actors",
            "{r}"
        );
    }
}

/// A bench whose completions failed (no P at the bootstrap address) says so in its exit
/// status: its throughput figures measured failures, not the receive path.
#[test]
fn a_bench_with_failed_completions_exits_non_zero() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .args([
            "bench",
            "--bootstrap",
            "http://127.0.0.1:1",
            "--requests",
            "10",
            "--json",
            "--log-level",
            "off",
        ])
        .output()
        .expect("kvrecv runs");
    assert_eq!(out.status.code(), Some(1));
    let r: Value = serde_json::from_slice(&out.stdout).expect("the report is still printed");
    assert!(r["failed_completions"].as_u64().unwrap_or(0) > 0, "{r}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("completions failed"));
}
