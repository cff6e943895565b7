//! A libzmq socket driven by tokio without blocking: `AsyncFd` on the socket's `ZMQ_FD`.
//!
//! Rules (DEPENDENCIES.md, "ZeroMQ from async Rust"): the fd is registered for READABLE only (it
//! signals a command in the socket's mailbox and is edge-triggered; it is never read); every
//! operation is tried with `DONTWAIT` first.
//!
//! Receiving trusts tokio's readiness only while the socket is *primed*: the last libzmq call
//! on it that could process its mailbox was a receive that found nothing. Such a receive drained
//! the mailbox and put the reader of every pipe to sleep, so whatever arrives next (a message
//! into a sleeping pipe, a new pipe) is a command that signals the fd. Anything else unprimes
//! it: a receive that got a message leaves its pipe awake (the next message there signals
//! nothing), a send or `ZMQ_EVENTS` may process the mailbox and consume a signal, and a new
//! socket's pipes start awake. An unprimed socket is always tried before waiting. Each try that
//! finds nothing is a `poll` on the mailbox; this keeps it to one per wait.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::raw::{c_char, c_int, c_void};
use std::task::{Context, Poll};

use futures::future::{poll_fn, FutureExt};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The signalling fd of a libzmq socket. libzmq owns it: dropping this closes nothing.
struct ZmqFd(RawFd);

impl AsRawFd for ZmqFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

extern "C" {
    // libzmq's own entry point (linked through `zmq-sys`); the `zmq` crate has no way to pass
    // the NULL endpoint that stops a monitor.
    fn zmq_socket_monitor(s: *mut c_void, addr: *const c_char, events: c_int) -> c_int;
}

/// Why an operation on an [`AsyncSocket`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("reactor: {0}")]
    Io(#[from] io::Error),
}

/// A `zmq::Socket` usable from async code on any tokio runtime (current-thread included).
/// Methods take `&mut self` because `zmq::Socket` is `Send` but not `Sync`.
pub struct AsyncSocket {
    // Declared first so it is dropped first: the fd is deregistered from the reactor before
    // `zmq_close` closes it.
    fd: AsyncFd<ZmqFd>,
    sock: zmq::Socket,
    /// See the module's doc: readiness can be trusted to announce the next message.
    primed: bool,
}

impl AsyncSocket {
    /// Wrap a configured socket. Needs a tokio reactor (call inside a runtime).
    pub fn new(sock: zmq::Socket) -> Result<Self, SocketError> {
        let raw = ZmqFd(sock.get_fd()?);
        // SAFETY: `ZMQ_FD` is libzmq's signaler fd, open until `zmq_close`; `fd` is declared
        // before `sock`, so the registration is dropped before the socket closes the fd.
        let fd = unsafe { AsyncFd::register_with_interest(raw, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(AsyncSocket {
            fd,
            sock,
            primed: false,
        })
    }

    /// The underlying socket (options, bind, connect, a send that must not wait). Any call
    /// on it may process the socket's mailbox (libzmq's connect, bind and send do), so the next
    /// receive asks the socket before it trusts readiness.
    pub fn socket(&mut self) -> &zmq::Socket {
        self.primed = false;
        &self.sock
    }

    /// The underlying socket for raw options (tests read them back).
    #[cfg(test)]
    pub fn socket_mut(&mut self) -> &mut zmq::Socket {
        self.primed = false;
        &mut self.sock
    }

    /// Stop the socket's monitor now, if it has one (`zmq_socket_monitor(s, NULL, 0)`).
    ///
    /// Call it before closing a monitored socket. `zmq_close` is asynchronous: the socket lives on
    /// in libzmq's reaper until its sessions are gone, and its monitor is stopped only when it is
    /// destroyed. Meanwhile its session can still emit events (a DEALER whose connection dropped
    /// schedules a reconnect and reports `CONNECT_RETRIED`) from the context's I/O thread, which
    /// sends them on the monitor PAIR *blocking*: once the reader has been closed nobody takes
    /// them and the I/O thread blocks for ever, taking every socket of the context with it.
    /// After this call (serialised with event emission by libzmq's monitor lock) no event is
    /// sent any more.
    pub fn stop_monitor(&mut self) -> Result<(), SocketError> {
        // SAFETY: `as_mut_ptr` is this open socket's handle (closed only when `sock` drops);
        // a NULL endpoint with no events is libzmq's documented way to stop monitoring, valid
        // whether or not a monitor is running.
        let rc = unsafe { zmq_socket_monitor(self.sock.as_mut_ptr(), std::ptr::null(), 0) };
        if rc == -1 {
            return Err(SocketError::Io(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Wait until `ZMQ_EVENTS` contains `wanted`, following the rules above.
    fn poll_event(
        &mut self,
        cx: &mut Context<'_>,
        wanted: zmq::PollEvents,
    ) -> Poll<Result<(), SocketError>> {
        loop {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            };
            // ZMQ_EVENTS processes the mailbox: a signal meant for a receive may be consumed.
            self.primed = false;
            let events = self.sock.get_events()?;
            // Cleared either way: ZMQ_EVENTS drained the mailbox, so what changes next signals
            // again. Kept, a send that fails again although ZMQ_EVENTS said it could go (a
            // ROUTER with ROUTER_MANDATORY: one peer's pipe full, another's not) would loop on
            // it without ever yielding.
            guard.clear_ready();
            if events.contains(wanted) {
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// Receive one whole multi-part message (every frame), without blocking the thread.
    pub fn poll_recv_multipart(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<Vec<u8>>, SocketError>> {
        loop {
            let guard = match readiness(&self.fd, self.primed, cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            match recv_now(&self.sock, &mut self.primed) {
                Ok(Some(frames)) => return Poll::Ready(Ok(frames)),
                Ok(None) => match guard {
                    // Loop to register the waker (or to try again if a signal came since).
                    Some(mut g) => g.clear_ready(),
                    // The waker is registered and nothing is pending.
                    None => return Poll::Pending,
                },
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }

    /// Receive one whole message, or `None` once the socket has no pipe to send on (`POLLOUT`
    /// off): for a DEALER with `ZMQ_IMMEDIATE` that took its message, its connection is gone.
    /// One mailbox check per wait, as [`Self::poll_recv_multipart`]: `ZMQ_EVENTS` answers both
    /// questions, and the message is read only once it says one is there. An answer without
    /// `POLLIN` leaves the socket as an empty receive does (mailbox drained, every pipe's reader
    /// asleep), so it primes it too.
    pub fn poll_recv_or_unconnected(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Vec<Vec<u8>>>, SocketError>> {
        loop {
            let guard = match readiness(&self.fd, self.primed, cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            let events = self.sock.get_events()?;
            if events.contains(zmq::POLLIN) {
                if let Some(frames) = recv_now(&self.sock, &mut self.primed)? {
                    return Poll::Ready(Ok(Some(frames)));
                }
            } else if !events.contains(zmq::POLLOUT) {
                self.primed = false;
                return Poll::Ready(Ok(None));
            } else {
                self.primed = true;
            }
            match guard {
                // Loop to register the waker (or to check again if a signal came since).
                Some(mut g) => g.clear_ready(),
                None => return Poll::Pending,
            }
        }
    }

    #[cfg(any(feature = "sim", feature = "testing"))]
    /// Receive one whole message.
    pub async fn recv_multipart(&mut self) -> Result<Vec<Vec<u8>>, SocketError> {
        poll_fn(|cx| self.poll_recv_multipart(cx)).await
    }

    /// Receive a message if one is queued right now (always asks the socket).
    pub fn try_recv_multipart(&mut self) -> Result<Option<Vec<Vec<u8>>>, SocketError> {
        // Readiness may stay set: a stale one costs one more try, never a lost message.
        Ok(recv_now(&self.sock, &mut self.primed)?)
    }

    /// Receive a message if one has been signalled: like [`Self::try_recv_multipart`], but
    /// without a syscall when the socket is primed and nothing was signalled since. A signal
    /// the runtime has not read from epoll yet is not seen: for checks that may be late. It
    /// replaces the waker of a receive that is pending: only for a socket no task waits on.
    pub(crate) fn recv_if_signalled(&mut self) -> Result<Option<Vec<Vec<u8>>>, SocketError> {
        // Outside the task's cooperative budget: a spent budget would make tokio answer
        // "not ready" for readiness it has, and the check would miss what it is for.
        tokio::task::unconstrained(poll_fn(|cx| self.poll_recv_multipart(cx)))
            .now_or_never()
            .transpose()
    }

    /// Send one message (`frames` as its parts), waiting while the socket is mute (HWM).
    pub async fn send_multipart(&mut self, frames: &[&[u8]]) -> Result<(), SocketError> {
        poll_fn(|cx| loop {
            // A send may process the mailbox (libzmq does, at most once a millisecond).
            self.primed = false;
            match self
                .sock
                .send_multipart(frames.iter().copied(), zmq::DONTWAIT)
            {
                Ok(()) => return Poll::Ready(Ok(())),
                Err(zmq::Error::EAGAIN) => {}
                Err(e) => return Poll::Ready(Err(e.into())),
            }
            match self.poll_event(cx, zmq::POLLOUT) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }
}

/// One receive, `DONTWAIT`, keeping `primed`: primed by a try that found nothing, unprimed
/// by one that got a message (its pipe's reader stays awake) or failed. Fields, not `&mut
/// AsyncSocket`: a readiness guard on the fd may be held across it.
fn recv_now(sock: &zmq::Socket, primed: &mut bool) -> Result<Option<Vec<Vec<u8>>>, zmq::Error> {
    // Parts of a multi-part message arrive atomically: once the first is readable the rest are
    // too, so DONTWAIT on every part is correct.
    let r = sock.recv_multipart(zmq::DONTWAIT);
    *primed = matches!(r, Err(zmq::Error::EAGAIN));
    match r {
        Ok(frames) => Ok(Some(frames)),
        Err(zmq::Error::EAGAIN) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether to try the socket now: its readiness guard when tokio saw a signal (taken before the
/// try, so that clearing it cannot lose a signal that came after), `None` when none came but the
/// socket is unprimed (tried anyway), `Pending` when primed and nothing was signalled since the
/// last empty try.
fn readiness<'a>(
    fd: &'a AsyncFd<ZmqFd>,
    primed: bool,
    cx: &mut Context<'_>,
) -> Poll<Result<Option<tokio::io::unix::AsyncFdReadyGuard<'a, ZmqFd>>, SocketError>> {
    match fd.poll_read_ready(cx) {
        Poll::Ready(Ok(g)) => Poll::Ready(Ok(Some(g))),
        Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
        Poll::Pending if primed => Poll::Pending,
        Poll::Pending => Poll::Ready(Ok(None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::zmq_context::ZmqContext;
    use std::time::Duration;

    const SAFETY: Duration = Duration::from_secs(20);

    /// A ROUTER on loopback and a DEALER connected to it, both wrapped.
    fn pair(ctx: &ZmqContext) -> (AsyncSocket, AsyncSocket) {
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.set_linger(0).unwrap();
        router.bind("tcp://127.0.0.1:0").unwrap();
        let addr = router.get_last_endpoint().unwrap().unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_linger(0).unwrap();
        // Wrapped before connect, as the transport does: connect attaches the pipe afterwards.
        let mut dealer = AsyncSocket::new(dealer).unwrap();
        dealer.socket().connect(&addr).unwrap();
        (AsyncSocket::new(router).unwrap(), dealer)
    }

    /// The next message on `s`, within [`SAFETY`]; `what` names it when it does not come.
    async fn recv_within(s: &mut AsyncSocket, what: &str) -> Vec<Vec<u8>> {
        tokio::time::timeout(SAFETY, s.recv_multipart())
            .await
            .unwrap_or_else(|_| panic!("{what}: nothing within {SAFETY:?}"))
            .unwrap()
    }

    /// Two PAIRs on `inproc://name`: the first bound, the second connected (its pipe's reader
    /// starts awake), both wrapped.
    fn inproc_pair(ctx: &ZmqContext, name: &str) -> (AsyncSocket, AsyncSocket) {
        let endpoint = format!("inproc://{name}");
        let a = ctx.socket(zmq::PAIR).unwrap();
        a.bind(&endpoint).unwrap();
        let b = ctx.socket(zmq::PAIR).unwrap();
        b.connect(&endpoint).unwrap();
        (AsyncSocket::new(a).unwrap(), AsyncSocket::new(b).unwrap())
    }

    /// Nothing to receive on `s` now; its receive is left waiting (with a waker that does
    /// nothing), its readiness cleared.
    fn nothing_yet(s: &mut AsyncSocket) {
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        assert!(s.poll_recv_multipart(&mut cx).is_pending(), "nothing yet");
    }

    /// [`pair`], once the DEALER's first message (`ask`) reached the ROUTER: the ROUTER, the
    /// DEALER and its routing id.
    async fn asked(ctx: &ZmqContext) -> (AsyncSocket, AsyncSocket, Vec<u8>) {
        let (mut router, mut dealer) = pair(ctx);
        dealer.send_multipart(&[b"ask"]).await.unwrap();
        let mut got = recv_within(&mut router, "the request arrives").await;
        assert_eq!(got.pop().unwrap(), b"ask");
        (router, dealer, got.remove(0))
    }

    /// The pipe `connect` attaches starts with its reader marked awake: its first message
    /// signals nothing. A receive that waits for readiness before any `ZMQ_EVENTS` check hangs
    /// here (seen, when waiting on readiness first was tried: every first pull on a new DEALER
    /// ran into its deadline).
    #[tokio::test]
    async fn first_reply_on_a_freshly_connected_dealer_is_received() {
        let ctx = ZmqContext::new(64).unwrap();
        let (mut router, mut dealer, id) = asked(&ctx).await;
        router.send_multipart(&[&id, b"reply"]).await.unwrap();
        let reply = recv_within(
            &mut dealer,
            "the first reply is seen without any other event on the socket",
        )
        .await;
        assert_eq!(reply, vec![b"reply".to_vec()]);
    }

    /// Replies queued together are all delivered (no edge comes for the second), and a reply
    /// that comes while the receiver waits with its readiness cleared wakes it.
    #[tokio::test]
    async fn queued_replies_are_all_delivered_and_a_later_one_wakes_the_waiter() {
        let ctx = ZmqContext::new(64).unwrap();
        let (mut router, mut dealer, id) = asked(&ctx).await;
        for part in [b"one", b"two"] {
            router.send_multipart(&[&id, part]).await.unwrap();
        }
        for want in [b"one", b"two"] {
            let got = recv_within(&mut dealer, "a queued reply is delivered").await;
            assert_eq!(got, vec![want.to_vec()]);
        }
        // Now nothing is queued: the receiver finds that out, clears readiness and waits.
        let waiter = tokio::spawn(async move {
            let got = dealer.recv_multipart().await;
            (dealer, got)
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "nothing to receive yet");
        router.send_multipart(&[&id, b"three"]).await.unwrap();
        let (mut dealer, got) = tokio::time::timeout(SAFETY, waiter)
            .await
            .expect("the later reply wakes the waiting receiver")
            .unwrap();
        assert_eq!(got.unwrap(), vec![b"three".to_vec()]);
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        assert!(
            dealer.poll_recv_multipart(&mut cx).is_pending(),
            "nothing more"
        );
    }

    /// Block until `fd` is readable (poll(2): neither libzmq nor tokio sees the check).
    fn wait_readable(fd: RawFd) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, SAFETY.as_millis() as i32) };
        assert_eq!(n, 1, "the signal arrives");
    }

    /// A send processes the socket's mailbox (libzmq does so at most once a millisecond): here
    /// it consumes the signal of a message that arrived after the receiver last found nothing,
    /// before the runtime saw it. The receive must still try the socket rather than wait for a
    /// signal that is gone, whether the send went through the wrapper or the raw socket (P's
    /// ROUTER sends that way).
    #[tokio::test]
    async fn a_message_whose_signal_a_send_consumed_is_still_received() {
        for raw in [false, true] {
            // A new pair each time: libzmq's throttle lets a socket's first send process.
            let ctx = ZmqContext::new(64).unwrap();
            let (mut router, mut dealer, id) = asked(&ctx).await;
            nothing_yet(&mut router);
            dealer.send_multipart(&[b"two"]).await.unwrap();
            wait_readable(router.fd.as_raw_fd());
            if raw {
                let frames = [id.as_slice(), b"reply"];
                router
                    .socket()
                    .send_multipart(frames, zmq::DONTWAIT)
                    .unwrap();
            } else {
                router.send_multipart(&[&id, b"reply"]).await.unwrap();
            }
            let what = format!("received though a send took its signal (raw {raw})");
            let got = recv_within(&mut router, &what).await;
            assert_eq!(got[1], b"two");
        }
    }

    /// A socket that connected and never sent (a monitor's reader) starts with its pipe's
    /// reader awake: the first message into it signals nothing, so it must be tried first.
    #[tokio::test]
    async fn the_first_message_on_a_socket_that_never_sent_is_received() {
        let ctx = ZmqContext::new(64).unwrap();
        let (mut a, mut b) = inproc_pair(&ctx, "never-sent");
        a.send_multipart(&[b"first"]).await.unwrap();
        let got = recv_within(&mut b, "the first message is received without a signal").await;
        assert_eq!(got, vec![b"first".to_vec()]);
    }

    /// A receive that gets a message leaves that pipe's reader awake: a second message queued
    /// behind it signals nothing, even when the runtime never saw the first one's signal.
    #[tokio::test]
    async fn a_message_behind_one_taken_without_waiting_is_received() {
        let ctx = ZmqContext::new(64).unwrap();
        let (mut router, mut dealer, id) = asked(&ctx).await;
        nothing_yet(&mut dealer);
        for part in [b"one", b"two"] {
            router.send_multipart(&[&id, part]).await.unwrap();
        }
        wait_readable(dealer.fd.as_raw_fd());
        assert_eq!(
            dealer.try_recv_multipart().unwrap(),
            Some(vec![b"one".to_vec()])
        );
        let got = recv_within(&mut dealer, "the second message is received").await;
        assert_eq!(got, vec![b"two".to_vec()]);
    }

    /// CPU time this thread has used (getrusage(2), RUSAGE_THREAD).
    fn thread_cpu() -> Duration {
        // SAFETY: an all-zero rusage is valid, and getrusage only writes into it.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is a valid rusage the call writes into.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
        let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
        tv(u.ru_utime) + tv(u.ru_stime)
    }

    /// A send that stays refused although `ZMQ_EVENTS` says the socket can send (a ROUTER with
    /// ROUTER_MANDATORY reports POLLOUT when any peer's pipe has room, and refuses a message
    /// for the one whose pipe is full) waits for the next signal instead of retrying on the
    /// thread (tokio's budget makes such a loop yield now and then, so it shows as CPU burnt
    /// while nothing can change, not as a hang).
    #[test]
    fn a_send_refused_despite_pollout_waits_instead_of_spinning() {
        let (tx, rx) = std::sync::mpsc::channel();
        // A thread of its own, so that its CPU time is the wait's alone.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let ctx = ZmqContext::new(64).unwrap();
                let router = ctx.socket(zmq::ROUTER).unwrap();
                router.set_router_mandatory(true).unwrap();
                router.set_sndhwm(1).unwrap();
                router.bind("inproc://mandatory").unwrap();
                let mut dealers = Vec::new();
                for id in [b"full", b"free"] {
                    let d = ctx.socket(zmq::DEALER).unwrap();
                    d.set_identity(id).unwrap();
                    d.set_rcvhwm(1).unwrap();
                    d.connect("inproc://mandatory").unwrap();
                    dealers.push(d); // never read
                }
                let mut router = AsyncSocket::new(router).unwrap();
                // The peers' pipes reached the ROUTER as commands: its fd is readable, and the
                // runtime knows it (readiness stays set until cleared).
                let _ = router.fd.readable().await.unwrap();
                // Fill the pipe to "full" until the ROUTER refuses.
                let mut refused = false;
                for _ in 0..1000 {
                    match router
                        .socket()
                        .send_multipart([&b"full"[..], b"x"], zmq::DONTWAIT)
                    {
                        Ok(()) => {}
                        Err(zmq::Error::EAGAIN) => {
                            refused = true;
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                assert!(refused, "the pipe to `full` fills up");
                let events = router.socket().get_events().unwrap();
                assert!(events.contains(zmq::POLLOUT), "`free` still has room");
                let wait = router.send_multipart(&[b"full", b"more"]);
                let cpu = thread_cpu();
                let r = tokio::time::timeout(Duration::from_millis(300), wait).await;
                tx.send((r.is_err(), thread_cpu() - cpu)).unwrap();
            });
        });
        let (waited, cpu) = rx.recv_timeout(SAFETY).expect("the wait ends");
        assert!(waited, "nothing made room for the refused message");
        // A retrying loop burns most of the 300 ms; waiting costs next to nothing. (A starved
        // thread could hide a loop, never fail a wait.)
        assert!(
            cpu < Duration::from_millis(100),
            "{cpu:?} of CPU while waiting"
        );
    }

    /// `recv_if_signalled` sees readiness the runtime has, even when the task has spent its
    /// cooperative budget (tokio then answers "not ready" to budgeted polls).
    #[tokio::test]
    async fn a_signalled_message_is_seen_by_a_task_out_of_budget() {
        let ctx = ZmqContext::new(64).unwrap();
        let (mut a, mut b) = inproc_pair(&ctx, "out-of-budget");
        nothing_yet(&mut b); // primed
        a.send_multipart(&[b"x"]).await.unwrap();
        let _ = b.fd.readable().await.unwrap(); // the runtime has the signal
                                                // Spend the budget without yielding: budgeted polls of a ready channel until refused.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..1000 {
            tx.send(i).unwrap();
        }
        while rx.recv().now_or_never().is_some() {}
        assert!(!rx.is_empty(), "the budget ran out before the channel did");
        assert_eq!(b.recv_if_signalled().unwrap(), Some(vec![b"x".to_vec()]));
    }
}
