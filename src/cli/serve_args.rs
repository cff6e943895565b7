//! `kvrecv serve`'s flags, and the worker they describe (a [`KvRecvBuilder`]).

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::config::{KvRecvConfig, MooncakeProtocol, Policy};
use crate::control::{BootstrapConfig, ControlCpu, ZmqTransportConfig};
use crate::layout::KvLayout;
use crate::messages::KvEvent;
use crate::rdma::memory::MemoryKind;
use crate::rdma::tcp::server::DEFAULT_IDLE_TIMEOUT;
use crate::rdma::tcp::target::DEFAULT_DATA_THREADS;
use crate::rdma::TargetConfig;
use crate::KvRecvBuilder;

/// Flags of `kvrecv serve`. Flags given explicitly override `--kv-transfer-config`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// vLLM's `--kv-transfer-config` JSON (kv_role kv_consumer; kvrecv keys under
    /// kv_connector_extra_config.kvrecv, layout included).
    #[arg(long)]
    pub kv_transfer_config: Option<String>,
    /// Number of layers (one region each, named model.layers.N.self_attn.attn).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Block stride in bytes.
    #[arg(long)]
    pub block_len: Option<u64>,
    /// Bytes transferred per block (default: block_len).
    #[arg(long)]
    pub kv_block_len: Option<u64>,
    /// Blocks per region.
    #[arg(long)]
    pub num_blocks: Option<u32>,
    #[arg(long)]
    pub tp_size: Option<u32>,
    #[arg(long)]
    pub tp_rank: Option<u32>,
    #[arg(long)]
    pub pp_size: Option<u32>,
    #[arg(long)]
    pub pp_rank: Option<u32>,
    /// D-side per-pull deadline (longest silence from a peer), ms.
    #[arg(long)]
    pub pull_timeout_ms: Option<u64>,
    /// How long D still waits for P's answer to a request the host aborted, ms: an answer
    /// proves P stopped writing (its landing window stays in rotation); none by then poisons
    /// the window until the quarantine deadline. The request's blocks stay held meanwhile.
    #[arg(long)]
    pub abort_grace_ms: Option<u64>,
    #[arg(long, value_enum)]
    pub policy: Option<Policy>,
    /// The transport P writes with (overrides `mooncake_protocol`): `tcp` (kvrecv's TCP target)
    /// or `rdma` (the RDMA target on this host's devices; needs a build with `--features rdma`).
    #[arg(long, value_enum)]
    pub protocol: Option<Protocol>,
    /// RDMA devices to use, comma-separated, in this order (default: every device). A listed
    /// device that is absent, whose port is down or that has no usable GID is skipped with a
    /// warning; startup fails only when none is usable.
    #[arg(long, value_delimiter = ',')]
    pub rdma_devices: Option<Vec<String>>,
    /// RDMA port number on every device (Mooncake's `MC_IB_PORT`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..))]
    pub rdma_port: u8,
    /// GID index on every device (`MC_GID_INDEX`; default: the best GID as Mooncake ranks
    /// them, routable before private before link-local or overlay, RoCE v2 before v1).
    #[arg(long)]
    pub rdma_gid_index: Option<u8>,
    /// GRH traffic class of D's queue pairs (`MC_IB_TC`; on RoCE v2, DSCP << 2).
    #[arg(long, default_value_t = 0)]
    pub rdma_traffic_class: u8,
    /// Service level of D's queue pairs (`MC_IB_SL`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..16))]
    pub rdma_service_level: u8,
    /// RDMA landing windows kept registered: each is one registration of the whole KV layout
    /// per NIC with keys of its own, one per P host while they last; a fence retires a
    /// suspect's window and registers another (DESIGN.md §5). More windows: fewer P hosts share
    /// one (a fence fails only its own host's writes in flight); each costs NIC translation
    /// entries and `memlock` (RLIMIT_MEMLOCK is checked for all of them).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub rdma_windows: u16,
    /// Interface the TE handshake daemon and data server listen on. Nothing authenticates
    /// them (any host that reaches them can write into the advertised windows while a permit is
    /// open): bind the interface the prefill nodes use, never a public one.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// Handshake daemon port (0: any); advertised to P as `remote_port`.
    #[arg(long, default_value_t = 0)]
    pub handshake_port: u16,
    /// Data server port (0: any); advertised in the segment descriptor (`tcp_data_port`).
    #[arg(long, default_value_t = 0)]
    pub data_port: u16,
    /// `remote_hostname` and `tcp_data_host` advertised to P (default: the --bind address;
    /// required when binding a wildcard address).
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// First advertised address (hex or decimal): window 0's region 0; regions follow
    /// contiguously, windows side by side.
    #[arg(long, default_value = "0x7e0000000000")]
    pub base_addr: String,
    /// Turn landing permits off (upstream behaviour: a late write lands; for detector tests).
    #[arg(long)]
    pub no_permits: bool,
    /// Answer the TE protocol's READ requests on the data port (interop checks that read back
    /// what landed). Off by default: vLLM's P only writes, and nothing authenticates the port.
    #[arg(long)]
    pub serve_reads: bool,
    /// Landing windows (epochs): pulls in flight at once, plus windows poisoned by abandoned
    /// writers, plus one reserved. Default: 16384, or as many as fit below 2^53 if fewer
    /// (ignored with --no-permits: one window). At least 2.
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    pub windows: Option<u32>,
    /// Turn the epoch rule off: reuse a window whose writer may still write (a late write can
    /// land in a newer pull's block; for detector tests only).
    #[arg(long)]
    pub no_epoch_rule: bool,
    /// Data server per-connection idle timeout, ms.
    #[arg(long)]
    pub idle_timeout_ms: Option<u64>,
    /// Threads serving data connections (TCP). One costs the least CPU per GiB; more land
    /// more per second when one is the limit (docs/PERFORMANCE.md).
    #[arg(long, default_value_t = DEFAULT_DATA_THREADS as u16,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub data_threads: u16,
    /// Land P's writes in the memory of GPU ORDINAL, allocated by kvrecv in the device's
    /// primary context, instead of host memory: each write goes through page-locked staging
    /// and a stream of kvrecv's own, and counts as landed once the device holds it. TCP only;
    /// needs a build with `--features cuda` (the driver is loaded at start).
    #[arg(long, value_name = "ORDINAL")]
    pub gpu: Option<u32>,
    /// P's TP size, when known: a /query view with fewer ranks is refused.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub expect_p_tp: Option<u32>,
    /// P's PP size, when known (with --expect-p-tp).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub expect_p_pp: Option<u32>,
    /// Most P workers (TP x PP) accepted from `/query` when --expect-p-tp is not given (a
    /// listing of thousands would exhaust sockets and file descriptors).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_p_workers: u32,
    /// Bootstrap `GET /query` timeout, ms.
    #[arg(long, default_value_t = 5000)]
    pub bootstrap_timeout_ms: u64,
    /// Largest control-plane frame accepted from a peer, bytes (at least 1 KiB). libzmq caps
    /// frames, not messages: a many-frame reply is refused only once whole (PROTOCOL.md §7.2).
    #[arg(long, default_value_t = 16 * 1024 * 1024, value_parser = clap::value_parser!(i64).range(1024..))]
    pub max_msg_size: i64,
    /// Where the control plane runs (the actors' thread and libzmq's I/O thread, together):
    /// `current` (the CPU serve starts its actors on), a CPU number, or `any` (not pinned).
    /// One CPU saves a cross-CPU wake-up per hand-off between the two (docs/PERFORMANCE.md).
    #[arg(long, default_value_t = ControlCpu::Current)]
    pub control_cpu: ControlCpu,
    /// Serve Prometheus text on this address (`/metrics`).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Longest stdin line accepted, bytes; a longer one is dropped (an `error` line answers it)
    /// without being held in memory. At least 1 KiB.
    #[arg(long, default_value_t = 64 * 1024 * 1024, value_parser = at_least_1k)]
    pub max_line_bytes: usize,
    /// Output waiting to be written to stdout, bytes, over which stdin is no longer read
    /// (a host that stops reading stdout then blocks on its own writes, and serve's memory
    /// stays bounded); reading resumes once half of it was written.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_output_backlog_bytes: usize,
    /// Coordinator events printed on stdout: all, completions (only `completion` lines), or
    /// none (answers to input lines only; for hosts that only `drain`).
    #[arg(long, value_enum, default_value_t = EventLevel::All)]
    pub events: EventLevel,
    /// Answers to input lines printed on stdout: all, or failures (a `load_kv` whose every
    /// request was accepted gets no line; rejections, errors and every other op are answered
    /// as always). For hosts that learn of their requests from completions and drains: one
    /// write to stdout, and one wake-up of the host, fewer per batch.
    #[arg(long, value_enum, default_value_t = AnswerLevel::All)]
    pub answers: AnswerLevel,
    /// Log filter when RUST_LOG is unset.
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

/// `--protocol`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Rdma,
}

/// Which coordinator events `serve` prints.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventLevel {
    All,
    Completions,
    None,
}

impl EventLevel {
    pub(super) fn prints(self, ev: &KvEvent) -> bool {
        match self {
            EventLevel::All => true,
            EventLevel::Completions => matches!(ev, KvEvent::Completion { .. }),
            EventLevel::None => false,
        }
    }
}

/// Which answers to input lines `serve` prints.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerLevel {
    All,
    Failures,
}

fn at_least_1k(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1024 => Ok(n),
        Ok(n) => Err(format!("{n} is under 1024")),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_u64(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("bad number {s:?}: {e}"))
}

impl ServeArgs {
    /// The effective configuration.
    pub fn config(&self) -> Result<KvRecvConfig, String> {
        let mut cfg = match &self.kv_transfer_config {
            Some(j) => {
                let p = KvRecvConfig::parse_kv_transfer_config(j).map_err(|e| e.to_string())?;
                // A config that names no layout gets it from all three flags, never a default.
                let flags =
                    self.layers.is_some() && self.block_len.is_some() && self.num_blocks.is_some();
                if !p.layout_given && !flags {
                    return Err(format!(
                        "{}, or all of --layers, --block-len, --num-blocks",
                        crate::config::ConfigError::NoLayout
                    ));
                }
                p.config
            }
            // serve's own default, which its flags adjust (the library has none).
            None => KvRecvConfig {
                layout: KvLayout::default(),
                ..KvRecvConfig::default()
            },
        };
        if self
            .layers
            .is_some_and(|l| l as usize > crate::layout::MAX_REGIONS)
        {
            return Err(format!(
                "--layers {}: at most {}",
                self.layers.unwrap_or(0),
                crate::layout::MAX_REGIONS
            ));
        }
        if self.layers.is_some() || self.block_len.is_some() || self.num_blocks.is_some() {
            let base = &cfg.layout;
            let layers = self.layers.unwrap_or(base.regions.len() as u32);
            let block_len = self
                .block_len
                .unwrap_or(base.regions.first().map_or(16 * 1024, |r| r.block_len));
            cfg.layout = KvLayout::uniform(
                layers,
                block_len,
                self.num_blocks.unwrap_or(base.num_blocks),
            );
        }
        if let Some(k) = self.kv_block_len {
            cfg.layout
                .regions
                .iter_mut()
                .for_each(|r| r.kv_block_len = k);
        }
        let d = &mut cfg.d_rank;
        d.tp_size = self.tp_size.unwrap_or(d.tp_size);
        d.tp_rank = self.tp_rank.unwrap_or(d.tp_rank);
        d.pp_size = self.pp_size.unwrap_or(d.pp_size);
        d.pp_rank = self.pp_rank.unwrap_or(d.pp_rank);
        if let Some(ms) = self.pull_timeout_ms {
            cfg.pull_timeout = Duration::from_millis(ms.max(1));
        }
        if let Some(ms) = self.abort_grace_ms {
            cfg.abort_grace = Duration::from_millis(ms);
        }
        if let Some(p) = self.policy {
            cfg.policy = p;
        }
        match self.protocol {
            Some(Protocol::Tcp) => cfg.mooncake_protocol = MooncakeProtocol::Tcp,
            Some(Protocol::Rdma) => cfg.mooncake_protocol = MooncakeProtocol::Rdma,
            None => {}
        }
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    /// The worker serve runs: the builder a host uses, with serve's own choices made
    /// explicit (its data target, the control plane's placement, which events it keeps, the
    /// RDMA devices and queue-pair options).
    pub fn builder(&self, cfg: KvRecvConfig) -> Result<KvRecvBuilder, String> {
        if self.gpu.is_some() && cfg.mooncake_protocol == MooncakeProtocol::Rdma {
            // The RDMA target registers host memory, or the host's own device regions
            // through GPUDirect (the library); it has no GPU allocation of its own.
            return Err(
                "--gpu is for the TCP target; with --protocol rdma it is not supported".into(),
            );
        }
        let target = self.target(&cfg.layout)?;
        let builder = KvRecvBuilder::new(cfg)
            .target(|t| *t = target)
            .bootstrap(BootstrapConfig {
                timeout: Duration::from_millis(self.bootstrap_timeout_ms.max(1)),
                expected_p_sizes: self.expect_p_tp.map(|t| (t, self.expect_p_pp.unwrap_or(1))),
                max_p_workers: self.max_p_workers,
                ..BootstrapConfig::default()
            })
            .zmq(ZmqTransportConfig {
                max_msg_size: self.max_msg_size,
                control_cpu: self.control_cpu,
                ..ZmqTransportConfig::default()
            })
            .rdma_handshake(crate::rdma::verbs::RdmaHandshakeConfig {
                traffic_class: self.rdma_traffic_class,
                service_level: self.rdma_service_level,
                ..Default::default()
            })
            .rdma_windows(usize::from(self.rdma_windows));
        #[cfg(feature = "rdma")]
        let builder = match builder.config().mooncake_protocol {
            MooncakeProtocol::Rdma => builder.rdma_devices(crate::rdma::verbs::RdmaDeviceConfig {
                devices: self.rdma_devices.clone(),
                port: self.rdma_port,
                gid_index: self.rdma_gid_index,
                ..Default::default()
            }),
            MooncakeProtocol::Tcp => builder,
        };
        // With no events printed the coordinator builds none.
        Ok(match self.events {
            EventLevel::All => builder.events(true),
            EventLevel::Completions => builder.completion_events(),
            EventLevel::None => builder,
        })
    }

    /// Where P's writes land (`--gpu`).
    pub fn memory_kind(&self) -> Result<MemoryKind, String> {
        match self.gpu {
            None => Ok(MemoryKind::Host),
            #[cfg(feature = "cuda")]
            Some(ordinal) => Ok(MemoryKind::Cuda {
                ordinal: ordinal as usize,
            }),
            #[cfg(not(feature = "cuda"))]
            Some(_) => Err(
                "--gpu: this kvrecv was built without CUDA (cargo build --features cuda)".into(),
            ),
        }
    }

    /// The data-plane target for `layout`.
    pub fn target(&self, layout: &KvLayout) -> Result<TargetConfig, String> {
        let advertise_host = match &self.advertise_host {
            Some(h)
                if h.trim()
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control()) =>
            {
                return Err(format!(
                    "--advertise-host {h:?}: a host name or address has no spaces or control \
                     characters"
                ))
            }
            Some(h) if !h.trim().is_empty() => h.trim().to_owned(),
            Some(_) => return Err("--advertise-host is empty".into()),
            None if self.bind.is_unspecified() => {
                return Err(format!(
                    "--bind {} is a wildcard: give --advertise-host (the address P reaches)",
                    self.bind
                ))
            }
            None => self.bind.to_string(),
        };
        let base_addr = parse_u64(&self.base_addr)?;
        if base_addr == 0 {
            return Err("--base-addr 0: the first advertised address must be non-zero".into());
        }
        Ok(TargetConfig {
            layout: layout.clone(),
            handshake_bind: SocketAddr::new(self.bind, self.handshake_port),
            data_bind: SocketAddr::new(self.bind, self.data_port),
            advertise_host,
            permits: !self.no_permits,
            windows: self.windows,
            epoch_rule: !self.no_epoch_rule,
            base_addr,
            idle_timeout: self
                .idle_timeout_ms
                .map_or(DEFAULT_IDLE_TIMEOUT, |ms| Duration::from_millis(ms.max(1))),
            memory: self.memory_kind()?,
            serve_reads: self.serve_reads,
            data_threads: usize::from(self.data_threads),
            ..TargetConfig::loopback(layout.clone())
        })
    }
}
