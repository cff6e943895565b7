//! `kvrecv repro`: replays a real trace through real actors, ZMQ and the TCP data plane with
//! injected peer faults, and shows the write-after-free under `naive` and its absence under
//! `settle`.

internal_mod!(bench);
internal_mod!(counting_writer);
internal_mod!(error);
internal_mod!(flood);
internal_mod!(report);
internal_mod!(run);
internal_mod!(scenario);
internal_mod!(trace);

#[cfg(feature = "testing")]
pub use error::ReproError;
#[cfg(feature = "testing")]
pub use report::{Report, VariantReport};
#[cfg(feature = "testing")]
pub use run::run;
pub use run::run_blocking;
pub use scenario::{Scenario, Soak, Variant};
