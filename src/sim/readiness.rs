//! When a P request is "prefilled": P serves a pull only for requests it has finished
//! (PROTOCOL.md §2.6 step 2). Tests and drivers mark transfer ids ready, or make everything ready
//! at once.

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::sync::Mutex;

use tokio::sync::watch;

/// Shared by every worker of one simulated engine.
pub struct Readiness {
    ready: Mutex<HashSet<String>>,
    all: std::sync::atomic::AtomicBool,
    changed: watch::Sender<u64>,
}

impl Readiness {
    /// `immediately`: every transfer id is ready as soon as it is pulled.
    pub fn new(immediately: bool) -> Self {
        Readiness {
            ready: Mutex::new(HashSet::new()),
            all: immediately.into(),
            changed: watch::channel(0).0,
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Mark one transfer id prefilled.
    pub fn mark(&self, transfer_id: &str) {
        self.ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(transfer_id.to_owned());
        self.bump();
    }

    /// Make every transfer id ready (or stop doing so).
    pub fn set_all(&self, all: bool) {
        self.all.store(all, std::sync::atomic::Ordering::SeqCst);
        self.bump();
    }

    pub fn is_ready(&self, transfer_id: &str) -> bool {
        self.all.load(std::sync::atomic::Ordering::SeqCst)
            || self
                .ready
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(transfer_id)
    }

    /// Subscribe before checking, then await `changed()`: no mark is missed in between.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}
