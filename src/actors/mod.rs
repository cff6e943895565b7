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
//! Outside the crate (the advanced path) the actors, [`Coordinator`], the messages a host sends
//! ([`LoadKv`], [`LoadMetas`], [`Drain`], [`Abort`]) and the ports ([`PeerTransport`],
//! [`TopologySource`], [`Landing`], with what they take and give) can be named. The messages the
//! actors send each other are reachable through the actors' `Handler` impls but opaque: each
//! carries `#[allow(unnameable_types)]`, and a host never builds one.
//!
//! Each shell is thin: the Receiver's admission, grouping, pull planning and rediscovery
//! decisions are `receiver_state`'s effects; the Peer keeps its bookkeeping in `peer_state`;
//! the RequestAggregator its per-request machine in `aggregator_state`; the BlockManager's
//! ledger (`block_ledger`) decides holds and releases, and `revoke_release` orders revoke,
//! quiesce and release (the actor only waits for a quiesce its landing asks for).

#![forbid(unsafe_code)]

internal_mod!(aggregation_table);
internal_mod!(aggregator);
internal_mod!(aggregator_state);
internal_mod!(alarm);
internal_mod!(batch_plan);
internal_mod!(block_ledger);
internal_mod!(block_manager);
internal_mod!(block_pool);
internal_mod!(event_sink);
internal_mod!(layout_acks);
internal_mod!(live_set);
internal_mod!(outbox);
internal_mod!(pause_watch);
internal_mod!(peer);
internal_mod!(peer_state);
internal_mod!(pending_set);
internal_mod!(pull_encoder);
internal_mod!(pull_mux);
internal_mod!(receiver);
internal_mod!(receiver_state);
internal_mod!(rediscovery);
internal_mod!(revoke_release);
#[cfg(any(test, feature = "testing"))]
internal_mod!(scripted_transport);
internal_mod!(shared);
internal_mod!(system);
internal_mod!(topology);
internal_mod!(transport);

// The advanced path (a host that runs actix itself): the actors, what they are made of, and the
// messages they take and give.
pub use crate::control::{HttpTopology, ZmqTransport};
pub use crate::messages::{Abort, Drain, LoadKv, LoadMetas};
pub use crate::rdma::{Landing, TcpLanding, TcpTarget};
// What a `Landing` takes and gives.
pub use crate::rdma::{
    FenceError, NoWindow, NoWindowReason, PullWindow, Revocation, RevokeRequest, Revoked,
};
pub use aggregator::RequestAggregator;
pub use block_manager::BlockManager;
pub use event_sink::EventSink;
pub use peer::{Peer, PeerConfig};
pub use receiver::Receiver;
#[cfg(any(test, feature = "testing"))]
pub use scripted_transport::{OpenedPull, ScriptedTransport};
pub use system::{Coordinator, CoordinatorParts};
pub use topology::{EngineTopology, TopologyError, TopologySource};
pub use transport::{CleanFinish, Frames, PeerTransport, ReplyStream, TransportError};
// What this crate's tests and benches name through `kvrecv::actors` (not the interface).
#[cfg(feature = "testing")]
pub use topology::{DRank, StaticTopology};
