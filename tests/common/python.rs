//! Finding the test venv's Python (created by `.ci/run`).

use std::path::PathBuf;

/// `$KVRECV_PYTHON`, else `.venv/bin/python` in the crate root. `None` (with a loud message)
/// when absent, so a bare `cargo test` without the venv still runs everything else.
pub fn python() -> Option<PathBuf> {
    let p = std::env::var_os("KVRECV_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"));
    if p.exists() {
        Some(p)
    } else {
        if std::env::var_os("KVRECV_REQUIRE_PYTHON").is_some() {
            panic!(
                "KVRECV_REQUIRE_PYTHON is set but {} does not exist",
                p.display()
            );
        }
        eprintln!(
            "SKIPPING: no Python venv at {} (run .ci/run or set KVRECV_PYTHON)",
            p.display()
        );
        None
    }
}
