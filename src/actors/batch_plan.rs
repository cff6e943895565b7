//! The Receiver's logic without actors: which requests of a `load_kv` batch are valid, how the
//! admitted ones group into one pull per P engine, and the `MooncakeXferMetadata` each pull
//! carries (PROTOCOL.md §2.3). The Receiver actor only wires these to the BlockManager's
//! admission, the topology lookups and the Peers.

#![forbid(unsafe_code)]

use crate::fast_hash::FastSet;
use std::sync::Arc;

use crate::config::DRank;
use crate::layout::KvLayout;
use crate::messages::{
    BatchError, BlockGroups, Interner, KvRequest, MetadataRef, PullLayout, ReqBlock,
    ReqBlocksRef, RequestMeta, SharedRequest,
};

use super::rediscovery::EngineKey;

/// A batch split by validation, each request with its index in the batch.
#[derive(Debug, Default)]
pub struct Validated {
    /// Requests that passed validation, in batch order (inline for a batch of one or two).
    pub valid: smallvec::SmallVec<[(usize, SharedRequest); 2]>,
    /// Requests refused, with why.
    pub rejected: Vec<(usize, BatchError)>,
}

/// Validate every request of a batch against the wire rules ([`KvRequest::validate`]) and the
/// layout (group count, block range), refusing an id listed twice in the batch, and an awaited
/// request whose P transfer (engine, `transfer_id`) another awaited request of the batch has.
pub fn validate(requests: Vec<KvRequest>, layout: &KvLayout, interner: &mut Interner) -> Validated {
    validate_metas(
        requests.into_iter().map(|kv| kv.into_meta(interner)),
        layout,
    )
}

/// [`validate`] for requests already read into their metadata (or refused) by the host
/// ([`LoadMetas`](crate::messages::LoadMetas)).
pub fn validate_metas(
    requests: impl ExactSizeIterator<Item = Result<RequestMeta, BatchError>>,
    layout: &KvLayout,
) -> Validated {
    // Each request checked alone, then the batch for duplicates.
    let checked: smallvec::SmallVec<[Result<SharedRequest, BatchError>; 2]> = requests
        .map(|m| m.and_then(|m| check_blocks(&m, layout).map(|_| Arc::new(m))))
        .collect();
    let passed = || checked.iter().filter_map(|r| r.as_ref().ok()).map(|m| &**m);
    let dups = if checked.len() <= SMALL_BATCH {
        duplicates_by_scan(passed())
    } else {
        duplicates_by_set(passed(), checked.len())
    };
    let mut out = Validated::default();
    let mut dups = dups.into_iter();
    for (i, r) in checked.into_iter().enumerate() {
        let m = match r {
            Ok(m) => m,
            Err(e) => {
                out.rejected.push((i, e));
                continue;
            }
        };
        // One verdict per request that passed alone, in order.
        match dups.next() {
            Some(Dup::Id) => out.rejected.push((
                i,
                BatchError::Duplicate {
                    req_id: m.req_id.to_string(),
                },
            )),
            Some(Dup::Transfer) => out.rejected.push((
                i,
                BatchError::DuplicateTransferId {
                    req_id: m.req_id.to_string(),
                    transfer_id: m.transfer_id().to_string(),
                },
            )),
            _ => out.valid.push((i, m)),
        }
    }
    out
}

/// A request's standing in its batch: first of its id and transfer, or a repeat of either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dup {
    No,
    Id,
    Transfer,
}

/// Up to this many requests a batch is checked for repeats by comparing each with those kept
/// before it: cheaper than building two hash sets (most batches at low load are this small).
const SMALL_BATCH: usize = 8;

/// One verdict per request, in order. An id repeats one kept earlier; a transfer repeats an
/// awaited one kept earlier (same bootstrap, engine and transfer id).
fn duplicates_by_scan<'a>(
    metas: impl Iterator<Item = &'a RequestMeta>,
) -> smallvec::SmallVec<[Dup; 64]> {
    let mut kept: smallvec::SmallVec<[&RequestMeta; SMALL_BATCH]> = smallvec::SmallVec::new();
    metas
        .map(|m| {
            let same_transfer = |k: &&RequestMeta| {
                k.is_awaiting()
                    && k.transfer_id() == m.transfer_id()
                    && k.engine_id == m.engine_id
                    && k.bootstrap_addr == m.bootstrap_addr
            };
            if kept.iter().any(|k| k.req_id == m.req_id) {
                Dup::Id
            } else if m.is_awaiting() && kept.iter().any(same_transfer) {
                Dup::Transfer
            } else {
                kept.push(m);
                Dup::No
            }
        })
        .collect()
}

/// [`duplicates_by_scan`]'s verdicts through hash sets keyed by the requests' own strings
/// (borrowed: no reference count touched per key).
fn duplicates_by_set<'a>(
    metas: impl Iterator<Item = &'a RequestMeta>,
    n: usize,
) -> smallvec::SmallVec<[Dup; 64]> {
    let mut seen = FastSet::with_capacity_and_hasher(n, Default::default());
    let mut transfers = FastSet::with_capacity_and_hasher(n, Default::default());
    metas
        .map(|m| {
            if seen.contains(&*m.req_id) {
                Dup::Id
            } else if m.is_awaiting()
                && !transfers.insert((&*m.bootstrap_addr, &*m.engine_id, m.transfer_id()))
            {
                Dup::Transfer
            } else {
                seen.insert(&*m.req_id);
                Dup::No
            }
        })
        .collect()
}

/// Layout-level checks on top of [`KvRequest::validate`]. A request with blocks has one list
/// per KV-cache group; one with none (`[]`, `[[]]`: sent so that P frees its side) no more
/// lists than groups.
fn check_blocks(r: &RequestMeta, l: &KvLayout) -> Result<(), BatchError> {
    let (lists, groups) = (r.block_ids().len(), l.num_groups as usize);
    if (r.is_awaiting() && lists != groups) || lists > groups.max(1) {
        return Err(BatchError::GroupCount {
            req_id: r.req_id.to_string(),
            groups: r.block_ids().len(),
            expected: l.num_groups as usize,
        });
    }
    match r.all_blocks().find(|b| *b >= l.num_blocks) {
        Some(block) => Err(BatchError::BlockOutOfRange {
            req_id: r.req_id.to_string(),
            block,
            num_blocks: l.num_blocks,
        }),
        None => Ok(()),
    }
}

/// The requests of one engine in a batch, inline for one (a batch of one allocates no list).
/// Speed only: the seven lists inline for one save 5.0% of the instructions per request at batch 1
/// (`scripts/callgrind-core`; DESIGN.md §10).
pub type RequestGroup = smallvec::SmallVec<[SharedRequest; 1]>;

/// Requests grouped by engine (inline for a batch from one engine, the usual case).
/// Speed only: the seven lists inline for one save 5.0% of the instructions per request at batch 1
/// (`scripts/callgrind-core`; DESIGN.md §10).
pub type EngineGroups = smallvec::SmallVec<[(EngineKey, RequestGroup); 1]>;

/// Group requests by (bootstrap address, engine), engines in order of first appearance and
/// requests in arrival order: one pull per engine and peer.
pub fn group_by_engine(requests: impl Into<RequestGroup>) -> EngineGroups {
    let requests = requests.into();
    let mut groups = EngineGroups::new();
    let Some(first) = requests.first() else {
        return groups;
    };
    let key = (first.bootstrap_addr.clone(), first.engine_id.clone());
    // Usually one engine: the batch is its group as it is.
    if requests
        .iter()
        .all(|m| m.bootstrap_addr == key.0 && m.engine_id == key.1)
    {
        groups.push((key, requests));
        return groups;
    }
    for meta in requests {
        let key = (meta.bootstrap_addr.clone(), meta.engine_id.clone());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(meta),
            None => groups.push((key, smallvec::smallvec![meta])),
        }
    }
    groups
}

#[cfg(any(test, feature = "testing"))]
/// The metadata of one pull: D's endpoint, every request of the group (cleanup pulls and full
/// prefix hits with an empty outer list, as vLLM sends them), the pull's advertised `bases` and
/// the layout's per-region arrays.
pub fn pull_metadata(
    layout: &KvLayout,
    d: DRank,
    (host, port): (&str, u32),
    group: &[SharedRequest],
    bases: Vec<u64>,
) -> crate::messages::MooncakeXferMetadata {
    let mut md = crate::messages::MooncakeXferMetadata::minimal(host, port, d.tp_size, d.tp_rank);
    md.remote_pp_size = d.pp_size;
    for r in group {
        let blocks = if r.is_awaiting() {
            r.block_ids()
                .iter()
                .map(|g| g.iter().map(|&b| u64::from(b)).collect())
                .collect()
        } else {
            vec![]
        };
        md.req_blocks
            .insert(r.req_id.to_string(), (r.transfer_id().to_string(), blocks));
    }
    md.kv_caches_base_addr = bases;
    md.block_lens = layout.regions.iter().map(|r| r.block_len).collect();
    md.kv_block_lens = layout.regions.iter().map(|r| r.kv_block_len).collect();
    md.registered_layer_names = layout
        .regions
        .iter()
        .map(|r| r.layer_name.clone())
        .collect();
    md.registered_layer_indices = layout.regions.iter().map(|r| r.layer_index).collect();
    md.registered_group_indices = layout.regions.iter().map(|r| r.group_index).collect();
    md
}

/// The layout's per-region arrays every pull's metadata carries, built once.
#[derive(Debug, Clone)]
pub struct LayoutArrays {
    block_lens: Vec<u64>,
    kv_block_lens: Vec<u64>,
    names: Vec<String>,
    indices: Vec<u32>,
    groups: Vec<u32>,
}

impl LayoutArrays {
    /// The arrays of `layout`.
    pub fn new(layout: &KvLayout) -> Self {
        let r = &layout.regions;
        LayoutArrays {
            block_lens: r.iter().map(|r| r.block_len).collect(),
            kv_block_lens: r.iter().map(|r| r.kv_block_len).collect(),
            names: r.iter().map(|r| r.layer_name.clone()).collect(),
            indices: r.iter().map(|r| r.layer_index).collect(),
            groups: r.iter().map(|r| r.group_index).collect(),
        }
    }
}

/// The `req_blocks` of a group of requests, borrowed and sorted by id (once per batch; every
/// peer's pull carries the same).
pub fn req_blocks(group: &[SharedRequest]) -> ReqBlockList<'_> {
    let mut v: ReqBlockList<'_> = group
        .iter()
        .map(|r| {
            let blocks = if r.is_awaiting() {
                r.block_ids()
            } else {
                BlockGroups::NONE
            };
            (&*r.req_id, r.transfer_id(), blocks)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(b.0));
    v
}

/// [`req_blocks`]' list, inline for a batch of one (no allocation per batch at low load).
/// Speed only: the seven lists inline for one save 5.0% of the instructions per request at batch 1
/// (`scripts/callgrind-core`; DESIGN.md §10).
pub type ReqBlockList<'a> = smallvec::SmallVec<[ReqBlock<'a>; 1]>;

/// [`pull_metadata`], borrowed: the same bytes on the wire, no per-request copies.
/// `layout`: the pull's layout id (0: none) and whether the pull carries the layout; one that
/// does not (P cached it under that id, vLLM 0.33) has empty lists and no bases.
pub fn pull_metadata_ref<'a>(
    arrays: &'a LayoutArrays,
    d: DRank,
    (host, port): (&'a str, u32),
    req_blocks: &'a ReqBlocksRef<'a>,
    bases: &'a [u64],
    layout: PullLayout,
) -> MetadataRef<'a> {
    if !layout.carried {
        return MetadataRef {
            remote_hostname: host,
            remote_port: port,
            remote_tp_size: d.tp_size,
            remote_tp_rank: d.tp_rank,
            req_blocks,
            kv_caches_base_addr: &[],
            block_lens: &[],
            kv_block_lens: &[],
            registered_layer_names: &[],
            registered_layer_indices: &[],
            registered_group_indices: &[],
            remote_pp_size: d.pp_size,
            layout_id: layout.id,
        };
    }
    MetadataRef {
        remote_hostname: host,
        remote_port: port,
        remote_tp_size: d.tp_size,
        remote_tp_rank: d.tp_rank,
        req_blocks,
        kv_caches_base_addr: bases,
        block_lens: &arrays.block_lens,
        kv_block_lens: &arrays.kv_block_lens,
        registered_layer_names: &arrays.names,
        registered_layer_indices: &arrays.indices,
        registered_group_indices: &arrays.groups,
        remote_pp_size: d.pp_size,
        layout_id: layout.id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Small batches are checked by scanning, large ones through hash sets: both give
        /// every request the same verdict.
        #[test]
        fn both_duplicate_checks_agree(
            batch in proptest::collection::vec(
                (0u8..6, 0u8..4, 0u8..2, 0u8..2, proptest::bool::ANY), 0..24),
        ) {
            let metas: Vec<RequestMeta> = batch
                .iter()
                .map(|&(id, transfer, engine, bootstrap, awaiting)| RequestMeta::new(format!("r{id}").as_str(), &format!("t{transfer}"), format!("e{engine}").as_str(), format!("http://p:{bootstrap}").as_str(), &if awaiting { vec![vec![1]] } else { vec![] }))
                .collect();
            let scan = duplicates_by_scan(metas.iter());
            let set = duplicates_by_set(metas.iter(), metas.len());
            proptest::prop_assert_eq!(scan, set);
        }
    }

    fn kv(id: &str, engine: &str, blocks: Vec<Vec<u32>>) -> KvRequest {
        KvRequest {
            req_id: id.into(),
            transfer_id: Some(format!("t-{id}")),
            remote_engine_id: Some(engine.into()),
            remote_bootstrap_addr: Some("http://p:1".into()),
            block_ids: blocks,
        }
    }

    #[test]
    fn validation_keeps_batch_order_and_names_each_refusal() {
        let l = KvLayout::uniform(2, 4096, 8);
        let v = validate(
            vec![
                kv("a", "e", vec![vec![1]]),
                kv("b", "e", vec![vec![8]]),
                kv("a", "e", vec![vec![2]]),
                kv("c", "e", vec![vec![1], vec![2]]),
                kv("d", "e", vec![]),
                kv("f", "e", vec![vec![]]),
                kv("g", "e", vec![vec![], vec![]]),
                kv("h", "e", vec![vec![]; 100_000]),
            ],
            &l,
            &mut Interner::default(),
        );
        let ok: Vec<(usize, &str)> = v.valid.iter().map(|(i, m)| (*i, &*m.req_id)).collect();
        assert_eq!(
            ok,
            [(0, "a"), (4, "d"), (5, "f")],
            "a cleanup pull without blocks is valid"
        );
        let kinds: Vec<(usize, &str)> = v.rejected.iter().map(|(i, e)| (*i, e.kind())).collect();
        assert_eq!(
            kinds,
            [
                (1, "block_out_of_range"),
                (2, "duplicate_in_batch"),
                (3, "group_count"),
                (6, "group_count"),
                (7, "group_count")
            ],
            "one block list per group, or none: more empty lists than groups are refused too"
        );
    }

    #[test]
    fn two_awaited_requests_of_one_p_transfer_are_refused_after_the_first() {
        let l = KvLayout::uniform(1, 4096, 8);
        let with_transfer = |id: &str, engine: &str, t: &str, blocks: Vec<Vec<u32>>| KvRequest {
            transfer_id: Some(t.into()),
            ..kv(id, engine, blocks)
        };
        let v = validate(
            vec![
                with_transfer("a", "e1", "t", vec![vec![1]]),
                with_transfer("b", "e1", "t", vec![vec![2]]),
                // Another engine's transfer of the same name, and a request with nothing to
                // receive, are not the same transfer.
                with_transfer("c", "e2", "t", vec![vec![3]]),
                with_transfer("d", "e1", "t", vec![]),
            ],
            &l,
            &mut Interner::default(),
        );
        let ok: Vec<&str> = v.valid.iter().map(|(_, m)| &*m.req_id).collect();
        assert_eq!(ok, ["a", "c", "d"]);
        assert!(
            matches!(&v.rejected[..], [(1, BatchError::DuplicateTransferId { req_id, transfer_id })]
                if req_id == "b" && transfer_id == "t"),
            "{:?}",
            v.rejected
        );
    }

    #[test]
    fn grouping_is_per_engine_in_arrival_order() {
        let l = KvLayout::uniform(1, 4096, 8);
        let v = validate(
            vec![
                kv("a", "e1", vec![vec![1]]),
                kv("b", "e2", vec![vec![2]]),
                kv("c", "e1", vec![vec![3]]),
            ],
            &l,
            &mut Interner::default(),
        );
        let shape = |g: EngineGroups| -> Vec<(String, Vec<String>)> {
            g.iter()
                .map(|(k, rs)| {
                    (
                        k.1.to_string(),
                        rs.iter().map(|r| r.req_id.to_string()).collect(),
                    )
                })
                .collect()
        };
        let metas: Vec<SharedRequest> = v.valid.into_iter().map(|(_, m)| m).collect();
        assert_eq!(
            shape(group_by_engine(metas.clone())),
            [
                ("e1".into(), vec!["a".into(), "c".into()]),
                ("e2".into(), vec!["b".into()])
            ]
        );
        // One engine (the batch taken as it is), and none.
        let e1: Vec<SharedRequest> = metas
            .into_iter()
            .filter(|m| &*m.engine_id == "e1")
            .collect();
        assert_eq!(
            shape(group_by_engine(e1)),
            [("e1".into(), vec!["a".into(), "c".into()])]
        );
        assert!(group_by_engine(vec![]).is_empty());
    }

    #[test]
    fn metadata_carries_the_pull_bases_and_empty_lists_for_cleanup_pulls() {
        let l = KvLayout::uniform(2, 4096, 8);
        let v = validate(
            vec![kv("a", "e", vec![vec![3, 4]]), kv("z", "e", vec![])],
            &l,
            &mut Interner::default(),
        );
        let group: Vec<SharedRequest> = v.valid.into_iter().map(|(_, m)| m).collect();
        let d = DRank {
            tp_size: 2,
            tp_rank: 1,
            pp_size: 1,
            pp_rank: 0,
        };
        let md = pull_metadata(&l, d, ("10.0.0.7", 15000), &group, vec![0x10, 0x20]);
        // The borrowed form P receives is byte for byte the owned one.
        let arrays = LayoutArrays::new(&l);
        let blocks = req_blocks(&group);
        let blocks = ReqBlocksRef(&blocks);
        let borrowed = pull_metadata_ref(
            &arrays,
            d,
            ("10.0.0.7", 15000),
            &blocks,
            &[0x10, 0x20],
            PullLayout::default(),
        );
        assert_eq!(borrowed.encode().unwrap(), md.encode().unwrap());
        assert_eq!(
            (md.remote_hostname.as_str(), md.remote_port),
            ("10.0.0.7", 15000)
        );
        assert_eq!((md.remote_tp_size, md.remote_tp_rank), (2, 1));
        assert_eq!(md.req_blocks["a"], ("t-a".to_string(), vec![vec![3, 4]]));
        assert_eq!(md.req_blocks["z"].1, Vec::<Vec<u64>>::new());
        assert_eq!(md.kv_caches_base_addr, [0x10, 0x20]);
        assert_eq!(md.block_lens, [4096, 4096]);
        assert_eq!(md.registered_layer_names.len(), 2);
    }
}
