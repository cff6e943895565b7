//! `kvrecv`: the decode-side KV receive coordinator's command-line tool.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod cli;

// The binary's allocator (why mimalloc, and why not through the `mimalloc` crate: see there).
#[global_allocator]
static ALLOCATOR: cli::allocator::MiMalloc = cli::allocator::MiMalloc;

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
    cli::allocator::tune();
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
