//! Tracing to stderr (stdout carries the JSON-lines protocol).

#![forbid(unsafe_code)]

use tracing_subscriber::EnvFilter;

/// `RUST_LOG` wins; otherwise `level` (e.g. `info`, `kvrecv=debug`).
pub fn init(level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
