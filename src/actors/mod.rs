//! The receive coordinator's actors (DESIGN.md §3) and the plain structs that hold their logic.
//!
//! Files here are of three kinds, and the name says which:
//! - **Actor shells**, named for their role: `receiver`, `peer`, `aggregator`, `block_manager`
//!   (the four actors) and `system` (their wiring). Only these use actix; they own the I/O:
//!   mailboxes, the Peer's channels and streams, timers, the calls into the landing (open,
//!   revoke, quiesce, fence) and sending effects on.
//! - **Sans-IO cores**: `<role>_state` for an actor's state machine (`receiver_state`,
//!   `peer_state`, `aggregator_state`), `block_ledger` and `revoke_release` for the
//!   BlockManager's, and the plain structs they and the shells use (`aggregation_table`,
//!   `batch_plan`, `block_pool`, `layout_acks`, `live_set`, `outbox`, `pending_set`,
//!   `pull_encoder`, `rediscovery`, `shared`, `topology`). No actix, no socket; time is passed
//!   in. Tested directly, and the admission, settle, release, permit and epoch cores are driven
//!   by the model check (`tests/model_check.rs`).
//! - **Ports and helpers of the shells**: `transport` (the Peer's channel trait), `pull_mux`
//!   (its reply streams merged), `alarm` (a timer task), `pause_watch`, `event_sink`, and the
//!   test double `scripted_transport`.
//!
//! Each shell is thin: the Receiver's admission, grouping, pull planning and rediscovery
//! decisions are `receiver_state`'s effects; the Peer keeps its bookkeeping in `peer_state`;
//! the RequestAggregator its per-request machine in `aggregator_state`; the BlockManager's
//! ledger (`block_ledger`) decides holds and releases, and `revoke_release` orders revoke,
//! quiesce and release (the actor only waits for a quiesce its landing asks for).

#![forbid(unsafe_code)]

#[doc(hidden)]
pub mod aggregation_table;
pub mod aggregator;
#[doc(hidden)]
pub mod aggregator_state;
#[doc(hidden)]
pub mod alarm;
#[doc(hidden)]
pub mod batch_plan;
#[doc(hidden)]
pub mod block_ledger;
pub mod block_manager;
#[doc(hidden)]
pub mod block_pool;
pub mod event_sink;
pub mod layout_acks;
#[doc(hidden)]
pub mod live_set;
#[doc(hidden)]
pub mod outbox;
#[doc(hidden)]
pub mod pause_watch;
pub mod peer;
#[doc(hidden)]
pub mod peer_state;
#[doc(hidden)]
pub mod pending_set;
#[doc(hidden)]
pub mod pull_encoder;
pub mod pull_mux;
pub mod receiver;
#[doc(hidden)]
pub mod receiver_state;
#[doc(hidden)]
pub mod rediscovery;
#[doc(hidden)]
pub mod revoke_release;
#[doc(hidden)]
#[cfg(any(test, feature = "testing"))]
pub mod scripted_transport;
#[doc(hidden)]
pub mod shared;
pub mod system;
pub mod topology;
pub mod transport;

pub use aggregator::RequestAggregator;
pub use block_manager::BlockManager;
pub use event_sink::EventSink;
pub use peer::{Peer, PeerConfig};
pub use receiver::Receiver;
#[cfg(any(test, feature = "testing"))]
pub use scripted_transport::{OpenedPull, ScriptedTransport};
pub use system::{Coordinator, CoordinatorParts};
pub use topology::{DRank, EngineTopology, StaticTopology, TopologyError, TopologySource};
pub use transport::{CleanFinish, Frames, PeerTransport, ReplyStream, TransportError};
