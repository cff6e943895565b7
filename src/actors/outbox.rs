//! What the BlockManager has ready for the host's next drain, in one place both can reach: the
//! BlockManager appends as completions and failures happen, the host takes it all at its drain
//! without a message round trip (DESIGN.md §7).

use std::sync::{Arc, Mutex, MutexGuard};

use crate::messages::StepOutput;

/// The step output not yet drained. [`Outbox::share`] hands out another reference to the same
/// output; `clone` copies it (the model checker clones a ledger to explore from it, and the
/// copy must not share its output with the original).
#[derive(Debug, Default)]
pub struct Outbox(Arc<Mutex<StepOutput>>);

impl Outbox {
    /// Another reference to this output (the host's drain side).
    pub fn share(&self) -> Outbox {
        Outbox(Arc::clone(&self.0))
    }

    /// The output, locked. Held only to append or take: never across an await or a send.
    pub fn lock(&self) -> MutexGuard<'_, StepOutput> {
        // Nothing in the output can be left half-changed by a panic (pushes and a take), so
        // a poisoned lock's contents are still whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Everything ready since the last take, in the order it became ready.
    pub fn take(&self) -> StepOutput {
        std::mem::take(&mut *self.lock())
    }
}

impl Clone for Outbox {
    fn clone(&self) -> Self {
        Outbox(Arc::new(Mutex::new(self.lock().clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::ReqId;

    #[test]
    fn shared_references_see_one_output_and_a_clone_is_its_own() {
        let a = Outbox::default();
        let host = a.share();
        a.lock().finished_recving.push(ReqId::from("r1"));
        let copy = a.clone();
        a.lock().invalid_block_ids.push(7);
        let taken = host.take();
        assert_eq!(taken.finished_recving, vec![ReqId::from("r1")]);
        assert_eq!(taken.invalid_block_ids, vec![7]);
        assert!(a.lock().is_empty(), "the take emptied the shared output");
        assert_eq!(
            copy.take().finished_recving,
            vec![ReqId::from("r1")],
            "the clone kept what it copied and saw nothing later"
        );
    }
}
