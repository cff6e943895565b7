//! The receive coordinator's actors (DESIGN.md §3). The logic lives in plain structs the actors
//! own (`*_state` — `receiver_state` and `peer_state` return effects the actor performs —,
//! `block_ledger` with `revoke_release`, `block_pool`, `topology`), tested directly and driven
//! by the model check.

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
