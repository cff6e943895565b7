//! The RDMA segment descriptor D serves for Metadata (type 1) requests (PROTOCOL.md §5.1, §6).
//!
//! Fields are declared in alphabetical order (serde writes declaration order) so the encoding
//! is compact JSON with alphabetical keys, like the TCP descriptor and like jsoncpp on the
//! Mooncake side.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use thiserror::Error;

use super::backend::MrKeys;
use super::nic::LocalNic;
use crate::messages::handshake::{BufferDesc, DeviceDesc, SegmentDescriptor};

/// One registered region as the descriptor needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredRegion {
    /// `cpu:<numa node>` or `cuda:<ordinal>`.
    pub location: String,
    pub addr: u64,
    pub length: u64,
    /// Keys in device order, as `VerbsBackend::register_memory` returns them.
    pub keys: Vec<MrKeys>,
}

/// A descriptor P would discard (PROTOCOL.md §5.1, §6): kvrecv refuses to build it instead.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// No segment name.
    #[error("the segment name is empty")]
    EmptyName,
    /// No device to list.
    #[error("no RDMA device: an RDMA descriptor needs at least one")]
    NoDevices,
    /// No buffer to list.
    #[error("no registered buffer")]
    NoBuffers,
    /// A buffer P would discard.
    #[error("buffer {index} has an empty location, a zero address or a zero length")]
    BadBuffer {
        /// The buffer, in descriptor order.
        index: usize,
    },
    /// A buffer without one key pair per device.
    #[error("buffer {index} has {keys} key pairs for {devices} devices")]
    KeyCountMismatch {
        /// The buffer, in descriptor order.
        index: usize,
        /// Key pairs it has.
        keys: usize,
        /// Devices listed.
        devices: usize,
    },
}

/// The descriptor the handshake daemon serves, replaced whenever the landing windows change
/// (a window retired by a fence, one registered in its place). Cheap to clone; clones share.
#[derive(Debug, Clone, Default)]
pub struct PublishedDescriptor(Arc<Mutex<Arc<[u8]>>>);

impl PublishedDescriptor {
    /// Serve `d` from now on.
    pub fn set(&self, d: &SegmentDescriptor) {
        let wire: Arc<[u8]> = d.to_wire().into();
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = wire;
    }

    /// The JSON line served now.
    pub fn wire(&self) -> Arc<[u8]> {
        Arc::clone(&self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The `priority_matrix` entry of one buffer location: `[preferred, available]` NIC names, as
/// Mooncake's `topology.cpp` lists them for `cpu:<node>`: the NICs on that NUMA node are
/// preferred, the others available (P picks among the preferred ones, and falls back to the
/// others on retries). When the node of the location or of every NIC is unknown (a `cuda:<n>`
/// location, or no NUMA information), or no NIC is on that node, every NIC is preferred.
pub fn location_priority(location: &str, nics: &[LocalNic]) -> [Vec<String>; 2] {
    let node = location
        .strip_prefix("cpu:")
        .and_then(|n| n.parse::<u32>().ok());
    let (preferred, available): (Vec<&LocalNic>, Vec<&LocalNic>) = match node {
        Some(node) => nics.iter().partition(|n| n.numa_node == Some(node)),
        None => (Vec::new(), Vec::new()),
    };
    let names = |v: Vec<&LocalNic>| v.into_iter().map(|n| n.name.clone()).collect::<Vec<_>>();
    if preferred.is_empty() {
        return [nics.iter().map(|n| n.name.clone()).collect(), Vec::new()];
    }
    [names(preferred), names(available)]
}

/// Build the RDMA segment descriptor (PROTOCOL.md §6) for `nics` (device order) and `regions`.
/// The priority matrix prefers the NICs on each location's NUMA node ([`location_priority`]).
pub fn build(
    segment_name: &str,
    nics: &[LocalNic],
    regions: &[RegisteredRegion],
    timestamp: String,
) -> Result<SegmentDescriptor, DescriptorError> {
    let d = build_live(segment_name, nics, regions, timestamp)?;
    if d.buffers.is_empty() {
        return Err(DescriptorError::NoBuffers);
    }
    Ok(d)
}

/// [`build`] for a running target: the buffer list may be empty (every landing window retired
/// and none could be registered again), which leaves P no address to write to.
pub fn build_live(
    segment_name: &str,
    nics: &[LocalNic],
    regions: &[RegisteredRegion],
    timestamp: String,
) -> Result<SegmentDescriptor, DescriptorError> {
    if segment_name.is_empty() {
        return Err(DescriptorError::EmptyName);
    }
    if nics.is_empty() {
        return Err(DescriptorError::NoDevices);
    }
    let mut buffers = Vec::with_capacity(regions.len());
    let mut priority_matrix = BTreeMap::new();
    for (index, r) in regions.iter().enumerate() {
        if r.location.is_empty() || r.addr == 0 || r.length == 0 {
            return Err(DescriptorError::BadBuffer { index });
        }
        if r.keys.len() != nics.len() {
            return Err(DescriptorError::KeyCountMismatch {
                index,
                keys: r.keys.len(),
                devices: nics.len(),
            });
        }
        buffers.push(BufferDesc {
            addr: r.addr,
            length: r.length,
            lkey: r.keys.iter().map(|k| k.lkey).collect(),
            name: r.location.clone(),
            rkey: r.keys.iter().map(|k| k.rkey).collect(),
        });
        priority_matrix
            .entry(r.location.clone())
            .or_insert_with(|| location_priority(&r.location, nics));
    }
    Ok(SegmentDescriptor {
        buffers,
        devices: nics
            .iter()
            .map(|n| DeviceDesc {
                gid: n.gid.to_string(),
                lid: n.lid,
                name: n.name.clone(),
            })
            .collect(),
        name: segment_name.to_owned(),
        priority_matrix,
        protocol: "rdma".to_owned(),
        rdma_server_name: String::new(),
        tcp_data_host: None,
        tcp_data_port: 0,
        tcp_proto_version: 2,
        timestamp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(name: &str, gid: &str) -> LocalNic {
        crate::rdma::verbs::fake::test_nic(name, gid.parse().unwrap())
    }

    fn nics() -> Vec<LocalNic> {
        vec![
            nic("mlx5_0", "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07"),
            nic("mlx5_1", "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:01:07"),
        ]
    }

    fn region(addr: u64, keys: &[(u32, u32)]) -> RegisteredRegion {
        RegisteredRegion {
            location: "cpu:0".into(),
            addr,
            length: 4096,
            keys: keys
                .iter()
                .map(|&(lkey, rkey)| MrKeys { lkey, rkey })
                .collect(),
        }
    }

    #[test]
    fn encodes_the_protocol_shape() {
        let d = crate::rdma::verbs::descriptor::build(
            "10.0.0.7:15000",
            &nics(),
            &[region(0x7f00_0000_0000, &[(1, 2), (3, 4)])],
            "1767225600.123456".into(),
        )
        .unwrap();
        let line = String::from_utf8(d.to_wire()).unwrap();
        assert_eq!(
            line,
            concat!(
                r#"{"buffers":[{"addr":139637976727552,"length":4096,"lkey":[1,3],"name":"cpu:0","rkey":[2,4]}],"#,
                r#""devices":[{"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07","lid":0,"name":"mlx5_0"},"#,
                r#"{"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:01:07","lid":0,"name":"mlx5_1"}],"#,
                r#""name":"10.0.0.7:15000","priority_matrix":{"cpu:0":[["mlx5_0","mlx5_1"],[]]},"#,
                r#""protocol":"rdma","rdma_server_name":"","tcp_data_port":0,"tcp_proto_version":2,"#,
                r#""timestamp":"1767225600.123456"}"#,
                "\n"
            )
        );
        let back: SegmentDescriptor = serde_json::from_str(&line).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn nics_on_the_locations_numa_node_are_preferred_the_others_available() {
        let mut n = nics();
        n.push(nic(
            "mlx5_2",
            "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:02:07",
        ));
        n[0].numa_node = Some(0);
        n[1].numa_node = Some(1);
        n[2].numa_node = Some(1);
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            location_priority("cpu:1", &n),
            [s(&["mlx5_1", "mlx5_2"]), s(&["mlx5_0"])]
        );
        assert_eq!(
            location_priority("cpu:0", &n),
            [s(&["mlx5_0"]), s(&["mlx5_1", "mlx5_2"])]
        );
        let all = [s(&["mlx5_0", "mlx5_1", "mlx5_2"]), Vec::new()];
        // No NIC on that node, a GPU location, or no NUMA information: all preferred.
        assert_eq!(location_priority("cpu:3", &n), all);
        assert_eq!(location_priority("cuda:0", &n), all);
        assert_eq!(
            location_priority("cpu:1", &nics()),
            [s(&["mlx5_0", "mlx5_1"]), vec![]]
        );
        // And it is what the descriptor carries.
        let mut r = region(1, &[(1, 2), (3, 4), (5, 6)]);
        r.location = "cpu:1".into();
        let d = crate::rdma::verbs::descriptor::build("h:1", &n, &[r], "t".into()).unwrap();
        assert_eq!(
            d.priority_matrix["cpu:1"],
            [s(&["mlx5_1", "mlx5_2"]), s(&["mlx5_0"])]
        );
    }

    #[test]
    fn keys_are_alphabetical_at_every_level() {
        let d = crate::rdma::verbs::descriptor::build(
            "h:1",
            &nics(),
            &[region(1, &[(1, 2), (3, 4)])],
            "t".into(),
        )
        .unwrap();
        let line = d.to_wire();
        // serde_json's Map is a BTreeMap (no preserve_order): re-encoding a Value sorts keys.
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        let mut sorted = serde_json::to_vec(&v).unwrap();
        sorted.push(b'\n');
        assert_eq!(line, sorted);
    }

    #[test]
    fn refuses_descriptors_p_would_discard() {
        let n = nics();
        let ok = region(1, &[(1, 2), (3, 4)]);
        let t = || "t".to_string();
        assert_eq!(
            crate::rdma::verbs::descriptor::build("", &n, std::slice::from_ref(&ok), t()),
            Err(DescriptorError::EmptyName)
        );
        assert_eq!(
            crate::rdma::verbs::descriptor::build("h:1", &[], std::slice::from_ref(&ok), t()),
            Err(DescriptorError::NoDevices)
        );
        assert_eq!(
            crate::rdma::verbs::descriptor::build("h:1", &n, &[], t()),
            Err(DescriptorError::NoBuffers)
        );
        let short = region(1, &[(1, 2)]);
        assert_eq!(
            crate::rdma::verbs::descriptor::build("h:1", &n, &[ok.clone(), short], t()),
            Err(DescriptorError::KeyCountMismatch {
                index: 1,
                keys: 1,
                devices: 2
            })
        );
        for bad in [
            RegisteredRegion {
                addr: 0,
                ..ok.clone()
            },
            RegisteredRegion {
                length: 0,
                ..ok.clone()
            },
            RegisteredRegion {
                location: String::new(),
                ..ok.clone()
            },
        ] {
            assert_eq!(
                crate::rdma::verbs::descriptor::build("h:1", &n, &[bad], t()),
                Err(DescriptorError::BadBuffer { index: 0 })
            );
        }
    }
}
