//! The reply streams of all of one Peer's live pulls, merged into the single stream the actor
//! handles.
//!
//! An actix context polls every one of its items each time the actor is woken. With one item
//! per pull, a reply on one pull made the Peer poll the sockets of every other live pull too
//! (at 64 pulls in flight, 64 futile receives per reply), and a burst of replies kept the
//! thread in one Peer for long enough to delay every settle behind it. Merged here, only the
//! pulls whose sockets woke are polled (the merge keeps a waker per stream), and the Peer has
//! one item however many pulls are live. The merge is `futures`' `SelectAll` (`futures_buffered`'s
//! reused slots saved 2.3% of the instructions per request at batch 1, `scripts/callgrind-core`:
//! under the complexity budget, DESIGN.md §10). Each item
//! comes tagged with its pull, and a stream that ends by itself says so once
//! ([`Tagged::item`] `None`): the Peer's pull is then over without a reply, which it must
//! learn; one ended through its [`PullHandle`] says nothing.

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use futures::stream::LocalBoxStream;
use futures::stream::SelectAll;
use futures::{Stream, StreamExt};

use crate::messages::PullId;

/// An item of one merged stream, or its end (`None`), with the stream's pull.
#[derive(Debug, PartialEq, Eq)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct Tagged<I> {
    /// The pull whose stream it came from.
    pub pull_id: PullId,
    /// The item; `None` once, when the stream ended by itself.
    pub item: Option<I>,
}

/// One merged stream, which its [`PullHandle`] can end at once.
struct Slot<T> {
    /// Whose stream it is: a handle ends only its own pull's (slots are reused).
    pull_id: PullId,
    stream: Option<LocalBoxStream<'static, T>>,
    /// Who polls this stream while it is parked (its last poll was `Pending`), woken when it
    /// is ended so the merge drops the empty slot. A stream that just yielded is polled again
    /// anyway (the merge queues it at once), so it keeps none: ending it then, as a Peer does
    /// after a reply that finishes its pull, wakes nobody.
    waker: Option<Waker>,
}

/// Every merged stream's slot, reused from one pull to the next (a pull allocates none).
type Slots<T> = Rc<RefCell<slab::Slab<Slot<T>>>>;

/// Ends one merged stream.
pub struct PullHandle<T> {
    slots: Slots<T>,
    key: usize,
    pull_id: PullId,
}

impl<T> PullHandle<T> {
    /// Drop the stream now, and its channel with it: a channel marked reusable is back in the
    /// pool before the next pull asks for one. It yields nothing more.
    pub fn end(&self) {
        let (stream, waker) = {
            let mut slots = self.slots.borrow_mut();
            match slots.get_mut(self.key) {
                Some(slot) if slot.pull_id == self.pull_id => {
                    (slot.stream.take(), slot.waker.take())
                }
                // Already dropped by the merge (it ended by itself), maybe reused since.
                _ => (None, None),
            }
        };
        drop(stream);
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The merge's view of a slot; its slot is freed when the merge drops it.
struct Slotted<T> {
    slots: Slots<T>,
    key: usize,
}

impl<T> Drop for Slotted<T> {
    fn drop(&mut self) {
        // The merge drops an ended stream's entry after that stream's poll, when the slab is
        // not borrowed; a failed borrow would only leave an empty slot behind.
        if let Ok(mut slots) = self.slots.try_borrow_mut() {
            slots.try_remove(self.key);
        }
    }
}

impl<T> Stream for Slotted<T> {
    type Item = Tagged<T>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Tagged<T>>> {
        let mut slots = self.slots.borrow_mut();
        let slot = &mut slots[self.key];
        let pull_id = slot.pull_id;
        let Some(stream) = slot.stream.as_mut() else {
            return Poll::Ready(None);
        };
        match stream.poll_next_unpin(cx) {
            Poll::Ready(item) => {
                slot.waker = None;
                if item.is_none() {
                    // Said once; the merge drops the slot at its next poll.
                    slot.stream = None;
                }
                Poll::Ready(Some(Tagged { pull_id, item }))
            }
            Poll::Pending => {
                if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    slot.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

struct Inner<T> {
    streams: SelectAll<Slotted<T>>,
    slots: Slots<T>,
}

/// Adds streams to a [`MergedPulls`]; each added stream can be stopped on its own.
pub struct PullMux<T> {
    inner: Rc<RefCell<Inner<T>>>,
}

/// The merged stream. It never ends: with nothing to poll it waits for the next stream.
pub struct MergedPulls<T> {
    inner: Rc<RefCell<Inner<T>>>,
    /// Items yielded since the task last gave the thread up.
    run: usize,
}

/// Items yielded in a row before the merged stream gives the thread up (it wakes its own task
/// and returns `Pending`, so the actor goes to the back of the queue): each item makes
/// settles, and the aggregator that turns them into completions runs only when the Peer
/// lets go of the thread. actix's own limit is 16 items per stream.
pub const ITEMS_PER_TURN: usize = 2;

impl<T> PullMux<T> {
    /// A mux and the stream that yields the items of everything added to it.
    pub fn new() -> (Self, MergedPulls<T>) {
        let inner = Rc::new(RefCell::new(Inner {
            streams: SelectAll::new(),
            slots: Rc::default(),
        }));
        (
            PullMux {
                inner: inner.clone(),
            },
            MergedPulls { inner, run: 0 },
        )
    }

    /// Merge `stream`, pull `pull_id`'s, in; the handle ends it. The merged stream polls it at
    /// its own next poll, and nothing is woken for it: the caller is the task that polls the
    /// merged stream, in a turn that polls it next (a Peer adds from its `Pull` handler, and
    /// actix polls an actor's items after its mailbox in the same turn). A wake would only
    /// poll that task once more for nothing: once per pull, 3% of a request at batch 1
    /// (docs/PERFORMANCE.md, tenth round).
    pub fn add(&self, pull_id: PullId, stream: LocalBoxStream<'static, T>) -> PullHandle<T> {
        let mut inner = self.inner.borrow_mut();
        let slots = inner.slots.clone();
        let key = slots.borrow_mut().insert(Slot {
            pull_id,
            stream: Some(stream),
            waker: None,
        });
        inner.streams.push(Slotted {
            slots: slots.clone(),
            key,
        });
        PullHandle {
            slots,
            key,
            pull_id,
        }
    }

    /// Streams merged (an ended one counts until the merge next polls it).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.borrow().streams.len()
    }

    /// Whether no stream is merged.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Stream for MergedPulls<T> {
    type Item = Tagged<T>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Tagged<T>>> {
        if self.run >= ITEMS_PER_TURN {
            self.run = 0;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let this = &mut *self;
        let mut inner = this.inner.borrow_mut();
        match inner.streams.poll_next_unpin(cx) {
            Poll::Ready(Some(item)) => {
                this.run += 1;
                Poll::Ready(Some(item))
            }
            // Empty: wait for `add` (its caller polls again), not for the end.
            Poll::Ready(None) | Poll::Pending => {
                this.run = 0;
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::task::noop_waker_ref;
    use std::cell::Cell;

    /// A stream that counts its polls and reports when it is dropped.
    struct Probe {
        polls: Rc<Cell<usize>>,
        dropped: Rc<Cell<bool>>,
        rx: futures::channel::mpsc::UnboundedReceiver<u32>,
    }
    impl Stream for Probe {
        type Item = u32;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<u32>> {
            self.polls.set(self.polls.get() + 1);
            self.rx.poll_next_unpin(cx)
        }
    }
    impl Drop for Probe {
        fn drop(&mut self) {
            self.dropped.set(true);
        }
    }

    type Tx = futures::channel::mpsc::UnboundedSender<u32>;

    /// A probe's stream, its sender, its poll count and whether it was dropped.
    type Probed = (
        LocalBoxStream<'static, u32>,
        Tx,
        Rc<Cell<usize>>,
        Rc<Cell<bool>>,
    );

    fn probe() -> Probed {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let polls = Rc::new(Cell::new(0));
        let dropped = Rc::new(Cell::new(false));
        let s = Probe {
            polls: polls.clone(),
            dropped: dropped.clone(),
            rx,
        };
        (s.boxed_local(), tx, polls, dropped)
    }

    /// An item on one stream polls that stream only: the others, whose sources did not wake,
    /// are left alone (one actor item per pull polled them all).
    #[test]
    fn only_the_stream_that_woke_is_polled() {
        let (mux, mut merged) = PullMux::new();
        let probes: Vec<_> = (0..64).map(|_| probe()).collect();
        let mut txs = Vec::new();
        let mut polls = Vec::new();
        let mut handles = Vec::new();
        for (i, (s, tx, p, _)) in probes.into_iter().enumerate() {
            handles.push(mux.add(i as PullId, s));
            txs.push(tx);
            polls.push(p);
        }
        let mut cx = Context::from_waker(noop_waker_ref());
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        let before: Vec<usize> = polls.iter().map(|p| p.get()).collect();
        assert!(before.iter().all(|&n| n == 1), "each polled once to start");
        txs[7].unbounded_send(42).unwrap();
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(item(7, 42)))
        );
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        for (i, p) in polls.iter().enumerate() {
            if i != 7 {
                assert_eq!(p.get(), 1, "stream {i} was polled without waking");
            }
        }
    }

    /// A stream ended through its handle is dropped at once and yields nothing more, even
    /// what was already queued; the others go on. One that ends by itself says so once. With
    /// every stream gone the merged stream waits (it does not end), and a stream added later
    /// is polled.
    #[test]
    fn an_ended_stream_is_dropped_at_once_and_the_merge_never_ends() {
        let (mux, mut merged) = PullMux::new();
        let (a, a_tx, _, a_dropped) = probe();
        let (b, b_tx, _, b_dropped) = probe();
        let a_handle = mux.add(1, a);
        let _b_handle = mux.add(2, b);
        let mut cx = Context::from_waker(noop_waker_ref());
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        a_tx.unbounded_send(1).unwrap();
        a_handle.end();
        assert!(a_dropped.get(), "the ended stream was dropped at once");
        b_tx.unbounded_send(2).unwrap();
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(item(2, 2)))
        );
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        assert!(!b_dropped.get());
        assert_eq!(mux.len(), 1);
        drop(b_tx); // b ends by itself
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Tagged {
                pull_id: 2,
                item: None
            })),
            "b's end, said once"
        );
        assert!(merged.poll_next_unpin(&mut cx).is_pending(), "no end");
        assert!(b_dropped.get() && mux.is_empty());
        let (c, c_tx, _, _) = probe();
        let _c_handle = mux.add(3, c);
        c_tx.unbounded_send(3).unwrap();
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(item(3, 3)))
        );
    }

    /// Slots are reused: the handle of a pull whose stream ended by itself ends nothing of
    /// the pull that took its slot since.
    #[test]
    fn a_stale_handle_leaves_the_next_pull_in_its_slot_alone() {
        let (mux, mut merged) = PullMux::<u32>::new();
        let mut cx = Context::from_waker(noop_waker_ref());
        let (a, a_tx, ..) = probe();
        let a_handle = mux.add(1, a);
        drop(a_tx);
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(Tagged {
                pull_id: 1,
                item: None
            }))
        );
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        assert!(mux.is_empty(), "a's slot is free");
        let (b, b_tx, _, b_dropped) = probe();
        let _b_handle = mux.add(2, b);
        a_handle.end();
        assert!(!b_dropped.get(), "a's handle ended b");
        b_tx.unbounded_send(5).unwrap();
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(item(2, 5)))
        );
    }

    /// A stream added is polled at the merged stream's next poll, and adding it wakes
    /// nobody (its caller polls the merged stream next): a reply already there comes out of
    /// that poll, and the task is not scheduled once more for nothing.
    #[test]
    fn a_stream_added_is_polled_at_the_next_poll_without_a_wake() {
        let (mux, mut merged) = PullMux::<u32>::new();
        let (flag, waker) = flagged();
        let mut cx = Context::from_waker(&waker);
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        let (s, tx, polls, _) = probe();
        tx.unbounded_send(7).unwrap();
        let _h = mux.add(1, s);
        assert!(
            !flag.load(std::sync::atomic::Ordering::SeqCst),
            "adding woke the task"
        );
        assert_eq!(polls.get(), 0, "not polled before the merge's next poll");
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(item(1, 7)))
        );
    }

    /// Ending a parked stream wakes the merge's task (so it drops the slot); ending one right
    /// after it yielded wakes nobody (the merge polls it again anyway), and either way the
    /// slot is gone at the merge's next poll.
    #[test]
    fn only_ending_a_parked_stream_wakes_the_merge() {
        let (mux, mut merged) = PullMux::<u32>::new();
        let (flag, waker) = flagged();
        let mut cx = Context::from_waker(&waker);
        let (a, a_tx, ..) = probe();
        let (b, _b_tx, ..) = probe();
        let (a, b) = (mux.add(1, a), mux.add(2, b));
        assert!(merged.poll_next_unpin(&mut cx).is_pending(), "both parked");
        a_tx.unbounded_send(5).unwrap();
        flag.store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            merged.poll_next_unpin(&mut cx),
            Poll::Ready(Some(item(1, 5)))
        );
        a.end();
        assert!(
            !flag.load(std::sync::atomic::Ordering::SeqCst),
            "ending a stream that just yielded woke the task"
        );
        b.end();
        assert!(
            flag.load(std::sync::atomic::Ordering::SeqCst),
            "ending a parked stream did not wake the task"
        );
        assert!(merged.poll_next_unpin(&mut cx).is_pending());
        assert!(mux.is_empty(), "both slots dropped at the next poll");
    }

    /// A burst of items is handed out ITEMS_PER_TURN at a time: then the merged stream wakes
    /// its own task and returns `Pending`, so the aggregator waiting for these settles gets
    /// the thread before the rest of the burst; nothing is lost or reordered.
    #[test]
    fn a_burst_gives_the_thread_up_between_turns() {
        let (mux, mut merged) = PullMux::new();
        let (s, tx, ..) = probe();
        let _h = mux.add(1, s);
        let n = ITEMS_PER_TURN * 3;
        for i in 0..n as u32 {
            tx.unbounded_send(i).unwrap();
        }
        let (flag, waker) = flagged();
        let mut cx = Context::from_waker(&waker);
        let mut got = Vec::new();
        let mut turns = 0;
        while got.len() < n {
            match merged.poll_next_unpin(&mut cx) {
                Poll::Ready(Some(t)) => got.extend(t.item),
                Poll::Ready(None) => unreachable!("the merged stream never ends"),
                Poll::Pending => {
                    assert!(
                        flag.swap(false, std::sync::atomic::Ordering::SeqCst),
                        "a turn ends with the task woken, not parked"
                    );
                    turns += 1;
                }
            }
        }
        assert_eq!(got, (0..n as u32).collect::<Vec<_>>());
        assert_eq!(turns, 2, "{n} items, {ITEMS_PER_TURN} per turn");
    }

    fn item(pull_id: PullId, i: u32) -> Tagged<u32> {
        Tagged {
            pull_id,
            item: Some(i),
        }
    }

    use std::sync::Arc;

    /// A waker that raises a flag, and the flag.
    fn flagged() -> (Arc<std::sync::atomic::AtomicBool>, Waker) {
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waker = futures::task::waker(Arc::new(Flag(flag.clone())));
        (flag, waker)
    }

    struct Flag(Arc<std::sync::atomic::AtomicBool>);
    impl futures::task::ArcWake for Flag {
        fn wake_by_ref(me: &Arc<Self>) {
            me.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
