//! `kvrecv repro`: the main job. Replays the trace with injected peer faults under each policy
//! and prints the table (or JSON). Exit status 1 if the `settle` column breaks an invariant.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::repro::{self, Scenario, Soak, Variant};

/// Flags of `kvrecv repro`; every default is the seed's experiment, scaled to run in about a
/// minute on two cores.
#[derive(clap::Args, Debug)]
pub struct ReproArgs {
    /// Trace file (JSON lines: timestamp, input_length, ...). Default: the bundled Mooncake trace.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Requests taken from the start of the trace.
    #[arg(long, default_value_t = 800)]
    pub requests: usize,
    /// Trace time is divided by this (arrivals only; write delays stay real).
    #[arg(long, default_value_t = 20.0)]
    pub time_scale: f64,
    /// Tokens per destination block.
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u64,
    /// Bytes per block per layer.
    #[arg(long, default_value_t = 4096)]
    pub block_bytes: u64,
    #[arg(long, default_value_t = 2)]
    pub layers: u32,
    /// Destination blocks in D's pool.
    #[arg(long, default_value_t = 1024)]
    pub pool_blocks: u32,
    /// Prefill TP size (peers writing head slices of the same blocks).
    #[arg(long, default_value_t = 2)]
    pub p_tp: u32,
    #[arg(long, default_value_t = 1)]
    pub p_pp: u32,
    #[arg(long, default_value_t = 1)]
    pub d_tp: u32,
    /// Fraction of requests peer 0 reports failed after writing them.
    #[arg(long, default_value_t = 0.05)]
    pub fail_rate: f64,
    /// Peer 1's write delay, uniform, in ms: MIN..MAX.
    #[arg(long, default_value = "0..500", value_parser = parse_range)]
    pub delay_ms: (u64, u64),
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Variants to run, in order (`settle-no-epochs`: settle with the epoch rule off).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "naive,naive-permits,settle"
    )]
    pub policies: Vec<Variant>,
    /// D-side pull deadline, ms.
    #[arg(long, default_value_t = 10_000)]
    pub pull_timeout_ms: u64,
    /// Last-resort quarantine deadline, ms.
    #[arg(long, default_value_t = 30_000)]
    pub quarantine_deadline_ms: u64,
    /// Landing windows (epochs) of D's target (default: 16384). Few windows force recycling,
    /// which is where a late writer meets a newer pull (see the `settle-no-epochs` variant).
    #[arg(long)]
    pub windows: Option<u32>,
    /// Add the soak faults: hangs past the deadline, garbage, omissions, peer-wide ERRORs,
    /// unknown and duplicate ids, crashes and restarts, late writes after the deadline.
    #[arg(long)]
    pub soak: bool,
    /// With `--soak`: every P worker evicts its cached D layouts before every n-th pull
    /// (vLLM 0.33's LRU), so pulls that omitted their layout get LAYOUT_MISS and are resent
    /// with it (row `layout resends`). 0: no eviction.
    #[arg(long, default_value_t = crate::repro::scenario::SOAK_EVICT_LAYOUTS_EVERY)]
    pub evict_layouts_every: u32,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Serve Prometheus metrics on this address while running.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Log level for stderr (RUST_LOG wins). The run injects failures on purpose, so the
    /// default keeps their warnings out of the table.
    #[arg(long, default_value = "error")]
    pub log_level: String,
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s.split_once("..").ok_or("expected MIN..MAX")?;
    let (a, b) = (
        a.trim().parse::<u64>().map_err(|e| e.to_string())?,
        b.trim().parse::<u64>().map_err(|e| e.to_string())?,
    );
    if a > b {
        return Err("MIN must be <= MAX".into());
    }
    Ok((a, b))
}

impl ReproArgs {
    fn scenario(&self) -> Scenario {
        let d = Scenario::default();
        Scenario {
            trace: self.trace.clone().unwrap_or(d.trace),
            requests: self.requests,
            time_scale: self.time_scale,
            block_tokens: self.block_tokens,
            block_bytes: self.block_bytes,
            layers: self.layers,
            pool_blocks: self.pool_blocks,
            p_tp: self.p_tp,
            p_pp: self.p_pp,
            d_tp: self.d_tp,
            fail_rate: self.fail_rate,
            delay_ms: self.delay_ms,
            seed: self.seed,
            variants: self.policies.clone(),
            pull_timeout: Duration::from_millis(self.pull_timeout_ms),
            quarantine_deadline: Duration::from_millis(self.quarantine_deadline_ms),
            windows: self.windows,
            soak: self.soak.then(|| Soak {
                evict_layouts_every: (self.evict_layouts_every > 0)
                    .then_some(self.evict_layouts_every),
                ..Soak::default()
            }),
        }
    }
}

pub fn run(args: ReproArgs) -> ExitCode {
    super::logging::init(&args.log_level);
    let scn = args.scenario();
    if let Some(addr) = args.metrics {
        // The exporter needs a runtime; the repro's own one starts below, so use a small one.
        let rt = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("error: cannot start the metrics runtime: {e}");
                return ExitCode::from(2);
            }
        };
        let r = rt.block_on(async { crate::metrics_endpoint::serve_prometheus(addr) });
        match r {
            Ok(bound) => eprintln!("metrics: http://{bound}/metrics"),
            Err(e) => {
                eprintln!("error: metrics on {addr}: {e}");
                return ExitCode::from(2);
            }
        }
        std::mem::forget(rt); // serves until the process exits
    }
    let report = match repro::run_blocking(&scn, !args.json) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if args.json {
        match serde_json::to_string(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        println!(
            "kvrecv repro: {} requests of {}, P TP{} PP{} -> D TP{}, peer 0 fails {:.0}% after writing, peer 1 delays {}..{} ms{}",
            scn.requests,
            scn.trace.file_name().map_or("trace".into(), |f| f.to_string_lossy()),
            scn.p_tp,
            scn.p_pp,
            scn.d_tp,
            scn.fail_rate * 100.0,
            scn.delay_ms.0,
            scn.delay_ms.1,
            if scn.soak.is_some() { ", soak faults on" } else { "" }
        );
        if let Some(w) = scn.windows {
            println!("{w} landing windows");
        }
        print!("{}", report.table());
    }
    let bad = report.settle_violations();
    if bad.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("settle policy broke its invariants: {}", bad.join("; "));
        ExitCode::from(1)
    }
}
