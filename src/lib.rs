//! kvrecv: the decode-side (D) receive coordinator for prefill/decode-disaggregated LLM serving.
//!
//! Prefill peers push KV-cache blocks into D's destination blocks. kvrecv asks every peer for its
//! share, tracks what each peer still owes, reports a failure at once, and releases destination
//! blocks only when no peer can still write into them (see `DESIGN.md`).
//!
//! Data flows one way: [`actors::Receiver`] -> [`actors::Peer`] -> [`actors::RequestAggregator`]
//! -> [`actors::BlockManager`].

pub mod actors;
pub mod config;
pub mod control;
pub mod embed;
pub mod layout;
pub mod messages;
pub mod metrics;
pub mod rdma;
pub mod repro;
pub mod sim;
