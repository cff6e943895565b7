//! Where actors publish [`KvEvent`]s for observers (`kvrecv serve`, the demo, tests).

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::messages::KvEvent;

/// A cheap clonable handle; with no observer attached, events are dropped at no cost. The
/// channel is unbounded because an observer must never slow the receive path down; observers
/// are expected to keep up (they only print or count).
#[derive(Clone, Default)]
pub struct EventSink(Option<UnboundedSender<KvEvent>>);

impl EventSink {
    /// A sink and the receiving end an observer reads.
    pub fn channel() -> (Self, UnboundedReceiver<KvEvent>) {
        let (tx, rx) = unbounded_channel();
        (EventSink(Some(tx)), rx)
    }

    /// A sink that drops every event (no observer attached).
    pub fn none() -> Self {
        EventSink(None)
    }

    /// Whether an observer is attached (so an event is worth building).
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Hand `ev` to the observer, if any; never blocks an actor.
    pub fn emit(&self, ev: KvEvent) {
        if let Some(tx) = &self.0 {
            let _ = tx.send(ev);
        }
    }
}
