//! Every message that crosses a boundary: control-plane wire structs (msgpack, msgspec-compatible),
//! bootstrap JSON, and the actix messages between actors. Plain data, no I/O.

#![forbid(unsafe_code)]

internal_mod!(abort);
internal_mod!(batch);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    bootstrap
);
internal_mod!(completion);
internal_mod!(drain);
internal_mod!(event);
internal_mod!(handshake);
internal_mod!(handshake_desc);
internal_mod!(ids);
internal_mod!(layout_id);
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    msgpack_strict
);
internal_mod!(pause);
internal_mod!(peer_text);
internal_mod!(pool);
internal_mod!(block_ids);
internal_mod!(request_tail);
internal_mod!(pull);
internal_mod!(pull_requests);
mod reply_reader;
internal_mod!(retire);
internal_mod!(settle);
internal_mod!(shared_str);
internal_mod!(tick);
// P's side of the wire (what the simulator and the tests encode, the serde reference decoders
// the strict ones are checked against) lives with D's side.
internal_mod!(
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    wire
);

pub use abort::{Abort, AbortAtPeer, AbortReply, ABORTED_BY_HOST};
#[cfg(feature = "cli")]
pub use batch::KvRequestRef;
pub use batch::{
    BatchError, Interner, KvRequest, LoadKv, LoadKvReply, LoadKvTo, LoadMetas,
    Queued, RequestMeta, SharedRequest,
};
pub use block_ids::BlockGroups;
pub use completion::{Completion, CompletionList, Completions, FirstFailure, Outcome};
pub use drain::{Drain, StepOutput};
pub use event::KvEvent;
pub use ids::{PeerId, PullId, ReqId};
pub use layout_id::LayoutIds;
pub use pause::{AbandonedRequest, BeginPause, NewRegistration, PauseReport, PauseStarted};
pub use pool::{Allocate, Free, GetLedgerStats, LedgerStats, PoolError};
pub use pull::{EncodeWithLayout, Pull, PullLayout, UnsentPull};
pub use pull_requests::{PullRequest, PullRequests};
pub use retire::{CountPeers, PeerCount, Retire};
pub use shared_str::SharedStr;
pub use settle::{Cause, Settle, SettleList, SettleOutcome, Settles};
pub use wire::{MetadataRef, MetadataTail, ReqBlock, ReqBlocksRef, WireError, XferReplyRef, XferStatus};
#[cfg(feature = "testing")]
pub use wire::IdList;
#[cfg(any(feature = "sim", feature = "testing"))]
pub use wire::{MooncakeXferMetadata, MooncakeXferResponse};
