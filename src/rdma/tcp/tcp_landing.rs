//! The core's [`Landing`] over kvrecv's own TCP target: opening pulls, revocation and pause go
//! to its [`PermitTable`], resume swaps the data server's memory.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use futures::future::LocalBoxFuture;

use super::permits::{PermitTable, NO_WINDOW};
use crate::messages::{PeerId, RequestMeta};
use crate::rdma::memory::LandingId;
use crate::rdma::landing::{
    FenceError, Landing, NoWindow, PullWindow, RegionBases, RevokeRequest, Revoked,
};

/// The core's [`Landing`] over kvrecv's own TCP target.
#[derive(Debug, Clone)]
pub struct TcpLanding {
    permits: Arc<PermitTable>,
    host: String,
    port: u32,
    /// The data server's memory, swapped by a resume on new memory (`None`: not swappable),
    /// and the id this landing registers host memory under.
    memory: Option<(Arc<super::memory_slot::MemorySlot>, LandingId)>,
}

impl TcpLanding {
    /// `host:port` is the handshake daemon P's TE contacts.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn new(permits: Arc<PermitTable>, host: &str, port: u16) -> Self {
        TcpLanding {
            permits,
            host: host.to_owned(),
            port: u32::from(port),
            memory: None,
        }
    }

    /// The data server's memory slot, which [`Landing::resume_on`] swaps, registering the new
    /// memory as `id` (the target's: its start registered the first under it).
    pub(crate) fn with_memory(
        mut self,
        slot: Arc<super::memory_slot::MemorySlot>,
        id: LandingId,
    ) -> Self {
        self.memory = Some((slot, id));
        self
    }

    /// The permit table.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn permits(&self) -> &Arc<PermitTable> {
        &self.permits
    }
}

impl Landing for TcpLanding {
    fn endpoint(&self) -> (&str, u32) {
        (&self.host, self.port)
    }

    fn open_pull(&self, window: &PullWindow<'_>) -> crate::rdma::RegionBases {
        if self.permits.is_paused() {
            // Admission is closed while paused; a pull that got here anyway lands nothing.
            return self.permits.reserved_bases();
        }
        let w = self.permits.open(window);
        self.permits.map().region_bases(w)
    }

    fn open_pulls(&self, windows: &[PullWindow<'_>]) -> Result<Vec<RegionBases>, NoWindow> {
        let map = self.permits.map();
        Ok(self
            .permits
            .open_all_at(windows, Instant::now())?
            .into_iter()
            .map(|w| map.region_bases(w))
            .collect())
    }

    fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        self.permits.revoke(r)
    }

    fn verify_ok(&self, req: &RequestMeta) -> Result<(), String> {
        self.permits.verify_ok(req)
    }

    fn failure_context(&self, req: &RequestMeta) -> Option<String> {
        self.permits
            .windowless(&req.req_id)
            .then(|| NO_WINDOW.to_owned())
    }

    /// Every permit is closed already (each request's completion revoked its own before the
    /// pause was called); from now on the data server refuses every write as `paused`.
    fn pause(&self) -> Result<(), crate::rdma::LandingPauseError> {
        self.permits.set_paused(true);
        Ok(())
    }

    fn resume(&self) -> Result<(), crate::rdma::LandingPauseError> {
        self.permits.set_paused(false);
        Ok(())
    }

    /// The data server's memory swapped while every write is refused and no permit is open
    /// (each request's completion revoked its own, and quiesced, before the pause): no write
    /// admitted before the pause passes its gate again, so none touches the old memory, and
    /// every write admitted after the unpause takes the new one (`MemorySlot`).
    fn resume_on(
        &self,
        memory: &crate::rdma::memory::HostMemory,
    ) -> Result<(), crate::rdma::LandingPauseError> {
        use crate::rdma::LandingPauseError as E;
        let Some((slot, id)) = &self.memory else {
            return Err(E::Unsupported("no swappable memory".into()));
        };
        if !self.permits.is_paused() {
            return Err(E::Failed(
                "not paused: the memory is swapped only while paused".into(),
            ));
        }
        if !self.permits.enabled() {
            // Nothing gates a write in flight: one admitted before the pause may still copy.
            return Err(E::Unsupported(
                "landing permits are off: a write in flight cannot be kept out of the old memory"
                    .into(),
            ));
        }
        if slot.current().is_staged() {
            return Err(E::Unsupported(
                "the worker lands in device memory; new host memory is not supported".into(),
            ));
        }
        if self.permits.live() > 0 {
            return Err(E::Failed(format!(
                "{} landing permits still open while paused",
                self.permits.live()
            )));
        }
        let spans = self.permits.map().region_spans();
        let needed: Vec<u64> = spans.iter().map(|&(_, len)| len).collect();
        crate::rdma::memory_fit::check_fit(memory, &needed)?;
        let registration = memory.register(*id).map_err(|_| E::InUse)?;
        let fresh = crate::rdma::memory::RegisteredMemory::host_owned(registration, &spans)
            .map_err(|e| E::Failed(e.to_string()))?;
        // The old memory goes when the last revoked write holding it ends; none reads it.
        drop(slot.replace(Arc::new(fresh)));
        self.permits.set_paused(false);
        tracing::info!("TCP landing resumed on new memory");
        Ok(())
    }

    fn fence(&self, _peers: &[PeerId]) -> LocalBoxFuture<'static, Result<(), FenceError>> {
        let enabled = self.permits.enabled();
        Box::pin(async move {
            if enabled {
                // The revocation closed every permit of the request and the BlockManager waited
                // for its quiescence: nothing more can land.
                Ok(())
            } else {
                Err(FenceError::Unavailable(
                    "TCP target without landing permits cannot refuse writes".into(),
                ))
            }
        })
    }
}
