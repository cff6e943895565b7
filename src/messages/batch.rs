//! What the host scheduler hands to `load_kv`: one batch of requests whose destination blocks
//! are allocated and must now be filled by the prefill peers.

use std::sync::Arc;

use actix::Message;
use serde::Deserialize;
use thiserror::Error;

use super::ids::ReqId;

/// One D request as the host scheduler knows it (vLLM: its `kv_transfer_params` plus the
/// destination block ids it allocated).
#[derive(Debug, Clone, Deserialize)]
pub struct KvRequest {
    /// D's own request id.
    pub req_id: String,
    /// `transfer_id` shared with the P request; P keys its state by it.
    #[serde(default)]
    pub transfer_id: Option<String>,
    /// `engine_id` of the P DP rank the router chose.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// `http://host:port` of P's bootstrap server.
    #[serde(default)]
    pub remote_bootstrap_addr: Option<String>,
    /// Logical destination block ids, one list per KV-cache group. Empty (or all groups empty)
    /// means nothing to receive: the pull is still sent so P frees its blocks, but it is not awaited.
    #[serde(default)]
    pub block_ids: Vec<Vec<u32>>,
}

/// A request of `load_kv` that cannot be pulled.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BatchError {
    #[error(
        "request {req_id}: missing `{field}` in kv_transfer_params; no pull can be started for it"
    )]
    MissingField { req_id: String, field: &'static str },
    #[error("request {req_id}: `{field}` is empty")]
    EmptyField { req_id: String, field: &'static str },
    #[error("request {req_id} appears twice in the batch")]
    Duplicate { req_id: String },
    #[error("request {req_id}: block id {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange {
        req_id: String,
        block: u32,
        num_blocks: u32,
    },
    #[error("request {req_id}: {groups} KV-cache groups, the layout has {expected}")]
    GroupCount {
        req_id: String,
        groups: usize,
        expected: usize,
    },
}

/// A validated request, shared (`Arc`) by every actor that needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    pub req_id: ReqId,
    pub transfer_id: String,
    pub engine_id: String,
    pub bootstrap_addr: String,
    pub block_ids: Vec<Vec<u32>>,
}

impl RequestMeta {
    /// Awaiting = the scheduler waits for a completion (there is at least one destination block).
    pub fn is_awaiting(&self) -> bool {
        self.block_ids.iter().any(|g| !g.is_empty())
    }

    /// All destination block ids, every group.
    pub fn all_blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.block_ids.iter().flatten().copied()
    }
}

impl KvRequest {
    /// Check the three keys vLLM needs (PROTOCOL.md §4); a missing one would leave the request
    /// waiting forever, so it is refused here instead.
    pub fn validate(&self) -> Result<RequestMeta, BatchError> {
        fn field<'a>(
            req: &'a KvRequest,
            v: &'a Option<String>,
            name: &'static str,
        ) -> Result<&'a str, BatchError> {
            match v.as_deref() {
                None => Err(BatchError::MissingField {
                    req_id: req.req_id.clone(),
                    field: name,
                }),
                Some("") => Err(BatchError::EmptyField {
                    req_id: req.req_id.clone(),
                    field: name,
                }),
                Some(s) => Ok(s),
            }
        }
        if self.req_id.is_empty() {
            return Err(BatchError::EmptyField {
                req_id: String::new(),
                field: "req_id",
            });
        }
        let transfer_id = field(self, &self.transfer_id, "transfer_id")?;
        let engine_id = field(self, &self.remote_engine_id, "remote_engine_id")?;
        let bootstrap = field(self, &self.remote_bootstrap_addr, "remote_bootstrap_addr")?;
        Ok(RequestMeta {
            req_id: ReqId::from(self.req_id.as_str()),
            transfer_id: transfer_id.to_owned(),
            engine_id: engine_id.to_owned(),
            bootstrap_addr: bootstrap.trim_end_matches('/').to_owned(),
            block_ids: self.block_ids.clone(),
        })
    }
}

/// Host -> Receiver: start receiving a batch. Answered once every request was validated; the
/// pulls proceed in the background.
#[derive(Debug, Message)]
#[rtype(result = "LoadKvReply")]
pub struct LoadKv {
    pub requests: Vec<KvRequest>,
}

/// Reply to [`LoadKv`]: the valid requests proceed, each invalid one is refused with its reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, actix::MessageResponse)]
pub struct LoadKvReply {
    pub accepted: usize,
    pub awaiting: usize,
    pub rejected: Vec<BatchError>,
}

/// Shared request metadata.
pub type SharedRequest = Arc<RequestMeta>;

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> KvRequest {
        KvRequest {
            req_id: "d-1".into(),
            transfer_id: Some("t-1".into()),
            remote_engine_id: Some("e0".into()),
            remote_bootstrap_addr: Some("http://127.0.0.1:8998/".into()),
            block_ids: vec![vec![1, 2]],
        }
    }

    #[test]
    fn missing_keys_are_refused_with_the_key_name() {
        for (field, mut r) in [
            (
                "transfer_id",
                KvRequest {
                    transfer_id: None,
                    ..req()
                },
            ),
            (
                "remote_engine_id",
                KvRequest {
                    remote_engine_id: None,
                    ..req()
                },
            ),
            (
                "remote_bootstrap_addr",
                KvRequest {
                    remote_bootstrap_addr: None,
                    ..req()
                },
            ),
        ] {
            let err = r.validate().unwrap_err();
            assert_eq!(
                err,
                BatchError::MissingField {
                    req_id: "d-1".into(),
                    field
                }
            );
            r.req_id.clear();
        }
    }

    #[test]
    fn valid_request_keeps_its_blocks_and_trims_the_bootstrap_slash() {
        let m = req().validate().unwrap();
        assert_eq!(m.bootstrap_addr, "http://127.0.0.1:8998");
        assert!(m.is_awaiting());
        let empty = KvRequest {
            block_ids: vec![vec![], vec![]],
            ..req()
        }
        .validate()
        .unwrap();
        assert!(!empty.is_awaiting());
    }
}
