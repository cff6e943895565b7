//! `kvrecv serve`: a D receiver driven by a host scheduler over a pipe.
//!
//! stdout carries one JSON object per line: `ready` once, then the answer to every input line
//! (`load_kv`, `abort`, `drain`, `stats`, `error`, `shutdown`) and every coordinator event
//! ([`KvEvent`], tagged `event`). stdin carries one JSON command per line:
//! `{"op":"load_kv","requests":[{"req_id","transfer_id","remote_engine_id","remote_bootstrap_addr","block_ids":[[..]]}]}`,
//! `{"op":"abort","req_id":"..."}` (the client went away: as `KvRecv::abort`),
//! `{"op":"drain"}`, `{"op":"stats"}`, `{"op":"shutdown"}` (end of input also shuts down). A bad
//! line (not JSON, not UTF-8, longer than `--max-line-bytes`) gets an `error` line and the
//! process keeps running. Logs go to stderr. `--events` chooses which coordinator events are
//! printed: `all` (default), `completions` (only `completion` lines), `none` (a host that only
//! needs `drain`; the coordinator then produces no events at all). `--answers failures` leaves
//! out the answer to a `load_kv` whose every request was accepted (every other answer is
//! printed): a host that learns of its requests from their completions saves a pipe write, and
//! its own wake-up, per batch.
//!
//! `shutdown` (or the end of input, or SIGTERM/SIGINT) is answered by a last `drain` line when anything was released
//! since the host's last drain, then `{"event":"shutdown","unreleased":N}`: N awaited requests
//! were never released (abandoned in flight).
//!
//! stdout is written through a buffered writer flushed whenever its queue is empty, so a burst
//! of events costs a few `write`s, not a write and a flush per line through tokio's blocking
//! pool. When stdin and stdout are pipes (a host driving serve) both go through the runtime's
//! epoll, on the actors' own thread: no blocking-pool read per chunk of input, no other thread
//! woken per burst of output. Over `--max-output-backlog-bytes` of unwritten output stdin is not
//! read ([`super::serve_output`]).
//!
//! The process is a Mooncake TE target: a handshake daemon (what P's TE reaches through
//! `remote_hostname:remote_port`) and, on TCP, a data server, both bound on `--bind`, with
//! landing permits on unless `--no-permits`. With `--protocol rdma` (feature `rdma`) it is the
//! RDMA target instead ([`DataTarget`]). Nothing authenticates either listener: bind the interface P uses,
//! never a public one.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::io::{AsyncRead, BufReader};
use tokio::net::unix::pipe;

use super::event_line::event_line;
use super::line_reader::{Line, LineReader};
use super::serve_output::{output, Output, Writer};
use super::serve_target::{DataTarget, RdmaOptions};
use crate::actors::{Coordinator, CoordinatorParts, EventSink};
use crate::config::{KvRecvConfig, MooncakeProtocol, Policy};
use crate::control::control_cpu::unpin_current_thread;
use crate::control::{
    BootstrapConfig, ControlCpu, HttpTopology, ZmqTransport, ZmqTransportConfig,
};
use crate::layout::KvLayout;
use crate::messages::{Interner, KvEvent, KvRequestRef, LoadMetas, ReqId, StepOutput};
use crate::rdma::memory::MemoryKind;
use crate::rdma::tcp::server::DEFAULT_IDLE_TIMEOUT;
use crate::rdma::TargetConfig;

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
    fn prints(self, ev: &KvEvent) -> bool {
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
            None => KvRecvConfig::default(),
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

    /// The RDMA target's device and queue-pair options (used with `--protocol rdma`).
    pub fn rdma_options(&self) -> RdmaOptions {
        RdmaOptions {
            devices: self.rdma_devices.clone(),
            port: self.rdma_port,
            gid_index: self.rdma_gid_index,
            traffic_class: self.rdma_traffic_class,
            service_level: self.rdma_service_level,
            windows: usize::from(self.rdma_windows),
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
            memory: MemoryKind::Host,
            serve_reads: self.serve_reads,
            ..TargetConfig::loopback(layout.clone())
        })
    }
}

/// One input line (a `load_kv`'s requests borrow it).
enum Op<'a> {
    LoadKv { requests: Vec<KvRequestRef<'a>> },
    Abort { req_id: String },
    Drain,
    Stats,
    Shutdown,
}

/// An input line as parsed: a plain struct, not an internally tagged enum, so that a `load_kv`
/// line's requests are parsed once, straight into [`KvRequestRef`]s that borrow the line (a
/// tagged enum buffers the whole object first).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpLine<'a> {
    op: OpName,
    #[serde(borrow)]
    requests: Option<Vec<KvRequestRef<'a>>>,
    req_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(try_from = "String")]
enum OpName {
    LoadKv,
    Abort,
    Drain,
    Stats,
    Shutdown,
}

impl TryFrom<String> for OpName {
    type Error = String;

    fn try_from(s: String) -> Result<OpName, String> {
        Ok(match s.as_str() {
            "load_kv" => OpName::LoadKv,
            "abort" => OpName::Abort,
            "drain" => OpName::Drain,
            "stats" => OpName::Stats,
            "shutdown" => OpName::Shutdown,
            _ => {
                return Err(format!(
                    "unknown op {s:?}; ops: load_kv, abort, drain, stats, shutdown"
                ))
            }
        })
    }
}

impl<'a> Op<'a> {
    fn parse(line: &'a str) -> Result<Op<'a>, String> {
        if !line.trim_start().starts_with('{') {
            return Err("a line is one JSON object, e.g. {\"op\":\"drain\"}".into());
        }
        let l: OpLine = serde_json::from_str(line).map_err(|e| e.to_string())?;
        match (l.op, l.requests, l.req_id) {
            (OpName::LoadKv, Some(requests), None) => Ok(Op::LoadKv { requests }),
            (OpName::LoadKv, None, _) => Err("load_kv needs `requests`".into()),
            (OpName::LoadKv, Some(_), Some(_)) => Err("only abort takes `req_id`".into()),
            (OpName::Abort, None, Some(req_id))
                if !req_id.is_empty() && req_id.len() <= crate::messages::batch::MAX_ID_BYTES =>
            {
                Ok(Op::Abort { req_id })
            }
            (OpName::Abort, None, _) => Err(format!(
                "abort needs a non-empty `req_id` of at most {} bytes",
                crate::messages::batch::MAX_ID_BYTES
            )),
            (_, Some(_), _) => Err("only load_kv takes `requests`".into()),
            (_, _, Some(_)) => Err("only abort takes `req_id`".into()),
            (OpName::Drain, None, None) => Ok(Op::Drain),
            (OpName::Stats, None, None) => Ok(Op::Stats),
            (OpName::Shutdown, None, None) => Ok(Op::Shutdown),
        }
    }
}

fn emit(out: &Output, v: serde_json::Value) {
    out.send(v.to_string());
}

/// stdin: a pipe through the runtime's epoll, anything else through tokio's blocking pool.
fn stdin_reader() -> Box<dyn AsyncRead + Unpin> {
    let pipe = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .and_then(|fd| pipe::Receiver::from_file(std::fs::File::from(fd)));
    match pipe {
        Ok(p) => Box::new(p),
        Err(_) => Box::new(tokio::io::stdin()),
    }
}

/// Run until `shutdown` or end of input.
pub fn run(args: ServeArgs) -> ExitCode {
    super::logging::init(&args.log_level);
    let fail = |e: String| {
        println!("{}", json!({"event": "error", "error": e}));
        ExitCode::from(2)
    };
    let cfg = match args.config() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let target = match args.target(&cfg.layout) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    // The data plane (handshake daemon, data server, their connections) runs on a runtime of
    // its own; the actors and the pipes run on a current-thread runtime on this thread, which
    // polls their sockets itself (one runtime for both made every control-plane wake-up a hop
    // from a worker's epoll to this thread: 15-20% of serve's CPU per request).
    let data_rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvrecv-data")
        // Not the control plane's CPU: a thread spawned later from its thread inherits it.
        .on_thread_start(unpin_current_thread)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(format!("data-plane runtime: {e}")),
    };
    // The recorder goes in before any metric handle is taken (the labels' and the target's).
    // The ready line names the address bound (a port 0 resolved), or null if none was.
    let metrics = args.metrics.and_then(|addr| {
        let _in_data_rt = data_rt.enter();
        crate::metrics_endpoint::serve_prometheus(addr)
            .map_err(|e| {
                println!(
                    "{}",
                    json!({"event": "error", "error": format!("metrics: {e}")})
                )
            })
            .ok()
    });
    let labels = crate::telemetry::Labels::for_config(&cfg);
    let target_cfg = TargetConfig {
        labels: labels.clone(),
        ..target
    };
    // Its tasks keep running on the data runtime's workers after this returns.
    let target = match data_rt.block_on(DataTarget::start(&cfg, target_cfg, &args.rdma_options())) {
        Ok(t) => t,
        Err(e) => return fail(format!("data plane: {e}")),
    };
    let sys = actix_rt::System::new();
    // The loop runs as a task on the actors' LocalSet, not as the future `block_on` polls: that
    // future's waker unparks the runtime's driver (an eventfd write, then one more epoll_wait)
    // every time an actor wakes it, i.e. for every load_kv answer and every burst of events.
    let code = sys.block_on(async move {
        actix_rt::spawn(serve(args, cfg, target, labels, metrics))
            .await
            .unwrap_or(ExitCode::from(2))
    });
    drop(data_rt);
    code
}

/// The `ready` line: where P and the host reach this worker, and the layout it serves.
fn ready_line(
    metrics: Option<SocketAddr>,
    cfg: &KvRecvConfig,
    target: &DataTarget,
    control_cpu: Option<usize>,
) -> serde_json::Value {
    let landing = target.landing();
    let (host, port) = landing.endpoint();
    let (data_plane, bases) = target.ready();
    let regions: Vec<_> = cfg
        .layout
        .regions
        .iter()
        .zip(bases)
        .map(|(r, b)| {
            json!({"layer_name": r.layer_name, "layer_index": r.layer_index, "group_index": r.group_index,
                   "block_len": r.block_len, "kv_block_len": r.kv_block_len, "base_addr": b})
        })
        .collect();
    let d = cfg.d_rank;
    let mut v = json!({
        "event": "ready", "version": env!("CARGO_PKG_VERSION"), "pid": std::process::id(),
        "endpoint": {"host": host, "port": port},
        "metrics": metrics.map(|a| a.to_string()), "control_cpu": control_cpu,
        "policy": cfg.policy.as_str(), "pull_timeout_ms": cfg.pull_timeout.as_millis() as u64,
        "d_rank": {"tp_size": d.tp_size, "tp_rank": d.tp_rank, "pp_size": d.pp_size, "pp_rank": d.pp_rank},
        "num_blocks": cfg.layout.num_blocks, "num_groups": cfg.layout.num_groups, "regions": regions,
    });
    if let (Some(v), serde_json::Value::Object(extra)) = (v.as_object_mut(), data_plane) {
        v.extend(extra);
    }
    v
}

/// The answer line to one input op (line `n`), `None` when `--answers` leaves it out, and
/// whether it is a drain that handed nothing over; `shutdown` is the caller's.
async fn answer(
    op: Op<'_>,
    n: u64,
    coord: &Coordinator,
    target: &DataTarget,
    session: &mut Session,
) -> (Option<String>, bool) {
    let v = match op {
        Op::Shutdown => json!({"event": "shutdown"}),
        Op::Stats => {
            let mut v = json!({"event": "stats", "line": n});
            if let (Some(v), serde_json::Value::Object(data)) = (v.as_object_mut(), target.stats())
            {
                v.extend(data);
            }
            v
        }
        Op::Drain => match coord.drain().await {
            Ok(s) => {
                session.unreleased = session
                    .unreleased
                    .saturating_sub(s.finished_recving.len() as u64);
                return (Some(drain_line(&s, n)), s.is_empty());
            }
            Err(e) => json!({"event": "error", "line": n, "error": e.to_string()}),
        },
        Op::Abort { req_id } => {
            let abort = crate::messages::Abort {
                req_id: req_id.as_str().into(),
            };
            match coord.receiver.send(abort).await {
                Ok(r) => json!({"event": "abort", "line": n, "req_id": req_id,
                                "peers_settled": r.peers_settled, "before_dispatch": r.before_dispatch}),
                Err(e) => json!({"event": "error", "line": n, "error": e.to_string()}),
            }
        }
        Op::LoadKv { requests } => {
            let r = coord
                .load_metas(metas(requests, &mut session.interner))
                .await;
            if let Ok(r) = &r {
                session.unreleased += r.awaiting as u64;
                // Not printed, so not built either.
                if session.answers == AnswerLevel::Failures && r.rejected.is_empty() {
                    return (None, false);
                }
            }
            load_kv_answer(r, n)
        }
    };
    (Some(v.to_string()), false)
}

/// A `drain` answer: its keys in the order of every other answer's (serde_json's map sorts
/// them), its lists written straight from the step's (a drain hands over up to thousands of
/// ids; a `serde_json::Value` of them copied each one).
#[derive(Serialize)]
struct DrainLine<'a> {
    event: &'static str,
    failed_recving: &'a [ReqId],
    finished_recving: &'a [ReqId],
    invalid_block_ids: &'a [u32],
    line: u64,
}

/// The answer line to a `drain` (line `n`) that handed `s` over.
fn drain_line(s: &StepOutput, n: u64) -> String {
    let line = DrainLine {
        event: "drain",
        failed_recving: &s.failed_recving,
        finished_recving: &s.finished_recving,
        invalid_block_ids: &s.invalid_block_ids,
        line: n,
    };
    serde_json::to_string(&line).unwrap_or_else(|e| {
        json!({"event": "error", "line": n, "error": format!("drain answer: {e}")}).to_string()
    })
}

/// A `load_kv` line's requests, each read into its metadata (or refused) here, where the line
/// is: the Receiver gets what it keeps, and no copy of an id is made only to be dropped.
fn metas(requests: Vec<KvRequestRef<'_>>, interner: &mut Interner) -> LoadMetas {
    LoadMetas {
        requests: requests
            .into_iter()
            .map(|r| r.into_meta(interner))
            .collect(),
    }
}

/// The answer line to a `load_kv` (line `n`).
fn load_kv_answer(
    r: Result<crate::messages::LoadKvReply, actix::MailboxError>,
    n: u64,
) -> serde_json::Value {
    match r {
        Ok(r) => {
            json!({"event": "load_kv", "line": n, "accepted": r.accepted, "awaiting": r.awaiting,
                   "rejected": r.rejected.iter().map(|e| e.to_string()).collect::<Vec<_>>()})
        }
        Err(e) => json!({"event": "error", "line": n, "error": e.to_string()}),
    }
}

/// SIGTERM and SIGINT, as one source.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The next stop signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// What serve keeps from one input line to the next.
struct Session {
    /// Engine ids and bootstrap addresses shared by every request that names them.
    interner: Interner,
    /// Requests awaited (per `load_kv` answers) and not yet handed back released (per `drain`
    /// answers): each awaited request is in exactly one drain's `finished_recving`, at release.
    unreleased: u64,
    /// Which answers are printed.
    answers: AnswerLevel,
}

async fn serve(
    args: ServeArgs,
    cfg: KvRecvConfig,
    target: DataTarget,
    labels: crate::telemetry::Labels,
    metrics: Option<SocketAddr>,
) -> ExitCode {
    let (out, out_queue) = output(args.max_output_backlog_bytes);
    let writer = match Writer::start(out_queue) {
        Ok(w) => w,
        Err(e) => {
            println!(
                "{}",
                json!({"event": "error", "error": format!("stdout writer: {e}")})
            );
            actix_rt::System::current().stop();
            return ExitCode::from(2);
        }
    };
    // With no events printed the coordinator gets no sink and builds none; the receiver then
    // comes from a channel kept open, so the loop below just never hears from it.
    let level = args.events;
    let answers = args.answers;
    let (events, mut event_rx, _no_events) = match level {
        EventLevel::None => {
            let (tx, rx) = EventSink::channel();
            (EventSink::none(), rx, Some(tx))
        }
        // Only completions are printed: the other events are not even built.
        EventLevel::Completions => {
            let (tx, rx) = EventSink::completions_channel();
            (tx, rx, None)
        }
        EventLevel::All => {
            let (tx, rx) = EventSink::channel();
            (tx, rx, None)
        }
    };
    let bootstrap = BootstrapConfig {
        timeout: Duration::from_millis(args.bootstrap_timeout_ms.max(1)),
        expected_p_sizes: args.expect_p_tp.map(|t| (t, args.expect_p_pp.unwrap_or(1))),
        max_p_workers: args.max_p_workers,
        ..BootstrapConfig::default()
    };
    let landing = target.landing();
    let transport = ZmqTransport::new(ZmqTransportConfig {
        max_msg_size: args.max_msg_size,
        control_cpu: args.control_cpu,
        ..ZmqTransportConfig::default()
    })
    .with_labels(labels.clone());
    let control_cpu = transport.control_cpu();
    let coord = Coordinator::start(CoordinatorParts {
        config: cfg.clone(),
        topology: Rc::new(HttpTopology::new(bootstrap).with_labels(labels.clone())),
        transport: Rc::new(transport),
        landing,
        events,
        builtin_pool: false,
    });
    emit(&out, ready_line(metrics, &cfg, &target, control_cpu));
    let max_line = args.max_line_bytes;
    let mut lines = LineReader::new(BufReader::new(stdin_reader()), max_line);
    let mut n = 0u64;
    let mut session = Session {
        interner: Interner::default(),
        unreleased: 0,
        answers,
    };
    let mut paused = false;
    let pause_count = labels.counter(crate::telemetry::STDIN_PAUSES);
    let mut stdout_lost = false;
    let mut stop = match StopSignals::new() {
        Ok(s) => s,
        Err(e) => {
            emit(
                &out,
                json!({"event": "error", "error": format!("signal handlers: {e}")}),
            );
            drop(out);
            writer.join().await;
            actix_rt::System::current().stop();
            return ExitCode::from(2);
        }
    };
    // Made once, not per round of the loop: each registers a waiter when made.
    let stopped = stop.next();
    tokio::pin!(stopped);
    let closed = out.closed();
    tokio::pin!(closed);
    loop {
        if !paused && out.over_high_water() {
            paused = true;
            pause_count.increment(1);
            tracing::warn!(
                queued = out.queued(),
                "stdout is not being read: stdin paused until the host reads"
            );
        }
        tokio::select! {
            ev = event_rx.recv() => {
                // What else is queued goes out in this turn, as one chunk of lines: a reply
                // settles a whole batch, and a `select!` round (or a queued line) per event
                // cost more than printing it.
                let mut chunk = Vec::new();
                let mut next = ev;
                while let Some(ev) = next {
                    if level.prints(&ev) {
                        event_line(&mut chunk, &ev);
                    }
                    next = event_rx.try_recv().ok();
                }
                if !chunk.is_empty() {
                    chunk.pop(); // the queue adds the last newline
                    // Serialized JSON is UTF-8.
                    out.send(String::from_utf8(chunk).unwrap_or_default());
                }
            }
            // An operator's stop (SIGTERM, SIGINT): as at the end of input, so the host still
            // gets the last drain and the count of requests abandoned in flight.
            name = &mut stopped => {
                tracing::warn!(signal = name, "stopping: shutting down as at the end of input");
                break;
            }
            // Nothing serve says can reach the host: stop as at the end of input.
            () = &mut closed => {
                tracing::error!("stdout is closed (a write to it failed): shutting down");
                stdout_lost = true;
                break;
            }
            // A host that does not read stdout stops being read: its writes block on the pipe.
            () = out.room(), if paused => {
                paused = false;
                tracing::info!(queued = out.queued(), "stdout drained: reading stdin again");
            }
            line = lines.next_line(), if !paused => {
                let line = match line {
                    Ok(Some(l)) => l,
                    Ok(None) => break,
                    Err(e) => {
                        emit(&out, json!({"event": "error", "error": format!("stdin: {e}")}));
                        break;
                    }
                };
                n += 1;
                // A bad line is answered and skipped; only the end of input ends serve.
                let line = match line {
                    Line::Text(l) => l,
                    Line::NotUtf8 { valid_up_to } => {
                        emit(&out, json!({"event": "error", "line": n,
                                          "error": format!("line is not UTF-8 (invalid byte at offset {valid_up_to})")}));
                        continue;
                    }
                    Line::TooLong { len } => {
                        emit(&out, json!({"event": "error", "line": n,
                                          "error": format!("line of {len} bytes is longer than --max-line-bytes {max_line}; ignored")}));
                        continue;
                    }
                };
                if line.trim().is_empty() {
                    continue;
                }
                match Op::parse(&line) {
                    Err(e) => emit(&out, json!({"event": "error", "line": n, "error": e})),
                    Ok(Op::Shutdown) => break,
                    Ok(op) => {
                        if let (Some(line), _) = answer(op, n, &coord, &target, &mut session).await {
                            out.send(line);
                        }
                    }
                }
            }
        }
    }
    // Events already produced are printed before the shutdown line.
    while let Ok(ev) = event_rx.try_recv() {
        if !level.prints(&ev) {
            continue;
        }
        if let Ok(line) = serde_json::to_string(&ev) {
            out.send(line);
        }
    }
    // What completed since the host's last drain is handed over; what is still in flight (or
    // quarantined) is abandoned, and said so.
    if let (Some(last), false) = answer(Op::Drain, n, &coord, &target, &mut session).await {
        out.send(last);
    }
    if session.unreleased > 0 {
        tracing::warn!(
            unreleased = session.unreleased,
            "shutting down with requests whose blocks were never released"
        );
    }
    emit(
        &out,
        json!({"event": "shutdown", "unreleased": session.unreleased}),
    );
    drop(out);
    writer.join().await;
    actix_rt::System::current().stop();
    if stdout_lost {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drain's answer written from the step's lists is the line the `serde_json::Value` of
    /// them gave: the same keys in the same order, the same escapes.
    #[test]
    fn a_drain_line_is_what_the_json_value_gave() {
        let steps = [
            StepOutput::default(),
            StepOutput {
                finished_recving: vec![ReqId::from("d-1"), ReqId::from("q\"\\\nü")],
                failed_recving: vec![ReqId::from("d-2")],
                invalid_block_ids: vec![7, 0, u32::MAX],
            },
        ];
        for s in &steps {
            let want = json!({"event": "drain", "line": 42, "finished_recving": s.finished_recving,
                              "failed_recving": s.failed_recving, "invalid_block_ids": s.invalid_block_ids});
            assert_eq!(drain_line(s, 42), want.to_string());
        }
    }
}
