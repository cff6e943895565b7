//! `kvrecv bench`: control-plane throughput and latency on loopback.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use crate::control::ControlCpu;
use crate::repro::bench::{run_bench, BenchConfig, Via};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Prefill peers per request (P TP size, D TP1).
    #[arg(long, default_value_t = 2)]
    pub peers: u32,
    /// Requests kept in flight.
    #[arg(long, default_value_t = 64)]
    pub in_flight: usize,
    /// Requests per load_kv (one pull per peer each).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Requests measured.
    #[arg(long, default_value_t = 5000)]
    pub requests: usize,
    /// Bootstrap URL of a P in its own process (e.g. `kvrecv prefill-sim`); default: an
    /// in-process simulator with `--peers` workers.
    #[arg(long)]
    pub bootstrap: Option<String>,
    /// Engine id of that P.
    #[arg(long, default_value = "prefill-0")]
    pub engine_id: String,
    /// Memory mode: hold this many requests in flight (against a P that holds every pull, such
    /// as `kvrecv prefill-sim --wait-ready`), driven over stdin by `benches/baseline.py`, which
    /// reads this process's RSS.
    #[arg(long)]
    pub hold: Option<usize>,
    /// How the host reaches kvrecv: `actors` (a task on the actors' thread, as `serve` runs its
    /// loop) or `handle` (the embedding handle `KvRecv`, the README's path, from a multi-thread
    /// tokio runtime; the TCP target with landing permits included).
    #[arg(long, value_enum, default_value_t = ViaArg::Actors)]
    pub via: ViaArg,
    /// Where kvrecv's control plane runs: `current`, a CPU number or `any` (as `serve`).
    #[arg(long, default_value_t = ControlCpu::Current)]
    pub control_cpu: ControlCpu,
    /// vLLM 0.33-style P that loses its layout cache: the in-process simulator evicts it
    /// before every Nth pull of each worker (pulls that omitted their layout get `LAYOUT_MISS`
    /// and are resent). Faults make the figures a fault run's, not a throughput baseline.
    #[arg(long)]
    pub evict_layouts_every: Option<u32>,
    /// Flood D's handshake and data ports with idle connections (1,100 per port, from another
    /// loopback address) all through the run; needs `--via handle` (the data target).
    #[arg(long)]
    pub flood: bool,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    #[arg(long, default_value = "warn")]
    pub log_level: String,
}

/// `--via`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViaArg {
    Actors,
    Handle,
}

pub fn run(a: BenchArgs) -> ExitCode {
    super::logging::init(&a.log_level);
    let cfg = BenchConfig {
        peers: a.peers,
        in_flight: a.in_flight,
        batch: a.batch,
        requests: a.requests,
        bootstrap: a.bootstrap,
        engine_id: Some(a.engine_id),
        via: match a.via {
            ViaArg::Actors => Via::Actors,
            ViaArg::Handle => Via::Handle,
        },
        control_cpu: a.control_cpu,
        evict_layouts_every: a.evict_layouts_every,
        flood: a.flood,
    };
    if let Some(n) = a.hold {
        return match crate::repro::bench::run_hold(cfg, n) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        };
    }
    // A run whose completions failed measured failures, not the receive path: the figures
    // are printed, and the exit status says so.
    let verdict = |failed: usize| {
        if failed == 0 {
            ExitCode::SUCCESS
        } else {
            eprintln!("error: {failed} completions failed (is P reachable and healthy?)");
            ExitCode::from(1)
        }
    };
    match run_bench(cfg) {
        Ok(r) if a.json => match serde_json::to_string(&r) {
            Ok(s) => {
                println!("{s}");
                verdict(r.failed_completions)
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Ok(r) => {
            print!("{}", r.table());
            verdict(r.failed_completions)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
