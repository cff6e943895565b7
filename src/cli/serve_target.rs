//! `kvrecv serve`'s data target: kvrecv's TCP target, or (feature `rdma`, `--protocol rdma` or
//! `mooncake_protocol = "rdma"`) the RDMA target on this host's devices, peers bound to their
//! Mooncake segments by host so that an uncertain peer's queue pairs are fenced.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::config::KvRecvConfig;
use crate::rdma::{Landing, TargetConfig, TcpTarget};

/// The running data target.
// One per process, alive for its whole life: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum DataTarget {
    Tcp(TcpTarget),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::verbs::RdmaTarget<crate::rdma::verbs::IbvDevices>),
}

fn n(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// `serve`'s `--rdma-*` options: which devices, port and GID, and the QPs' QoS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaOptions {
    pub devices: Option<Vec<String>>,
    pub port: u8,
    pub gid_index: Option<u8>,
    pub traffic_class: u8,
    pub service_level: u8,
    /// Landing windows kept registered.
    pub windows: usize,
}

impl DataTarget {
    /// Start the target `cfg.mooncake_protocol` names; an error is one line for the operator.
    pub async fn start(
        cfg: &KvRecvConfig,
        tcp: TargetConfig,
        rdma: &RdmaOptions,
    ) -> Result<DataTarget, String> {
        match cfg.mooncake_protocol {
            crate::config::MooncakeProtocol::Tcp => TcpTarget::start(tcp)
                .await
                .map(DataTarget::Tcp)
                .map_err(|e| e.to_string()),
            crate::config::MooncakeProtocol::Rdma => Self::start_rdma(tcp, rdma).await,
        }
    }

    #[cfg(feature = "rdma")]
    async fn start_rdma(tcp: TargetConfig, rdma: &RdmaOptions) -> Result<DataTarget, String> {
        use crate::rdma::verbs::{
            DeviceConfig, HandshakeConfig, IbvDevices, RdmaTarget, RdmaTargetConfig,
        };
        let device_cfg = DeviceConfig {
            devices: rdma.devices.clone(),
            port: rdma.port,
            gid_index: rdma.gid_index,
            ..DeviceConfig::default()
        };
        let devices = IbvDevices::open(&device_cfg).map_err(|e| format!("RDMA devices: {e}"))?;
        let cfg = RdmaTargetConfig {
            handshake_bind: tcp.handshake_bind,
            advertise_host: tcp.advertise_host.clone(),
            handshake: HandshakeConfig {
                traffic_class: rdma.traffic_class,
                service_level: rdma.service_level,
                ..HandshakeConfig::default()
            },
            windows: rdma.windows,
            ..RdmaTargetConfig::loopback(tcp.layout.clone())
        };
        RdmaTarget::start(devices, cfg)
            .await
            .map(DataTarget::Rdma)
            .map_err(|e| format!("RDMA target: {e}"))
    }

    #[cfg(not(feature = "rdma"))]
    async fn start_rdma(_tcp: TargetConfig, _rdma: &RdmaOptions) -> Result<DataTarget, String> {
        Err(crate::embed::StartError::RdmaNotBuilt.to_string())
    }

    /// The core's view of it.
    pub fn landing(&self) -> Arc<dyn Landing> {
        match self {
            DataTarget::Tcp(t) => t.landing(),
            #[cfg(feature = "rdma")]
            DataTarget::Rdma(t) => t.landing(),
        }
    }

    /// The `stats` answer's data-plane part.
    pub fn stats(&self) -> Value {
        match self {
            DataTarget::Tcp(t) => {
                let d = t.stats();
                let h = t.handshake_stats();
                json!({
                    "data": {"connections": n(&d.connections), "bytes_landed": n(&d.bytes_landed),
                             "writes_landed": n(&d.writes_landed), "reads_served": n(&d.reads_served),
                             "rejected_out_of_range": n(&d.rejected_out_of_range),
                             "rejected_bad_opcode": n(&d.rejected_bad_opcode),
                             "rejected_reads_off": n(&d.rejected_reads_off),
                             "rejected_no_permit": n(&d.rejected_no_permit),
                             "rejected_revoked": n(&d.rejected_revoked), "idle_timeouts": n(&d.idle_timeouts),
                             "v1_requests": n(&d.v1_requests), "broken": n(&d.broken),
                             "refused_over_cap": n(&d.refused_over_cap),
                             "refused_per_address": n(&d.refused_per_address),
                             "evicted": n(&d.evicted)},
                    "handshake": {"metadata": n(&h.metadata), "notify": n(&h.notify), "probe": n(&h.probe),
                                  "connection": n(&h.connection), "refused": n(&h.refused),
                                  "refused_over_cap": n(&h.refused_over_cap),
                                  "refused_per_address": n(&h.refused_per_address),
                                  "evicted": n(&h.evicted)},
                    "live_permits": t.landing().permits().live(),
                })
            }
            #[cfg(feature = "rdma")]
            DataTarget::Rdma(t) => {
                let h = t.handshake_stats();
                json!({
                    "handshake": {"metadata": n(&h.metadata), "notify": n(&h.notify), "probe": n(&h.probe),
                                  "connection": n(&h.connection), "refused": n(&h.refused),
                                  "refused_over_cap": n(&h.refused_over_cap),
                                  "refused_per_address": n(&h.refused_per_address),
                                  "evicted": n(&h.evicted)},
                })
            }
        }
    }

    /// The `ready` line's data-plane part, and each layout region's advertised base address.
    pub fn ready(&self) -> (Value, Vec<u64>) {
        match self {
            DataTarget::Tcp(t) => {
                let landing = t.landing();
                let map = landing.permits().map();
                let d = t.descriptor();
                let v = json!({
                    "protocol": "tcp",
                    "handshake": {"listen": t.handshake_addr().to_string(), "segment_name": t.segment_name()},
                    "data": {"listen": t.data_addr().to_string(), "host": d.tcp_data_host,
                             "port": d.tcp_data_port, "proto_version": d.tcp_proto_version},
                    "permits": landing.permits().enabled(), "windows": map.windows(),
                });
                (v, map.region_bases(0).to_vec())
            }
            #[cfg(feature = "rdma")]
            DataTarget::Rdma(t) => {
                let v = json!({
                    "protocol": "rdma",
                    "handshake": {"listen": t.handshake_addr().to_string(), "segment_name": t.segment_name()},
                    "devices": t.descriptor().devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
                    "windows": t.landing().live_windows().len(),
                });
                let landing = t.landing();
                let first = landing
                    .live_windows()
                    .first()
                    .and_then(|w| landing.window_bases(*w));
                (v, first.map(|b| b.to_vec()).unwrap_or_default())
            }
        }
    }
}
