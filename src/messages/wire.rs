//! The two control-plane structs of vLLM's MooncakeConnector, byte-compatible with msgspec
//! (`omit_defaults=True`, map form, declaration order; PROTOCOL.md §2.3–§2.5).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_repr::{Deserialize_repr, Serialize_repr};
use thiserror::Error;

use super::block_ids::BlockGroups;
use super::msgpack_strict::{check_map_document, check_map_document_capped, ListCap, StrictError};

/// A `req_blocks` value: (`transfer_id`, one list of logical block ids per KV-cache group).
pub type ReqBlocks = (String, Vec<Vec<u64>>);

/// D -> P: write these requests into these blocks.
///
/// ```
/// use kvrecv::messages::MooncakeXferMetadata;
/// let m = MooncakeXferMetadata::minimal("h", 1, 1, 0);
/// let bytes = m.encode().unwrap();
/// assert_eq!(bytes[0], 0x88); // a map of the 8 required keys
/// assert_eq!(MooncakeXferMetadata::decode(&bytes).unwrap(), m);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MooncakeXferMetadata {
    pub remote_hostname: String,
    pub remote_port: u32,
    pub remote_tp_size: u32,
    pub remote_tp_rank: u32,
    pub req_blocks: BTreeMap<String, ReqBlocks>,
    pub kv_caches_base_addr: Vec<u64>,
    pub block_lens: Vec<u64>,
    pub kv_block_lens: Vec<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registered_layer_names: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registered_layer_indices: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registered_group_indices: Vec<u32>,
    /// vLLM 0.33: per region, the KV-cache groups sharing it (kvrecv never sends it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registered_shared_group_ids: Vec<Vec<u32>>,
    /// vLLM 0.33: per region, its byte offset in the block row, -1 unknown (never sent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registered_row_offsets: Vec<i64>,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub remote_pp_size: u32,
    /// vLLM 0.33: the id of the layout this pull lands through (0: none; PROTOCOL.md §2.7).
    /// With empty layout lists it asks P for the layout it cached under this id.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub layout_id: u64,
}

/// One pull's metadata borrowed from its batch and layout: encodes to exactly the bytes of the
/// equivalent [`MooncakeXferMetadata`] (same keys, order and omissions) without copying a
/// request's ids and blocks into owned strings and vectors first (the receive path encodes one
/// per pull and peer).
#[derive(Debug, Clone, Serialize)]
pub struct MetadataRef<'a> {
    pub remote_hostname: &'a str,
    pub remote_port: u32,
    pub remote_tp_size: u32,
    pub remote_tp_rank: u32,
    /// Borrowed: every peer's pull of a batch carries the same.
    pub req_blocks: &'a ReqBlocksRef<'a>,
    pub kv_caches_base_addr: &'a [u64],
    pub block_lens: &'a [u64],
    pub kv_block_lens: &'a [u64],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub registered_layer_names: &'a [String],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub registered_layer_indices: &'a [u32],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub registered_group_indices: &'a [u32],
    #[serde(skip_serializing_if = "is_one")]
    pub remote_pp_size: u32,
    /// The pull's layout id (0: none, omitted); see [`MooncakeXferMetadata::layout_id`].
    #[serde(skip_serializing_if = "is_zero")]
    pub layout_id: u64,
}

/// One entry of `req_blocks`, borrowed: (request id, transfer id, blocks per group).
pub type ReqBlock<'a> = (&'a str, &'a str, BlockGroups<'a>);

/// `req_blocks`, borrowed, sorted by request id (the order a `BTreeMap` gives the owned form),
/// ids unique. A slice, so that whoever builds the list chooses its storage (the Receiver's
/// is inline for a batch of one).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReqBlocksRef<'a>(pub &'a [ReqBlock<'a>]);

impl Serialize for ReqBlocksRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (id, transfer, blocks) in self.0 {
            m.serialize_entry(id, &(transfer, blocks))?;
        }
        m.end()
    }
}

/// A msgpack list's length header, refused past what it can say.
fn list_len(n: usize) -> Result<u32, WireError> {
    u32::try_from(n).map_err(|_| {
        WireError::Encode(rmp_serde::encode::Error::Syntax(
            "a msgpack list holds at most 2^32 - 1 items".into(),
        ))
    })
}

impl ReqBlocksRef<'_> {
    /// The bytes [`Serialize`] gives, written straight into `buf`: every pull encodes its own
    /// `req_blocks`, and through serde each of its ids and blocks cost a serializer step
    /// (half the pull's encoding, `callgrind` of serve at TP2, batch 16).
    fn write_to(&self, buf: &mut Vec<u8>) -> Result<(), WireError> {
        use rmp::encode::{write_array_len, write_map_len, write_str, write_uint};
        let e = rmp_serde::encode::Error::from;
        write_map_len(buf, list_len(self.0.len())?).map_err(e)?;
        for (id, transfer, blocks) in self.0 {
            write_str(buf, id).map_err(e)?;
            write_array_len(buf, 2).map_err(e)?;
            write_str(buf, transfer).map_err(e)?;
            write_array_len(buf, list_len(blocks.len())?).map_err(e)?;
            for group in blocks.iter() {
                write_array_len(buf, list_len(group.len())?).map_err(e)?;
                for &b in group {
                    write_uint(buf, u64::from(b)).map_err(e)?;
                }
            }
        }
        Ok(())
    }
}

impl MetadataRef<'_> {
    /// The msgpack bytes P receives.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        encode_named(self)
    }

    /// The same bytes as [`MetadataRef::encode`], with the entries after `kv_caches_base_addr`
    /// taken from `tail` (encoded once) instead of from `self`'s lists: a pull then encodes only
    /// what is its own. `tail` must come from a metadata with the same layout and PP size
    /// ([`MetadataTail::of`]); the lists in `self` are not read.
    pub fn encode_with(&self, tail: &MetadataTail) -> Result<Vec<u8>, WireError> {
        if (self.layout_id != 0) != tail.has_layout_id {
            // The tail's entry count says whether a `layout_id` follows: not this pull's.
            return self.encode();
        }
        let mut buf = Vec::with_capacity(tail.bytes.len() + self.head_len_bound());
        // Written with rmp's own calls, the bytes serde's serializer would write for each
        // (the most compact int, a str, an array of ints), without a serializer per entry.
        use rmp::encode::{write_array_len, write_str, write_uint};
        let e = rmp_serde::encode::Error::from;
        match &tail.head {
            // D's endpoint and ranks are the same in every pull of a coordinator.
            Some(head) if head.is_of(self) => buf.extend_from_slice(&head.bytes),
            _ => self.write_endpoint(&mut buf, tail.entries)?,
        }
        self.req_blocks.write_to(&mut buf)?;
        write_str(&mut buf, "kv_caches_base_addr").map_err(e)?;
        write_array_len(&mut buf, list_len(self.kv_caches_base_addr.len())?).map_err(e)?;
        for &b in self.kv_caches_base_addr {
            write_uint(&mut buf, b).map_err(e)?;
        }
        buf.extend_from_slice(&tail.bytes);
        if self.layout_id != 0 {
            // Per pull (one id per landing window), so not part of the pre-encoded tail.
            write_str(&mut buf, "layout_id").map_err(e)?;
            write_uint(&mut buf, self.layout_id).map_err(e)?;
        }
        Ok(buf)
    }

    /// The map's header and the entries before `req_blocks`'s value (D's endpoint and ranks).
    fn write_endpoint(&self, buf: &mut Vec<u8>, tail_entries: u32) -> Result<(), WireError> {
        use rmp::encode::{write_map_len, write_str, write_uint};
        let e = rmp_serde::encode::Error::from;
        write_map_len(buf, HEAD_ENTRIES + tail_entries).map_err(e)?;
        write_str(buf, "remote_hostname").map_err(e)?;
        write_str(buf, self.remote_hostname).map_err(e)?;
        for (key, v) in [
            ("remote_port", self.remote_port),
            ("remote_tp_size", self.remote_tp_size),
            ("remote_tp_rank", self.remote_tp_rank),
        ] {
            write_str(buf, key).map_err(e)?;
            write_uint(buf, u64::from(v)).map_err(e)?;
        }
        write_str(buf, "req_blocks").map_err(e)?;
        Ok(())
    }

    /// At least the encoded length of the head entries (up to `kv_caches_base_addr`), so a
    /// pull's buffer is allocated once: keys and headers (~100 B), the strings, at most 9 B
    /// per number.
    fn head_len_bound(&self) -> usize {
        let blocks: usize = self
            .req_blocks
            .0
            .iter()
            .map(|(id, t, groups)| {
                id.len() + t.len() + 16 + groups.iter().map(|g| 5 + 9 * g.len()).sum::<usize>()
            })
            .sum();
        // (+ `layout_id`: 10 B of key, 9 B of value at most)
        148 + self.remote_hostname.len() + 9 * self.kv_caches_base_addr.len() + blocks
    }
}

/// Entries of [`MetadataRef`] up to `kv_caches_base_addr`: the ones a pull encodes itself.
const HEAD_ENTRIES: u32 = 6;

/// The entries of a pull's metadata after `kv_caches_base_addr` (the layout's lists and D's PP
/// size, each omitted as msgspec omits it), encoded: the same in every pull of a coordinator.
/// A layout of 80 layers repeats 80 layer names in every pull; encoding them once keeps a
/// pull's cost flat in the number of layers. A pull that omits its layout (vLLM 0.33) has a
/// tail of its own: empty `block_lens` and `kv_block_lens`, no `registered_*` (made by
/// [`MetadataTail::of`] from a metadata with empty lists). A `layout_id`, if any, is written
/// per pull after the tail; the tail only counts it.
#[derive(Debug, Clone)]
pub struct MetadataTail {
    bytes: Vec<u8>,
    /// Entries after `kv_caches_base_addr`, `layout_id` included.
    entries: u32,
    /// Whether the pulls this tail ends carry a (non-zero) `layout_id`.
    has_layout_id: bool,
    /// The head before `req_blocks`'s value for one endpoint, encoded (see [`Self::with_head`]).
    head: Option<EncodedHead>,
}

/// The map header and D's endpoint and ranks, encoded for the metadata they were taken from.
#[derive(Debug, Clone)]
struct EncodedHead {
    hostname: String,
    port: u32,
    tp: (u32, u32),
    bytes: Vec<u8>,
}

impl EncodedHead {
    /// Whether `md` has the endpoint and ranks these bytes say.
    fn is_of(&self, md: &MetadataRef<'_>) -> bool {
        self.hostname == md.remote_hostname
            && self.port == md.remote_port
            && self.tp == (md.remote_tp_size, md.remote_tp_rank)
    }
}

impl MetadataTail {
    /// The tail of `md` (its head entries are not read).
    pub fn of(md: &MetadataRef<'_>) -> Result<Self, WireError> {
        let mut t = MetadataTail {
            bytes: Vec::new(),
            entries: 0,
            has_layout_id: md.layout_id != 0,
            head: None,
        };
        // In declaration order, each omitted as `MetadataRef`'s `skip_serializing_if` omits it.
        t.put("block_lens", md.block_lens, false)?;
        t.put("kv_block_lens", md.kv_block_lens, false)?;
        let names = md.registered_layer_names;
        t.put("registered_layer_names", names, names.is_empty())?;
        let indices = md.registered_layer_indices;
        t.put("registered_layer_indices", indices, indices.is_empty())?;
        let groups = md.registered_group_indices;
        t.put("registered_group_indices", groups, groups.is_empty())?;
        let pp = md.remote_pp_size;
        t.put("remote_pp_size", &pp, is_one(&pp))?;
        // Counted in the map's header; its value is each pull's own.
        t.entries += u32::from(t.has_layout_id);
        Ok(t)
    }

    /// This tail, with `md`'s endpoint and ranks encoded too: a metadata with the same ones
    /// copies them instead of writing four keys and values (every pull of a coordinator has
    /// the same). Any other metadata is written in full, so the bytes never depend on it.
    pub fn with_head(mut self, md: &MetadataRef<'_>) -> Result<Self, WireError> {
        let mut bytes = Vec::new();
        md.write_endpoint(&mut bytes, self.entries)?;
        self.head = Some(EncodedHead {
            hostname: md.remote_hostname.to_owned(),
            port: md.remote_port,
            tp: (md.remote_tp_size, md.remote_tp_rank),
            bytes,
        });
        Ok(self)
    }

    fn put<T: Serialize + ?Sized>(
        &mut self,
        key: &str,
        v: &T,
        omit: bool,
    ) -> Result<(), WireError> {
        if !omit {
            entry(&mut self.bytes, key, v)?;
            self.entries += 1;
        }
        Ok(())
    }
}

/// One map entry as `rmp_serde::to_vec_named` writes a struct field: the key as a str, then
/// the value.
fn entry<T: Serialize + ?Sized>(buf: &mut Vec<u8>, key: &str, v: &T) -> Result<(), WireError> {
    let mut ser = rmp_serde::Serializer::new(buf).with_struct_map();
    key.serialize(&mut ser)?;
    v.serialize(&mut ser)?;
    Ok(())
}

fn one() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A `layout_id` as msgspec reads an `int`: any msgpack int. None D draws is negative, so a
/// negative one (P echoing what D never sent) is read as 0, which acks nothing.
fn any_int_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    struct V;
    impl serde::de::Visitor<'_> for V {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an int")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
            Ok(u64::try_from(v).unwrap_or(0))
        }
    }
    d.deserialize_any(V)
}

/// Response status (a plain int on the wire; anything outside {0, 1, 2, 3} is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize_repr, Deserialize_repr)]
#[repr(u8)]
pub enum XferStatus {
    Finish = 0,
    Continue = 1,
    Error = 2,
    /// vLLM 0.33: P does not hold the layout of the pull's `layout_id` (the pull omitted it);
    /// it wrote nothing and the pull is over. D resends the pull with its layout.
    LayoutMiss = 3,
}

/// P -> D: the outcome of one ready subset (CONTINUE / FINISH) or of the whole pull (ERROR).
/// `None`, `[]` and an absent key mean the same; unknown keys are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MooncakeXferResponse {
    pub status: XferStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ok_reqs: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub err_reqs: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub err_msg: Option<String>,
    /// vLLM 0.33: the pull's `layout_id`, echoed in its CONTINUE and FINISH once P holds that
    /// layout (0: omitted; a P of 0.32 or older never sends it).
    #[serde(
        default,
        skip_serializing_if = "is_zero",
        deserialize_with = "any_int_id"
    )]
    pub layout_id: u64,
}

/// A reply's `ok_reqs` or `err_reqs`, borrowed; inline for one id (a reply at batch 1 allocates
/// nothing).
/// Speed only: the seven lists inline for one save 5.0% of the instructions per request at batch 1
/// (`scripts/callgrind-core`; DESIGN.md §10).
pub type IdList<'a> = smallvec::SmallVec<[&'a str; 1]>;

/// A [`MooncakeXferResponse`] read in place: its ids and message borrow the frame. D reads a
/// reply once, to settle the requests it names, so owned copies of the ids would be allocated
/// only to be freed (two replies of 16 ids were 32 allocations per batch). The owned type
/// decodes through this one: both accept and refuse exactly the same bytes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct XferReplyRef<'a> {
    pub status: XferStatus,
    #[serde(default, borrow)]
    pub ok_reqs: Option<IdList<'a>>,
    #[serde(default, borrow)]
    pub err_reqs: Option<IdList<'a>>,
    #[serde(default, borrow)]
    pub err_msg: Option<&'a str>,
    /// The echoed `layout_id` (0 when absent).
    #[serde(default, deserialize_with = "any_int_id")]
    pub layout_id: u64,
}

impl<'a> XferReplyRef<'a> {
    /// What [`Self::decode_bounded`] did before it read a reply in one pass: the strict check,
    /// then serde. Kept as the reference it is tested against (by the tests and benches only).
    pub fn decode_by_serde(buf: &'a [u8], max_ids: usize) -> Result<Self, WireError> {
        check_map_document_capped(
            buf,
            Some(ListCap {
                keys: &["ok_reqs", "err_reqs"],
                max_items: max_ids,
            }),
        )?;
        Ok(rmp_serde::from_slice(buf)?)
    }

    /// `ok_reqs` with nil, `[]` and absence alike.
    pub fn ok(&self) -> &[&'a str] {
        self.ok_reqs.as_deref().unwrap_or(&[])
    }

    /// `err_reqs` with nil, `[]` and absence alike.
    pub fn err(&self) -> &[&'a str] {
        self.err_reqs.as_deref().unwrap_or(&[])
    }

    /// The owned reply.
    pub fn owned(&self) -> MooncakeXferResponse {
        let owned = |v: &Option<IdList<'_>>| {
            v.as_ref()
                .map(|ids| ids.iter().map(|s| s.to_string()).collect())
        };
        MooncakeXferResponse {
            status: self.status,
            ok_reqs: owned(&self.ok_reqs),
            err_reqs: owned(&self.err_reqs),
            err_msg: self.err_msg.map(str::to_owned),
            layout_id: self.layout_id,
        }
    }
}

/// Why bytes could not be encoded or decoded.
#[derive(Debug, Error)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub enum WireError {
    #[error("malformed msgpack: {0}")]
    Structure(#[from] StrictError),
    #[error("malformed message: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error("cannot encode: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
}

fn encode_named<T: Serialize>(v: &T) -> Result<Vec<u8>, WireError> {
    Ok(rmp_serde::to_vec_named(v)?)
}

fn decode_strict<T: for<'de> Deserialize<'de>>(buf: &[u8]) -> Result<T, WireError> {
    check_map_document(buf)?;
    Ok(rmp_serde::from_slice(buf)?)
}

impl MooncakeXferMetadata {
    /// The eight required keys with empty collections (PROTOCOL.md's reference vector).
    pub fn minimal(host: &str, port: u32, tp_size: u32, tp_rank: u32) -> Self {
        MooncakeXferMetadata {
            remote_hostname: host.to_owned(),
            remote_port: port,
            remote_tp_size: tp_size,
            remote_tp_rank: tp_rank,
            req_blocks: BTreeMap::new(),
            kv_caches_base_addr: vec![],
            block_lens: vec![],
            kv_block_lens: vec![],
            registered_layer_names: vec![],
            registered_layer_indices: vec![],
            registered_group_indices: vec![],
            registered_shared_group_ids: vec![],
            registered_row_offsets: vec![],
            remote_pp_size: 1,
            layout_id: 0,
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        encode_named(self)
    }

    /// Decode untrusted bytes with msgspec's strictness (used by the prefill simulator).
    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        decode_strict(buf)
    }
}

impl MooncakeXferResponse {
    pub fn new(status: XferStatus) -> Self {
        MooncakeXferResponse {
            status,
            ok_reqs: None,
            err_reqs: None,
            err_msg: None,
            layout_id: 0,
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        encode_named(self)
    }

    /// Decode a reply that came off a socket. Never panics.
    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        XferReplyRef::decode_bounded(buf, usize::MAX).map(|r| r.owned())
    }

    /// [`Self::decode`], refusing a reply whose `ok_reqs` and `err_reqs` name more than
    /// `max_ids` ids together (see [`XferReplyRef::decode_bounded`]).
    pub fn decode_bounded(buf: &[u8], max_ids: usize) -> Result<Self, WireError> {
        XferReplyRef::decode_bounded(buf, max_ids).map(|r| r.owned())
    }

    /// `ok_reqs` with nil, `[]` and absence alike.
    pub fn ok(&self) -> &[String] {
        self.ok_reqs.as_deref().unwrap_or(&[])
    }

    /// `err_reqs` with nil, `[]` and absence alike.
    pub fn err(&self) -> &[String] {
        self.err_reqs.as_deref().unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::RequestMeta;

    fn hex(s: &str) -> Vec<u8> {
        s.split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect()
    }

    #[test]
    fn response_reference_vectors_roundtrip() {
        let finish_ok = hex("82 a6 73 74 61 74 75 73 00 a7 6f 6b 5f 72 65 71 73 91 a2 72 31");
        let r = MooncakeXferResponse::decode(&finish_ok).unwrap();
        assert_eq!(r.status, XferStatus::Finish);
        assert_eq!(r.ok(), ["r1".to_string()]);
        assert_eq!(r.encode().unwrap(), finish_ok);

        let cont = hex("81 a6 73 74 61 74 75 73 01");
        assert_eq!(
            MooncakeXferResponse::new(XferStatus::Continue)
                .encode()
                .unwrap(),
            cont
        );

        let err = hex("82 a6 73 74 61 74 75 73 02 a7 65 72 72 5f 6d 73 67 a1 78");
        let mut e = MooncakeXferResponse::new(XferStatus::Error);
        e.err_msg = Some("x".into());
        assert_eq!(e.encode().unwrap(), err);
        assert_eq!(MooncakeXferResponse::decode(&err).unwrap(), e);
    }

    #[test]
    fn realistic_metadata_is_the_269_byte_reference() {
        let mut m = MooncakeXferMetadata::minimal("10.0.0.7", 15000, 1, 0);
        m.req_blocks
            .insert("d-1".into(), ("t-1".into(), vec![vec![5, 6]]));
        m.kv_caches_base_addr = vec![0x7e00_0000_0000];
        m.block_lens = vec![4096];
        m.kv_block_lens = vec![4096];
        m.registered_layer_names = vec!["model.layers.0.self_attn.attn".into()];
        m.registered_layer_indices = vec![0];
        m.registered_group_indices = vec![0];
        let b = m.encode().unwrap();
        assert_eq!(b.len(), 269);
        assert_eq!(b[0], 0x8b);
        let addr = hex("b3")
            .into_iter()
            .chain(b"kv_caches_base_addr".iter().copied())
            .collect::<Vec<_>>();
        let at = b.windows(addr.len()).position(|w| w == addr).unwrap() + addr.len();
        assert_eq!(&b[at..at + 10], &hex("91 cf 00 00 7e 00 00 00 00 00")[..]);
        let mut pp2 = m.clone();
        pp2.remote_pp_size = 2;
        let b2 = pp2.encode().unwrap();
        assert_eq!(b2[0], 0x8c);
        assert!(b2.ends_with(&[b"remote_pp_size".as_slice(), &[0x02]].concat()));
    }

    #[test]
    fn rejections_match_msgspec() {
        // array form of a response
        assert!(MooncakeXferResponse::decode(&hex("91 00")).is_err());
        // status outside {0,1,2,3}
        assert!(MooncakeXferResponse::decode(&hex("81 a6 73 74 61 74 75 73 04")).is_err());
        // LAYOUT_MISS is a status since vLLM 0.33
        let miss = MooncakeXferResponse::decode(&hex("81 a6 73 74 61 74 75 73 03")).unwrap();
        assert_eq!(miss.status, XferStatus::LayoutMiss);
        // a layout_id that is not an int
        assert!(MooncakeXferResponse::decode(&hex(
            "82 a6 73 74 61 74 75 73 00 a9 6c 61 79 6f 75 74 5f 69 64 c0"
        ))
        .is_err());
        // nil for the status int
        assert!(MooncakeXferResponse::decode(&hex("81 a6 73 74 61 74 75 73 c0")).is_err());
        // bool for the status int
        assert!(MooncakeXferResponse::decode(&hex("81 a6 73 74 61 74 75 73 c3")).is_err());
        // bin where a str is expected
        assert!(MooncakeXferResponse::decode(&hex(
            "82 a6 73 74 61 74 75 73 00 a7 6f 6b 5f 72 65 71 73 91 c4 02 72 31"
        ))
        .is_err());
        // missing status
        assert!(MooncakeXferResponse::decode(&hex("80")).is_err());
        // garbage
        assert!(MooncakeXferResponse::decode(b"\xff\xfe garbage").is_err());
    }

    #[test]
    fn nil_empty_and_absent_lists_are_the_same_and_unknown_keys_are_ignored() {
        // {"status":0,"ok_reqs":nil,"err_reqs":[],"zzz":{"a":1}}
        let mut b = hex(
            "84 a6 73 74 61 74 75 73 00 a7 6f 6b 5f 72 65 71 73 c0 a8 65 72 72 5f 72 65 71 73 90",
        );
        b.extend(hex("a3 7a 7a 7a 81 a1 61 01"));
        let r = MooncakeXferResponse::decode(&b).unwrap();
        assert!(r.ok().is_empty() && r.err().is_empty());
    }

    #[test]
    fn a_reply_read_in_place_borrows_its_ids_from_the_frame() {
        let mut r = MooncakeXferResponse::new(XferStatus::Finish);
        r.ok_reqs = Some(vec!["d-1".into(), "d-2".into()]);
        r.err_reqs = Some(vec!["d-3".into()]);
        r.err_msg = Some("TE failed".into());
        let frame = r.encode().unwrap();
        let view = XferReplyRef::decode_bounded(&frame, 3).unwrap();
        assert_eq!(view.ok(), ["d-1", "d-2"]);
        assert_eq!(view.err(), ["d-3"]);
        let inside = |s: &str| frame.as_ptr_range().contains(&s.as_ptr());
        assert!(view.ok().iter().chain(view.err()).all(|id| inside(id)));
        assert!(inside(view.err_msg.unwrap()));
        assert_eq!(view.owned(), r);
        // The cap counts both lists together, before anything is decoded.
        assert!(XferReplyRef::decode_bounded(&frame, 2).is_err());
        assert!(MooncakeXferResponse::decode_bounded(&frame, 2).is_err());
    }

    #[test]
    fn metadata_wrong_tuple_length_and_flat_block_list_are_rejected() {
        let mut m = MooncakeXferMetadata::minimal("h", 1, 1, 0);
        m.req_blocks.insert("d".into(), ("t".into(), vec![vec![1]]));
        let good = m.encode().unwrap();
        assert!(MooncakeXferMetadata::decode(&good).is_ok());
        // ("t", [[1]]) -> ("t", [1]): a flat block list
        let flat = good
            .windows(4)
            .position(|w| w == [0xa1, b't', 0x91, 0x91])
            .unwrap();
        let mut bad = good.clone();
        bad.remove(flat + 2);
        bad.truncate(bad.len());
        assert!(MooncakeXferMetadata::decode(&bad).is_err());
    }

    proptest::proptest! {
        /// A pull encoded with the pre-encoded tail is byte for byte the pull encoded whole,
        /// for any layout (lists empty or not, names, groups, PP size) and any requests.
        #[test]
        fn a_pull_encoded_with_its_tail_is_the_pull_encoded_whole(
            layers in 0usize..6,
            names in proptest::bool::ANY,
            groups in proptest::bool::ANY,
            pp in 1u32..4,
            reqs in proptest::collection::vec(
                ("[a-z0-9-]{1,12}", proptest::collection::vec(
                    proptest::collection::vec(0u32..100_000, 0..4), 0..3)),
                0..5),
            host in "[a-z0-9.]{0,40}",
            port in proptest::num::u32::ANY,
            tp in (proptest::num::u32::ANY, proptest::num::u32::ANY),
            base in proptest::num::u64::ANY,
            layout_id in proptest::prop_oneof![proptest::strategy::Just(0u64), proptest::num::u64::ANY],
            bare in proptest::bool::ANY,
        ) {
            // A pull that omits its layout (vLLM 0.33): every list empty.
            let layers = if bare { 0 } else { layers };
            let lens: Vec<u64> = (0..layers as u64).map(|i| 4096 << i).collect();
            let kv_lens: Vec<u64> = lens.iter().map(|l| l / 2).collect();
            let bases: Vec<u64> = (0..layers as u64).map(|i| base.wrapping_add(i << 30) >> (i % 64)).collect();
            let layer_names: Vec<String> = if names {
                (0..layers).map(|i| format!("model.layers.{i}.self_attn.attn")).collect()
            } else {
                vec![]
            };
            let indices: Vec<u32> = if names { (0..layers as u32).collect() } else { vec![] };
            let group_ids: Vec<u32> = if groups { vec![0; layers] } else { vec![] };
            let stored: Vec<RequestMeta> = reqs
                .iter()
                .map(|(id, b)| RequestMeta::new(id.as_str(), id, "e", "b", b.as_slice()))
                .collect();
            let mut req_blocks: Vec<ReqBlock<'_>> = reqs
                .iter()
                .zip(&stored)
                .map(|((id, _), m)| (id.as_str(), id.as_str(), m.block_ids()))
                .collect();
            req_blocks.sort_by(|a, b| a.0.cmp(b.0));
            req_blocks.dedup_by(|a, b| a.0 == b.0);
            let md = MetadataRef {
                remote_hostname: &host,
                remote_port: port,
                remote_tp_size: tp.0,
                remote_tp_rank: tp.1,
                req_blocks: &ReqBlocksRef(&req_blocks),
                kv_caches_base_addr: &bases,
                block_lens: &lens,
                kv_block_lens: &kv_lens,
                registered_layer_names: &layer_names,
                registered_layer_indices: &indices,
                registered_group_indices: &group_ids,
                remote_pp_size: pp,
                layout_id,
            };
            // The tail of a metadata with another head (as the Receiver builds it).
            let template = MetadataRef {
                remote_hostname: "",
                remote_port: 0,
                req_blocks: &ReqBlocksRef::default(),
                kv_caches_base_addr: &[],
                ..md.clone()
            };
            let tail = MetadataTail::of(&template).unwrap();
            let bytes = md.encode_with(&tail).unwrap();
            // Allocated once: the bound covers what was written.
            proptest::prop_assert!(bytes.len() <= tail.bytes.len() + md.head_len_bound());
            let whole = md.encode().unwrap();
            proptest::prop_assert_eq!(&bytes, &whole);
            // With the endpoint pre-encoded: copied for a metadata of that endpoint, and
            // written for one of any other (the template's), the same bytes either way.
            let with_head = tail.clone().with_head(&md).unwrap();
            proptest::prop_assert_eq!(&md.encode_with(&with_head).unwrap(), &whole);
            let other = MetadataRef { req_blocks: md.req_blocks, kv_caches_base_addr: &bases, ..template };
            proptest::prop_assert_eq!(
                other.encode_with(&with_head).unwrap(),
                other.encode().unwrap()
            );
            // A tail made for another id-ness is not used (its entry count would be wrong).
            let flipped = MetadataRef { layout_id: if layout_id == 0 { 7 } else { 0 }, ..md.clone() };
            proptest::prop_assert_eq!(flipped.encode_with(&tail).unwrap(), flipped.encode().unwrap());
            // The owned struct reads the id back.
            let owned = MooncakeXferMetadata::decode(&whole).unwrap();
            proptest::prop_assert_eq!(owned.layout_id, layout_id);
        }
    }
}
