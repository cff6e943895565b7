//! The `kvrecv` binary's subcommands, one module each (feature `cli`). They live in the library so
//! that they reach its internals while those stay private; [`main`] is the one public item.

#![forbid(unsafe_code)]

mod bench;
mod event_line;
mod line_reader;
mod logging;
mod prefill_sim;
mod repro;
mod serve;
mod serve_answers;
mod serve_args;
mod serve_ops;
mod serve_output;

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
    Serve(serve::ServeArgs),
    /// Run a simulated vLLM prefill engine (bootstrap server + one ROUTER per worker).
    ///
    /// Prints a `ready` line, then reads JSON commands on stdin (`ready`, `ready_all`, `faults`,
    /// `crash`, `restart`, `stats`, `shutdown`). It runs until `{"op":"shutdown"}` or the end of
    /// stdin: started in the background, keep its stdin open (`sleep infinity | kvrecv
    /// prefill-sim ...`).
    PrefillSim(prefill_sim::PrefillSimArgs),
    /// The main job: replay a trace with injected peer faults; show the write-after-free under
    /// `naive` and its absence under `settle`.
    Repro(repro::ReproArgs),
    /// Control-plane throughput and latency on loopback (no faults).
    Bench(bench::BenchArgs),
}

/// Parse the command line and run the subcommand it names (the `kvrecv` binary's `main`, after it
/// installed its allocator).
pub fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Config { json } => match crate::config::KvRecvConfig::from_kv_transfer_config(&json) {
            Ok(c) => {
                println!("{c:#?}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::ExitCode::from(2)
            }
        },
        Cmd::Serve(args) => serve::run(args),
        Cmd::PrefillSim(args) => prefill_sim::run(args),
        Cmd::Bench(args) => bench::run(args),
        Cmd::Repro(args) => repro::run(args),
    }
}
