#![warn(unnameable_types)]
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
//! kvrecv: the decode-side (D) receive coordinator for prefill/decode-disaggregated LLM serving.
//!
//! Prefill peers push KV-cache blocks into D's destination blocks. kvrecv asks every peer for its
//! share, tracks what each peer still owes, reports a failure at once, and releases destination
//! blocks only when no peer can still write into them (see `DESIGN.md`).
//!
//! A host starts one worker from vLLM's `--kv-transfer-config` (or a [`KvRecvConfig`]), hands
//! it the KV memory, loads requests as its scheduler admits them and takes what finished once
//! per step (the README's "Embedding" has a whole host):
//!
//! ```no_run
//! # async fn host(config_json: &str, requests: Vec<kvrecv::KvRequest>) -> Result<(), Box<dyn std::error::Error>> {
//! use kvrecv::{HostMemory, KvEvent, KvRecvBuilder, Outcome};
//!
//! let memory = HostMemory::owned(vec![vec![0u8; 16 * 4096]; 2])?; // one buffer per layer
//! let kv = KvRecvBuilder::from_kv_transfer_config(config_json)? // its layout: 2 x 16 x 4 KiB
//!     .host_memory(memory)
//!     .completion_events()
//!     .start()?;
//! let mut events = kv.events()?;
//! let reply = kv.load_kv(requests).await?; // refused ones are in reply.rejected
//! # let _ = reply;
//! // A completion says why a request failed (its blocks still come back through drain).
//! if let Some(KvEvent::Completion { req_id, outcome: Outcome::Failed { cause, reason, .. }, .. }) =
//!     events.recv().await
//! {
//!     eprintln!("{req_id}: {cause:?}: {reason}"); // recompute it
//! }
//! let step = kv.drain().await?; // each scheduler step: finished_recving, invalid_block_ids
//! # let _ = step;
//! kv.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Data flows one way: [`actors::Receiver`] -> [`actors::Peer`] -> [`actors::RequestAggregator`]
//! -> [`actors::BlockManager`].
//!
//! The public interface is: the builder ([`KvRecvBuilder`]) and what it takes (configuration:
//! [`KvRecvConfig`] and its parts; [`KvLayout`]; destination memory: [`HostMemory`],
//! [`DeviceMemory`] and their regions; data-plane, bootstrap, ZMQ and RDMA settings), the
//! handle ([`KvRecv`]) with its requests ([`KvRequest`]), replies ([`LoadKvReply`],
//! [`StepOutput`], [`AbortReply`], [`PauseReport`], [`Stats`]) and events ([`KvEvent`]),
//! reading landed blocks back ([`KvRecv::read_block`], [`HostMemory::take_back`], [`Stamp`],
//! [`owner_tag`]), the errors and what they carry ([`Cause`], ...), and, for hosts that run
//! actix themselves, the advanced actor path ([`actors`]: the actors, the messages a host sends
//! them, and the ports they are built on). Everything else is private, and every type a public
//! item reaches can be named (`unnameable_types` is warned, so CI's clippy denies it), but for
//! the actors' messages to each other, which are opaque (see [`actors`]). (The `cli` feature adds
//! the binary's entry point, `cli::main`; the `testing` feature opens the internals to this
//! crate's own tests and benches and is not part of the interface.)
//!
//! Hosts that run actix themselves wire the actors directly ([`actors::Coordinator::start`]);
//! [`KvRecv::from_parts`] puts such custom parts behind the same handle.

/// Declares an internal module: private, or public under the `testing` feature (this crate's
/// integration tests, benches and examples reach internals through it; its items are then
/// exempt from `missing_docs`, not being the public interface).
macro_rules! internal_mod {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        #[cfg(feature = "testing")]
        #[allow(missing_docs)]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "testing"))]
        pub(crate) mod $name;
    };
}

pub mod actors;
internal_mod!(block_ownership);
internal_mod!(block_read);
#[cfg(feature = "cli")]
pub mod cli;
internal_mod!(config);
internal_mod!(control);
internal_mod!(embed);
pub(crate) mod fast_hash;
internal_mod!(layout);
internal_mod!(messages);
#[cfg(feature = "cli")]
internal_mod!(metrics_endpoint);
pub(crate) mod millis;
internal_mod!(rdma);
#[cfg(feature = "cli")]
internal_mod!(repro);
// The simulator's API is shaped for this crate's tests (faults, crashes, restarts); `kvrecv
// prefill-sim` uses a part of it.
#[cfg(feature = "sim")]
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code, unused_imports))]
    sim
);
internal_mod!(telemetry);

pub use block_ownership::owner_tag;
pub use block_read::BlockReadError;
pub use config::{ConfigError, DRank, KvRecvConfig, LoadFailurePolicy, MooncakeProtocol, Policy};
pub use control::{BootstrapConfig, ControlCpu, ZmqTransportConfig};
pub use embed::{
    DataPlaneStats, EventStream, KvRecv, KvRecvBuilder, KvRecvError, LoadTicket, PauseError,
    ResumeMemory, StartError, Stats,
};
pub use layout::{KvLayout, Region};
pub use messages::batch::MAX_ID_BYTES;
pub use messages::{
    AbandonedRequest, AbortReply, BatchError, KvEvent, KvRequest, LedgerStats, LoadKvReply,
    Outcome, PauseReport, PeerId, PullId, ReqId, SettleOutcome, StepOutput,
};
pub use rdma::audit::Stamp;
pub use rdma::memory::{
    DeviceMemory, DeviceRegion, HostMemory, HostRegion, MemoryError, MemoryKind,
};
pub use rdma::memory_fit::MemoryFitError;
pub use rdma::tcp::target::TargetError;
#[cfg(feature = "rdma")]
pub use rdma::verbs::RdmaDeviceConfig;
pub use rdma::verbs::{PeerBinding, RdmaHandshakeConfig, RdmaMtu};
pub use rdma::verbs::{RdmaTargetError, VerbsError};
// What the errors and outcomes above carry, so that a host can match on them.
pub use messages::settle::Cause;
pub use rdma::tcp::windows::WindowError;
pub use rdma::verbs::backend::{QpId, SkippedDevice};
pub use rdma::verbs::descriptor::DescriptorError;
pub use rdma::verbs::gpudirect::GpuDirectError;
pub use rdma::verbs::rdma_landing::RdmaLandingError;
pub use rdma::verbs::window_registrations::WindowRegisterError;
pub use rdma::{LandingPauseError, TargetConfig, NO_CLEAN_WINDOW};

/// The README's Rust snippets are compiled (and the embedding one type-checked) as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
