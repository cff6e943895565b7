//! The P2P handshake daemon (PROTOCOL.md §5.1): one request per connection, framed as a u64 LE
//! length (type byte + JSON incl. its `\n`), a type byte (0 Connection, 1 Metadata, 2 Notify,
//! 3 Probe) and compact JSON; a payload starting with a byte > 3 is the legacy untyped
//! Connection frame. The daemon replies without waiting for EOF, half-closes, waits a bounded
//! time for the client to close, and serves connections concurrently.
//!
//! What it answers to Metadata and Connection frames is a [`HandshakeService`]: [`TcpService`]
//! (TCP descriptor, Connection refused) or [`RdmaService`] (RDMA descriptor, Connection handed to
//! the passive endpoint handshake, PROTOCOL.md §6).

#![forbid(unsafe_code)]

use crate::telemetry::Labels;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::accept_cap::Caps;
use super::conn_table::{ConnGuard, ConnTable, Phase};

use crate::messages::handshake::{HandShakeDesc, NotifyMsg, ProbeReply, SegmentDescriptor};

use super::verbs::{PublishedDescriptor, SharedHandshake, VerbsBackend};

/// Largest accepted frame (`MC_HANDSHAKE_MAX_LENGTH`).
pub const MAX_FRAME: u64 = 1 << 20;
/// Receive timeout for the request frame.
pub const RECV_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for the client's close after the half-close: a finished exchange is the
/// cheapest connection to hold, so it is closed soonest (and evicted first at a cap).
pub const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// Default cap on handshake connections open at once. P fetches the descriptor once per segment
/// name and caches it, so even a large P fleet handshakes rarely; a connection may be held for
/// up to `RECV_TIMEOUT + CLOSE_WAIT`. At the cap the idlest connection is closed to make room
/// (`conn_table`), so idle connections can never lock a P out.
pub const DEFAULT_MAX_HANDSHAKES: usize = 64;
/// Default cap on handshake connections from one peer address: a quarter of the default cap,
/// so one host (a TE leaking connections, a flood) only ever evicts its own.
pub const DEFAULT_MAX_HANDSHAKES_PER_ADDRESS: usize = 16;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    Connection = 0,
    Metadata = 1,
    Notify = 2,
    Probe = 3,
}

impl FrameType {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(FrameType::Connection),
            1 => Some(FrameType::Metadata),
            2 => Some(FrameType::Notify),
            3 => Some(FrameType::Probe),
            _ => None,
        }
    }
}

/// Counters of the daemon.
#[derive(Debug, Default)]
pub struct HandshakeStats {
    pub metadata: AtomicU64,
    pub notify: AtomicU64,
    pub probe: AtomicU64,
    pub connection: AtomicU64,
    /// Frames refused (bad length, timeout, I/O error).
    pub refused: AtomicU64,
    /// Connections closed at accept because `max_concurrent` connections were open, every one
    /// of them inside an exchange (none could be evicted).
    pub refused_over_cap: AtomicU64,
    /// Connections closed at accept because their address held `max_per_address`, every one
    /// inside an exchange.
    pub refused_per_address: AtomicU64,
    /// Idle connections closed to make room for a new one (at either cap).
    pub evicted: AtomicU64,
}

/// Why a request frame was refused.
#[derive(Debug, Error)]
pub enum FrameError {
    #[error("frame length {0} is 0 or above the cap")]
    Length(u64),
    #[error("frame announced {expected} bytes, the connection ended after {got}")]
    Truncated { expected: u64, got: usize },
    #[error("timed out waiting for the request")]
    Timeout,
    #[error("timed out: the client did not read its reply")]
    ReplyTimeout,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// One request frame as read off a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFrame {
    /// False for the legacy form without a type byte (answered without one).
    pub typed: bool,
    pub ty: FrameType,
    /// The JSON body (type byte removed).
    pub body: Vec<u8>,
}

/// Read one request frame: u64 LE length, then that many bytes (type byte + JSON, or a legacy
/// untyped body). The buffer grows with the bytes that actually arrive instead of being sized
/// from the announced length, so a 9-byte frame announcing 1 MiB costs a few bytes, not 1 MiB.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<RequestFrame, FrameError> {
    let len = r.read_u64_le().await?;
    if len == 0 || len > MAX_FRAME {
        return Err(FrameError::Length(len));
    }
    let mut payload = Vec::new();
    (&mut *r).take(len).read_to_end(&mut payload).await?;
    if payload.len() as u64 != len {
        return Err(FrameError::Truncated {
            expected: len,
            got: payload.len(),
        });
    }
    Ok(match FrameType::from_byte(payload[0]) {
        Some(ty) => RequestFrame {
            typed: true,
            ty,
            body: payload.split_off(1),
        },
        None => RequestFrame {
            typed: false,
            ty: FrameType::Connection,
            body: payload,
        },
    })
}

/// What the daemon answers to the frames that depend on the data plane: Metadata (type 1) and
/// Connection (type 0, and the legacy untyped form). Notify and Probe are answered by the daemon
/// itself. Implementations must not panic on any body: it comes from the network.
pub trait HandshakeService: Send + Sync + 'static {
    /// `"tcp"` or `"rdma"` (logs and `Debug`).
    fn protocol(&self) -> &'static str;

    /// Reply body (JSON incl. its `\n`) to a Metadata request: the segment descriptor.
    fn metadata(&self, body: &[u8]) -> Vec<u8>;

    /// Reply body (a HandShakeDesc JSON line) to a Connection request. May block (firmware
    /// calls): the daemon calls it on tokio's blocking pool.
    fn connection(&self, body: &[u8]) -> Vec<u8>;
}

/// TCP mode: serve the TCP descriptor and refuse every RDMA endpoint handshake.
#[derive(Debug, Clone)]
pub struct TcpService {
    descriptor: Vec<u8>,
}

impl TcpService {
    pub fn new(descriptor: &SegmentDescriptor) -> Self {
        TcpService {
            descriptor: descriptor.to_wire(),
        }
    }
}

impl HandshakeService for TcpService {
    fn protocol(&self) -> &'static str {
        "tcp"
    }

    fn metadata(&self, _body: &[u8]) -> Vec<u8> {
        self.descriptor.clone()
    }

    fn connection(&self, body: &[u8]) -> Vec<u8> {
        // Unknown keys and a malformed body are tolerated: the answer is a refusal anyway.
        let req = HandShakeDesc::from_json(body).unwrap_or_default();
        HandShakeDesc {
            peer_nic_path: req.local_nic_path,
            ..HandShakeDesc::rejection("kvrecv: TCP-only target, no RDMA endpoint".into())
        }
        .to_json_line()
    }
}

/// RDMA mode: serve the RDMA segment descriptor (PROTOCOL.md §6) and hand Connection frames to
/// the passive endpoint handshake, which shares its endpoints with the fence.
pub struct RdmaService<B> {
    /// Replaced by the landing whenever a window is retired or added.
    descriptor: PublishedDescriptor,
    handshake: SharedHandshake<B>,
}

impl<B> RdmaService<B> {
    pub fn new(descriptor: PublishedDescriptor, handshake: SharedHandshake<B>) -> Self {
        RdmaService {
            descriptor,
            handshake,
        }
    }
}

impl<B: VerbsBackend + 'static> HandshakeService for RdmaService<B> {
    fn protocol(&self) -> &'static str {
        "rdma"
    }

    fn metadata(&self, _body: &[u8]) -> Vec<u8> {
        self.descriptor.wire().to_vec()
    }

    fn connection(&self, body: &[u8]) -> Vec<u8> {
        // A poisoned lock only means another handshake panicked half-way; the endpoint table
        // is still the truth about the QPs, so keep serving (as the fence does).
        let mut hs = self
            .handshake
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Synchronous verbs calls (create / modify / destroy QP): the daemon runs this on the
        // blocking pool (`Daemon::handle`), never on a runtime worker.
        hs.on_connection_frame(body)
    }
}

fn json_line(v: serde_json::Result<Vec<u8>>) -> Vec<u8> {
    let mut v = v.unwrap_or_else(|_| b"{}".to_vec());
    v.push(b'\n');
    v
}

/// The daemon: Notify and Probe, plus whatever its [`HandshakeService`] answers.
pub struct Daemon {
    service: Arc<dyn HandshakeService>,
    pub stats: Arc<HandshakeStats>,
    /// Connections open at once at most; at the cap the idlest is evicted for a new one.
    pub max_concurrent: usize,
    /// Connections from one peer address at most (at most `max_concurrent`).
    pub max_per_address: usize,
    /// The open connections (rebuilt by the `with_max_*` builders; `serve` uses it).
    conns: Arc<ConnTable>,
    /// The coordinator's metric labels.
    pub labels: Labels,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("protocol", &self.service.protocol())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Daemon {
    /// TCP mode (serves `descriptor`, refuses RDMA endpoint handshakes).
    pub fn new(descriptor: &SegmentDescriptor) -> Self {
        Daemon::with_service(Arc::new(TcpService::new(descriptor)))
    }

    /// RDMA mode: serve the current `descriptor` and route Connection frames to `handshake`.
    pub fn rdma<B: VerbsBackend + 'static>(
        descriptor: PublishedDescriptor,
        handshake: SharedHandshake<B>,
    ) -> Self {
        Daemon::with_service(Arc::new(RdmaService::new(descriptor, handshake)))
    }

    /// Any service.
    pub fn with_service(service: Arc<dyn HandshakeService>) -> Self {
        Daemon {
            service,
            stats: Arc::default(),
            max_concurrent: DEFAULT_MAX_HANDSHAKES,
            max_per_address: DEFAULT_MAX_HANDSHAKES_PER_ADDRESS,
            conns: ConnTable::new(DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKES_PER_ADDRESS),
            labels: Labels::default(),
        }
    }

    /// Record metrics under `labels`.
    pub fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// Cap the connections open at once (at least one).
    pub fn with_max_concurrent(mut self, n: usize) -> Self {
        self.max_concurrent = n.max(1);
        self.max_per_address = self.max_per_address.min(self.max_concurrent);
        self.conns = ConnTable::new(self.max_concurrent, self.max_per_address);
        self
    }

    /// Cap the connections from one peer address (1 to `max_concurrent`).
    pub fn with_max_per_address(mut self, n: usize) -> Self {
        self.max_per_address = n.clamp(1, self.max_concurrent);
        self.conns = ConnTable::new(self.max_concurrent, self.max_per_address);
        self
    }

    /// Connections open now from `ip` (tests, diagnostics).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn open_connections_from(&self, ip: std::net::IpAddr) -> usize {
        self.conns.open_from(ip)
    }

    /// `"tcp"` or `"rdma"`.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn protocol(&self) -> &'static str {
        self.service.protocol()
    }

    /// The reply body (JSON incl. `\n`) for a request of type `t` with body `body`.
    pub fn reply(&self, t: FrameType, body: &[u8]) -> Vec<u8> {
        match t {
            FrameType::Metadata => {
                self.stats.metadata.fetch_add(1, Ordering::Relaxed);
                self.service.metadata(body)
            }
            FrameType::Notify => {
                self.stats.notify.fetch_add(1, Ordering::Relaxed);
                json_line(serde_json::to_vec(&NotifyMsg {
                    name: String::new(),
                    notify_msg: "success".into(),
                }))
            }
            FrameType::Probe => {
                self.stats.probe.fetch_add(1, Ordering::Relaxed);
                json_line(serde_json::to_vec(&ProbeReply {
                    status: "success".into(),
                }))
            }
            FrameType::Connection => {
                self.stats.connection.fetch_add(1, Ordering::Relaxed);
                self.service.connection(body)
            }
        }
    }

    async fn handle(&self, stream: &mut TcpStream, conn: &ConnGuard) -> Result<(), FrameError> {
        let RequestFrame { typed, ty, body } =
            tokio::time::timeout(RECV_TIMEOUT, read_frame(stream))
                .await
                .map_err(|_| FrameError::Timeout)??;
        conn.set(Phase::Busy);
        let reply = match ty {
            // The RDMA endpoint handshake creates and modifies QPs (firmware commands that can
            // take long on a busy NIC) under a std mutex: off the runtime, so that a slow one
            // never stalls the other handshakes, the data plane or the coordinator.
            FrameType::Connection => {
                self.stats.connection.fetch_add(1, Ordering::Relaxed);
                let service = Arc::clone(&self.service);
                tokio::task::spawn_blocking(move || service.connection(&body))
                    .await
                    .unwrap_or_else(|e| {
                        HandShakeDesc::rejection(format!("kvrecv: handshake handler failed: {e}"))
                            .to_json_line()
                    })
            }
            _ => self.reply(ty, &body),
        };
        let mut frame = Vec::with_capacity(reply.len() + 9);
        let len = reply.len() as u64 + u64::from(typed);
        frame.extend_from_slice(&len.to_le_bytes());
        if typed {
            frame.push(ty as u8);
        }
        frame.extend_from_slice(&reply);
        // A client that does not read its reply holds a slot no longer than one that does not
        // send its request.
        tokio::time::timeout(RECV_TIMEOUT, stream.write_all(&frame))
            .await
            .map_err(|_| FrameError::ReplyTimeout)??;
        stream.shutdown().await?;
        conn.set(Phase::Done);
        // Wait (bounded in time and bytes) for the client to read and close, discarding what it
        // still sends: a client that keeps sending is closed after 64 KiB.
        let _ = tokio::time::timeout(CLOSE_WAIT, async {
            let mut sink = [0u8; 512];
            let mut left = 64 * 1024usize;
            while let Ok(n @ 1..) = stream.read(&mut sink).await {
                left = left.saturating_sub(n);
                if left == 0 {
                    break;
                }
            }
        })
        .await;
        Ok(())
    }
}

/// Serve handshake connections forever, concurrently, at most `max_concurrent` at once and
/// `max_per_address` from one address; at a cap the idlest connection (a finished exchange
/// first) is closed to make room, and a new one is refused only if all are inside an exchange.
pub async fn serve(listener: TcpListener, daemon: Arc<Daemon>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "handshake accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let caps = Caps {
            table: &daemon.conns,
            labels: &daemon.labels,
            listener: "handshake",
            cap: daemon.max_concurrent,
            evicted: &daemon.stats.evicted,
            refused_per_address: &daemon.stats.refused_per_address,
            refused_over_cap: &daemon.stats.refused_over_cap,
        };
        let Some(conn) = caps.admit(peer) else {
            // The initiator sees the close and fails (then retries) its handshake.
            drop(stream);
            continue;
        };
        let d = daemon.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            // Dropped before the stream: the place is free by the time the client sees the close.
            let conn = conn;
            tokio::select! {
                r = d.handle(&mut stream, &conn) => {
                    if let Err(e) = r {
                        d.stats.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%peer, error = %e, "handshake request refused");
                    }
                }
                () = conn.evicted() => {
                    tracing::debug!(%peer, "idle handshake connection evicted at the cap");
                }
            }
        });
    }
}

#[cfg(any(feature = "sim", feature = "testing"))]
/// Client side of one handshake exchange (used by the initiator and tests): send `body` as a
/// frame of type `ty` (`None`: legacy untyped) to `addr`, return (type byte if any, reply body).
pub async fn request(
    addr: std::net::SocketAddr,
    ty: Option<FrameType>,
    body: &[u8],
    timeout: Duration,
) -> io::Result<(Option<u8>, Vec<u8>)> {
    tokio::time::timeout(timeout, async {
        let mut s = TcpStream::connect(addr).await?;
        let mut frame = Vec::with_capacity(body.len() + 9);
        frame.extend_from_slice(&(body.len() as u64 + u64::from(ty.is_some())).to_le_bytes());
        if let Some(t) = ty {
            frame.push(t as u8);
        }
        frame.extend_from_slice(body);
        s.write_all(&frame).await?;
        let len = s.read_u64_le().await?;
        if len == 0 || len > MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply length {len}"),
            ));
        }
        let mut payload = vec![0u8; len as usize];
        s.read_exact(&mut payload).await?;
        if ty.is_some() {
            let t = payload.remove(0);
            Ok((Some(t), payload))
        } else {
            Ok((None, payload))
        }
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "handshake timed out"))?
}
