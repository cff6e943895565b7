//! The GPU probe of `scripts/device-check` (docs/HARDWARE.md). Prints one
//! `PASS|FAIL|SKIPPED <check> <detail>` line per check on stdout; exits 1 if any failed.
//!
//! ```text
//! device_probe gpu [--kvrecv-bin PATH | --p-self] [--ordinal N] [--layers N] [--block-kib N]
//!                  [--blocks N] [--blocks-per-req N] [--busy-ms N] [--plan | --fake-device]
//! device_probe p-sim [--tp N]     # the P of --p-self (kvrecv prefill-sim --write, in-process)
//! ```
//!
//! `--plan` prints the checks and the P command it would run, touching no GPU; `--fake-device`
//! runs the first check's pipeline into kvrecv's fake device (both for the dry run).
//! Built with `--features cuda` (dynamic loading: it compiles and plans without CUDA).

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod cuda;
mod expected;
mod gpu_checks;
mod loads;
mod prefill;
mod rehearsal;
mod report;
mod serve_check;

use std::process::ExitCode;
use std::time::Duration;

use gpu_checks::GpuOpts;
use report::Report;

fn usage(why: &str) -> ExitCode {
    eprintln!("device_probe: {why}");
    eprintln!(
        "usage: device_probe gpu [--kvrecv-bin PATH | --p-self] [--ordinal N] [--layers N] \
         [--block-kib N] [--blocks N] [--blocks-per-req N] [--busy-ms N] [--plan | --fake-device]\n       \
         device_probe p-sim [--tp N]"
    );
    ExitCode::from(2)
}

/// Parsed `gpu` arguments.
struct GpuArgs {
    opts: GpuOpts,
    /// P's program and arguments.
    p: (String, Vec<String>),
    plan: bool,
    /// Rehearse on kvrecv's fake device instead of a GPU.
    fake_device: bool,
    /// The kvrecv binary (`--kvrecv-bin`): `gpu.serve_cuda` runs its `serve --gpu`.
    serve_bin: Option<String>,
}

fn parse_gpu(args: &[String]) -> Result<GpuArgs, String> {
    let mut opts = GpuOpts {
        ordinal: 0,
        layers: 4,
        block_len: 1 << 20,
        blocks: 256,
        blocks_per_req: 8,
        busy: Duration::from_secs(3),
    };
    let mut kvrecv_bin: Option<String> = None;
    let mut p_self = false;
    let mut plan = false;
    let mut fake_device = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse::<u64>().map_err(|e| format!("{name} {v}: {e}"))
        };
        match a.as_str() {
            "--kvrecv-bin" => {
                kvrecv_bin = Some(it.next().ok_or("--kvrecv-bin needs a path")?.clone())
            }
            "--p-self" => p_self = true,
            "--plan" => plan = true,
            "--fake-device" => fake_device = true,
            "--ordinal" => opts.ordinal = value(a)? as i32,
            "--layers" => opts.layers = value(a)? as u32,
            "--block-kib" => opts.block_len = value(a)? * 1024,
            "--blocks" => opts.blocks = value(a)? as u32,
            "--blocks-per-req" => opts.blocks_per_req = value(a)? as u32,
            "--busy-ms" => opts.busy = Duration::from_millis(value(a)?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if opts.layers == 0 || opts.blocks_per_req == 0 || opts.blocks < opts.blocks_per_req {
        return Err("need layers >= 1 and blocks >= blocks-per-req >= 1".into());
    }
    if opts.block_len == 0 || opts.block_len % (2 * gpu_checks::P_TP) != 0 {
        return Err("--block-kib must split into P TP2's two head slices".into());
    }
    let p_args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let serve_bin = kvrecv_bin.clone();
    let p = match (kvrecv_bin, p_self) {
        (Some(_), true) => return Err("--kvrecv-bin and --p-self exclude each other".into()),
        (Some(bin), false) => (
            bin,
            p_args(&[
                "prefill-sim",
                "--write",
                "--tp",
                "2",
                "--bootstrap-port",
                "0",
                "--engine-id",
                "device-check-p",
                "--log-level",
                "warn",
            ]),
        ),
        (None, true) => (
            std::env::current_exe()
                .map_err(|e| e.to_string())?
                .to_string_lossy()
                .into_owned(),
            p_args(&["p-sim", "--tp", "2"]),
        ),
        (None, false) => return Err("give --kvrecv-bin PATH or --p-self".into()),
    };
    Ok(GpuArgs {
        opts,
        p,
        plan,
        fake_device,
        serve_bin,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("gpu") => {}
        Some("p-sim") => {
            let tp = match args.get(1..) {
                Some([flag, n]) if flag == "--tp" => n.parse().unwrap_or(0),
                Some([]) => 2,
                _ => 0,
            };
            if tp == 0 {
                return usage("p-sim takes only --tp N (N >= 1)");
            }
            return match prefill::serve_in_this_process(tp).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("device_probe p-sim: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => return usage("first argument: gpu or p-sim"),
    }
    let a = match parse_gpu(&args[1..]) {
        Ok(a) => a,
        Err(e) => return usage(&e),
    };
    let mut report = Report::default();
    if a.plan {
        println!(
            "PLAN p {} {} ({} GiB on GPU {}: {} layers x {} blocks x {} KiB, {} blocks per request, busy kernel {} ms)",
            a.p.0,
            a.p.1.join(" "),
            a.opts.total_bytes() as f64 / f64::from(1u32 << 30),
            a.opts.ordinal,
            a.opts.layers,
            a.opts.blocks,
            a.opts.block_len / 1024,
            a.opts.blocks_per_req,
            a.opts.busy.as_millis()
        );
        for c in gpu_checks::CHECKS.iter().chain([&serve_check::CHECK]) {
            println!("PLAN check {c}");
        }
        return ExitCode::SUCCESS;
    }
    if a.fake_device {
        return match prefill::Prefill::spawn(&a.p.0, &a.p.1).await {
            Ok(p) => {
                rehearsal::run(&mut report, &a.opts, &p).await;
                if let Some(bin) = &a.serve_bin {
                    serve_check::rehearse(&mut report, &a.opts, &p, bin).await;
                }
                p.stop().await;
                if report.failed() {
                    ExitCode::FAILURE
                } else {
                    ExitCode::SUCCESS
                }
            }
            Err(e) => {
                report.fail(rehearsal::CHECK, format!("P did not start: {e}"));
                ExitCode::FAILURE
            }
        };
    }
    match cuda::init() {
        Ok(gpu) => eprintln!("device_probe: {gpu}"),
        Err(e) => {
            for c in gpu_checks::CHECKS.iter().chain([&serve_check::CHECK]) {
                report.skip(c, format!("no usable GPU: {e}"));
            }
            return ExitCode::SUCCESS;
        }
    }
    let p = match prefill::Prefill::spawn(&a.p.0, &a.p.1).await {
        Ok(p) => p,
        Err(e) => {
            for c in gpu_checks::CHECKS.iter().chain([&serve_check::CHECK]) {
                report.fail(c, format!("P did not start: {e}"));
            }
            return ExitCode::FAILURE;
        }
    };
    gpu_checks::run(&mut report, &a.opts, &p).await;
    match &a.serve_bin {
        Some(bin) => serve_check::run(&mut report, &a.opts, &p, bin).await,
        None => report.skip(
            serve_check::CHECK,
            "needs --kvrecv-bin (the kvrecv whose serve --gpu it runs)",
        ),
    }
    p.stop().await;
    if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
