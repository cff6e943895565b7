//! The receive coordinator's actors (DESIGN.md §3). Each actor is thin: the logic lives in a
//! plain struct it owns (`*_state`, `block_ledger`, `block_pool`, `topology`), tested directly.

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
internal_mod!(rediscovery);
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
pub use crate::rdma::{Landing, TcpTarget};
pub use aggregator::RequestAggregator;
pub use block_manager::BlockManager;
pub use event_sink::EventSink;
pub use peer::{Peer, PeerConfig};
pub use receiver::Receiver;
#[cfg(any(test, feature = "testing"))]
pub use scripted_transport::{OpenedPull, ScriptedTransport};
pub use system::{Coordinator, CoordinatorParts};
pub use topology::TopologySource;
pub use transport::PeerTransport;
// What this crate's tests and benches name through `kvrecv::actors` (not the interface).
#[cfg(feature = "testing")]
pub use topology::{DRank, EngineTopology, StaticTopology, TopologyError};
#[cfg(feature = "testing")]
pub use transport::{CleanFinish, Frames, ReplyStream, TransportError};
