//! The coordinator core alone: requests through Receiver -> Peer (a transport that answers
//! FINISH ok at once) -> RequestAggregator -> BlockManager, for 1, 2 and 4 peers, batches of 1
//! and 64, events on (the host reads them: the batch's releases, then one drain).
//!
//! The transport does none of P's work inside the timing: each batch's FINISH is encoded before
//! the clock starts, and every peer's pull is answered with a copy of it (the owned frame a
//! socket would hand D). D still encodes every pull's metadata and decodes every reply.
//!
//! Two harnesses, one group each: `core_requests` builds every batch of a sample before the
//! clock starts and times the sample whole; `core_requests_fresh` builds each batch just before
//! it is loaded (as a host builds what it loads) and times each batch alone, its two clock
//! reads (~50 ns) included. Prebuilt, the coordinator reads a sample's requests from memory
//! long since cold and frees the host's allocations faster than glibc's per-thread cache takes
//! them back; fresh, neither.
//!
//! `cargo bench --bench core` ; per-request cost = time per batch / batch size. `LAYERS=N`
//! (default 2) sets the layout's layer count: every pull's metadata lists each layer.

include!("shared/coordinator.rs");
