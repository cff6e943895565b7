//! D's RDMA endpoints: one per (D NIC, P NIC path), each with N RC queue pairs on that D NIC.
//! Owns the verbs backend; connects (reusing, resetting or replacing QPs) and fences endpoints.
//! Validation of what P sent is the caller's job (`PassiveHandshake`).
//!
//! Keyed like Mooncake's endpoint stores: one store per local NIC (`RdmaContext`), keyed by the
//! peer's NIC path. P picks one of D's NICs per slice, so one P NIC holds endpoints to several
//! D NICs at once; a handshake to one of them must leave the others' QPs alone.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use super::backend::{AsyncEvent, AsyncEventKind, QpId, VerbsBackend, VerbsError};
use super::nic_path::NicPath;
use super::qp_attrs::{connect_sequence_with, RdmaMtu, PathAttrs, QpState, QpTransition, RemoteQp};

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// QPs are RTS; P offered the `ready_ack` round and has not confirmed yet.
    AwaitingConfirmation,
    /// QPs are RTS; confirmed, or P did not offer the round.
    Connected,
    /// QPs are in ERR (or RESET, or destroyed): P cannot write until it re-handshakes, which
    /// replaces them with new QPs.
    Fenced,
    /// A connect failed half-way, or a QP failed by itself (an async event): its QPs accept
    /// nothing (ERR, RESET or destroyed). The next handshake replaces them with new QPs.
    Broken,
}

/// One endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Index of the local NIC the QPs live on.
    pub nic: usize,
    /// D's QPs, in the order of P's `qp_num` list.
    pub local_qps: Vec<QpId>,
    /// P's QP numbers the local QPs are connected to (empty until connected).
    pub peer_qps: Vec<u32>,
    pub state: EndpointState,
}

impl Endpoint {
    /// D's QP numbers, for the reply.
    pub fn local_qp_nums(&self) -> Vec<u32> {
        self.local_qps.iter().map(|q| q.qp_num).collect()
    }
}

/// An endpoint's key: the D NIC its QPs live on and P's NIC path, exactly as P sent it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointKey {
    /// Index of D's NIC (into `VerbsBackend::nics`).
    pub nic: usize,
    /// P's `local_nic_path`.
    pub peer_path: String,
}

/// What a connect did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectKind {
    /// New endpoint, new QPs.
    Created,
    /// Same peer QPs on a live endpoint: nothing touched.
    Reused,
    /// A live endpoint's QPs reset and connected to P's new QPs.
    Reset,
    /// A fenced or broken endpoint: new QPs created and connected, the old ones destroyed.
    Replaced,
}

/// Why a fence did not complete for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceFailure {
    pub peer_path: String,
    pub reason: String,
}

/// How a QP was made to accept nothing.
enum Stopped {
    /// Still exists, in ERR or RESET.
    Kept,
    /// Destroyed (it refused ERR, or did not read back as stopped).
    Destroyed,
}

fn live(state: EndpointState) -> bool {
    matches!(
        state,
        EndpointState::Connected | EndpointState::AwaitingConfirmation
    )
}

/// The endpoints and the backend they live on.
#[derive(Debug)]
pub struct EndpointTable<B> {
    backend: B,
    qps_per_endpoint: usize,
    mtu_cap: RdmaMtu,
    path: PathAttrs,
    endpoints: BTreeMap<EndpointKey, Endpoint>,
}

impl<B: VerbsBackend> EndpointTable<B> {
    /// `qps_per_endpoint` is `MC_NUM_QP_PER_EP` (at least 1); `mtu_cap` is `MC_MTU`.
    pub fn new(backend: B, qps_per_endpoint: usize, mtu_cap: RdmaMtu) -> Self {
        EndpointTable {
            backend,
            qps_per_endpoint: qps_per_endpoint.max(1),
            mtu_cap,
            path: PathAttrs::default(),
            endpoints: BTreeMap::new(),
        }
    }

    /// Traffic class and service level of every QP connected from now on.
    pub fn with_path(mut self, path: PathAttrs) -> Self {
        self.path = path;
        self
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    pub fn qps_per_endpoint(&self) -> usize {
        self.qps_per_endpoint
    }

    /// The distinct segment names (server part of P's NIC path) that have an endpoint.
    pub fn servers(&self) -> Vec<String> {
        let servers: std::collections::BTreeSet<String> = self
            .endpoints
            .keys()
            .filter_map(|k| NicPath::parse(&k.peer_path).ok().map(|p| p.server))
            .collect();
        servers.into_iter().collect()
    }

    /// The endpoint from P's NIC path `peer_path` on D's NIC `nic`.
    pub fn get(&self, nic: usize, peer_path: &str) -> Option<&Endpoint> {
        self.endpoints.get(&EndpointKey {
            nic,
            peer_path: peer_path.to_owned(),
        })
    }

    /// Every endpoint from P's NIC path `peer_path`, in D NIC order.
    pub fn of_peer<'a, 'p>(
        &'a self,
        peer_path: &'p str,
    ) -> impl Iterator<Item = &'a Endpoint> + use<'a, 'p, B> {
        self.endpoints
            .iter()
            .filter(move |(k, _)| k.peer_path == peer_path)
            .map(|(_, ep)| ep)
    }

    /// Every endpoint with its key.
    pub fn iter(&self) -> impl Iterator<Item = (&EndpointKey, &Endpoint)> {
        self.endpoints.iter()
    }

    /// Set an endpoint's state (the `ready_ack: true` round confirms it).
    pub fn set_state(&mut self, nic: usize, peer_path: &str, state: EndpointState) {
        let key = EndpointKey {
            nic,
            peer_path: peer_path.to_owned(),
        };
        if let Some(ep) = self.endpoints.get_mut(&key) {
            ep.state = state;
        }
    }

    /// Find or create the endpoint for (`nic`, `peer_path`) and connect it to P's QPs.
    /// `peer_qps.len()` must equal `qps_per_endpoint` (checked by the caller). Endpoints of the
    /// same P path on other D NICs are not touched.
    ///
    /// Same peer QPs on a live endpoint: reused untouched. New peer QPs on a live endpoint: its
    /// QPs go through RESET → INIT → RTR → RTS again. A fenced or broken endpoint gets new QPs
    /// (created before the old ones are destroyed, so their numbers differ from every old one):
    /// a packet still in flight to an old QP number finds no QP. If connecting fails half-way,
    /// every QP of the endpoint is stopped (ERR, or left in RESET), because a QP left in RTR
    /// would accept P's writes.
    pub fn connect(
        &mut self,
        peer_path: &str,
        nic: usize,
        remote_lid: u16,
        remote_gid: super::gid::Gid,
        peer_qps: &[u32],
        then: EndpointState,
    ) -> Result<(ConnectKind, &Endpoint), VerbsError> {
        let n = self.qps_per_endpoint;
        let key = EndpointKey {
            nic,
            peer_path: peer_path.to_owned(),
        };
        let existing = self.endpoints.remove(&key);
        let (mut ep, kind) = match existing {
            Some(ep) if ep.peer_qps == peer_qps && live(ep.state) => {
                let ep = Endpoint { state: then, ..ep };
                let ep = self.endpoints.entry(key).or_insert(ep);
                return Ok((ConnectKind::Reused, ep));
            }
            Some(ep) if live(ep.state) && ep.local_qps.len() == n => (ep, ConnectKind::Reset),
            Some(old) => match self.fresh(nic) {
                Ok(new) => {
                    for qp in old.local_qps {
                        self.discard_qp(qp);
                    }
                    (new, ConnectKind::Replaced)
                }
                Err(e) => {
                    self.endpoints.insert(key, old);
                    return Err(e);
                }
            },
            None => (self.fresh(nic)?, ConnectKind::Created),
        };
        let local = self.backend.nics()[nic].local_port();
        let mut result = Ok(());
        'qps: for (qp, &qp_num) in ep.local_qps.iter().zip(peer_qps) {
            let remote = RemoteQp {
                lid: remote_lid,
                gid: remote_gid,
                qp_num,
            };
            for t in connect_sequence_with(local, self.mtu_cap, remote, self.path) {
                if let Err(e) = self.backend.modify_qp(*qp, &t) {
                    result = Err(e);
                    break 'qps;
                }
            }
        }
        match result {
            Ok(()) => {
                ep.peer_qps = peer_qps.to_vec();
                ep.state = then;
            }
            Err(_) => {
                let mut kept = Vec::with_capacity(ep.local_qps.len());
                for qp in std::mem::take(&mut ep.local_qps) {
                    match self.stop_qp(qp) {
                        Ok(Stopped::Kept) => kept.push(qp),
                        Ok(Stopped::Destroyed) => {}
                        Err(reason) => {
                            tracing::error!(qp = qp.qp_num, %reason, "RDMA QP left running after a failed connect");
                            kept.push(qp);
                        }
                    }
                }
                ep.local_qps = kept;
                ep.peer_qps.clear();
                ep.state = EndpointState::Broken;
            }
        }
        let ep = self.endpoints.entry(key).or_insert(ep);
        result.map(|()| (kind, &*ep))
    }

    fn fresh(&mut self, nic: usize) -> Result<Endpoint, VerbsError> {
        let local_qps = self.backend.create_rc_qps(nic, self.qps_per_endpoint)?;
        Ok(Endpoint {
            nic,
            local_qps,
            peer_qps: Vec::new(),
            state: EndpointState::Broken,
        })
    }

    /// Make `qp` accept nothing: to ERR, confirmed by reading the state back. A QP that refuses
    /// ERR but reads back RESET is stopped already (RESET → ERR is illegal, and a QP in RESET
    /// drops every packet). Anything else is destroyed (a destroyed QP cannot receive either).
    /// `Err`: the QP may still receive.
    fn stop_qp(&mut self, qp: QpId) -> Result<Stopped, String> {
        let confirmed = self
            .backend
            .modify_qp(qp, &QpTransition::ToErr)
            .and_then(|()| self.backend.query_qp_state(qp));
        let refused = match confirmed {
            Ok(QpState::Err) => return Ok(Stopped::Kept),
            Ok(other) => format!("reads back {other:?} after ERR"),
            Err(e) => match self.backend.query_qp_state(qp) {
                Ok(QpState::Reset) => return Ok(Stopped::Kept),
                _ => e.to_string(),
            },
        };
        match self.backend.destroy_qp(qp) {
            Ok(()) => Ok(Stopped::Destroyed),
            Err(e) => Err(format!(
                "QP {:#x}: to ERR: {refused}; destroy failed: {e}",
                qp.qp_num
            )),
        }
    }

    /// Destroy a QP an endpoint no longer uses (stopping it first if destroying fails).
    fn discard_qp(&mut self, qp: QpId) {
        if let Err(e) = self.backend.destroy_qp(qp) {
            let stopped = self.stop_qp(qp);
            tracing::warn!(qp = qp.qp_num, error = %e, stopped = stopped.is_ok(), "RDMA QP not destroyed");
        }
    }

    /// Act on an async event: the endpoint owning a failed QP, or every endpoint on a NIC whose
    /// port or device failed, becomes Broken (its QPs are in ERR already, or unusable). Returns
    /// the endpoints that were live and are now Broken.
    pub fn on_async_event(&mut self, ev: &AsyncEvent) -> Vec<EndpointKey> {
        let port = self.backend.nics().get(ev.nic).map(|n| n.port);
        let hit = |k: &EndpointKey, ep: &Endpoint| -> bool {
            k.nic == ev.nic
                && match ev.kind {
                    AsyncEventKind::PortErr { port: p } => Some(p) == port,
                    AsyncEventKind::DeviceFatal => true,
                    kind => kind
                        .failed_qp()
                        .is_some_and(|n| ep.local_qps.iter().any(|q| q.qp_num == n)),
                }
        };
        let mut broken = Vec::new();
        for (k, ep) in self.endpoints.iter_mut() {
            if hit(k, ep) && live(ep.state) {
                ep.state = EndpointState::Broken;
                broken.push(k.clone());
            }
        }
        broken
    }

    /// Fence every endpoint whose P NIC path is on segment `server`, on every D NIC: each QP
    /// stopped (see `stop_qp`). Returns how many endpoints are now fenced, or what failed.
    pub fn fence_server(&mut self, server: &str) -> Result<usize, Vec<FenceFailure>> {
        let keys: Vec<EndpointKey> = self
            .endpoints
            .keys()
            .filter(|k| {
                NicPath::parse(&k.peer_path)
                    .map(|p| p.server == server)
                    .unwrap_or(false)
            })
            .cloned()
            .collect();
        let mut failures = Vec::new();
        for key in &keys {
            let Some(qps) = self
                .endpoints
                .get_mut(key)
                .map(|ep| std::mem::take(&mut ep.local_qps))
            else {
                continue;
            };
            let mut kept = Vec::with_capacity(qps.len());
            for qp in qps {
                match self.stop_qp(qp) {
                    Ok(Stopped::Kept) => kept.push(qp),
                    Ok(Stopped::Destroyed) => {}
                    Err(reason) => {
                        kept.push(qp);
                        failures.push(FenceFailure {
                            peer_path: key.peer_path.clone(),
                            reason,
                        });
                    }
                }
            }
            if let Some(ep) = self.endpoints.get_mut(key) {
                ep.local_qps = kept;
                ep.peer_qps.clear();
                ep.state = EndpointState::Fenced;
            }
        }
        if failures.is_empty() {
            Ok(keys.len())
        } else {
            Err(failures)
        }
    }
}
