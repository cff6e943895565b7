//! D's RDMA endpoints: one per P NIC path, each with N RC queue pairs on one local NIC. Owns the
//! verbs backend; connects (reusing or resetting) and fences endpoints. Validation of what P sent
//! is the caller's job (`PassiveHandshake`).

use std::collections::BTreeMap;

use super::backend::{QpId, VerbsBackend, VerbsError};
use super::nic_path::NicPath;
use super::qp_attrs::{connect_sequence, Mtu, QpState, QpTransition, RemoteQp};

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// QPs are RTS; P offered the `ready_ack` round and has not confirmed yet.
    AwaitingConfirmation,
    /// QPs are RTS; confirmed, or P did not offer the round.
    Connected,
    /// QPs are in ERR (or destroyed): P cannot write until it re-handshakes.
    Fenced,
    /// A connect failed half-way; its QPs were sent to ERR. The next handshake resets them.
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

/// What a connect did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectKind {
    /// New endpoint, new QPs.
    Created,
    /// Same peer QPs on a live endpoint: nothing touched.
    Reused,
    /// Existing QPs reset and connected to new peer QPs (or after a fence / failure).
    Reset,
}

/// Why a fence did not complete for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceFailure {
    pub peer_path: String,
    pub reason: String,
}

/// The endpoints and the backend they live on.
#[derive(Debug)]
pub struct EndpointTable<B> {
    backend: B,
    qps_per_endpoint: usize,
    mtu_cap: Mtu,
    /// Keyed by P's `local_nic_path`, exactly as P sent it.
    endpoints: BTreeMap<String, Endpoint>,
}

impl<B: VerbsBackend> EndpointTable<B> {
    /// `qps_per_endpoint` is `MC_NUM_QP_PER_EP` (at least 1); `mtu_cap` is `MC_MTU`.
    pub fn new(backend: B, qps_per_endpoint: usize, mtu_cap: Mtu) -> Self {
        EndpointTable {
            backend,
            qps_per_endpoint: qps_per_endpoint.max(1),
            mtu_cap,
            endpoints: BTreeMap::new(),
        }
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
            .filter_map(|k| NicPath::parse(k).ok().map(|p| p.server))
            .collect();
        servers.into_iter().collect()
    }

    pub fn get(&self, peer_path: &str) -> Option<&Endpoint> {
        self.endpoints.get(peer_path)
    }

    /// Mark a live endpoint confirmed (the `ready_ack: true` round).
    pub fn set_state(&mut self, peer_path: &str, state: EndpointState) {
        if let Some(ep) = self.endpoints.get_mut(peer_path) {
            ep.state = state;
        }
    }

    /// Find or create the endpoint for `peer_path` on NIC `nic` and connect it to P's QPs.
    /// `peer_qps.len()` must equal `qps_per_endpoint` (checked by the caller).
    ///
    /// Same peer QPs on a live endpoint: reused untouched. Anything else: the endpoint's QPs go
    /// through RESET → INIT → RTR → RTS again. If that fails half-way, every QP of the endpoint
    /// is sent to ERR, because a QP left in RTR would accept P's writes.
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
        let existing = self.endpoints.remove(peer_path);
        let (mut ep, kind) = match existing {
            Some(ep)
                if ep.nic == nic
                    && ep.peer_qps == peer_qps
                    && matches!(
                        ep.state,
                        EndpointState::Connected | EndpointState::AwaitingConfirmation
                    ) =>
            {
                let ep = Endpoint { state: then, ..ep };
                let ep = self.endpoints.entry(peer_path.to_owned()).or_insert(ep);
                return Ok((ConnectKind::Reused, ep));
            }
            Some(ep) if ep.nic == nic && ep.local_qps.len() == n => (ep, ConnectKind::Reset),
            Some(old) => {
                // Other NIC, or QPs lost to a fence that had to destroy them: start over.
                for qp in old.local_qps {
                    let _ = self.backend.destroy_qp(qp);
                }
                (self.fresh(nic)?, ConnectKind::Created)
            }
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
            for t in connect_sequence(local, self.mtu_cap, remote) {
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
                for qp in &ep.local_qps {
                    let _ = self.backend.modify_qp(*qp, &QpTransition::ToErr);
                }
                ep.peer_qps.clear();
                ep.state = EndpointState::Broken;
            }
        }
        let ep = self.endpoints.entry(peer_path.to_owned()).or_insert(ep);
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

    /// Fence every endpoint whose P NIC path is on segment `server`: each QP to ERR, then read
    /// the state back to confirm. A QP that refuses ERR is destroyed instead (a destroyed QP
    /// cannot receive either). Returns how many endpoints are now fenced, or what failed.
    pub fn fence_server(&mut self, server: &str) -> Result<usize, Vec<FenceFailure>> {
        let keys: Vec<String> = self
            .endpoints
            .keys()
            .filter(|k| {
                NicPath::parse(k)
                    .map(|p| p.server == server)
                    .unwrap_or(false)
            })
            .cloned()
            .collect();
        let mut failures = Vec::new();
        for key in &keys {
            let Some(ep) = self.endpoints.get_mut(key) else {
                continue;
            };
            let mut kept = Vec::with_capacity(ep.local_qps.len());
            for qp in std::mem::take(&mut ep.local_qps) {
                let confirmed = self
                    .backend
                    .modify_qp(qp, &QpTransition::ToErr)
                    .and_then(|()| self.backend.query_qp_state(qp));
                match confirmed {
                    Ok(QpState::Err) => kept.push(qp),
                    other => match self.backend.destroy_qp(qp) {
                        Ok(()) => {}
                        Err(e) => {
                            kept.push(qp);
                            failures.push(FenceFailure {
                                peer_path: key.clone(),
                                reason: format!(
                                    "QP {:#x}: to ERR gave {other:?}, destroy failed: {e}",
                                    qp.qp_num
                                ),
                            });
                        }
                    },
                }
            }
            ep.local_qps = kept;
            ep.peer_qps.clear();
            ep.state = EndpointState::Fenced;
        }
        if failures.is_empty() {
            Ok(keys.len())
        } else {
            Err(failures)
        }
    }
}
