//! Where actors publish [`KvEvent`]s for observers (`kvrecv serve`, the demo, tests).

#![forbid(unsafe_code)]

use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::messages::KvEvent;

/// A cheap clonable handle; with no observer attached, events are dropped at no cost. The
/// channel is unbounded because an observer must never slow the receive path down; observers
/// are expected to keep up (they only print or count).
#[derive(Clone, Default)]
pub struct EventSink {
    tx: Option<Tx>,
    /// The observer takes completions only: the other events are not even built.
    completions_only: bool,
}

#[derive(Clone)]
enum Tx {
    Plain(UnboundedSender<KvEvent>),
    Stamped(UnboundedSender<(Instant, KvEvent)>),
}

impl EventSink {
    /// A sink and the receiving end an observer reads.
    pub fn channel() -> (Self, UnboundedReceiver<KvEvent>) {
        let (tx, rx) = unbounded_channel();
        (
            EventSink {
                tx: Some(Tx::Plain(tx)),
                completions_only: false,
            },
            rx,
        )
    }

    /// A sink whose events come with the instant they were emitted, for measuring the
    /// coordinator's own latencies apart from the observer's scheduling (`kvrecv bench`: from a
    /// request's last settle to its completion). `completions_only` as
    /// [`EventSink::completions_channel`].
    pub fn stamped_channel(
        completions_only: bool,
    ) -> (Self, UnboundedReceiver<(Instant, KvEvent)>) {
        let (tx, rx) = unbounded_channel();
        (
            EventSink {
                tx: Some(Tx::Stamped(tx)),
                completions_only,
            },
            rx,
        )
    }

    /// A sink for an observer that reads only [`KvEvent::Completion`]s (`serve --events
    /// completions`): every other event is skipped where it would be built.
    pub fn completions_channel() -> (Self, UnboundedReceiver<KvEvent>) {
        let (mut sink, rx) = Self::channel();
        sink.completions_only = true;
        (sink, rx)
    }

    /// A sink that drops every event (no observer attached).
    pub fn none() -> Self {
        EventSink::default()
    }

    /// Whether an observer is attached (so a completion is worth building).
    pub fn is_on(&self) -> bool {
        self.tx.is_some()
    }

    /// Whether the observer wants the events other than completions (settles, failures,
    /// releases, quarantines), so they are worth building.
    pub fn wants_detail(&self) -> bool {
        self.tx.is_some() && !self.completions_only
    }

    /// Hand `ev` to the observer, if any and if it wants that kind; never blocks an actor.
    pub fn emit(&self, ev: KvEvent) {
        if let Some(tx) = &self.tx {
            if self.completions_only && !matches!(ev, KvEvent::Completion { .. }) {
                return;
            }
            match tx {
                Tx::Plain(tx) => {
                    let _ = tx.send(ev);
                }
                Tx::Stamped(tx) => {
                    let _ = tx.send((Instant::now(), ev));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{Outcome, PeerId};

    /// A detail event, then a completion.
    fn emit_restart_then_completion(sink: &EventSink) {
        sink.emit(KvEvent::PeerRestarted {
            peer: PeerId::new("tcp://p:1"),
            restarts: 1,
        });
        sink.emit(KvEvent::Completion {
            req_id: "r".into(),
            outcome: Outcome::Ok,
            uncertain_peers: vec![],
            unsettled_peers: vec![],
        });
    }

    #[test]
    fn a_completions_only_sink_passes_completions_and_nothing_else() {
        let (sink, mut rx) = EventSink::completions_channel();
        assert!(sink.is_on() && !sink.wants_detail());
        emit_restart_then_completion(&sink);
        assert!(matches!(rx.try_recv(), Ok(KvEvent::Completion { .. })));
        assert!(rx.try_recv().is_err());
        let (all, _rx) = EventSink::channel();
        assert!(all.wants_detail());
        assert!(!EventSink::none().is_on());
    }

    /// A stamped sink carries the instant of emission (not of reading), and keeps the
    /// completions-only filter.
    #[test]
    fn a_stamped_sink_stamps_at_emission() {
        let (sink, mut rx) = EventSink::stamped_channel(true);
        assert!(sink.is_on() && !sink.wants_detail());
        let before = Instant::now();
        emit_restart_then_completion(&sink);
        let after = Instant::now();
        let (at, ev) = rx.try_recv().expect("the completion");
        assert!(matches!(ev, KvEvent::Completion { .. }));
        assert!(
            before <= at && at <= after,
            "stamped when emitted, not when read"
        );
        assert!(rx.try_recv().is_err(), "the other event was filtered");
    }
}
