//! The main job at a small scale (what CI asserts): real actors, ZMQ, TCP data plane, the
//! bundled trace and the seed's faults. `naive` must show writes after free (else the detector
//! proves nothing), permits must refuse them, and `settle` must show none, leak nothing and
//! complete every request exactly once.

use std::process::Command;

use kvrecv::repro::{run_blocking, Scenario, Soak, Variant};

#[test]
fn naive_writes_after_free_settle_none() {
    let scn = Scenario {
        requests: 300,
        time_scale: 40.0,
        ..Scenario::default()
    };
    let report = run_blocking(&scn, false).expect("repro runs");
    eprintln!("{}", report.table());
    let naive = report.get(Variant::Naive).unwrap();
    let permits = report.get(Variant::NaivePermits).unwrap();
    let settle = report.get(Variant::Settle).unwrap();
    for r in [naive, permits, settle] {
        assert_eq!(r.requests, 300);
        assert!(
            r.injected_failures > 0,
            "{}: the fault was not injected",
            r.variant
        );
        assert!(r.audited_writes > 0, "{}: the audit saw nothing", r.variant);
    }
    // The bug, reproduced: late writes land in freed (and reallocated) blocks.
    assert!(
        naive.writes_after_free > 0 && naive.requests_written_after_free > 0,
        "{naive:?}"
    );
    assert!(naive.writes_after_realloc <= naive.writes_after_free);
    // Permits refuse every late write even with the upstream completion rule.
    assert_eq!(permits.writes_after_free, 0, "{permits:?}");
    assert!(permits.late_writes_rejected > 0, "{permits:?}");
    // The fix: nothing lands late, nothing even tries, nothing leaks, one completion each.
    assert!(settle.violations().is_empty(), "{:?}", settle.violations());
    assert_eq!(
        settle.late_writes_rejected, 0,
        "settle waits for every peer: no late write at all"
    );
    assert_eq!(
        (
            settle.completions_min,
            settle.completions_max,
            settle.leaked
        ),
        (1, 1, 0)
    );
    assert_eq!(settle.written_by_both_peers, 300);
}

#[test]
fn cli_json_has_one_object_per_policy_and_exits_zero() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .args([
            "repro",
            "--requests",
            "60",
            "--time-scale",
            "40",
            "--policies",
            "naive,settle",
            "--json",
        ])
        .output()
        .expect("kvrecv runs");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let vs = v["variants"].as_array().unwrap();
    assert_eq!(
        vs.iter()
            .map(|r| r["variant"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["naive", "settle"]
    );
    for key in [
        "requests",
        "written_by_both_peers",
        "injected_failures",
        "writes_after_free",
        "writes_after_realloc",
        "late_writes_rejected",
        "leaked",
        "completions_min",
        "completions_max",
        "pulls_per_s",
        "completion_p50_ms",
        "completion_p99_ms",
    ] {
        assert!(vs[1].get(key).is_some(), "missing {key}");
    }
    assert_eq!(vs[1]["writes_after_free"], 0);
}

/// `repro --soak` with P evicting its layout cache (vLLM 0.33's LRU) every few pulls, under
/// the soak's other faults: pulls that omitted their layout get LAYOUT_MISS and are resent,
/// and still no write lands after free, nothing leaks and every request completes once.
#[test]
fn soak_with_layout_evictions_resends_and_never_writes_after_free() {
    let scn = Scenario {
        requests: 150,
        time_scale: 40.0,
        variants: vec![Variant::Settle],
        pull_timeout: std::time::Duration::from_secs(2),
        soak: Some(Soak {
            period: std::time::Duration::from_millis(400),
            fault_for: std::time::Duration::from_millis(200),
            evict_layouts_every: Some(3),
        }),
        ..Scenario::default()
    };
    let report = run_blocking(&scn, false).expect("repro runs");
    eprintln!("{}", report.table());
    let settle = report.get(Variant::Settle).unwrap();
    assert!(settle.layout_resends > 0, "no pull was resent: {settle:?}");
    assert!(
        settle.audited_writes > 0,
        "the audit saw nothing: {settle:?}"
    );
    assert!(settle.violations().is_empty(), "{:?}", settle.violations());
    assert_eq!(
        (
            settle.writes_after_free,
            settle.completions_min,
            settle.completions_max,
            settle.leaked
        ),
        (0, 1, 1, 0),
        "{settle:?}"
    );
}

/// `kvrecv bench` through the handle with vLLM 0.33-style peers that lose their layout cache
/// and idle-connection floods on D's ports all through the run: every request still completes
/// ok (the floods' sockets are evicted before they keep P out; the misses are resent).
#[test]
fn bench_under_floods_and_layout_evictions_completes_every_request() {
    use kvrecv::repro::bench::{run_bench, BenchConfig, Via};
    let report = run_bench(BenchConfig {
        peers: 2,
        in_flight: 16,
        batch: 4,
        requests: 2000,
        via: Via::Handle,
        evict_layouts_every: Some(3),
        flood: true,
        ..BenchConfig::default()
    })
    .expect("the bench runs");
    assert_eq!(report.failed_completions, 0, "{:?}", report.failure_causes);
}
