//! Every message that crosses a boundary: control-plane wire structs (msgpack, msgspec-compatible),
//! bootstrap JSON, and the actix messages between actors. Plain data, no I/O.

#![forbid(unsafe_code)]

pub mod abort;
pub mod batch;
#[doc(hidden)]
pub mod bootstrap;
pub mod completion;
pub mod drain;
pub mod event;
#[doc(hidden)]
pub mod handshake;
pub mod handshake_desc;
pub mod ids;
pub mod layout_id;
#[doc(hidden)]
pub mod msgpack_strict;
pub mod pause;
pub mod peer_text;
#[doc(hidden)]
pub mod pool;
pub mod pull;
mod reply_reader;
pub mod retire;
pub mod settle;
#[doc(hidden)]
pub mod tick;
#[doc(hidden)]
pub mod wire;

pub use abort::{Abort, AbortAtPeer, AbortReply, ABORTED_BY_HOST};
pub use batch::{
    BatchError, Interner, KvRequest, KvRequestRef, LoadKv, LoadKvReply, LoadKvTo, LoadMetas,
    Queued, RequestMeta, SharedRequest,
};
pub use completion::{Completion, CompletionList, Completions, FirstFailure, Outcome};
pub use drain::{Drain, StepOutput};
pub use event::KvEvent;
pub use ids::{PeerId, PullId, ReqId};
pub use layout_id::LayoutIds;
pub use pause::{AbandonedRequest, BeginPause, NewRegistration, PauseReport, PauseStarted};
pub use pool::{Allocate, Free, GetLedgerStats, LedgerStats, PoolError};
pub use pull::{EncodeWithLayout, Pull, PullLayout, PullRequest, PullRequests, UnsentPull};
pub use retire::{CountPeers, PeerCount, Retire};
pub use settle::{Cause, Settle, SettleList, SettleOutcome, Settles};
pub use wire::{
    IdList, MetadataRef, MetadataTail, MooncakeXferMetadata, MooncakeXferResponse, ReqBlock,
    ReqBlocksRef, WireError, XferReplyRef, XferStatus,
};
