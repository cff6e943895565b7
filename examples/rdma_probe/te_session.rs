//! The real Mooncake TE wheel as P's transfer engine: `tests/py/te_session.py` in a child
//! process, one TE for the whole probe (so a write after D's fence goes out on P's existing
//! endpoint, as Mooncake's retry does), one JSON line per batch of writes.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// One write: `len` bytes of `pattern(seed, len)` at D's address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    pub addr: u64,
    pub len: u64,
    pub seed: u8,
    /// Where it lands in the (single) layout region, for checking the host's bytes.
    pub region_offset: u64,
}

/// `te_writer.py`'s payload formula: byte `i` of a write with `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (u64::from(seed) * 31 + (i % 251) as u64 + (i / 251) as u64) as u8)
        .collect()
}

/// The running TE.
pub struct TeSession {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl TeSession {
    /// Start `python script protocol device`, TE log to `log`, and wait for it to be ready.
    pub async fn start(
        python: &str,
        script: &str,
        protocol: &str,
        device: &str,
        log: std::fs::File,
    ) -> Result<TeSession, String> {
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .arg(protocol)
            .arg(device)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        // P's transfer timeout bounds the repost after the fence (Mooncake retries a slice
        // and re-handshakes within it).
        if std::env::var_os("MC_TRANSFER_TIMEOUT").is_none() {
            cmd.env("MC_TRANSFER_TIMEOUT", "30");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {python} {script}: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut s = TeSession {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        };
        let first = s.answer(Duration::from_secs(90)).await?;
        match first.get("ready") {
            Some(Value::Bool(true)) => Ok(s),
            _ => Err(format!("TE session: {first}")),
        }
    }

    async fn answer(&mut self, timeout: Duration) -> Result<Value, String> {
        let line = tokio::time::timeout(timeout, self.lines.next_line())
            .await
            .map_err(|_| format!("TE session: no answer within {timeout:?}"))?
            .map_err(|e| e.to_string())?
            .ok_or("TE session exited (see its log)")?;
        serde_json::from_str(&line).map_err(|e| format!("TE session said {line:?}: {e}"))
    }

    /// One `batch_transfer_sync_write` to segment `target`: its return code and duration.
    pub async fn write(&mut self, target: &str, writes: &[Write]) -> Result<(i64, f64), String> {
        let cmd = json!({
            "op": "write",
            "target": target,
            "writes": writes.iter().map(|w| json!({"addr": w.addr, "len": w.len, "seed": w.seed})).collect::<Vec<_>>(),
        });
        let mut line = cmd.to_string();
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| format!("TE session stdin: {e}"))?;
        let a = self.answer(Duration::from_secs(120)).await?;
        match (
            a.get("rc").and_then(Value::as_i64),
            a.get("seconds").and_then(Value::as_f64),
        ) {
            (Some(rc), Some(s)) => Ok((rc, s)),
            _ => Err(format!("TE session: {a}")),
        }
    }

    /// Close its input and wait for it (killed after 10 s).
    pub async fn stop(mut self) {
        drop(self.stdin);
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}
