//! `kvrecv prefill-sim`: a simulated vLLM prefill engine (bootstrap server + one ROUTER per
//! worker) for demos and manual tests. Prints one `ready` JSON line, then reads JSON commands on
//! stdin: `{"op":"ready","transfer_ids":[..]}`, `{"op":"ready_all"}` (sticky: every request is
//! ready from then on),
//! `{"op":"faults","tp":0,"pp":0,"faults":{..}}`, `{"op":"crash","tp":0,"pp":0}`,
//! `{"op":"restart","tp":0,"pp":0}`, `{"op":"stats"}`, `{"op":"shutdown"}`. It runs until
//! `shutdown` or the end of stdin.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tokio::io::BufReader;

use super::line_reader::{Line, LineReader};

use crate::sim::{Faults, PrefillSim, SimConfig};

/// Longest command line read; a longer one is dropped unread and answered with an error.
const MAX_LINE: usize = 1 << 20;

#[derive(clap::Args, Debug)]
pub struct PrefillSimArgs {
    #[arg(long, default_value = "prefill-0")]
    pub engine_id: String,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub tp: u32,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub pp: u32,
    /// Interface to bind (ROUTERs and the bootstrap server).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Bootstrap port (vLLM default 8998; 0 for any).
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// Requests become ready only when marked on stdin (default: at once).
    #[arg(long)]
    pub wait_ready: bool,
    /// P's readiness wait, ms (vLLM: 480000).
    #[arg(long, default_value_t = 480_000)]
    pub readiness_timeout_ms: u64,
    /// Pulls served at once per worker (vLLM: 2 x num_workers = 20).
    #[arg(long, default_value_t = 20)]
    pub serving_tasks: usize,
    /// Write each request's bytes into D with the Mooncake TE protocol (TCP) before answering,
    /// as a real P does (a pattern, through kvrecv's TE initiator). Default: answer only (a
    /// control-plane P: what `kvrecv bench` and `benches/baseline.py` measure).
    #[arg(long)]
    pub write: bool,
    /// Faults of every worker, JSON: an object of any of these keys (missing ones: healthy).
    ///
    /// Rates are probabilities in 0..=1. `failure_rate` (a written request is reported
    /// failed), `omission_rate` (a ready request is left out of both lists), `write_delay_ms`:
    /// [min, max] (write duration per subset), `error_after_subsets`: n (answer ERROR after n
    /// answered subsets), `error_names_subset`: bool (that ERROR names the current subset),
    /// `reject_pulls`: "why" (refuse every pull with one ERROR), `hang`: bool (never answer),
    /// `crash_after_subsets`: n (close the ROUTER after n answered subsets), `malformed`:
    /// "garbage" | "multi_frame" | "bad_status" | {"oversized": bytes}, `unknown_ids`: bool
    /// (an id D never asked for in every ok list), `duplicate_ids`: bool, `evict_layouts_every`:
    /// n (forget cached D layouts every n-th pull), `legacy_0_32`: bool (vLLM 0.32: no layout
    /// ids). Per worker at run time: the stdin op `{"op":"faults","tp":0,"pp":0,"faults":{..}}`.
    /// Example: `--faults '{"failure_rate":0.2,"write_delay_ms":[0,50]}'`.
    #[arg(long, verbatim_doc_comment)]
    pub faults: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Op {
    Ready { transfer_ids: Vec<String> },
    ReadyAll,
    Faults { tp: u32, pp: u32, faults: Faults },
    Crash { tp: u32, pp: u32 },
    Restart { tp: u32, pp: u32 },
    Stats,
    Shutdown,
}

/// One line on stdout; false once stdout is gone (`println!` would panic on the closed pipe).
fn say(line: impl std::fmt::Display) -> bool {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

pub fn run(args: PrefillSimArgs) -> ExitCode {
    super::logging::init(&args.log_level);
    let faults = match args.faults.as_deref().map(Faults::from_json).transpose() {
        Ok(f) => f.unwrap_or_default(),
        Err(e) => {
            say(json!({"event": "error", "error": format!("--faults: {e}")}));
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say(json!({"event": "error", "error": e.to_string()}));
            return ExitCode::from(1);
        }
    };
    rt.block_on(async move {
        let mut sim = match start_sim(&args, faults).await {
            Ok(s) => s,
            Err(e) => {
                say(json!({"event": "error", "error": e.to_string()}));
                return ExitCode::from(1);
            }
        };
        let workers: Vec<_> = sim
            .workers()
            .iter()
            .map(|w| json!({"tp": w.rank().tp_rank, "pp": w.rank().pp_rank, "addr": w.addr()}))
            .collect();
        if !say(json!({"event": "ready", "engine_id": sim.engine_id(), "bootstrap": sim.bootstrap_url(), "workers": workers})) {
            return ExitCode::from(1);
        }
        serve_ops(&mut sim).await
    })
}

/// The simulator the arguments describe, started (with the TE writer under `--write`).
async fn start_sim(
    args: &PrefillSimArgs,
    faults: Faults,
) -> Result<PrefillSim, crate::sim::SimError> {
    let cfg = SimConfig {
        engine_id: args.engine_id.clone(),
        tp_size: args.tp,
        pp_size: args.pp,
        host: args.host.clone(),
        bootstrap_port: args.bootstrap_port,
        serving_tasks: args.serving_tasks,
        readiness_timeout: Duration::from_millis(args.readiness_timeout_ms),
        ready_immediately: !args.wait_ready,
        faults,
        seed: args.seed,
        ..SimConfig::default()
    };
    if args.write {
        let writer =
            crate::sim::te_writer::TeWriter::new(crate::sim::initiator::InitiatorConfig::default());
        PrefillSim::start_with_writer(cfg, std::sync::Arc::new(writer)).await
    } else {
        PrefillSim::start(cfg).await
    }
}

/// Answer stdin's ops one line each until `shutdown`, EOF or a closed stdout.
async fn serve_ops(sim: &mut PrefillSim) -> ExitCode {
    // Capped, and a line that is not UTF-8 is answered, not taken for the end of input.
    let mut lines = LineReader::new(BufReader::new(tokio::io::stdin()), MAX_LINE);
    while let Ok(Some(line)) = lines.next_line().await {
        let line = match line {
            Line::Text(t) => t,
            Line::NotUtf8 { valid_up_to } => {
                say(json!({"event": "error", "error": format!("not UTF-8 (byte {valid_up_to})")}));
                continue;
            }
            Line::TooLong { len } => {
                say(
                    json!({"event": "error", "error": format!("line of {len} bytes, over {MAX_LINE}")}),
                );
                continue;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Op>(&line) {
            Err(e) => json!({"event": "error", "error": e.to_string()}),
            Ok(op) => match apply(sim, op).await {
                Some(reply) => reply,
                None => break,
            },
        };
        if !say(reply) {
            // The driver closed our stdout: it hears nothing more, so stop as at EOF.
            eprintln!("prefill-sim: stdout closed; shutting down");
            return ExitCode::from(1);
        }
    }
    say(json!({"event": "shutdown"}));
    ExitCode::SUCCESS
}

/// Carry out one op and the line that answers it; `None` for `shutdown`.
async fn apply(sim: &mut PrefillSim, op: Op) -> Option<serde_json::Value> {
    let in_range =
        |s: &PrefillSim, tp: u32, pp: u32| tp < s.config().tp_size && pp < s.config().pp_size;
    let reply = match op {
        Op::Shutdown => return None,
        Op::Ready { transfer_ids } => {
            transfer_ids.iter().for_each(|t| sim.mark_ready(t));
            json!({"event": "ok"})
        }
        Op::ReadyAll => {
            sim.readiness().set_all(true);
            json!({"event": "ok"})
        }
        Op::Stats => json!({"event": "stats", "pulls_received": sim.pulls_received(),
                             "bootstrap_queries": sim.bootstrap().query_count()}),
        Op::Faults { tp, pp, .. } | Op::Crash { tp, pp } | Op::Restart { tp, pp }
            if !in_range(sim, tp, pp) =>
        {
            json!({"event": "error", "error": format!("no worker tp={tp} pp={pp}")})
        }
        Op::Faults { tp, pp, faults } => {
            sim.set_faults(tp, pp, faults);
            json!({"event": "ok"})
        }
        Op::Crash { tp, pp } => {
            sim.crash_worker(tp, pp).await;
            json!({"event": "ok"})
        }
        Op::Restart { tp, pp } => match sim.restart_worker(tp, pp).await {
            Ok(()) => json!({"event": "ok"}),
            Err(e) => json!({"event": "error", "error": e.to_string()}),
        },
    };
    Some(reply)
}
