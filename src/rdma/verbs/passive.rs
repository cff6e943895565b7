//! The passive side of Mooncake's RDMA endpoint handshake (type-0 frames, PROTOCOL.md §6), as a
//! plain struct the handshake daemon calls: validate what P sent, connect the endpoint, build the
//! reply. No I/O here besides the verbs calls behind [`VerbsBackend`].

#![forbid(unsafe_code)]

use thiserror::Error;

use super::backend::{AsyncEventKind, VerbsBackend, VerbsError};
use super::endpoint::{Endpoint, EndpointState, EndpointTable, FenceFailure};
use super::gid::{Gid, GidParseError};
use super::nic_path::NicPath;
use super::qp_attrs::{RdmaMtu, PathAttrs};
use crate::messages::handshake_desc::HandShakeDesc;

/// Metric: async events read, by event (`qp_fatal`, `qp_req_err`, `qp_access_err`,
/// `path_mig_err`, `port_err`, `device_fatal`, `other`); label `event`.
pub const ASYNC_EVENTS: &str = "kvrecv_rdma_async_events_total";

/// Mooncake's defaults: `MC_NUM_QP_PER_EP` and `MC_MTU`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaHandshakeConfig {
    /// QPs per endpoint; P must send exactly this many QP numbers. Default 2.
    pub qps_per_endpoint: usize,
    /// Upper bound of the path MTU. Default 4096.
    pub mtu_cap: RdmaMtu,
    /// GRH traffic class of D's QPs (`MC_IB_TC`). Default 0.
    pub traffic_class: u8,
    /// Service level of D's QPs (`MC_IB_SL`). Default 0.
    pub service_level: u8,
}

impl Default for RdmaHandshakeConfig {
    fn default() -> Self {
        RdmaHandshakeConfig {
            qps_per_endpoint: 2,
            mtu_cap: RdmaMtu::Mtu4096,
            traffic_class: 0,
            service_level: 0,
        }
    }
}

/// Why a Connection request is refused. `Display` is the `reply_msg` P logs, so it says what to
/// fix.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandshakeReject {
    #[error("malformed handshake request: {0}")]
    Malformed(String),
    #[error("invalid {field} {path:?}: expected \"server@nic\"")]
    BadNicPath { field: &'static str, path: String },
    #[error(
        "Invalid argument: peer nic path inconsistency, expect server {expected}, got {got:?}"
    )]
    WrongServer { expected: String, got: String },
    #[error("no local RDMA NIC named {0:?}")]
    UnknownNic(String),
    #[error(
        "QP count mismatch in peer and local endpoints: got {got}, expected {expected} \
         (MC_NUM_QP_PER_EP must match on both sides)"
    )]
    QpCountMismatch { got: usize, expected: usize },
    #[error("peer GID missing: kvrecv needs local_gid in the handshake (it does not fetch the initiator's descriptor)")]
    MissingPeerGid,
    #[error("invalid peer GID: {0}")]
    BadPeerGid(GidParseError),
    #[error("ready_ack confirmation for {0:?}, which has no connected endpoint")]
    NothingToConfirm(String),
    #[error("ready_ack confirmation QP numbers {got:?} differ from the handshake's {expected:?}")]
    ConfirmationMismatch { expected: Vec<u32>, got: Vec<u32> },
    #[error("RDMA endpoint setup failed: {0}")]
    Verbs(VerbsError),
}

/// The passive handshake handler and the endpoints it created.
#[derive(Debug)]
pub struct PassiveHandshake<B> {
    segment_name: String,
    table: EndpointTable<B>,
}

impl<B: VerbsBackend> PassiveHandshake<B> {
    /// `segment_name` is D's `host:port`, the server part P puts in the NIC paths it asks for.
    pub fn new(backend: B, segment_name: impl Into<String>, config: RdmaHandshakeConfig) -> Self {
        PassiveHandshake {
            segment_name: segment_name.into(),
            table: EndpointTable::new(backend, config.qps_per_endpoint, config.mtu_cap).with_path(
                PathAttrs {
                    traffic_class: config.traffic_class,
                    service_level: config.service_level,
                },
            ),
        }
    }

    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn segment_name(&self) -> &str {
        &self.segment_name
    }

    pub fn backend(&self) -> &B {
        self.table.backend()
    }

    /// For memory registration, which shares the devices.
    pub fn backend_mut(&mut self) -> &mut B {
        self.table.backend_mut()
    }

    /// The segment names P's endpoints connected from.
    pub fn servers(&self) -> Vec<String> {
        self.table.servers()
    }

    /// An endpoint from P's NIC path, if any: the one on D's first NIC (in device order) that
    /// has one. With several D NICs, [`endpoint_on`](Self::endpoint_on) names the NIC.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn endpoint(&self, peer_nic_path: &str) -> Option<&Endpoint> {
        self.table.of_peer(peer_nic_path).next()
    }

    /// The endpoint from P's NIC path on D's NIC named `nic`.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn endpoint_on(&self, nic: &str, peer_nic_path: &str) -> Option<&Endpoint> {
        let i = self.nic_index(nic)?;
        self.table.get(i, peer_nic_path)
    }

    /// Every endpoint from P's NIC path, in D NIC order (one per D NIC P connected to).
    #[cfg(test)]
    pub fn endpoints_from<'a>(
        &'a self,
        peer_nic_path: &'a str,
    ) -> impl Iterator<Item = &'a Endpoint> {
        self.table.of_peer(peer_nic_path)
    }

    fn nic_index(&self, name: &str) -> Option<usize> {
        self.table
            .backend()
            .nics()
            .iter()
            .position(|n| n.name == name)
    }

    /// Handle one type-0 frame body and return the reply body (JSON line). Every failure,
    /// malformed JSON included, becomes a HandShakeDesc with a non-empty `reply_msg`, which is
    /// how a Mooncake initiator learns it was refused.
    pub fn on_connection_frame(&mut self, body: &[u8]) -> Vec<u8> {
        let reply = HandShakeDesc::from_json(body)
            .map_err(|e| HandshakeReject::Malformed(e.to_string()))
            .and_then(|req| self.on_connection_request(req));
        match reply {
            Ok(desc) => desc.to_json_line(),
            Err(reject) => {
                tracing::warn!(%reject, "RDMA handshake refused");
                HandShakeDesc::rejection(reject.to_string()).to_json_line()
            }
        }
    }

    /// Handle one decoded Connection request.
    pub fn on_connection_request(
        &mut self,
        req: HandShakeDesc,
    ) -> Result<HandShakeDesc, HandshakeReject> {
        let wanted =
            NicPath::parse(&req.peer_nic_path).map_err(|_| HandshakeReject::BadNicPath {
                field: "peer_nic_path",
                path: req.peer_nic_path.clone(),
            })?;
        if NicPath::parse(&req.local_nic_path).is_err() {
            return Err(HandshakeReject::BadNicPath {
                field: "local_nic_path",
                path: req.local_nic_path.clone(),
            });
        }
        if wanted.server != self.segment_name {
            return Err(HandshakeReject::WrongServer {
                expected: self.segment_name.clone(),
                got: wanted.server,
            });
        }
        let nic = self
            .nic_index(&wanted.nic)
            .ok_or_else(|| HandshakeReject::UnknownNic(wanted.nic.clone()))?;
        let expected = self.table.qps_per_endpoint();
        if req.qp_num.len() != expected {
            return Err(HandshakeReject::QpCountMismatch {
                got: req.qp_num.len(),
                expected,
            });
        }
        if req.ready_ack == Some(true) {
            return self.confirm(nic, &req);
        }
        if req.local_gid.is_empty() {
            return Err(HandshakeReject::MissingPeerGid);
        }
        let peer_gid: Gid = req.local_gid.parse().map_err(HandshakeReject::BadPeerGid)?;
        // Offered round (`ready_ack: false`): wait for the confirmation. Not offered: done.
        let then = match req.ready_ack {
            Some(_) => EndpointState::AwaitingConfirmation,
            None => EndpointState::Connected,
        };
        let (kind, ep) = self
            .table
            .connect(
                &req.local_nic_path,
                nic,
                req.local_lid,
                peer_gid,
                &req.qp_num,
                then,
            )
            .map_err(HandshakeReject::Verbs)?;
        let local_qps = ep.local_qp_nums();
        let local = &self.table.backend().nics()[nic];
        tracing::info!(peer = %req.local_nic_path, nic = %local.name, ?kind, qps = ?local_qps, "RDMA endpoint connected");
        Ok(HandShakeDesc {
            local_gid: local.gid.to_string(),
            local_lid: local.lid,
            // The path P asked for, which is ours (server and NIC were checked above): P
            // rejects a reply whose local_nic_path differs from what it asked.
            local_nic_path: req.peer_nic_path,
            peer_nic_path: req.local_nic_path,
            qp_num: local_qps,
            ready_ack: req.ready_ack.map(|_| false),
            ..HandShakeDesc::default()
        })
    }

    /// The `ready_ack: true` round: same QP numbers as the handshake, answered with an empty
    /// descriptor.
    fn confirm(
        &mut self,
        nic: usize,
        req: &HandShakeDesc,
    ) -> Result<HandShakeDesc, HandshakeReject> {
        let ep = self
            .table
            .get(nic, &req.local_nic_path)
            .filter(|ep| {
                matches!(
                    ep.state,
                    EndpointState::AwaitingConfirmation | EndpointState::Connected
                )
            })
            .ok_or_else(|| HandshakeReject::NothingToConfirm(req.local_nic_path.clone()))?;
        if ep.peer_qps != req.qp_num {
            return Err(HandshakeReject::ConfirmationMismatch {
                expected: ep.peer_qps.clone(),
                got: req.qp_num.clone(),
            });
        }
        self.table
            .set_state(nic, &req.local_nic_path, EndpointState::Connected);
        Ok(HandShakeDesc::default())
    }

    /// Take the backend's pending async events and act on them: an endpoint whose QP failed by
    /// itself, or whose NIC's port or device went down, is marked Broken (so it is not reused
    /// nor confirmed, and a re-handshake replaces its QPs). Each event is logged and counted.
    /// Returns how many events were handled.
    pub fn on_async_events(&mut self) -> usize {
        let events = self.table.backend_mut().take_async_events();
        for ev in &events {
            let broken = self.table.on_async_event(ev);
            let nic = self
                .table
                .backend()
                .nics()
                .get(ev.nic)
                .map_or("?", |n| n.name.as_str());
            metrics::counter!(ASYNC_EVENTS, "event" => ev.kind.label()).increment(1);
            let peers: Vec<&str> = broken.iter().map(|k| k.peer_path.as_str()).collect();
            match ev.kind {
                AsyncEventKind::Other { code } => {
                    tracing::info!(nic, code, "RDMA async event")
                }
                kind => tracing::warn!(nic, event = kind.label(), ?kind, broken = ?peers,
                    "RDMA async event: endpoints marked broken"),
            }
        }
        events.len()
    }

    /// Fence every endpoint of P segment `server` (QPs to ERR, confirmed). `Ok(n)`: `n`
    /// endpoints are fenced (0 if the segment never connected).
    pub fn fence_server(&mut self, server: &str) -> Result<usize, Vec<FenceFailure>> {
        let r = self.table.fence_server(server);
        tracing::info!(server, result = ?r, "RDMA fence");
        r
    }
}

#[cfg(test)]
#[path = "passive_tests.rs"]
mod tests;
