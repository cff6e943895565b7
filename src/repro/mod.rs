//! `kvrecv repro`: replays a real trace through real actors, ZMQ and the TCP data plane with
//! injected peer faults, and shows the write-after-free under `naive` and its absence under
//! `settle`.

pub mod bench;
pub mod counting_writer;
pub mod error;
pub mod flood;
pub mod report;
pub mod run;
pub mod scenario;
pub mod trace;

pub use error::ReproError;
pub use report::{Report, VariantReport};
pub use run::{run, run_blocking};
pub use scenario::{Scenario, Soak, Variant};
