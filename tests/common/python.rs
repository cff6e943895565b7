//! Finding the test venv's Python (created by `.ci/run`).

use std::io::Write;
use std::path::PathBuf;

/// `$KVRECV_PYTHON`, else `.venv/bin/python` in the crate root. `None` when absent, so a bare
/// `cargo test` without the venv still runs everything else; the test that asked then returns
/// early, and says so with a `SKIPPED:` line on the process's stderr, which the test harness
/// does not capture (a plain `eprintln!` would be shown only for a failing test). Where a skip
/// would hide a check that must run (`KVRECV_REQUIRE_PYTHON`, set by `.ci/run`, or `CI=true`
/// as CI services set it), a missing venv fails the test instead.
pub fn python() -> Option<PathBuf> {
    let p = std::env::var_os("KVRECV_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"));
    if p.exists() {
        return Some(p);
    }
    let why = format!(
        "no Python venv at {} (run .ci/run or set KVRECV_PYTHON)",
        p.display()
    );
    if let Some(var) = required_by() {
        panic!("{var} is set but {why}");
    }
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED: {test}: {why}");
    None
}

/// The variable that makes a missing venv a failure, if one is set.
fn required_by() -> Option<&'static str> {
    if std::env::var_os("KVRECV_REQUIRE_PYTHON").is_some() {
        return Some("KVRECV_REQUIRE_PYTHON");
    }
    let ci = std::env::var("CI").unwrap_or_default();
    matches!(ci.to_ascii_lowercase().as_str(), "true" | "1").then_some("CI")
}
