//! Tests of the ZMQ transport: the socket pool, channels and monitor events.

#![forbid(unsafe_code)]

use super::*;

const SAFETY: Duration = Duration::from_secs(20);

/// An endpoint libzmq cannot take is refused as not dialled (nothing sent), not a panic in
/// the `zmq` crate's C-string conversion.
#[test]
fn a_nul_in_the_address_is_refused_not_dialled() {
    let t = ZmqTransport::default();
    match t.open(&PeerId::new("tcp://127.0.0.1:1\0x")) {
        Err(TransportError::BadAddress { reason, .. }) => assert!(reason.contains("NUL")),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("dialled"),
    }
}

/// A pull's DEALER holds small engine buffers ([`ENGINE_BATCH`]): each pull in flight
/// holds one, and libzmq's 8 KiB defaults were most of its memory.
#[tokio::test]
async fn a_pulls_dealer_has_small_engine_buffers() {
    let t = ZmqTransport::default();
    let (_router, addr) = p_router(&t);
    let mut ch = t.open(&PeerId::new(&addr)).unwrap();
    let batch = super::super::zmq_context::engine_batch(ch.dealer.socket_mut());
    assert_eq!(batch, Some(ENGINE_BATCH));
}

/// P's side: a ROUTER on loopback, on `t`'s context, and its address.
fn p_router(t: &ZmqTransport) -> (AsyncSocket, String) {
    let router = t.context().socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    let addr = router.get_last_endpoint().unwrap().unwrap();
    (AsyncSocket::new(router).unwrap(), addr)
}

/// A DEALER can outlive its pull's channel in libzmq's reaper (`zmq_close` is
/// asynchronous) and report connection events after the channel's monitor reader is gone.
/// libzmq sends them blocking from the context's I/O thread, so one such event wedged every
/// socket of the context (`peer_dying_mid_pull_is_uncertain_then_restart_and_next_pull_works`
/// hung under load when `CONNECT_RETRIED` came after the reader closed); `Drop for Channel`
/// stops the monitor first, so none is sent. Here a pull's channel, as `open` makes it, is
/// dropped while its DEALER must outlive it for sure (a linger, and more queued than P
/// reads: it is still flushing), then P goes: the DEALER reports `DISCONNECTED`. The same
/// context must still serve a pull end to end.
#[tokio::test]
async fn a_dropped_channel_whose_dealer_outlives_it_does_not_wedge_the_transport() {
    let t = ZmqTransport::default();
    // P reads one message at a time, and stops reading after the first.
    let router = t.context().socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.set_rcvhwm(1).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    let addr = router.get_last_endpoint().unwrap().unwrap();
    let mut router = AsyncSocket::new(router).unwrap();
    let mut ch = t.open(&PeerId::new(&addr)).unwrap();
    tokio::time::timeout(SAFETY, ch.send(b"pull"))
        .await
        .expect("taken into a connection")
        .unwrap();
    let pull = tokio::time::timeout(SAFETY, router.recv_multipart())
        .await
        .expect("P has the pull")
        .unwrap();
    assert_eq!(pull[1], b"pull");
    // Queue on the DEALER until it takes no more (P's buffers are full), and give it a
    // linger: closed, it stays in the reaper to flush what P will never read.
    ch.dealer.socket().set_linger(60_000).unwrap();
    let chunk = vec![0u8; 64 << 10];
    let mut queued = 0usize;
    loop {
        match ch.dealer.socket().send(&chunk[..], zmq::DONTWAIT) {
            Ok(()) => queued += 1,
            Err(zmq::Error::EAGAIN) => break,
            Err(e) => panic!("send: {e}"),
        }
        assert!(queued < 1 << 14, "the DEALER never filled up");
    }
    drop(ch); // the real `Drop for Channel`, then the DEALER (lingering) and its reader
    drop(router); // P goes: the lingering DEALER's connection drops, an event

    // The same context still serves a pull end to end (the stream sends when polled).
    let (mut router, addr) = p_router(&t);
    let mut replies = t.pull(
        &PeerId::new(&addr),
        b"ping".to_vec(),
        CleanFinish::default(),
    );
    let p_side = async {
        let req = router.recv_multipart().await.unwrap();
        assert_eq!(req[1], b"ping");
        router
            .send_multipart(&[req[0].as_slice(), b"pong"])
            .await
            .unwrap();
    };
    let Ok((_, reply)) =
        tokio::time::timeout(SAFETY, futures::future::join(p_side, replies.next())).await
    else {
        // A wedged I/O thread never lets the context terminate: leave it, fail.
        std::mem::forget(replies);
        std::mem::forget(router);
        std::mem::forget(t);
        panic!("the pull was never answered: the context's I/O thread is wedged");
    };
    let reply = reply.expect("one item").expect("a reply, not an error");
    assert_eq!(reply, vec![b"pong".to_vec()]);
}

/// One pull on `t` answered by `router` with one FINISH, received: the routing identity it
/// came from (one per connection), the stream (still open) and its `CleanFinish` (unset).
async fn answered_pull(
    t: &ZmqTransport,
    router: &mut AsyncSocket,
    addr: &str,
) -> (Vec<u8>, ReplyStream, CleanFinish) {
    let finish = CleanFinish::default();
    let mut replies = t.pull(&PeerId::new(addr), b"pull".to_vec(), finish.clone());
    let p_side = async {
        let req = router.recv_multipart().await.unwrap();
        router
            .send_multipart(&[req[0].as_slice(), b"FINISH"])
            .await
            .unwrap();
        req[0].clone()
    };
    let (identity, reply) =
        tokio::time::timeout(SAFETY, futures::future::join(p_side, replies.next()))
            .await
            .expect("answered");
    assert!(matches!(reply, Some(Ok(_))), "{reply:?}");
    (identity, replies, finish)
}

/// [`answered_pull`] then `finish` set, as the Peer sets it after FINISH, and the stream
/// dropped; returns the routing identity.
async fn one_pull(t: &ZmqTransport, router: &mut AsyncSocket, addr: &str) -> Vec<u8> {
    let (identity, replies, finish) = answered_pull(t, router, addr).await;
    finish.set();
    drop(replies);
    identity
}

/// Channels that come back together (a burst of FINISHes) are kept for the next burst of
/// pulls, as many as were lent at once, although more than `idle_per_peer`: none is
/// closed and opened again. (Capped at `idle_per_peer`, 6 of these 10 were.)
#[tokio::test]
async fn a_burst_of_returned_channels_is_kept_for_the_next_burst() {
    let t = ZmqTransport::new(ZmqTransportConfig {
        idle_per_peer: 4,
        ..ZmqTransportConfig::default()
    });
    let (mut router, addr) = p_router(&t);
    let mut first = Vec::new();
    for _ in 0..10 {
        first.push(answered_pull(&t, &mut router, &addr).await);
    }
    let identities: std::collections::HashSet<Vec<u8>> =
        first.iter().map(|(id, ..)| id.clone()).collect();
    assert_eq!(identities.len(), 10, "ten connections at once");
    for (_, replies, finish) in first {
        finish.set();
        drop(replies);
    }
    let mut second = Vec::new();
    for _ in 0..10 {
        second.push(answered_pull(&t, &mut router, &addr).await);
    }
    for (id, ..) in &second {
        assert!(
            identities.contains(id),
            "a pooled connection carried every pull"
        );
    }
}

/// Once the Peer marked the pull's FINISH, the stream ends at once: it does not wait on the
/// socket for a reply that cannot come (P sends nothing after FINISH), and the channel is
/// pooled for the next pull.
#[tokio::test]
async fn the_stream_ends_once_the_finish_is_marked() {
    let t = ZmqTransport::default();
    let (mut router, addr) = p_router(&t);
    let (_, mut replies, finish) = answered_pull(&t, &mut router, &addr).await;
    finish.set();
    let end = tokio::time::timeout(SAFETY, replies.next())
        .await
        .expect("the stream ends without another message from P");
    assert!(end.is_none(), "{end:?}");
    drop(replies);
    assert_eq!(
        t.pool
            .idle
            .borrow()
            .get(&PeerId::new(&addr))
            .map_or(0, Vec::len),
        1,
        "the channel is pooled"
    );
}

/// A pooled DEALER that received a message while idle (no pull was waiting for it) is
/// closed when taken, not handed to the next pull, which would read it as its own reply.
#[tokio::test]
async fn a_message_on_an_idle_socket_closes_it() {
    let t = ZmqTransport::default();
    let (mut router, addr) = p_router(&t);

    let first = one_pull(&t, &mut router, &addr).await;
    assert_eq!(
        one_pull(&t, &mut router, &addr).await,
        first,
        "a clean pull's DEALER is reused"
    );
    // P answers again, for no pull; wait until D's idle DEALER has it queued.
    router
        .send_multipart(&[first.as_slice(), b"stray"])
        .await
        .unwrap();
    let queued = async {
        loop {
            let ready = t
                .pool
                .idle
                .borrow_mut()
                .get_mut(&PeerId::new(&addr))
                .is_some_and(|l| {
                    l.iter_mut().any(|i| {
                        i.ch.dealer
                            .socket()
                            .get_events()
                            .is_ok_and(|e| e.contains(zmq::POLLIN))
                    })
                });
            if ready {
                break;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(SAFETY, queued)
        .await
        .expect("the stray message reaches D");
    assert_ne!(
        one_pull(&t, &mut router, &addr).await,
        first,
        "the DEALER with a stray message was closed; a new connection carried the pull"
    );
}

/// Once its request is taken, a pull's channel holds its DEALER alone (the monitor's two
/// sockets and their inproc pipes were a third of a held pull's memory, docs/PERFORMANCE.md),
/// and it still sees P go mid-pull: the connection's loss fails the pull as the monitor's
/// `DISCONNECTED` did, not the pull's deadline.
#[tokio::test]
async fn a_held_pull_keeps_no_monitor_and_still_sees_its_peer_go() {
    let t = ZmqTransport::default();
    let (mut router, addr) = p_router(&t);
    let mut ch = t.open(&PeerId::new(&addr)).unwrap();
    tokio::time::timeout(SAFETY, ch.send(b"pull"))
        .await
        .expect("taken into a connection")
        .unwrap();
    assert!(
        ch.monitor.is_none(),
        "the monitor is closed once the request is taken"
    );
    let pull = tokio::time::timeout(SAFETY, router.recv_multipart())
        .await
        .expect("P has the pull")
        .unwrap();
    router
        .send_multipart(&[pull[0].as_slice(), b"CONTINUE"])
        .await
        .unwrap();
    match tokio::time::timeout(SAFETY, ch.next())
        .await
        .expect("a reply")
    {
        Step::Reply(f) => assert_eq!(f, vec![b"CONTINUE".to_vec()]),
        Step::Fail(e) => panic!("{e}"),
    }
    drop(router); // P goes with the pull half answered
    match tokio::time::timeout(SAFETY, ch.next())
        .await
        .expect("the loss is seen while the pull waits")
    {
        Step::Fail(TransportError::Recv { reason, .. }) => {
            assert!(reason.contains("connection lost"), "{reason}")
        }
        Step::Fail(e) => panic!("{e}"),
        Step::Reply(f) => panic!("{f:?}"),
    }
}

/// A pooled DEALER carries no monitor; one whose P went away while it was idle is closed when
/// taken, not used: the pull gets a new DEALER, whose refused connect fails it as never sent.
#[tokio::test]
async fn a_pooled_dealer_whose_peer_went_is_closed_when_taken() {
    let t = ZmqTransport::default();
    let (mut router, addr) = p_router(&t);
    one_pull(&t, &mut router, &addr).await;
    drop(router);
    let peer = PeerId::new(&addr);
    let lost = async {
        loop {
            let gone = t.pool.idle.borrow_mut().get_mut(&peer).is_some_and(|l| {
                l.iter_mut().all(|i| {
                    i.ch.monitor.is_none()
                        && i.ch
                            .dealer
                            .socket()
                            .get_events()
                            .is_ok_and(|e| !e.contains(zmq::POLLOUT))
                })
            });
            if gone {
                break;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(SAFETY, lost)
        .await
        .expect("the idle DEALER loses its connection");
    let mut replies = t.pull(&peer, b"pull".to_vec(), CleanFinish::default());
    match tokio::time::timeout(SAFETY, replies.next())
        .await
        .expect("the pull fails")
    {
        Some(Err(TransportError::Connect { reason, .. })) => {
            assert!(reason.contains("refused"), "a new DEALER dialled: {reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(t.pool.idle.borrow().get(&peer).is_none_or(|l| l.is_empty()));
}

/// A P that sends to an idle DEALER (here 8 messages of 1 MiB; a hostile one filled GBs this
/// way) gets that DEALER closed by the Receiver's sweep, with no pull to take it: libzmq holds
/// what is queued until the socket closes. A healthy idle DEALER stays for the next pull.
#[tokio::test]
async fn the_sweep_closes_an_idle_dealer_its_peer_sent_to_and_keeps_a_healthy_one() {
    let t = ZmqTransport::default();
    let (mut hostile, hostile_addr) = p_router(&t);
    let (mut healthy, healthy_addr) = p_router(&t);
    let identity = one_pull(&t, &mut hostile, &hostile_addr).await;
    one_pull(&t, &mut healthy, &healthy_addr).await;
    let junk = vec![0u8; 1 << 20];
    for _ in 0..8 {
        hostile
            .send_multipart(&[identity.as_slice(), junk.as_slice()])
            .await
            .unwrap();
    }
    let (hostile_peer, healthy_peer) = (PeerId::new(&hostile_addr), PeerId::new(&healthy_addr));
    let queued = async {
        while !t.pool.idle.borrow_mut().get_mut(&hostile_peer).is_some_and(|l| {
            l.iter_mut().all(|i| {
                i.ch.dealer
                    .socket()
                    .get_events()
                    .is_ok_and(|e| e.contains(zmq::POLLIN))
            })
        }) {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(SAFETY, queued)
        .await
        .expect("the junk reaches the idle DEALER");
    let idle = |peer: &PeerId| t.pool.idle.borrow().get(peer).map_or(0, Vec::len);
    assert_eq!((idle(&hostile_peer), idle(&healthy_peer)), (1, 1));
    t.sweep_idle();
    assert_eq!(
        (idle(&hostile_peer), idle(&healthy_peer)),
        (0, 1),
        "the DEALER holding junk is closed, the healthy one kept"
    );
}
