//! Subcommands of the `kvrecv` binary, one module each; `main.rs` only dispatches.

pub mod allocator;
pub mod bench;
pub mod event_line;
pub mod line_reader;
pub mod logging;
pub mod prefill_sim;
pub mod repro;
pub mod serve;
pub mod serve_output;
pub mod serve_target;
