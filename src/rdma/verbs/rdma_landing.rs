//! The core's view of an RDMA data plane ([`Landing`], DESIGN.md §5):
//!
//! - `endpoint()`: the handshake daemon's host and port (the segment name P connects to);
//! - `open_pull`: the **registered** base address of every layout region. On RDMA the NIC
//!   resolves P's addresses through the memory registration, so there are no synthetic
//!   per-pull windows (PROTOCOL.md §5.4) and no per-pull permit;
//! - `revoke`: nothing can be revoked per request, so always [`Revocation::NotExact`](crate::rdma::Revocation::NotExact);
//! - `fence`: [`RdmaFence`], the queue pairs of the peers' segments to ERR (segments found by
//!   host unless [`PeerBinding::Explicit`](super::PeerBinding) is configured; then an unbound
//!   peer cannot be fenced, so its blocks stay quarantined until the last-resort deadline).

use futures::future::LocalBoxFuture;
use thiserror::Error;

use super::backend::VerbsBackend;
use super::descriptor::RegisteredRegion;
use super::fence::RdmaFence;
use crate::layout::KvLayout;
use crate::messages::PeerId;
use crate::rdma::{FenceError, Landing, PullWindow, RevokeRequest, Revoked};

/// Why the registered memory cannot hold the layout.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RdmaLandingError {
    #[error("the KV layout has no region")]
    EmptyLayout,
    #[error("KV region {region} needs {needed} bytes, which overflows u64")]
    Overflow { region: usize, needed: u64 },
    #[error(
        "{regions} registered regions for {layout} layout regions: register one region per layout \
         region, or a single region holding them back to back"
    )]
    RegionCount { regions: usize, layout: usize },
    #[error("KV region {region} needs {needed} bytes at {addr:#x}; the registration holds {have}")]
    TooSmall {
        region: usize,
        addr: u64,
        needed: u64,
        have: u64,
    },
}

/// [`Landing`] for the RDMA target. Cheap to share (`Arc`); the fence is shared with whoever
/// binds peers to segments.
pub struct RdmaLanding<B> {
    host: String,
    port: u32,
    bases: crate::rdma::RegionBases,
    fence: RdmaFence<B>,
}

impl<B> std::fmt::Debug for RdmaLanding<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaLanding")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("bases", &self.bases)
            .finish()
    }
}

/// Bytes of layout region `i` (every block of it).
fn region_len(layout: &KvLayout, i: usize) -> Result<u64, RdmaLandingError> {
    let block_len = layout.regions[i].block_len;
    block_len
        .checked_mul(u64::from(layout.num_blocks))
        .ok_or(RdmaLandingError::Overflow {
            region: i,
            needed: block_len,
        })
}

impl<B: VerbsBackend + 'static> RdmaLanding<B> {
    /// `host`/`port`: where P reaches D's handshake daemon (the segment name). `regions`: the
    /// registrations (as `MemoryRegistrations::regions` lists them), either one per layout region
    /// in layout order, or one holding every layout region back to back. Checks that every
    /// address P can compute from the advertised bases lies inside a registration.
    pub fn new(
        host: impl Into<String>,
        port: u16,
        layout: &KvLayout,
        regions: &[RegisteredRegion],
        fence: RdmaFence<B>,
    ) -> Result<Self, RdmaLandingError> {
        let n = layout.regions.len();
        if n == 0 {
            return Err(RdmaLandingError::EmptyLayout);
        }
        let mut bases = Vec::with_capacity(n);
        if regions.len() == n {
            for (i, r) in regions.iter().enumerate() {
                let needed = region_len(layout, i)?;
                if needed > r.length {
                    return Err(RdmaLandingError::TooSmall {
                        region: i,
                        addr: r.addr,
                        needed,
                        have: r.length,
                    });
                }
                bases.push(r.addr);
            }
        } else if let [r] = regions {
            let mut offset = 0u64;
            for i in 0..n {
                let len = region_len(layout, i)?;
                let end = offset.checked_add(len).ok_or(RdmaLandingError::Overflow {
                    region: i,
                    needed: len,
                })?;
                if end > r.length {
                    return Err(RdmaLandingError::TooSmall {
                        region: i,
                        addr: r.addr,
                        needed: end,
                        have: r.length,
                    });
                }
                bases.push(r.addr + offset);
                offset = end;
            }
        } else {
            return Err(RdmaLandingError::RegionCount {
                regions: regions.len(),
                layout: n,
            });
        }
        Ok(RdmaLanding {
            host: host.into(),
            port: u32::from(port),
            bases: bases.into(),
            fence,
        })
    }

    /// Record that `peer` writes from Mooncake segment `segment` (`host:port`).
    pub fn bind_peer(&self, peer: PeerId, segment: impl Into<String>) {
        self.fence.bind_peer(peer, segment);
    }

    /// The registered base address of every layout region, in layout order.
    pub fn bases(&self) -> &[u64] {
        &self.bases
    }
}

impl<B: VerbsBackend + 'static> Landing for RdmaLanding<B> {
    fn endpoint(&self) -> (&str, u32) {
        (&self.host, self.port)
    }

    fn open_pull(&self, window: &PullWindow<'_>) -> crate::rdma::RegionBases {
        // The peer's host becomes a known one: segments there are its, not orphans.
        self.fence.note_peer(window.peer);
        self.bases.clone()
    }

    fn revoke(&self, _r: &RevokeRequest<'_>) -> Revoked {
        Revoked::not_exact()
    }

    fn fence(&self, peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        self.fence.fence(peers)
    }
}

#[cfg(test)]
mod tests {
    use crate::messages::RequestMeta;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::messages::handshake_desc::HandShakeDesc;
    use crate::rdma::verbs::backend::{MrAccess, MrKeys};
    use crate::rdma::verbs::endpoint::EndpointState;
    use crate::rdma::verbs::fake::FakeVerbs;
    use crate::rdma::verbs::fence::SharedHandshake;
    use crate::rdma::verbs::memory::MemoryRegistrations;
    use crate::rdma::verbs::nic::LocalNic;
    use crate::rdma::verbs::passive::{HandshakeConfig, PassiveHandshake};
    use crate::rdma::verbs::qp_attrs::{Mtu, QpState};

    const D: &str = "10.0.0.7:15000";
    const P_PATH: &str = "10.0.0.5:16001@mlx5_0";

    fn shared() -> SharedHandshake<FakeVerbs> {
        let nic = LocalNic {
            name: "mlx5_0".into(),
            port: 1,
            lid: 0,
            gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07"
                .parse()
                .unwrap(),
            gid_index: 3,
            active_mtu: Mtu::Mtu4096,
            link_layer: Default::default(),
            numa_node: None,
        };
        Arc::new(Mutex::new(PassiveHandshake::new(
            FakeVerbs::new(vec![nic]),
            D,
            HandshakeConfig::default(),
        )))
    }

    fn region(addr: u64, length: u64) -> RegisteredRegion {
        RegisteredRegion {
            location: "cpu:0".into(),
            addr,
            length,
            keys: vec![MrKeys { lkey: 1, rkey: 2 }],
        }
    }

    fn landing(t: &SharedHandshake<FakeVerbs>) -> RdmaLanding<FakeVerbs> {
        let layout = KvLayout::uniform(2, 64, 4);
        RdmaLanding::new(
            "10.0.0.7",
            15000,
            &layout,
            &[region(0x1000, 256), region(0x9000, 256)],
            RdmaFence::new(Arc::clone(t)),
        )
        .unwrap()
    }

    fn request(id: &str) -> RequestMeta {
        RequestMeta {
            req_id: id.into(),
            transfer_id: id.into(),
            engine_id: "e".into(),
            bootstrap_addr: "b".into(),
            block_ids: vec![vec![1]],
        }
    }

    #[test]
    fn endpoint_and_real_registered_bases_for_every_pull() {
        let t = shared();
        let l = landing(&t);
        assert_eq!(l.endpoint(), ("10.0.0.7", 15000));
        let peer = PeerId::new("tcp://p");
        let reqs = [Arc::new(request("r1"))];
        for pull_id in [1, 2, 77] {
            let w = PullWindow {
                pull_id,
                peer: &peer,
                requests: &reqs,
            };
            assert_eq!(
                &*l.open_pull(&w),
                [0x1000, 0x9000],
                "no synthetic per-pull windows on RDMA"
            );
        }
        let r1 = request("r1");
        let revoked = l.revoke(&crate::rdma::RevokeRequest {
            req: &r1,
            suspects: &[],
            poison_until: std::time::Instant::now(),
        });
        assert_eq!(revoked.revocation, crate::rdma::Revocation::NotExact);
    }

    #[test]
    fn bases_come_from_actual_registrations() {
        let t = shared();
        let mut mem = MemoryRegistrations::new();
        {
            let mut g = t.lock().unwrap();
            mem.register_host(
                g.backend_mut(),
                "cpu:0",
                vec![0u8; 512].into_boxed_slice(),
                MrAccess::default(),
            )
            .unwrap();
        }
        let regions = mem.regions();
        let layout = KvLayout::uniform(2, 64, 4);
        let l =
            RdmaLanding::new("h", 1, &layout, &regions, RdmaFence::new(Arc::clone(&t))).unwrap();
        assert_eq!(l.bases(), &[regions[0].addr, regions[0].addr + 256]);
        let mut b = t.lock().unwrap();
        mem.deregister_all(b.backend_mut()).unwrap();
    }

    #[test]
    fn registrations_that_cannot_hold_the_layout_are_refused() {
        let t = shared();
        let f = || RdmaFence::new(Arc::clone(&t));
        let layout = KvLayout::uniform(2, 64, 4); // 256 bytes per region
        assert_eq!(
            RdmaLanding::new("h", 1, &layout, &[region(0x1000, 511)], f()).unwrap_err(),
            RdmaLandingError::TooSmall {
                region: 1,
                addr: 0x1000,
                needed: 512,
                have: 511
            }
        );
        assert!(matches!(
            RdmaLanding::new("h", 1, &layout, &[region(1, 256), region(2, 255)], f()),
            Err(RdmaLandingError::TooSmall { region: 1, .. })
        ));
        assert_eq!(
            RdmaLanding::new("h", 1, &layout, &[], f()).unwrap_err(),
            RdmaLandingError::RegionCount {
                regions: 0,
                layout: 2
            }
        );
        let empty = KvLayout::uniform(0, 64, 4);
        assert_eq!(
            RdmaLanding::new("h", 1, &empty, &[region(1, 1)], f()).unwrap_err(),
            RdmaLandingError::EmptyLayout
        );
        let huge = KvLayout::uniform(1, u64::MAX, 2);
        assert!(matches!(
            RdmaLanding::new("h", 1, &huge, &[region(1, 1)], f()),
            Err(RdmaLandingError::Overflow { .. })
        ));
    }

    #[test]
    fn fence_moves_the_bound_peers_qps_to_err_and_resolves_ok() {
        let t = shared();
        let reply = t
            .lock()
            .unwrap()
            .on_connection_request(HandShakeDesc {
                local_gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05".into(),
                local_nic_path: P_PATH.into(),
                peer_nic_path: format!("{D}@mlx5_0"),
                qp_num: vec![1, 2],
                ..HandShakeDesc::default()
            })
            .unwrap();
        assert!(reply.reply_msg.is_empty());
        let l = landing(&t);
        let peer = PeerId::new("tcp://10.0.0.5:41233");
        l.bind_peer(peer.clone(), "10.0.0.5:16001");
        let qps = t
            .lock()
            .unwrap()
            .endpoint(P_PATH)
            .unwrap()
            .local_qps
            .clone();
        for qp in &qps {
            assert_eq!(t.lock().unwrap().backend().state(*qp), Some(QpState::Rts));
        }
        futures::executor::block_on(l.fence(std::slice::from_ref(&peer))).unwrap();
        let g = t.lock().unwrap();
        assert_eq!(g.endpoint(P_PATH).unwrap().state, EndpointState::Fenced);
        for qp in &qps {
            assert_eq!(g.backend().state(*qp), Some(QpState::Err));
        }
    }

    #[test]
    fn fence_of_an_unbound_peer_fails_and_touches_no_qp() {
        let t = shared();
        t.lock()
            .unwrap()
            .on_connection_request(HandShakeDesc {
                local_gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05".into(),
                local_nic_path: P_PATH.into(),
                peer_nic_path: format!("{D}@mlx5_0"),
                qp_num: vec![1, 2],
                ..HandShakeDesc::default()
            })
            .unwrap();
        let layout = KvLayout::uniform(2, 64, 4);
        let fence =
            RdmaFence::with_binding(Arc::clone(&t), crate::rdma::verbs::PeerBinding::Explicit);
        let l = RdmaLanding::new(
            "10.0.0.7",
            15000,
            &layout,
            &[region(0x1000, 256), region(0x9000, 256)],
            fence,
        )
        .unwrap();
        let stranger = PeerId::new("tcp://10.0.0.9:1");
        let err =
            futures::executor::block_on(l.fence(std::slice::from_ref(&stranger))).unwrap_err();
        assert!(matches!(err, FenceError::Failed { ref peer, .. } if *peer == stranger));
        let g = t.lock().unwrap();
        assert_eq!(g.endpoint(P_PATH).unwrap().state, EndpointState::Connected);
        for qp in &g.endpoint(P_PATH).unwrap().local_qps {
            assert_eq!(g.backend().state(*qp), Some(QpState::Rts));
        }
    }
}
