//! `kvrecv`: the decode-side KV receive coordinator's command-line tool.

mod cli;

// The binary's allocator. glibc's malloc took 11% of `kvrecv bench`'s CPU (perf record, TP2,
// batch 16, 64 in flight): per-pull messages and per-request state are freed on another thread
// than the one that allocated them, which glibc pays for in arena locks and consolidation.
// Measured in docs/PERFORMANCE.md; a library user keeps its own allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's defaults keep freed pages resident for a while and commit whole arenas up front:
/// RSS per in-flight request at 100k in flight went from 1,131 B (glibc) to 1,160–1,218 B
/// (`baseline.py --memory-only`). Purging at once and committing on demand brought it to
/// 1,104 B with the same CPU. An operator's `MIMALLOC_*` variable still wins.
fn tune_allocator() {
    // `mi_option_t` values, the same in mimalloc v2 and v3 (include/mimalloc.h).
    const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // mimalloc reads its variables case-insensitively and also under their older names.
    let set_by_operator = |names: &[&str]| {
        std::env::vars_os().any(|(k, _)| {
            k.to_str()
                .is_some_and(|k| names.iter().any(|n| k.eq_ignore_ascii_case(n)))
        })
    };
    for (option, names) in [
        (
            ARENA_EAGER_COMMIT,
            &[
                "MIMALLOC_ARENA_EAGER_COMMIT",
                "MIMALLOC_EAGER_REGION_COMMIT",
            ][..],
        ),
        (
            PURGE_DELAY,
            &["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"][..],
        ),
    ] {
        if !set_by_operator(names) {
            // SAFETY: plain option setters; they take effect on the allocator's next decision.
            unsafe { libmimalloc_sys::mi_option_set(option, 0) };
        }
    }
}

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvrecv",
    version,
    about = "Decode-side KV-cache receive coordinator (vLLM MooncakeConnector compatible)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the effective configuration for a vLLM kv_transfer_config JSON.
    Config {
        /// The JSON, as given to vLLM's --kv-transfer-config.
        json: String,
    },
    /// Run a D receiver driven by JSON lines on stdin; events as JSON lines on stdout.
    Serve(cli::serve::ServeArgs),
    /// Run a simulated vLLM prefill engine (bootstrap server + one ROUTER per worker).
    ///
    /// Prints a `ready` line, then reads JSON commands on stdin (`ready`, `ready_all`, `faults`,
    /// `crash`, `restart`, `stats`, `shutdown`). It runs until `{"op":"shutdown"}` or the end of
    /// stdin: started in the background, keep its stdin open (`sleep infinity | kvrecv
    /// prefill-sim ...`).
    PrefillSim(cli::prefill_sim::PrefillSimArgs),
    /// The main job: replay a trace with injected peer faults; show the write-after-free under
    /// `naive` and its absence under `settle`.
    Repro(cli::repro::ReproArgs),
    /// Control-plane throughput and latency on loopback (no faults).
    Bench(cli::bench::BenchArgs),
}

fn main() -> std::process::ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Config { json } => {
            match kvrecv::config::KvRecvConfig::from_kv_transfer_config(&json) {
                Ok(c) => {
                    println!("{c:#?}");
                    std::process::ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::ExitCode::from(2)
                }
            }
        }
        Cmd::Serve(args) => cli::serve::run(args),
        Cmd::PrefillSim(args) => cli::prefill_sim::run(args),
        Cmd::Bench(args) => cli::bench::run(args),
        Cmd::Repro(args) => cli::repro::run(args),
    }
}
