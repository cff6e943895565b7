//! Mooncake Transfer Engine handshake JSON (PROTOCOL.md §5.1, §6): segment descriptors and the
//! small Notify / Probe bodies. Plain data.
//!
//! Field order matters: the real TE emits compact JSON with keys in alphabetical order, and
//! `serde_json` writes struct fields in declaration order, so every struct below declares its
//! fields alphabetically.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One buffer of a segment descriptor: on TCP an advertised address range, on RDMA one
/// registered region with its keys per device.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BufferDesc {
    /// First address (non-zero; TCP: advertised, kept below 2^53; RDMA: the registered one).
    pub addr: u64,
    /// Bytes covered (non-zero).
    pub length: u64,
    /// RDMA: local key per device, in `devices` order. Absent on TCP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lkey: Vec<u32>,
    /// TCP: the segment name; RDMA: the location (`cpu:0`, `cuda:0`), the key into
    /// `priority_matrix`. P discards a descriptor with an empty buffer name.
    pub name: String,
    /// RDMA: remote key per device, in `devices` order. Absent on TCP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rkey: Vec<u32>,
}

/// `devices[]` of an RDMA descriptor: one per opened NIC, in key-array order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    /// Port GID, 16 `:`-joined hex bytes.
    pub gid: String,
    /// Port LID.
    pub lid: u16,
    /// Device name (`mlx5_0`).
    pub name: String,
}

/// The segment descriptor D serves for a Metadata (type 1) request, TCP or RDMA: one wire
/// concept, with the RDMA-only fields left out of a TCP descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// TCP: every address window D will ever hand out; RDMA: every registered region.
    pub buffers: Vec<BufferDesc>,
    /// RDMA: the NICs. Absent on TCP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceDesc>,
    /// `"host:port"` of the handshake daemon.
    pub name: String,
    /// RDMA: location -> [preferred device names, other available device names]. Absent on TCP.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub priority_matrix: BTreeMap<String, [Vec<String>; 2]>,
    /// `"tcp"` or `"rdma"`: P chooses its transport from this.
    pub protocol: String,
    /// Only for dual-NIC RDMA setups; `""` otherwise.
    #[serde(default)]
    pub rdma_server_name: String,
    /// Host of the TCP data server (0.3.13+; older P uses the host part of `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_data_host: Option<String>,
    /// Port of the TCP data server.
    #[serde(default)]
    pub tcp_data_port: u16,
    /// TCP framing version: 2 = status frames; absent means 1.
    #[serde(default = "one")]
    pub tcp_proto_version: u32,
    /// Informational.
    #[serde(default)]
    pub timestamp: String,
}

fn one() -> u32 {
    1
}

impl SegmentDescriptor {
    /// Compact JSON terminated by `\n`, as on the wire.
    pub fn to_wire(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }

    /// The host P connects to for data: `tcp_data_host`, else the host part of `name`.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn data_host(&self) -> &str {
        match &self.tcp_data_host {
            Some(h) if !h.is_empty() => h,
            _ => split_segment_name(&self.name).0,
        }
    }
}

/// Split a segment name `"host:port"` at the last colon (brackets around IPv6 removed); no port
/// means 12001 (`MC_HANDSHAKE_PORT`).
///
/// ```
/// use kvrecv::messages::handshake::split_segment_name;
/// assert_eq!(split_segment_name("127.0.0.1:15000"), ("127.0.0.1", 15000));
/// assert_eq!(split_segment_name("[::1]:7"), ("::1", 7));
/// assert_eq!(split_segment_name("host"), ("host", 12001));
/// ```
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
pub fn split_segment_name(name: &str) -> (&str, u16) {
    if let Some(rest) = name.strip_prefix('[') {
        if let Some((h, p)) = rest.split_once(']') {
            let port = p
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .unwrap_or(12001);
            return (h, port);
        }
    }
    match name.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, p.parse().unwrap_or(12001)),
        _ => (name, 12001),
    }
}

/// Notify (type 2) body, both directions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyMsg {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub notify_msg: String,
}

/// Probe (type 3) reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReply {
    pub status: String,
}

pub use crate::messages::handshake_desc::HandShakeDesc;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_is_compact_alphabetical_and_newline_terminated() {
        let d = SegmentDescriptor {
            buffers: vec![BufferDesc {
                addr: 1 << 40,
                length: 4096,
                name: "127.0.0.1:1".into(),
                ..BufferDesc::default()
            }],
            devices: vec![],
            name: "127.0.0.1:1".into(),
            priority_matrix: Default::default(),
            protocol: "tcp".into(),
            rdma_server_name: String::new(),
            tcp_data_host: Some("127.0.0.1".into()),
            tcp_data_port: 2,
            tcp_proto_version: 2,
            timestamp: "1.5".into(),
        };
        let s = String::from_utf8(d.to_wire()).unwrap();
        assert_eq!(
            s,
            "{\"buffers\":[{\"addr\":1099511627776,\"length\":4096,\"name\":\"127.0.0.1:1\"}],\
             \"name\":\"127.0.0.1:1\",\"protocol\":\"tcp\",\"rdma_server_name\":\"\",\
             \"tcp_data_host\":\"127.0.0.1\",\"tcp_data_port\":2,\"tcp_proto_version\":2,\
             \"timestamp\":\"1.5\"}\n"
        );
        let back: SegmentDescriptor = serde_json::from_str(&s).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn old_descriptor_without_version_means_v1_and_name_host() {
        let d: SegmentDescriptor = serde_json::from_str(
            r#"{"buffers":[],"name":"10.0.0.7:9","protocol":"tcp","tcp_data_port":5}"#,
        )
        .unwrap();
        assert_eq!(d.tcp_proto_version, 1);
        assert_eq!(d.data_host(), "10.0.0.7");
    }
}
