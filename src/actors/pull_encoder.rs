//! How the Receiver encodes a pull's metadata: the layout's arrays and D's endpoint, encoded
//! once for pulls that carry the layout and once for pulls that omit it (vLLM 0.33), and the
//! layout id of the pull's landing window (DESIGN.md §5.4). Speed only: the pre-encoded tails
//! save 19% of the instructions per request at batch 1 with 2 layers, 46% with 64
//! (`scripts/callgrind-core`; DESIGN.md §10).

#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::config::KvRecvConfig;
use crate::messages::{
    EncodeWithLayout, LayoutIds, MetadataRef, MetadataTail, PullLayout, PullRequests, ReqBlocksRef,
    SharedRequest, WireError,
};
use crate::rdma::RegionBases;

use super::batch_plan::{self, LayoutArrays};

/// Encodes one pull from its requests, window bases and layout (a seam: a test makes it fail).
pub type EncodeFn = fn(&MetadataRef<'_>, Option<&MetadataTail>) -> Result<Vec<u8>, WireError>;

/// Everything but the requests and the window that a pull's metadata holds.
pub struct PullEncoder {
    cfg_rank: crate::config::DRank,
    host: String,
    port: u32,
    arrays: LayoutArrays,
    /// The ids of this registration; `None` with layout ids off.
    ids: Option<LayoutIds>,
    /// The tail of a pull that carries the layout (`None` if it cannot be encoded: each pull
    /// then encodes it itself, and meets the same error).
    with_layout: Option<MetadataTail>,
    /// The tail of a pull that omits it (layout ids on).
    without_layout: Option<MetadataTail>,
    /// The encoder (seam).
    pub(crate) encode: EncodeFn,
}

impl PullEncoder {
    /// The encoder of `cfg`'s layout for a landing at `endpoint`; with `cfg.layout_ids`, a new
    /// registration (a fresh nonce).
    pub fn new(cfg: &KvRecvConfig, endpoint: (&str, u32)) -> Self {
        let ids = cfg.layout_ids.then(LayoutIds::draw);
        let mut enc = PullEncoder {
            cfg_rank: cfg.d_rank,
            host: endpoint.0.to_owned(),
            port: endpoint.1,
            arrays: LayoutArrays::new(&cfg.layout),
            ids,
            with_layout: None,
            without_layout: None,
            encode: |md, tail| match tail {
                Some(t) => md.encode_with(t),
                None => md.encode(),
            },
        };
        // Any non-zero id stands for the pulls' own: a tail only counts the id's entry.
        let id = u64::from(ids.is_some());
        enc.with_layout = enc.tail(PullLayout { id, carried: true });
        if ids.is_some() {
            enc.without_layout = enc.tail(PullLayout { id, carried: false });
        }
        enc
    }

    fn tail(&self, layout: PullLayout) -> Option<MetadataTail> {
        let none = ReqBlocksRef::default();
        let template = self.metadata(&none, &[], layout);
        MetadataTail::of(&template)
            .and_then(|t| t.with_head(&template))
            .inspect_err(|e| tracing::warn!(error = %e, "cannot pre-encode the layout's metadata"))
            .ok()
    }

    fn metadata<'a>(
        &'a self,
        req_blocks: &'a ReqBlocksRef<'a>,
        bases: &'a [u64],
        layout: PullLayout,
    ) -> MetadataRef<'a> {
        batch_plan::pull_metadata_ref(
            &self.arrays,
            self.cfg_rank,
            (&self.host, self.port),
            req_blocks,
            bases,
            layout,
        )
    }

    /// The layout id of the window advertising `bases` (0 with layout ids off).
    pub fn layout_id(&self, bases: &[u64]) -> u64 {
        self.ids.map_or(0, |ids| ids.id_of(bases))
    }

    /// The metadata of a pull of `req_blocks` landing at `bases`, with or without its layout.
    pub fn encode(
        &self,
        req_blocks: &ReqBlocksRef<'_>,
        bases: &[u64],
        layout: PullLayout,
    ) -> Result<Vec<u8>, WireError> {
        let md = self.metadata(req_blocks, bases, layout);
        let tail = if layout.carried {
            self.with_layout.as_ref()
        } else {
            self.without_layout.as_ref()
        };
        (self.encode)(&md, tail)
    }

    /// For a pull sent without its layout: how to encode it again with it (same requests,
    /// same window), should P answer `LAYOUT_MISS`.
    pub fn resend(self: &Arc<Self>, bases: RegionBases, id: u64) -> EncodeWithLayout {
        let enc = self.clone();
        Arc::new(move |requests: &PullRequests| {
            let group: Vec<SharedRequest> = requests.iter().map(|r| r.meta.clone()).collect();
            let blocks = batch_plan::req_blocks(&group);
            let layout = PullLayout { id, carried: true };
            enc.encode(&ReqBlocksRef(&blocks), &bases, layout)
        })
    }
}
