//! State parties of one D worker reach without a message: a value behind a mutex, held only to
//! read or change it, never across an await or a send. Two tables are shared this way, because
//! the host's drain reaches them from its own thread: the ledger's outbox (the BlockManager
//! appends, the drain takes) and the live set (the Receiver admits, the BlockManager releases
//! blocks, the drain hands requests over) (DESIGN.md §3). Two more are shared between actors of
//! the worker's one thread, as `Rc<RefCell<_>>` rather than through this type: the aggregation
//! table (`aggregation_table`: the Receiver registers, the RequestAggregator settles) and the
//! layout acks (`layout_acks`: the Peers write, the Receiver reads). Four in all.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};

/// A value two parties share. [`Shared::share`] hands out another reference to the same value;
/// `clone` copies it (the model checker clones a ledger to explore from it, and the copy must
/// not share its state with the original).
#[derive(Debug, Default)]
pub struct Shared<T>(Arc<Mutex<T>>);

impl<T> Shared<T> {
    /// A value shared from now on.
    pub fn new(value: T) -> Self {
        Shared(Arc::new(Mutex::new(value)))
    }

    /// Another reference to this value.
    pub fn share(&self) -> Shared<T> {
        Shared(Arc::clone(&self.0))
    }

    /// The value, locked.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        // Every change made under this lock is a few inserts, removes or pushes that a panic
        // cannot leave half-made, so a poisoned lock's contents are still whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T: Clone> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared::new(self.lock().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_references_see_one_value_and_a_clone_is_its_own() {
        let a = Shared::new(vec![1]);
        let b = a.share();
        let copy = a.clone();
        a.lock().push(2);
        assert_eq!(*b.lock(), vec![1, 2], "a shared reference sees the change");
        assert_eq!(
            *copy.lock(),
            vec![1],
            "the clone kept what it copied and saw nothing later"
        );
    }
}
