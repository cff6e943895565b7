//! The Mooncake TE TCP data-plane framing (PROTOCOL.md §5.2), shared by the server and the
//! initiator: the 24-byte request header and the v2 status frames.

#![forbid(unsafe_code)]

/// Bytes of a request header (a C struct with 7 bytes of tail padding).
pub const HEADER_LEN: usize = 24;
/// Opcode low bits: READ.
pub const OP_READ: u8 = 0;
/// Opcode low bits: WRITE.
pub const OP_WRITE: u8 = 1;
/// Opcode bit: v2 framing (status frames).
pub const V2_FLAG: u8 = 0x80;
/// High 32 bits of every v2 status frame ("MCTV").
pub const STATUS_MAGIC: u64 = 0x4D43_5456 << 32;
/// v2 status: accepted / completed.
pub const STATUS_OK: u64 = STATUS_MAGIC;
/// v2 status: address rejected.
pub const STATUS_REJECT: u64 = STATUS_MAGIC | 1;

/// Framing version of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProtoVersion {
    /// No status frames: "done" means the bytes left the writer.
    V1,
    /// Status frame per request.
    #[default]
    V2,
}

/// One request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub size: u64,
    pub addr: u64,
    pub opcode: u8,
}

impl Header {
    #[cfg(any(feature = "sim", feature = "testing"))]
    /// A WRITE or READ header in `version` framing.
    pub fn new(write: bool, addr: u64, size: u64, version: ProtoVersion) -> Self {
        let op = if write { OP_WRITE } else { OP_READ };
        let opcode = if version == ProtoVersion::V2 {
            op | V2_FLAG
        } else {
            op
        };
        Header { size, addr, opcode }
    }

    #[cfg(any(feature = "sim", feature = "testing"))]
    /// Wire bytes (padding zeroed).
    ///
    /// ```
    /// use kvrecv::rdma::tcp::wire::{Header, ProtoVersion};
    /// let h = Header::new(true, 0x7f05_09bf_b010, 16, ProtoVersion::V2);
    /// assert_eq!(h.encode()[..17], [16, 0, 0, 0, 0, 0, 0, 0, 0x10, 0xb0, 0xbf, 0x09, 0x05, 0x7f, 0, 0, 0x81]);
    /// assert_eq!(Header::decode(&h.encode()), h);
    /// ```
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = self.opcode;
        b
    }

    /// Parse; the padding is ignored.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        let mut size = [0u8; 8];
        let mut addr = [0u8; 8];
        size.copy_from_slice(&b[0..8]);
        addr.copy_from_slice(&b[8..16]);
        Header {
            size: u64::from_le_bytes(size),
            addr: u64::from_le_bytes(addr),
            opcode: b[16],
        }
    }

    /// Framing of this request.
    pub fn version(&self) -> ProtoVersion {
        if self.opcode & V2_FLAG != 0 {
            ProtoVersion::V2
        } else {
            ProtoVersion::V1
        }
    }

    /// Opcode without the version bit.
    pub fn op(&self) -> u8 {
        self.opcode & !V2_FLAG
    }
}
