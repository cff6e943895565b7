//! Loopback control-plane benchmark (the same measurement as `kvrecv bench`): kvrecv's D
//! against the in-process prefill simulator.
//!
//! `cargo bench --bench control_plane` (env `PULLS`, `INFLIGHT`, `PEERS`, `BATCH`).

use kvrecv::repro::bench::{run_bench, BenchConfig};

fn env(name: &str, dflt: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(dflt)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` probes with --list
    }
    let d = BenchConfig::default();
    let cfg = BenchConfig {
        peers: env("PEERS", d.peers as usize) as u32,
        in_flight: env("INFLIGHT", d.in_flight),
        batch: env("BATCH", d.batch),
        requests: env("PULLS", d.requests),
        ..d
    };
    match run_bench(cfg) {
        Ok(r) => print!("{}", r.table()),
        Err(e) => {
            eprintln!("bench failed: {e}");
            std::process::exit(1);
        }
    }
}
