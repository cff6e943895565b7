//! Receiver -> Peer: ask one prefill worker for its share of a batch.

#![forbid(unsafe_code)]

use actix::Message;

use super::ids::PullId;
use super::pull_requests::PullRequests;
use super::wire::WireError;
use std::sync::Arc;

/// A pull's layout id and whether the pull carries the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct PullLayout {
    /// 0: no id (layout ids off); the layout is then always carried.
    pub id: u64,
    /// Whether the metadata carries the layout (bases, block lengths, layer lists).
    pub carried: bool,
}

impl Default for PullLayout {
    /// No id, layout carried: a pull as vLLM 0.32 sends it.
    fn default() -> Self {
        PullLayout {
            id: 0,
            carried: true,
        }
    }
}

/// Encodes a pull that omitted its layout again, with it, for the same requests and window:
/// what D sends after P answered `LAYOUT_MISS`. Made by the Receiver (which holds the layout
/// and the window's bases); run by the Peer, rarely.
pub type EncodeWithLayout = Arc<dyn Fn(&PullRequests) -> Result<Vec<u8>, WireError> + Send + Sync>;

/// One `MooncakeXferMetadata` for one peer. The payload is already encoded: the Peer only
/// transports it and interprets the replies.
#[derive(Clone, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Pull {
    /// Unique per coordinator; matches replies and events to the pull.
    pub pull_id: PullId,
    /// The encoded `MooncakeXferMetadata` sent to P.
    pub payload: Vec<u8>,
    /// The requests it asks for.
    pub requests: PullRequests,
    /// When the Receiver handed it over (tokio's clock): its deadline and latency count from
    /// there (one clock read for the batch, not one more per pull).
    pub handed_at: tokio::time::Instant,
    /// The pull's layout id, and whether `payload` carries the layout.
    pub layout: PullLayout,
    /// For a pull that omitted its layout: its payload with the layout, made if P answers
    /// `LAYOUT_MISS` (`None` when the layout is carried).
    pub with_layout: Option<EncodeWithLayout>,
}

/// A pull whose metadata could not be encoded, so nothing was sent: the Peer settles each of
/// its requests Failed (nothing reached P, so nothing can be written), and every aggregator
/// still reaches zero.
#[derive(Clone, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct UnsentPull {
    /// The pull that was not sent.
    pub pull_id: PullId,
    /// Its requests (each settled Failed).
    pub requests: PullRequests,
    /// Why it could not be encoded.
    pub reason: String,
}

impl std::fmt::Debug for Pull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pull")
            .field("pull_id", &self.pull_id)
            .field("payload_len", &self.payload.len())
            .field("layout", &self.layout)
            .field(
                "requests",
                &self
                    .requests
                    .iter()
                    .map(|r| &*r.meta.req_id)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}
