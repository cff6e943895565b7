//! The TCP data server (PROTOCOL.md §5.2): many concurrent connections, each a loop of
//! sequential requests until EOF; v1 and v2 framing per request; WRITE payloads are read
//! straight from the socket into destination memory (no per-request buffer) inside the landing
//! permit's gate; the v2 OK frame goes out only once the last byte is in destination memory.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::block_ownership::BlockOwnership;
use crate::telemetry as m;

use super::conn_shards::ConnShards;
use super::memory_slot::MemorySlot;
use crate::rdma::accept_cap::Caps;
use crate::rdma::conn_table::{ConnGuard, ConnTable, Phase};

use super::permits::{Access, Admitted, OwnedGateGuard, PermitTable, RejectReason};
use super::raw_recv::{queued, set_rcvlowat, try_recv_into};
use super::windows::{Resolved, WindowMap};
use super::wire::{Header, ProtoVersion, HEADER_LEN, OP_READ, OP_WRITE, STATUS_OK, STATUS_REJECT};
use crate::rdma::audit::{AuditCounters, Auditor};
use crate::rdma::device_stream::STAGING_SLOTS;
use crate::rdma::memory::{MemoryError, RegisteredMemory, STAGING_CHUNK};

/// Most a payload wait asks to have queued before waking (`SO_RCVLOWAT`; the kernel caps it
/// further at half its largest receive buffer).
const LOWAT_CAP: usize = 1 << 20;

/// Default per-connection idle (and payload-progress) timeout. P's own status timeout is 30 s.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default cap on open data connections. A P worker keeps at most 16 lanes per target
/// (`MC_TCP_LANES_PER_PEER`, default 4), an older P one connection per request in flight; 1024
/// covers dozens of P workers while bounding the tasks and sockets a flood can make us hold.
pub const DEFAULT_MAX_DATA_CONNECTIONS: usize = 1024;
/// Default cap on open data connections from one peer address: a quarter of the default cap
/// (eight TP workers of one P host at 16 lanes each use 128), so one host only ever evicts its
/// own connections.
pub const DEFAULT_MAX_DATA_CONNECTIONS_PER_ADDRESS: usize = 256;

/// Counters of the data server, readable while it runs.
#[derive(Debug, Default)]
pub struct DataStats {
    pub connections: AtomicU64,
    pub bytes_landed: AtomicU64,
    pub writes_landed: AtomicU64,
    pub reads_served: AtomicU64,
    pub rejected_out_of_range: AtomicU64,
    pub rejected_bad_opcode: AtomicU64,
    /// READs refused because reads are off.
    pub rejected_reads_off: AtomicU64,
    pub rejected_no_permit: AtomicU64,
    /// Late writes: refused at the header, or cut off mid-payload, because the request was revoked.
    pub rejected_revoked: AtomicU64,
    /// Refused because the target was paused (sleep mode).
    pub rejected_paused: AtomicU64,
    pub idle_timeouts: AtomicU64,
    /// Requests in v1 framing (no status frames: unsafe, but accepted, PROTOCOL.md §5.2).
    pub v1_requests: AtomicU64,
    /// Connections that ended on an I/O error or EOF inside a request.
    pub broken: AtomicU64,
    /// Connections closed at accept because `max_connections` were open, every one of them
    /// inside a request (none could be evicted).
    pub refused_over_cap: AtomicU64,
    /// Connections closed at accept because their address held `max_per_address`, every one
    /// inside a request.
    pub refused_per_address: AtomicU64,
    /// Idle connections closed to make room for a new one (at either cap).
    pub evicted: AtomicU64,
}

impl DataStats {
    /// Counter of rejections for `reason`.
    pub fn rejected(&self, reason: RejectReason) -> &AtomicU64 {
        match reason {
            RejectReason::OutOfRange => &self.rejected_out_of_range,
            RejectReason::BadOpcode => &self.rejected_bad_opcode,
            RejectReason::ReadsOff => &self.rejected_reads_off,
            RejectReason::NoPermit => &self.rejected_no_permit,
            RejectReason::Revoked => &self.rejected_revoked,
            RejectReason::Paused => &self.rejected_paused,
        }
    }

    /// All rejections.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn rejected_total(&self) -> u64 {
        [
            RejectReason::OutOfRange,
            RejectReason::BadOpcode,
            RejectReason::ReadsOff,
            RejectReason::NoPermit,
            RejectReason::Revoked,
            RejectReason::Paused,
        ]
        .iter()
        .map(|&r| self.rejected(r).load(Ordering::Relaxed))
        .sum()
    }
}

/// Everything the connections share.
pub struct DataPlane {
    pub map: Arc<WindowMap>,
    pub permits: Arc<PermitTable>,
    /// Where writes land: swapped only while paused (sleep mode's resume on new memory).
    memory: Arc<MemorySlot>,
    pub stats: Arc<DataStats>,
    pub idle_timeout: Duration,
    /// Open connections at most; at the cap the idlest is evicted for a new one, and a new one
    /// is refused (closed at accept, never queued) only if all are inside a request.
    pub max_connections: usize,
    /// Open connections from one peer address at most (at most `max_connections`).
    pub max_per_address: usize,
    /// The open connections (rebuilt by the `with_max_*` builders; `serve` uses it).
    conns: Arc<ConnTable>,
    /// Answer READ requests (off unless asked: vLLM never reads from D, and anyone who reaches
    /// the data port could read an open pull's blocks).
    pub reads: bool,
    audit: OnceLock<Auditor>,
    /// Staged device copies in flight at most (one per staging slot): the rest wait here, on
    /// the runtime, rather than park blocking-pool threads on the slot pool.
    copy_slots: Arc<Semaphore>,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane")
            .field("permits", &self.permits)
            .field("memory", &self.memory.current())
            .finish()
    }
}

impl DataPlane {
    pub fn new(
        permits: Arc<PermitTable>,
        memory: Arc<RegisteredMemory>,
        idle_timeout: Duration,
    ) -> Self {
        DataPlane {
            map: permits.map().clone(),
            permits,
            memory: Arc::new(MemorySlot::new(memory)),
            stats: Arc::default(),
            idle_timeout,
            max_connections: DEFAULT_MAX_DATA_CONNECTIONS,
            max_per_address: DEFAULT_MAX_DATA_CONNECTIONS_PER_ADDRESS,
            conns: ConnTable::new(
                DEFAULT_MAX_DATA_CONNECTIONS,
                DEFAULT_MAX_DATA_CONNECTIONS_PER_ADDRESS,
            ),
            reads: false,
            audit: OnceLock::new(),
            copy_slots: Arc::new(Semaphore::new(STAGING_SLOTS)),
        }
    }

    /// Answer READ requests too (interop tests read back what landed).
    pub fn with_reads(mut self, on: bool) -> Self {
        self.reads = on;
        self
    }

    /// Cap the open connections (at least one).
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self.max_per_address = self.max_per_address.min(self.max_connections);
        self.conns = ConnTable::new(self.max_connections, self.max_per_address);
        self
    }

    /// Cap the open connections from one peer address (1 to `max_connections`).
    pub fn with_max_per_address(mut self, n: usize) -> Self {
        self.max_per_address = n.clamp(1, self.max_connections);
        self.conns = ConnTable::new(self.max_connections, self.max_per_address);
        self
    }

    /// Connections open now from `ip` (tests, diagnostics).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn open_connections_from(&self, ip: std::net::IpAddr) -> usize {
        self.conns.open_from(ip)
    }

    /// Turn audit mode on against `ownership` (once; later calls return the existing counters).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn install_audit(&self, ownership: Arc<BlockOwnership>) -> Arc<AuditCounters> {
        self.audit
            .get_or_init(|| Auditor::new(ownership))
            .counters()
    }

    /// The destination memory now (a resume on new memory replaces it).
    pub fn memory(&self) -> Arc<RegisteredMemory> {
        self.memory.current()
    }

    /// The slot the destination memory is in (the landing swaps it at a resume).
    pub fn memory_slot(&self) -> &Arc<MemorySlot> {
        &self.memory
    }

    /// Audit counters, if audit mode is on.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn audit(&self) -> Option<Arc<AuditCounters>> {
        self.audit.get().map(|a| a.counters())
    }
}

/// Why a connection ended other than by a clean EOF between requests.
#[derive(Debug, Error)]
enum ConnEnd {
    #[error("request rejected ({0:?})")]
    Rejected(RejectReason),
    #[error("idle for longer than the timeout")]
    Idle,
    #[error("peer closed inside a request")]
    Eof,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("memory: {0}")]
    Memory(#[from] MemoryError),
}

/// Accept connections forever, each served on its own task on one of `shards`' threads; at
/// most `max_connections` at once and `max_per_address` from one address. At a cap the
/// connection idle longest (between requests) is closed to make room; a new one is refused
/// only if all are inside a request.
pub(crate) async fn serve(listener: TcpListener, plane: Arc<DataPlane>, shards: Arc<ConnShards>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and friends: back off briefly instead of spinning.
                tracing::warn!(error = %e, "data server accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let caps = Caps {
            table: &plane.conns,
            labels: plane.permits.labels(),
            listener: "data",
            cap: plane.max_connections,
            evicted: &plane.stats.evicted,
            refused_per_address: &plane.stats.refused_per_address,
            refused_over_cap: &plane.stats.refused_over_cap,
        };
        // Counted before the close, so a client that saw the close also sees the counter.
        let Some(conn) = caps.admit(peer) else {
            // Closed before reading anything: P fails that lane's request.
            drop(stream);
            continue;
        };
        // Status frames are 8 bytes: Nagle would hold them back.
        let _ = stream.set_nodelay(true);
        plane.stats.connections.fetch_add(1, Ordering::Relaxed);
        // Registered again on the thread that will serve it.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                plane.stats.broken.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%peer, error = %e, "data connection could not be handed over");
                continue;
            }
        };
        let stats = Arc::clone(&plane.stats);
        let plane = plane.clone();
        let spawned = shards.spawn(async move {
            let mut stream = match TcpStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    plane.stats.broken.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, error = %e, "data connection could not be registered");
                    return;
                }
            };
            // Declared after the stream, so dropped before it: the place is free again by the
            // time the client sees the close.
            let conn = conn;
            // The stream outlives the accounting below, so a client that saw the close also
            // sees the counters. An evicted connection is idle between requests (its phase),
            // so dropping its future cuts no write short.
            let served = tokio::select! {
                r = connection(&mut stream, &plane, &conn) => r,
                () = conn.evicted() => {
                    tracing::debug!(%peer, "idle data connection evicted at the cap");
                    Ok(())
                }
            };
            match served {
                Ok(()) => {}
                Err(ConnEnd::Rejected(_)) => {}
                Err(ConnEnd::Idle) => {
                    plane.stats.idle_timeouts.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, "data connection idle, closed");
                }
                Err(e) => {
                    plane.stats.broken.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, error = %e, "data connection ended");
                }
            }
        });
        if !spawned {
            // Stopping (the target is being dropped), or every connection thread ended.
            stats.broken.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, "no data connection thread is serving; connection closed");
        }
    }
}

/// Read a header; `Ok(false)` on a clean EOF before its first byte.
async fn read_header(stream: &mut TcpStream, buf: &mut [u8; HEADER_LEN]) -> Result<bool, ConnEnd> {
    let mut got = 0;
    while got < HEADER_LEN {
        let n = stream.read(&mut buf[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(false)
            } else {
                Err(ConnEnd::Eof)
            };
        }
        got += n;
    }
    Ok(true)
}

async fn reject(
    stream: &mut TcpStream,
    plane: &DataPlane,
    h: &Header,
    reason: RejectReason,
) -> ConnEnd {
    plane.stats.rejected(reason).fetch_add(1, Ordering::Relaxed);
    plane
        .permits
        .labels()
        .counter_by(m::WRITES_REJECTED, "reason", reason.label())
        .increment(1);
    tracing::debug!(
        addr = h.addr,
        size = h.size,
        opcode = h.opcode,
        reason = reason.label(),
        "request rejected"
    );
    if h.version() == ProtoVersion::V2 {
        // Best effort, bounded like every write (a P that stopped reading cannot hold this
        // task): the connection closes either way, which is what P acts on.
        let _ = send(stream, plane, &STATUS_REJECT.to_le_bytes()).await;
    }
    let _ = stream.shutdown().await;
    ConnEnd::Rejected(reason)
}

async fn connection(
    stream: &mut TcpStream,
    plane: &DataPlane,
    conn: &ConnGuard,
) -> Result<(), ConnEnd> {
    let mut hb = [0u8; HEADER_LEN];
    loop {
        conn.set(Phase::Idle);
        match tokio::time::timeout(plane.idle_timeout, read_header(stream, &mut hb)).await {
            Err(_) => return Err(ConnEnd::Idle),
            Ok(Ok(false)) => return Ok(()),
            Ok(Ok(true)) => {}
            Ok(Err(e)) => return Err(e),
        }
        conn.set(Phase::Busy);
        let h = Header::decode(&hb);
        if h.version() == ProtoVersion::V1 {
            plane.stats.v1_requests.fetch_add(1, Ordering::Relaxed);
        }
        let op = h.op();
        if op != OP_READ && op != OP_WRITE {
            return Err(reject(stream, plane, &h, RejectReason::BadOpcode).await);
        }
        if op == OP_READ && !plane.reads {
            return Err(reject(stream, plane, &h, RejectReason::ReadsOff).await);
        }
        let Some(r) = plane.map.resolve(h.addr, h.size) else {
            return Err(reject(stream, plane, &h, RejectReason::OutOfRange).await);
        };
        let admitted = match plane.permits.admit(&r, h.size, access(op, h.version())) {
            Ok(a) => a,
            Err(reason) => return Err(reject(stream, plane, &h, reason).await),
        };
        if op == OP_WRITE {
            land(stream, plane, &h, &r, &admitted).await?;
            if h.version() == ProtoVersion::V2 {
                send(stream, plane, &STATUS_OK.to_le_bytes()).await?;
            }
        } else {
            serve_read(stream, plane, &h, &r, &admitted).await?;
        }
    }
}

fn access(op: u8, v: ProtoVersion) -> Access {
    if op == OP_WRITE {
        Access::Write {
            acknowledged: v == ProtoVersion::V2,
        }
    } else {
        Access::Read
    }
}

/// Read the payload of an admitted WRITE into destination memory, then commit and audit it,
/// all inside the permit's gate so a revocation either precedes every copied byte of a read
/// or waits for it.
async fn land(
    stream: &mut TcpStream,
    plane: &DataPlane,
    h: &Header,
    r: &Resolved,
    admitted: &Admitted,
) -> Result<(), ConnEnd> {
    let size = h.size;
    // Taken after the admission: a write admitted after a resume lands in the memory the
    // resume put in place (the slot's doc).
    let memory = plane.memory.current();
    if memory.is_staged() {
        land_staged(stream, plane, &memory, h, r, admitted).await?;
        landed(plane, admitted, size);
        return Ok(());
    }
    let mut pos = 0u64;
    let mut lowat = false;
    loop {
        {
            let Some(_gate) = admitted.enter() else {
                return Err(reject(stream, plane, h, RejectReason::Revoked).await);
            };
            // `r` was resolved inside one region, so the range is in bounds.
            let dst = memory.landing_ptr(r.mem_offset + pos, size - pos)?;
            // SAFETY: `dst` is valid for `size - pos` bytes of writes (bounds-checked; the
            // memory is kept alive by `memory`); the landing bytes are only ever reached through
            // raw pointers (`RegisteredMemory::landing_ptr`), so no reference to them exists.
            match unsafe { try_recv_into(stream, dst, (size - pos) as usize) } {
                Ok(0) => return Err(ConnEnd::Eof),
                Ok(n) => {
                    pos += n as u64;
                    if pos == size {
                        memory.commit(r.mem_offset, size)?;
                        if let Some(a) = plane.audit.get() {
                            // Copies of the stamps, never a view of the shared bytes.
                            a.check_with(
                                size,
                                r.offset,
                                plane.map.block_len(r.region),
                                |at, stamp| memory.read(r.mem_offset + at, stamp).is_ok(),
                            );
                        }
                        break;
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Wake once the rest is queued, not once per arriving segment (a writer that sends
        // in small pieces, as the TE wheel does, otherwise costs a wakeup and a `recv` each).
        // `dataplane_bench` against the build without it, TE wheel writer: 0.63x the CPU per
        // GiB at 1 MiB writes, 0.83x at 256 KiB (docs/PERFORMANCE.md, issue 40 item 2).
        set_rcvlowat(stream, ((size - pos) as usize).min(LOWAT_CAP))?;
        lowat = true;
        match tokio::time::timeout(plane.idle_timeout, stream.readable()).await {
            // Below the low-water mark nothing wakes us: bytes queued are progress, not idling.
            Err(_) if queued(stream)? > 0 => {}
            Err(_) => return Err(ConnEnd::Idle),
            Ok(r) => r?,
        }
    }
    if lowat {
        // The next header (or a READ, which has no payload) must wake us at its first byte.
        set_rcvlowat(stream, 1)?;
    }
    landed(plane, admitted, size);
    Ok(())
}

fn landed(plane: &DataPlane, admitted: &Admitted, size: u64) {
    admitted.landed(size);
    plane.stats.bytes_landed.fetch_add(size, Ordering::Relaxed);
    plane.stats.writes_landed.fetch_add(1, Ordering::Relaxed);
    let labels = plane.permits.labels();
    labels.counter(m::BYTES_LANDED).increment(size);
    labels.counter(m::WRITES_LANDED).increment(1);
}

/// [`land`] for memory the server cannot address (device memory): socket bytes collect in a
/// staging buffer of at most [`STAGING_CHUNK`] bytes, then go to the device on tokio's blocking
/// pool (a device copy and the wait for it never run on a runtime worker). Each copy holds the
/// permit's gate until the device has the bytes, even if this task is dropped meanwhile, so a
/// revocation either precedes a copy or waits for it to complete; bytes staged before a
/// revocation are dropped, never copied. The write counts as landed only after its last copy
/// returned.
async fn land_staged(
    stream: &mut TcpStream,
    plane: &DataPlane,
    memory: &Arc<RegisteredMemory>,
    h: &Header,
    r: &Resolved,
    admitted: &Admitted,
) -> Result<(), ConnEnd> {
    let size = h.size;
    let mut staging = vec![0u8; (size as usize).min(STAGING_CHUNK)];
    let (mut pos, mut filled) = (0u64, 0usize);
    loop {
        let done = {
            let Some(_gate) = admitted.enter() else {
                return Err(reject(stream, plane, h, RejectReason::Revoked).await);
            };
            let want = (staging.len() - filled).min((size - pos) as usize - filled);
            match stream.try_read(&mut staging[filled..filled + want]) {
                Ok(0) => return Err(ConnEnd::Eof),
                Ok(n) => {
                    filled += n;
                    Some(pos + filled as u64 == size)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                Err(e) => return Err(e.into()),
            }
        };
        match done {
            Some(done) if filled == staging.len() || done => {
                let Some(back) =
                    upload(plane, memory, admitted, r.mem_offset + pos, staging, filled).await?
                else {
                    return Err(reject(stream, plane, h, RejectReason::Revoked).await);
                };
                staging = back;
                if let Some(a) = plane.audit.get() {
                    a.check(
                        &staging[..filled],
                        r.offset + pos,
                        plane.map.block_len(r.region),
                    );
                }
                pos += filled as u64;
                filled = 0;
                if done {
                    return Ok(());
                }
            }
            Some(_) => {}
            None => match tokio::time::timeout(plane.idle_timeout, stream.readable()).await {
                Err(_) => return Err(ConnEnd::Idle),
                Ok(r) => r?,
            },
        }
    }
}

/// Copy `buf[..len]` to destination offset `at` on the blocking pool once a copy slot is free,
/// the permit's gate held from then until the device has the bytes (waiting for a slot does not
/// hold a revocation up); the buffer comes back for the next chunk. `None`: the write was
/// revoked before its copy began (nothing copied).
async fn upload(
    plane: &DataPlane,
    memory: &Arc<RegisteredMemory>,
    admitted: &Admitted,
    at: u64,
    buf: Vec<u8>,
    len: usize,
) -> Result<Option<Vec<u8>>, ConnEnd> {
    let started = std::time::Instant::now();
    let slot = Arc::clone(&plane.copy_slots)
        .acquire_owned()
        .await
        .map_err(|_| ConnEnd::Memory(MemoryError::Cuda("device copies closed".into())))?;
    let Some(gate) = admitted.enter_owned() else {
        return Ok(None);
    };
    let memory = Arc::clone(memory);
    let (buf, copied) = tokio::task::spawn_blocking(move || {
        let copied = memory.upload(at, &buf[..len]);
        drop(gate);
        drop(slot);
        (buf, copied)
    })
    .await
    .map_err(|e| ConnEnd::Memory(MemoryError::Cuda(format!("device copy task: {e}"))))?;
    if let Err(e) = &copied {
        tracing::warn!(error = %e, offset = at, len, "device copy failed; connection closed");
    }
    copied?;
    plane
        .permits
        .labels()
        .histogram(m::DEVICE_COPY_LATENCY)
        .record(started.elapsed().as_secs_f64());
    Ok(Some(buf))
}

/// Copy `buf.len()` destination bytes at `at` out of staged (device) memory on the blocking
/// pool, `gate` held until they are out.
async fn download(
    memory: &Arc<RegisteredMemory>,
    gate: OwnedGateGuard,
    at: u64,
    mut buf: Vec<u8>,
) -> Result<Vec<u8>, ConnEnd> {
    let memory = Arc::clone(memory);
    let (buf, copied) = tokio::task::spawn_blocking(move || {
        let copied = memory.read(at, &mut buf);
        drop(gate);
        (buf, copied)
    })
    .await
    .map_err(|e| ConnEnd::Memory(MemoryError::Cuda(format!("device copy task: {e}"))))?;
    copied?;
    Ok(buf)
}

/// Write `bytes`, giving up after the idle timeout without progress (a reader that stopped).
async fn send(stream: &mut TcpStream, plane: &DataPlane, bytes: &[u8]) -> Result<(), ConnEnd> {
    match tokio::time::timeout(plane.idle_timeout, stream.write_all(bytes)).await {
        Err(_) => Err(ConnEnd::Idle),
        Ok(r) => r.map_err(ConnEnd::from),
    }
}

/// Stream an admitted READ back (interop tests; vLLM never reads from D): v2 OK, then the
/// bytes. Each chunk is copied out of destination memory inside the
/// permit's gate, so no byte is read from a block after its request was revoked (by then the
/// block may hold another request's KV); the socket write happens outside the gate, so a
/// reader that stops reading cannot hold a revocation up, and it is bounded by the idle timeout.
async fn serve_read(
    stream: &mut TcpStream,
    plane: &DataPlane,
    h: &Header,
    r: &Resolved,
    admitted: &Admitted,
) -> Result<(), ConnEnd> {
    if h.version() == ProtoVersion::V2 {
        send(stream, plane, &STATUS_OK.to_le_bytes()).await?;
    }
    // Chunked so a READ costs at most one `MC_TCP_SLICE_SIZE` buffer whatever size the header
    // announces (1 MiB per connection let a 24-byte header pin 1 GiB across the connection cap).
    const CHUNK: u64 = 64 * 1024;
    // Taken after the admission, as in `land`.
    let memory = plane.memory.current();
    let mut buf = vec![0u8; h.size.min(CHUNK) as usize];
    let mut pos = 0u64;
    while pos < h.size {
        let n = (h.size - pos).min(CHUNK) as usize;
        let Some(gate) = admitted.enter_owned() else {
            // Mid-stream: no status frame can follow the data already sent; the close says it.
            plane
                .stats
                .rejected(RejectReason::Revoked)
                .fetch_add(1, Ordering::Relaxed);
            let _ = stream.shutdown().await;
            return Err(ConnEnd::Rejected(RejectReason::Revoked));
        };
        if memory.is_staged() {
            buf.truncate(n);
            buf = download(&memory, gate, r.mem_offset + pos, buf).await?;
        } else {
            memory.read(r.mem_offset + pos, &mut buf[..n])?;
            drop(gate);
        }
        send(stream, plane, &buf[..n]).await?;
        pos += n as u64;
    }
    plane.stats.reads_served.fetch_add(1, Ordering::Relaxed);
    Ok(())
}
