//! Bootstrap server JSON (PROTOCOL.md §3): `POST /register` bodies and `GET /query` answers.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /register` body sent by each P worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterWorker {
    pub engine_id: String,
    pub dp_rank: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub addr: String,
}

/// One DP entry of `GET /query`. Unknown keys are ignored; `tp_size`/`pp_size` are used when a
/// branch of vLLM sends them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct DpEntry {
    pub engine_id: String,
    /// TP rank -> PP rank -> side-channel address. JSON keys are strings.
    pub worker_addr: BTreeMap<String, BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u32>,
}

/// `GET /query` answer: DP rank (string key) -> entry.
pub type QueryResponse = BTreeMap<String, DpEntry>;

/// Parse a `GET /query` body (untrusted: it comes off the network). Errors, never panics;
/// serde_json bounds nesting (128 levels) and allocates in proportion to the input.
pub fn parse_query(body: &[u8]) -> Result<QueryResponse, serde_json::Error> {
    serde_json::from_slice(body)
}
