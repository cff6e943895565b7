//! What the host scheduler hands to `load_kv`: one batch of requests whose destination blocks
//! are allocated and must now be filled by the prefill peers.

#![forbid(unsafe_code)]

use crate::fast_hash::FastSet;
use std::borrow::Cow;
use std::sync::Arc;

use actix::Message;
use serde::Deserialize;
use thiserror::Error;

use super::block_ids::BlockGroups;
use super::request_tail::RequestTail;
use super::ids::ReqId;
use super::shared_str::SharedStr;

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
    /// Required when deserialized (an empty list is explicit), so that a misspelt key is refused
    /// rather than taken for nothing to receive.
    #[serde(deserialize_with = "exact_block_ids")]
    pub block_ids: Vec<Vec<u32>>,
}

/// A [`KvRequest`] read in place from a host's JSON (`serve`'s `load_kv` lines): the ids
/// borrow the line (an id with an escape in it is the one copied), so a request costs the
/// allocations its [`RequestMeta`] keeps and no others. The same keys, defaults and checks as
/// [`KvRequest`]: [`KvRequestRef::into_meta`] gives what [`KvRequest::into_meta`] gives.
#[derive(Debug, Deserialize)]
pub struct KvRequestRef<'a> {
    /// D's own request id.
    #[serde(borrow)]
    pub req_id: Cow<'a, str>,
    /// `transfer_id` shared with the P request.
    #[serde(default, borrow, deserialize_with = "borrowed_opt")]
    pub transfer_id: Option<Cow<'a, str>>,
    /// `engine_id` of the P DP rank the router chose.
    #[serde(default, borrow, deserialize_with = "borrowed_opt")]
    pub remote_engine_id: Option<Cow<'a, str>>,
    /// `http://host:port` of P's bootstrap server.
    #[serde(default, borrow, deserialize_with = "borrowed_opt")]
    pub remote_bootstrap_addr: Option<Cow<'a, str>>,
    /// As [`KvRequest::block_ids`] (required, read at exact length).
    #[serde(deserialize_with = "exact_block_ids")]
    pub block_ids: Vec<Vec<u32>>,
}

impl KvRequestRef<'_> {
    /// The request's metadata, as [`KvRequest::into_meta`] (the block lists are copied into
    /// the metadata's one buffer).
    pub fn into_meta(self, interner: &mut Interner) -> Result<RequestMeta, BatchError> {
        Fields {
            req_id: &self.req_id,
            transfer_id: self.transfer_id.as_deref(),
            engine_id: self.remote_engine_id.as_deref(),
            bootstrap: self.remote_bootstrap_addr.as_deref(),
        }
        .into_meta(self.block_ids, interner)
    }
}

/// An optional string that borrows the input when it can: serde's own `Option<Cow<str>>`
/// always copies (only a `Cow` field marked `borrow` borrows).
fn borrowed_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    #[derive(Deserialize)]
    struct Borrowed<'a>(#[serde(borrow)] Cow<'a, str>);
    Ok(Option::<Borrowed<'de>>::deserialize(d)?.map(|b| b.0))
}

/// A request's ids, borrowed from whichever form it was read in.
struct Fields<'a> {
    req_id: &'a str,
    transfer_id: Option<&'a str>,
    engine_id: Option<&'a str>,
    bootstrap: Option<&'a str>,
}

/// `block_ids` read into vectors of exactly their length: a request keeps its lists for as long
/// as it is in flight, and a list grown element by element (the default) has slack that
/// [`KvRequest::into_meta`] would reallocate away, two reallocations per request.
fn exact_block_ids<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Vec<u32>>, D::Error> {
    use serde::de::{SeqAccess, Visitor};
    use smallvec::SmallVec;

    struct Group;
    impl<'de> serde::de::DeserializeSeed<'de> for Group {
        type Value = Vec<u32>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<u32>, D::Error> {
            d.deserialize_seq(Group)
        }
    }
    impl<'de> Visitor<'de> for Group {
        type Value = Vec<u32>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of block ids")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
            let mut v: SmallVec<[u32; 32]> = SmallVec::new();
            while let Some(b) = seq.next_element()? {
                v.push(b);
            }
            Ok(v.to_vec())
        }
    }
    struct Groups;
    impl<'de> Visitor<'de> for Groups {
        type Value = Vec<Vec<u32>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of block id lists, one per KV-cache group")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Vec<u32>>, A::Error> {
            let mut v: SmallVec<[Vec<u32>; 4]> = SmallVec::new();
            while let Some(g) = seq.next_element_seed(Group)? {
                v.push(g);
            }
            let mut out = Vec::with_capacity(v.len());
            out.extend(v);
            Ok(out)
        }
    }
    d.deserialize_seq(Groups)
}

/// The longest request id, transfer id, engine id or bootstrap address accepted, bytes: far
/// above what vLLM writes (a few dozen bytes; a client's `X-Request-Id` header can make a
/// request id longer, within an HTTP server's 8 KiB header limit), low enough that a pull
/// carrying many of them stays small.
pub const MAX_ID_BYTES: usize = 16 * 1024;

/// A request of `load_kv` that cannot be pulled.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BatchError {
    #[error(
        "request {req_id}: missing `{field}` in kv_transfer_params; no pull can be started for it"
    )]
    /// A field the request needs is absent.
    MissingField {
        /// The request refused.
        req_id: String,
        /// The field.
        field: &'static str,
    },
    #[error("request {req_id:?}: `{field}` is empty")]
    /// A field the request needs is empty.
    EmptyField {
        /// The request refused.
        req_id: String,
        /// The field.
        field: &'static str,
    },
    #[error("request {req_id}: {field} is {len} bytes, over the {max} an id may have")]
    /// An id or address longer than any vLLM writes ([`MAX_ID_BYTES`]); `req_id` is cut to
    /// its first 64 characters here.
    TooLong {
        /// The request refused (its first 64 characters).
        req_id: String,
        /// The field.
        field: &'static str,
        /// Its length, bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    #[error("request {req_id} appears twice in the batch")]
    /// The same request twice in one batch.
    Duplicate {
        /// The request refused.
        req_id: String,
    },
    #[error(
        "request {req_id}: transfer_id {transfer_id} is already another request's in the batch \
         (P keys its transfers by it: two requests cannot share one)"
    )]
    /// Two requests of one batch name the same P transfer (same engine and `transfer_id`).
    DuplicateTransferId {
        /// The request refused.
        req_id: String,
        /// The transfer it shares.
        transfer_id: String,
    },
    #[error("request {req_id}: block id {block} is outside the pool of {num_blocks} blocks")]
    /// A block id outside the layout's pool.
    BlockOutOfRange {
        /// The request refused.
        req_id: String,
        /// The offending block.
        block: u32,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    #[error("request {req_id}: {groups} KV-cache groups, the layout has {expected}")]
    /// Block lists for a different number of KV-cache groups than the layout.
    GroupCount {
        /// The request refused.
        req_id: String,
        /// Groups the request lists.
        groups: usize,
        /// Groups the layout has.
        expected: usize,
    },
    #[error("request {req_id}: remote_bootstrap_addr {addr:?} is not http://host:port ({reason})")]
    /// The bootstrap address is not an `http://host:port` URL.
    BadBootstrapAddr {
        /// The request refused.
        req_id: String,
        /// The address given.
        addr: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    #[error("request {req_id}: block {block} is listed twice in KV-cache group {group}")]
    /// A block listed twice in one group: two peers would write it.
    DuplicateBlock {
        /// The request refused.
        req_id: String,
        /// The group.
        group: usize,
        /// The block.
        block: u32,
    },
    #[error(
        "request {req_id} is still in flight or its completion was not drained yet; \
         load it again only after drain returned it"
    )]
    /// The request id is still live (loaded, not yet drained).
    AlreadyLive {
        /// The request refused.
        req_id: String,
    },
    #[error(
        "request {req_id}: block {block} of KV-cache group {group} belongs to request {owner}, \
         which is still in flight or quarantined"
    )]
    /// A block still held by another live request.
    BlockInUse {
        /// The request refused.
        req_id: String,
        /// The group.
        group: usize,
        /// The block.
        block: u32,
        /// The live request holding it.
        owner: String,
    },
    #[error("request {req_id}: the coordinator is not running")]
    /// The coordinator is not running.
    Unavailable {
        /// The request refused.
        req_id: String,
    },
    #[error("request {req_id}: kvrecv is paused (sleep mode): nothing is admitted until resume")]
    /// The worker is paused ([`KvRecv::pause`](crate::embed::KvRecv::pause)): nothing lands, so nothing is
    /// admitted; load it again after [`KvRecv::resume`](crate::embed::KvRecv::resume).
    Paused {
        /// The request refused.
        req_id: String,
    },
    #[error(
        "request {req_id}: {live} requests are live (the limit is {limit}); drain, then retry"
    )]
    /// Too many live requests; retry after a drain.
    Backpressure {
        /// The request refused.
        req_id: String,
        /// Requests live now.
        live: usize,
        /// The configured limit.
        limit: usize,
    },
    #[error(
        "request {req_id}: a submitted batch of {batch} requests is over the limit of {limit} \
         live requests and can never fit; submit smaller batches"
    )]
    /// A [`KvRecv::submit`](crate::KvRecv::submit) batch larger than `max_live_requests` (all or nothing: no
    /// drain makes room for it).
    BatchOverLimit {
        /// The request refused.
        req_id: String,
        /// Requests in the batch.
        batch: usize,
        /// The configured limit.
        limit: usize,
    },
}

impl BatchError {
    /// The refused request's id.
    pub fn req_id(&self) -> &str {
        match self {
            BatchError::MissingField { req_id, .. }
            | BatchError::EmptyField { req_id, .. }
            | BatchError::TooLong { req_id, .. }
            | BatchError::Duplicate { req_id }
            | BatchError::DuplicateTransferId { req_id, .. }
            | BatchError::BlockOutOfRange { req_id, .. }
            | BatchError::GroupCount { req_id, .. }
            | BatchError::BadBootstrapAddr { req_id, .. }
            | BatchError::DuplicateBlock { req_id, .. }
            | BatchError::AlreadyLive { req_id }
            | BatchError::BlockInUse { req_id, .. }
            | BatchError::Unavailable { req_id }
            | BatchError::Paused { req_id }
            | BatchError::Backpressure { req_id, .. }
            | BatchError::BatchOverLimit { req_id, .. } => req_id,
        }
    }

    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BatchError::MissingField { .. } | BatchError::EmptyField { .. } => "missing_field",
            BatchError::TooLong { .. } => "too_long",
            BatchError::Duplicate { .. } => "duplicate_in_batch",
            BatchError::DuplicateTransferId { .. } => "duplicate_transfer_id",
            BatchError::BlockOutOfRange { .. } => "block_out_of_range",
            BatchError::GroupCount { .. } => "group_count",
            BatchError::BadBootstrapAddr { .. } => "bad_bootstrap_addr",
            BatchError::DuplicateBlock { .. } => "duplicate_block",
            BatchError::AlreadyLive { .. } => "already_live",
            BatchError::BlockInUse { .. } => "block_in_use",
            BatchError::Unavailable { .. } => "unavailable",
            BatchError::Paused { .. } => "paused",
            BatchError::Backpressure { .. } => "backpressure",
            BatchError::BatchOverLimit { .. } => "batch_over_limit",
        }
    }
}

/// Check that `addr` is `http://host:port` (a trailing `/` already trimmed): vLLM appends
/// `/query`, and a URL the HTTP client would read differently (no port, port 99999 read as 80)
/// must be refused here rather than reach the wrong host.
///
/// ```
/// use kvrecv::messages::batch::check_bootstrap_addr;
/// assert!(check_bootstrap_addr("http://10.0.0.7:8998").is_ok());
/// assert!(check_bootstrap_addr("http://[::1]:8998").is_ok());
/// assert!(check_bootstrap_addr("http://10.0.0.7:99999").is_err());
/// assert!(check_bootstrap_addr("http://10.0.0.7").is_err());
/// assert!(check_bootstrap_addr("http://p%31:8998").is_err());
/// ```
pub fn check_bootstrap_addr(addr: &str) -> Result<(), &'static str> {
    let scheme = addr.get(..7).filter(|s| s.eq_ignore_ascii_case("http://"));
    let rest = scheme
        .map(|_| &addr[7..])
        .ok_or("the scheme must be http")?;
    if rest.contains(['/', '?', '#', '@']) || rest.chars().any(|c| c.is_whitespace()) {
        return Err("only scheme, host and port are allowed");
    }
    let (host, port) = match rest.strip_prefix('[') {
        // IPv6 literal: [addr]:port
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or("unclosed '['")?;
            let port = after.strip_prefix(':').ok_or("no port")?;
            if !host
                .chars()
                .all(|c| c.is_ascii_hexdigit() || ":.%".contains(c))
                || host.is_empty()
            {
                return Err("bad IPv6 host");
            }
            (host, port)
        }
        None => {
            let (host, port) = rest.rsplit_once(':').ok_or("no port")?;
            if host.contains(':') {
                return Err("an IPv6 host needs brackets");
            }
            // A DNS name or IPv4 address: what the HTTP client accepts without percent-escapes
            // (anything else was accepted here and failed later, at the lookup).
            if !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
            {
                return Err("the host may hold only letters, digits, '-', '.' and '_'");
            }
            (host, port)
        }
    };
    if host.is_empty() {
        return Err("empty host");
    }
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err("the port must be a decimal number");
    }
    match port.parse::<u32>() {
        Ok(1..=65535) => Ok(()),
        _ => Err("the port must be in 1..=65535"),
    }
}

/// A validated request, shared (`Arc`) by every actor that needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct RequestMeta {
    /// vLLM's request id (the key of every event and drain).
    pub req_id: ReqId,
    /// P's engine id (shared by every request of the engine, see [`Interner`]; one pointer).
    pub engine_id: SharedStr,
    /// P's bootstrap server (shared likewise).
    pub bootstrap_addr: SharedStr,
    /// Destination blocks and the transfer id, in one allocation.
    tail: RequestTail,
}

/// Shares the strings many requests repeat (engine ids, bootstrap addresses): one allocation
/// per distinct value, not one per request. Bounded: past `cap` distinct values (only a host
/// sending ever-new engines) it starts over, which costs sharing, never correctness.
#[derive(Debug, Default)]
pub struct Interner {
    seen: FastSet<SharedStr>,
    /// Bootstrap addresses that passed [`check_bootstrap_addr`] (checked once, not per request).
    bootstraps: FastSet<SharedStr>,
}

impl Interner {
    const CAP: usize = 4096;

    /// Whether `addr` already passed [`check_bootstrap_addr`].
    fn checked_bootstrap(&mut self, addr: &str) -> bool {
        self.bootstraps.contains(addr)
    }

    /// Remember that `addr` passed [`check_bootstrap_addr`].
    fn bootstrap_ok(&mut self, addr: &str) {
        if self.bootstraps.len() >= Self::CAP {
            self.bootstraps.clear();
        }
        let a = self.intern(addr);
        self.bootstraps.insert(a);
    }

    /// The shared copy of `s`.
    pub fn intern(&mut self, s: &str) -> SharedStr {
        match self.seen.get(s) {
            Some(a) => a.clone(),
            None => {
                if self.seen.len() >= Self::CAP {
                    self.seen.clear();
                }
                let a = SharedStr::from(s);
                self.seen.insert(a.clone());
                a
            }
        }
    }
}

impl RequestMeta {
    /// A request's metadata: `block_ids` one list per KV-cache group.
    pub fn new<G: AsRef<[u32]>>(
        req_id: impl Into<ReqId>,
        transfer_id: &str,
        engine_id: impl Into<SharedStr>,
        bootstrap_addr: impl Into<SharedStr>,
        block_ids: &[G],
    ) -> Self {
        RequestMeta {
            req_id: req_id.into(),
            engine_id: engine_id.into(),
            bootstrap_addr: bootstrap_addr.into(),
            tail: RequestTail::new(block_ids, transfer_id),
        }
    }

    /// P's transfer id for the request.
    pub fn transfer_id(&self) -> &str {
        self.tail.transfer_id()
    }

    /// Destination blocks, one list per KV-cache group.
    pub fn block_ids(&self) -> BlockGroups<'_> {
        self.tail.block_ids()
    }

    /// Awaiting = the scheduler waits for a completion (there is at least one destination block).
    pub fn is_awaiting(&self) -> bool {
        self.block_ids().iter().any(|g| !g.is_empty())
    }

    /// All destination block ids, every group.
    pub fn all_blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.block_ids().iter().flatten().copied()
    }
}

impl KvRequest {
    /// Check the three keys vLLM needs (PROTOCOL.md §4); a missing one would leave the request
    /// waiting forever, so it is refused here instead.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn validate(&self) -> Result<RequestMeta, BatchError> {
        self.validate_with(&mut Interner::default())
    }

    /// [`Self::validate`], sharing engine ids and bootstrap addresses through `interner`.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub(crate) fn validate_with(&self, interner: &mut Interner) -> Result<RequestMeta, BatchError> {
        self.clone().into_meta(interner)
    }

    /// [`Self::validate_with`], taking the request: its block lists are copied into one
    /// allocation for every group (the metadata lives as long as the request).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn into_meta(self, interner: &mut Interner) -> Result<RequestMeta, BatchError> {
        // One path for both forms: the owned request is read as the borrowed one.
        fn borrowed(s: &Option<String>) -> Option<Cow<'_, str>> {
            s.as_deref().map(Cow::Borrowed)
        }
        KvRequestRef {
            req_id: Cow::Borrowed(&self.req_id),
            transfer_id: borrowed(&self.transfer_id),
            remote_engine_id: borrowed(&self.remote_engine_id),
            remote_bootstrap_addr: borrowed(&self.remote_bootstrap_addr),
            block_ids: self.block_ids,
        }
        .into_meta(interner)
    }
}

impl<'a> Fields<'a> {
    /// The metadata of a valid request, its block lists and transfer id in one allocation
    /// ([`RequestTail`]: they live as long as the request).
    fn into_meta(
        self,
        block_ids: Vec<Vec<u32>>,
        interner: &mut Interner,
    ) -> Result<RequestMeta, BatchError> {
        let (transfer_id, engine_id, bootstrap) = self.checked(&block_ids, interner)?;
        Ok(RequestMeta {
            req_id: ReqId::from(self.req_id),
            engine_id: interner.intern(engine_id),
            bootstrap_addr: interner.intern(bootstrap),
            tail: RequestTail::new(&block_ids, transfer_id),
        })
    }

    /// Every check of [`KvRequest::validate`]: the transfer id, engine id and bootstrap
    /// address (its trailing `/` trimmed) of a valid request.
    fn checked(
        &self,
        block_ids: &[Vec<u32>],
        interner: &mut Interner,
    ) -> Result<(&'a str, &'a str, &'a str), BatchError> {
        let req_id = self.req_id;
        let field = |v: Option<&'a str>, name: &'static str| match v {
            None => Err(BatchError::MissingField {
                req_id: req_id.to_owned(),
                field: name,
            }),
            Some("") => Err(BatchError::EmptyField {
                req_id: req_id.to_owned(),
                field: name,
            }),
            Some(s) => Ok(s),
        };
        if req_id.is_empty() {
            return Err(BatchError::EmptyField {
                req_id: String::new(),
                field: "req_id",
            });
        }
        let too_long = |field: &'static str, v: &str| {
            (v.len() > MAX_ID_BYTES).then(|| BatchError::TooLong {
                req_id: req_id.chars().take(64).collect(),
                field,
                len: v.len(),
                max: MAX_ID_BYTES,
            })
        };
        if let Some(e) = too_long("req_id", req_id) {
            return Err(e);
        }
        let transfer_id = field(self.transfer_id, "transfer_id")?;
        let engine_id = field(self.engine_id, "remote_engine_id")?;
        let bootstrap = field(self.bootstrap, "remote_bootstrap_addr")?;
        for (name, v) in [
            ("transfer_id", transfer_id),
            ("remote_engine_id", engine_id),
            ("remote_bootstrap_addr", bootstrap),
        ] {
            if let Some(e) = too_long(name, v) {
                return Err(e);
            }
        }
        let bootstrap = bootstrap.trim_end_matches('/');
        if !interner.checked_bootstrap(bootstrap) {
            check_bootstrap_addr(bootstrap).map_err(|reason| BatchError::BadBootstrapAddr {
                req_id: req_id.to_owned(),
                addr: bootstrap.to_owned(),
                reason,
            })?;
            interner.bootstrap_ok(bootstrap);
        }
        check_unique_blocks(req_id, block_ids)?;
        Ok((transfer_id, engine_id, bootstrap))
    }
}

/// A block listed twice in one group would be written twice by every peer and released
/// twice; block ids are unique only within a group (PROTOCOL.md §4).
fn check_unique_blocks(req_id: &str, block_ids: &[Vec<u32>]) -> Result<(), BatchError> {
    for (group, blocks) in block_ids.iter().enumerate() {
        // A request's blocks are few (a long prompt's a few hundred): a pairwise scan of a
        // short list costs less than building a set.
        let dup = if blocks.len() <= 32 {
            blocks
                .iter()
                .enumerate()
                .find(|(i, b)| blocks[..*i].contains(b))
                .map(|(_, &b)| b)
        } else {
            let mut seen = FastSet::with_capacity_and_hasher(blocks.len(), Default::default());
            blocks.iter().find(|b| !seen.insert(**b)).copied()
        };
        if let Some(block) = dup {
            return Err(BatchError::DuplicateBlock {
                req_id: req_id.to_owned(),
                group,
                block,
            });
        }
    }
    Ok(())
}

/// Host -> Receiver: start receiving a batch. Answered once every request was validated; the
/// pulls proceed in the background.
#[derive(Debug, Message)]
#[rtype(result = "LoadKvReply")]
pub struct LoadKv {
    /// The batch, in vLLM's order.
    pub requests: Vec<KvRequest>,
}

/// Host -> Receiver: [`LoadKv`] whose reply goes to a channel the host reads when it chooses
/// ([`KvRecv::submit`](crate::KvRecv::submit)). A host that checks the reply at its next step, rather than
/// awaiting it, is not woken for it: the reply waits in the channel.
#[derive(Debug, Message)]
#[rtype(result = "()")]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct LoadKvTo {
    /// The batch.
    pub batch: LoadKv,
    /// Where the reply goes (dropped unanswered if the Receiver stopped).
    pub reply: tokio::sync::oneshot::Sender<LoadKvReply>,
    /// Counts the batch's requests as queued until the Receiver takes the batch.
    pub queued: Queued,
}

/// A batch's requests counted in a host's queue of submitted batches, until this is dropped
/// (the Receiver took the batch, or a stopped one dropped it unread).
#[derive(Debug)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Queued {
    count: Arc<std::sync::atomic::AtomicUsize>,
    n: usize,
}

impl Queued {
    /// Count `n` more requests in `count`, unless that would make more than `limit`: then
    /// `Err` with how many are queued already.
    pub fn try_add(
        count: &Arc<std::sync::atomic::AtomicUsize>,
        n: usize,
        limit: usize,
    ) -> Result<Queued, usize> {
        use std::sync::atomic::Ordering;
        let before = count.fetch_add(n, Ordering::AcqRel);
        if before.saturating_add(n) > limit {
            count.fetch_sub(n, Ordering::AcqRel);
            return Err(before);
        }
        Ok(Queued {
            count: Arc::clone(count),
            n,
        })
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.count
            .fetch_sub(self.n, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Host -> Receiver: [`LoadKv`] for a host that reads its requests itself (`serve` reads its
/// JSON lines in place, as `KvRequestRef`s): each request already turned into its metadata
/// (with the host's own `Interner`) or refused with why, in the batch's order. The Receiver
/// checks the rest (layout, duplicates) and answers as for [`LoadKv`].
#[derive(Debug, Message)]
#[rtype(result = "LoadKvReply")]
pub struct LoadMetas {
    /// The batch, in vLLM's order.
    pub requests: Vec<Result<RequestMeta, BatchError>>,
}

/// Reply to [`LoadKv`]: the valid requests proceed, each invalid one is refused with its reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, actix::MessageResponse)]
pub struct LoadKvReply {
    /// Requests taken (awaited or not).
    pub accepted: usize,
    /// Of those, the ones awaiting a receive.
    pub awaiting: usize,
    /// Requests refused, with why; nothing was started for them.
    pub rejected: Vec<BatchError>,
}

/// Shared request metadata.
pub type SharedRequest = Arc<RequestMeta>;

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
