//! The P side of the GPU checks: a real `kvrecv prefill-sim --write` process (P TP2 writing
//! every block through the Mooncake TE protocol over kvrecv's TCP data plane), or, where the
//! carried `kvrecv` binary cannot start here, the same simulator in a child of this probe.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{PrefillSim, SimConfig};

/// A running P process.
pub struct Prefill {
    child: Child,
    pub bootstrap: String,
    pub engine_id: String,
}

impl Prefill {
    /// Start `program args..` and read its `ready` line.
    pub async fn spawn(program: &str, args: &[String]) -> Result<Prefill, String> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {program}: {e}"))?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(out).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .map_err(|_| format!("{program}: no ready line within 30 s"))?
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{program} exited before its ready line"))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("ready line {line:?}: {e}"))?;
        let field = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_str())
                .map(str::to_owned)
                .ok_or_else(|| format!("ready line without {k}: {line}"))
        };
        Ok(Prefill {
            bootstrap: field("bootstrap")?,
            engine_id: field("engine_id")?,
            child,
        })
    }

    /// The process id (its CPU clock is read from /proc).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Ask it to stop and wait (killed if it does not within 10 s).
    pub async fn stop(mut self) {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = stdin.write_all(b"{\"op\":\"shutdown\"}\n").await;
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// `device_probe p-sim --tp N`: what `kvrecv prefill-sim --write --bootstrap-port 0` does, for
/// a machine where the carried binary cannot run. Prints the same `ready` line, then runs until
/// stdin closes or says anything.
pub async fn serve_in_this_process(tp: u32) -> Result<(), String> {
    let cfg = SimConfig {
        engine_id: "device-check-p".into(),
        tp_size: tp,
        ..SimConfig::default()
    };
    let writer = TeWriter::new(InitiatorConfig::default());
    let sim = PrefillSim::start_with_writer(cfg, std::sync::Arc::new(writer))
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::json!({"event": "ready", "engine_id": sim.engine_id(), "bootstrap": sim.bootstrap_url()})
    );
    let mut line = String::new();
    let _ = BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await;
    drop(sim);
    Ok(())
}
