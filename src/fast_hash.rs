//! Hash maps for the per-request paths.
//!
//! std's SipHash took 3–4% of the actors' thread in `perf record` of `kvrecv bench` (TP2,
//! batch 16, 64 in flight): every pull, settle and completion looks up a request id or pull id
//! several times. foldhash is several times faster on short keys and stays randomly seeded per
//! map, so request ids chosen by a host (or names echoed by a hostile peer, which are only
//! looked up, never inserted) cannot be picked to collide ahead of time. Speed only: std's
//! hasher costs 16.0% more instructions per request at batch 1 (`scripts/callgrind-core`;
//! DESIGN.md §10).

#![forbid(unsafe_code)]

/// A `HashMap` with foldhash's fast, randomly seeded hasher.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// A `HashSet` with foldhash's fast, randomly seeded hasher.
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
