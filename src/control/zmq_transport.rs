//! [`PeerTransport`] on libzmq (the `zmq` crate, the same engine as pyzmq on the P side).
//!
//! A DEALER per pull, connected (never bound), `LINGER=0`, the request sent as one frame, every
//! reply delivered whole (all its frames, so the Peer can call a multi-frame reply malformed),
//! inbound messages capped with `ZMQ_MAXMSGSIZE`. Never REQ, never two pulls on one socket at
//! once. A DEALER whose pull ended with a clean FINISH (the Peer sets [`CleanFinish`]) goes back
//! to a small per-peer pool and carries the next pull to that peer: P's ROUTER answers each
//! message on its own, addressed by the connection's identity, and nothing of the finished pull
//! can still arrive. Any other ending (deadline, channel error, malformed reply, ERROR, channel
//! closed early) closes the socket (PROTOCOL.md §2.1), so a late reply is never read as another
//! pull's.
//!
//! ZMQ hides the TCP connection: a refused connect is retried forever and a peer that dies just
//! goes quiet. So a new DEALER carries a socket monitor (an inproc PAIR) until its first request
//! is taken, and the stream turns connection events into [`TransportError`]s, which make the
//! Peer restart with backoff:
//! - `CONNECT_RETRIED` before the ZMTP handshake succeeded: connection refused/unreachable;
//! - `HANDSHAKE_FAILED_*`: whatever listens there is not a ZMQ peer;
//! - `DISCONNECTED`: the peer's process exited or closed its ROUTER, a heartbeat timed out (a
//!   vanished host), or the peer sent a message over the size cap (libzmq drops the connection).
//!
//! Once the request is taken the DEALER has its one connection, and the monitor is stopped and
//! closed (its two sockets and their inproc pipes were a third of a held pull's memory,
//! docs/PERFORMANCE.md): what it would still report is the connection's loss, and that the
//! DEALER shows by itself. With `ZMQ_IMMEDIATE` libzmq removes a lost connection's pipe from the
//! socket at once (a command to its mailbox, which wakes the task) and attaches a new one only
//! after the reconnect interval (1 s here): so a DEALER that took a message and no longer
//! reports `POLLOUT` lost its connection, a [`TransportError::Recv`] as `DISCONNECTED` was.
//!
//! Every DEALER has `ZMQ_IMMEDIATE`: libzmq takes a message only into a connection whose
//! handshake succeeded, never into a queue that a later connection would deliver. So a pull
//! whose send is still waiting when one of these events comes was never handed to P:
//! [`TransportError::Connect`], which the Peer settles Failed, with no landing window to poison
//! (P cannot write what it never got). Once the send is taken, a failure is Uncertain. (Without
//! it, a pull to an address nobody listens on was queued, failed Uncertain and poisoned its
//! window for the quarantine deadline: a few hostile bootstrap servers listing closed ports
//! used up every window.)
//!
//! A pooled DEALER is checked when it is taken: no connection now (`POLLOUT` off: lost while it
//! was idle and not back), or any message that arrived for no pull, and it is closed instead of
//! used. A send into a pooled DEALER that cannot be taken at once means its connection went
//! since: [`TransportError::Connect`], never sent.
//!
//! Replies that were already queued when the connection dropped are delivered first. A peer that
//! is alive but never answers is left to the Peer's deadline.

#![forbid(unsafe_code)]

use crate::fast_hash::FastMap;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::future::poll_fn;
use futures::stream;
use futures::StreamExt;

use crate::actors::transport::{CleanFinish, Frames, PeerTransport, ReplyStream, TransportError};
use crate::messages::PeerId;
use crate::telemetry::{self as m, Labels};

use super::async_socket::{AsyncSocket, SocketError};
use super::control_cpu::{pin_current_thread, ControlCpu};
use super::fd_exhaustion::{fd_exhaustion, note_fd_exhaustion};
use super::zmq_context::{set_engine_batch, ZmqContext, DEFAULT_MAX_SOCKETS, ENGINE_BATCH};

/// Knobs of the ZMQ side channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZmqTransportConfig {
    /// `ZMQ_MAXMSGSIZE`: an inbound frame larger than this drops the connection. libzmq has
    /// no cap on a whole multipart message: one of many frames under this is queued whole
    /// before it can be refused as a malformed reply (PROTOCOL.md §7.2).
    pub max_msg_size: i64,
    /// `ZMQ_CONNECT_TIMEOUT`: a TCP connect that takes longer counts as refused.
    pub connect_timeout: Duration,
    /// `ZMQ_HEARTBEAT_IVL` / `ZMQ_HEARTBEAT_TIMEOUT` (ZMTP 3.1 PING/PONG, answered by P's libzmq
    /// I/O thread even while P's Python code is busy): detects a host that vanished without
    /// closing TCP. Zero disables. Default 10 s: with `heartbeat_timeout`, a P that stops
    /// answering with its connection open is noticed after about 40 s.
    pub heartbeat_ivl: Duration,
    /// How long without any traffic (PONG included) before the connection counts as dead.
    /// Default 30 s.
    pub heartbeat_timeout: Duration,
    /// `ZMQ_MAX_SOCKETS` of the transport's context: a pull holds three sockets until its
    /// request is taken (its DEALER and the monitor pair), one after, and so does a pooled
    /// DEALER (libzmq's default cap of 1023 allows only 341 connecting pulls at once).
    pub max_sockets: i32,
    /// Connected DEALERs kept per peer for later pulls (0: a fresh DEALER per pull, as vLLM).
    pub idle_per_peer: usize,
    /// A pooled DEALER unused for this long is closed (a peer that went away, a burst that
    /// ended) when the pool is next touched.
    pub idle_timeout: Duration,
    /// Raise the process's soft `RLIMIT_NOFILE` to its hard limit when the transport starts
    /// (default on; the limit stays raised). Off for a host that keeps a low limit on purpose
    /// (`select()` and `FD_SETSIZE`): pulls then fail once descriptors run out.
    pub raise_nofile_limit: bool,
    /// Where the control plane runs. [`ControlCpu::Any`] (the default) pins nothing. Asked to
    /// ([`ControlCpu::Current`]: the CPU the creating thread is on then; or
    /// [`ControlCpu::Fixed`]), the thread that creates the transport (the one that runs the
    /// coordinator's actors and uses the sockets) and libzmq's I/O thread are pinned to one
    /// CPU, so that a pull's hand-offs between them are not cross-CPU wake-ups (`kvrecv serve`
    /// and `kvrecv bench` do, docs/PERFORMANCE.md). Threads that thread spawns later inherit
    /// its CPU (kvrecv's data-plane threads unpin themselves). A CPU this process may not run
    /// on is warned about and left to the scheduler.
    pub control_cpu: ControlCpu,
}

impl Default for ZmqTransportConfig {
    fn default() -> Self {
        ZmqTransportConfig {
            max_msg_size: 16 * 1024 * 1024,
            connect_timeout: Duration::from_secs(5),
            heartbeat_ivl: Duration::from_secs(10),
            heartbeat_timeout: Duration::from_secs(30),
            max_sockets: DEFAULT_MAX_SOCKETS,
            idle_per_peer: 64,
            idle_timeout: Duration::from_secs(60),
            raise_nofile_limit: true,
            control_cpu: ControlCpu::default(),
        }
    }
}

/// Gives each pull a DEALER (pooled or new) on a shared context.
pub struct ZmqTransport {
    ctx: ZmqContext,
    cfg: ZmqTransportConfig,
    pool: Rc<Pool>,
    labels: Labels,
    cpu: Option<usize>,
}

/// The name libzmq's threads (its I/O thread and its reaper) carry.
pub const ZMQ_THREAD_NAME: &str = "kvrecv-zmq";

/// How often the pool looks for DEALERs idle past their timeout.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

struct Idle {
    ch: Channel,
    since: Instant,
}

/// Connected DEALERs whose last pull ended with a clean FINISH, per peer, most recent last.
struct Pool {
    idle: RefCell<FastMap<PeerId, Vec<Idle>>>,
    /// Per peer: channels lent to pulls now, and the most ever lent at once.
    lent: RefCell<FastMap<PeerId, Lent>>,
    max_per_peer: usize,
    idle_timeout: Duration,
    last_sweep: Cell<Instant>,
}

impl Pool {
    fn new(cfg: &ZmqTransportConfig) -> Self {
        Pool {
            idle: RefCell::new(FastMap::default()),
            lent: RefCell::new(FastMap::default()),
            max_per_peer: cfg.idle_per_peer,
            idle_timeout: cfg.idle_timeout,
            last_sweep: Cell::new(Instant::now()),
        }
    }

    /// A usable pooled DEALER to `peer` (the most recently used), or `None`. The unusable ones
    /// met on the way are closed.
    fn take(&self, peer: &PeerId) -> Option<Channel> {
        self.sweep();
        let mut idle = self.idle.borrow_mut();
        let list = idle.get_mut(peer)?;
        while let Some(Idle { mut ch, since }) = list.pop() {
            if since.elapsed() < self.idle_timeout && ch.usable_after_idle() {
                return Some(ch);
            }
        }
        None
    }

    /// A channel to `peer` is lent to a pull.
    fn lend(&self, peer: &PeerId) {
        let mut lent = self.lent.borrow_mut();
        let l = lent.entry(peer.clone()).or_default();
        l.now += 1;
        l.peak = l.peak.max(l.now);
    }

    /// A lent channel came back: kept for the next pull if `reusable` and the peer has room,
    /// closed otherwise.
    fn give_back(&self, ch: Channel, reusable: bool) {
        let (now, peak) = {
            let mut lent = self.lent.borrow_mut();
            match lent.get_mut(&ch.peer) {
                Some(l) => {
                    l.now = l.now.saturating_sub(1);
                    (l.now, l.peak)
                }
                None => (0, 0),
            }
        };
        if reusable {
            self.put(ch, now, peak);
        }
    }

    /// Keep `ch` for the next pull to its peer, or close it if the peer has enough: the pool and
    /// the pulls together hold no more channels to a peer than its pulls ever needed at once
    /// (or `idle_per_peer`, if more). Replies come in bursts, so channels come back in bursts
    /// before the next burst of pulls: with the pool capped at 64 a peer serving 256 pulls at
    /// once had 5,307 of 16,004 channels closed on return and as many DEALERs opened again.
    fn put(&self, ch: Channel, still_lent: usize, peak_lent: usize) {
        if self.max_per_peer == 0 {
            return;
        }
        let mut idle = self.idle.borrow_mut();
        let list = idle.entry(ch.peer.clone()).or_default();
        if list.len() + still_lent < self.max_per_peer.max(peak_lent) {
            list.push(Idle {
                ch,
                since: Instant::now(),
            });
        }
    }

    /// [`Self::sweep_now`], at most once per [`SWEEP_EVERY`].
    fn sweep(&self) {
        if self.last_sweep.get().elapsed() < SWEEP_EVERY {
            return;
        }
        self.sweep_now();
    }

    /// Close DEALERs idle past the timeout (their peer may be gone for good, a P restarted on
    /// new ports, and each holds descriptors) and those that would not be taken any more
    /// ([`Channel::usable_after_idle`]): a message queued on an idle DEALER is held by libzmq
    /// until the socket closes, up to its high-water mark of `max_msg_size` messages (a hostile
    /// P filled 4.6 GB in 16 s that way).
    fn sweep_now(&self) {
        self.last_sweep.set(Instant::now());
        let timeout = self.idle_timeout;
        let mut idle = self.idle.borrow_mut();
        idle.retain(|_, list| {
            list.retain_mut(|i| i.since.elapsed() < timeout && i.ch.usable_after_idle());
            !list.is_empty()
        });
        // A peer with nothing lent and nothing idle is forgotten, its peak with it: a P that
        // restarted on new ports leaves no entry behind, and a burst long past no longer sizes
        // the pool.
        self.lent
            .borrow_mut()
            .retain(|peer, l| l.now > 0 || idle.contains_key(peer));
    }
}

/// Channels of one peer lent to pulls.
#[derive(Default)]
struct Lent {
    now: usize,
    peak: usize,
}

/// A pull's hold on its channel: back to the pool on drop if the Peer marked the pull finished
/// cleanly and the channel saw no failure, closed otherwise.
struct Lease {
    ch: Option<Channel>,
    pool: Rc<Pool>,
    finish: CleanFinish,
}

impl Lease {
    fn ch(&mut self) -> &mut Channel {
        self.ch
            .as_mut()
            .expect("a lease holds its channel until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(ch) = self.ch.take() {
            let reusable = self.finish.is_set() && ch.broken.is_none();
            self.pool.give_back(ch, reusable);
        }
    }
}

static MONITOR_SEQ: AtomicU64 = AtomicU64::new(0);

const MONITORED: i32 = (zmq_sys_events::CONNECT_RETRIED
    | zmq_sys_events::DISCONNECTED
    | zmq_sys_events::HANDSHAKE_SUCCEEDED
    | zmq_sys_events::HANDSHAKE_FAILED_NO_DETAIL
    | zmq_sys_events::HANDSHAKE_FAILED_PROTOCOL
    | zmq_sys_events::HANDSHAKE_FAILED_AUTH) as i32;

/// libzmq 4.3 monitor event ids (`ZMQ_EVENT_*`), as the first two bytes of an event message.
mod zmq_sys_events {
    pub const CONNECT_RETRIED: u16 = 0x0004;
    pub const DISCONNECTED: u16 = 0x0200;
    pub const HANDSHAKE_FAILED_NO_DETAIL: u16 = 0x0800;
    pub const HANDSHAKE_SUCCEEDED: u16 = 0x1000;
    pub const HANDSHAKE_FAILED_PROTOCOL: u16 = 0x2000;
    pub const HANDSHAKE_FAILED_AUTH: u16 = 0x4000;
}

impl ZmqTransport {
    /// A transport on a new context. Also raises the process's soft `RLIMIT_NOFILE` to its
    /// hard limit (as Go's runtime does at start) unless `raise_nofile_limit` is off: every
    /// socket holds descriptors, and a pull that cannot get one fails its requests.
    pub fn new(cfg: ZmqTransportConfig) -> Self {
        if cfg.raise_nofile_limit {
            match rlimit::increase_nofile_limit(u64::MAX) {
                Ok(n) => tracing::debug!(nofile = n, "file descriptor limit"),
                Err(e) => tracing::warn!(error = %e, "cannot raise the file descriptor limit"),
            }
        }
        let ctx = ZmqContext::new(cfg.max_sockets).unwrap_or_else(|e| {
            // Out of memory or descriptors at start: libzmq's own default context still works.
            tracing::error!(error = %e, "cannot create a ZMQ context with a raised socket cap");
            ZmqContext::new(1023).expect("a libzmq context")
        });
        let cpu = match pin_current_thread(cfg.control_cpu) {
            Ok(cpu) => cpu,
            Err(e) => {
                tracing::warn!(error = %e, placement = %cfg.control_cpu, "cannot place the control plane; the scheduler places it");
                None
            }
        };
        if let Some(cpu) = cpu {
            match ctx.set_io_thread_cpu(cpu) {
                Ok(()) => tracing::info!(
                    cpu,
                    "control plane (actors and libzmq's I/O thread) on one CPU"
                ),
                Err(e) => tracing::warn!(error = %e, cpu, "cannot place libzmq's I/O thread"),
            }
            // Sharing a CPU, the two would otherwise preempt each other at every send.
            if let Err(e) = ctx.set_io_thread_batch() {
                tracing::warn!(error = %e, "cannot set libzmq's I/O thread's policy");
            }
        }
        // libzmq's threads (I/O and reaper) start with the context's first socket and take
        // the name of the thread that made it: made from a thread of their own, they are
        // `kvrecv-zmq`, not the creating thread's name (a host's thread, or kvrecv's actors').
        if let Err(e) = ctx.start_threads(ZMQ_THREAD_NAME) {
            tracing::warn!(error = %e, "cannot start libzmq's threads up front; the first pull starts them");
        }
        let pool = Rc::new(Pool::new(&cfg));
        ZmqTransport {
            ctx,
            cfg,
            pool,
            labels: Labels::default(),
            cpu,
        }
    }

    /// The CPU the control plane was pinned to, if it was (see
    /// [`ZmqTransportConfig::control_cpu`]).
    pub fn control_cpu(&self) -> Option<usize> {
        self.cpu
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub(crate) fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// The context (unit tests share it for inproc sockets).
    #[cfg(test)]
    pub(crate) fn context(&self) -> &ZmqContext {
        &self.ctx
    }

    /// The pull's channel: a pooled one if usable, else a new one; `Local` when D could not
    /// create its sockets (nothing was sent, so the peer is not to blame), `BadAddress` when
    /// the peer's address cannot be dialled (nothing was sent either).
    fn channel(&self, peer: &PeerId) -> Result<Channel, TransportError> {
        if let Some(ch) = self.pool.take(peer) {
            self.labels
                .counter_by(m::SIDE_CHANNELS, "how", "reused")
                .increment(1);
            return Ok(ch);
        }
        self.labels
            .counter_by(m::SIDE_CHANNELS, "how", "opened")
            .increment(1);
        self.open(peer)
    }

    fn open(&self, peer: &PeerId) -> Result<Channel, TransportError> {
        // Checked before any socket exists: the `zmq` crate panics on a NUL in an endpoint.
        if let Some(reason) = crate::actors::topology::undialable(peer.addr()) {
            return Err(TransportError::BadAddress {
                peer: peer.clone(),
                reason: reason.into(),
            });
        }
        let mut ch = self.sockets(peer).map_err(|e| {
            let errno = match &e {
                SocketError::Zmq(z) => z.to_raw(),
                SocketError::Io(io) => io.raw_os_error().unwrap_or(0),
            };
            if matches!(errno, libc::EMFILE | libc::ENFILE) {
                note_fd_exhaustion();
            }
            TransportError::Local {
                peer: peer.clone(),
                reason: e.to_string(),
            }
        })?;
        ch.dealer
            .socket()
            .connect(peer.addr())
            .map_err(|e| TransportError::BadAddress {
                peer: peer.clone(),
                reason: format!("zmq: {e}"),
            })?;
        Ok(ch)
    }

    fn sockets(&self, peer: &PeerId) -> Result<Channel, SocketError> {
        let ms = |d: Duration| i32::try_from(d.as_millis()).unwrap_or(i32::MAX);
        let mut dealer = self.ctx.socket(zmq::DEALER)?;
        set_engine_batch(&mut dealer, ENGINE_BATCH)?;
        dealer.set_linger(0)?;
        dealer.set_maxmsgsize(self.cfg.max_msg_size)?;
        dealer.set_connect_timeout(ms(self.cfg.connect_timeout))?;
        if !self.cfg.heartbeat_ivl.is_zero() {
            dealer.set_heartbeat_ivl(ms(self.cfg.heartbeat_ivl))?;
            dealer.set_heartbeat_timeout(ms(self.cfg.heartbeat_timeout))?;
        }
        // A lost connection's pipe is gone for at least this long before a new connection's
        // is attached: the window in which a held pull sees the loss (module doc). A refused
        // first connect is reported (`CONNECT_RETRIED`) when its retry is scheduled, whatever
        // the interval. Backing off to 30 s keeps a pooled DEALER whose peer went away from
        // dialling it often.
        dealer.set_reconnect_ivl(1_000)?;
        dealer.set_reconnect_ivl_max(30_000)?;
        // A message is taken only into a connection (see the module's doc).
        dealer.set_immediate(true)?;
        // The monitor must exist before connect, or the first events are lost.
        let endpoint = format!(
            "inproc://kvrecv-monitor-{}",
            MONITOR_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        dealer.monitor(&endpoint, MONITORED)?;
        let monitor = self.ctx.socket(zmq::PAIR)?;
        monitor.set_linger(0)?;
        // libzmq sends monitor events blocking, from the context's I/O thread: a reader at its
        // high-water mark (1000 unread events of a long-idle DEALER) would stall every socket
        // of the context. 0 makes the inproc pipe unbounded (set before connect).
        monitor.set_rcvhwm(0)?;
        monitor.connect(&endpoint)?;
        // Wrapped before connecting: from here on `Drop for Channel` stops the monitor before
        // either socket closes, whatever fails.
        let ch = Channel {
            peer: peer.clone(),
            dealer: AsyncSocket::new(dealer)?,
            monitor: Some(AsyncSocket::new(monitor)?),
            handshaken: false,
            broken: None,
            max_msg_size: self.cfg.max_msg_size,
            labels: self.labels.clone(),
            _ctx: self.ctx.clone(),
        };
        Ok(ch)
    }
}

impl Default for ZmqTransport {
    fn default() -> Self {
        ZmqTransport::new(ZmqTransportConfig::default())
    }
}

/// A DEALER and, until its first request is taken, its connection monitor, carrying one pull
/// at a time.
struct Channel {
    peer: PeerId,
    dealer: AsyncSocket,
    /// The monitor's reader; `None` once a request was taken (see the module's doc).
    monitor: Option<AsyncSocket>,
    handshaken: bool,
    /// The connection failed; reported once the replies queued before it are delivered.
    broken: Option<TransportError>,
    max_msg_size: i64,
    labels: Labels,
    /// Last: the sockets above close before this reference to their context goes.
    _ctx: ZmqContext,
}

impl Drop for Channel {
    /// Stop the DEALER's monitor before the DEALER and the reader close. Closing the reader
    /// while the DEALER can still report events (its close is asynchronous, see
    /// [`AsyncSocket::stop_monitor`]) would block this context's I/O thread for ever on the next
    /// event: every later pull of the transport would then hang without a connection event.
    fn drop(&mut self) {
        if self.monitor.is_some() {
            if let Err(e) = self.dealer.stop_monitor() {
                tracing::warn!(peer = %self.peer, error = %e, "cannot stop the side-channel monitor");
            }
        }
    }
}

enum Step {
    Reply(Frames),
    Fail(TransportError),
}

impl Channel {
    fn recv_err(&self, e: SocketError) -> TransportError {
        TransportError::Recv {
            peer: self.peer.clone(),
            reason: e.to_string(),
        }
    }

    /// A monitor event, turned into a channel failure when it is one.
    fn on_event(&mut self, frames: &[Vec<u8>]) -> Option<TransportError> {
        on_event(&self.peer, &mut self.handshaken, self.max_msg_size, frames)
    }

    /// Hand the pull's request to the DEALER, which takes it once it has a connection. A
    /// connection event while it waits means P never got it: [`TransportError::Connect`]. Once
    /// it is taken the monitor goes ([`Self::unmonitor`]).
    async fn send(&mut self, request: &[u8]) -> Result<(), TransportError> {
        self.send_watched(request).await?;
        self.unmonitor();
        Ok(())
    }

    async fn send_watched(&mut self, request: &[u8]) -> Result<(), TransportError> {
        let Channel {
            peer,
            dealer,
            monitor,
            handshaken,
            max_msg_size,
            ..
        } = self;
        let frames = [request];
        let Some(monitor) = monitor else {
            // A pooled DEALER: connected when it was taken, so it takes one message at once
            // (`ZMQ_IMMEDIATE`, far below the high-water mark) unless that connection is gone.
            return match dealer.socket().send_multipart(frames, zmq::DONTWAIT) {
                Ok(()) => Ok(()),
                Err(zmq::Error::EAGAIN) => Err(TransportError::Connect {
                    peer: peer.clone(),
                    reason: "connection lost while the side channel was idle; the request \
                             was never sent"
                        .into(),
                }),
                Err(e) => Err(TransportError::Send {
                    peer: peer.clone(),
                    reason: e.to_string(),
                }),
            };
        };
        let send = dealer.send_multipart(&frames);
        futures::pin_mut!(send);
        poll_fn(|cx| {
            // The send first: taken is taken, whatever the monitor says next.
            if let Poll::Ready(r) = std::future::Future::poll(send.as_mut(), cx) {
                return Poll::Ready(r.map_err(|e| TransportError::Send {
                    peer: peer.clone(),
                    reason: e.to_string(),
                }));
            }
            loop {
                match monitor.poll_recv_multipart(cx) {
                    Poll::Ready(Ok(ev)) => {
                        if let Some(e) = on_event(peer, handshaken, *max_msg_size, &ev) {
                            return Poll::Ready(Err(unsent(e, peer)));
                        }
                    }
                    Poll::Ready(Err(e)) => {
                        return Poll::Ready(Err(TransportError::Send {
                            peer: peer.clone(),
                            reason: e.to_string(),
                        }))
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await
    }
}

/// A connection failure seen while the pull's request still waited to be taken: whatever the
/// event, nothing reached P.
fn unsent(e: TransportError, peer: &PeerId) -> TransportError {
    match e {
        TransportError::Connect { .. } => e,
        other => TransportError::Connect {
            peer: peer.clone(),
            reason: format!("{other}; the request was never sent"),
        },
    }
}

/// The DEALER's connection to `peer` is gone: its monitor's `DISCONNECTED`, or (unmonitored) no
/// `POLLOUT` after a request was taken.
fn connection_lost(peer: &PeerId, max_msg_size: i64) -> TransportError {
    TransportError::Recv {
        peer: peer.clone(),
        reason: format!(
            "connection lost (peer exited or closed its socket, heartbeat timeout, or a reply \
             over the {max_msg_size}-byte cap)"
        ),
    }
}

/// A monitor event of the DEALER to `peer`, turned into a channel failure when it is one.
fn on_event(
    peer: &PeerId,
    handshaken: &mut bool,
    max_msg_size: i64,
    frames: &[Vec<u8>],
) -> Option<TransportError> {
    let id = frames
        .first()
        .filter(|f| f.len() >= 2)
        .map(|f| u16::from_ne_bytes([f[0], f[1]]))?;
    let peer = peer.clone();
    match id {
        zmq_sys_events::HANDSHAKE_SUCCEEDED => {
            *handshaken = true;
            None
        }
        zmq_sys_events::CONNECT_RETRIED if !*handshaken => Some(TransportError::Connect {
            peer,
            // libzmq retries a connect whose socket() failed as it does a refused one.
            reason: match fd_exhaustion() {
                Some(use_) => format!("cannot open a connection: {use_}"),
                None => "connection refused or unreachable (or the host name did not \
                             resolve)"
                    .into(),
            },
        }),
        zmq_sys_events::DISCONNECTED => Some(connection_lost(&peer, max_msg_size)),
        zmq_sys_events::HANDSHAKE_FAILED_NO_DETAIL
        | zmq_sys_events::HANDSHAKE_FAILED_PROTOCOL
        | zmq_sys_events::HANDSHAKE_FAILED_AUTH => Some(TransportError::Connect {
            peer,
            reason: "ZMTP handshake failed (not a ZMQ peer?)".into(),
        }),
        _ => None,
    }
}

impl Channel {
    /// Whether a pooled channel may carry another pull: no connection failure reported while it
    /// was idle, and nothing queued (a message for no pull means the peer and D disagree about
    /// where the last pull ended). The monitor is read only if it signalled: a failure the
    /// runtime has not seen yet fails the pull that takes the channel, as one coming a moment
    /// later would.
    fn usable_after_idle(&mut self) -> bool {
        while let Some(monitor) = self.monitor.as_mut() {
            match monitor.recv_if_signalled() {
                Ok(Some(ev)) => {
                    if let Some(e) =
                        on_event(&self.peer, &mut self.handshaken, self.max_msg_size, &ev)
                    {
                        tracing::debug!(error = %e, "pooled side channel closed");
                        return false;
                    }
                }
                Ok(None) => break,
                Err(_) => return false,
            }
        }
        // One mailbox check answers both: a message for no pull (`POLLIN`), and whether it is
        // connected now (`POLLOUT`; module doc): lost while idle and not back, it is closed.
        match self.dealer.socket().get_events() {
            Ok(e) if e.contains(zmq::POLLIN) => {
                tracing::warn!(peer = %self.peer, "message on an idle side channel; closing it");
                false
            }
            Ok(e) if e.contains(zmq::POLLOUT) => true,
            Ok(_) => {
                tracing::debug!(peer = %self.peer, "pooled side channel lost its connection; closing it");
                false
            }
            Err(_) => false,
        }
    }

    /// After a connection failure: deliver what arrived before it, then report it.
    fn drain_broken(&mut self) -> Step {
        let Some(err) = self.broken.take() else {
            return Step::Fail(TransportError::Closed {
                peer: self.peer.clone(),
            });
        };
        match self.dealer.try_recv_multipart() {
            Ok(Some(f)) => {
                self.broken = Some(err);
                Step::Reply(f)
            }
            Ok(None) => Step::Fail(err),
            Err(e) => Step::Fail(self.recv_err(e)),
        }
    }

    async fn next(&mut self) -> Step {
        if self.broken.is_some() {
            return self.drain_broken();
        }
        poll_fn(|cx| loop {
            let Some(monitor) = self.monitor.as_mut() else {
                // Unmonitored (the request was taken): a reply, or the connection's loss once
                // no reply is queued (module doc).
                return match self.dealer.poll_recv_or_unconnected(cx) {
                    Poll::Ready(Ok(Some(f))) => Poll::Ready(Step::Reply(f)),
                    Poll::Ready(Ok(None)) => {
                        self.broken = Some(connection_lost(&self.peer, self.max_msg_size));
                        Poll::Ready(self.drain_broken())
                    }
                    Poll::Ready(Err(e)) => Poll::Ready(Step::Fail(self.recv_err(e))),
                    Poll::Pending => Poll::Pending,
                };
            };
            // Still monitored (its stop failed): data first, a reply queued before a disconnect
            // must not be lost to it; then the monitor's events, as before the send.
            match self.dealer.poll_recv_multipart(cx) {
                Poll::Ready(Ok(f)) => return Poll::Ready(Step::Reply(f)),
                Poll::Ready(Err(e)) => return Poll::Ready(Step::Fail(self.recv_err(e))),
                Poll::Pending => {}
            }
            match monitor.poll_recv_multipart(cx) {
                Poll::Ready(Ok(ev)) => {
                    if let Some(err) = self.on_event(&ev) {
                        self.broken = Some(err);
                        return Poll::Ready(self.drain_broken());
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Step::Fail(self.recv_err(e))),
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }

    /// Stop and close the monitor once a request was taken (see the module's doc). What it
    /// reported before it stopped is read first: a loss among it breaks the channel.
    fn unmonitor(&mut self) {
        let Some(mut monitor) = self.monitor.take() else {
            return;
        };
        if let Err(e) = self.dealer.stop_monitor() {
            // Still monitored: keep the reader, or the next event would wedge libzmq's I/O
            // thread (`Drop for Channel`).
            tracing::warn!(peer = %self.peer, error = %e, "cannot stop the side-channel monitor");
            self.monitor = Some(monitor);
            return;
        }
        // Stopped under libzmq's monitor lock: every event it sent is in the pipe already.
        loop {
            match monitor.try_recv_multipart() {
                Ok(Some(ev)) => {
                    if let Some(err) =
                        on_event(&self.peer, &mut self.handshaken, self.max_msg_size, &ev)
                    {
                        self.broken.get_or_insert(err);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    let err = self.recv_err(e);
                    self.broken.get_or_insert(err);
                    break;
                }
            }
        }
    }
}

fn count(labels: &Labels, e: &TransportError) {
    let kind = match e {
        TransportError::Local { .. } => "local",
        TransportError::BadAddress { .. } => "bad_address",
        TransportError::Connect { .. } => "connect",
        TransportError::Send { .. } => "send",
        TransportError::Recv { .. } => "recv",
        TransportError::Closed { .. } => "closed",
    };
    labels
        .counter_by(m::TRANSPORT_ERRORS, "kind", kind)
        .increment(1);
    tracing::warn!(error = %e, "side channel failed");
}

impl PeerTransport for ZmqTransport {
    fn pull(&self, peer: &PeerId, request: Vec<u8>, finish: CleanFinish) -> ReplyStream {
        let ch = match self.channel(peer) {
            Ok(ch) => ch,
            Err(err) => {
                count(&self.labels, &err);
                return stream::once(async move { Err(err) }).boxed_local();
            }
        };
        self.pool.lend(peer);
        let lease = Lease {
            ch: Some(ch),
            pool: self.pool.clone(),
            finish,
        };
        // State: the lease and the request still to send; `None` once failed (the stream ends
        // after its error item, and the failed channel closes with its lease).
        stream::unfold(Some((lease, Some(request))), |st| async move {
            let (mut lease, request) = st?;
            // The Peer marks a clean FINISH while handling it, before the stream is polled
            // again: nothing more can come for this pull, so the stream ends without reading
            // the sockets once more (three `poll`s on their mailboxes per pull) and the
            // channel goes back to the pool.
            if request.is_none() && lease.finish.is_set() {
                return None;
            }
            let ch = lease.ch();
            if let Some(req) = request {
                if let Err(err) = ch.send(&req).await {
                    count(&ch.labels, &err);
                    return Some((Err(err), None));
                }
            }
            match ch.next().await {
                Step::Reply(f) => Some((Ok(f), Some((lease, None)))),
                Step::Fail(e) => {
                    count(&ch.labels, &e);
                    Some((Err(e), None))
                }
            }
        })
        .boxed_local()
    }

    fn sweep_idle(&self) {
        self.pool.sweep_now();
    }
}

#[cfg(test)]
#[path = "zmq_transport_tests.rs"]
mod tests;
