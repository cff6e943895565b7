//! A timer that tells an actor when it fires, from a task of its own.
//!
//! actix polls every item of an actor's context at each of the actor's turns, and a timer made
//! with `run_later` is such an item: at every turn it registered its waker with the timer wheel
//! again (a few atomic operations and ~150 instructions per turn; a Peer and the Receiver each
//! kept one, 1.5% of a request at batch 1, docs/PERFORMANCE.md). An alarm's task is polled
//! when it is made and when it fires, and the actor hears of it as a message.

#![forbid(unsafe_code)]

use actix::{Message, WeakRecipient};

/// Sends one message at an instant, unless dropped first (dropping it cancels it).
pub struct Alarm {
    at: tokio::time::Instant,
    task: tokio::task::JoinHandle<()>,
}

impl Alarm {
    /// Send `msg` to `to` at `at` (at once if `at` has passed), if the actor is still there:
    /// the address is weak, so a pending alarm does not keep its actor alive (an actor whose
    /// addresses are all dropped stops, as it would without one). `None` outside a runtime: a
    /// system dropped without being stopped polls its actors once more from their drop, where
    /// no timer can be made (and none would ever fire).
    pub fn set<M>(to: WeakRecipient<M>, at: tokio::time::Instant, msg: M) -> Option<Self>
    where
        M: Message<Result = ()> + Send + 'static,
    {
        tokio::runtime::Handle::try_current().ok()?;
        let task = actix::spawn(async move {
            tokio::time::sleep_until(at).await;
            if let Some(to) = to.upgrade() {
                to.do_send(msg);
            }
        });
        Some(Alarm { at, task })
    }

    /// When it fires.
    pub fn at(&self) -> tokio::time::Instant {
        self.at
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix::{Actor, Context, Handler};
    use std::time::Duration;

    #[derive(Message)]
    #[rtype(result = "()")]
    struct Ring(u32);

    /// Records the rings it hears and stops the system at the second.
    struct Bell(Vec<u32>, tokio::sync::mpsc::UnboundedSender<u32>);
    impl Actor for Bell {
        type Context = Context<Self>;
    }
    impl Handler<Ring> for Bell {
        type Result = ();
        fn handle(&mut self, r: Ring, _: &mut Context<Self>) {
            self.0.push(r.0);
            let _ = self.1.send(r.0);
        }
    }

    /// An alarm rings at its instant, not before; one dropped before then never rings.
    #[actix::test]
    async fn rings_at_its_instant_unless_dropped() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let bell = Bell(Vec::new(), tx).start();
        let t0 = tokio::time::Instant::now();
        let early = t0 + Duration::from_millis(20);
        let dropped = Alarm::set(weak(&bell), early, Ring(1)).expect("in a runtime");
        let at = t0 + Duration::from_millis(40);
        let kept = Alarm::set(weak(&bell), at, Ring(2)).expect("in a runtime");
        assert_eq!(kept.at(), at);
        drop(dropped);
        // The dropped one was due first: had it rung, its ring would come first.
        assert_eq!(rx.recv().await, Some(2));
        assert!(tokio::time::Instant::now() >= at);
    }

    /// Outside a runtime no alarm is made (and nothing panics).
    #[test]
    fn outside_a_runtime_there_is_none() {
        let sys = actix::System::new();
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let bell = sys.block_on(async { Bell(Vec::new(), tx).start() });
        assert!(Alarm::set(weak(&bell), tokio::time::Instant::now(), Ring(0)).is_none());
    }

    fn weak<A: Actor<Context = Context<A>> + Handler<Ring>>(
        a: &actix::Addr<A>,
    ) -> WeakRecipient<Ring> {
        a.downgrade().recipient()
    }

    /// Tells when it stops.
    struct Watched(Option<tokio::sync::oneshot::Sender<()>>);
    impl Actor for Watched {
        type Context = Context<Self>;
        fn stopped(&mut self, _: &mut Context<Self>) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    impl Handler<Ring> for Watched {
        type Result = ();
        fn handle(&mut self, _: Ring, _: &mut Context<Self>) {}
    }

    /// A pending alarm does not keep its actor alive: with every address dropped, the actor
    /// stops although its alarm is an hour away.
    #[actix::test]
    async fn a_pending_alarm_keeps_no_actor_alive() {
        let (tx, stopped) = tokio::sync::oneshot::channel();
        let addr = Watched(Some(tx)).start();
        let at = tokio::time::Instant::now() + Duration::from_secs(3600);
        let _alarm = Alarm::set(weak(&addr), at, Ring(0)).expect("in a runtime");
        drop(addr);
        // Bounded, so that an alarm that kept it alive fails here instead of hanging.
        tokio::time::timeout(Duration::from_secs(10), stopped)
            .await
            .expect("the actor stopped, its alarm pending")
            .expect("it said so");
    }
}
