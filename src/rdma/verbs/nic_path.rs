//! Mooncake NIC paths: `"<segment name or rdma_server_name>@<nic name>"` (PROTOCOL.md §6).
//! P's path is the key of its endpoint on D; the path P asks for names one of D's NICs.

#![forbid(unsafe_code)]

use std::fmt;

use thiserror::Error;

/// A parsed NIC path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NicPath {
    /// Segment (server) name, `host:port`.
    pub server: String,
    /// RDMA device name, e.g. `mlx5_0`.
    pub nic: String,
}

/// A NIC path without both of its parts.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("not a NIC path (\"server@nic\"): {0:?}")]
pub struct NicPathError(pub String);

impl NicPath {
    /// Split at the last `@` (device names never contain one); both parts must be non-empty, as
    /// Mooncake requires before it connects.
    pub fn parse(path: &str) -> Result<NicPath, NicPathError> {
        match path.rsplit_once('@') {
            Some((server, nic)) if !server.is_empty() && !nic.is_empty() => Ok(NicPath {
                server: server.to_owned(),
                nic: nic.to_owned(),
            }),
            _ => Err(NicPathError(path.to_owned())),
        }
    }
}

impl fmt::Display for NicPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.server, self.nic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_server_and_nic() {
        let p = NicPath::parse("10.0.0.5:15321@mlx5_1").unwrap();
        assert_eq!(p.server, "10.0.0.5:15321");
        assert_eq!(p.nic, "mlx5_1");
        assert_eq!(p.to_string(), "10.0.0.5:15321@mlx5_1");
        let v6 = NicPath::parse("[fe80::1]:15000@mlx5_0").unwrap();
        assert_eq!(v6.server, "[fe80::1]:15000");
    }

    #[test]
    fn refuses_paths_missing_a_part() {
        for bad in ["", "mlx5_0", "@mlx5_0", "10.0.0.5:1@", "@"] {
            assert_eq!(
                NicPath::parse(bad),
                Err(NicPathError(bad.to_owned())),
                "{bad:?}"
            );
        }
    }
}
