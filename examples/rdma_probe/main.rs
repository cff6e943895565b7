//! The RDMA probe of `scripts/device-check` (docs/HARDWARE.md): kvrecv's RDMA target embedded
//! with the host's own memory, the real Mooncake TE wheel as P's transfer engine, every landed
//! byte read in host memory, then the fence under Mooncake's retry. Prints one
//! `PASS|FAIL|SKIPPED <check> <detail>` line per check; exits 1 if any failed.
//!
//! ```text
//! rdma_probe --python PY --te-script tests/py/te_session.py --device DEV --te-log FILE
//!            [--protocol rdma|tcp] [--plan]
//! ```
//!
//! `--protocol tcp` rehearses the same steps over kvrecv's TCP target (checks named
//! `rehearsal.tcp.*`): the dry run runs it where the TE wheel is installed. `--plan` prints the
//! checks and exits. Built with `--features rdma` (links libibverbs).

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[path = "../device_probe/loads.rs"]
mod loads;
#[path = "../device_probe/report.rs"]
mod report;

mod fence_checks;
mod session_writer;
mod te_session;

use std::process::ExitCode;

fn parse(args: &[String]) -> Result<(fence_checks::Opts, bool), String> {
    let mut o = fence_checks::Opts {
        protocol: "rdma".into(),
        device: String::new(),
        python: "python3".into(),
        te_script: "tests/py/te_session.py".into(),
        te_log: "te-session.log".into(),
    };
    let mut plan = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--protocol" => o.protocol = value()?,
            "--device" => o.device = value()?,
            "--python" => o.python = value()?,
            "--te-script" => o.te_script = value()?,
            "--te-log" => o.te_log = value()?,
            "--plan" => plan = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.protocol != "rdma" && o.protocol != "tcp" {
        return Err(format!("--protocol {}: rdma or tcp", o.protocol));
    }
    Ok((o, plan))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (o, plan) = match parse(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("rdma_probe: {e}");
            eprintln!(
                "usage: rdma_probe --python PY --te-script PATH --device DEV --te-log FILE \
                 [--protocol rdma|tcp] [--plan]"
            );
            return ExitCode::from(2);
        }
    };
    if plan {
        println!(
            "PLAN te {} {} {} {:?} (log {})",
            o.python, o.te_script, o.protocol, o.device, o.te_log
        );
        for c in fence_checks::CHECKS {
            println!("PLAN check {c}");
        }
        return ExitCode::SUCCESS;
    }
    let mut report = report::Report::default();
    fence_checks::run(&mut report, &o).await;
    if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
