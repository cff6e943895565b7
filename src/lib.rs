#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
//! kvrecv: the decode-side (D) receive coordinator for prefill/decode-disaggregated LLM serving.
//!
//! Prefill peers push KV-cache blocks into D's destination blocks. kvrecv asks every peer for its
//! share, tracks what each peer still owes, reports a failure at once, and releases destination
//! blocks only when no peer can still write into them (see `DESIGN.md`).
//!
//! Data flows one way: [`actors::Receiver`] -> [`actors::Peer`] -> [`actors::RequestAggregator`]
//! -> [`actors::BlockManager`].
//!
//! The front door for a host (a Rust inference server on its own tokio runtime) is
//! [`KvRecvBuilder`] -> [`KvRecv`]; the items a host needs are re-exported here. The actor
//! modules are the advanced path for hosts that run actix themselves.

pub mod actors;
pub mod block_ownership;
pub mod block_read;
pub mod config;
pub mod control;
pub mod embed;
pub(crate) mod fast_hash;
pub mod layout;
pub mod messages;
#[cfg(feature = "cli")]
pub mod metrics_endpoint;
pub(crate) mod millis;
pub mod rdma;
#[doc(hidden)]
#[cfg(feature = "cli")]
pub mod repro;
#[doc(hidden)]
#[cfg(feature = "sim")]
pub mod sim;
pub mod telemetry;

pub use block_read::BlockReadError;
pub use config::{ConfigError, KvRecvConfig, LoadFailurePolicy, Policy};
pub use embed::{
    DataPlaneStats, EventStream, KvRecv, KvRecvBuilder, KvRecvError, LoadTicket, PauseError,
    ResumeMemory, StartError, Stats,
};
pub use layout::{KvLayout, Region};
pub use messages::batch::MAX_ID_BYTES;
pub use messages::{
    AbandonedRequest, AbortReply, BatchError, KvEvent, KvRequest, LoadKvReply, PauseReport, ReqId,
    StepOutput,
};
pub use rdma::memory::{DeviceMemory, DeviceRegion, HostMemory, HostRegion, MemoryError};

/// The README's Rust snippets are compiled (and the embedding one type-checked) as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
