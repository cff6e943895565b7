//! The fence as the core asks for it (`Landing::fence(&[PeerId])`, DESIGN.md §5): map each peer
//! (its ZMQ side-channel address) to the Mooncake segment(s) its TE connects from, and move the
//! QPs of those segments' endpoints to ERR.
//!
//! The binding peer → segment is by host unless configured otherwise ([`PeerBinding`]): the
//! landing notes every peer it opens a pull for, and a fence stops every segment on that
//! peer's host (or the segments no known peer can claim). `bind_peer` adds explicit bindings.
//! In [`PeerBinding::Explicit`] mode a peer with no binding cannot be fenced: its blocks stay
//! quarantined until the last-resort deadline, the safe answer when D cannot tell which queue
//! pairs are its.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::LocalBoxFuture;

use super::backend::VerbsBackend;
use super::passive::PassiveHandshake;
use super::peer_binding::{peer_host, segments_to_fence, PeerBinding};
use crate::messages::PeerId;
use crate::rdma::FenceError;

/// The handshake handler, shared between the handshake daemon and the fence. A std mutex held
/// across verbs calls: only ever locked off the async runtime (`spawn_blocking`) or at start.
pub type SharedHandshake<B> = Arc<Mutex<PassiveHandshake<B>>>;

/// Fences peers on RDMA. Cheap to clone; clones share bindings and endpoints.
pub struct RdmaFence<B> {
    target: SharedHandshake<B>,
    mode: PeerBinding,
    bindings: Arc<Mutex<Bindings>>,
}

/// What the fence knows of peers: explicit bindings and the hosts of every peer seen.
#[derive(Default)]
struct Bindings {
    explicit: BTreeMap<PeerId, BTreeSet<String>>,
    /// Segments some peer was bound to explicitly (never an orphan).
    claimed: BTreeSet<String>,
    /// Canonical hosts of the peers pulls were opened for (and of bound peers).
    known_hosts: BTreeSet<String>,
}

impl<B> Clone for RdmaFence<B> {
    fn clone(&self) -> Self {
        RdmaFence {
            target: Arc::clone(&self.target),
            mode: self.mode,
            bindings: Arc::clone(&self.bindings),
        }
    }
}

/// Lock even if another thread panicked while holding the lock: the fence must still run (a
/// stale endpoint table only means a QP is fenced that need not be).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<B: VerbsBackend + 'static> RdmaFence<B> {
    /// Peers bound by host ([`PeerBinding::ByHost`]) plus whatever `bind_peer` adds.
    pub fn new(target: SharedHandshake<B>) -> Self {
        Self::with_binding(target, PeerBinding::default())
    }

    pub fn with_binding(target: SharedHandshake<B>, mode: PeerBinding) -> Self {
        RdmaFence {
            target,
            mode,
            bindings: Arc::new(Mutex::new(Bindings::default())),
        }
    }

    /// Note a peer D pulls from: its host is then a known one (see [`PeerBinding::ByHost`]).
    pub fn note_peer(&self, peer: &PeerId) {
        if let Some(host) = peer_host(peer.addr()) {
            let mut b = lock(&self.bindings);
            if !b.known_hosts.contains(&host) {
                b.known_hosts.insert(host);
            }
        }
    }

    /// Record that `peer` writes from Mooncake segment `segment` (`host:port`, the server part
    /// of its NIC paths). A peer may have several (one per TE it runs).
    pub fn bind_peer(&self, peer: PeerId, segment: impl Into<String>) {
        let segment = segment.into();
        self.note_peer(&peer);
        let mut b = lock(&self.bindings);
        b.claimed.insert(segment.clone());
        b.explicit.entry(peer).or_default().insert(segment);
    }

    /// Forget a peer's explicit bindings (peer gone for good).
    pub fn unbind_peer(&self, peer: &PeerId) {
        let mut b = lock(&self.bindings);
        b.explicit.remove(peer);
        let claimed = b.explicit.values().flatten().cloned().collect();
        b.claimed = claimed;
    }

    /// Fence now, synchronously: every QP of every endpoint of the peers' segments goes to ERR
    /// and is confirmed. Stops at the first peer that cannot be fenced.
    pub fn fence_now(&self, peers: &[PeerId]) -> Result<(), FenceError> {
        for peer in peers {
            let mut target = lock(&self.target);
            let segments = {
                let b = lock(&self.bindings);
                let none = BTreeSet::new();
                let host = peer_host(peer.addr());
                let servers = target.servers();
                segments_to_fence(
                    self.mode,
                    host.as_deref(),
                    b.explicit.get(peer).unwrap_or(&none),
                    servers.iter().map(String::as_str),
                    &b.known_hosts,
                    &b.claimed,
                )
            };
            if segments.is_empty() {
                // Nothing to stop now, but the peer has D's addresses and may still connect and
                // write: not fenced, so its blocks wait for the last-resort deadline.
                let reason = match self.mode {
                    PeerBinding::Explicit => {
                        "no Mooncake segment bound to this peer: its queue pairs are unknown"
                    }
                    PeerBinding::ByHost => {
                        "no connected Mooncake segment can be this peer's yet: it may still \
                         connect and write"
                    }
                };
                return Err(FenceError::Failed {
                    peer: peer.clone(),
                    reason: reason.into(),
                });
            }
            for segment in &segments {
                target
                    .fence_server(segment)
                    .map_err(|failures| FenceError::Failed {
                        peer: peer.clone(),
                        reason: failures
                            .iter()
                            .map(|f| format!("{}: {}", f.peer_path, f.reason))
                            .collect::<Vec<_>>()
                            .join("; "),
                    })?;
            }
        }
        Ok(())
    }

    /// The same, shaped like `Landing::fence`. Inside a tokio runtime the verbs calls (which
    /// are firmware commands: `ibv_modify_qp` can take milliseconds, far longer on a busy or
    /// failing NIC, and the table's lock may be held by a handshake doing the same) run on the
    /// blocking pool, so no runtime worker waits on them; outside one (plain executors in tests)
    /// they run when the future is first polled.
    pub fn fence(&self, peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        let this = self.clone();
        off_runtime(peers, move |peers| this.fence_now(peers))
    }
}

/// `fence(peers)` shaped like `Landing::fence`, run on tokio's blocking pool inside a runtime
/// (firmware calls never block a runtime worker), or when first polled outside one (plain
/// executors in tests). A task that dies fails the fence of the first peer.
pub(crate) fn off_runtime(
    peers: &[PeerId],
    fence: impl FnOnce(&[PeerId]) -> Result<(), FenceError> + Send + 'static,
) -> LocalBoxFuture<'static, Result<(), FenceError>> {
    let peers = peers.to_vec();
    Box::pin(async move {
        if tokio::runtime::Handle::try_current().is_err() {
            return fence(&peers);
        }
        let first = peers.first().cloned();
        tokio::task::spawn_blocking(move || fence(&peers))
            .await
            .unwrap_or_else(|e| match first {
                Some(peer) => Err(FenceError::Failed {
                    peer,
                    reason: format!("fence task failed: {e}"),
                }),
                None => Ok(()),
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::handshake_desc::HandShakeDesc;
    use crate::rdma::verbs::endpoint::EndpointState;
    use crate::rdma::verbs::fake::{test_nic, FakeVerbs};
    use crate::rdma::verbs::passive::RdmaHandshakeConfig;
    use crate::rdma::verbs::qp_attrs::QpState;

    fn shared() -> SharedHandshake<FakeVerbs> {
        let nic = test_nic(
            "mlx5_0",
            "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07"
                .parse()
                .unwrap(),
        );
        let t = PassiveHandshake::new(
            FakeVerbs::new(vec![nic]),
            "10.0.0.7:15000",
            RdmaHandshakeConfig::default(),
        );
        Arc::new(Mutex::new(t))
    }

    fn connect(t: &SharedHandshake<FakeVerbs>, p_path: &str) {
        let req = HandShakeDesc {
            local_gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05".into(),
            local_nic_path: p_path.into(),
            peer_nic_path: "10.0.0.7:15000@mlx5_0".into(),
            qp_num: vec![1, 2],
            ..HandShakeDesc::default()
        };
        lock(t).on_connection_request(req).unwrap();
    }

    #[test]
    fn fences_the_bound_segment_only() {
        let t = shared();
        connect(&t, "10.0.0.5:16001@mlx5_0");
        connect(&t, "10.0.0.5:16002@mlx5_0");
        let fence = RdmaFence::with_binding(Arc::clone(&t), PeerBinding::Explicit);
        let p0 = PeerId::new("tcp://10.0.0.5:41233");
        fence.bind_peer(p0.clone(), "10.0.0.5:16001");
        futures::executor::block_on(fence.fence(std::slice::from_ref(&p0))).unwrap();
        let g = lock(&t);
        let fenced = g.endpoint("10.0.0.5:16001@mlx5_0").unwrap();
        assert_eq!(fenced.state, EndpointState::Fenced);
        for qp in &fenced.local_qps {
            assert_eq!(g.backend().state(*qp), Some(QpState::Err));
        }
        assert_eq!(
            g.endpoint("10.0.0.5:16002@mlx5_0").unwrap().state,
            EndpointState::Connected
        );
    }

    #[test]
    fn unbound_peer_is_a_fence_failure_not_a_silent_success() {
        let t = shared();
        connect(&t, "10.0.0.5:16001@mlx5_0");
        let fence = RdmaFence::with_binding(Arc::clone(&t), PeerBinding::Explicit);
        let p = PeerId::new("tcp://10.0.0.5:41233");
        let err = fence.fence_now(std::slice::from_ref(&p)).unwrap_err();
        assert!(matches!(err, FenceError::Failed { ref peer, .. } if *peer == p));
        fence.bind_peer(p.clone(), "10.0.0.5:16001");
        fence.clone().unbind_peer(&p);
        assert!(fence.fence_now(&[p]).is_err(), "clones share bindings");
        assert_eq!(
            lock(&t).endpoint("10.0.0.5:16001@mlx5_0").unwrap().state,
            EndpointState::Connected
        );
    }

    fn states(t: &SharedHandshake<FakeVerbs>, path: &str) -> Vec<Option<QpState>> {
        let g = lock(t);
        let ep = g.endpoint(path).unwrap();
        ep.local_qps.iter().map(|q| g.backend().state(*q)).collect()
    }

    const RTS: [Option<QpState>; 2] = [Some(QpState::Rts); 2];
    const ERR: [Option<QpState>; 2] = [Some(QpState::Err); 2];

    #[test]
    fn by_host_fences_the_peers_host_without_any_binding() {
        let t = shared();
        connect(&t, "10.0.0.5:16001@mlx5_0");
        connect(&t, "10.0.0.5:16002@mlx5_0");
        connect(&t, "10.0.0.6:16001@mlx5_0");
        let fence = RdmaFence::new(Arc::clone(&t));
        let p5 = PeerId::new("tcp://10.0.0.5:41233");
        let p6 = PeerId::new("tcp://10.0.0.6:41233");
        fence.note_peer(&p5);
        fence.note_peer(&p6);
        fence.fence_now(std::slice::from_ref(&p5)).unwrap();
        assert_eq!(states(&t, "10.0.0.5:16001@mlx5_0"), ERR);
        assert_eq!(
            states(&t, "10.0.0.5:16002@mlx5_0"),
            ERR,
            "co-located TE too"
        );
        assert_eq!(states(&t, "10.0.0.6:16001@mlx5_0"), RTS, "another host's");
    }

    #[test]
    fn by_host_peer_on_no_segment_host_fences_the_orphans() {
        let t = shared();
        // The peer's TE connected from another interface than its side channel.
        connect(&t, "192.168.0.5:16001@mlx5_0");
        connect(&t, "10.0.0.6:16001@mlx5_0");
        let fence = RdmaFence::new(Arc::clone(&t));
        let p5 = PeerId::new("tcp://10.0.0.5:41233");
        fence.note_peer(&p5);
        fence.note_peer(&PeerId::new("tcp://10.0.0.6:41233"));
        fence.fence_now(std::slice::from_ref(&p5)).unwrap();
        assert_eq!(states(&t, "192.168.0.5:16001@mlx5_0"), ERR);
        assert_eq!(states(&t, "10.0.0.6:16001@mlx5_0"), RTS);
    }

    #[test]
    fn by_host_with_nothing_connected_is_not_called_fenced() {
        // The peer has D's addresses and may connect after the fence: its blocks must wait.
        let t = shared();
        connect(&t, "10.0.0.6:16001@mlx5_0");
        let fence = RdmaFence::new(Arc::clone(&t));
        let p = PeerId::new("tcp://10.0.0.5:41233");
        fence.note_peer(&p);
        fence.note_peer(&PeerId::new("tcp://10.0.0.6:41233"));
        let err = fence.fence_now(std::slice::from_ref(&p)).unwrap_err();
        assert!(matches!(err, FenceError::Failed { ref peer, .. } if *peer == p));
        assert_eq!(states(&t, "10.0.0.6:16001@mlx5_0"), RTS, "another peer's");
    }

    #[test]
    fn failure_to_fence_is_reported_with_the_endpoint() {
        let t = shared();
        connect(&t, "10.0.0.5:16001@mlx5_0");
        {
            let mut g = lock(&t);
            g.backend_mut().fail_modify_to = Some((QpState::Err, 5));
        }
        // Destroy is the fallback; make it fail too by destroying the QP behind the table's back.
        {
            let mut g = lock(&t);
            let qp = g.endpoint("10.0.0.5:16001@mlx5_0").unwrap().local_qps[0];
            use crate::rdma::verbs::backend::VerbsBackend as _;
            g.backend_mut().destroy_qp(qp).unwrap();
        }
        let fence = RdmaFence::new(Arc::clone(&t));
        let p = PeerId::new("tcp://10.0.0.5:41233");
        fence.bind_peer(p.clone(), "10.0.0.5:16001");
        let err = fence.fence_now(&[p]).unwrap_err();
        let FenceError::Failed { reason, .. } = err else {
            panic!("{err:?}")
        };
        assert!(reason.contains("10.0.0.5:16001@mlx5_0"), "{reason}");
    }
}
